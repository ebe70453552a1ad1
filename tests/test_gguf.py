"""`quantization: gguf` (models/gguf_weights.py, models/weight_blocks.py): a GGUF's blocks decoded exactly as gguf-py
decodes them, placed where PagedLlama's fused Linears want them (llama.cpp's q/k row order undone), and served
without a float copy, on a tiny random Llama written as llama.cpp writes one (also through a real tritonserver) and on
the default model as shipped.

Bounds: the served logits against float32 on the dequantized weights (the only difference being the activations
rounded to int8 per 32 values, llama.cpp's Q8_1 / Q8_0 activations): on the tiny random Llama (logit std ~4, far
more sensitive than a trained model) relative L2 error 0.05 on average and the argmax kept at >= 85 % of positions
(measured ~0.02 / ~95 %); on SmolLM2 as shipped, perplexity within 1 % of float32 on the dequantized file and
top-1 agreement >= 90 % over float32's greedy outputs (load_tests/bench_quantization.py has the figures).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType, dequantize
from transformers import MixtralConfig, Qwen3MoeConfig

from backend.engine import EngineConfig, LLMEngine
from backend.engine.models.checkpoint_format import served_quantization
from backend.engine.models.gguf_weights import gguf_file, load_gguf
from backend.engine.models.llama import load_model
from backend.engine.models.weight_blocks import MXFP4_VALUES, STORED, Q4Blocks, Q8Blocks, Stacked, as_float, from_gguf
from backend.engine.runners import torch_runner
from backend.engine.runners.gemm import TACTICS
from backend.engine.runners.torch_runner import TorchRunner
from backend.engine.sampling import SamplingParams
from backend.serving.detokenize import decode_text
from backend.serving.model_store import gguf_config, prepare_default_model, prepare_gguf_folder
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from load_tests.bench_quantization import fixed_text
from tests.conftest import start_server
from tests.reference import hf_greedy
from tests.test_model_families import COMMON, FAMILIES, VOCAB, WINDOW, save_random
from tests.test_quantization import TOKENS, all_logits, assert_near, loaded_rss
from tests.tiny_gguf import random_raw, write_gguf
from tests.tiny_model import make_tiny_llama

TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q4_1", "token_embd": "Q8_0", "output": "Q8_0"}


@pytest.mark.parametrize("type_name", STORED)
def test_each_block_form_decodes_as_gguf_py_decodes_it(type_name):
    """Random blocks (finite float16 scales, every other byte random): our Q8Blocks / Q4Blocks hold the same values."""
    qtype = GGMLQuantizationType[type_name]
    rows, cols = 6, 2 * GGML_QUANT_SIZES[qtype][0]
    raw = random_raw(qtype, rows, cols, np.random.default_rng(len(type_name)), 2.0)
    blocks = from_gguf(type_name, raw, rows, cols)
    assert isinstance(blocks, Q4Blocks if type_name.startswith(("Q4", "IQ4", "MXFP4")) else Q8Blocks)
    if isinstance(blocks, Q4Blocks):
        assert blocks.q.max() <= 15
    expected = dequantize(raw, qtype).reshape(rows, cols)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))


def test_only_the_stored_forms_are_read_as_blocks():
    with pytest.raises(ValueError, match="weight_blocks: Q8_0, Q5_0, .*, IQ4_XS, MXFP4 are read as blocks, not IQ2_XS"):
        from_gguf("IQ2_XS", np.zeros((1, 74), np.uint8), 1, 256)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("tiny_gguf"), TYPES)


def test_the_stored_blocks_are_the_dequantized_model_exactly(tiny_gguf):
    """Names, fusion and llama.cpp's q/k row order: every served Linear (and the embedding) dequantizes to the
    weights of the folder made from the same file, bit for bit, and the file's norms are the folder's."""
    model = TorchRunner(tiny_gguf, "float32", 16, 16, gemm_backend="aten").model
    state, stored = load_gguf(tiny_gguf, model.cfg)
    assert set(stored) == {"embed_tokens"} | {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, blocks in stored.items():
        assert torch.equal(blocks.dequantize(), model.get_submodule(name).weight), name
    norms = {n.removeprefix("model."): w for n, w in state.items()}  # the rest of the model: its norms
    assert set(norms) == {n for n, _ in model.named_parameters()} - {f"{n}.weight" for n in stored}
    for name, weight in norms.items():
        assert torch.equal(weight, model.get_parameter(name)), name


def test_the_stored_weights_stand_in_the_model_without_bytes(tiny_gguf):
    """Before the tactics take them, the model's stored Linears and embedding are a zero expanded to their shape, never
    materialized (a float32 copy of a 1B's embedding would be 1 GB at load), while its norms are copies of their own."""
    cfg = TorchRunner(tiny_gguf, "float32", 16, 16, gemm_backend="aten").model.cfg
    state, stored = load_gguf(tiny_gguf, cfg)
    model = load_model(tiny_gguf, torch.float32, "cpu", state, stored)
    for name in stored:
        assert model.get_submodule(name).weight.stride() == (0, 0), name
    assert model.norm.weight.untyped_storage().nbytes() == 4 * cfg.hidden_size


def test_served_gguf_is_within_its_bounds_of_float32_on_the_same_values(tiny_gguf):
    reference = all_logits(TorchRunner(tiny_gguf, "float32", 64, 16, gemm_backend="aten"))
    runner = TorchRunner(tiny_gguf, "float32", 64, 16, quantization="gguf")
    assert set(runner.gemm_tactics.values()) <= {"q4_1_w4a8", "q8_0", "q8_0_w8a8"}
    assert all(m.weight is None for m in runner.model.modules() if isinstance(m, torch.nn.Linear))
    assert not isinstance(runner.model.embed_tokens, torch.nn.Embedding), "the embedding stays in its blocks"
    assert_near(all_logits(runner), reference, 0.05, 0.85)


# a Q4_K_M file as llama.cpp makes one: Q4_K, with Q6_K for attn_v and the output (and here the embedding); and types
# of other files: Q5_K (a Q5_K_M's) for ffn_up, Q2_K for ffn_down, F16 (no kernel of ours) for attn_output
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "F16", "ffn_gate": "Q4_K",
          "ffn_up": "Q5_K", "ffn_down": "Q2_K", "token_embd": "Q6_K", "output": "Q6_K"}


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory) -> Path:
    """Q4_K_M of a random Llama wide enough for K-quants' 256-value blocks (random blocks: gguf-py cannot round to
    them)."""
    model = make_tiny_llama(tmp_path_factory.mktemp("wide_llama"), hidden_size=256, intermediate_size=512, head_dim=64)
    return write_gguf(model, tmp_path_factory.mktemp("tiny_q4_k_m"), Q4_K_M)


