"""Dynamo on its cluster planes: etcd for discovery and NATS JetStream for KV events and load (Debian's etcd-server
and nats-server, started by backend/dynamo/control_plane.py), a real frontend and two real workers. Greedy text
equals HF's; a shared prefix goes to the worker that holds it (the router learns it from KV events over NATS); the
planes stop with the cluster."""

from __future__ import annotations

import re

import pytest

from backend.serving.tokenizer import load_tokenizer
from tests.dynamo_cluster import MODEL, post, start_cluster
from tests.reference import hf_greedy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo-etcd-logs"), workers=2, discovery="etcd")
    yield c
    c.stop()
    assert all(p.poll() is not None for p in c.planes.procs), "etcd or NATS outlived the cluster"


def test_served_on_etcd_and_nats(cluster, tiny_model_dir):
    assert cluster.planes.etcd.startswith("http://127.0.0.1:") and cluster.planes.nats.startswith("nats://127.0.0.1:")
    tokenizer = load_tokenizer(tiny_model_dir)
    [expected] = hf_greedy(tiny_model_dir, [tokenizer(PROMPT)["input_ids"]], [12])
    code, body = post(cluster, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True})
    assert code == 200 and body["choices"][0]["text"] == tokenizer.decode(expected), body
    log = re.sub(r"\x1b\[[0-9;]*m", "", (cluster.log_dir / "worker0.log").read_text())  # without its colours
    assert f"discovery backend: Etcd({cluster.planes.etcd})" in log and "topic=kv-events transport=Nats" in log


def test_the_router_learns_a_shared_prefix_over_nats(cluster):
    prefix = " ".join(f"u{i % 17}" for i in range(200))  # ~200 tokens, 12 blocks
    served = []
    for turn in range(4):
        code, body = post(cluster, "/v1/completions", {"model": MODEL, "prompt": f"{prefix} question {turn}",
                                                       "max_tokens": 2, "nvext": {"extra_fields": ["worker_id"]}})
        assert code == 200, body
        usage = body["usage"]
        served.append((body["nvext"]["worker_id"]["decode_worker_id"],
                       usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]))
    assert len({w for w, _ in served}) == 1, served
    assert served[0][1] == 0 and all(hit > 0.8 for _, hit in served[1:]), served
