"""GPTQ and AWQ checkpoints (models/gptq_awq_weights.py), served as stored by their own config.json. Each is made
here from a compressed-tensors checkpoint (itself made by compressed-tensors from a seeded random Llama,
tests/test_compressed_tensors.py) by writing the same integers and scales again in AutoGPTQ's / AutoAWQ's layouts
(load_tests/gptq_awq_checkpoint.py): so every Linear must read back to the compressed-tensors checkpoint's blocks
exactly, and serve the same greedy tokens. The layouts themselves are pinned word by word below, from AutoAWQ's pack
order and AutoGPTQ's z - 1 (the ones vLLM's CPU kernels unpack; vLLM served these folders in the benchmarks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized import unpack_from_int32
from safetensors.torch import load_file, save_file

from backend.engine import EngineConfig, LLMEngine
from backend.engine.models.checkpoint_format import quantization_config
from backend.engine.models.compressed_tensors_weights import load_compressed_tensors
from backend.engine.models.gptq_awq_weights import load_gptq_awq
from backend.engine.models.config import load_model_config
from backend.engine.models.weight_blocks import InputsPermuted, Q4Blocks, Q8Blocks, Stacked, as_float
from backend.engine.runners.gemm import TACTICS
from backend.engine.runners.torch_runner import TorchRunner
from backend.engine.sampling import SamplingParams
from load_tests.compressed_checkpoint import compress_checkpoint
from load_tests.gptq_awq_checkpoint import convert
from tests.test_compressed_tensors import LINEARS, assert_served_as_the_engine_serves, float_folder
from tests.test_quantization import TOKENS, all_logits, assert_near
from tests.tiny_model import make_tiny_llama

# name: (compressed-tensors scheme, group, method, GPTQ checkpoint_format); float16 scales, as GPTQ and AWQ store them
CHECKPOINTS = {"gptq_sym_g128": ("W4A16", None, "gptq", "gptq"),
               "gptq_asym_g32": ("W4A16_ASYM", 32, "gptq", "gptq"),
               "gptq_v2_asym_g64": ("W4A16_ASYM", 64, "gptq", "gptq_v2"),
               "gptq_8bit_g64": ("W8A16", 64, "gptq", "gptq"),
               "awq_g64": ("W4A16_ASYM", 64, "awq", None)}
# act-order (desc_act: true): each Linear's inputs shuffled by a seeded permutation, g_idx as act-order writes it
ACT_ORDER = {"gptq_act_order_asym_g32": ("W4A16_ASYM", 32, "gptq", "gptq"),
             "gptq_act_order_8bit_g64": ("W8A16", 64, "gptq", "gptq")}

FLOAT_TACTICS = {name for name, tactic in TACTICS.items() if tactic.quantization == "none"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (its compressed-tensors source, the GPTQ / AWQ checkpoint)."""
    root = tmp_path_factory.mktemp("gptq_awq")
    model = make_tiny_llama(root / "float", hidden_size=256, intermediate_size=512, head_dim=64)
    sources: dict[tuple, Path] = {}
    out = {}
    for name, (scheme, group, method, fmt) in {**CHECKPOINTS, **ACT_ORDER}.items():
        if (scheme, group) not in sources:
            sources[scheme, group] = compress_checkpoint(model, root / f"ct_{scheme}_{group}", scheme, group,
                                                         dtype="float16")
        out[name] = sources[scheme, group], convert(sources[scheme, group], root / name, method, fmt or "gptq",
                                                    act_order_seed=0 if name in ACT_ORDER else None)
    return out


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_every_linear_reads_back_to_the_compressed_tensors_blocks_exactly(folders, name):
    source, checkpoint = folders[name]
    cfg = load_model_config(checkpoint)
    _, theirs = load_compressed_tensors(source, cfg)
    _, ours = load_gptq_awq(checkpoint, cfg, quantization_config(checkpoint))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert type(ours[key]) is type(theirs[key]), key
        assert torch.equal(as_float(ours[key]), as_float(theirs[key])), key
    assert isinstance(ours["layers.0.qkv_proj"], Q8Blocks if "8bit" in name else Q4Blocks)
    assert isinstance(ours["lm_head"], torch.Tensor)


