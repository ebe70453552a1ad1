"""Quantized Linear weights in llama.cpp's block forms, as the int8/int4 GEMM tactics read them (runners/gemm.py):
rounded at load from a float weight (`quantization: int8 | int4`), or decoded from a GGUF file's own blocks without
a float copy (`quantization: gguf`, models/gguf_weights.py). A GGUF tensor of another type is a float tensor
(`Weight`): F16 / BF16 as stored, the others (IQ2_XS, IQ3_S, ...) float32 of their dequantized values, served by the
float tactics.

- `Q8Blocks` (GGUF Q8_0): w ~ q * scale, q int8, one scale per 32 weights along a row. Q5_0 (w ~ d (q - 16), q in
  0..31) is q - 16 on scale d: exact, so a Q4_K_M file of a model whose rows are not whole 256-value blocks (llama.cpp
  then falls back to Q5_0 for Q4_K) reaches the int8 kernels as stored. Q6_K (w ~ d * sc (q - 32) per 16, q in
  0..63, sc int8, d float16) is q - 32 on a scale per 16 weights, d * sc: exact in float32 (11 + 7 bits), and so is
  each weight, that times a 6-bit q; so is Q3_K (w ~ d (sc6 - 32) q per 16, q in -4..3). With a min per scale
  (w ~ q * scale + m): Q5_1 and Q5_K's 32-weight sub-blocks (q in 0..31; Q5_K's scale = d * scale6, m = -dmin *
  min6, as Q4_K's), Q2_K's 16-weight ones (q in 0..3, d * sc4 and -dmin * min4).
- `Q4Blocks` (GGUF Q4_1): w ~ d * q + m, q in 0..15, a (d, m) pair per 32 weights. Q4_0 (w ~ d (q - 8)) is
  m = -8 d, and Q4_K's 32-weight sub-blocks are d = d_super * scale6, m = -dmin_super * min6: both exact in float32,
  so each GGUF 4-bit format reaches one kernel with its numbers unchanged. With `values` (IQ4_NL, IQ4_XS) q is an
  index and there is no min: w ~ d * values[q], values llama.cpp's 16 int8 (IQ4_VALUES), d per 32 (IQ4_XS:
  d * (sc6 - 32)); the kernel then reads 5 bits a weight instead of 6. MXFP4 (gpt-oss's experts) is the same with
  its own table, the E2M1 values doubled (MXFP4_VALUES), and d = 2^(e - 128) from its E8M0 byte e: exact in float32.
A K-quant's scales (and mins) also keep their stored form (`SuperScales`: small integers under a float16 d per 256
weights), which the int8 kernels read instead of the float32 products: a Q4_K weight in 4.75 bits, not 6.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

BLOCK = 32


@dataclass(frozen=True)
class SuperScales:
    """A K-quant's scales as stored: scale = unit * step, an int8 step per scale and a unit (its float16 d, held in
    float32; the kernels read it in float16) per 256 weights along a row, each product exact in float32; mins the
    same, or None."""
    step: torch.Tensor  # int8 [N, scales per row]
    unit: torch.Tensor  # float32 [N, K / 256]
    min_step: torch.Tensor | None = None
    min_unit: torch.Tensor | None = None

    @staticmethod
    def _products(step: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        return (unit[..., None] * step.float().reshape(*unit.shape, -1)).reshape(step.shape).contiguous()

    def scales(self) -> torch.Tensor:
        return self._products(self.step, self.unit)

    def mins(self) -> torch.Tensor | None:
        return None if self.min_step is None else self._products(self.min_step, self.min_unit)

    def rows(self, index: torch.Tensor) -> SuperScales:
        return SuperScales(*(None if t is None else t[index] for t in (self.step, self.unit, self.min_step,
                                                                         self.min_unit)))

    @staticmethod
    def cat(parts: list[SuperScales | None]) -> SuperScales | None:
        """Stacked rows; None unless every part has them in the same form (the kernels then read the products)."""
        if any(p is None or (p.min_step is None) != (parts[0].min_step is None) for p in parts):
            return None
        return SuperScales(*(None if ts[0] is None else torch.cat(ts) for ts in
                             zip(*((p.step, p.unit, p.min_step, p.min_unit) for p in parts))))


@dataclass(frozen=True)
class Q8Blocks:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / 32], or [N, K / 16] (Q6_K, Q3_K, Q2_K)
    m: torch.Tensor | None = None  # float32, as scale (Q5_1, Q5_K, Q2_K)
    stored: SuperScales | None = None  # scale and m as a K-quant stores them

    @property
    def block(self) -> int:
        """Weights per scale along a row: 32, or 16."""
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().reshape(n, -1, self.block) * self.scale[..., None]
        return (w if self.m is None else w + self.m[..., None]).reshape(n, k)


@dataclass(frozen=True)
class Q4Blocks:
    q: torch.Tensor  # uint8 [N, K], values 0..15
    d: torch.Tensor  # float32 [N, K / 32]
    m: torch.Tensor | None  # float32 [N, K / 32]; None with values
    values: torch.Tensor | None = None  # int8 [16]: the weight of each q, before d (None: q itself, plus m)
    stored: SuperScales | None = None  # d and m as a K-quant stores them

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        if self.values is not None:
            return (self.values[self.q.long()].float().reshape(n, -1, BLOCK) * self.d[..., None]).reshape(n, k)
        return (self.q.float().reshape(n, -1, BLOCK) * self.d[..., None] + self.m[..., None]).reshape(n, k)


Blocks = Q8Blocks | Q4Blocks


@dataclass(frozen=True)
class Stacked:
    """A fused Linear's output channels in parts of different forms (a Q4_K_M's Q4_K q/k beside its Q6_K v): each
    part is served by the tactics of its own form, and their outputs are concatenated (runners/gemm.py)."""
    parts: tuple[Blocks | torch.Tensor, ...]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([as_float(p) for p in self.parts])


@dataclass(frozen=True)
class InputsPermuted:
    """Blocks whose input features are in the order `index` (a GPTQ act-order Linear, its groups sorted into whole
    blocks): its GEMM reads x[..., index] (runners/gemm.py)."""
    blocks: Blocks
    index: torch.Tensor  # int64 [K]: the input feature of each of the blocks' columns

    def dequantize(self) -> torch.Tensor:
        w = self.blocks.dequantize()
        return torch.empty_like(w).index_copy_(1, self.index, w)


Weight = Blocks | InputsPermuted | torch.Tensor | Stacked  # a tensor: F16 / BF16 as stored, other types dequantized
STORED = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "MXFP4")
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # ggml's kvalues_mxfp4


def as_float(weight: Weight) -> torch.Tensor:
    return weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()


def _blocks_of(weight: torch.Tensor, form: str) -> torch.Tensor:
    n, k = weight.shape
    if k % BLOCK:
        raise RuntimeError(f"{form}: in_features must be a multiple of {BLOCK}, got {k}")
    return weight.float().reshape(n, k // BLOCK, BLOCK)


def q8_0(weight: torch.Tensor) -> Q8Blocks:
    """llama.cpp's quantize_row_q8_0: scale max|w| / 127, round half to even."""
    w = _blocks_of(weight, "q8_0")
    amax = w.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return Q8Blocks(torch.round(w * inv[..., None]).to(torch.int8).reshape(weight.shape), (amax / 127).contiguous())


