"""The elementwise ops around the GEMMs as OpenAI Triton kernels for the GPU, one pass each: RMSNorm (with the
residual add fused, the residual updated in place), rotary (q and k in place), SiLU(gate) * up.

Each rounds where TorchOps (models/llama.py, HF's math) rounds: the math runs in float32 and every intermediate
that torch would store in the model dtype is cast to it, so a bfloat16 or float16 result differs from the torch
ops' by at most one rounding step of the dtype (float32: the order of a sum). They run under `TRITON_INTERPRET=1`
on CPU tensors too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, delta_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, N_PAD: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N_PAD)
    ok = i < N
    x = tl.load(x_ptr + row * N + i, mask=ok, other=0.0)
    if ADD:  # residual += delta, rounded to the model dtype, stored back
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * N + i, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * N + i, x, mask=ok)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)).to(x.dtype)
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + row * N + i, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), x [T, N]."""
    return _norm(x, None, weight, eps)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place); returns its norm."""
    return _norm(residual, delta, weight, eps)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.is_contiguous()
    T, N = x.shape
    out = torch.empty_like(x)
    if T:
        _rms_norm[(T,)](x, x if delta is None else delta.contiguous(), weight, out, eps, N=N,
                        N_PAD=triton.next_power_of_2(N), ADD=delta is not None)
    return out


@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, row_stride, token_stride, HEADS: tl.constexpr, D: tl.constexpr,
            HALF_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    ok = i < D // 2
    base = x_ptr + token * token_stride + head * row_stride
    a = tl.load(base + i, mask=ok, other=0.0)
    b = tl.load(base + D // 2 + i, mask=ok, other=0.0)
    dtype = a.dtype
    cos_a = tl.load(cos_ptr + token * D + i, mask=ok, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + token * D + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + token * D + i, mask=ok, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + token * D + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a); each product rounded as torch rounds it
    new_a = ((a32 * cos_a).to(dtype).to(tl.float32) + (-b32 * sin_a).to(dtype).to(tl.float32)).to(dtype)
    new_b = ((b32 * cos_b).to(dtype).to(tl.float32) + (a32 * sin_b).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + i, new_a, mask=ok)
    tl.store(base + D // 2 + i, new_b, mask=ok)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, H, D] and k [T, KVH, D] (strided views of one qkv row are fine) rotated in place by cos/sin [T, D]."""
    T, H, D = q.shape
    if T == 0:
        return
    for x in (q, k):
        assert x.stride(2) == 1
        _rotary[(T, x.shape[1])](x, cos.contiguous(), sin.contiguous(), x.stride(1), x.stride(0), HEADS=x.shape[1],
                                 D=D, HALF_PAD=triton.next_power_of_2(D // 2))


@triton.jit
def _silu_mul(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    gate = tl.load(x_ptr + row * 2 * N + i, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * 2 * N + N + i, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * N + i, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2N] -> [T, N]."""
    assert gate_up.is_contiguous()
    T, N2 = gate_up.shape
    out = torch.empty(T, N2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(1024, triton.next_power_of_2(N2 // 2))
        _silu_mul[(T, triton.cdiv(N2 // 2, block))](gate_up, out, N=N2 // 2, BLOCK=block)
    return out
