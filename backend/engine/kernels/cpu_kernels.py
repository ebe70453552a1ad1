"""The CPU kernels of the eager PyTorch path, compiled on first use: paged attention (paged_attention.cpp), the
fused elementwise ops around the GEMMs (fused_ops.cpp), both over cpu_math.h, the float32 GEMM of the `f32_panels`
tactic (f32_linear.cpp), the bfloat16 AMX GEMM of `bf16_amx` (bf16_amx.cpp), the int8 GEMMs of the `quantization`
tactics (q8_linear.cpp, q8_0_w8a8.cpp, q4_1_w4a8.cpp), and the sampler's argmax (argmax.cpp); AMX tiles (amx.h) in
the GEMM and the bfloat16 prefill attention where the CPU has AMX-BF16. The GEMMs' and the decode attention's
threads take their items from shares that a thread done with its own takes from (work_queue.h); the int8 GEMMs
quantize their activations into memory the calling thread keeps (scratch.h).

They are built with the machine's own compiler for the machine's own CPU (-march=native: AVX-512 vectors
where the CPU has them), once per Python environment, into `$LLM_KERNEL_CACHE` or
`<repo>/.cache/kernels/<cpu>/<torch build>`; later loads take milliseconds. `LLM_KERNEL_MARCH` (e.g.
`x86-64-v3`: AVX2 and FMA) builds for another CPU level instead, so the 8-float AVX2 code is tested on an AVX-512
machine too (tests/test_kernels_avx2.py). Building needs a C++ compiler and ninja (pinned in requirements.txt).
The exported graph (ONNX Runtime, TensorRT) never uses them: models/llama.py keeps the torch ops they replace as
the reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "fused_ops.cpp", HERE / "f32_linear.cpp", HERE / "bf16_amx.cpp",
           HERE / "q8_linear.cpp", HERE / "q8_0_w8a8.cpp", HERE / "q4_1_w4a8.cpp", HERE / "argmax.cpp")
HEADERS = (HERE / "cpu_math.h", HERE / "amx.h", HERE / "scratch.h", HERE / "work_queue.h")
REPO_ROOT = HERE.parents[2]
_lock = threading.Lock()


def march() -> str:
    return os.environ.get("LLM_KERNEL_MARCH") or "native"


def cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def cpu_tag() -> str:
    """-march=native code runs only where it was built: key the build folder by the CPU's flags (and the -march
    when it is not native)."""
    level = "" if (target := march()) == "native" else f"-{target}"
    return f"{platform.machine()}-{hashlib.sha1(cpu_flags().encode()).hexdigest()[:10]}{level}"


def toolchain_tag() -> str:
    """The build's torch, its headers' folder, Python's and the compiler: each Python environment builds its own
    copy. In one folder, the Triton venv's processes and Dynamo's (torch's headers elsewhere, so another compile
    command) rebuilt every kernel (~90 s) at each switch, and a server starting meanwhile waited for it."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    parts = [torch.__version__, sysconfig.get_paths()["include"], os.environ.get("CXX", "c++"), *include_paths()]
    return f"torch{torch.__version__}-{hashlib.sha1(chr(0).join(parts).encode()).hexdigest()[:10]}"


def load() -> None:
    """Compile (or load the cached build of) the kernels: registers torch.ops.llm_kernels.*."""
    from torch.utils.cpp_extension import load as build

    with _lock:
        if loaded():
            return
        # torch runs the `ninja` found on PATH: the environment's own (pinned in requirements.txt), not a system one
        # whose other log format made each side rebuild everything (~90 s) after the other had built
        if (own := Path(sys.executable).parent / "ninja").is_file():
            os.environ["PATH"] = os.pathsep.join([str(own.parent), os.environ.get("PATH", "")])
        root = Path(os.environ.get("LLM_KERNEL_CACHE") or REPO_ROOT / ".cache" / "kernels")
        build_dir = root / cpu_tag() / toolchain_tag()
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch rebuilds when a source or a flag changes, not a header: put the header's hash in a flag
        headers = hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:12]
        log.info("cpu kernels: loading from %s (compiled there on first use, ~30 s)", build_dir)
        build(name="llm_kernels", sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
              extra_cflags=["-O3", f"-march={march()}", "-fopenmp", f"-DLLM_KERNELS_HEADERS={headers}"],
              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def loaded() -> bool:
    return hasattr(torch.ops.llm_kernels, "paged_attention")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [S, V]: by argmax.cpp when x is float32 on the CPU and a runner has loaded the
    kernels (sampling never builds them), else by torch."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and loaded():
        return torch.ops.llm_kernels.argmax_rows(x)
    return x.argmax(dim=-1)