def q4_1(weight: torch.Tensor) -> Q4Blocks:
    """llama.cpp's quantize_row_q4_1 (d = (max - min) / 15, m = min, q = floor((w - m) / d + 0.5) clamped to 15),
    with d and m kept in float32 rather than GGUF's float16."""
    w = _blocks_of(weight, "q4_1")
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.floor((w - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15)
    return Q4Blocks(q.to(torch.uint8).reshape(weight.shape), d.contiguous(), lo.contiguous())


def _half(raw: np.ndarray) -> torch.Tensor:
    """float16 bytes [..., 2] -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes, a little-endian uint32 -> [..., 32] bits, value i's at bit i."""
    return (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(BLOCK, dtype=np.uint32)) & 1


def _steps(a: np.ndarray) -> torch.Tensor:
    """Small integers [rows, super-blocks, per super-block] -> int8 [rows, scales per row]."""
    return torch.from_numpy(a.astype(np.int8).reshape(a.shape[0], -1))


def _k_scales(b: np.ndarray) -> SuperScales:
    """A Q4_K / Q5_K super-block's leading 16 bytes (d, dmin float16, 12 bytes of 6-bit scales and mins) -> its 8
    sub-blocks' scales d * scale6 and mins -dmin * min6."""
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    s = b[..., 4:16].astype(np.uint8)
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scale6 = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    min6 = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return SuperScales(_steps(scale6), d, _steps(min6), -dmin)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low nibbles are the first 16 values, the high ones the next 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def from_gguf(type_name: str, data: np.ndarray, rows: int, cols: int) -> Blocks:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes per row]) as Q8Blocks / Q4Blocks, values unchanged."""
    nb = cols // BLOCK
    if type_name == "Q8_0":  # per block: d f16, 32 x int8
        b = data.reshape(rows, nb, 34)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, cols).copy())
        return Q8Blocks(q, _half(b[..., :2]).contiguous())
    if type_name in ("Q5_0", "Q5_1"):  # per block: d f16, (m f16), 32 fifth bits (uint32), 16 bytes of nibbles
        b = data.reshape(rows, nb, 22 if type_name == "Q5_0" else 24)
        q = _nibbles(b[..., -16:]) | (_fifth_bits(b[..., -20:-16]).astype(np.uint8) << 4)
        if type_name == "Q5_0":
            return Q8Blocks(torch.from_numpy((q.astype(np.int8) - 16).reshape(rows, cols)), _half(b[..., :2]))
        return Q8Blocks(torch.from_numpy(q.astype(np.int8).reshape(rows, cols)), _half(b[..., :2]), _half(b[..., 2:4]))
    if type_name == "Q6_K":  # per 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d f16
        b = data.reshape(rows, cols // 256, 210)
        ql = b[..., :128].reshape(rows, -1, 2, 2, 32)  # [half of 256][bytes 0-31 | 32-63]
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        low = np.stack([ql & 0x0F, ql >> 4], axis=3)  # values 32 j + l of a half: j = (nibble, byte run)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 3
        q = (low.reshape(rows, -1, 2, 4, 32) | (high << 4)).astype(np.int8) - 32
        stored = SuperScales(_steps(np.ascontiguousarray(b[..., 192:208]).view(np.int8)), _half(b[..., 208:210]))
        return Q8Blocks(torch.from_numpy(q.reshape(rows, cols)), stored.scales(), None, stored)
    if type_name in ("Q4_0", "Q4_1"):  # per block: d f16, (m f16), 16 bytes of nibbles
        b = data.reshape(rows, nb, 18 if type_name == "Q4_0" else 20)
        d = _half(b[..., :2])
        m = -8 * d if type_name == "Q4_0" else _half(b[..., 2:4])
        q = torch.from_numpy(_nibbles(b[..., -16:]).reshape(rows, cols))
        return Q4Blocks(q, d.contiguous(), m.contiguous())
    if type_name in ("Q4_K", "Q5_K"):  # per 256: d, dmin, 6-bit scales/mins (16 bytes), (32 bytes of fifth bits),
        b = data.reshape(rows, cols // 256, 144 if type_name == "Q4_K" else 176)  # 128 bytes of nibbles
        stored = _k_scales(b)
        qs = b[..., -128:].reshape(rows, cols // 256, 4, 32)  # 64 values per 32 bytes: low nibbles, then high
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols // 256, 8, 32)
        if type_name == "Q4_K":
            return Q4Blocks(torch.from_numpy(q.reshape(rows, cols)), stored.scales(), stored.mins(), None, stored)
        fifth = (b[..., 16:48].reshape(rows, cols // 256, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        return Q8Blocks(torch.from_numpy((q | (fifth << 4)).astype(np.int8).reshape(rows, cols)), stored.scales(),
                        stored.mins(), stored)
    if type_name in ("Q2_K", "Q3_K"):  # per 16 values a scale (and Q2_K a min); 2-bit values, 4 per byte
        b = data.reshape(rows, cols // 256, 84 if type_name == "Q2_K" else 110)
        # 64 bytes: per half of the 256 values, 32 bytes whose bits 2j, 2j + 1 of byte l hold value 32 j + l
        qs = b[..., 16:80] if type_name == "Q2_K" else b[..., 32:96]
        q = ((qs.reshape(rows, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(rows, cols)
        if type_name == "Q2_K":  # 16 bytes of (scale4 | min4 << 4), 64 of values, d, dmin f16
            sc = b[..., :16]
            stored = SuperScales(_steps(sc & 0x0F), _half(b[..., 80:82]), _steps(sc >> 4), -_half(b[..., 82:84]))
            return Q8Blocks(torch.from_numpy(q.astype(np.int8)), stored.scales(), stored.mins(), stored)
        # Q3_K: 32 bytes of high bits (value 32 j + l at bit j of byte l; clear: minus 4), 64 of low pairs, 12 bytes
        # of 6-bit scales (low nibbles in bytes 0-7, high pairs in 8-11), d f16
        high = (b[..., None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        q = q.astype(np.int8) - ((high.reshape(rows, cols) ^ 1) << 2).astype(np.int8)
        low = (b[..., None, 96:104] >> np.array([0, 4], dtype=np.uint8)[:, None]).reshape(rows, -1, 16) & 0x0F
        top = (b[..., None, 104:108] >> (2 * np.arange(4, dtype=np.uint8))[:, None]).reshape(rows, -1, 16) & 3
        stored = SuperScales(_steps((low | (top << 4)).astype(np.int8) - 32), _half(b[..., 108:110]))
        return Q8Blocks(torch.from_numpy(q), stored.scales(), None, stored)
    if type_name == "IQ4_NL":  # per block: d f16, 16 bytes of indices (low nibbles the first 16 values)
        b = data.reshape(rows, nb, 18)
        return _iq4(_nibbles(b[..., 2:]).reshape(rows, cols), _half(b[..., :2]).contiguous())
    if type_name == "IQ4_XS":  # per 256: d f16, 2 high bits of each 6-bit scale (uint16), their low nibbles (4 bytes),
        b = data.reshape(rows, cols // 256, 136)  # then per 32 values 16 bytes of indices as IQ4_NL's
        high = (np.ascontiguousarray(b[..., 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
        low = ((b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F).reshape(rows, -1, 8)
        stored = SuperScales(_steps((low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32), _half(b[..., :2]))
        return _iq4(_nibbles(b[..., 8:].reshape(rows, -1, 8, 16)).reshape(rows, cols), stored.scales(), stored=stored)
    if type_name == "MXFP4":  # per block: E8M0 e, 16 bytes of indices as IQ4_NL's; d = ggml_e8m0_to_fp32_half(e)
        b = data.reshape(rows, nb, 17)
        e = b[..., 0].astype(np.uint32)
        d = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
        return _iq4(_nibbles(b[..., 1:]).reshape(rows, cols), torch.from_numpy(d.copy()), MXFP4_VALUES)
    raise ValueError(f"weight_blocks: {', '.join(STORED)} are read as blocks, not {type_name}")


def _iq4(index: np.ndarray, d: torch.Tensor, values: np.ndarray = IQ4_VALUES, stored: SuperScales | None = None
         ) -> Q4Blocks:
    return Q4Blocks(torch.from_numpy(index), d, None, torch.from_numpy(values), stored)


def _matrix(weight: Blocks | InputsPermuted | torch.Tensor) -> torch.Tensor:
    """A tensor of the weight's [output channels, input features]."""
    weight = getattr(weight, "blocks", weight)
    return weight if isinstance(weight, torch.Tensor) else weight.q


