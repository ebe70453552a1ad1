"""The threads a CPU forward runs on: as many as the CPUs that other processes leave free.

OpenMP workers that spin a little at each barrier instead of sleeping (the launcher's default,
docs/benchmarks-log.md#openmp-wait-policy) make a step on CPUs of its own ~20 % faster, since a forward is hundreds of
short parallel regions and waking a sleeping worker costs tens of microseconds each time. Beside a busy process the
same spin is a loss: a worker spins through the slice its descheduled partner needs (2 threads beside one busy
process on 2 CPUs: 0.71x of sleeping workers, where one thread matches them). So about once a second the engine
reads how much of its CPUs (its affinity) other processes used, from /proc/stat less its own CPU time, and runs the
next steps on the CPUs they left: at least one thread, at most the threads it started with. Only the time the
engine has work counts toward a window: what others take of CPUs it leaves idle says nothing of what they leave it
(two engines taking turns on 2 CPUs each saw the other's steps and went down to one thread at each turn).
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
    window_s: float  # the time with work that others' use is averaged over
    window_start: float | None  # time.monotonic() when the window's stretch of work began; None: the engine is idle
    busy_start: float  # busy_seconds(cpus) then
    own_start: float  # this process's CPU time then
    counted_s: float = 0.0  # the window's earlier stretches of work: their time,
    counted_used: float = 0.0  # and the CPU-seconds others used in them

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
        """CPUs other processes used on average over the window's time with work (starts the next window)."""
        self.idle()
        used = self.counted_used / max(self.counted_s, 1e-9)
        self.counted_s = self.counted_used = 0.0
        self._begin()
        return max(0.0, used)

    def idle(self) -> None:
        """The engine has no work left: the window's stretch of work ends here (the next begins at its next step)."""
        if self.window_start is not None:
            now, busy, own = time.monotonic(), busy_seconds(self.cpus), time.process_time()
            self.counted_s += now - self.window_start
            self.counted_used += (busy - self.busy_start) - (own - self.own_start)
            self.window_start = None

    def _begin(self) -> None:
        self.window_start, self.busy_start, self.own_start = (time.monotonic(), busy_seconds(self.cpus),
                                                              time.process_time())

    def update(self) -> None:
        """Before a step: once the window holds `window_s` of work, set torch's threads to the CPUs others left."""
        if self.window_start is None:
            self._begin()
        if self.counted_s + time.monotonic() - self.window_start < self.window_s:
            return
        others = self.others()
        threads = max(1, min(self.max_threads, round(len(self.cpus) - others)))
        if threads != self.threads:  # fewer is worth a warning: something else runs on the engine's CPUs
            log.log(logging.WARNING if threads < self.threads else logging.INFO,
                    "other processes used %.1f of this engine's %d CPUs: the forward runs on %d of %d threads",
                    others, len(self.cpus), threads, self.max_threads)
            torch.set_num_threads(threads)
            self.threads = threads
