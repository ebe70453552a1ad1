"""The CPU kernels of the eager PyTorch path, compiled once per CPU: paged attention (paged_attention.cpp), the
fused elementwise ops around the GEMMs (fused_ops.cpp), both over cpu_math.h, the float32 GEMM of the `f32_panels`
tactic (f32_linear.cpp), the bfloat16 AMX GEMM of `bf16_amx` (bf16_amx.cpp), the int8 GEMMs of the `quantization`
tactics (q8_linear.cpp, q8_0_w8a8.cpp, q4_1_w4a8.cpp), and the sampler's argmax (argmax.cpp); AMX tiles (amx.h) in
the GEMM and the bfloat16 prefill attention where the CPU has AMX-BF16. The GEMMs' and the decode attention's
threads take their items from shares that a thread done with its own takes from (work_queue.h); the int8 GEMMs
quantize their activations into memory the calling thread keeps (scratch.h); a mixture-of-experts layer's experts
run in one int8 GEMM call (expert_groups.h), its tokens grouped by expert and their outputs summed in one call
each (expert_routing.cpp); a K-quant's scales are read as stored (block_scales.h); the weight GEMMs prefetch their
next panel into L2 (prefetch.h). A step's decoder layers run in one call from Python where their Linears all
have our kernels (layer_program.cpp).

They are built with the machine's own compiler for the machine's own CPU (-march=native: AVX-512 vectors
where the CPU has them) into one shared library, `<cache>/<cpu>/llm_kernels-<key>.so` under `$LLM_KERNEL_CACHE` or
`<repo>/.cache/kernels`, keyed by the sources, the flags, torch's version, Python's ABI and the compiler: the
Triton venv and Dynamo's, with the same torch, load one build, and later loads take milliseconds. `make serve`,
`make test`, the Docker image and the launcher build it beforehand (`python -m backend.engine.kernels.cpu_kernels`,
with a progress line), so no server start compiles it under a load timeout. A process that finds it missing
builds it under a lock (flock: the kernel drops it when its owner dies, so a build killed midway holds nobody up,
and torch's own lock file that such a build leaves is removed by the next builder). `LLM_KERNEL_MARCH` (e.g.
`x86-64-v3`: AVX2 and FMA) builds for another CPU level instead, so the 8-float AVX2 code is tested on an AVX-512
machine too (tests/test_kernels_avx2.py). Building needs a C++ compiler and ninja (pinned in requirements.txt).
The exported graph (ONNX Runtime, TensorRT) never uses them: models/llama.py keeps the torch ops they replace as
the reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "fused_ops.cpp", HERE / "f32_linear.cpp", HERE / "bf16_amx.cpp",
           HERE / "q8_linear.cpp", HERE / "q8_0_w8a8.cpp", HERE / "q4_1_w4a8.cpp", HERE / "argmax.cpp",
           HERE / "expert_routing.cpp", HERE / "draw.cpp", HERE / "huge_pages.cpp", HERE / "layer_program.cpp")
HEADERS = (HERE / "cpu_math.h", HERE / "amx.h", HERE / "scratch.h", HERE / "work_queue.h", HERE / "expert_groups.h",
           HERE / "block_scales.h", HERE / "prefetch.h")
REPO_ROOT = HERE.parents[2]
PROGRESS_S = 10.0  # a build logs how far it is this often
_lock = threading.Lock()


def march() -> str:
    return os.environ.get("LLM_KERNEL_MARCH") or "native"


def cflags() -> list[str]:
    # torch's build reruns a compile when its source or command changes, not a header: the headers' hash is a flag
    headers = hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:12]
    return ["-O3", f"-march={march()}", "-fopenmp", f"-DLLM_KERNELS_HEADERS={headers}"]


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


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{cxx} {version.splitlines()[0] if version else ''}"


def library_path() -> Path:
    """Where this CPU's build of the current sources, flags, torch, Python ABI and compiler lies (or will)."""
    digest = hashlib.sha1()
    for part in (*(f.read_bytes() for f in SOURCES), *map(str.encode, cflags()), torch.__version__.encode(),
                 str(sysconfig.get_config_var("SOABI")).encode(), _compiler().encode()):
        digest.update(hashlib.sha1(part).digest())
    root = Path(os.environ.get("LLM_KERNEL_CACHE") or REPO_ROOT / ".cache" / "kernels")
    return root / cpu_tag() / f"llm_kernels-{digest.hexdigest()[:16]}.so"


def load() -> None:
    """Load the kernels, building them first if this CPU has no build of them: registers torch.ops.llm_kernels.*."""
    with _lock:
        if loaded():
            return
        path = library_path()
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            with _build_lock(path.parent):
                if not path.is_file():  # else another process built it while this one waited
                    _build(path)  # which loads it too
                    return
        torch.ops.load_library(str(path))


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """One builder a CPU folder at a time. flock, not a lock file's existence: the kernel releases it when the
    holder dies, so a build killed midway (a server stopped while it loaded) holds no later process up."""
    with open(folder / "build.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            log.info("cpu kernels: %s is building them; waiting for it", f.read().strip() or "another process")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(f"process {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(path: Path) -> None:
    """Compile the sources into `path` (and load them), logging progress: objects done, seconds, and what the last
    build on this CPU took."""
    from torch.utils.cpp_extension import load as build

    # torch runs the `ninja` found on PATH: the environment's own (pinned in requirements.txt), not a system one
    # whose other log format made each side rebuild everything (~90 s) after the other had built
    if (own := Path(sys.executable).parent / "ninja").is_file():
        os.environ["PATH"] = os.pathsep.join([str(own.parent), os.environ.get("PATH", "")])
    build_dir = path.parent / "build"  # one a CPU folder: a change to one source recompiles that source alone
    build_dir.mkdir(exist_ok=True)
    # torch's FileBaton: a build killed midway leaves it, and torch would wait on it forever. This process holds the
    # build lock, so no other is building here.
    (build_dir / "lock").unlink(missing_ok=True)
    timing = path.parent / "last_build_seconds"
    last = timing.read_text().strip() if timing.is_file() else None
    log.info("cpu kernels: compiling %d sources for -march=%s into %s (%s)", len(SOURCES), march(), path,
             f"the last build on this CPU took {last} s" if last else "the first build on this CPU")
    start, wall_start, done = time.monotonic(), time.time(), threading.Event()

    def progress() -> None:
        while not done.wait(PROGRESS_S):
            objects = _written_since(build_dir, wall_start)  # not the last build's objects, which the folder still has
            log.info("cpu kernels: %d of %d objects compiled, %.0f s%s", objects, len(SOURCES),
                     time.monotonic() - start, f" (of ~{last} s last time)" if last else "")

    reporter = threading.Thread(target=progress, name="kernel-build-progress", daemon=True)
    reporter.start()
    try:
        build(name="llm_kernels", sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
              extra_cflags=cflags(), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    finally:
        done.set()
    seconds = time.monotonic() - start
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    shutil.copyfile(build_dir / "llm_kernels.so", partial)
    os.replace(partial, path)  # whole or absent, for a process that loads it without the lock
    timing.write_text(f"{seconds:.0f}\n")
    log.info("cpu kernels: built in %.0f s: %s", seconds, path)


def _written_since(folder: Path, since: float) -> int:
    """The objects in `folder` written at or after `since` (time.time())."""
    written = 0
    for o in folder.glob("*.o"):
        with contextlib.suppress(FileNotFoundError):  # the compiler replacing it
            written += o.stat().st_mtime >= since
    return written


def loaded() -> bool:
    return hasattr(torch.ops.llm_kernels, "paged_attention")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [S, V]: by argmax.cpp when x is float32 on the CPU and a runner has loaded the
    kernels (sampling never builds them), else by torch."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and loaded():
        return torch.ops.llm_kernels.argmax_rows(x)
    return x.argmax(dim=-1)



def main() -> int:
    """Build (or find) this CPU's kernels ahead of the servers and tests that load them."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    try:
        load()
    except Exception as e:  # noqa: BLE001 - the runner falls back to the gather path; say why here, once
        log.error("cpu kernels: the build failed (%s); servers will use the slower gather attention", e)
        return 1
    log.info("cpu kernels: ready in %.1f s (%s)", time.monotonic() - start, library_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