def rows_of(weight: Blocks | InputsPermuted | torch.Tensor) -> int:
    """Output channels."""
    return _matrix(weight).shape[0]


def shape_of(weight: Weight) -> tuple[int, int]:
    """(output channels, input features)."""
    parts = getattr(weight, "parts", [weight])
    return sum(rows_of(p) for p in parts), _matrix(parts[0]).shape[1]


def take_rows(blocks: Blocks | torch.Tensor, index: torch.Tensor) -> Blocks | torch.Tensor:
    """The same blocks with their output channels reordered (a row is whole blocks, so nothing is rounded)."""
    if isinstance(blocks, torch.Tensor):
        return blocks[index]
    stored = None if blocks.stored is None else blocks.stored.rows(index)
    if isinstance(blocks, Q8Blocks):
        return Q8Blocks(blocks.q[index], blocks.scale[index], None if blocks.m is None else blocks.m[index], stored)
    return Q4Blocks(blocks.q[index], blocks.d[index], None if blocks.m is None else blocks.m[index], blocks.values,
                    stored)


def _join_key(weight: Blocks | InputsPermuted | torch.Tensor) -> tuple:
    """Parts with one key are served as one weight: the same class, for Q8Blocks the same block and min or none, for
    Q4Blocks the same values (or none), for InputsPermuted the same order of the same."""
    if isinstance(weight, InputsPermuted):
        return InputsPermuted, _join_key(weight.blocks), tuple(weight.index.tolist())
    if isinstance(weight, Q8Blocks):
        return Q8Blocks, weight.block, weight.m is None
    if isinstance(weight, Q4Blocks):
        return Q4Blocks, None if weight.values is None else tuple(weight.values.tolist())
    return (type(weight),)


