"""The CPU a benchmark ran on, named in every report: machines differ (AMD Zen 3 with AVX2 only, Zen 5 and
Intel Xeons with AVX-512, some with bf16 or AMX), and a figure without its CPU says little."""

from __future__ import annotations

import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_summary() -> str:
    """e.g. 'AMD EPYC 7B13 (x86_64; avx2)': the model name and the vector flags that choose kernels."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return f"{model} ({platform.machine()}; {' '.join(f for f in FLAGS if f in flags) or 'no avx2'})"
