"""The threads a CPU forward runs on: as many as the CPUs that other processes leave free.

OpenMP workers that spin a little at each barrier instead of sleeping (the launcher's default,
docs/benchmarks-log.md#openmp-wait-policy) make a step on CPUs of its own ~20 % faster, since a forward is hundreds of
short parallel regions and waking a sleeping worker costs tens of microseconds each time. Beside a busy process the
same spin is a loss: a worker spins through the slice its descheduled partner needs (2 threads beside one busy
process on 2 CPUs: 0.71x of sleeping workers, where one thread matches them). So about once a second the engine
reads how much of its CPUs (its affinity) other processes used, from /proc/stat less its own CPU time, and runs the
next steps on the CPUs they left: at least one thread, at most the threads it started with.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
WINDOW_S = 1.0  # how long others' use is averaged over before the thread count follows it
PROC_STAT = "/proc/stat"


def busy_seconds(cpus: frozenset[int]) -> float:
    """CPU-seconds the CPUs `cpus` spent on anything but idle and iowait since boot; steal counts as busy (the
    hypervisor's other guests took it)."""
    ticks = 0
    with open(PROC_STAT) as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name != "cpu" and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
                ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuShare:
    max_threads: int  # torch's threads when the engine started: the most a step gets
    cpus: frozenset[int]  # the CPUs this process may run on
    threads: int  # the threads the next steps run on
    window_s: float
    window_start: float  # time.monotonic() when the window began
    busy_start: float  # busy_seconds(cpus) then
    own_start: float  # this process's CPU time then

    @classmethod
    def start(cls, window_s: float = WINDOW_S) -> CpuShare | None:
        """None where /proc/stat cannot be read (not Linux): the threads then stay as they are."""
        cpus = frozenset(os.sched_getaffinity(0))
        try:
            busy = busy_seconds(cpus)
        except (OSError, ValueError):
            return None
        threads = torch.get_num_threads()
        return cls(threads, cpus, threads, window_s, time.monotonic(), busy, time.process_time())

    def others(self) -> float:
        """CPUs other processes used on average since the window began (starts the next window)."""
        now, busy, own = time.monotonic(), busy_seconds(self.cpus), time.process_time()
        used = max(0.0, (busy - self.busy_start) - (own - self.own_start)) / max(now - self.window_start, 1e-9)
        self.window_start, self.busy_start, self.own_start = now, busy, own
        return used

    def update(self) -> None:
        """Before a step: once a window has passed, set torch's threads to the CPUs the others left."""
        if time.monotonic() - self.window_start < self.window_s:
            return
        others = self.others()
        threads = max(1, min(self.max_threads, round(len(self.cpus) - others)))
        if threads != self.threads:  # fewer is worth a warning: something else runs on the engine's CPUs
            log.log(logging.WARNING if threads < self.threads else logging.INFO,
                    "other processes used %.1f of this engine's %d CPUs: the forward runs on %d of %d threads",
                    others, len(self.cpus), threads, self.max_threads)
            torch.set_num_threads(threads)
            self.threads = threads
