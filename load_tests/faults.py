"""Faults and hostile load against a RUNNING server that the launcher started on this host (`make serve`).

Checks, in the order given, each printing its numbers (the CPU first):
- fairness: tenant b's TTFT alone, then beside tenant a's flood of long streams; the ratio, and b's flooded
  TTFT in engine steps of the flooded batch (what is left once nothing queues b behind a).
- overload: a burst of concurrent requests past max_num_seqs + max_waiting; how many were served, refused
  "overloaded" (and the refusal counter's increase), failed otherwise, or got no final response.
- kill: streams in flight, then SIGKILL of the llm model's python stub; how the streams ended, and the seconds
  until /v2/health/ready stops answering 200, answers again, and a request is served.
- storm (not in the default set; for --storm-minutes): rounds of 16 bad requests at once, then 24 streams
  (to --model, the client's default llm) of which half are abandoned after their first chunk; counts rounds,
  tritonserver restarts (the python backend's `boost::interprocess::lock_exception` abort seen once in five
  such storms on a Zen 3, and its stub crashes) and requests that got no final response.

    .venv/bin/python -m load_tests.faults [--checks fairness,overload,kill] [--flood 48] [--burst 400]
    .venv/bin/python -m load_tests.faults --checks storm --storm-minutes 60
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from backend.triton.supervisor import stub_processes
from client.client import LLMClient
from load_tests.machine import cpu_summary


def metric(metrics_url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's series whose labels contain `labels` (0 if absent)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(v) for lab, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M) if labels in lab)


def in_threads(target: Callable[[int], None], n: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    return threads


# -- fairness -------------------------------------------------------------------------------------------------

def ttfts(url: str, model: str, n: int, max_tokens: int) -> list[float]:
    with LLMClient(url, model) as client:
        return [client.generate(f"Tenant b, question {i}: say something.", max_tokens=max_tokens,
                                tenant="b", ignore_eos=True, stream=True).ttft for i in range(n)]


def end_streams(clients: list[LLMClient], threads: list[threading.Thread], timeout: float) -> None:
    """Cancel each client's request in flight, wait for the threads that streamed them, close the clients."""
    for client in clients:
        client.cancel()
    for thread in threads:
        thread.join(timeout)
    for client in clients:
        client.close()


def fairness(args: argparse.Namespace) -> None:
    solo = ttfts(args.url, args.model, args.requests, args.max_tokens)
    clients = [LLMClient(args.url, args.model) for _ in range(args.flood)]
    flooding = threading.Event()
    flooding.set()

    def flood(i: int) -> None:  # a stream ends, the next begins: the flood lasts as long as b's requests
        while flooding.is_set():
            for _ in clients[i].stream(f"Tenant a, essay {i}: write at length.", max_tokens=args.flood_tokens,
                                       tenant="a", ignore_eos=True, stream=True):
                pass

    threads = in_threads(flood, args.flood)
    queues = ("llm_num_requests_running", "llm_num_requests_waiting")
    deadline = time.monotonic() + 60  # until every stream of a's runs or waits in the engine
    while sum(metric(args.metrics_url, q) for q in queues) < args.flood and time.monotonic() < deadline:
        time.sleep(0.05)
    running, waiting = (metric(args.metrics_url, q) for q in queues)
    steps = [metric(args.metrics_url, f"llm_step_seconds_{s}") for s in ("sum", "count")]
    flooded = ttfts(args.url, args.model, args.requests, args.max_tokens)
    step_s = (metric(args.metrics_url, "llm_step_seconds_sum") - steps[0]) / \
        max(1.0, metric(args.metrics_url, "llm_step_seconds_count") - steps[1])
    flooding.clear()
    end_streams(clients, threads, 120)

    alone, busy = (np.percentile(x, [50, 99]) for x in (solo, flooded))
    print(f"fairness: tenant b's TTFT over {args.requests} requests alone: p50 {alone[0]:.3f} s, p99 {alone[1]:.3f} s")
    print(f"  beside tenant a's {args.flood} streams ({running:.0f} running, {waiting:.0f} waiting when b began): "
          f"p50 {busy[0]:.3f} s, p99 {busy[1]:.3f} s; the flooded batch's mean step {step_s * 1e3:.0f} ms "
          f"(b's p50 = {busy[0] / step_s:.1f} steps)")
    print(f"  ratio (flooded / alone): p50 {busy[0] / alone[0]:.2f}x, p99 {busy[1] / alone[1]:.2f}x")


