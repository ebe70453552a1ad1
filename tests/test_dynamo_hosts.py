"""Dynamo on hosts of their own (backend/dynamo/hosts.py): etcd and NATS, the frontend and each worker in a Linux
network namespace with its own address on a bridge, as on several machines. Greedy text equals HF's; the router
learns a shared prefix over NATS across hosts; a worker that joins on a new host gets traffic; nothing is reachable
by this host's 127.0.0.1, and every namespace and the bridge go with the cluster."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from backend.serving.tokenizer import load_tokenizer
from tests.dynamo_cluster import MODEL, join_and_route, learned, post, prefix_turns, start_cluster
from tests.reference import hf_greedy


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo-hosts-logs"), workers=2, discovery="etcd",
                      hosts=True)
    namespaces = [c.hosts.namespace(name) for name in c.hosts.addresses]
    yield c
    c.stop()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed
    assert subprocess.run(["ip", "link", "show", c.hosts.bridge], capture_output=True).returncode != 0


def test_each_process_is_on_a_host_of_its_own(cluster):
    procs = [*cluster.planes.procs, cluster.frontend, *cluster.workers]
    spaces = {os.readlink(f"/proc/{p.pid}/ns/net") for p in procs}
    assert len(spaces) == len(procs) - 1 and os.readlink("/proc/self/ns/net") not in spaces  # etcd + NATS share one
    addresses = cluster.hosts.addresses
    assert cluster.url.startswith(f"http://{addresses['frontend']}:")
    assert cluster.planes.etcd.startswith(f"http://{addresses['planes']}:")
    port = int(cluster.url.rsplit(":", 1)[1])
    for i in range(len(cluster.workers)):  # each serves on its address; none on this host's loopback
        with socket.socket() as s:
            assert s.connect_ex((cluster.worker_address(i), port + 1 + i)) == 0
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port + 1 + i)) != 0
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_served_across_hosts_equals_hf(cluster, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = "The capital of France is"
    [expected] = hf_greedy(tiny_model_dir, [tokenizer(prompt)["input_ids"]], [12])
    code, body = post(cluster, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True})
    assert code == 200 and body["choices"][0]["text"] == tokenizer.decode(expected), body


def test_the_router_learns_a_shared_prefix_across_hosts(cluster):
    served = prefix_turns(cluster, " ".join(f"h{i % 13}" for i in range(200)))
    assert learned(served), served


def test_a_worker_joins_on_a_new_host_and_gets_traffic(cluster):
    joined, before, after = join_and_route(cluster)
    assert f"worker{joined}" in cluster.hosts.addresses
    assert after - before, f"the worker on a new host got none of 40 requests: {before} then {after}"
