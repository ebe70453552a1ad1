"""GEMM tactics for the Linear layers, chosen per weight shape by measurement (TensorRT's tactic selection,
on the CPU).

No single GEMM is fastest on every CPU: torch's float32 `F.linear` goes to MKL, which runs AVX2 code on AMD
CPUs even where AVX-512 exists; oneDNN with a prepacked weight is faster there at decode sizes; on a CPU
with avx512_bf16 but no AMX, a native bfloat16 GEMM can be slower than a float32 one on the same weights.
So at load, each candidate is timed on each of the model's Linear shapes at a few token counts, and the
fastest per shape is kept. Choices are cached per CPU (model name and flags), torch version,
dtype, candidates and shape in `.cache/gemm/` (`$LLM_KERNEL_CACHE/../gemm` when set), so the second start
costs nothing. The first timing on a machine is kept even where other processes took a share of the CPUs while it
ran (cpu_share.py reads it; the log says so and how to time again): tactics round differently, and two processes
that serve one model (a test's engine and its server, a prefill and a decode worker) must compute the same numbers.
Processes that start together time under a file lock, one at a time, the later ones reading the first one's table.

A candidate is a tactic that runs on this CPU: each is probed once per process and dtype on a tiny weight
(oneDNN's bfloat16 path needs avx512bw/vl/dq or avx_ne_convert: an AVX2-only CPU such as AMD Zen 3 lacks it,
as does any CPU under `ONEDNN_MAX_CPU_ISA=AVX2`). Forcing one that does not run is refused by name at load.

Tactics (each returns the model dtype; the `_f32` ones compute a float32 product and sum, then round to the
model dtype: the arithmetic of a bf16 GEMM that accumulates in float32):
- `aten`: `F.linear` on the weight in the model dtype (MKL for float32 on x86; oneDNN for bfloat16).
- `onednn`: oneDNN with the weight prepacked once (`torch.ops.mkldnn._reorder_linear_weight`).
- `aten_f32`, `onednn_f32`: the same on a float32 copy of a bfloat16/float16 weight (2x its memory).
- `f32_panels`: ours (kernels/f32_linear.cpp), float32 multiply-adds over weights in panels that the loop prefetches
  ahead of them; ahead of oneDNN and MKL at decode sizes with the weights coming from DRAM. 16-bit weights (a
  bfloat16/float16 model's, or a float32 model's from a 16-bit checkpoint) stay in their 16 bits, widened exactly as
  they are loaded: the float32 copy's sums from half its bytes (one row from DRAM 2.0-2.2x faster, 16-64 rows 1.1-1.4x,
  prefill rows even: AMD EPYC Zen 3, AVX2, the 1B's shapes); the race times each tactic on the weights as stored.
- `bf16_amx`: ours (kernels/bf16_amx.cpp), bfloat16 weights in AMX tiles, the next panel prefetched; a bfloat16 model
  on a CPU with AMX-BF16 (Intel Xeon since Sapphire Rapids), where it reads decode-sized GEMMs' weights faster than
  oneDNN's own AMX GEMM.

Each candidate is timed as a step sees its weights: not in cache (a step reads every layer's before it comes back to
the first), by cycling through copies of the weight that together outgrow the caches. Timed on one cache-hot copy, a
decode-sized GEMM looked up to 2x faster than it runs in a step, and the table favoured whatever hid that best.

Quantized tactics change the numbers, so they never race the float ones: with `quantization` set, the tactics of
its weight form are the only candidates. Weights in llama.cpp's block forms (models/weight_blocks.py):
- `q8_0`: ours (kernels/q8_linear.cpp), Q8_0 weights (a scale per 32 weights along a row, or per 16: GGUF Q6_K,
  Q3_K; and a min per scale: GGUF Q5_1, Q5_K, Q2_K), activations float: the weights widened to float in registers.
- `q8_0_w8a8`: ours (kernels/q8_0_w8a8.cpp), the same weights times activations rounded the same way per call (32
  values of a row per scale), in int8 arithmetic (AVX512-VNNI, or AVX2's vpmaddubsw as llama.cpp's AVX2 dot product;
  16 rows at a time in AMX-INT8 tiles where the CPU has them; the same result bit for bit): llama.cpp's Q8_0 x Q8_0.
  A K-quant with a scale per 16 (Q6_K, Q3_K, Q2_K) has 6-bit values, packed in 6 bits as llama.cpp's Q6_K holds them
  (the same result bit for bit): 6.6 bits a weight instead of 10.6. At one row that is a Q6_K lm_head's read cut by
  38 %; where the kernel is compute-bound (16 rows and more) the unpacking costs ~10 %.
- `aten_int8`: `torch._weight_int8pack_mm`, a scale per output channel (float weights only, no GGUF blocks).
- `q4_1_w4a8` (int4): ours (kernels/q4_1_w4a8.cpp), Q4_1 weights (w ~ d q + m per 32; GGUF IQ4_NL / IQ4_XS: d times
  a 16-entry table's value of q) times activations rounded to int8 per 32, in int8 arithmetic (AVX512-VNNI, or
  AVX2; AMX-INT8 tiles from 32 rows, bit for bit the same): llama.cpp's Q4_1 x Q8_1.
On the GPU (`device: cuda`): `aten` (cuBLAS) for float weights; `triton_q8_0` and `triton_q4_1`
(kernels/triton_linear.py), the Q8_0 and Q4_1 forms above widened to the model dtype in registers, bf16/fp16 tensor
cores (float32 models in IEEE float32); one tactic per form there, so nothing is timed.
`int4` keeps the lm_head (the tied embedding: ~21 % of SmolLM2's weights, and the layer a logit error comes out
of directly) in Q8_0, as llama.cpp's own Q4 files do; `gguf` serves each Linear in its stored form (a fused one of
mixed forms in parts, each by the tactics of its form; the tactics are timed on Q8_0 for both Q8 scale widths;
the int8-activation kernels read a K-quant's scales as stored, int8 steps under a float16 unit, the file's d: the
same numbers).
Measured and left out: torch's dynamic-quantized Linear (FBGEMM, `quantized::linear_dynamic`) is fast but rounds
the activations with one scale per tensor; on SmolLM2 its logits kept the float32 argmax at 33 % of positions
(Q8_0: 88 %), since a few activation channels are far larger than the rest; `aten._weight_int4pack_mm_for_cpu`
(issue 29: 5.5x slower than float32 oneDNN on an AVX2 Zen 3).
"""

