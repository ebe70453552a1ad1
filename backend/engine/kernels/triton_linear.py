"""Weight-only quantized Linears on the GPU (OpenAI Triton): the engine's block forms (models/weight_blocks.py), the
same rounding as the CPU tactics, widened to the model dtype in registers and multiplied on the tensor cores.

- `Q8Blocks` (`quantization: int8`, llama.cpp's Q8_0): int8 weights, a float32 scale per 32 (or 16) along a row,
  optionally a min per scale: 1.125 bytes a weight against bfloat16's 2.
- `Q4Blocks` without a value table (`int4`, Q4_1): 4-bit weights, two to a byte, a scale d and a min m per 32:
  0.75 bytes a weight.

A decode step reads every weight once for a few rows of activations, so its time is the bytes it streams. Each
program computes a [BLOCK_M, BLOCK_N] tile over a share of K; with few rows the grid has too few tiles to keep
every SM streaming, so K is split into parts summed after (float32 partials). A prefill of WIDEN_ROWS rows or more
is bound by arithmetic instead: its weight is widened into a scratch copy in one pass and multiplied by cuBLAS
(vLLM's AWQ path does the same from 256 tokens), since the fused kernel's small tiles reach a fraction of cuBLAS's
rate there.

The widened weight is rounded to the model dtype before its product, as a bf16 GEMM on the dequantized weight would
round it; float32 models multiply in IEEE float32, not TF32 (and so does every model under the interpreter, whose
bfloat16 dot is wrong). The kernels run under `TRITON_INTERPRET=1` on CPU tensors too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from backend.engine.kernels.triton_attention import INTERPRETED
from backend.engine.models.weight_blocks import Q4Blocks, Q8Blocks

WIDEN_ROWS = 256  # from this many rows, widen the weight into a scratch copy and multiply it with cuBLAS


@triton.jit
def _widened(q_ptr, s_ptr, m_ptr, rn, n_ok, k0, K, GROUP: tl.constexpr, NIBBLES: tl.constexpr, HAS_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [rn, k0:k0 + BLOCK_K] in float32: q * scale (+ m) per group."""
    groups = K // GROUP
    if NIBBLES:  # byte j of a row: weight 2j in its low nibble, 2j + 1 in its high
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(q_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=n_ok[:, None], other=0)
        q = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
    rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s = tl.load(s_ptr + rn[:, None] * groups + rg[None, :], mask=n_ok[:, None], other=0.0)
    w = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None]
    if HAS_M:
        w += tl.load(m_ptr + rn[:, None] * groups + rg[None, :], mask=n_ok[:, None], other=0.0)[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _blocks_linear(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, M, N, K, k_per_part,
                   GROUP: tl.constexpr, NIBBLES: tl.constexpr, HAS_M: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(part * k_per_part, (part + 1) * k_per_part, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_ok[:, None], other=0.0)
        w = _widened(q_ptr, s_ptr, m_ptr, rn, n_ok, k0, K, GROUP, NIBBLES, HAS_M, BLOCK_N, BLOCK_K).to(x.dtype)
        if IEEE:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + part * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _widen(q_ptr, s_ptr, m_ptr, w_ptr, N, K, GROUP: tl.constexpr, NIBBLES: tl.constexpr, HAS_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    w = _widened(q_ptr, s_ptr, m_ptr, rn, n_ok, k0, K, GROUP, NIBBLES, HAS_M, BLOCK_N, BLOCK_K)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rn[:, None] * K + rk[None, :], w.to(w_ptr.dtype.element_ty), mask=n_ok[:, None])


@dataclass(frozen=True)
class BlocksLinear:
    """A quantized weight resident on the GPU, called as its Linear: x [..., K] -> [..., N] in x's dtype."""
    q: torch.Tensor  # int8 [N, K], or uint8 [N, K / 2] (two 4-bit weights a byte)
    scale: torch.Tensor  # float32 [N, K / group]
    m: torch.Tensor | None  # float32, as scale
    group: int
    nibbles: bool
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, blocks: Q8Blocks | Q4Blocks, bias: torch.Tensor | None = None) -> BlocksLinear:
        if isinstance(blocks, Q4Blocks):
            if blocks.values is not None:
                raise ValueError("int4: a Q4 form with a value table (IQ4_NL, IQ4_XS) has no GPU kernel")
            q = blocks.q
            return cls((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), blocks.d.contiguous(), blocks.m.contiguous(),
                       q.shape[1] // blocks.d.shape[1], True, bias)
        m = None if blocks.m is None else blocks.m.contiguous()
        return cls(blocks.q.contiguous(), blocks.scale.contiguous(), m, blocks.block, False, bias)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.scale.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.m) if t is not None)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`, as the fused kernel rounds it."""
        (n, k), block_k = self.shape, math.gcd(self.shape[1], 128)
        w = torch.empty(n, k, dtype=dtype, device=self.q.device)
        _widen[(triton.cdiv(n, 64), k // block_k)](self.q, self.scale, self.scale if self.m is None else self.m, w, n,
                                                   k, GROUP=self.group, NIBBLES=self.nibbles,
                                                   HAS_M=self.m is not None, BLOCK_N=64, BLOCK_K=block_k)
        return w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (n, k), lead = self.shape, x.shape[:-1]
        x2 = x.reshape(-1, k).contiguous()
        M = x2.shape[0]
        if M >= WIDEN_ROWS:  # a prefill: the GEMM is bound by arithmetic, which cuBLAS does best
            return F.linear(x2, self.widened(x.dtype), self.bias).view(*lead, n)
        block_m, block_n, block_k, parts = tiles(M, n, k, _multiprocessors(x.device))
        grid = (triton.cdiv(M, block_m), triton.cdiv(n, block_n), parts)
        out = torch.empty(parts, M, n, dtype=x.dtype if parts == 1 else torch.float32, device=x.device)
        if M:
            _blocks_linear[grid](x2, self.q, self.scale, self.scale if self.m is None else self.m, out, M, n, k,
                                 k // parts, GROUP=self.group, NIBBLES=self.nibbles, HAS_M=self.m is not None,
                                 IEEE=x.dtype == torch.float32 or INTERPRETED, BLOCK_M=block_m, BLOCK_N=block_n,
                                 BLOCK_K=block_k, num_stages=4)
        y = out[0] if parts == 1 else out.sum(0).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, n)


def tiles(M: int, N: int, K: int, multiprocessors: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, parts of K). Rows in tiles of 16-64 (tl.dot's least is 16); columns in tiles of
    32, K in steps of 256 for one tile of rows, else 128, 4 stages deep (measured best on an H100 for Llama-3-8B's
    Linears at 1, 16 and 64 rows, among 32-128 x 128-256 x 3-4 stages); K split in two while the grid has fewer
    programs than SMs and a part keeps 4096 of K (only down_proj at 14336 splits there)."""
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n = 32
    block_k = math.gcd(K, 256 if block_m == 16 else 128)
    tiles_mn = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    parts = 1
    while tiles_mn * parts < multiprocessors and (K // block_k) % (2 * parts) == 0 and K // (2 * parts) >= 4096:
        parts *= 2
    return block_m, block_n, block_k, parts


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's SMs; under the interpreter an H100's 132, so that CPU tests take a GPU's tiles."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
