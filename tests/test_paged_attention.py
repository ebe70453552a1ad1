"""The CPU paged-attention kernel equals the gather path (the graph ONNX Runtime and TensorRT run,
itself checked against HF) on mixed batches: decodes, a whole prompt, prefill chunks mid-sequence,
blocks shared between sequences, in every dtype the kernel takes, and from an int8 or (under a float32 q) a float16
cache (kv_quantization.py), which both read as the same rounded rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.engine.batch import build_model_input
from backend.engine.kernels import cpu_kernels
from backend.engine.kv_quantization import stored
from backend.engine.models.config import ModelConfig
from backend.engine.models.llama import DecoderLayer, KernelLayout, RowLayout, split_attend
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence

H, KVH, D, BLOCK = 6, 2, 16, 4
CFG = ModelConfig("llama", 100, H * D, 4 * H * D, 1, H, KVH, D, 4096, 1e-5, True, False, ())


MIXED = [(40, 1), (7, 1), (1, 1), (33, 33), (12 + 29, 29), (3 * BLOCK + 5, 5), (3 * BLOCK + 1, 1), (90, 17)]
# decodes longer than the float32 kernel's segment (336 keys of SmolLM2's rows: paged_attention.cpp kSegmentBytes),
# odd and even, ending mid-block and on a segment's edge
LONG_DECODES = [(1001, 1), (672, 1), (337, 1), (16, 1)]


def scheduled_batch(rng: np.random.Generator, num_blocks: int,
                    cases: list[tuple[int, int]] = MIXED) -> list[tuple[Sequence, int]]:
    """(sequence, new tokens) pairs: context already cached + the new tokens of this step."""
    shared = rng.choice(num_blocks, 3, replace=False).tolist()  # a common prefix of 3 full blocks
    free = [b for b in rng.permutation(num_blocks).tolist() if b not in shared]
    batch = []
    for i, (total, new) in enumerate(cases):
        seq = Sequence(f"s{i}", rng.integers(0, 100, total).tolist(), SamplingParams(), arrival_index=i)
        num_blocks_needed = -(-total // BLOCK)
        prefix = shared if i in (5, 6) else []
        seq.block_ids = prefix + [free.pop() for _ in range(num_blocks_needed - len(prefix))]
        seq.num_computed_tokens = total - new
        batch.append((seq, new))
    return batch


@pytest.mark.parametrize("heads", [(H, KVH, D), (9, 3, 64)])  # SmolLM2's: bfloat16 prefill in AMX tiles, where it is
@pytest.mark.parametrize("dtype,tol,kv", [(torch.float32, 2e-5, None), (torch.bfloat16, 3e-2, None),
                                          (torch.float16, 3e-3, None), (torch.float32, 2e-5, torch.int8),
                                          (torch.bfloat16, 3e-2, torch.int8), (torch.float32, 2e-5, torch.float16)])
def test_kernel_equals_gather(dtype, tol, kv, heads):
    check_kernel_equals_gather(dtype, tol, kv, heads, MIXED, 64)


def test_long_decodes_read_in_segments_equal_gather():
    check_kernel_equals_gather(torch.float32, 2e-5, None, (9, 3, 64), LONG_DECODES, 600)


@pytest.mark.parametrize("dtype,tol,kv", [(torch.float32, 2e-5, None), (torch.bfloat16, 3e-2, None),
                                          (torch.float32, 2e-5, torch.int8), (torch.float32, 2e-5, torch.float16)])
def test_a_lone_decode_split_by_kv_heads_equals_gather(dtype, tol, kv):
    """One decode and more threads: its KV heads in parts, a thread each (3 KV heads: 1 and 2), past a segment's
    length; test_a_generated_token_attends_as_a_decode_in_any_chunk holds such a decode to the same token's bits in a
    batch, where it is not split."""
    check_kernel_equals_gather(dtype, tol, kv, (9, 3, 64), [(1001, 1)], 600)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)])  # Gemma 3's head_dim 256: 32 vectors on AVX2
@pytest.mark.parametrize("dtype,tol,kv", [(torch.float32, 2e-5, None), (torch.bfloat16, 3e-2, None),
                                          (torch.float32, 2e-5, torch.int8), (torch.float32, 2e-5, torch.float16)])
def test_a_sliding_window_equals_gather(dtype, tol, kv, heads):
    """A sliding layer (the last 9 keys, the query's own included) in decodes, tiles of a chunk and long decodes."""
    check_kernel_equals_gather(dtype, tol, kv, heads, MIXED + LONG_DECODES[2:], 160, window=9)


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("dtype,tol,kv", [(torch.float32, 2e-5, None), (torch.bfloat16, 3e-2, None),
                                          (torch.float32, 2e-5, torch.int8), (torch.float32, 2e-5, torch.float16)])
def test_attention_sinks_equal_gather(dtype, tol, kv, window):
    """gpt-oss's sinks (a logit per head in each softmax's sum), with and without a window: the kernel's decodes,
    tiles and long decodes equal the gather path's, which counts each sink as one more key of zero value (and which
    test_model_families holds to HF). Sinks of -3..3: some outweigh every key, some none."""
    sinks = torch.linspace(-3.0, 3.0, 9)
    check_kernel_equals_gather(dtype, tol, kv, (9, 3, 64), MIXED + LONG_DECODES[2:], 160, window, sinks)


def check_kernel_equals_gather(dtype: torch.dtype, tol: float, kv: torch.dtype | None, heads: tuple[int, int, int],
                               cases: list[tuple[int, int]], num_blocks: int, window: int = 0,
                               sinks: torch.Tensor | None = None) -> None:
    H, KVH, D = heads
    CFG = ModelConfig("llama", 100, H * D, 4 * H * D, 1, H, KVH, D, 4096, 1e-5, True, False, ())
    cpu_kernels.load()
    rng = np.random.default_rng(0)
    batch = build_model_input(scheduled_batch(rng, num_blocks, cases), BLOCK, q_tile=8)
    gen = torch.Generator().manual_seed(0)
    T = batch.num_tokens
    q, k, v = (torch.randn(T, n, D, generator=gen).to(dtype) for n in (H, KVH, KVH))
    cache_k, cache_v = (torch.randn(num_blocks, BLOCK, KVH, D, generator=gen).to(dtype) for _ in range(2))
    if kv:  # the cache narrower than q
        cache_k, cache_v = stored(cache_k, kv), stored(cache_v, kv)
    t = {name: torch.from_numpy(a) for name, a in vars(batch).items() if a is not None}  # no LoRA groups

    rows = RowLayout(t["row_block_tables"], t["row_token_index"], t["positions"][t["row_token_index"]],
                     t["kv_src"], t["kv_dst"], t["token_slot"])
    expected = rows.attend(q, k, v, cache_k.clone(), cache_v.clone(), CFG, window, sinks)
    kernel = KernelLayout(t["block_tables"], t["query_start"], t["context_lens"], t["slot_mapping"])
    got = kernel.attend(q, k, v, cache_k, cache_v, CFG, window, sinks)

    assert got.dtype == dtype and got.shape == expected.shape == (T, H * D)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # the kernel wrote the new K/V where the runner would have
    flat = cache_k.view(-1, KVH, cache_k.shape[-1])[t["slot_mapping"]]
    assert torch.equal(flat, stored(k, kv) if kv else k)


@pytest.mark.parametrize("dtype,kv", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8),
                                      (torch.float32, torch.float16)])
