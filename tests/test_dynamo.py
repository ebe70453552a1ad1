"""The engine as NVIDIA Dynamo workers: a real frontend (OpenAI API, KV-aware router) and two real worker
processes from .venv-dynamo (`make dynamo-venv`), serving the tiny random Llama."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import jsonschema
import pytest
from openai import OpenAI

from backend.dynamo import launcher
from backend.engine import EngineConfig, LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.tokenizer import load_tokenizer
from tests.dynamo_cluster import (DYNAMO_PYTHON, MODEL, free_ports, learned, post, prefix_turns, start_cluster,
                                  wait_kv_free, worker_metric)
from tests.reference import hf_greedy

WORKERS = 2
IGNORE_EOS = {"ignore_eos": True}  # run to max_tokens, as the HF reference does
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo-logs"), workers=WORKERS)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_completion_greedy_equals_hf_streamed_or_not(client, tokenizer, tiny_model_dir):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    [expected] = hf_greedy(tiny_model_dir, [prompt_ids], [12])
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    assert full.choices[0].text == tokenizer.decode(expected)
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), 12)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body=IGNORE_EOS)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text


def test_chat_completion_streams_the_same_text_with_usage(client, tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          extra_body=IGNORE_EOS)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), 10)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=IGNORE_EOS))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10


def test_seeded_sampling_repeats_and_greedy_is_deterministic(client):
    def text(**kw):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, extra_body=IGNORE_EOS,
                                         **kw).choices[0].text

    assert text(temperature=1.0, seed=7) == text(temperature=1.0, seed=7)
    assert text(temperature=1.0, top_p=0.9, seed=7) != text(temperature=0)  # 16 random tokens: a tie is ~0
    assert text(temperature=0) == text(temperature=0)


def test_stop_string_ends_the_output_before_it(client):
    # no ignore_eos here: with it, Dynamo's frontend drops stop strings (a benchmark runs to max_tokens)
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {free!r}"
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=[stop]).choices[0]
    assert (out.text, out.finish_reason) == (free[:free.index(stop)], "stop"), (free, stop)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_through_the_openai_api(client):
    """response_format (json_schema, json_object) and vLLM's guided_regex / guided_choice, as the openai package
    sends them; Dynamo's frontend turns them into sampling_options.guided_decoding for the worker."""
    messages = [{"role": "user", "content": "Describe a person."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=1.0, seed=1,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # an unbounded object may run to max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    regex = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=2,
                                      extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"}).choices[0].text
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex), regex
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["Paris", "Lyon"]}).choices[0].text
    assert choice in ("Paris", "Lyon")


def test_top_logprobs_through_the_openai_api(client):
    """Chat's logprobs + top_logprobs and the completions API's logprobs N reach the worker as output_options.logprobs;
    each token comes back with its N likeliest, likeliest first (the greedy token first), their text filled in by
    the frontend."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body=IGNORE_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 5 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token and top[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                           extra_body=IGNORE_EOS)
    assert [len(top) for top in completion.choices[0].logprobs.top_logprobs] == [3] * 4


def test_prompt_logprobs_through_the_openai_api_are_the_offline_engines(cluster, tokenizer, tiny_model_dir):
    """Chat's `prompt_logprobs` (vLLM's extension) reach the worker as output_options.prompt_logprobs and come back
    in the response's `prompt_logprobs`: per prompt position, the prompt's token and the N likeliest, with text.
    (Dynamo 1.6.1's completions response carries none: its frontend drops them there.)"""
    messages = [{"role": "user", "content": "Say something."}]
    code, body = post(cluster, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                        "prompt_logprobs": 2})
    assert code == 200, body
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    [entries] = [out.prompt_logprobs for out in engine.step()]
    positions = body["prompt_logprobs"]
    assert len(positions) == len(prompt) and positions[0] is None
    for token, position, entry in zip(prompt[1:], positions[1:], entries):
        assert position[str(token)]["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert position[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert {int(t) for t in position} == {token} | {t for t, _ in entry.top_logprobs}


@pytest.mark.parametrize("field, body", [
    ("n", {"n": 2}),
    ("min_p", {"min_p": 1.5}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("guided_decoding_guide", {"guided_json": {"type": "array", "uniqueItems": True}}),
    ("top_p", {"top_p": 0.0}),
])
def test_bad_request_is_a_4xx_naming_the_field_and_the_next_is_served(cluster, client, field, body):
    code, err = post(cluster, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body})
    assert 400 <= code < 500, (code, err)
    assert field in json.dumps(err).lower(), err
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].text is not None


