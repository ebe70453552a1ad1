"""The GPU kernels (OpenAI Triton) equal their references: paged attention against the gather path and the CPU
kernel on mixed batches (decodes, whole prompts, prefill chunks over a cached prefix, shared blocks, GQA), with
and without split-K; the KV write; the elementwise ops against TorchOps; the weight-only int8/int4 Linears against
float64 math on their own rounding; a whole forward against the gather forward. Without a GPU they run under
Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest.py) on CPU tensors; on a GPU host
(scripts/gpu_check.sh) the same tests run the compiled kernels on CUDA tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.engine.batch import build_model_input
from backend.engine.kernels import cpu_kernels, triton_attention, triton_ops
from backend.engine.kernels.triton_linear import BlocksLinear, tiles
from backend.engine.models.llama import KernelLayout, RMSNorm, RowLayout, TorchOps, TritonLayout, TritonOps, load_model
from backend.engine.models.weight_blocks import Q8Blocks, q4_1, q8_0
from backend.engine.runners.cuda_runner import graph_sizes
from tests.test_paged_attention import BLOCK, CFG, D, H, KVH, scheduled_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def tensors(batch) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(a).to(DEVICE) for name, a in vars(batch).items() if a is not None}  # no LoRA


def random_case(dtype: torch.dtype, seed: int = 0, num_blocks: int = 64):
    rng = np.random.default_rng(seed)
    batch = build_model_input(scheduled_batch(rng, num_blocks), BLOCK, q_tile=8)
    gen = torch.Generator().manual_seed(seed)
    T = batch.num_tokens
    q, k, v = (torch.randn(T, n, D, generator=gen).to(dtype).to(DEVICE) for n in (H, KVH, KVH))
    cache_k, cache_v = (torch.randn(num_blocks, BLOCK, KVH, D, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    return batch, q, k, v, cache_k, cache_v


def gather_reference(batch, q, k, v, cache_k, cache_v) -> torch.Tensor:
    t = tensors(batch)
    rows = RowLayout(t["row_block_tables"], t["row_token_index"], t["positions"][t["row_token_index"]],
                     t["kv_src"], t["kv_dst"], t["token_slot"])
    return rows.attend(q, k, v, cache_k.clone(), cache_v.clone(), CFG)


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_equals_the_gather_path(dtype, segments):
    batch, q, k, v, cache_k, cache_v = random_case(dtype)
    expected = gather_reference(batch, q, k, v, cache_k, cache_v)
    t = tensors(batch)
    layout = TritonLayout(t["block_tables"], t["query_start"], t["context_lens"], t["slot_mapping"],
                          int(np.diff(batch.query_start).max()), segments)
    got = layout.attend(q, k, v, cache_k, cache_v, CFG)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # the new K/V are where the runner would have written them
    assert torch.equal(cache_k.view(-1, KVH, D)[t["slot_mapping"]], k)
    assert torch.equal(cache_v.view(-1, KVH, D)[t["slot_mapping"]], v)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU kernel takes CPU tensors")
def test_paged_attention_equals_the_cpu_kernel():
    cpu_kernels.load()
    batch, q, k, v, cache_k, cache_v = random_case(torch.float32, seed=1)
    t = tensors(batch)
    expected = KernelLayout(t["block_tables"], t["query_start"], t["context_lens"], t["slot_mapping"]).attend(
        q, k, v, cache_k.clone(), cache_v.clone(), CFG)
    for segments in (1, 2):
        got = TritonLayout(t["block_tables"], t["query_start"], t["context_lens"], t["slot_mapping"],
                           int(np.diff(batch.query_start).max()), segments).attend(q, k, v, cache_k, cache_v, CFG)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim,tile", [(8, 8, 32, 16), (12, 4, 16, 32), (8, 1, 64, 16)])
def test_paged_attention_shapes_and_segments(heads, kv_heads, head_dim, tile):
    """Group sizes 1, 3 (not a power of 2) and 8, head dims 16..64, decodes split into more segments than some
    contexts have tiles (empty segments), a context of one key. Poisoned output: every element is written."""
    gen = torch.Generator().manual_seed(heads + head_dim)
    block_size, num_blocks = 16, 64
    contexts = [1, 5, 16, 17, 150, 64]
    S = len(contexts)
    tables = torch.randperm(num_blocks, generator=gen)[:S * 10].view(S, 10)
    q = torch.randn(S, heads, head_dim, generator=gen)
    cache_k, cache_v = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) for _ in range(2))
    # float64 reference, key by key
    expected = torch.empty(S, heads, head_dim, dtype=torch.float64)
    for s, n in enumerate(contexts):
        slots = tables[s, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        keys = cache_k.view(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        values = cache_v.view(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), keys) * head_dim ** -0.5, -1)
        expected[s] = torch.einsum("hn,nhd->hd", p, values)
    args = [x.to(DEVICE) for x in (q, cache_k, cache_v, tables, torch.arange(S + 1), torch.tensor(contexts))]
    for segments in (1, 2, 8):
        out = triton_attention.paged_attention(*args, head_dim ** -0.5, 1, segments, tile)
        assert not out.isnan().any()
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, KVH, D, generator=gen).to(DEVICE), torch.randn(3, KVH, D, generator=gen).to(DEVICE)
    cache_k, cache_v = torch.zeros(4, BLOCK, KVH, D, device=DEVICE), torch.zeros(4, BLOCK, KVH, D, device=DEVICE)
    triton_attention.write_kv(k, v, cache_k, cache_v, torch.tensor([5, -1, 0], device=DEVICE))
    flat_k, flat_v = cache_k.view(-1, KVH, D), cache_v.view(-1, KVH, D)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2]) and torch.equal(flat_v[5], v[0])
    assert flat_k.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [0, 5]


def test_segments_and_graph_sizes():
    assert triton_attention.segments_for(64, 8, 1, 132) == 1  # 512 programs fill 132 multiprocessors
    assert triton_attention.segments_for(1, 8, 1, 132) == 16  # capped at MAX_SEGMENTS
    assert triton_attention.segments_for(8, 8, 1, 132) == 8
    assert triton_attention.segments_for(1, 8, 7, 132) == 1  # prefill: never split
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(1) == [1]


ELEMENTWISE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # one rounding step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_elementwise_ops_equal_the_torch_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    T, hidden, heads, kv_heads, head_dim, inter = 5, 96, 6, 2, 16, 80
    tol = dict(atol=ELEMENTWISE_TOLERANCE[dtype], rtol=ELEMENTWISE_TOLERANCE[dtype])

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    x, delta = rand(T, hidden), rand(T, hidden)
    torch.testing.assert_close(TritonOps.rms_norm(x, norm), TorchOps.rms_norm(x, norm), **tol)
    residual = x.clone()
    expected_residual, expected_norm = TorchOps.add_rms_norm(delta, x, norm)
    got_residual, got_norm = TritonOps.add_rms_norm(delta, residual, norm)
    assert got_residual.data_ptr() == residual.data_ptr()  # in place
    torch.testing.assert_close(got_residual, expected_residual, **tol)
    torch.testing.assert_close(got_norm, expected_norm, **tol)

    qkv = rand(T, (heads + 2 * kv_heads) * head_dim)  # q and k as strided views of one row, as the model has them
    angles = torch.randn(T, head_dim // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)
    expected_q, expected_k = TorchOps.rotary(q.clone(), k.clone(), cos, sin)
    TritonOps.rotary(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, **tol)
    torch.testing.assert_close(k, expected_k, **tol)

    gate_up = rand(T, 2 * inter)
    torch.testing.assert_close(TritonOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up), **tol)
    assert triton_ops.silu_mul(gate_up[:0]).shape == (0, inter)


def q8_with_mins(w: torch.Tensor) -> Q8Blocks:
    """A Q8 form with a scale and a min per 16 (GGUF Q2_K's shape): w ~ q * scale + m."""
    n, k = w.shape
    blocks = w.view(n, k // 16, 16)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = (hi - lo).clamp(min=1e-8) / 255
    q = torch.round((blocks - lo[..., None]) / scale[..., None]) - 128
    return Q8Blocks(q.to(torch.int8).view(n, k), scale, lo + 128 * scale)


@pytest.mark.parametrize("form", [q8_0, q8_with_mins, q4_1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(1, 96, 64), (3, 70, 96), (17, 130, 256), (5, 32, 8192), (64, 200, 128),
                                     (300, 70, 128)])
def test_weight_only_linear_is_exact_math_on_its_rounding(form, dtype, m, n, k):
    """x @ dequantized(W).T (+ bias) in float64 on the weights as the model dtype rounds them. Bounds, relative to
    the output's largest: float32 1e-5 (only sums' order differs); bfloat16 one step of bf16 (2^-7) compiled, two
    under the interpreter, which rounds float32 to bf16 by truncating (the widened weights and the output).
    (5, 32, 8192) splits K in two (one tile of rows and columns), 70 and 130 leave part of a column tile, 96 is a K
    of 32-wide steps, 300 rows widen the weight for cuBLAS (a prefill)."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w, bias = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g).to(dtype)
    blocks = form(w)
    linear = BlocksLinear.of(type(blocks)(*(t if t is None else t.to(DEVICE) for t in vars(blocks).values())),
                             bias.to(DEVICE))
    if k == 8192:
        assert tiles(m, n, k, 132)[3] == 2
    y = linear(x.view(1, m, k))
    assert y.dtype == dtype and y.shape == (1, m, n)
    reference = x.double().cpu() @ blocks.dequantize().to(dtype).double().T + bias.double()
    error = (y[0].double().cpu() - reference).abs().max() / reference.abs().max()
    assert error < (1e-5 if dtype == torch.float32 else 2 ** -7 if DEVICE == "cuda" else 2 ** -6), error
    assert linear.nbytes == n * k * {q8_0: 1.125, q8_with_mins: 1.5, q4_1: 0.75}[form]  # bytes a weight, scales in


def test_forward_with_the_triton_layout_equals_the_gather_forward(random_llama_dir):
    """The whole model: TritonOps + TritonLayout against TorchOps + RowLayout on a mixed batch."""
    model = load_model(random_llama_dir, torch.float32, DEVICE)
    cfg = model.cfg
    rng = np.random.default_rng(3)
    num_blocks = 64
    scheduled = scheduled_batch(rng, num_blocks)
    batch = build_model_input(scheduled, BLOCK, q_tile=8)
    t = tensors(batch)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(cfg.num_layers, 2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(DEVICE)
    expected, _ = model(*(t[name] for name in ("token_ids", "positions", "row_block_tables", "row_token_index",
                                               "kv_src", "kv_dst", "token_slot", "logits_index")), kv_cache=cache.clone())
    layout = TritonLayout(t["block_tables"], t["query_start"], t["context_lens"], t["slot_mapping"],
                          int(np.diff(batch.query_start).max()), 2)
    got, _ = model(t["token_ids"], t["positions"], None, None, None, None, None, t["logits_index"], kv_cache=cache,
                   kernel=layout)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