def test_a_generated_token_attends_as_a_decode_in_any_chunk(dtype, kv):
    """With prompt_lens, a generated token's attention is the bits of its own decode step, whether it is verified
    with speculative drafts after it (sequence 0: 1 + 5 tokens past a 20-token prompt) or recomputed with its prompt
    after a preemption (sequence 1: a 10-token prompt and 5 outputs in one chunk), while prompt tokens still go in
    tiles, as a prefill chunk does without prompt_lens. So speculation cannot change a greedy output."""
    Hs, KVHs, Ds = 9, 3, 64
    cpu_kernels.load()
    gen = torch.Generator().manual_seed(3)
    cache = [torch.randn(32, BLOCK, KVHs, Ds, generator=gen).to(dtype) for _ in range(2)]
    if kv:
        cache = [stored(c, kv) for c in cache]
    tables = torch.tensor([list(range(0, 14, 2)), list(range(1, 15, 2))])  # 7 blocks each, interleaved
    chunks, context, prompt = [6, 15], [28, 15], [20, 10]
    T = sum(chunks)
    q = torch.randn(T, Hs, Ds, generator=gen).to(dtype)
    k, v = (torch.randn(T, KVHs, Ds, generator=gen).to(dtype) for _ in range(2))
    slots = torch.tensor([int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK
                          for s in range(2) for p in range(context[s] - chunks[s], context[s])])
    starts, lens, scale = torch.tensor([0, chunks[0], T]), torch.tensor(context), Ds ** -0.5

    def step(prompt_lens):  # one step over both chunks; returns its output and the caches it wrote
        ck, cv = (c.clone() for c in cache)
        return torch.ops.llm_kernels.write_and_attend(q, k, v, ck, cv, slots, tables, starts, lens, scale,
                                                      prompt_lens), ck, cv

    out, ck, cv = step(torch.tensor(prompt))
    generated = [(0, row, context[0] - chunks[0] + row + 1) for row in range(chunks[0])]  # (sequence, row, its keys)
    generated += [(1, chunks[0] + p, p + 1) for p in range(prompt[1], chunks[1])]
    for s, row, keys in generated:  # decoded alone: a chunk of one, the keys up to it in the cache
        alone = torch.ops.llm_kernels.paged_attention(q[row:row + 1], ck, cv, tables[s:s + 1], torch.tensor([0, 1]),
                                                      torch.tensor([keys]), scale)
        assert torch.equal(out[row], alone[0]), (s, row)
    prompt_rows = torch.arange(chunks[0], chunks[0] + prompt[1])
    assert torch.equal(out[prompt_rows], step(None)[0][prompt_rows])