def test_the_layouts_word_by_word(folders):
    """One packed word of each: AutoAWQ puts output channel 8c + ORDER[i] in nibble i, ORDER = 0 2 4 6 1 3 5 7;
    AutoGPTQ packs 8 input rows per word (row 8r + i in nibble i) and stores each zero minus one."""
    _, awq = folders["awq_g64"]
    _, gptq = folders["gptq_asym_g32"]
    cfg = load_model_config(awq)
    name = "model.layers.0.self_attn.q_proj"
    for checkpoint in (awq, gptq):
        state = load_file(str(checkpoint / "model.safetensors"))
        _, stored = load_gptq_awq(checkpoint, cfg, quantization_config(checkpoint))
        q = stored["layers.0.qkv_proj"].q  # [N, K], q/k/v fused: q_proj's channels first
        word = state[f"{name}.qweight"][0, 0].item() & 0xFFFFFFFF
        nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
        if checkpoint == awq:
            assert nibbles == [q[c, 0].item() for c in (0, 2, 4, 6, 1, 3, 5, 7)]
        else:
            assert nibbles == [q[0, k].item() for k in range(8)]
            zeros = state[f"{name}.qzeros"][0, 0].item() & 0xFFFFFFFF
            d, m = stored["layers.0.qkv_proj"].d, stored["layers.0.qkv_proj"].m
            z = [round(-(m[c, 0] / d[c, 0]).item()) for c in range(8)]
            assert [(zeros >> (4 * i)) & 0xF for i in range(8)] == [(v - 1) & 0xF for v in z]


@pytest.mark.parametrize("name", ["gptq_sym_g128", "gptq_8bit_g64", "awq_g64"])
def test_the_engine_serves_it_by_itself_as_its_compressed_tensors_source(folders, name):
    """The same blocks through the same kernels: the same greedy tokens; no KV block left behind."""
    source, checkpoint = folders[name]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [TOKENS[:20], TOKENS[5:40]]
    engine = LLMEngine(EngineConfig.create(model=str(checkpoint)))
    assert engine.config.quantization == CHECKPOINTS[name][2]  # what logs and benchmarks report
    ours = engine.generate(prompts, params)
    assert ours == LLMEngine(EngineConfig.create(model=str(source))).generate(prompts, params)
    assert all(len(out) == 12 for out in ours) and engine.kv.num_free_blocks == engine.kv.num_blocks


def act_order_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every Linear of a GPTQ checkpoint as its g_idx says, w[n, k] = s[g, n] (q[n, k] - z[g, n]) with g = g_idx[k],
    in float64, unpacked by compressed-tensors' `unpack_from_int32` (not by the reader under test)."""
    state, qconfig = load_file(str(checkpoint / "model.safetensors")), quantization_config(checkpoint)
    bits = qconfig["bits"]
    offset = 1 << (bits - 1)
    out = {}
    for name in [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]:
        scales, g_idx = state[f"{name}.scales"].double(), state[f"{name}.g_idx"].long()
        (groups, n), k = scales.shape, g_idx.shape[0]
        q = unpack_from_int32(state[f"{name}.qweight"].t().contiguous(), bits, torch.Size((n, k))).double() + offset
        z = unpack_from_int32(state[f"{name}.qzeros"], bits, torch.Size((groups, n))).double() + offset + 1  # v1: z - 1
        z = torch.full_like(z, offset) if qconfig["sym"] else z
        out[name] = scales[g_idx].t() * (q - z[g_idx].t())
    return out


@pytest.mark.parametrize("name", ACT_ORDER)
def test_an_act_order_checkpoint_is_read_as_its_g_idx_says(folders, name):
    """The inputs sorted by group for the kernels, and gathered back: every value exact; q/k/v, in one order (they
    share their input), one weight."""
    checkpoint = folders[name][1]
    cfg = load_model_config(checkpoint)
    _, stored = load_gptq_awq(checkpoint, cfg, quantization_config(checkpoint))
    exact = act_order_weights(checkpoint)
    assert len(exact) == 7 * cfg.num_layers and quantization_config(checkpoint)["desc_act"]
    fused = {"qkv_proj": LINEARS[:3], "o_proj": LINEARS[3:4], "gate_up_proj": LINEARS[4:6], "down_proj": LINEARS[6:]}
    for i in range(cfg.num_layers):
        for ours, theirs in fused.items():
            expected = torch.cat([exact[f"model.layers.{i}.{n}"] for n in theirs])
            assert torch.equal(as_float(stored[f"layers.{i}.{ours}"]).double(), expected), (name, i, ours)
    assert all(isinstance(stored[f"layers.0.{ours}"], InputsPermuted) for ours in fused)


def _v_in_its_own_order(state: dict[str, torch.Tensor]) -> None:
    """Layer 0's v_proj read in another order than q/k's: its groups (64 inputs each) reversed."""
    key = "model.layers.0.self_attn.v_proj.g_idx"
    state[key] = (state[key].max() - state[key]).contiguous()


@pytest.mark.parametrize("v_alone", [False, True])
def test_an_8_bit_act_order_checkpoint_with_float_activations_is_float32_on_its_values(folders, tmp_path, v_alone):
    """The weight-only `q8_0` forced: float32's logits on the same values to its summation order, so every Linear
    gathers its inputs in its blocks' order; with v in its own order, q/k/v are served in two parts."""
    checkpoint = folders["gptq_act_order_8bit_g64"][1]
    if v_alone:
        checkpoint = _edited(checkpoint, tmp_path / "v", state_edit=_v_in_its_own_order)
        _, stored = load_gptq_awq(checkpoint, load_model_config(checkpoint), quantization_config(checkpoint))
        assert isinstance(stored["layers.0.qkv_proj"], Stacked) and len(stored["layers.0.qkv_proj"].parts) == 2
    exact = act_order_weights(checkpoint)
    reference = all_logits(TorchRunner(float_folder(checkpoint, tmp_path / "f", exact), "float32", 64, 16,
                                       gemm_backend="aten"))
    runner = TorchRunner(checkpoint, "float32", 64, 16, gemm_backend="q8_0")
    assert set(runner.gemm_tactics.values()) - FLOAT_TACTICS == {"q8_0"}
    assert_near(all_logits(runner), reference, 1e-5, 1.0)


def test_a_4_bit_act_order_checkpoint_is_served_within_bounds_of_float32_on_its_values(folders, tmp_path):
    """The default tactics (int8 activations, rounded per 32 in the blocks' order), the compressed-tensors bounds (measured
    0.076 / 86 %)."""
    checkpoint = folders["gptq_act_order_asym_g32"][1]
    reference = all_logits(TorchRunner(float_folder(checkpoint, tmp_path / "f", act_order_weights(checkpoint)),
                                       "float32", 64, 16, gemm_backend="aten"))
    engine = LLMEngine(EngineConfig.create(model=str(checkpoint)))
    assert "q4_1_w4a8" in set(engine.runner.gemm_tactics.values())
    assert_near(all_logits(engine.runner), reference, 0.10, 0.80)
    [out] = engine.generate([TOKENS[:20]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out) == 8 and engine.kv.num_free_blocks == engine.kv.num_blocks


def _edited(checkpoint: Path, out: Path, config_edit=None, state_edit=None) -> Path:
    shutil.copytree(checkpoint, out)
    if config_edit:
        config = json.loads((out / "config.json").read_text())
        config_edit(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    if state_edit:
        state = load_file(str(out / "model.safetensors"))
        state_edit(state)
        save_file(state, str(out / "model.safetensors"))
    return out


def _uneven_g_idx(state: dict[str, torch.Tensor]) -> None:
    state["model.layers.0.self_attn.q_proj.g_idx"][0] = 1


@pytest.mark.parametrize("name, settings, config_edit, state_edit, error", [
    ("gptq_sym_g128", {"quantization": "int4"}, None, None,
     r"quantization: int4 rounds a float checkpoint, and .* is quantized already \(gptq\): set none or gptq"),
    ("awq_g64", {"quantization": "compressed-tensors"}, None, None,
     r"quantization: compressed-tensors rounds a float checkpoint, and .* is quantized already \(awq\)"),
    ("gptq_sym_g128", {"runtime": "onnxruntime", "engine_dir": "/nonexistent"}, None, None,
     "quantization: gptq is served by runtime torch, not onnxruntime"),
    ("gptq_sym_g128", {}, lambda c: c.update(bits=3), None, r"model: .* is 3-bit gptq; served are 4 and 8 bits"),
    ("awq_g64", {}, lambda c: c.update(bits=8), None, r"model: .* is 8-bit awq; served are 4 bits"),
    ("awq_g64", {}, lambda c: c.update(version="gemv"), None, r"model: .* is awq version 'gemv'; served is gemm"),
    ("gptq_sym_g128", {}, lambda c: c.update(checkpoint_format="marlin"), None,
     r"model: .* is gptq of checkpoint_format 'marlin'; served are gptq, gptq_v2"),
    ("gptq_sym_g128", {}, lambda c: c.update(desc_act=True), _uneven_g_idx,
     r"gptq: model.layers.0.self_attn.q_proj's g_idx does not give each of its 2 groups 128 inputs"),
])
def test_what_is_not_served_is_refused_by_name(folders, tmp_path, name, settings, config_edit, state_edit, error):
    model = folders[name][1]
    if config_edit or state_edit:
        model = _edited(model, tmp_path / "m", config_edit, state_edit)
    with pytest.raises(ValueError, match=error):
        LLMEngine(EngineConfig.create(model=str(model), **settings))


def test_a_real_tritonserver_serves_an_awq_checkpoint_as_the_engine_does(tmp_path_factory, folders):
    assert_served_as_the_engine_serves(folders["awq_g64"][1], tmp_path_factory.mktemp("repo_awq"))