def test_a_q4_k_m_file_is_served_whole(tiny_q4_k_m):
    """Its K-quant Linears (and embedding) as blocks, the fused q/k/v (Q4_K q/k, Q6_K v) and gate/up (Q4_K, Q5_K) in
    two parts each, the F16 o_proj as its float32 values: each exactly the folder's weights, and served within the
    bounds above of float32 on the same values."""
    reference_runner = TorchRunner(tiny_q4_k_m, "float32", 64, 16, gemm_backend="aten")
    _, stored = load_gguf(tiny_q4_k_m, reference_runner.model.cfg)
    forms = {name: type(w) for name, w in stored.items()}
    assert {name for name, form in forms.items() if form is torch.Tensor} == {f"layers.{i}.o_proj" for i in range(2)}
    down, lm_head = stored["layers.0.down_proj"], stored["lm_head"]
    assert isinstance(down, Q8Blocks) and down.block == 16 and down.m is not None
    assert isinstance(lm_head, Q8Blocks) and lm_head.block == 16 and lm_head.m is None
    for fused in ("qkv_proj", "gate_up_proj"):
        assert forms[f"layers.0.{fused}"] is Stacked
        assert [type(p) for p in stored[f"layers.0.{fused}"].parts] == [Q4Blocks, Q8Blocks]
    for name, weight in stored.items():
        assert torch.equal(as_float(weight), reference_runner.model.get_submodule(name).weight), name
    runner = TorchRunner(tiny_q4_k_m, "float32", 64, 16, quantization="gguf")
    tactics = {(s.out_features, s.in_features): t for s, t in runner.gemm_tactics.items()}
    # gate, q/k; up, down, v, lm_head; o
    assert tactics[(384, 256)] == "q4_1_w4a8"
    assert {tactics[(256, 512)], tactics[(128, 256)], tactics[(49152, 256)]} <= {"q8_0", "q8_0_w8a8"}
    assert TACTICS[tactics[(256, 256)]].quantization == "none"  # a float tactic
    assert all(m.weight is None for m in runner.model.modules() if isinstance(m, torch.nn.Linear))
    # 0.08 / 80 % here (measured 0.046 / 86 %): this random model's logits have near-ties (the median gap between its
    # top two is 0.41, against a spread of 8), and most flips of the argmax are at such gaps
    assert_near(all_logits(runner), all_logits(reference_runner), 0.08, 0.80)
    engine = LLMEngine(EngineConfig.create(model=str(tiny_q4_k_m), quantization="gguf"))
    [out] = engine.generate([TOKENS[:20]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out) == 8 and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_stored_f16_tensor_keeps_its_16_bits_under_f32_panels(tiny_q4_k_m):
    """In a float32 model, f32_panels serves the file's F16 o_proj as stored (half a float32 copy's bytes, read and
    held), with the float32 copy's sums: its values widen exactly."""
    runner = TorchRunner(tiny_q4_k_m, "float32", 64, 16, quantization="gguf", gemm_backend="f32_panels")
    _, stored = load_gguf(tiny_q4_k_m, runner.model.cfg)
    for i in range(2):
        weight, gemm = stored[f"layers.{i}.o_proj"], runner.model.get_submodule(f"layers.{i}.o_proj").gemm
        assert weight.dtype == torch.float16 and [t.dtype for t in gemm.gemm.panels] == [torch.float16]
        x = torch.randn(7, weight.shape[1])
        assert torch.equal(gemm(x), TACTICS["f32_panels"].prepare(weight.float(), None)(x))


# mixtures of experts as llama.cpp's converter writes them (every layer sparse, as its qwen3moe reads): each projection
# of a layer's experts one 3-D tensor, the router float32
MOE = {"qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=128, num_hidden_layers=2, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True),
       "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=8,
                                        num_experts_per_tok=2, sliding_window=WINDOW)}
