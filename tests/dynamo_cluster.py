"""Helpers for the tests that start a real Dynamo cluster (backend/dynamo/launcher.py) from .venv-dynamo."""

from __future__ import annotations

import json
import random
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from backend.dynamo import launcher

REPO = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
MODEL = "tiny"


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free (the frontend, then each worker's metrics; Dynamo takes a system port
    as a signed 16-bit number, so below 32768)."""
    for _ in range(50):
        base = random.randrange(20000, 32000)
        if not any(launcher.port_in_use("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port range")


def start_cluster(model_dir: Path, log_dir: Path, worker_args: tuple[str, ...] = (), **layout) -> launcher.Cluster:
    assert DYNAMO_PYTHON.exists(), "no .venv-dynamo: `make dynamo-venv` (make test builds it)"
    workers = layout.get("workers", 2) + layout.get("prefill_workers", 0) + layout.get("decode_workers", 0)
    return launcher.start(http_port=free_ports(workers + 3), model=str(model_dir), served_model_name=MODEL,  # 2 to join
                          worker_args=("--num-kv-blocks", "256", "--max-num-seqs", "8", *worker_args), log_dir=log_dir,
                          threads_per_worker=1, python=str(DYNAMO_PYTHON), **layout)


def post(cluster: launcher.Cluster, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(cluster.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def routed(cluster: launcher.Cluster, prompt: str, model: str = MODEL, max_tokens: int = 2) -> tuple[int, float]:
    """(worker id the frontend routed a completion of `prompt` to, the cached share of its prompt there)."""
    code, body = post(cluster, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                   "nvext": {"extra_fields": ["worker_id"]}})
    assert code == 200, body
    usage = body["usage"]
    return (body["nvext"]["worker_id"]["decode_worker_id"],
            usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])


def worker_of(cluster: launcher.Cluster, prompt: str) -> int:
    """The worker id the frontend routed a one-token completion of `prompt` to."""
    return routed(cluster, prompt, max_tokens=1)[0]


def join_and_route(cluster: launcher.Cluster, tries: int = 40) -> tuple[int, set[int], set[int]]:
    """One more worker (Cluster.add_worker), then one-token requests, up to `tries`, until one lands on a worker that
    8 probes before the join did not reach: (the new worker's index, workers reached before, workers reached after)."""
    before = {worker_of(cluster, f"probe {i} " * 4) for i in range(8)}
    joined, after = cluster.add_worker(), set()
    for i in range(tries):
        after.add(worker_of(cluster, f"fresh {i} " * 4))
        if after - before:
            break
    return joined, before, after


def prefix_turns(cluster: launcher.Cluster, prefix: str, turns: int = 4, model: str = MODEL) -> list[tuple[int, float]]:
    """routed() of `turns` completions of `prefix` with a different tail each, one after another: a router that
    learned the prefix sends every turn after the first to the first's worker."""
    return [routed(cluster, f"{prefix} turn {turn}", model) for turn in range(turns)]


def learned(served: list[tuple[int, float]]) -> bool:
    """prefix_turns' turns all on one worker, the first with nothing cached and the others mostly cached."""
    return len({w for w, _ in served}) == 1 and served[0][1] == 0 and all(hit > 0.8 for _, hit in served[1:])


def worker_metric(cluster: launcher.Cluster, worker: int, name: str, labels: str = "") -> float:
    """The sum of a metric's samples on worker `worker` (whose metrics port follows the frontend's)."""
    port = int(cluster.url.rsplit(":", 1)[1]) + 1 + worker
    with urllib.request.urlopen(f"http://{cluster.worker_address(worker)}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    family = re.sub(r"_(total|count|sum|bucket)$", "", name)
    assert re.search(rf"^# TYPE {family}(_total)? ", text, re.M), f"worker{worker} exports no {family}"
    values = [float(m.group(2)) for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M)
              if labels in m.group(0)]
    return sum(values)


def wait_kv_free(cluster: launcher.Cluster, workers: list[int], timeout: float = 20.0) -> float:
    """Poll the workers' KV usage until it is 0; returns the last sum."""
    deadline = time.monotonic() + timeout
    while True:
        used = sum(worker_metric(cluster, w, "dynamo_component_gpu_cache_usage_percent") for w in workers)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)