# -- overload -------------------------------------------------------------------------------------------------

def overload(args: argparse.Namespace) -> None:
    refused_before = metric(args.metrics_url, "llm_requests_refused_total", 'reason="overloaded"')
    outcome: list[str] = ["no final response"] * args.burst
    go = threading.Event()

    def one(i: int) -> None:
        with LLMClient(args.url, args.model) as client:
            go.wait()
            try:
                client.generate(f"Burst request {i}.", max_tokens=32, ignore_eos=True, timeout=300)
                outcome[i] = "served"
            except Exception as err:  # noqa: BLE001 - counted by kind
                outcome[i] = "refused overloaded" if "overloaded" in str(err) else f"failed: {str(err)[:80]}"

    threads = in_threads(one, args.burst)
    start = time.monotonic()
    go.set()
    for thread in threads:
        thread.join(330)
    refused = metric(args.metrics_url, "llm_requests_refused_total", 'reason="overloaded"') - refused_before
    counts = ", ".join(f"{n} {kind}" for kind, n in Counter(outcome).most_common())
    print(f"overload: {args.burst} concurrent requests in {time.monotonic() - start:.1f} s: {counts}; "
          f"llm_requests_refused_total{{reason=\"overloaded\"}} +{refused:.0f}")


# -- kill -----------------------------------------------------------------------------------------------------

