"""Disaggregated prefill and decode on Dynamo: a real frontend, one prefill and one decode worker (tiny
random Llama). The decode worker imports the prefill worker's KV blocks over TCP and generates exactly what
one worker generates alone; cancellations and a killed prefill worker leave no KV block behind."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from openai import OpenAI

from backend.serving.tokenizer import load_tokenizer
from backend.dynamo.launcher import Cluster
from tests.dynamo_cluster import MODEL, post, start_cluster, wait_kv_free, worker_metric
from tests.reference import hf_greedy

PREFILL, DECODE = 0, 1  # worker indices in the launcher's order
# Dynamo's rule: prefill on the decode worker when fewer than 64 prompt tokens are new to it, and under 70 %
CONDITIONAL = '{"policy": "isl_bounding", "eff_isl_threshold": 64, "eff_isl_ratio_threshold": 0.7}'
LONG = " ".join(f"w{i % 97}" for i in range(300))  # 861 tokens of the tiny model's 1024
# ~70 tokens: 4 full blocks travel, the partial last block is recomputed on the decode worker
PROMPT = ("A long prompt that spans several KV blocks, so that the prefill worker has full blocks to hand "
          "over: the quick brown fox jumps over the lazy dog, again and again, until the story is told.")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("disagg-logs"), workers=0, prefill_workers=1,
                      decode_workers=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _remote(cluster) -> float:
    return worker_metric(cluster, DECODE, "llm_disagg_requests_total", 'prefill="remote"')


def test_disaggregated_greedy_equals_hf_and_streams_the_same(cluster, client, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    [expected] = hf_greedy(tiny_model_dir, [prompt_ids], [16])
    before = _remote(cluster)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "nvext": {"extra_fields": ["worker_id"]}})
    assert out.choices[0].text == tokenizer.decode(expected)
    assert out.usage.completion_tokens == 16
    # the decode worker took every full prompt block from the prefill worker, and computed the rest
    assert out.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // 16 * 16
    assert _remote(cluster) == before + 1
    assert worker_metric(cluster, DECODE, "llm_kv_transfer_bytes_total") > 0
    deadline = time.monotonic() + 10  # the READ's notification releases the prefill worker's buffer
    while worker_metric(cluster, PREFILL, "llm_kv_exports_pending") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_metric(cluster, PREFILL, "llm_kv_exports_pending") == 0
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == out.choices[0].text


@dataclass
class Conditional:
    """A disaggregated cluster under one of Dynamo's conditional rules."""

    cluster: Cluster
    client: OpenAI

    def count(self, path: str) -> float:
        """The decode worker's requests prefilled `remote` or `local`."""
        return worker_metric(self.cluster, DECODE, "llm_disagg_requests_total", f'prefill="{path}"')

    def complete(self, prompt: str) -> str:
        """Greedy, 8 tokens, non-streaming (see the rule's caveat in docs/dynamo.md)."""
        return self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text


@contextlib.contextmanager
def conditional_cluster(model_dir, log_dir, rule: str, worker_args: tuple[str, ...] = (),
                        timeout: float = 60) -> Iterator[Conditional]:
    cluster = start_cluster(model_dir, log_dir, worker_args, workers=0, prefill_workers=1, decode_workers=1,
                            conditional_disagg=rule)
    try:
        yield Conditional(cluster, OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0,
                                          timeout=timeout))
    finally:
        cluster.stop()


def test_the_conditional_rule_keeps_a_mostly_cached_turn_on_the_decode_worker(tiny_model_dir, tmp_path_factory):
    """Non-streaming here: on a request the rule keeps local, Dynamo 1.6's stream opens with a custom SSE event
    (`x-bypass-remote-prefill`) that the openai package cannot parse (docs/dynamo.md)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    with conditional_cluster(tiny_model_dir, tmp_path_factory.mktemp("conditional-logs"), CONDITIONAL) as c:
        answer = c.complete(PROMPT)
        assert (c.count("remote"), c.count("local")) == (1, 0)  # new to the decode worker: prefilled remotely
        second = f"{PROMPT}{answer} And then?"  # the decode worker holds all but a few of its tokens
        text = c.complete(second)
        assert (c.count("remote"), c.count("local")) == (1, 1)
    ids = tokenizer(second)["input_ids"]
    assert text == tokenizer.decode(hf_greedy(tiny_model_dir, [ids], [8])[0])


def test_the_conditional_rule_prefills_on_the_decode_worker_while_the_prefill_worker_is_busy(tiny_model_dir,
                                                                                            tmp_path_factory):
    """Dynamo's `prefill_load` policy (the design's prefill-queue condition): a request whose prefill worker has
    more prompt tokens in flight than `prefill_busy_threshold` of its `max_num_batched_tokens` (16 here, so a
    861-token prompt holds it for 54 steps) is prefilled on its decode worker instead of waiting behind them."""
    tokenizer = load_tokenizer(tiny_model_dir)
    with conditional_cluster(tiny_model_dir, tmp_path_factory.mktemp("prefill-load-logs"),
                             '{"policy": "prefill_load", "prefill_busy_threshold": 1.0}',
                             ("--max-num-batched-tokens", "16"), timeout=120) as c:
        c.complete(PROMPT)  # an idle prefill worker: prefilled there
        assert (c.count("remote"), c.count("local")) == (1, 0)
        results = []
        long = threading.Thread(target=lambda: results.append(c.complete(LONG)))
        long.start()
        deadline = time.monotonic() + 30  # until the prefill worker holds the long prompt's blocks
        while not worker_metric(c.cluster, PREFILL, "dynamo_component_gpu_cache_usage_percent"):
            assert time.monotonic() < deadline, "the long prompt never reached the prefill worker"
            time.sleep(0.01)
        other = f"Another prompt, new to both workers: {PROMPT}"
        text = c.complete(other)
        # this one local, while the long one is prefilled; the long one counts as remote once its prefill is done,
        # which a fast CPU reaches before this one's 8 tokens are out (Zen 5: remote 2 here)
        assert c.count("local") == 1 and c.count("remote") in (1, 2)
        assert text == tokenizer.decode(hf_greedy(tiny_model_dir, [tokenizer(other)["input_ids"]], [8])[0])
        long.join(120)
        assert len(results) == 1 and (c.count("remote"), c.count("local")) == (2, 1)
        assert wait_kv_free(c.cluster, [PREFILL, DECODE]) == 0


def test_a_prompt_under_one_block_is_prefilled_on_the_decode_worker(cluster, client, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer("Hi there")["input_ids"]
    out = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == tokenizer.decode(hf_greedy(tiny_model_dir, [ids], [6])[0])


def test_cancellations_leave_no_kv_on_either_worker(cluster, client):
    def abandon(i: int, chunks: int) -> None:
        stream = client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n >= chunks:
                break
        stream.close()

    # 0 chunks: the client leaves during the prefill or the transfer; 3: during decode
    threads = [threading.Thread(target=abandon, args=(i, (0, 3)[i % 2])) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert wait_kv_free(cluster, [PREFILL, DECODE]) == 0
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].text is not None


def test_a_killed_prefill_worker_fails_or_prefills_locally_never_hangs(cluster):
    victim = cluster.workers[PREFILL]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(10)
    for i in range(3):  # each answered within the client timeout: served (by the decode worker) or an error
        code, body = post(cluster, "/v1/completions", {"model": MODEL, "prompt": f"{PROMPT} after {i}",
                                                       "max_tokens": 8})
        assert code == 200 or (400 <= code < 600 and body.get("message")), (code, body)
    assert wait_kv_free(cluster, [DECODE]) == 0