def test_kernel_rejects_mismatched_dtypes():
    cpu_kernels.load()
    q = torch.zeros(1, H, D)
    cache = torch.zeros(2, BLOCK, KVH, D, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="in q's dtype, int8, or float16 under a float32 q"):
        torch.ops.llm_kernels.paged_attention(q, cache, cache, idx, torch.tensor([0, 1]), torch.tensor([1]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_rows_is_index_copy(dtype):
    """The step's new K/V rows, read from their places in the qkv output (rows strided), go where index_copy_ puts
    them, in both caches; a slot outside the cache is refused."""
    cpu_kernels.load()
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (H + 2 * KVH) * D, generator=gen).to(dtype)
    k, v = (qkv[:, (H + i * KVH) * D:(H + (i + 1) * KVH) * D].view(5, KVH, D) for i in (0, 1))
    slots = torch.tensor([9, 0, 31, 4, 17])
    caches = [torch.randn(8, BLOCK, KVH, D, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone().view(-1, KVH, D).index_copy_(0, slots, x).view_as(c) for c, x in zip(caches, (k, v))]
    torch.ops.llm_kernels.write_rows(k, v, *caches, slots)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected))
    with pytest.raises(RuntimeError, match="slot 32 outside the cache"):
        torch.ops.llm_kernels.write_rows(k, v, *caches, torch.tensor([9, 0, 32, 4, 17]))


def test_write_rows_rounds_float32_rows_into_a_float16_cache_as_half_does():
    """`kv_cache_dtype: float16` under a float32 model: each value rounded to nearest even, as Tensor.half(); values
    past float16's range go to infinity as it sends them, tiny ones to its subnormals."""
    cpu_kernels.load()
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, (H + 2 * KVH) * D, generator=gen) * torch.logspace(-8, 5, D).repeat(H + 2 * KVH)
    k, v = (qkv[:, (H + i * KVH) * D:(H + (i + 1) * KVH) * D].view(5, KVH, D) for i in (0, 1))
    slots = torch.tensor([9, 0, 31, 4, 17])
    caches = [torch.zeros(8, BLOCK, KVH, D, dtype=torch.float16) for _ in range(2)]
    torch.ops.llm_kernels.write_rows(k, v, *caches, slots)
    for cache, x in zip(caches, (k, v)):
        assert torch.equal(cache.view(-1, KVH, D)[slots], x.half())
    written = caches[0].view(-1, KVH, D)[slots]
    assert written.isinf().any() and ((written != 0) & (written.abs() < 6e-5)).any()
    assert caches[0].view(-1, KVH, D)[[1, 2, 3]].eq(0).all()  # nothing else written
    with pytest.raises(RuntimeError, match="write_rows: k, v"):  # the two caches in one dtype
        torch.ops.llm_kernels.write_rows(k, v, caches[0], caches[1].float(), slots)


@pytest.mark.parametrize("dtype,kv", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8),
                                      (torch.float32, torch.float16)])
def test_attend_qkv_is_the_split_the_rotary_and_the_attention(dtype, kv):
    """llm_kernels.attend_qkv, the kernel path's one call a layer between its qkv and o projections, equals what it
    fuses called one by one (split_attend: the split, the rotary kernel, the K/V write, the attention kernel): the
    same bits, in the output, in q and k rotated in place, and in the cache."""
    Hs, KVHs, Ds = 9, 3, 64  # SmolLM2's heads
    cfg = ModelConfig("llama", 100, Hs * Ds, 4 * Hs * Ds, 1, Hs, KVHs, Ds, 4096, 1e-5, True, False, ())
    cpu_kernels.load()
    batch = build_model_input(scheduled_batch(np.random.default_rng(2), 64), BLOCK, q_tile=8)
    t = {name: torch.from_numpy(a) for name, a in vars(batch).items() if a is not None}
    gen = torch.Generator().manual_seed(2)
    T = batch.num_tokens
    qkv = torch.randn(T, (Hs + 2 * KVHs) * Ds, generator=gen).to(dtype)
    cos, sin = (torch.randn(T, Ds, generator=gen).to(dtype) for _ in range(2))
    caches = [torch.randn(64, BLOCK, KVHs, Ds, generator=gen).to(dtype) for _ in range(2)]
    if kv:
        caches = [stored(c, kv) for c in caches]
    kernel = KernelLayout(t["block_tables"], t["query_start"], t["context_lens"], t["slot_mapping"])

    expected_qkv, expected_caches = qkv.clone(), [c.clone() for c in caches]
    layer = DecoderLayer(cfg, 0)
    expected, _, _ = split_attend(kernel, expected_qkv, cos, sin, *expected_caches, layer)
    got, _, _ = kernel.attend_qkv(qkv, cos, sin, *caches, layer)
    assert torch.equal(got, expected) and got.shape == (T, Hs * Ds)
    assert torch.equal(qkv, expected_qkv)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches))