from __future__ import annotations

import fcntl
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

from backend.engine.cpu_share import CpuShare
from backend.engine.kernels.cpu_kernels import REPO_ROOT, cpu_tag
from backend.engine.models.checkpoint_format import AS_STORED
from backend.engine.models.weight_blocks import (Blocks, InputsPermuted, Q4Blocks, Q8Blocks, Weight, q4_1, q8_0,
                                                 rows_of)

log = logging.getLogger(__name__)
Gemm = Callable[[torch.Tensor], torch.Tensor]
QUANTIZATIONS = ("none", "int8", "int4", *AS_STORED)  # AS_STORED: a checkpoint's own blocks, served in their forms
LAYER_TOKENS = (16, 64, 256, 512)  # tokens per step: decode batches up to prefill-chunk budgets
HEAD_TOKENS = (4, 16, 64)  # lm_head sees one row per sequence
COLD_BYTES = 64 << 20  # weights cycled through when timing: past the L2 and the share of L3 a 2-core VM sees
# a table timed while other processes took more than this of the CPUs (on average, and in CPU-seconds, above
# /proc/stat's 10 ms ticks) is cached with a warning: its choices may be slower than a timing alone would make
CONTENDED_CPUS, CONTENDED_CPU_S = 0.25, 0.1
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


@dataclass(frozen=True)
class FloatBias:
    """A float32 kernel's product (+ bias) in the model dtype."""
    gemm: Gemm
    bias: torch.Tensor | None  # float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.dtype == torch.float32:  # a float32 model: nothing to convert (one call, not three)
            return self.gemm(x.contiguous())
        y = self.gemm(x.float().contiguous())
        return (y if self.bias is None else y + self.bias).to(x.dtype)


def _float_bias(bias: torch.Tensor | None, gemm: Gemm) -> FloatBias:
    return FloatBias(gemm, None if bias is None else bias.float())


