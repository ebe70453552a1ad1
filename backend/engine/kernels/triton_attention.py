"""Paged attention on the GPU as OpenAI Triton kernels, over the pool and block tables the CPU kernel reads.

One kernel serves decode, prefill and chunked prefill: a program takes up to BLOCK_Q query tokens of one
sequence and every query head of one KV head (GQA: the group's heads are rows of one tile), and walks that
sequence's keys and values in place, TILE positions at a time through its block table: no gather, no padding
to the batch's longest context. A query at position p sees keys 0..p (causal within the chunk; the cached
prefix is read from its blocks). Scores, softmax (online, flash-attention style) and the output accumulate in
float32 whatever the storage dtype; float32 storage multiplies in IEEE float32 (not TF32), so a float32 model
is exact.

Split-K: a decode batch too small to fill the GPU (sequences x KV heads under twice the multiprocessors) gives
each program a segment of the context; a second kernel merges the segments' partial softmaxes. The choice
depends on the batch size only, so a CUDA graph captured for a batch size stays right for any context length.

`write_kv` puts a step's new K/V into their slots; a slot < 0 (a padded row of a CUDA graph) is skipped.
Both run under `TRITON_INTERPRET=1` on CPU tensors (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE = 64  # key positions per loop iteration
# Triton 3.6's interpreter multiplies bfloat16 dot operands wrongly (seen: errors of 1e10): interpreted, every dot
# runs in float32 on upcast operands, which is what a bf16/fp16 dot with float32 accumulation computes anyway
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SEGMENTS = 16


@triton.jit
def _paged_attention(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr, block_tables_ptr,
                     query_start_ptr, context_lens_ptr, scale_log2, table_stride,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                     BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, SEGMENTS: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2) // SEGMENTS
    segment = tl.program_id(2) % SEGMENTS
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    prefix = tl.load(context_lens_ptr + seq) - q_len  # cached keys before this chunk

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_index = q_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_index < q_len) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    token = q_start + q_index
    q = tl.load(q_ptr + (token * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = prefix + q_index

    kv_end = prefix + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # the block's last query sees keys < kv_end
    tiles = tl.cdiv(kv_end, TILE_N)
    per_segment = tl.cdiv(tiles, SEGMENTS)
    first = segment * per_segment
    last = tl.minimum(first + per_segment, tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for t in range(first, last):
        k_pos = t * TILE_N + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_end
        block = tl.load(block_tables_ptr + seq * table_stride + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        offset = ((block * BLOCK_SIZE + k_pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + offset, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offset, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key (an empty segment, a padded row): zeros
    mask = row_ok[:, None] & d_ok[None, :]
    if SEGMENTS == 1:
        tl.store(out_ptr + (token * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (token * NUM_HEADS + head) * SEGMENTS + segment
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=mask)
        tl.store(stats_ptr + part * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_segments(part_ptr, stats_ptr, out_ptr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    SEGMENTS: tl.constexpr):
    """out[token, head] from its segments' (output, max, sum): the softmax over the whole context."""
    row = tl.program_id(0)  # token * NUM_HEADS + head
    seg = tl.arange(0, SEGMENTS)
    d = tl.arange(0, D_PAD)
    m = tl.load(stats_ptr + (row * SEGMENTS + seg) * 2)
    l = tl.load(stats_ptr + (row * SEGMENTS + seg) * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max) * l  # empty segments: exp2(-inf) * 0 = 0
    parts = tl.load(part_ptr + (row * SEGMENTS + seg)[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :],
                    other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def segments_for(num_seqs: int, num_kv_heads: int, max_query_len: int, multiprocessors: int) -> int:
    """Context segments per program: >1 only for decode batches with fewer programs than 2x the multiprocessors."""
    if max_query_len > 1:
        return 1
    programs = num_seqs * num_kv_heads
    segments = 1
    while segments < MAX_SEGMENTS and programs * segments < 2 * multiprocessors:
        segments *= 2
    return segments


def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, max_query_len: int,
                    segments: int = 1, tile: int = TILE) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]. The cache [num_blocks, block_size, KVH, D] must hold this step's K/V; sequence s's
    queries are q[query_start[s]:query_start[s + 1]], the last ones of its context_lens[s] tokens. `max_query_len`
    bounds the chunks (the grid's size); `segments` (a power of 2) splits each context (segments_for)."""
    T, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    S = context_lens.shape[0]
    group = H // KVH
    group_pad = triton.next_power_of_2(group)
    # rows of a program's tile: 16 (tl.dot's least) for decode; 128 where chunks are long, so that a chunk's keys
    # are read once per 128 rows, not once per 16
    block_m = 16 if max_query_len == 1 else 128
    block_q = max(1, block_m // group_pad)
    q = q.contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    part = stats = out  # unused when segments == 1
    if segments > 1:
        part = torch.empty(T, H, segments, D, dtype=torch.float32, device=q.device)
        stats = torch.empty(T, H, segments, 2, dtype=torch.float32, device=q.device)
    grid = (S, KVH, triton.cdiv(max_query_len, block_q) * segments)
    _paged_attention[grid](q, k_cache, v_cache, out, part, stats, block_tables, query_start, context_lens,
                           scale * 1.4426950408889634, block_tables.stride(0),
                           NUM_HEADS=H, NUM_KV_HEADS=KVH, HEAD_DIM=D, D_PAD=triton.next_power_of_2(max(D, 16)),
                           BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, TILE_N=tile,
                           SEGMENTS=segments, IEEE=q.dtype == torch.float32 or INTERPRETED, num_warps=4 if block_m == 16 else 8)
    if segments > 1:
        _merge_segments[(T * H,)](part, stats, out, HEAD_DIM=D, D_PAD=triton.next_power_of_2(D), SEGMENTS=segments)
    return out


@triton.jit
def _write_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, WIDTH: tl.constexpr, W_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    i = tl.arange(0, W_PAD)
    ok = i < WIDTH
    tl.store(k_cache_ptr + slot * WIDTH + i, tl.load(k_ptr + token * WIDTH + i, mask=ok), mask=ok)
    tl.store(v_cache_ptr + slot * WIDTH + i, tl.load(v_ptr + token * WIDTH + i, mask=ok), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, KVH, D] into the cache [num_blocks, block_size, KVH, D] at `slots` (block * block_size + offset)."""
    T = k.shape[0]
    if T:
        width = k.shape[1] * k.shape[2]
        _write_kv[(T,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slots, WIDTH=width,
                        W_PAD=triton.next_power_of_2(width))