def _cat_same(parts: list[Blocks | InputsPermuted | torch.Tensor]) -> Blocks | InputsPermuted | torch.Tensor:
    if len(parts) == 1:  # as is: a tied lm_head stays the embedding's tensor, not a copy
        return parts[0]
    if isinstance(parts[0], InputsPermuted):
        return InputsPermuted(_cat_same([p.blocks for p in parts]), parts[0].index)
    if isinstance(parts[0], (Q8Blocks, Q4Blocks)):
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        q, stored = torch.cat([p.q for p in parts]), SuperScales.cat([p.stored for p in parts])
        if isinstance(parts[0], Q8Blocks):
            return Q8Blocks(q, torch.cat([p.scale for p in parts]), m, stored)
        return Q4Blocks(q, torch.cat([p.d for p in parts]), m, parts[0].values, stored)
    return torch.cat(parts)


def cat_rows(parts: list[Blocks | InputsPermuted | torch.Tensor]) -> Weight:
    """Output channels stacked (q/k/v and gate/up are fused): each run of parts of one form joined, and runs of
    different forms kept apart, in order (`Stacked`)."""
    runs = [_cat_same(list(run)) for _, run in itertools.groupby(parts, key=_join_key)]
    return runs[0] if len(runs) == 1 else Stacked(tuple(runs))


class BlockEmbedding(nn.Module):
    """An embedding table kept in its blocks (a GGUF's token_embd): the looked-up rows are dequantized."""

    def __init__(self, blocks: Blocks | torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.blocks, self.dtype = blocks, dtype

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return as_float(take_rows(self.blocks, token_ids)).to(self.dtype)
