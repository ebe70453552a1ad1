"""`kv_cache_dtype: float16 | int8` (backend/engine/kv_quantization.py): int8 rows rounded to nearest on their own
scale; the model on a narrower cache within stated bounds of the float32 cache (kernel and gather attention), the pool
holding 2x (float16) and 3.76x (int8) the blocks per GB, an engine serving from it without leaking a block (prefix
hits, chunked prefill, a mixed batch), blocks moving between engines of one cache dtype only (disaggregated prefill),
config.pbtxt's `kv_cache_dtype` through a real tritonserver, and the refusals by name. The kernel against the gather
path on narrower rows: tests/test_paged_attention.py; n-gram speculation on an int8 cache: tests/test_speculative.py.

Bounds (teacher-forced over 200 fixed tokens, the tiny seeded random Llama, whose logits are far more sensitive to
rounding than a trained model's): int8, relative L2 error of a position's logits 0.07 on average (measured 0.044, both
attention paths), the float32 cache's argmax kept at >= 90 % of positions (measured 96.5 %); float16, 0.005 and 98 %
(measured 0.0025 and 99.5 %, both paths). SmolLM2 over the same tokens, int8: 0.005 and 96 %
(load_tests/bench_quantization.py gives its perplexity).
"""

from __future__ import annotations

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.errors import InvalidRequestError
from backend.engine.kv_quantization import dequantize, quantize
from backend.engine.runners.torch_runner import TorchRunner
from client.client import LLMClient
from tests.conftest import start_server
from tests.test_quantization import TOKENS, all_logits, assert_near
from tests.test_server import metrics


def test_each_row_rounds_to_nearest_on_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-3, 2, 5).view(5, 1, 1)  # rows of very different sizes
    x[2, 1] = 0
    packed = quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (5, 3, 68)
    scale = packed[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale[..., 0][x.abs().amax(-1) > 0], (x.abs().amax(-1) / 127)[x.abs().amax(-1) > 0])
    assert packed[..., :64].abs().max() == 127 and torch.equal(dequantize(packed, torch.float32)[2, 1], x[2, 1])
    assert ((dequantize(packed, torch.float32) - x).abs() <= scale / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_row_writer_rounds_as_quantize_does(dtype):
    """llm_kernels.write_int8_rows (the kernel path's writer) on K as the model has it: a strided view of qkv."""
    from backend.engine.kernels import cpu_kernels

    cpu_kernels.load()
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(9, 4 * 16 + 2 * 2 * 16, generator=g) * 3).to(dtype)
    qkv[4, 64:96] = 0  # a zero row
    k = qkv[:, 64:96].view(9, 2, 16)
    cache = torch.zeros(6, 4, 2, 20, dtype=torch.int8)
    slots = torch.tensor([23, 0, 5, 6, 7, 1, 12, 13, 2])
    torch.ops.llm_kernels.write_int8_rows(k, cache, slots)
    assert torch.equal(cache.view(-1, 2, 20)[slots], quantize(k))
    assert cache.view(-1, 2, 20)[[3, 4, 8]].eq(0).all()  # nothing else written


@pytest.fixture(scope="module")
def float_cache_logits(tiny_model_dir) -> torch.Tensor:
    return all_logits(TorchRunner(tiny_model_dir, "float32", 64, 16, gemm_backend="aten"))


@pytest.mark.parametrize("attention", ["kernel", "gather"])
@pytest.mark.parametrize("kv, dtype, width, bounds", [("int8", torch.int8, 4, (0.07, 0.90)),
                                                      ("float16", torch.float16, 0, (0.005, 0.98))])
def test_a_narrower_cache_is_within_its_bounds_of_the_float32_cache(tiny_model_dir, float_cache_logits, attention, kv,
                                                                    dtype, width, bounds):
    runner = TorchRunner(tiny_model_dir, "float32", 64, 16, attention=attention, gemm_backend="aten",
                         kv_cache_dtype=kv)
    cfg = runner.model_config
    assert runner.kv_cache.dtype == dtype
    assert runner.kv_cache.shape == (cfg.num_layers, 2, 64, 16, cfg.num_kv_heads, cfg.head_dim + width)
    logits = all_logits(runner)
    assert_near(logits, float_cache_logits, *bounds)
    assert not torch.equal(logits, float_cache_logits)  # the rows were rounded