def server_pid(http_port: int) -> int:
    """The tritonserver serving HTTP on this port (the launcher passes --http-port=N)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"tritonserver") and f"--http-port={http_port}".encode() in args:
            return int(cmdline.parent.name)
    raise SystemExit(f"no tritonserver with --http-port={http_port} on this host: the kill check must run beside it")


def ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def kill(args: argparse.Namespace) -> None:
    stub = stub_processes(server_pid(int(args.http_url.rsplit(":", 1)[1])))["llm_0_0"]
    ended: list[str] = ["no final response"] * 4
    first = threading.Event()
    killed_at = 0.0

    def stream(i: int) -> None:
        with LLMClient(args.url, args.model) as client:
            try:
                for _ in client.stream(f"Stream {i}: write at length.", max_tokens=400, ignore_eos=True,
                                       stream=True, timeout=120):
                    first.set()
                ended[i] = "finished"
            except Exception:  # noqa: BLE001 - how it ended is the finding
                ended[i] = f"error after {time.monotonic() - killed_at:.2f} s" if killed_at else "error before"

    threads = in_threads(stream, len(ended))
    first.wait(60)
    os.kill(stub, signal.SIGKILL)
    killed_at = time.monotonic()
    not_ready = back = None
    while time.monotonic() - killed_at < args.recovery_timeout:
        up = ready(args.http_url)
        if not up and not_ready is None:
            not_ready = time.monotonic() - killed_at
        if up and not_ready is not None:
            back = time.monotonic() - killed_at
            break
        time.sleep(0.1)
    served = None
    if back is not None:
        with LLMClient(args.url, args.model) as client:
            client.generate("After the fault.", max_tokens=8)
        served = time.monotonic() - killed_at
    for thread in threads:
        thread.join(10)
    fmt = lambda t: "never" if t is None else f"{t:.1f} s"  # noqa: E731
    print(f"kill: SIGKILL of llm's stub (pid {stub}) with {len(ended)} streams in flight: "
          f"{', '.join(f'{n} {k}' for k, n in Counter(ended).items())}; not ready after {fmt(not_ready)}, "
          f"ready again after {fmt(back)}, a request served after {fmt(served)}")


# -- storm ----------------------------------------------------------------------------------------------------

BAD = [dict(top_p=5.0), dict(max_tokens=-1), dict(temperature=-1.0), dict(top_k=-3), dict(min_tokens=10**6)]


def storm(args: argparse.Namespace) -> None:
    port = int(args.http_url.rsplit(":", 1)[1])
    pid, restarts, rounds = server_pid(port), 0, 0
    outcome: Counter[str] = Counter()

    def bad(i: int) -> None:
        with LLMClient(args.url, args.model) as client:
            try:
                client.generate("Bad request.", **BAD[i % len(BAD)])
                outcome["bad request served"] += 1
            except Exception as err:  # noqa: BLE001 - counted by kind
                outcome["timeout" if isinstance(err, TimeoutError) else "bad request refused"] += 1

    def stream(i: int) -> None:
        with LLMClient(args.url, args.model) as client:
            try:
                chunks = client.stream(f"Storm {i}: write at length.", max_tokens=200, ignore_eos=True,
                                       stream=True, timeout=60)
                for n, _ in enumerate(chunks):
                    if i % 2 and n == 0:
                        chunks.close()  # the client leaves: stream cancelled (and `stop` sent)
                        outcome["abandoned"] += 1
                        return
                outcome["finished"] += 1
            except Exception as err:  # noqa: BLE001 - counted by kind
                outcome["no final response" if type(err).__name__ == "Empty" else "failed"] += 1

    start = time.monotonic()
    deadline, shown = start + args.storm_minutes * 60, start
    while time.monotonic() < deadline:
        for thread in in_threads(bad, 16) + in_threads(stream, 24):
            thread.join(120)
        rounds += 1
        if not ready(args.http_url) or server_pid(port) != pid:
            restarts += 1
            down_at = time.monotonic()
            while not ready(args.http_url):
                if time.monotonic() - down_at > args.recovery_timeout:
                    raise SystemExit(f"storm: the server is not ready again after {args.recovery_timeout:g} s "
                                     f"(round {rounds}); is it supervised (`make serve`)?")
                time.sleep(0.5)
            pid = server_pid(port)
        if time.monotonic() - shown >= 60:  # progress, once a minute
            shown = time.monotonic()
            print(f"  storm: {(shown - start) / 60:.0f} of {args.storm_minutes:g} min, {rounds} rounds, {restarts} "
                  f"restarts, {outcome['no final response']} without a final response", flush=True)
    print(f"storm: {rounds} rounds in {args.storm_minutes:g} min ({rounds * 40} requests): {restarts} tritonserver "
          f"restarts; {', '.join(f'{n} {k}' for k, n in outcome.most_common())}")


CHECKS = {"fairness": fairness, "overload": overload, "kill": kill, "storm": storm}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", default="fairness,overload,kill", help=f"comma-separated, of {list(CHECKS)}")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port")
    p.add_argument("--model", default="llm", help="the front door every check calls: llm, llm_bls or ensemble")
    p.add_argument("--http-url", default="http://127.0.0.1:8000")
    p.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    p.add_argument("--flood", type=int, default=48, help="fairness: tenant a's concurrent streams")
    p.add_argument("--flood-tokens", type=int, default=400)
    p.add_argument("--requests", type=int, default=30, help="fairness: tenant b's sequential requests per phase")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--burst", type=int, default=400, help="overload: concurrent requests")
    p.add_argument("--recovery-timeout", type=float, default=120.0)
    p.add_argument("--storm-minutes", type=float, default=5.0)
    args = p.parse_args(argv)
    checks = args.checks.split(",")
    if unknown := set(checks) - CHECKS.keys():
        p.error(f"--checks: unknown {sorted(unknown)} (expected some of {list(CHECKS)})")
    print(f"CPU: {cpu_summary()}")
    for check in checks:
        CHECKS[check](args)


if __name__ == "__main__":
    main()
