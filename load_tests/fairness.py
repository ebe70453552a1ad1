"""Tenant fairness against a RUNNING server (`make serve`): one tenant floods, does another still get served?

Tenant "b" sends `--requests` short requests one after another, first alone, then while tenant "a" keeps
`--flood` long streams open. Prints b's TTFT p50/p99 in both phases and the ratio, with the CPU.

    .venv/bin/python -m load_tests.fairness [--url 127.0.0.1:8001] [--flood 48] [--requests 12]
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import urllib.request

import numpy as np

from client.client import LLMClient
from load_tests.machine import cpu_summary


def ttfts(url: str, n: int, max_tokens: int) -> list[float]:
    with LLMClient(url) as client:
        return [client.generate(f"Tenant b, question {i}: say something.", max_tokens=max_tokens,
                                tenant="b", ignore_eos=True, stream=True).ttft for i in range(n)]


def engine_queues(metrics_url: str) -> tuple[float, float]:
    """(running, waiting) sequences, from the llm's metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    value = {name: float(v) for name, v in re.findall(r"^(llm_num_requests_\w+)\{[^}]*\} (\S+)$", text, re.M)}
    return value.get("llm_num_requests_running", 0.0), value.get("llm_num_requests_waiting", 0.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port")
    p.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    p.add_argument("--flood", type=int, default=48, help="tenant a's concurrent streams")
    p.add_argument("--flood-tokens", type=int, default=400)
    p.add_argument("--requests", type=int, default=12, help="tenant b's sequential requests per phase")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)

    solo = ttfts(args.url, args.requests, args.max_tokens)
    clients = [LLMClient(args.url) for _ in range(args.flood)]

    def flood(client: LLMClient, i: int) -> None:
        for _ in client.stream(f"Tenant a, essay {i}: write at length.", max_tokens=args.flood_tokens,
                               tenant="a", ignore_eos=True):
            pass

    threads = [threading.Thread(target=flood, args=(c, i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60  # until every stream of a's runs or waits in the engine
    while sum(engine_queues(args.metrics_url)) < args.flood and time.monotonic() < deadline:
        time.sleep(0.05)
    queued = engine_queues(args.metrics_url)
    flooded = ttfts(args.url, args.requests, args.max_tokens)
    for client in clients:
        client.cancel()
    for t in threads:
        t.join(120)
    for client in clients:
        client.close()

    alone, busy = (np.percentile(x, [50, 99]) for x in (solo, flooded))
    print(f"CPU: {cpu_summary()}")
    print(f"tenant b TTFT alone: p50 {alone[0]:.3f} s, p99 {alone[1]:.3f} s")
    print(f"tenant b TTFT beside tenant a's {args.flood} streams ({queued[0]:.0f} running, {queued[1]:.0f} waiting "
          f"when b began): p50 {busy[0]:.3f} s, p99 {busy[1]:.3f} s")
    print(f"ratio (flooded / alone): p50 {busy[0] / alone[0]:.2f}x, p99 {busy[1] / alone[1]:.2f}x")


if __name__ == "__main__":
    main()