def test_the_pool_holds_what_the_rows_shrank(tiny_model_dir):
    """Same kv_cache_memory_gb: rows of head_dim 16 take 32 bytes in float16 and 20 in int8 where float32 takes 64."""
    engines = [LLMEngine(EngineConfig.create(model=str(tiny_model_dir), kv_cache_memory_gb=0.01, kv_cache_dtype=kv))
               for kv in ("auto", "float16", "int8")]
    cfg = engines[0].model_config
    row_budget = int(0.01 * 2**30) // (cfg.num_layers * 2 * cfg.num_kv_heads)  # the pool's bytes per row of a token
    assert [e.kv.num_blocks for e in engines] == [row_budget // row // 16 for row in (64, 32, 20)]
    for engine in engines:
        cache = engine.runner.kv_cache
        assert cache.numel() * cache.element_size() <= 0.01 * 2**30


@pytest.mark.parametrize("kv", ["int8", "float16"])
def test_an_engine_serves_from_a_narrower_cache_and_frees_every_block(tiny_model_dir, kv):
    """Shared prefixes (prefix hits), prompts longer than a step's token budget (chunked prefill) and a mixed batch."""
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), kv_cache_dtype=kv, max_num_batched_tokens=64))
    prefix = TOKENS[:48]
    prompts = [prefix + TOKENS[100 + i:110 + i] for i in range(4)] + [TOKENS[:150], TOKENS[20:23]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o) for o in outputs] == [12] * 6
    assert engine.kv.stats.hit_tokens >= 3 * 48  # the prompts after the first found the prefix cached
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_free_blocks == engine.kv.num_blocks
    again = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), kv_cache_dtype=kv, max_num_batched_tokens=64))
    assert again.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True)) == outputs  # deterministic


@pytest.mark.parametrize("kv_cache_dtype, dtype", [("int8", torch.int8), ("float16", torch.float16)])
def test_blocks_move_between_engines_of_their_cache_dtype_only(tiny_model_dir, kv_cache_dtype, dtype):
    prompt = TOKENS[:57]  # 3 full blocks of 16 and a partial one
    prefill, decode = (LLMEngine(EngineConfig.create(model=str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype))
                       for _ in range(2))
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    kv = prefill.export_kv(prompt)
    assert kv.data.dtype == dtype and kv.num_tokens == 48
    assert decode.import_kv(prompt, kv) == 48
    [out] = decode.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert decode.kv.stats.hit_tokens == 48
    assert out == prefill.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]

    float_engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir)))
    with pytest.raises(InvalidRequestError, match=rf"kv: blocks of shape .* {dtype} do not fit this pool"):
        float_engine.import_kv(prompt, kv)


def test_served_from_an_int8_cache(tmp_path_factory, tiny_model_dir):
    """The text the engine's own greedy ids on an int8 cache decode to, from a pool of as many blocks as the engine's."""
    from backend.serving.detokenize import decode_text
    from backend.serving.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = "The quick brown fox"
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), kv_cache_dtype="int8", kv_cache_memory_gb=0.05))
    [expected] = engine.generate([encode(tokenizer, prompt, False)], SamplingParams(max_tokens=24, ignore_eos=True))
    settings = {"kv_cache_dtype": "int8", "kv_cache_memory_gb": "0.05"}
    with start_server(tmp_path_factory.mktemp("repo_kv_int8"), tiny_model_dir, settings) as srv:
        srv.wait_ready(300)
        with LLMClient(srv.url_grpc, "llm") as client:
            text = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=True).text
        blocks = metrics(srv)['llm_kv_blocks{state="total"}']
    assert text == decode_text(tokenizer, expected)
    assert blocks == engine.kv.num_blocks and engine.kv.num_blocks > 3 * LLMEngine(EngineConfig.create(
        model=str(tiny_model_dir), kv_cache_memory_gb=0.05)).kv.num_blocks


@pytest.mark.parametrize("settings, words", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype: expected one of ['auto', 'float16', 'int8'], got 'fp8'"),
    ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "kv_cache_dtype: float16 stores a float32 model's K/V; a "
                                                         "bfloat16 model's cache is bfloat16 (auto) or int8"),
    ({"kv_cache_dtype": "int8", "runtime": "onnxruntime", "engine_dir": "/nonexistent"},
     "kv_cache_dtype: int8 is served by runtime torch on the CPU, not onnxruntime on cpu"),
    ({"kv_cache_dtype": "int8", "device": "cuda"}, "kv_cache_dtype: int8 is served by runtime torch on the CPU, not "
                                                   "torch on cuda"),
])
def test_bad_kv_cache_dtype_settings_are_refused_by_name(tiny_model_dir, settings, words):
    with pytest.raises(ValueError) as err:
        EngineConfig.create(model=str(tiny_model_dir), **settings)
    assert words in str(err.value), err.value