MOE_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate_exps": "Q4_0",
             "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}


@pytest.mark.parametrize("family", list(MOE))
def test_a_mixture_of_experts_file_is_served_expert_by_expert(family, tmp_path, monkeypatch):
    """Each expert's slice of the file's 3-D tensors is that expert's Linear exactly, and the router is the folder's;
    served as stored within the bounds above of float32 on the same values, the pool free afterwards; its experts
    stacked into one call per Linear (int8-activation tactics) compute what they compute one by one. Dequantized
    (`none` on the file alone) it is greedy-equal to HF generate on the folder of its values: every expert in its
    place."""
    folder = write_gguf(save_random(tmp_path / "hf", MOE[family]()), tmp_path / "gguf", MOE_TYPES)
    reference_runner = TorchRunner(folder, "float32", 64, 16, gemm_backend="aten", quantization="none")
    state, stored = load_gguf(folder, reference_runner.model.cfg)
    assert {n for n in stored if ".experts." in n} == {f"layers.{i}.moe.experts.{e}.{p}" for i in range(2)
                                                        for e in range(8) for p in ("gate_up_proj", "down_proj")}
    for name, weight in stored.items():
        assert torch.equal(as_float(weight), reference_runner.model.get_submodule(name).weight), name
    for i in range(2):
        router = next(w for n, w in state.items() if n.startswith(f"model.layers.{i}.") and n.endswith("gate.weight"))
        assert torch.equal(router, reference_runner.model.get_parameter(f"layers.{i}.moe.router"))
    tokens = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = TorchRunner(folder, "float32", 64, 16, quantization="gguf")
    tactics = {(s.out_features, s.in_features): t for s, t in runner.gemm_tactics.items()}
    inter = runner.model.cfg.moe_intermediate_size  # an expert's gate/up: Q4_0 and Q4_1 rows; its down: Q8_0
    assert tactics[(2 * inter, 64)] == "q4_1_w4a8" and tactics[(64, inter)] in ("q8_0", "q8_0_w8a8")
    # both int8-activation kernels: a layer's experts in one call per Linear (q8_0 has no experts kernel)
    assert [layer.moe.stacked is not None for layer in runner.model.layers] == [tactics[(64, inter)] == "q8_0_w8a8"] * 2
    # either Q8_0 tactic that timing may pick (a machine's choice) within its bound of float32 on the same values:
    # float activations (q8_0) 0.05 / 85 % (measured 0.017 / 98 %); int8 ones as llama.cpp rounds them (q8_0_w8a8)
    # 0.08 / 85 % (measured on mixtral 0.059 / 89 %: the mean is 2 of 120 positions routed to other experts, 0.3 / 0.7)
    reference = all_logits(reference_runner, tokens)
    assert_near(all_logits(TorchRunner(folder, "float32", 64, 16, gemm_backend="q8_0", quantization="gguf"), tokens),
                reference, 0.05, 0.85)
    w8a8 = TorchRunner(folder, "float32", 64, 16, gemm_backend="q8_0_w8a8", quantization="gguf")  # stacked here too
    assert all(layer.moe.stacked is not None for layer in w8a8.model.layers)
    assert_near(all_logits(w8a8, tokens), reference, 0.08, 0.85)
    monkeypatch.setattr(torch_runner, "stack_experts", lambda model: 0)
    one_by_one = TorchRunner(folder, "float32", 64, 16, gemm_backend="q8_0_w8a8", quantization="gguf")
    assert torch.equal(all_logits(w8a8, tokens), all_logits(one_by_one, tokens))
    engine = LLMEngine(EngineConfig.create(model=str(folder), quantization="gguf"))
    assert len(engine.generate([tokens[:30]], SamplingParams(max_tokens=8, ignore_eos=True))[0]) == 8
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    prompts = [tokens[:7], tokens[:70]]
    want = hf_greedy(folder, prompts, [12, 12])  # HF on the folder's float weights: the file's values
    (folder / "model.safetensors").unlink()  # the file alone: `none` serves its dequantized values
    alone = LLMEngine(EngineConfig.create(model=str(folder), quantization="none"))
    assert alone.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True)) == want


