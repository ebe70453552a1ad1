"""What a load test checks on the server itself: engine gauges from the metrics port, and the memory of
the tritonserver process with its python-backend stubs (found through /proc, so only on this host).

    python -m load_tests.server_stats --metrics-url http://127.0.0.1:8002/metrics [--port 8001]
        [--label start] [--wait-idle SECONDS]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
IGNORED_LABELS = ("model", "version")


def read_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value}, without the model/version labels."""
    body = urllib.request.urlopen(url, timeout=timeout).read().decode()
    values: dict[str, float] = {}
    for line in body.splitlines():
        if (m := LINE.match(line)) is None:
            continue
        name, labels, value = m.groups()
        kept = [f'{k}="{v}"' for k, v in LABEL.findall(labels or "") if k not in IGNORED_LABELS]
        values[name + (f"{{{','.join(kept)}}}" if kept else "")] = float(value)
    return values


@dataclass(frozen=True)
class EngineState:
    running: int
    waiting: int
    kv_used: int
    kv_free: int
    kv_cached: int  # free blocks that still hold a reusable prefix
    kv_total: int

    @classmethod
    def read(cls, metrics_url: str) -> EngineState:
        m = read_metrics(metrics_url)
        keys = ["llm_num_requests_running", "llm_num_requests_waiting",
                *(f'llm_kv_blocks{{state="{s}"}}' for s in ("used", "free", "cached", "total"))]
        try:
            return cls(*(int(m[k]) for k in keys))
        except KeyError as err:
            raise RuntimeError(f"{metrics_url} has no {err.args[0]} (has the llm model served a step yet?)") \
                from None

    @property
    def idle(self) -> bool:
        """Nothing running or waiting and every KV block free (cached prefixes count as free)."""
        return self.running == self.waiting == self.kv_used == 0 and self.kv_free == self.kv_total

    def __str__(self) -> str:
        requests = f"running {self.running}, waiting {self.waiting}"
        if self.kv_total == 0:  # engine steps set the gauges
            return f"{requests}; no KV blocks reported yet (no engine step)"
        return (f"{requests}; KV blocks used {self.kv_used}, free {self.kv_free} (cached {self.kv_cached}) "
                f"of {self.kv_total}")


def wait_idle(metrics_url: str, timeout: float) -> EngineState:
    """The engine state once idle, or the last one read when `timeout` runs out."""
    deadline = time.monotonic() + timeout
    while not (state := EngineState.read(metrics_url)).idle and time.monotonic() < deadline:
        time.sleep(0.2)
    return state


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def find_tritonserver(port: int) -> int | None:
    """The pid of the local tritonserver serving gRPC or HTTP on `port`, if any."""
    for pid in _pids():
        try:
            args = _cmdline(pid)
        except OSError:
            continue
        ports = {f"--grpc-port={port}", f"--http-port={port}"}
        if args and args[0].endswith("tritonserver") and ports & set(args):
            return pid
    return None


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on: field n is at index n - 3 (comm may hold spaces and ")")."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the python backend's stubs are the server's children)."""
    parents: dict[int, int] = {}
    for p in _pids():
        try:
            parents[p] = int(_stat(p)[1])  # field 4: ppid
        except OSError:
            continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by `pid` and its live descendants."""
    ticks = 0
    for p in descendants(pid):
        try:
            fields = _stat(p)
        except OSError:  # exited meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class TreeMemory:
    processes: int
    rss_mib: float  # sum of RSS: counts pages shared between processes (the shm pool) once per process
    pss_mib: float  # sum of PSS: shared pages split between their users, so the sum is the real footprint

    @classmethod
    def read(cls, pid: int) -> TreeMemory:
        rss = pss = 0
        pids = descendants(pid)
        for p in pids:
            try:
                lines = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()[1:]
            except OSError:  # exited meanwhile
                continue
            fields = dict(line.split(":", 1) for line in lines)
            rss += int(fields["Rss"].split()[0])
            pss += int(fields["Pss"].split()[0])
        return cls(len(pids), rss / 1024, pss / 1024)

    def __str__(self) -> str:
        return f"RSS {self.rss_mib:.0f} MiB (PSS {self.pss_mib:.0f} MiB) in {self.processes} processes"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    p.add_argument("--port", type=int,
                   help="find the local tritonserver by its gRPC or HTTP port and print its memory")
    p.add_argument("--label", default="server", help="first word of the line printed")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for the engine to be idle")
    args = p.parse_args(argv)
    state = wait_idle(args.metrics_url, args.wait_idle)
    print(f"{args.label}: {state}{'' if state.idle else '  (NOT idle)'}")
    if args.port:
        pid = find_tritonserver(args.port)
        memory = f"pid {pid}, {TreeMemory.read(pid)}" if pid else f"not on this host (port {args.port})"
        print(f"{args.label}: tritonserver {memory}")
    return 0 if state.idle or not args.wait_idle else 1


if __name__ == "__main__":
    sys.exit(main())
