"""The CPU kernels' build (backend/engine/kernels/cpu_kernels.py) on real processes: a build killed midway, as a
server stopped while it loaded kills it, leaves torch's lock file and no library; the process that was waiting for it
takes over and builds. Before the flock, every later process waited on that file forever (a 2-core Zen 3, 2026-11-28:
~600 tests errored)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from backend.engine.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[1]
LOAD = ("import logging, sys, torch; logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='%(message)s'); "
        "from backend.engine.kernels import cpu_kernels; cpu_kernels.load(); print(torch.ops.llm_kernels.argmax_rows)")


def _wait_for(done, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"process {proc.pid} ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def test_a_build_killed_midway_is_taken_over_by_the_process_waiting_for_it(tmp_path):
    """This CPU's build seeds a fresh cache with its objects but one (argmax.cpp, the smallest), so the killed build
    and the one that takes over compile one source each, not eight (~2 minutes on 2 cores)."""
    cpu_kernels.load()
    built = cpu_kernels.library_path()
    cache = tmp_path / "kernels"
    env = {**os.environ, "LLM_KERNEL_CACHE": str(cache)}
    target = cache / built.parent.name / built.name
    build_dir = target.parent / "build"
    shutil.copytree(built.parent / "build", build_dir)
    for left_out in ("llm_kernels.so", "argmax.o", "lock"):
        (build_dir / left_out).unlink(missing_ok=True)

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", LOAD], cwd=REPO, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start()
    # torch's lock: the compile is about to start, under the flock
    _wait_for((build_dir / "lock").exists, first, "torch's lock file")
    second = start()
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(second.stderr), daemon=True)
    reader.start()
    _wait_for(lambda: any("waiting" in line for line in err_lines), second, "the second process waiting")
    os.killpg(first.pid, signal.SIGKILL)  # the builder and its ninja and compiler
    first.wait()
    assert (build_dir / "lock").exists() and not target.exists()
    out = second.stdout.read()
    assert second.wait(timeout=600) == 0
    reader.join()
    err = "".join(err_lines)
    assert "llm_kernels.argmax_rows" in out
    assert f"process {first.pid} is building them; waiting" in err and "cpu kernels: built in" in err, err
    assert target.is_file() and not (build_dir / "lock").exists()
    # the next process loads the library as it is: no build, no wait
    third = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert third.returncode == 0 and "compiling" not in third.stderr and "waiting" not in third.stderr, third.stderr


def test_the_progress_line_counts_the_objects_this_build_wrote(tmp_path):
    """A rebuild (a source or header changed) finds the last build's objects in the folder: they are not progress."""
    last = tmp_path / "argmax.o"
    last.write_bytes(b"")
    os.utime(last, (1, 1))
    started = time.time() - 1  # the file system's clock may round a new file's time down a tick
    (tmp_path / "fused_ops.o").write_bytes(b"")
    (tmp_path / "build.ninja").write_bytes(b"")
    assert cpu_kernels._written_since(tmp_path, started) == 1
