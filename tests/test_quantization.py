"""`quantization: int8 | int4` (backend/engine/runners/gemm.py): the Q8_0 and Q4_1 kernels against exact float64
math on their own rounding, each int8 tactic forced against the float32 model within stated bounds, int4 against
float32 on its own rounding, the refusals by name, and the process's memory shrinking by what the weights shrank.

Bounds (teacher-forced over 200 fixed tokens, the tiny seeded random Llama; its logits have std ~4 and are far
more sensitive to rounding than a trained model's: on SmolLM2 Q8_0 keeps the float32 argmax at 90 % of such
positions with a mean relative logit error of 0.7 %, load_tests/bench_quantization.py):
- the kernels vs x @ dequantized(W) (q8_0) or dequantized(x) @ dequantized(W) (q8_0_w8a8) in float64: 1e-5
  relative (only float32 sums differ);
- each int8 tactic vs float32: relative L2 error of a position's logits 0.12 on average (measured 0.07-0.10), the
  argmax kept at >= 75 % of positions (measured 77-83 %).
- int4 (Q4_1 layers, lm_head Q8_0, int8 activations) vs float32 on those rounded weights: 0.10 and >= 75 %
  (measured 0.066 and 84 % with the lm_head's q8_0_w8a8; the activations' rounding alone). Against the unrounded float32 tiny model it keeps the argmax at only 21 %:
  4 bits on its wide random weights; SmolLM2's figures are in docs/benchmarks-log.md.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from backend.engine import EngineConfig, LLMEngine
from backend.engine.batch import build_model_input
from backend.engine.kernels import cpu_kernels
from backend.engine.kv_cache import KVCacheManager
from backend.engine.models.weight_blocks import Q4Blocks, Q8Blocks, cat_rows, from_gguf, q4_1, q8_0, take_rows
from backend.engine.runners import gemm
from backend.engine.runners.torch_runner import TorchRunner
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence
from tests.tiny_gguf import random_raw
from tests.tiny_model import make_tiny_llama, save_rounded

REPO = Path(__file__).resolve().parents[1]
INT8_TACTICS = [name for name, t in gemm.TACTICS.items() if t.quantization == "int8"]
TOKENS = torch.randint(100, 20000, (200,), generator=torch.Generator().manual_seed(0)).tolist()


def all_logits(runner: TorchRunner, tokens: list[int] = TOKENS) -> torch.Tensor:
    """The logits at every position of `tokens`, one prefill."""
    kv = KVCacheManager(runner.num_blocks, 16, enable_prefix_caching=False)
    seq = Sequence("0", tokens, SamplingParams(), 0)
    assert kv.allocate(seq, len(tokens))
    return runner.forward(build_model_input([(seq, len(tokens))], 16, 16, [len(tokens)]))


@pytest.mark.parametrize("m, n, k", [(1, 960, 576), (3, 7, 64), (16, 1536, 576), (5, 576, 1536), (13, 49, 96),
                                     (64, 3071, 576)])
def test_q8_0_kernel_is_exact_math_on_its_rounding(m, n, k):
    cpu_kernels.load()
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    blocks = q8_0(w)
    q, scales = blocks.q, blocks.scale
    assert q.abs().max() <= 127 and torch.equal(scales, (w.reshape(n, -1, 32).abs().amax(-1) / 127))
    dequantized = blocks.dequantize().double()
    assert (dequantized - w.double()).abs().max() <= scales.double().max() / 2 + 1e-6  # round to nearest
    packed, packed_scales = torch.ops.llm_kernels.q8_0_pack(q, scales)
    y = torch.ops.llm_kernels.q8_0_linear(x, packed, packed_scales, torch.empty(0), n)
    reference = x.double() @ dequantized.T
    assert y.shape == (m, n) and ((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5


def w8a8_runs_here() -> bool:
    """q8_0_w8a8 runs with AVX512-VNNI or AVX2 (its AVX2 path: an AMD Zen 3, or LLM_KERNEL_MARCH=x86-64-v3, in
    tests/test_kernels_avx2.py); a build for a CPU with neither refuses it by name."""
    if "q8_0_w8a8" in gemm.candidates(torch.float32, torch.device("cpu"), "int8"):
        return True
    assert "needs AVX2 and FMA" in gemm.why_not("q8_0_w8a8", torch.float32)
    assert not {"avx2", "fma"} <= set(cpu_kernels.cpu_flags().split())
    return False


@pytest.mark.parametrize("m, n, k", [(1, 960, 576), (3, 7, 64), (16, 1536, 576), (13, 49, 96), (64, 3071, 576)])
def test_q8_0_w8a8_is_exact_math_on_its_rounding(m, n, k):
    """Both operands rounded to Q8_0 (the activations per call): exact int8 products, float scales and sums."""
    if not w8a8_runs_here():
        return
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    y = gemm.TACTICS["q8_0_w8a8"].prepare(w, None)(x)
    reference = q8_0(x).dequantize().double() @ q8_0(w).dequantize().double().T
    assert y.shape == (m, n) and ((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K", "Q5_K", "Q2_K", "Q5_1"])  # Q8Blocks of other shapes
@pytest.mark.parametrize("m, n, k", [(1, 960, 1536), (13, 49, 256), (64, 577, 512)])
def test_the_q8_tactics_serve_gguf_blocks_with_a_scale_per_16_or_a_min(type_name, m, n, k):
    """Random GGUF blocks (models/weight_blocks.py): Q6_K and Q3_K (a scale per 16 weights), Q5_K and Q5_1 (q * scale
    + min per 32), Q2_K (per 16). q8_0 is exact math on their values; q8_0_w8a8 on them times Q8_0-rounded
    activations (the mins times the rounded activations' sums)."""
    rng = np.random.default_rng(m * n)
    blocks = from_gguf(type_name, random_raw(GGMLQuantizationType[type_name], n, k, rng, 0.01), n, k)
    assert isinstance(blocks, Q8Blocks) and blocks.block == (32 if type_name[:2] == "Q5" else 16)
    assert (blocks.m is None) == (type_name in ("Q6_K", "Q3_K"))
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    names = gemm.candidates(torch.float32, torch.device("cpu"), "int8", Q8Blocks)
    assert "q8_0" in names and ("q8_0_w8a8" in names) == w8a8_runs_here()
    for tactic, rounded_x in (("q8_0", x), ("q8_0_w8a8", q8_0(x).dequantize())):
        if tactic in names:
            y = gemm.TACTICS[tactic].prepare(blocks, None)(x)
            reference = rounded_x.double() @ blocks.dequantize().double().T
            assert y.shape == (m, n) and ((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5, tactic


@pytest.mark.parametrize("m, n, k", [(1, 960, 576), (3, 7, 64), (16, 1536, 576), (13, 49, 96), (64, 3071, 576),
                                     (5, 576, 1536)])
def test_q4_1_w4a8_is_exact_math_on_its_rounding(m, n, k):
    """Q4_1 weights (q in 0..15 within half a step of w) times Q8_0-rounded activations: exact integer products,
    float scales and sums; the AVX2 path runs in tests/test_kernels_avx2.py."""
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g) * 0.05
    blocks = q4_1(w)
    assert blocks.q.max() <= 15 and (blocks.dequantize() - w).abs().max() <= blocks.d.max() / 2 + 1e-6
    y = gemm.TACTICS["q4_1_w4a8"].prepare(w, None)(x)
    reference = q8_0(x).dequantize().double() @ blocks.dequantize().double().T
    assert y.shape == (m, n) and ((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5


def _served_blocks(tactic: str, type_name: str, seed: int,
                   k: int = 512) -> tuple[Q8Blocks | Q4Blocks, np.random.Generator] | None:
    """Random GGUF blocks [577, k] of `type_name` and the generator after them; None where this CPU refuses
    `tactic` (q8_0_w8a8 without VNNI or AVX2: by name)."""
    if (why := gemm.why_not(tactic, torch.float32)) is not None:
        assert tactic == "q8_0_w8a8" and "needs AVX512-VNNI" in why
        return None
    rng = np.random.default_rng(seed)
    return from_gguf(type_name, random_raw(GGMLQuantizationType[type_name], 577, k, rng, 0.01), 577, k), rng


@pytest.mark.parametrize("tactic, type_name, k", [
    ("q8_0_w8a8", "Q8_0", 512), ("q8_0_w8a8", "Q5_1", 512), ("q8_0_w8a8", "Q6_K", 512), ("q8_0_w8a8", "Q2_K", 512),
    ("q4_1_w4a8", "Q4_1", 512), ("q4_1_w4a8", "IQ4_NL", 512), ("q8_0_w8a8", "Q8_0", 480), ("q4_1_w4a8", "Q4_1", 480)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(tactic, type_name, k):
    """Each row of 45 at once equals that row alone, bit for bit. With AMX-INT8 (kernels/q8_0_w8a8.cpp and
    q4_1_w4a8.cpp) the first 32 rows go in tiles of 16, the last 13 through the VNNI microkernel, and one row alone
    through the microkernel: the two paths give the same float32 sums (the 6-bit weights, Q6_K and Q2_K, stay on
    VNNI: passes of 12 rows, then 9). The tiles take blocks two at a time (amx.h): 15 blocks (k 480) end on one.
    A CPU without VNNI refuses q8_0_w8a8 by name."""
    if (made := _served_blocks(tactic, type_name, 7, k)) is None:
        return
    blocks, rng = made
    x = torch.from_numpy(rng.standard_normal((45, k), dtype=np.float32))
    run = gemm.TACTICS[tactic].prepare(blocks, None)
    assert torch.equal(run(x), torch.cat([run(x[i:i + 1]) for i in range(45)]))


@pytest.mark.parametrize("tactic, type_name", [("q8_0_w8a8", "Q8_0"), ("q8_0_w8a8", "Q5_1"), ("q4_1_w4a8", "Q4_0"),
                                               ("q4_1_w4a8", "Q4_1"), ("q4_1_w4a8", "IQ4_NL")])
def test_a_files_float16_scales_are_read_in_float16_with_the_same_bits(tactic, type_name):
    """A GGUF block's scale (and min) is the file's float16: the int8 kernels read it so (kernels/block_scales.h,
    2 bytes a block, not 4; a Q8_0 weight in 8.5 bits, llama.cpp's) and give the float32 scales' outputs bit for bit, at 1
    row and at 45, alone and as an expert. Scales that float16 cannot hold exactly (our own Q8_0 of float weights)
    stay float32."""
    if (made := _served_blocks(tactic, type_name, 13)) is None:
        return
    (blocks, rng), (n, k) = made, (577, 512)
    kernel = gemm.TACTICS[tactic].prepare(blocks, None).gemm
    scales = kernel.panels[1:3]  # scales and mins
    assert scales[0].dtype == torch.float16 and all(t.numel() == 0 or t.dtype == torch.float16 for t in scales)
    floats = tuple(t.float() if t.dtype == torch.float16 else t for t in kernel.panels)
    x = torch.from_numpy(rng.standard_normal((45, k), dtype=np.float32))
    for rows in (x[:1], x):
        want = kernel.op(rows, *floats, *kernel.shared, n)
        assert torch.equal(kernel(rows), want)
        assert torch.equal(kernel.experts_op(rows, *kernel.panels, *kernel.shared, n, [0], [0, len(rows)]), want)
    if type_name == "Q8_0":
        assert 8 * sum(t.nbytes for t in kernel.panels) / (-(-n // 16) * 16 * k) == 8.5  # values, scale
        own = gemm.TACTICS[tactic].prepare(torch.randn(n, k) * 0.02, None).gemm
        assert own.panels[1].dtype == torch.float32


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("m, n, k", [(1, 960, 1536), (13, 49, 256), (64, 577, 512)])
def test_q4_1_w4a8_serves_iq4_blocks_through_their_table(type_name, m, n, k):
    """Random GGUF IQ4_NL / IQ4_XS blocks: 4-bit indices into llama.cpp's 16 int8 values (w ~ d * values[q]), which
    the kernel looks up in registers (VNNI: values + 128 unsigned; AVX2: |value| with its sign on x). Exact math on
    their values times Q8_0-rounded activations, as the plain Q4_1 blocks above."""
    rng = np.random.default_rng(m * n)
    blocks = from_gguf(type_name, random_raw(GGMLQuantizationType[type_name], n, k, rng, 0.01), n, k)
    assert isinstance(blocks, Q4Blocks) and blocks.values is not None and blocks.m is None and blocks.q.max() <= 15
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    y = gemm.TACTICS["q4_1_w4a8"].prepare(blocks, None)(x)
    reference = q8_0(x).dequantize().double() @ blocks.dequantize().double().T
    assert y.shape == (m, n) and ((y.double() - reference).abs().max() / reference.abs().max()) < 1e-5


@pytest.mark.parametrize("type_name", ["Q4_K", "IQ4_XS", "Q6_K", "Q5_K", "Q3_K", "Q2_K"])
def test_a_k_quants_scales_read_as_stored_are_its_float32_scales_bit_for_bit(type_name):
    """The int8 kernels read a K-quant's scales (and mins) as stored, int8 steps under a float16 unit per 256
    weights (kernels/block_scales.h), and form in registers the products the float32 scales hold: the same outputs
    bit for bit, at 1 row and at 45 (AMX tiles where the CPU has them), alone and as an expert, from 5/16 or less of
    the scales' bytes (a Q4_K weight in 4.625 bits). Joined (fused q/k/v) and reordered rows (llama.cpp's rotary
    order) keep them."""
    rng = np.random.default_rng(11)
    n, k = 577, 512
    blocks = from_gguf(type_name, random_raw(GGMLQuantizationType[type_name], n, k, rng, 0.01), n, k)
    tactic = "q4_1_w4a8" if isinstance(blocks, Q4Blocks) else "q8_0_w8a8"
    if tactic == "q8_0_w8a8" and not w8a8_runs_here():
        return
    assert blocks.stored is not None and (blocks.stored.min_step is None) == (blocks.m is None)
    joined = cat_rows([blocks, take_rows(blocks, torch.randperm(n, generator=torch.Generator().manual_seed(0)))])
    assert torch.equal(joined.stored.scales(), joined.d if tactic == "q4_1_w4a8" else joined.scale)
    as_stored = gemm.TACTICS[tactic].prepare(blocks, None)
    floats = gemm.TACTICS[tactic].prepare(dataclasses.replace(blocks, stored=None), None)
    kernel, flat = as_stored.gemm, floats.gemm
    def scale_bytes(k: gemm.PackedKernel) -> int:  # not the weights
        return sum(t.nbytes for t in k.panels[1:])

    assert scale_bytes(kernel) <= 0.3125 * scale_bytes(flat)  # 1 byte a scale and 2 per 8 or 16, not 4
    if type_name == "Q4_K":  # nibbles, a scale and a min step per 32, their units per 256 (llama.cpp's file: 4.5)
        assert 8 * sum(t.nbytes for t in kernel.panels) / (-(-n // 16) * 16 * k) == 4.625
    x = torch.from_numpy(rng.standard_normal((45, k), dtype=np.float32))
    for rows in (x[:1], x):
        want = floats(rows)
        assert torch.equal(as_stored(rows), want)
        assert torch.equal(kernel.experts_op(rows, *kernel.panels, *kernel.shared, n, [0], [0, len(rows)]), want)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K", "Q2_K"])
def test_a_k_quants_16_weight_sub_blocks_are_read_in_6_bits(type_name):
    """The values of a K-quant with a scale per 16 weights fit in 6 bits (Q6_K -32..31, Q3_K -4..3, Q2_K 0..3), and
    q8_0_w8a8 packs them so (kernels/q8_0_w8a8.cpp: 4 bits in the 4-bit kernels' nibble layout, the top 2 in planes
    beside them): 6 bits a weight where int8 values took 8 (as llama.cpp's Q6_K's 6.56 with its scales, ours the
    same). Exact math on the values is the test above; a weight with a scale per 16 outside 6 bits
    is refused by name."""
    if not w8a8_runs_here():
        return
    rng = np.random.default_rng(5)
    n, k = 577, 512
    blocks = from_gguf(type_name, random_raw(GGMLQuantizationType[type_name], n, k, rng, 0.01), n, k)
    kernel = gemm.TACTICS["q8_0_w8a8"].prepare(blocks, None).gemm
    packed, scales, mins, scale_steps, min_steps = kernel.panels
    panels = -(-n // 16)
    assert packed.dtype == torch.uint8 and packed.shape == (panels, k // 32, 384)
    bits = 8 * sum(t.nbytes for t in kernel.panels) / (panels * 16 * k)
    # 6 bits, an int8 step per 16 and a float16 unit per 256 (and as many for Q2_K's mins); Q3_K and Q2_K: 6-bit
    # values of their 3.4 and 2.6 bits
    assert bits <= 6.5625 + (0.5625 if blocks.m is not None else 0), bits
    wide = dataclasses.replace(blocks, q=blocks.q.clone().index_fill_(1, torch.tensor([5]), -33))
    with pytest.raises(ValueError, match="q8_0_w8a8: a weight with a scale per 16 must have values in -32..31"):
        gemm.TACTICS["q8_0_w8a8"].prepare(wide, None)


def assert_near(logits: torch.Tensor, reference: torch.Tensor, max_relative: float, min_agreement: float) -> None:
    """Mean relative L2 distance per position at most `max_relative`, argmax agreement at least `min_agreement`."""
    relative = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert relative.mean() <= max_relative, relative.mean()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= min_agreement


@pytest.fixture(scope="module")
def float_logits(tiny_model_dir) -> torch.Tensor:
    return all_logits(TorchRunner(tiny_model_dir, "float32", 64, 16, gemm_backend="aten"))


@pytest.mark.parametrize("tactic", INT8_TACTICS)
def test_each_int8_tactic_forced_is_within_its_bounds(tiny_model_dir, float_logits, tactic):
    if tactic not in gemm.candidates(torch.float32, torch.device("cpu"), "int8"):
        with pytest.raises(ValueError, match=f"gemm_backend: {tactic} cannot run float32 on this cpu"):
            TorchRunner(tiny_model_dir, "float32", 64, 16, gemm_backend=tactic, quantization="int8")
        return
    runner = TorchRunner(tiny_model_dir, "float32", 64, 16, gemm_backend=tactic, quantization="int8")
    assert set(runner.gemm_tactics.values()) == {tactic}
    assert all(m.weight is None for m in runner.model.modules() if isinstance(m, torch.nn.Linear)), \
        "the float weights are released"
    assert_near(all_logits(runner), float_logits, 0.12, 0.75)


def test_int4_is_its_rounding_plus_int8_activations(tiny_model_dir, tmp_path):
    """int4 (Q4_1 layers, lm_head Q8_0, the embedding float) against float32 on a copy of the model whose weights are
    that rounding's values: only the activations' rounding differs."""
    rounded = save_rounded(tiny_model_dir, tmp_path / "rounded", "int4")
    reference = all_logits(TorchRunner(rounded, "float32", 64, 16, gemm_backend="aten"))
    runner = TorchRunner(tiny_model_dir, "float32", 64, 16, quantization="int4")
    assert {s.out_features: t for s, t in runner.gemm_tactics.items()}[runner.model.cfg.vocab_size] in INT8_TACTICS
    assert set(runner.gemm_tactics.values()) - set(INT8_TACTICS) == {"q4_1_w4a8"}
    assert_near(all_logits(runner), reference, 0.10, 0.75)


def test_int8_auto_picks_among_int8_tactics_and_serves(tiny_model_dir):
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), quantization="int8"))
    assert set(engine.runner.gemm_tactics.values()) <= set(INT8_TACTICS)
    [out] = engine.generate([TOKENS[:20]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out) == 8 and engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("settings, words", [
    ({"quantization": "int5"},
     "quantization: expected one of ['none', 'int8', 'int4', 'gguf', 'compressed-tensors', 'gptq', 'awq'], got "
     "'int5'"),
    ({"quantization": "int4", "gemm_backend": "onednn"}, "gemm_backend: onednn cannot run float32 on this cpu (not a "),
    ({"quantization": "int8", "gemm_backend": "q4_1_w4a8"}, "gemm_backend: q4_1_w4a8 cannot run float32 on this cpu "
                                                            "(not a int8 tactic"),
    ({"quantization": "int8", "gemm_backend": "onednn"}, "gemm_backend: onednn cannot run float32 on this cpu (not a "
                                                         "int8 tactic"),
    ({"quantization": "none", "gemm_backend": "q8_0"}, "gemm_backend: q8_0 cannot run float32 on this cpu (not a "
                                                       "none tactic"),
    ({"quantization": "gguf", "runtime": "onnxruntime", "engine_dir": "/nonexistent"},
     "quantization: gguf is served by runtime torch, not onnxruntime"),
    ({"quantization": "int4", "runtime": "tensorrt", "engine_dir": "/nonexistent"},
     "quantization: int4 is served by runtime torch and onnxruntime, not tensorrt"),
])
def test_bad_quantization_settings_are_refused_by_name(tiny_model_dir, settings, words):
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig.create(model=str(tiny_model_dir), **settings))
    assert words in str(err.value), err.value


RSS_SCRIPT = """
import ctypes, sys, torch
from backend.engine.runners.torch_runner import TorchRunner
runner = TorchRunner(sys.argv[1], "float32", 16, 16, gemm_backend=sys.argv[2], quantization=sys.argv[3])
ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed load-time temporaries the allocator kept are not weights
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024)
"""


def loaded_rss(model: Path, tactic: str, quantization: str) -> int:
    """The RSS of a fresh process (1 thread) that has loaded `model` so."""
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model), tactic, quantization], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_the_process_shrinks_by_what_the_weights_shrank(tmp_path):
    """A larger random Llama (untied lm_head), loaded in a fresh process each way: int8 keeps 1 byte per weight plus a
    float scale per 32, float32 4 bytes; the float copies are released."""
    model = make_tiny_llama(tmp_path / "m", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4)
    runner = TorchRunner(model, "float32", 16, 16, gemm_backend="aten")
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    shrink = sum(m.weight.numel() * (4 - 1 - 4 / 32) for m in linears)

    dropped = loaded_rss(model, "onednn", "none") - loaded_rss(model, "q8_0", "int8")
    assert dropped >= 0.8 * shrink, (dropped / 2**20, shrink / 2**20)
    lm_head = runner.model.lm_head.weight.numel()  # int4 keeps it in Q8_0
    shrink4 = sum(m.weight.numel() * (4 - 0.5 - 8 / 32) for m in linears) - lm_head * (1 + 4 / 32 - 0.5 - 8 / 32)
    loaded_rss(model, "q4_1_w4a8", "int4")  # the first start times its lm_head's int8 tactics (cached): not weights
    dropped = loaded_rss(model, "onednn", "none") - loaded_rss(model, "q4_1_w4a8", "int4")
    assert dropped >= 0.8 * shrink4, (dropped / 2**20, shrink4 / 2**20)
