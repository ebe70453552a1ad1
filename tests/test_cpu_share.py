"""The forward's threads follow the CPUs other processes leave free (backend/engine/cpu_share.py): a real busy
process pinned to one of the engine's CPUs takes a thread away, and its exit gives it back; what it takes while the
engine is idle does not count."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.engine.cpu_share import CpuShare
from backend.engine.sampling import SamplingParams

CPUS = sorted(os.sched_getaffinity(0))


@contextmanager
def busy_neighbour() -> Iterator[None]:
    """Another process that keeps one of this process's CPUs busy."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(child.pid, {CPUS[-1]})
        yield
    finally:
        child.kill()
        child.wait()


@contextmanager
def threads_per_cpu() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(len(CPUS))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_others_counts_a_busy_process_and_not_this_one():
    share = CpuShare.start()
    assert share is not None and share.cpus == frozenset(CPUS)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # this process's own work is not the others'
        pass
    assert share.others() < 0.5
    with busy_neighbour():
        time.sleep(1.0)
        assert 0.8 < share.others() < 1.5


def threads_after_steps(engine: LLMEngine, seconds: float) -> int:
    """Short requests one after the other for `seconds` (the engine idle between them); the threads the last step
    ran on."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        engine.add_request(f"r{time.monotonic()}", list(range(100, 120)), SamplingParams(max_tokens=4))
        while engine.has_unfinished():
            engine.step()
    return torch.get_num_threads()


@pytest.mark.skipif(len(CPUS) < 2, reason="one CPU: a single thread is all there is to run on")
def test_an_engine_steps_on_the_cpus_a_busy_process_leaves(tiny_model_dir):
    with threads_per_cpu():
        engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
        share = engine.cpu_share
        assert share is not None and share.max_threads == len(CPUS)
        share.window_s = 0.5
        with busy_neighbour():
            share.others()  # a window of the neighbour alone begins; the next step reads it
            time.sleep(0.6)
            assert threads_after_steps(engine, 0.1) == share.threads == engine.stats().cpu_threads == len(CPUS) - 1
        share.others()
        time.sleep(0.6)
        assert threads_after_steps(engine, 0.1) == share.threads == len(CPUS)


def test_only_runtime_torch_on_the_cpu_follows(tiny_model_dir, tiny_engine_dir):
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), runtime="onnxruntime",
                                           engine_dir=str(tiny_engine_dir)))
    assert engine.cpu_share is None  # ONNX Runtime's pool is sized when its session is made


@pytest.mark.skipif(len(CPUS) < 2, reason="one CPU: a single thread is all there is to run on")
def test_only_the_time_the_engine_has_work_counts(tiny_model_dir):
    with threads_per_cpu():
        engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
        share = engine.cpu_share
        share.window_s = 0.5
        threads_after_steps(engine, 0.01)  # ends idle
        with busy_neighbour():  # busy while the engine has nothing to do: not counted
            time.sleep(0.8)
        assert threads_after_steps(engine, 0.3) == len(CPUS)  # less than a window of work: as it was
        with busy_neighbour():  # beside short requests, the engine idle between them: their stretches add up
            assert threads_after_steps(engine, 1.2) == share.threads == len(CPUS) - 1
