"""Dynamo's planner against fixed worker counts, on one load ramp: low, high, low.

Each system is a fresh Dynamo cluster (etcd + NATS, the frontend, our engine's workers, one thread each): `fixed1`
(1 worker), `fixed2` (2) and `planner` (1 at the start; Dynamo's planner in load mode adds and stops workers up to 2:
backend/dynamo/scaling.py). The ramp: `--streams` phases of closed-loop streams (each one greedy completion after
another), e.g. 1, 12, 1 streams for `--phase-seconds` each; a request belongs to the phase it started in. Printed per
system and phase: requests (errors), TTFT and ITL p50 / p99; per system the worker-seconds used (the serving worker
count integrated over the run: a started worker counts from its decision, a stopped one until it). A plot (workers
over time; TTFT p99 per phase) beside the JSON.

    python -m load_tests.bench_planner [--systems fixed1,fixed2,planner] [--streams 1,12,1] [--phase-seconds 40]
        [--model default] [--num-kv-blocks 64] [--up 60] [--down 30] [--out results/planner.json]

Needs .venv-dynamo (`make dynamo-venv`) and etcd + NATS (`make cluster-env`).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from backend.dynamo import launcher
from backend.dynamo.scaling import Autoscaler
from load_tests.bench_offline import DYNAMO_PYTHON
from load_tests.bench_online import percentiles
from load_tests.machine import cpu_summary
from load_tests.streams import StreamError, StreamRecord, openai_sse_stream

MODEL = "bench"
SYSTEMS = {"fixed1": 1, "fixed2": 2, "planner": 1}  # workers at the start


@dataclass
class PhaseResult:
    system: str
    phase: int
    streams: int
    requests: int
    errors: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


def worker_seconds(timeline: list[tuple[float, int]], end: float) -> float:
    """The integral of a worker count over time: `timeline` is (time, count from then on), sorted, to `end`."""
    return sum(count * (min(nxt, end) - at) for (at, count), (nxt, _) in zip(timeline, [*timeline[1:], (end, 0)])
               if at < end)


def phase_of(start: float, t0: float, phase_seconds: float, phases: int) -> int:
    return min(int((start - t0) // phase_seconds), phases - 1)


def phase_results(system: str, streams: list[int], records: list[tuple[int, StreamRecord | None]]
                  ) -> list[PhaseResult]:
    """Per phase: its requests (None: an error), their TTFT and ITL percentiles."""
    out = []
    for phase, n in enumerate(streams):
        ok = [r for p, r in records if p == phase and r is not None]
        ttft = percentiles([r.ttft for r in ok], "t")
        itl = percentiles([g for r in ok for g in r.itls], "t")
        out.append(PhaseResult(system, phase, n, sum(1 for p, _ in records if p == phase),
                               sum(1 for p, r in records if p == phase and r is None), ttft.get("t_p50", 0.0),
                               ttft.get("t_p99", 0.0), itl.get("t_p50", 0.0), itl.get("t_p99", 0.0)))
    return out


def run_system(system: str, args: argparse.Namespace) -> dict:
    workers = SYSTEMS[system]
    print(f"[{system}] starting etcd, NATS, the frontend and {workers} worker(s) ...", flush=True)
    cluster = launcher.start(workers=workers, http_port=args.port, model=args.model, served_model_name=MODEL,
                             python=str(DYNAMO_PYTHON), discovery="etcd", threads_per_worker=1,
                             worker_args=("--num-kv-blocks", str(args.num_kv_blocks)))
    try:
        scaler = None
        if system == "planner":
            scaler = Autoscaler(cluster, {"decode_scale_up_kv_rate": args.up, "decode_scale_down_kv_rate": args.down,
                                          "load_adjustment_interval_seconds": 2}, 1, 2)
            while "[summary]" not in (cluster.log_dir / "planner.log").read_text():
                assert scaler.planner.poll() is None, "the planner exited: see planner.log in " + str(cluster.log_dir)
                time.sleep(0.5)
        prompt = " ".join(f"word{i}" for i in range(args.prompt_words))
        openai_sse_stream(requests.Session(), cluster.url, MODEL, "warm up", 4)
        records: list[tuple[int, StreamRecord | None]] = []
        phases, t0 = len(args.streams), time.monotonic()

        def stream(last: int) -> None:  # closed loop to the end of phase `last`
            session = requests.Session()
            while (now := time.monotonic()) < t0 + (last + 1) * args.phase_seconds:
                phase = phase_of(now, t0, args.phase_seconds, phases)
                try:
                    records.append((phase, openai_sse_stream(session, cluster.url, MODEL, prompt, args.max_tokens)))
                except (StreamError, requests.RequestException):
                    records.append((phase, None))

        threads = []
        for phase, n in enumerate(args.streams):
            time.sleep(max(0.0, t0 + phase * args.phase_seconds - time.monotonic()))
            threads += [threading.Thread(target=stream, args=(phase,)) for _ in range(n)]
            for t in threads[-n:]:
                t.start()
        for t in threads:
            t.join()
        done = time.monotonic()
        wall0 = time.time() - (done - t0)  # the decisions' wall clock, on the ramp's monotonic one
        timeline = [(t0, workers)] + ([(t0 + d.at - wall0, d.workers) for d in scaler.decisions] if scaler else [])
        timeline = [(at, n) for at, n in sorted(timeline) if at <= done]
        print(f"[{system}] {len(records)} requests, {sum(r is None for _, r in records)} errors", flush=True)
        return {"phases": [asdict(p) for p in phase_results(system, args.streams, records)],
                "workers": [(round(at - t0, 2), n) for at, n in timeline],
                "worker_seconds": round(worker_seconds(timeline, done), 1), "seconds": round(done - t0, 1),
                "decisions": [asdict(d) for d in scaler.decisions] if scaler else []}
    finally:
        cluster.stop()


def table(results: dict[str, dict]) -> str:
    lines = ["| system | phase (streams) | requests (errors) | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | worker-s |",
             "|---|---|---|---|---|---|"]
    for system, r in results.items():
        for p in r["phases"]:
            lines.append(f"| {system} | {p['phase']} ({p['streams']}) | {p['requests']} ({p['errors']}) | "
                         f"{p['ttft_p50']:.2f} / {p['ttft_p99']:.2f} | {p['itl_p50'] * 1e3:.0f} / "
                         f"{p['itl_p99'] * 1e3:.0f} | {r['worker_seconds'] if p['phase'] == 0 else ''} |")
    return "\n".join(lines)


def plot(results: dict[str, dict], streams: list[int], phase_seconds: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for system, r in results.items():
        xs, ys = [], []
        for at, n in r["workers"]:
            xs += [at, at]
            ys += [ys[-1] if ys else n, n]
        xs.append(r["seconds"])
        ys.append(ys[-1])
        left.plot(xs, ys, label=f"{system} ({r['worker_seconds']:.0f} worker-s)")
        right.plot(range(len(streams)), [p["ttft_p99"] for p in r["phases"]], marker="o", label=system)
    for i in range(1, len(streams)):
        left.axvline(i * phase_seconds, color="grey", lw=0.5)
    left.set(xlabel="seconds", ylabel="workers serving", title="worker count")
    right.set(xlabel="phase", ylabel="TTFT p99 (s)", title="TTFT p99 per phase",
              xticks=range(len(streams)), xticklabels=[f"{i}: {n} streams" for i, n in enumerate(streams)])
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="fixed1,fixed2,planner")
    p.add_argument("--streams", default="1,12,1", help="closed-loop streams in each phase")
    p.add_argument("--phase-seconds", type=float, default=40.0)
    p.add_argument("--model", default="default")
    p.add_argument("--num-kv-blocks", type=int, default=64, help="each worker's KV pool (blocks of 16 tokens)")
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--up", type=float, default=60.0, help="the planner's decode_scale_up_kv_rate (%%)")
    p.add_argument("--down", type=float, default=30.0,
                   help="the planner's decode_scale_down_kv_rate (%%): above what the low phase holds (one stream ~25 %%)")
    p.add_argument("--port", type=int, default=8280)
    p.add_argument("--out", type=Path, default=Path("results/planner.json"))
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    cpu = cpu_summary()
    print(f"CPU: {cpu}", flush=True)
    results = {system: run_system(system, args) for system in args.systems.split(",")}
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "streams": args.streams, "phase_seconds": args.phase_seconds,
                                    "model": args.model, "num_kv_blocks": args.num_kv_blocks, "results": results},
                                   indent=1))
    plot(results, args.streams, args.phase_seconds, args.out.with_suffix(".png"),
         f"{cpu}; streams {args.streams}, {args.phase_seconds:.0f} s a phase")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
