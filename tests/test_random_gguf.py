"""load_tests/random_gguf.save_random_hf: a model's random weights written a module at a time, in shards, as
transformers would initialise them, under the names save_pretrained writes (a Qwen3-MoE's experts one Linear each, as
llama.cpp's converter reads them); the folder loads in transformers with every weight found."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from load_tests.random_gguf import save_random_hf


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, tie_word_embeddings=True),
    Qwen3MoeConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   tie_word_embeddings=False),
], ids=["llama-tied", "qwen3-moe"])
def test_random_weights_written_in_shards_load_whole(config, tmp_path):
    folder = save_random_hf(config, tmp_path / "hf", seed=3, shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[config.model_type]]
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((folder / s).is_file() for s in shards)  # small shards: several
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    params = dict(model.named_parameters())
    # the names save_pretrained writes, each tensor once (a tied lm_head is the embedding's)
    model.save_pretrained(tmp_path / "reference")
    with safe_open(tmp_path / "reference" / "model.safetensors", "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())
    if config.model_type == "qwen3_moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in index["weight_map"]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    norms = [p for n, p in params.items() if n.endswith("norm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    for name, p in params.items():
        if p.dim() >= 2:  # N(0, initializer_range), as transformers initialises a new model
            assert abs(p.float().std().item() - config.initializer_range) < 0.2 * config.initializer_range, name
    again = save_random_hf(config, tmp_path / "again", seed=3, shard_bytes=40_000)
    assert all((folder / s).read_bytes() == (again / s).read_bytes() for s in shards)  # seeded
