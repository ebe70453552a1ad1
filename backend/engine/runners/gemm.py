"""GEMM tactics for the Linear layers, chosen per weight shape by measurement (TensorRT's tactic selection,
on the CPU).

No single GEMM is fastest on every CPU: torch's float32 `F.linear` goes to MKL, which runs AVX2 code on AMD
CPUs even where AVX-512 exists; oneDNN with a prepacked weight is faster there at decode sizes; on a CPU
with avx512_bf16 but no AMX, a native bfloat16 GEMM can be slower than a float32 one on the same weights.
So at load, each candidate is timed on each of the model's Linear shapes at a few token counts, and the
fastest per shape is kept. Choices are cached per CPU (model name and flags), torch version, thread count,
dtype, candidates and shape in `.cache/gemm/` (`$LLM_KERNEL_CACHE/../gemm` when set), so the second start
costs nothing.

A candidate is a tactic that runs on this CPU: each is probed once per process and dtype on a tiny weight
(oneDNN's bfloat16 path needs avx512bw/vl/dq or avx_ne_convert: an AVX2-only CPU such as AMD Zen 3 lacks it,
as does any CPU under `ONEDNN_MAX_CPU_ISA=AVX2`). Forcing one that does not run is refused by name at load.

Tactics (each returns the model dtype; the `_f32` ones compute a float32 product and sum, then round to the
model dtype: the arithmetic of a bf16 GEMM that accumulates in float32):
- `aten`: `F.linear` on the weight in the model dtype (MKL for float32 on x86; oneDNN for bfloat16).
- `onednn`: oneDNN with the weight prepacked once (`torch.ops.mkldnn._reorder_linear_weight`).
- `aten_f32`, `onednn_f32`: the same on a float32 copy of a bfloat16/float16 weight (2x its memory).

Quantized tactics (`quantization: int8`) change the numbers, so they never race the float ones: with int8 set,
they are the only candidates. Both are weight-only (activations stay float) and symmetric (scale max|w| / 127):
- `q8_0`: ours (kernels/q8_linear.cpp), llama.cpp's Q8_0 rounding (a scale per 32 weights along a row), the
  weights widened to float in registers.
- `q8_0_w8a8`: ours (kernels/q8_0_w8a8.cpp), the same weights times activations rounded the same way per call (32
  values of a row per scale), in int8 arithmetic (AVX512-VNNI only): llama.cpp's Q8_0 x Q8_0.
- `aten_int8`: `torch._weight_int8pack_mm`, a scale per output channel.
Measured and left out: torch's dynamic-quantized Linear (FBGEMM, `quantized::linear_dynamic`) is fast but rounds
the activations with one scale per tensor; on SmolLM2 its logits kept the float32 argmax at 33 % of positions
(Q8_0: 88 %), since a few activation channels are far larger than the rest.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from backend.engine.kernels.cpu_kernels import REPO_ROOT, cpu_tag

log = logging.getLogger(__name__)
Gemm = Callable[[torch.Tensor], torch.Tensor]
QUANTIZATIONS = ("none", "int8")
LAYER_TOKENS = (16, 64, 256, 512)  # tokens per step: decode batches up to prefill-chunk budgets
HEAD_TOKENS = (4, 16, 64)  # lm_head sees one row per sequence
_lock = threading.Lock()


def _aten(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    return lambda x: F.linear(x, weight, bias)


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _in_f32(make: Callable[[torch.Tensor, torch.Tensor | None], Gemm]) -> Callable[..., Gemm]:
    def prepare(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
        gemm = make(weight.float(), None if bias is None else bias.float())
        return lambda x: gemm(x.float()).to(x.dtype)
    return prepare


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output channel): w ~ q * scale, |q| <= 127."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_blocks(weight: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], float32 scales [N, K / block]): Q8_0, each run of `block` weights along a row rounded
    with its own scale (round half to even)."""
    n, k = weight.shape
    if k % block:
        raise RuntimeError(f"q8_0: in_features must be a multiple of {block}, got {k}")
    w = weight.float().reshape(n, k // block, block)
    amax = w.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(w * inv[..., None]).to(torch.int8).reshape(n, k), (amax / 127).contiguous()


def _q8_0(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    packed, scales = torch.ops.llm_kernels.q8_0_pack(*int8_blocks(weight))
    n, b = weight.shape[0], None if bias is None else bias.float()

    def gemm(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.llm_kernels.q8_0_linear(x.float().contiguous(), packed, scales, n)
        return (y if b is None else y + b).to(x.dtype)
    return gemm


def _aten_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    q, scale = int8_per_channel(weight)
    b = None if bias is None else bias.float()

    def gemm(x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.float(), q, scale)
        return (y if b is None else y + b).to(x.dtype)
    return gemm


def _q8_0_w8a8(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    q, scales = int8_blocks(weight)
    (n, k), panels = q.shape, -(-q.shape[0] // 16)
    q = torch.cat([q, q.new_zeros(panels * 16 - n, k)])  # whole panels of 16 output channels
    scales = torch.cat([scales, scales.new_zeros(panels * 16 - n, k // 32)])
    packed = q.view(panels, 16, k // 4, 4).transpose(1, 2).contiguous()  # 4 consecutive k of a channel together
    block_scales = scales.view(panels, 16, k // 32).transpose(1, 2).contiguous()
    # each block's dot product of (x + 128) and w carries 128 * sum(w): the accumulator starts from minus that
    comp = (-128 * q.view(panels, 16, k // 32, 32).sum(-1, dtype=torch.int32)).transpose(1, 2).contiguous()
    b = None if bias is None else bias.float()

    def gemm(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.llm_kernels.q8_0_w8a8_linear(x.float().contiguous(), packed, block_scales, comp, n)
        return (y if b is None else y + b).to(x.dtype)
    return gemm


@dataclass(frozen=True)
class Tactic:
    name: str
    prepare: Callable[[torch.Tensor, torch.Tensor | None], Gemm]
    narrow_only: bool = False  # only for bfloat16 / float16 models
    quantization: str = "none"  # the weights' rounding: only tactics of the engine's `quantization` race


TACTICS = {t.name: t for t in (Tactic("aten", _aten), Tactic("onednn", _onednn),
                               Tactic("aten_f32", _in_f32(_aten), narrow_only=True),
                               Tactic("onednn_f32", _in_f32(_onednn), narrow_only=True),
                               Tactic("q8_0", _q8_0, quantization="int8"),
                               Tactic("q8_0_w8a8", _q8_0_w8a8, quantization="int8"),
                               Tactic("aten_int8", _aten_int8, quantization="int8"))}
BACKENDS = ("auto", *TACTICS)


@functools.cache
def why_not(name: str, dtype: torch.dtype) -> str | None:
    """None when tactic `name` runs `dtype` on this CPU, else why not (the error it raises on a tiny weight)."""
    try:
        TACTICS[name].prepare(torch.ones(8, 32, dtype=dtype), None)(torch.ones(2, 32, dtype=dtype))
    except Exception as err:  # a oneDNN path this CPU cannot run, or our kernels that do not build here
        return str(err).splitlines()[0]
    return None


def candidates(dtype: torch.dtype, device: torch.device, quantization: str = "none") -> list[str]:
    """The tactics of `quantization` that run `dtype` here."""
    if device.type != "cpu":
        return ["aten"] if quantization == "none" else []
    return [t.name for t in TACTICS.values() if t.quantization == quantization
            and (dtype != torch.float32 or not t.narrow_only) and why_not(t.name, dtype) is None]


@dataclass(frozen=True)
class Shape:
    out_features: int
    in_features: int
    tokens: tuple[int, ...]  # token counts to time at

    @property
    def key(self) -> str:
        """Its row of the cached table (after a dtype/threads/candidates prefix), e.g. `960x576/(16, 64, 256, 512)`."""
        return f"{self.out_features}x{self.in_features}/{self.tokens}"


def _seconds_per_token(gemm: Gemm, shape: Shape, dtype: torch.dtype) -> float:
    """Median time per token over the shape's token counts, summed: each regime (decode, prefill) weighs
    the same."""
    total = 0.0
    for m in shape.tokens:
        x = torch.randn(m, shape.in_features).to(dtype)
        reps = max(3, min(50, int(2e8 / (2 * m * shape.out_features * shape.in_features))))
        gemm(x)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            gemm(x)
            times.append(time.perf_counter() - start)
        total += statistics.median(times) / m
    return total


def measure(shape: Shape, dtype: torch.dtype, names: list[str]) -> dict[str, float]:
    """Seconds per token (summed over the shape's token counts) of each tactic that runs here."""
    weight = torch.randn(shape.out_features, shape.in_features).to(dtype)
    return {name: _seconds_per_token(TACTICS[name].prepare(weight, None), shape, dtype) for name in names}


def cache_file() -> Path:
    kernels = os.environ.get("LLM_KERNEL_CACHE")
    root = Path(kernels).parent / "gemm" if kernels else REPO_ROOT / ".cache" / "gemm"
    return root / f"{cpu_tag()}-torch{torch.__version__}.json"


def choose(shapes: list[Shape], dtype: torch.dtype, device: torch.device, backend: str = "auto",
           quantization: str = "none") -> dict[Shape, str]:
    """The tactic for each shape: `backend` itself when forced, else the fastest of `quantization`'s measured here."""
    if backend not in BACKENDS:
        raise ValueError(f"gemm_backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected one of {list(QUANTIZATIONS)}, got {quantization!r}")
    names = candidates(dtype, device, quantization)
    if not names:
        raise ValueError(f"quantization: {quantization} has no tactic on {device.type} (CPU only)")
    if backend != "auto":
        if backend not in names:
            why = (f"not a {quantization} tactic (quantization: {quantization})"
                   if TACTICS[backend].quantization != quantization else
                   why_not(backend, dtype) if device.type == "cpu" else "CPU only")
            raise ValueError(f"gemm_backend: {backend} cannot run {str(dtype).removeprefix('torch.')} on this "
                             f"{device.type} ({why}); candidates: {names}")
        return {s: backend for s in shapes}
    if len(names) == 1:
        return {s: names[0] for s in shapes}
    path = cache_file()
    with _lock:
        table = json.loads(path.read_text()) if path.is_file() else {}
        # the candidates are in the key: a row timed where others ran (another ONEDNN_MAX_CPU_ISA) is timed again
        prefix = f"{str(dtype).removeprefix('torch.')}/threads{torch.get_num_threads()}/{'+'.join(names)}"
        missing = [s for s in shapes if f"{prefix}/{s.key}" not in table]
        if missing:
            log.info("gemm: timing %s on %d shapes (cached in %s)", "/".join(names), len(missing), path)
        for shape in missing:
            timings = measure(shape, dtype, names)
            table[f"{prefix}/{shape.key}"] = {
                "choice": min(timings, key=timings.get), "us_per_token": {k: v * 1e6 for k, v in timings.items()}}
        if missing:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            tmp.replace(path)
    chosen = {s: table[f"{prefix}/{s.key}"] for s in shapes}
    log.info("gemm tactics (%s, %d threads, us/token summed over token counts):\n%s", prefix.split("/")[0],
             torch.get_num_threads(), "\n".join(
                 f"  {k.key:>30}: {v['choice']:<10} " + " ".join(f"{n}={t:.2f}" for n, t in v["us_per_token"].items())
                 for k, v in chosen.items()))
    return {k: v["choice"] for k, v in chosen.items()}


def use_tactics(model: nn.Module, device: torch.device, backend: str = "auto", quantization: str = "none"
                ) -> dict[Shape, str]:
    """Give every nn.Linear of `model` its tactic as `linear.gemm`; a tactic that keeps its own copy of the
    weight (packed, float32 or int8) releases the module's."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    shapes = {name: Shape(m.out_features, m.in_features, HEAD_TOKENS if name == "lm_head" else LAYER_TOKENS)
              for name, m in linears.items()}
    dtype = next(iter(linears.values())).weight.dtype
    chosen = choose(sorted(set(shapes.values()), key=lambda s: s.key), dtype, device, backend, quantization)
    for name, linear in linears.items():
        tactic = chosen[shapes[name]]
        linear.gemm = TACTICS[tactic].prepare(linear.weight, linear.bias)
        if tactic != "aten":
            linear.weight = linear.bias = None
    return chosen
