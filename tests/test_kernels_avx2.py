"""What an AVX2-only CPU (AMD Zen 3) runs, on a machine that has AVX-512 too: the kernel, GEMM-tactic and
engine-vs-HF tests run again in a process whose kernels are built with -march=x86-64-v3 (LLM_KERNEL_MARCH),
whose oneDNN stops at AVX2 (ONEDNN_MAX_CPU_ISA: its bfloat16 path, which needs avx512bw/vl/dq, is then
refused) and whose ATen kernels are the AVX2 ones (ATEN_CPU_CAPABILITY). So `make test` on either CPU checks
both vector widths against the references (`AVX2_ONLY` also runs the whole suite so: docs/benchmarks-log.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.engine.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[1]
CPU_TESTS = ("tests/test_fused_ops.py", "tests/test_paged_attention.py", "tests/test_gemm.py", "tests/test_quantization.py",
             "tests/test_engine_correctness.py", "tests/test_sampler.py")
AVX2_ONLY = {"LLM_KERNEL_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


FLAGS = set(cpu_kernels.cpu_flags().split())


@pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="needs an AVX2 CPU")
@pytest.mark.skipif("avx512f" not in FLAGS, reason="an AVX2-only CPU (AMD Zen 3): the whole suite runs the AVX2 code")
def test_the_cpu_tests_pass_as_on_an_avx2_only_cpu():
    env = {**os.environ, **AVX2_ONLY}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CPU_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