NARROW = (torch.bfloat16, torch.float16)
HUGE_PAGE = 2 << 20


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A packed weight in memory of 2 MiB pages (kernels/huge_pages.cpp), where it fills at least one: a decode step
    streams it from DRAM, and with 4 KiB pages each 4 KiB of it costs a TLB miss."""
    return torch.ops.llm_kernels.in_huge_pages(t) if t.device.type == "cpu" and t.nbytes >= HUGE_PAGE else t


@dataclass(frozen=True)
class PackedKernel:
    """One of our GEMM kernels with its packed weight: `op(x, *panels, *shared, out_features)`. `panels` are per 16
    output channels along dim 0 (so the experts of a mixture-of-experts layer stack into one where the kernel has an
    `experts_op`: runners/expert_gemm.py), `shared` the same for every expert (a 4-bit index table)."""
    op: Callable[..., torch.Tensor]
    experts_op: Callable[..., torch.Tensor] | None
    panels: tuple[torch.Tensor, ...]
    shared: tuple[torch.Tensor, ...]
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, *self.panels, *self.shared, self.out_features)

    @classmethod
    def of(cls, op: Callable[..., torch.Tensor], experts_op: Callable[..., torch.Tensor] | None,
           panels: tuple[torch.Tensor, ...], shared: tuple[torch.Tensor, ...], out_features: int) -> PackedKernel:
        """With its panels in huge pages."""
        return cls(op, experts_op, tuple(map(in_huge_pages, panels)), shared, out_features)


def _f32_panels(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    # kept in its 16 bits: widened exactly as it is loaded
    packed = torch.ops.llm_kernels.f32_pack(weight if weight.dtype in NARROW else weight.float())
    return _float_bias(bias, PackedKernel.of(torch.ops.llm_kernels.f32_linear, None, (packed,), (), weight.shape[0]))


def _bf16_amx(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    packed, rows = in_huge_pages(torch.ops.llm_kernels.bf16_amx_pack(weight)), weight.shape[0]
    b = None if bias is None else bias.float()  # once here, not at every call
    return lambda x: torch.ops.llm_kernels.bf16_amx_linear(x, packed, b, rows)


def _q8_0(weight: torch.Tensor | Q8Blocks, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    blocks = weight if isinstance(weight, Q8Blocks) else q8_0(weight)
    packed, scales = torch.ops.llm_kernels.q8_0_pack(blocks.q, blocks.scale)
    return _float_bias(bias, PackedKernel.of(torch.ops.llm_kernels.q8_0_linear, None,
                                             (packed, scales, _panel_major(blocks.m)), (), blocks.q.shape[0]))


def _aten_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Gemm:
    q, scale = int8_per_channel(weight)
    return _float_bias(bias, lambda x: torch._weight_int8pack_mm(x, q, scale))


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [panels, 16, ...]: whole panels of 16 output channels, zero rows added."""
    panels = -(-t.shape[0] // 16)
    return torch.cat([t, t.new_zeros(panels * 16 - t.shape[0], *t.shape[1:])]).view(panels, 16, *t.shape[1:])


def _panel_major(t: torch.Tensor | None) -> torch.Tensor:
    """Per-block values [N, blocks] -> [panels, blocks, 16], as the kernels read scales and mins; None -> empty."""
    return torch.empty(0) if t is None else _panels(t).transpose(1, 2).contiguous()


def _narrowest(t: torch.Tensor) -> torch.Tensor:
    """float16 where every value is one (a GGUF file's own float16 scales), else as it is: the kernels read either as
    the same float32 numbers."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t


def _scales_as_read(blocks: Blocks) -> tuple[torch.Tensor, ...]:
    """(scales, mins, scale steps, min steps) of the int8 kernels (kernels/block_scales.h): a K-quant's stored steps
    under their units in float16 (the file's own d, so exact), else the scales, in float16 where that holds them
    exactly; an empty tensor for each that is not there."""
    s = blocks.stored
    if s is None:
        scale = blocks.scale if isinstance(blocks, Q8Blocks) else blocks.d
        return (_narrowest(_panel_major(scale)), _narrowest(_panel_major(blocks.m)), _panel_major(None),
                _panel_major(None))
    return (_panel_major(s.unit).half(), _panel_major(s.min_unit).half(), _panel_major(s.step),
            _panel_major(s.min_step))


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [panels, 16, K] -> the 4-bit kernels' layout [panels, K / 32, 256]: per 32-value block 4 groups
    of [16 channels][4 k], a byte holding k = 4g + j in its low nibble and 16 + 4g + j in its high one."""
    q = q.view(q.shape[0], 16, -1, 2, 4, 4)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(q.shape[0], -1, 256).contiguous()


def _six_bits(q: torch.Tensor) -> torch.Tensor:
    """int8 values -32..31 [panels, 16, K] -> q8_0_w8a8's 6-bit layout [panels, K / 32, 384] (kernels/q8_0_w8a8.cpp):
    u = q + 32's low 4 bits as _nibbles lays them out, then its top 2 bits in two planes of [16 channels][4 k] bytes,
    group g's at bits 2g and 2g + 1, the first plane for the low nibbles' values, the second for the high ones'."""
    if q.numel() and (q.min() < -32 or q.max() > 31):
        raise ValueError("q8_0_w8a8: a weight with a scale per 16 must have values in -32..31 (6 bits)")
    u = (q.to(torch.int16) + 32).to(torch.uint8)
    top = (u >> 4).view(u.shape[0], 16, -1, 2, 4, 4)  # [panels, channels, blocks, half, g, j]
    planes = sum(top[:, :, :, :, g] << (2 * g) for g in range(4)).permute(0, 2, 3, 1, 4)
    return torch.cat([_nibbles(u & 15), planes.reshape(u.shape[0], -1, 128)], dim=-1).contiguous()


def _q8_0_w8a8(weight: torch.Tensor | Q8Blocks, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    blocks = weight if isinstance(weight, Q8Blocks) else q8_0(weight)
    (n, k), q, b = blocks.q.shape, _panels(blocks.q), blocks.block
    scales, mins, scale_steps, min_steps = _scales_as_read(blocks)
    if b == 16:  # a K-quant's 16-weight sub-blocks (Q6_K, Q3_K, Q2_K): 6-bit values, read in 6 bits
        packed = _six_bits(q)
    else:  # 4 consecutive k of a channel together, as u = w + 128 (vpdpbusd's unsigned operand; the kernel's doc)
        packed = (q.view(-1, 16, k // 4, 4).transpose(1, 2).contiguous().view(torch.uint8) ^ 0x80)
    ops = torch.ops.llm_kernels
    return _float_bias(bias, PackedKernel.of(ops.q8_0_w8a8_linear, ops.q8_0_w8a8_experts,
                                             (packed, scales, mins, scale_steps, min_steps), (), n))


def _q4_1_w4a8(weight: torch.Tensor | Q4Blocks, bias: torch.Tensor | None) -> Gemm:
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    blocks = weight if isinstance(weight, Q4Blocks) else q4_1(weight)
    n, packed = blocks.q.shape[0], _nibbles(_panels(blocks.q))
    values = torch.empty(0, dtype=torch.int8) if blocks.values is None else blocks.values
    ops = torch.ops.llm_kernels
    return _float_bias(bias, PackedKernel.of(ops.q4_1_w4a8_linear, ops.q4_1_w4a8_experts,
                                             (packed, *_scales_as_read(blocks)), (values,), n))


def _triton_blocks(weight: torch.Tensor | Blocks, bias: torch.Tensor | None, form: Callable[..., Blocks]) -> Gemm:
    from backend.engine.kernels.triton_linear import BlocksLinear

    return BlocksLinear.of(weight if isinstance(weight, (Q8Blocks, Q4Blocks)) else form(weight), bias)


@dataclass(frozen=True)
class Tactic:
    name: str
    prepare: Callable[[torch.Tensor, torch.Tensor | None], Gemm]
    narrow_only: bool = False  # only for bfloat16 / float16 models
    keeps_narrow: bool = False  # serves a bfloat16 / float16 weight in a float32 model as is (float32 math)
    quantization: str = "none"  # the weights' rounding: only tactics of the engine's `quantization` race
    reads: type | None = None  # the stored block form it serves as is (`quantization: gguf`)
    devices: tuple[str, ...] = ("cpu",)


TACTICS = {t.name: t for t in (Tactic("aten", _aten, devices=("cpu", "cuda")), Tactic("onednn", _onednn),
                               Tactic("f32_panels", _f32_panels, keeps_narrow=True),
                               Tactic("bf16_amx", _bf16_amx, narrow_only=True),
                               Tactic("aten_f32", _in_f32(_aten), narrow_only=True),
                               Tactic("onednn_f32", _in_f32(_onednn), narrow_only=True),
                               Tactic("q8_0", _q8_0, quantization="int8", reads=Q8Blocks),
                               Tactic("q8_0_w8a8", _q8_0_w8a8, quantization="int8", reads=Q8Blocks),
                               Tactic("aten_int8", _aten_int8, quantization="int8"),
                               Tactic("q4_1_w4a8", _q4_1_w4a8, quantization="int4", reads=Q4Blocks),
                               Tactic("triton_q8_0", functools.partial(_triton_blocks, form=q8_0), quantization="int8",
                                      reads=Q8Blocks, devices=("cuda",)),
                               Tactic("triton_q4_1", functools.partial(_triton_blocks, form=q4_1), quantization="int4",
                                      reads=Q4Blocks, devices=("cuda",)))}
BACKENDS = ("auto", *TACTICS)


def may_keep_narrow(backend: str) -> bool:
    """Whether `backend` (a tactic, or `auto`'s race) may serve a 16-bit weight as stored in a float32 model."""
    return backend == "auto" or (backend in TACTICS and TACTICS[backend].keeps_narrow)


@functools.cache
def why_not(name: str, dtype: torch.dtype) -> str | None:
    """None when tactic `name` runs `dtype` on this CPU, else why not (the error it raises on a tiny weight)."""
    try:
        TACTICS[name].prepare(torch.ones(8, 32, dtype=dtype), None)(torch.ones(2, 32, dtype=dtype))
    except Exception as err:  # a oneDNN path this CPU cannot run, or our kernels that do not build here
        return str(err).splitlines()[0]
    return None


def candidates(dtype: torch.dtype, device: torch.device, quantization: str = "none", reads: type | None = None
               ) -> list[str]:
    """The tactics of `quantization` that run `dtype` here (and serve stored blocks of form `reads`, if given)."""
    return [t.name for t in TACTICS.values() if device.type in t.devices and t.quantization == quantization
            and reads in (None, t.reads) and (dtype != torch.float32 or not t.narrow_only)
            and (device.type != "cpu" or why_not(t.name, dtype) is None)]


@dataclass(frozen=True)
class Shape:
    out_features: int
    in_features: int
    tokens: tuple[int, ...]  # token counts to time at

    @property
    def key(self) -> str:
        """Its row of the cached table (after a dtype/candidates prefix), e.g. `960x576/(16, 64, 256, 512)`."""
        return f"{self.out_features}x{self.in_features}/{self.tokens}"


def _seconds_per_token(gemms: list[Gemm], shape: Shape, dtype: torch.dtype) -> float:
    """Median time per token over the shape's token counts, summed: each regime (decode, prefill) weighs
    the same. Each call takes the next of `gemms` (copies of one weight), so its weight comes from memory."""
    total = 0.0
    for m in shape.tokens:
        x = torch.randn(m, shape.in_features).to(dtype)
        reps = max(3, min(50, int(2e8 / (2 * m * shape.out_features * shape.in_features))))
        for gemm in gemms:  # first calls: oneDNN builds its kernels, pages are touched
            gemm(x)
        times = []
        for i in range(reps):
            gemm = gemms[i % len(gemms)]
            start = time.perf_counter()
            gemm(x)
            times.append(time.perf_counter() - start)
        total += statistics.median(times) / m
    return total


def measure(shape: Shape, dtype: torch.dtype, names: list[str], stored: torch.dtype | None = None
            ) -> dict[str, float]:
    """Seconds per token (summed over the shape's token counts) of each tactic that runs here, on copies of a weight
    that together take at least COLD_BYTES, each tactic given the weight as a model's load gives it: stored in
    `stored` (default `dtype`), in `dtype` unless the tactic serves it as stored (_in_dtype)."""
    stored = stored or dtype
    size = shape.out_features * shape.in_features * torch.finfo(stored).bits // 8
    copies = min(64, -(-COLD_BYTES // size))  # a tiny model's weights stay in cache in any case
    weights = [torch.randn(shape.out_features, shape.in_features).to(stored) for _ in range(copies)]
    return {name: _seconds_per_token([TACTICS[name].prepare(_in_dtype(w, TACTICS[name], dtype), None) for w in weights],
                                     shape, dtype) for name in names}


def cache_file() -> Path:
    kernels = os.environ.get("LLM_KERNEL_CACHE")
    root = Path(kernels).parent / "gemm" if kernels else REPO_ROOT / ".cache" / "gemm"
    return root / f"{cpu_tag()}-torch{torch.__version__}.json"


def choose(shapes: list[Shape], dtype: torch.dtype, device: torch.device, backend: str = "auto",
           quantization: str = "none", reads: type | None = None, stored: torch.dtype | None = None
           ) -> dict[Shape, str]:
    """The tactic for each shape: `backend` itself when forced, else the fastest of `quantization`'s measured here
    (on float weights stored in `stored`, if not `dtype`: 16 bits that f32_panels serves as stored in a float32
    model)."""
    if backend not in BACKENDS:
        raise ValueError(f"gemm_backend: expected one of {list(BACKENDS)}, got {backend!r}")
    names = candidates(dtype, device, quantization, reads)
    if not names:
        raise ValueError(f"quantization: {quantization} has no tactic on {device.type}")
    if backend != "auto":
        if backend not in names:
            why = (f"not a {quantization} tactic (quantization: {quantization})"
                   if TACTICS[backend].quantization != quantization else
                   f"it reads no stored {reads.__name__}" if reads not in (None, TACTICS[backend].reads) else
                   f"it runs on {'/'.join(TACTICS[backend].devices)}" if device.type not in TACTICS[backend].devices
                   else why_not(backend, dtype))
            raise ValueError(f"gemm_backend: {backend} cannot run {str(dtype).removeprefix('torch.')} on this "
                             f"{device.type} ({why}); candidates: {names}")
        return {s: backend for s in shapes}
    if len(names) == 1:
        return {s: names[0] for s in shapes}
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # the candidates are in the key: a row timed where others ran (another ONEDNN_MAX_CPU_ISA) is timed again
    # not the thread count: a process whose CPU share cut its threads must still pick what the others picked
    held = "" if stored in (None, dtype) else f"<-{str(stored).removeprefix('torch.')}"
    prefix = f"{str(dtype).removeprefix('torch.')}{held}/{'+'.join(names)}"
    with _lock, open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process that starts while another times waits and reads its choices
        table = json.loads(path.read_text()) if path.is_file() else {}
        missing = [s for s in shapes if f"{prefix}/{s.key}" not in table]
        if missing:
            log.info("gemm: timing %s on %d shapes (cached in %s)", "/".join(names), len(missing), path)
            share, start = CpuShare.start(), time.monotonic()
            timings = {shape: measure(shape, dtype, names, stored) for shape in missing}
            others = share.others() if share else 0.0
            for shape, times in timings.items():
                table[f"{prefix}/{shape.key}"] = {"choice": min(times, key=times.get), "others_cpus": round(others, 2),
                                                  "us_per_token": {k: v * 1e6 for k, v in times.items()}}
            if others > CONTENDED_CPUS and others * (time.monotonic() - start) > CONTENDED_CPU_S:
                log.warning("gemm: other processes used %.1f CPUs while the tactics were timed; the choices are cached "
                            "all the same (every process here computes the same numbers); delete %s to time them "
                            "again alone", others, path)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            tmp.replace(path)
    chosen = {s: table[f"{prefix}/{s.key}"] for s in shapes}
    log.info("gemm tactics (%s, %d threads, us/token summed over token counts):\n%s", prefix.split("/")[0],
             torch.get_num_threads(), "\n".join(
                 f"  {k.key:>30}: {v['choice']:<10} " + " ".join(f"{n}={t:.2f}" for n, t in v["us_per_token"].items())
                 for k, v in chosen.items()))
    return {k: v["choice"] for k, v in chosen.items()}


def _form(quantization: str, name: str, weight: Blocks | InputsPermuted | torch.Tensor) -> tuple[str, type | None]:
    """(tactic quantization, stored block form) that serve `weight` of Linear `name`; a stored float tensor is
    float's."""
    if quantization in AS_STORED:
        form = type(getattr(weight, "blocks", weight))
        return {Q8Blocks: ("int8", Q8Blocks), Q4Blocks: ("int4", Q4Blocks)}.get(form, ("none", None))
    if quantization == "int4" and name == "lm_head":
        return "int8", None
    return quantization, None


def use_tactics(model: nn.Module, device: torch.device, backend: str = "auto", quantization: str = "none",
                stored: dict[str, Weight] | None = None, dtype: torch.dtype | None = None) -> dict[Shape, str]:
    """Give every nn.Linear of `model` its tactic as `linear.gemm`, from its float weight or (gguf) from the `stored`
    weight of its name (each part of a `Stacked` one its own tactic, the outputs concatenated; an `InputsPermuted` one
    gathers its inputs first); a tactic that keeps its own copy of the weight (packed, float32 or int8), and every
    stored one, releases the module's; `stored` is consumed, each weight dropped once its tactic holds it. A forced
    `backend` serves the Linears of its form (int4's Q8_0 lm_head picks its own). `dtype` is the model's (default: its
    Linears' weights', unless load_model left them in their stored 16 bits)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected one of {list(QUANTIZATIONS)}, got {quantization!r}")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    parts = {name: [m.weight] if stored is None else list(getattr(stored[name], "parts", [stored[name]]))
             for name, m in linears.items()}
    units = [(name, i) for name, weights in parts.items() for i in range(len(weights))]
    shapes = {(name, i): Shape(rows_of(parts[name][i]), linears[name].in_features,
                               HEAD_TOKENS if name == "lm_head" else LAYER_TOKENS) for name, i in units}
    dtype = dtype or next(iter(linears.values())).weight.dtype
    forms = {(name, i): (*_form(quantization, name, parts[name][i]), _float_dtype(parts[name][i], dtype))
             for name, i in units}
    forced = TACTICS[backend].quantization if backend in TACTICS else None
    served = {form[0] for form in forms.values()}
    chosen: dict[tuple[str, int], str] = {}
    for form in sorted(set(forms.values()), key=str):
        of_form = [unit for unit in units if forms[unit] == form]
        # a forced tactic serves its own form; one of no form served here goes to each, which refuses it by name
        own = backend if forced in (None, form[0]) or forced not in served else "auto"
        picks = choose(sorted({shapes[u] for u in of_form}, key=lambda s: s.key), dtype, device, own, *form)
        chosen.update({unit: picks[shapes[unit]] for unit in of_form})
    for name, linear in linears.items():
        gemms, first = [], 0
        if stored is not None:
            stored.pop(name)  # with parts[name] below: each stored weight freed once packed, not all after the last
        for i, weight in enumerate(parts.pop(name)):
            rows = rows_of(weight)
            bias = None if linear.bias is None else linear.bias[first:first + rows]
            first += rows
            tactic = TACTICS[chosen[name, i]]
            if isinstance(weight, InputsPermuted):
                gemms.append(functools.partial(_inputs_permuted, tactic.prepare(weight.blocks, bias), weight.index))
            else:
                gemms.append(tactic.prepare(_in_dtype(weight, tactic, dtype), bias))
        linear.gemm = gemms[0] if len(gemms) == 1 else functools.partial(_concatenated, gemms)
        if chosen[name, 0] != "aten" or stored is not None or linear.weight.dtype != dtype:  # aten's is not its own
            linear.weight = linear.bias = None
    return {shapes[unit]: tactic for unit, tactic in chosen.items()}


def _float_dtype(weight: Weight, dtype: torch.dtype) -> torch.dtype | None:
    """A float weight's dtype where it is not the model's (the tactics are timed on it as stored), else None."""
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.dtype != dtype else None


def _in_dtype(weight: Weight, tactic: Tactic, dtype: torch.dtype) -> Weight:
    """A float weight in the model's dtype; blocks, and a 16-bit weight that the tactic widens exactly itself (a
    float32 model: half a float32 copy's bytes), as they are."""
    if not isinstance(weight, torch.Tensor):
        return weight
    widened_by_tactic = tactic.keeps_narrow and dtype == torch.float32 and weight.dtype in NARROW
    return weight if widened_by_tactic else weight.to(dtype)


def _inputs_permuted(gemm: Gemm, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return gemm(x.index_select(-1, index))


def _concatenated(gemms: list[Gemm], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([gemm(x) for gemm in gemms], dim=-1)


@dataclass(frozen=True)
class KernelCall:
    """A float32 Linear's part as one call of our kernels: op(x, *tensors, *ints) (+ bias)."""
    op: str  # the kernel's qualified name, llm_kernels::...
    tensors: list[torch.Tensor]
    ints: list[int]
    bias: torch.Tensor | None


def kernel_calls(gemm: Gemm) -> list[KernelCall] | None:
    """A float32 Linear's gemm as the calls of our kernels that make it, its parts' outputs concatenated; None where
    a part is another tactic (oneDNN, aten, an InputsPermuted weight's gather)."""
    parts = gemm.args[0] if isinstance(gemm, functools.partial) and gemm.func is _concatenated else [gemm]
    if not all(isinstance(part, FloatBias) and isinstance(part.gemm, PackedKernel) for part in parts):
        return None
    return [KernelCall(part.gemm.op._qualified_op_name, [*part.gemm.panels, *part.gemm.shared],
                       [part.gemm.out_features], part.bias) for part in parts]