def test_a_gpt_oss_file_with_mxfp4_experts(tmp_path, monkeypatch):
    """gpt-oss as llama.cpp's MXFP4_MOE files hold it: experts MXFP4 (a power-of-two scale per 32 and E2M1 values),
    attention Q8_0, sinks and biases float32. Each expert's slice is its Linear exactly, kept as 4-bit indices into
    MXFP4's table; as stored, a layer's experts (with their biases) run in one kernel call per Linear, bit-equal to one
    call per expert, within the bounds above of float32 on the same values; dequantized (`none` on the file alone),
    greedy-equal to HF generate on the folder of its values: sinks, biases and every expert in place."""
    types = {**MOE_TYPES, "ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4"}
    folder = write_gguf(save_random(tmp_path / "hf", FAMILIES["gpt_oss"]()), tmp_path / "gguf", types)
    reference_runner = TorchRunner(folder, "float32", 64, 16, gemm_backend="aten", quantization="none")
    _, stored = load_gguf(folder, reference_runner.model.cfg)
    for name, weight in stored.items():
        assert torch.equal(as_float(weight), reference_runner.model.get_submodule(name).weight), name
    expert = stored["layers.1.moe.experts.5.down_proj"]
    assert isinstance(expert, Q4Blocks) and expert.values.tolist() == MXFP4_VALUES.tolist()
    tokens = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = TorchRunner(folder, "float32", 64, 16, quantization="gguf")
    assert all(layer.moe.stacked is not None for layer in runner.model.layers)
    logits = all_logits(runner, tokens)
    assert_near(logits, all_logits(reference_runner, tokens), 0.05, 0.85)
    monkeypatch.setattr(torch_runner, "stack_experts", lambda model: 0)
    assert torch.equal(logits, all_logits(TorchRunner(folder, "float32", 64, 16, quantization="gguf"), tokens))
    prompts = [tokens[:7], tokens[:70]]
    want = hf_greedy(folder, prompts, [12, 12])
    (folder / "model.safetensors").unlink()
    alone = LLMEngine(EngineConfig.create(model=str(folder), quantization="none"))
    assert alone.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True)) == want
    assert alone.kv.num_free_blocks == alone.kv.num_blocks


