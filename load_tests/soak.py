"""Soak test: start our tritonserver, run the locust load test headless against it for N minutes, then check
that nothing failed, the engine is idle with every KV block free again, and memory stopped growing.

    python -m load_tests.soak [--minutes 10] [--users 32] [--model default|DIR] [--prompt-set chat]
        [--max-tokens 16-128] [--threads N] [--out results/soak]

Memory is the RSS (and PSS) of tritonserver plus its python-backend stubs, sampled through the run. The
KV cache pool is allocated lazily, so RSS rises while blocks are first touched; the leak check therefore
compares the second half of the load: growth from its middle to its end must stay under --max-growth-mib.
The drain after it (locust's stop: the users finish their requests in flight, so the engine runs every batch
size from the users' count down to one) is left out of the check and shown as "idle after": it added 40-50
MiB once in the 3- and 10-minute soaks of 2026-11-23, on the loop that overlaps its sends and the one that
waits alike, while the steady load's second half grew 11-15 MiB.
Writes locust's CSVs, its HTML report and log, and rss.csv to --out; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from backend.triton.launcher import TritonServer
from client.client import LLMClient
from load_tests.bench_offline import resolve_model
from load_tests.bench_online import ours_repository
from load_tests.server_stats import TreeMemory, find_tritonserver, wait_idle
from load_tests.summarize import format_summary, read_summary

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
SAMPLE_EVERY_S = 5.0
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class Check:
    name: str
    value: str
    ok: bool


class MemorySampler:
    """(seconds since start, memory) of the server's process tree every SAMPLE_EVERY_S, in a thread."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[tuple[float, TreeMemory]] = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self._start, TreeMemory.read(self.pid)))
            if self._stop.wait(SAMPLE_EVERY_S):
                return

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, seconds: float) -> TreeMemory:
        """The last sample taken at or before `seconds`."""
        return [m for t, m in self.samples if t <= seconds][-1]


def progress_line(elapsed_s: float, args: argparse.Namespace, memory: MemorySampler) -> str:
    """Elapsed time, requests done and failed so far (locust rewrites its CSV every few seconds), RSS."""
    done = failed = 0
    try:
        summary = read_summary(args.out / "soak_stats.csv")
        done, failed = sum(r.count for r in summary.rows if r.kind == "E2E"), summary.errors
    except (FileNotFoundError, ValueError, KeyError):
        pass
    rss = memory.samples[-1][1].rss_mib if memory.samples else float("nan")
    return (f"  {elapsed_s / 60:4.1f} / {args.minutes:g} min: {done} requests done, {failed} failed, "
            f"server RSS {rss:.0f} MiB")


def run_locust(url: str, args: argparse.Namespace, memory: MemorySampler) -> int:
    cmd = [str(Path(sys.executable).parent / "locust"), "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "-H", url, "-u", str(args.users), "-r", str(args.users), "-t", f"{args.minutes * 60:.0f}s",
           "--stop-timeout", "60",  # users finish the request in flight (load_tests/locustfile.py)
           "--prompt-set", args.prompt_set, "--max-tokens", args.max_tokens,
           "--csv", str(args.out / "soak"), "--html", str(args.out / "soak.html")]
    with open(args.out / "locust.log", "wb") as log:
        env = {**os.environ, "LOAD_SHAPE": "constant", "LOAD_PROTOCOL": "grpc"}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        try:
            while proc.poll() is None:
                if time.monotonic() - start > args.minutes * 60 + 180:
                    raise TimeoutError("locust ran 3 minutes past its time")
                try:
                    proc.wait(PROGRESS_EVERY_S)
                except subprocess.TimeoutExpired:
                    print(progress_line(time.monotonic() - start, args, memory), file=sys.stderr, flush=True)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode


def verdict(checks: list[Check]) -> str:
    width = max(len(c.value) for c in checks)
    lines = [f"{'check':<32} {'value':<{width}}  verdict", "-" * (42 + width)]
    lines += [f"{c.name:<32} {c.value:<{width}}  {'PASS' if c.ok else 'FAIL'}" for c in checks]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--model", default="default", help="'default' (SmolLM2) or an HF folder")
    p.add_argument("--prompt-set", default="chat")
    p.add_argument("--max-tokens", default="16-128")
    p.add_argument("--threads", type=int, help="OMP threads of the server (default: its own choice)")
    p.add_argument("--max-growth-mib", type=float, default=64.0,
                   help="largest RSS growth allowed over the second half of the run")
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(None if args.model == "default" else args.model)
    with tempfile.TemporaryDirectory() as tmp, \
            TritonServer(ours_repository(Path(tmp), model_dir), http_port=0, grpc_port=0, metrics_port=0,
                         extra_args=["--disable-auto-complete-config"]) as server:
        with LLMClient(server.url_grpc) as client:  # one step sets the engine's gauges
            client.generate("Hello", max_tokens=4)
        start_state = wait_idle(server.url_metrics, 30)
        pid = find_tritonserver(server.grpc_port)
        assert pid is not None, "the server just started is not in /proc"
        print(f"server up (pid {pid}); {args.users} users for {args.minutes:g} min", file=sys.stderr,
              flush=True)
        with MemorySampler(pid) as memory:
            t0 = time.monotonic()
            code = run_locust(server.url_grpc, args, memory)
            run_s = time.monotonic() - t0
            end_state = wait_idle(server.url_metrics, 60)
        idle_memory = TreeMemory.read(pid)

    summary = read_summary(args.out / "soak_stats.csv")
    print(format_summary(summary))
    requests = sum(r.count for r in summary.rows if r.kind == "E2E")
    load_s = min(run_s, args.minutes * 60)  # then locust stops and its users finish their requests (the drain)
    first, mid, last = memory.samples[0][1], memory.at(load_s / 2), memory.at(load_s)
    growth = last.rss_mib - mid.rss_mib
    peak = max(m.rss_mib for _, m in memory.samples)
    with open(args.out / "rss.csv", "w") as f:
        f.write("seconds,rss_mib,pss_mib,processes\n")
        f.writelines(f"{t:.1f},{m.rss_mib:.1f},{m.pss_mib:.1f},{m.processes}\n" for t, m in memory.samples)
    checks = [
        Check("locust exit code", str(code), code == 0),
        Check("requests / failures", f"{requests} / {summary.errors}", requests > 0 and summary.errors == 0),
        Check("engine idle before", str(start_state), start_state.idle),
        Check("engine idle after, KV all free", str(end_state), end_state.idle),
        Check("RSS MiB start/mid/load end/peak",
              f"{first.rss_mib:.0f} / {mid.rss_mib:.0f} / {last.rss_mib:.0f} / {peak:.0f} "
              f"(idle after: {idle_memory.rss_mib:.0f}, PSS {idle_memory.pss_mib:.0f})", True),
        Check("RSS growth, load's second half", f"{growth:+.0f} MiB (limit {args.max_growth_mib:g})",
              growth <= args.max_growth_mib),
    ]
    print(verdict(checks))
    print(f"reports in {args.out}: soak.html, soak_stats.csv, locust.log, rss.csv", file=sys.stderr)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
