"""Reference outputs: HF transformers `generate`, greedy, float32, one prompt at a time (no padding)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    return _greedy(_hf_model(str(model_dir)), prompts, max_tokens)


def peft_greedy(model_dir: Path | str, adapter: Path | str | None, prompts: list[list[int]],
                max_tokens: list[int]) -> list[list[int]]:
    """HF + peft with the LoRA adapter folder `adapter` (None: HF alone), as `hf_greedy`."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.generation_config.eos_token_id = None
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    return _greedy(model.eval(), prompts, max_tokens)


def _greedy(model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            # An explicit mask: otherwise generate treats real tokens equal to pad_token_id as padding.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs
