"""The KV cache stored narrower than the model's dtype: `kv_cache_dtype: float16` (llama.cpp's default cache) or `int8`.

float16: each value rounded to nearest (IEEE, as `Tensor.half()`), half a float32 model's bytes: a decode step's
attention reads half the KV, and the pool holds twice the tokens. int8: each (token, KV head) row of head_dim values is
stored as head_dim int8s and its float32 scale, packed into one int8 row of head_dim + 4 bytes.

Symmetric, one scale per row: scale = max |x| / 127, q = round(x / scale). A row is quantized once, when its token's
K/V are written, and never again (a per-block scale would re-round a block's earlier rows as it fills). With
SmolLM2's head_dim 64 a row takes 68 bytes where float32 takes 256: a decode step reads 3.8x fewer KV bytes, and the
same `kv_cache_memory_gb` holds 3.8x the tokens. The packing keeps the cache one tensor
[layers, 2, blocks, block_size, kv_heads, head_dim + 4], so block copies (prefix cache, disaggregated transfers)
work unchanged. On the kernel path the rows are written by `llm_kernels.write_int8_rows` (this rounding, in one op;
float16 ones by `write_rows`) and read as stored by the attention kernel (kernels/paged_attention.cpp); the gather
path widens what it gathers.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "float16", "int8")  # auto: the model's dtype
SCALE_BYTES = 4  # a float32 after each row's int8s


def cache_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The cache tensor's dtype for a model in `dtype`."""
    return {"auto": dtype, "float16": torch.float16, "int8": torch.int8}[kv_cache_dtype]


def row_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes of one (token, KV head) row in the cache."""
    if kv_cache_dtype == "int8":
        return head_dim + SCALE_BYTES
    return head_dim * cache_dtype(dtype, kv_cache_dtype).itemsize


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: the rounded values, then the scale's 4 bytes."""
    x32 = x.float()
    scale = x32.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: zeros, any scale
    q = torch.round(x32 / scale).to(torch.int8)
    return torch.cat((q, scale.view(torch.int8)), dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., D] in `dtype`."""
    scale = packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (packed[..., :-SCALE_BYTES].float() * scale).to(dtype)


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` holds it (int8: quantize's rows)."""
    return quantize(x) if dtype == torch.int8 else x.to(dtype)


def widened(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows in `dtype` (int8: dequantize's values)."""
    return dequantize(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` gives it back: the new K/V a step attends to in the gather path, so that it sees what
    the kernel path (which writes first, then reads) sees."""
    return widened(stored(x, dtype), x.dtype)
