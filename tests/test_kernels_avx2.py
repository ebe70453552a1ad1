"""The CPU kernels' 8-float AVX2 code, on a machine whose native build takes the 16-float AVX-512 code: the
kernel tests run again in a process whose kernels are built with -march=x86-64-v3 (LLM_KERNEL_MARCH), so both
vector widths are checked against the torch reference wherever `make test` runs on an AVX2 CPU or better."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.engine.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ("tests/test_fused_ops.py", "tests/test_paged_attention.py")


@pytest.mark.skipif(not {"avx2", "fma"} <= set(cpu_kernels.cpu_flags().split()), reason="needs an AVX2 CPU")
def test_the_kernel_tests_pass_on_an_avx2_build():
    env = {**os.environ, "LLM_KERNEL_MARCH": "x86-64-v3"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
