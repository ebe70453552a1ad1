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
from safetensors.torch import load_file, save_file

from backend.engine import EngineConfig, LLMEngine
from backend.engine.models.checkpoint_format import quantization_config
from backend.engine.models.compressed_tensors_weights import load_compressed_tensors
from backend.engine.models.gptq_awq_weights import load_gptq_awq
from backend.engine.models.llama import load_model_config
from backend.engine.models.weight_blocks import Q4Blocks, Q8Blocks, as_float
from backend.engine.sampling import SamplingParams
from load_tests.compressed_checkpoint import compress_checkpoint
from load_tests.gptq_awq_checkpoint import convert
from tests.test_compressed_tensors import assert_served_as_the_engine_serves
from tests.test_quantization import TOKENS
from tests.tiny_model import make_tiny_llama

# name: (compressed-tensors scheme, group, method, GPTQ checkpoint_format); float16 scales, as GPTQ and AWQ store them
CHECKPOINTS = {"gptq_sym_g128": ("W4A16", None, "gptq", "gptq"),
               "gptq_asym_g32": ("W4A16_ASYM", 32, "gptq", "gptq"),
               "gptq_v2_asym_g64": ("W4A16_ASYM", 64, "gptq", "gptq_v2"),
               "gptq_8bit_g64": ("W8A16", 64, "gptq", "gptq"),
               "awq_g64": ("W4A16_ASYM", 64, "awq", None)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (its compressed-tensors source, the GPTQ / AWQ checkpoint)."""
    root = tmp_path_factory.mktemp("gptq_awq")
    model = make_tiny_llama(root / "float", hidden_size=256, intermediate_size=512, head_dim=64)
    sources: dict[tuple, Path] = {}
    out = {}
    for name, (scheme, group, method, fmt) in CHECKPOINTS.items():
        if (scheme, group) not in sources:
            sources[scheme, group] = compress_checkpoint(model, root / f"ct_{scheme}_{group}", scheme, group,
                                                         dtype="float16")
        out[name] = sources[scheme, group], convert(sources[scheme, group], root / name, method, fmt or "gptq")
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


def _shuffle_g_idx(state: dict[str, torch.Tensor]) -> None:
    key = "model.layers.0.self_attn.q_proj.g_idx"
    state[key] = state[key].flip(0).contiguous()


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
    ("gptq_sym_g128", {}, lambda c: c.update(desc_act=True), _shuffle_g_idx,
     r"gptq: model.layers.0.self_attn.q_proj orders its groups by activation \(g_idx, desc_act: true\)"),
])
def test_what_is_not_served_is_refused_by_name(folders, tmp_path, name, settings, config_edit, state_edit, error):
    model = folders[name][1]
    if config_edit or state_edit:
        model = _edited(model, tmp_path / "m", config_edit, state_edit)
    with pytest.raises(ValueError, match=error):
        LLMEngine(EngineConfig.create(model=str(model), **settings))


def test_a_real_tritonserver_serves_an_awq_checkpoint_as_the_engine_does(tmp_path_factory, folders):
    assert_served_as_the_engine_serves(folders["awq_g64"][1], tmp_path_factory.mktemp("repo_awq"))