# an IQ4_XS / IQ4_NL file's Linears (llama.cpp falls back to IQ4_NL where a row is not whole 256-value blocks), and a
# Q4_0 attn_v: 4-bit indices into a table beside plain 4-bit values
IQ4 = {"attn_q": "IQ4_NL", "attn_k": "IQ4_NL", "attn_v": "Q4_0", "attn_output": "IQ4_NL", "ffn_gate": "IQ4_XS",
       "ffn_up": "IQ4_NL", "ffn_down": "IQ4_NL", "token_embd": "Q8_0", "output": "Q8_0"}


def test_an_iq4_file_is_served_by_the_4_bit_kernel(tmp_path_factory):
    """IQ4_NL and IQ4_XS stay 4-bit indices (`Q4Blocks.values`), looked up by q4_1_w4a8 itself: each weight is the
    folder's exactly, gate (IQ4_XS) and up (IQ4_NL) are one weight, q/k/v two parts (a Q4_0 v has no table), and the
    logits are within the bounds above of float32 on the same values (measured 0.021 / 95 %)."""
    model = make_tiny_llama(tmp_path_factory.mktemp("wide_llama"), hidden_size=256, intermediate_size=512, head_dim=64)
    folder = write_gguf(model, tmp_path_factory.mktemp("tiny_iq4"), IQ4)
    reference_runner = TorchRunner(folder, "float32", 64, 16, gemm_backend="aten")
    _, stored = load_gguf(folder, reference_runner.model.cfg)
    gate_up, qkv = stored["layers.0.gate_up_proj"], stored["layers.0.qkv_proj"]
    assert isinstance(gate_up, Q4Blocks) and gate_up.values is not None and gate_up.m is None
    assert [p.values is None for p in qkv.parts] == [False, True]
    for name, weight in stored.items():
        assert torch.equal(as_float(weight), reference_runner.model.get_submodule(name).weight), name
    runner = TorchRunner(folder, "float32", 64, 16, quantization="gguf")
    tactics = {(s.out_features, s.in_features): t for s, t in runner.gemm_tactics.items()}
    # gate/up, q/k, v, o, down
    assert {tactics[s] for s in ((1024, 256), (384, 256), (128, 256), (256, 256), (256, 512))} == {"q4_1_w4a8"}
    assert_near(all_logits(runner), all_logits(reference_runner), 0.08, 0.80)


def test_a_real_tritonserver_serves_the_file_as_the_engine_does(tmp_path_factory, tiny_q4_k_m):
    """config.pbtxt's `quantization: gguf` through a real tritonserver: the streamed text is what the engine's own
    greedy ids on the same file decode to."""
    tokenizer = load_tokenizer(tiny_q4_k_m)
    prompt = "The quick brown fox"
    engine = LLMEngine(EngineConfig.create(model=str(tiny_q4_k_m), quantization="gguf"))
    [expected] = engine.generate([encode(tokenizer, prompt, False)], SamplingParams(max_tokens=24, ignore_eos=True))
    with start_server(tmp_path_factory.mktemp("repo_gguf"), tiny_q4_k_m, {"quantization": "gguf"}) as srv:
        srv.wait_ready(300)
        with LLMClient(srv.url_grpc, "llm") as client:
            text = client.generate(prompt, max_tokens=24, ignore_eos=True, stream=True).text
    assert text == decode_text(tokenizer, expected) and text


def test_a_bare_gguf_file_is_served_as_its_prepared_folder_serves_it(tmp_path_factory):
    """What llama.cpp users have is the .gguf alone. Given as the model it gets a folder of the config and tokenizer
    that transformers reads from the file's metadata, with no float weights; it is served as stored by itself, and
    its greedy ids are those of the default model's folder with `quantization: gguf`, token for token. A real
    tritonserver given the file streams their text."""
    default = prepare_default_model(verbose=False)
    file = gguf_file(default).resolve()
    root = tmp_path_factory.mktemp("bare")
    folder = prepare_gguf_folder(file, root)
    assert folder == root / file.stem and not list(folder.glob("*.safetensors"))
    assert prepare_gguf_folder(file, root) == folder and len(list(root.iterdir())) == 1  # prepared once
    assert served_quantization(folder, "auto") == "gguf" and served_quantization(folder, "none") == "none"
    with pytest.raises(ValueError, match="quantization: int8 rounds float weights, and .* has only a GGUF file"):
        served_quantization(folder, "int8")
    tokenizer = load_tokenizer(folder)
    assert tokenizer(fixed_text())["input_ids"] == load_tokenizer(default)(fixed_text())["input_ids"]
    prompt = "The capital of France is"
    prompts = [encode(tokenizer, prompt, False), TOKENS[:20]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = LLMEngine(EngineConfig.create(model=str(folder)))
    assert engine.config.quantization == "gguf"
    bare = engine.generate(prompts, params)
    assert bare == LLMEngine(EngineConfig.create(model=str(default), quantization="gguf")).generate(prompts, params)
    # none: the file's values dequantized as transformers reads them, which is how the default folder's float
    # weights were made from the same file
    dequantized = LLMEngine(EngineConfig.create(model=str(folder), quantization="none")).generate(prompts, params)
    assert dequantized == LLMEngine(EngineConfig.create(model=str(default), quantization="none")).generate(prompts,
                                                                                                          params)
    with start_server(tmp_path_factory.mktemp("repo_bare_gguf"), file, {}) as srv:
        srv.wait_ready(300)
        with LLMClient(srv.url_grpc, "llm") as client:
            text = client.generate(prompt, max_tokens=16, ignore_eos=True, stream=True).text
    assert text == decode_text(tokenizer, bare[0]) and text


def test_a_gpt_oss_files_config_is_what_its_metadata_says(tmp_path):
    """transformers 5 reads a gpt-oss GGUF's YaRN wrong (raw field parts: a factor of 27, the length of a key) and
    skips its window and head_dim: read from the file's metadata (as llama.cpp's converter writes it), the config has
    the file's values, and gpt-oss's own rope otherwise (beta 32 / 1, not truncated: HF's and OpenAI's; llama.cpp's
    YaRN truncates, docs/benchmarks.md)."""
    writer = GGUFWriter(str(tmp_path / "oss.gguf"), "gpt-oss")
    for add, value in (("block_count", 2), ("context_length", 4096), ("embedding_length", 64),
                       ("feed_forward_length", 32), ("head_count", 4), ("head_count_kv", 2), ("key_length", 16),
                       ("value_length", 16), ("rope_freq_base", 150000.0), ("layer_norm_rms_eps", 1e-5),
                       ("expert_count", 8), ("expert_used_count", 2), ("sliding_window", 32),
                       ("rope_scaling_type", RopeScalingType.YARN), ("rope_scaling_factor", 4.0),
                       ("rope_scaling_orig_ctx_len", 1024)):
        getattr(writer, "add_" + add)(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = gguf_config(tmp_path / "oss.gguf")
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False}
    assert (config.sliding_window, config.head_dim, config.num_local_experts, config.num_experts_per_tok,
            config.num_hidden_layers) == (32, 16, 8, 2, 2)
    assert config.layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("arch, norms, message", [
    ("phi3", True, r"quantization: gguf serves the architectures llama, qwen2, qwen3, qwen3moe, gemma3, gpt-oss; "
                   r"model.gguf is phi3 \(llama\)"),
    ("qwen2", True, r"quantization: gguf serves .*; model.gguf is qwen2 \(llama\)"),  # not the model's own
    ("llama", False, "quantization: gguf: tensor output_norm.weight is not in model.gguf")])
def test_a_gguf_the_reader_cannot_serve_is_refused_by_name(tiny_model_dir, tmp_path, arch, norms, message):
    """An architecture not served, or not the model's (llama.cpp permutes q/k rows for llama only: another
    architecture's file would be read wrongly), is refused by name; so is a missing tensor."""
    folder = write_gguf(tiny_model_dir, tmp_path, TYPES, arch, norms)
    with pytest.raises(ValueError, match=message):
        TorchRunner(folder, "float32", 16, 16, quantization="gguf")


def test_the_engine_serves_gguf_and_frees_its_blocks(tiny_gguf):
    engine = LLMEngine(EngineConfig.create(model=str(tiny_gguf), quantization="gguf"))
    [out] = engine.generate([TOKENS[:20]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out) == 8 and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_gguf_without_a_gguf_file_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match=r"quantization: gguf serves the one \*.gguf file in the model folder .*none"):
        LLMEngine(EngineConfig.create(model=str(tiny_model_dir), quantization="gguf"))


def test_the_default_model_is_served_as_shipped():
    """SmolLM2's Q4_1 file (token_embd in Q8_0, tied): the prepared folder links it, the blocks are the folder's
    float weights exactly, and the greedy replies of the served blocks agree with float32's."""
    folder = prepare_default_model(verbose=False)
    assert any(f.suffix == ".gguf" for f in folder.iterdir())
    float_runner = TorchRunner(folder, "float32", 64, 16, gemm_backend="onednn")
    runner = TorchRunner(folder, "float32", 64, 16, quantization="gguf")
    assert {shape.out_features: t for shape, t in runner.gemm_tactics.items()}[49152] in ("q8_0", "q8_0_w8a8")
    text = load_tokenizer(folder)(fixed_text())["input_ids"][:256]
    ref, got = all_logits(float_runner, text), all_logits(runner, text)
    nll = [float(-torch.log_softmax(x[:-1], -1).gather(1, torch.tensor(text[1:])[:, None]).mean()) for x in (ref, got)]
    assert abs(nll[1] - nll[0]) <= 0.01, nll
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_the_process_holds_the_file_not_its_float_copy():
    """SmolLM2 served from its GGUF in a fresh process holds ~100 MB of blocks where float32 holds 540 MB: the
    process is at least 80 % of that difference smaller (its float copies are released)."""
    folder = prepare_default_model(verbose=False)

    stored = sum(os.path.getsize(f) for f in folder.glob("*.gguf"))
    float_bytes = sum(os.path.getsize(f) for f in folder.glob("*.safetensors"))
    loaded_rss(folder, "auto", "gguf")  # the first start times the lm_head's int8 tactics (cached): not weights
    dropped = loaded_rss(folder, "onednn", "none") - loaded_rss(folder, "auto", "gguf")
    assert dropped >= 0.8 * (float_bytes - stored), (dropped / 2**20, (float_bytes - stored) / 2**20)


def test_a_bfloat16_model_serves_a_gguf_within_the_same_bounds(tiny_q4_k_m):
    """bfloat16: the blocks' kernels compute in float32 and round their outputs, the float-form tensors (F16) are
    rounded to bfloat16; against bfloat16 on the same values (measured 0.050 / 88 %)."""
    reference = all_logits(TorchRunner(tiny_q4_k_m, "bfloat16", 64, 16, gemm_backend="aten"))
    runner = TorchRunner(tiny_q4_k_m, "bfloat16", 64, 16, quantization="gguf")
    assert "q4_1_w4a8" in runner.gemm_tactics.values()
    assert_near(all_logits(runner), reference, 0.08, 0.85)