def test_client_disconnect_frees_the_workers_kv(cluster, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=900, temperature=0, stream=True,
                                       extra_body=IGNORE_EOS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    busy = sum(worker_metric(cluster, w, "dynamo_component_gpu_cache_usage_percent") for w in range(WORKERS))
    assert busy > 0, "the request held no KV blocks while streaming"
    stream.close()  # the client goes away
    assert wait_kv_free(cluster, list(range(WORKERS))) == 0, "the worker kept the disconnected request's KV blocks"


def test_workers_publish_forward_pass_metrics_for_the_planner(cluster, client, tokenizer, tmp_path):
    """What Dynamo's planner scales on (load-based): each step's forward-pass metrics on the event plane, read here by
    Dynamo's own consumer. A fresh 40-odd-token prompt is one prefill chunk with nothing cached, then 5 decodes."""
    out = tmp_path / "fpm.jsonl"
    probe = subprocess.Popen([str(DYNAMO_PYTHON), "-m", "dynamo.common.recv_forward_pass_metrics",
                              "--namespace", "dynamo", "--component", "backend", "--endpoint", "generate",
                              "--output", str(out), "--flush-interval", "0.2"],
                             env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def received() -> list[dict]:
        return [json.loads(line)["metrics"] for line in out.read_text().splitlines()] if out.exists() else []

    try:
        deadline = time.monotonic() + 60  # until it hears the idle workers' heartbeats: subscribed
        while len({m["worker_id"] for m in received()}) < WORKERS:
            assert probe.poll() is None and time.monotonic() < deadline, "no heartbeat from every worker"
            time.sleep(0.2)
        prompt = "Forward pass metrics, a prompt no other test sends: " + " ".join(f"m{i}" for i in range(12))
        n = len(tokenizer(prompt)["input_ids"])
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
        deadline = time.monotonic() + 30
        while len(steps := [m for m in received() if m["wall_time"] > 0]) < 6 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        probe.terminate()
        probe.wait(10)
    prefill = [(s["scheduled_requests"]["num_prefill_requests"], s["scheduled_requests"]["sum_prefill_tokens"],
                s["scheduled_requests"]["sum_prefill_kv_tokens"]) for s in steps]
    decode = [(s["scheduled_requests"]["num_decode_requests"], s["scheduled_requests"]["sum_decode_kv_tokens"])
              for s in steps if s["scheduled_requests"]["num_decode_requests"]]
    assert prefill[0] == (1, n, 0), steps
    assert decode == [(1, n + i) for i in range(1, 6)], steps
    assert len({s["worker_id"] for s in steps}) == 1  # the worker that served it


def test_kv_router_sends_a_shared_prefix_to_the_worker_that_holds_it(cluster):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    for doc in range(3):
        prefix = " ".join(words[(doc * 7 + i * 3) % len(words)] for i in range(200))  # ~200 tokens, 12 blocks
        served = prefix_turns(cluster, prefix)  # the cached shares are the engine's own hits
        assert learned(served), f"prefix {doc}: {served}"


def test_a_cache_salt_keeps_prefixes_apart_and_the_router_follows_it(cluster):
    """OpenAI requests with nvext.cache_salt: the same salt's turns go to one worker and hit its cache (the router
    hashes the request with the salt, as the worker's KV events do); another salt shares nothing."""
    prefix = " ".join(f"w{i % 13}" for i in range(200))

    def ask(turn: int, salt: str) -> tuple[int, int]:
        code, body = post(cluster, "/v1/completions", {
            "model": MODEL, "prompt": f"{prefix} question {turn}", "max_tokens": 2,
            "nvext": {"extra_fields": ["worker_id"], "cache_salt": salt}})
        assert code == 200, body
        return body["nvext"]["worker_id"]["decode_worker_id"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    salted = [ask(turn, "tenant-a") for turn in range(4)]
    assert len({w for w, _ in salted}) == 1 and salted[0][1] == 0 and all(c > 0 for _, c in salted[1:]), salted
    assert ask(9, "tenant-b")[1] == 0


def test_a_killed_worker_is_dropped_and_the_others_serve(cluster, client):
    victim = cluster.workers[0]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(10)
    texts = [client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=4).choices[0].text
             for i in range(6)]
    assert all(t is not None for t in texts)


def test_launcher_refuses_a_busy_port_and_a_missing_model_by_name(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"http_port: 127.0.0.1:{port} is in use"):
            launcher.start(http_port=port, model=str(tmp_path), python=str(DYNAMO_PYTHON))
    with pytest.raises(FileNotFoundError, match="model_dir: .* is not an HF model folder"):
        launcher.start(http_port=free_ports(3), model=str(tmp_path / "missing"), python=str(DYNAMO_PYTHON))
