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
    model = _hf_model(str(model_dir))
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            # An explicit mask: otherwise generate treats real tokens equal to pad_token_id as padding.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs
