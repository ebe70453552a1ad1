"""Seeded random PEFT LoRA adapters for a model folder (nothing from a hub), for the LoRA tests and benchmark."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, path: Path, rank: int, seed: int, targets: list[str] | None = None,
                 alpha: float | None = None, scale: float = 0.3, **options) -> Path:
    """Save a LoRA adapter (peft's own save_pretrained) of `rank` on `targets` (default: all seven Linears of a Llama
    layer) with seeded random A and B of std `scale`: PEFT starts B at zero, which would change nothing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=targets or ALL_TARGETS, lora_dropout=0.0, init_lora_weights=False, **options)
    model = get_peft_model(base, config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data.normal_(0.0, scale)
    model.save_pretrained(str(path))
    return path
