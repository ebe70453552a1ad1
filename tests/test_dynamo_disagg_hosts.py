"""Disaggregated prefill and decode on hosts of their own (backend/dynamo/hosts.py): two prefill workers and a decode
worker, each in a Linux network namespace with its own address, etcd and NATS on another, once with each KV transport.
The KV blocks cross between the namespaces' addresses (NIXL's READ over UCX's TCP, or the TCP pull from the prefill
worker's address): the bytes the decode worker counts fetched equal those its prefill worker counts sent, and that
prefill host's link carried at least as many. Greedy text equals HF's; the router learns a shared prefix over NATS
(every turn to one prefill worker); no KV block is left on any worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from backend.serving.tokenizer import load_tokenizer
from tests.dynamo_cluster import MODEL, post, start_cluster, wait_kv_free, worker_metric
from tests.reference import hf_greedy

PREFILLS, DECODE = (0, 1), 2  # worker indices in the launcher's order
LONG = " ".join(f"w{i % 97}" for i in range(300))  # 861 tokens: 53 full blocks, ~430 KB of the tiny model's K/V


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def cluster(request, tiny_model_dir, tmp_path_factory):
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp(f"disagg-hosts-{request.param}"),
                      ("--kv-transport", request.param), workers=0, prefill_workers=len(PREFILLS), decode_workers=1,
                      discovery="etcd", hosts=True)
    yield c
    c.stop()


def _link_sent(cluster, worker: int) -> int:
    """Bytes worker `worker`'s host has sent on its link (the bridge's end receives them)."""
    link = cluster.hosts.link(f"worker{worker}")
    return int(Path(f"/sys/class/net/{link}/statistics/rx_bytes").read_text())


def _sent(cluster) -> dict[int, float]:
    return {w: worker_metric(cluster, w, "llm_kv_sent_bytes_total") for w in PREFILLS}


def test_the_kv_crosses_hosts_counted_on_both_sides_and_greedy_equals_hf(cluster, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    [expected] = hf_greedy(tiny_model_dir, [tokenizer(LONG)["input_ids"]], [4])
    sent, fetched = _sent(cluster), worker_metric(cluster, DECODE, "llm_kv_transfer_bytes_total")
    link = {w: _link_sent(cluster, w) for w in PREFILLS}
    code, body = post(cluster, "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
    link = {w: _link_sent(cluster, w) - link[w] for w in PREFILLS}  # before this test's own scrapes
    assert code == 200 and body["choices"][0]["text"] == tokenizer.decode(expected), body
    moved = worker_metric(cluster, DECODE, "llm_kv_transfer_bytes_total") - fetched
    assert moved >= 53 * 16 * 512, moved  # every full block: 2 layers x K,V x 2 heads x 16 dims x float32 a token
    deadline = time.monotonic() + 10  # NIXL counts an export sent when the decode worker's notification arrives
    while sorted(_sent(cluster)[w] - sent[w] for w in PREFILLS) != [0, moved] and time.monotonic() < deadline:
        time.sleep(0.05)
    [source] = [w for w, total in _sent(cluster).items() if total - sent[w] == moved]
    assert link[source] >= moved, (link, moved)  # the bytes went over its address, not through shared memory


def _prefill_worker(cluster, prompt: str) -> int:
    code, body = post(cluster, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                   "nvext": {"extra_fields": ["worker_id"]}})
    assert code == 200, body
    return body["nvext"]["worker_id"]["prefill_worker_id"]


def test_the_router_learns_a_shared_prefix_across_hosts(cluster):
    """The prefill router's KV index is fed by the prefill workers' events over NATS: every turn after the first goes
    where the first left the prefix's blocks."""
    prefix = " ".join(f"p{i % 11}" for i in range(200))
    first = _prefill_worker(cluster, f"{prefix} turn 0")
    assert [_prefill_worker(cluster, f"{prefix} turn {turn}") for turn in range(1, 6)] == [first] * 5


def test_no_kv_block_is_left_on_any_worker(cluster):
    assert wait_kv_free(cluster, [*PREFILLS, DECODE]) == 0
