"""What a checkpoint's config.json says about its architecture, in the one form the decoder (models/llama.py) reads.

The families differ in data, not in code paths of their own, so one table holds each family's facts (as llama.cpp's
architecture tables do; vLLM's files per family each repeat a decoder). By config.json's `model_type`:
- llama, mistral, qwen2: the Llama decoder (Qwen2: q/k/v bias). A sliding window, where the config has one (Mistral
  on every layer; Qwen2 on the layers `layer_types` names), attends over the last `sliding_window` tokens.
- qwen3: Llama + q/k RMSNorm per head before the rotary (`layer_types` may name sliding layers too).
- gemma3_text (Gemma3ForCausalLM: Gemma 3 270M and 1B): q/k norm, RMSNorms of (1 + w) (the 1 folded into the weights
  at load), GeGLU (tanh GELU), embeddings times sqrt(hidden), norms on the attention and MLP outputs before their
  residual adds, sliding-window and global layers interleaved (`layer_types`), each kind with its rope base, and
  attention scaled by query_pre_attn_scalar ** -0.5.
- phi3 (Phi-3, Phi-4-mini): q/k/v and gate/up fused in the checkpoint, partial rotary, LongRoPE.
- qwen3_moe, mixtral: mixture-of-experts MLPs (models/moe.py), attention as qwen3's / mistral's.
- gpt_oss: attention with biases and a learned sink logit per head (a key every query sees, of no value), sliding
  and full layers alternating (`layer_types`), YaRN; experts with biases, a router with a bias whose top k logits are
  softmaxed, a clamped SwiGLU ((up + 1) * gate * sigmoid(alpha gate), both clamped to `swiglu_limit`).
Anything else, a rope type not listed in ROPE_TYPES, or a feature of a family that is not implemented (logit
softcapping in attention, bidirectional attention) is refused by name when the model loads.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
# computed exactly as HF does, by the family's own rotary class; `longrope` per position (see rope_tables)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class Family:
    """A model_type's facts: where transformers keeps its rotary class, and what its decoder layers have."""

    modeling: str  # transformers.models.<modeling>.modeling_<modeling>
    rotary: str  # its rotary embedding class there
    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm per head on q and k before the rotary
    window_everywhere: bool = False  # `sliding_window`, when set, on every layer (else where `layer_types` says)
    gemma: bool = False  # Gemma 3's norms, activation, embedding scale and rope per layer kind
    moe: str = ""  # the mixture-of-experts form (models/moe.py): qwen3_moe | mixtral | gpt_oss
    o_bias: bool = False  # config.json's attention_bias puts a bias on o_proj too (not only on q/k/v)


FAMILIES = {
    "llama": Family("llama", "LlamaRotaryEmbedding", o_bias=True),
    "mistral": Family("mistral", "MistralRotaryEmbedding", window_everywhere=True),
    "qwen2": Family("qwen2", "Qwen2RotaryEmbedding", qkv_bias=True),
    "qwen3": Family("qwen3", "Qwen3RotaryEmbedding", qk_norm=True, o_bias=True),
    "gemma3_text": Family("gemma3", "Gemma3RotaryEmbedding", qk_norm=True, gemma=True, o_bias=True),
    "phi3": Family("phi3", "Phi3RotaryEmbedding", window_everywhere=True),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeRotaryEmbedding", qk_norm=True, window_everywhere=True, moe="qwen3_moe",
                        o_bias=True),
    "mixtral": Family("mixtral", "MixtralRotaryEmbedding", window_everywhere=True, moe="mixtral"),
    "gpt_oss": Family("gpt_oss", "GptOssRotaryEmbedding", moe="gpt_oss", o_bias=True),
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # on q/k/v
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False
    activation: str = "silu"  # of the gated MLP: silu | gelu_tanh | clamped_swiglu (gpt-oss: swiglu_alpha, _limit)
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    attention_sinks: bool = False  # a learned logit per head in every softmax's sum (gpt-oss)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # Gemma: norms on the attention and MLP outputs, and one before the MLP
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default: head_dim)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included; 0: none
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = every layer FULL
    rotary_dim: int = 0  # dims of a head the rotary turns (Phi's partial rotary); 0: head_dim
    final_logit_softcapping: float | None = None
    o_proj_bias: bool = False
    # mixture of experts (models/moe.py): the layers in moe_layers have num_experts MLPs of moe_intermediate_size,
    # num_experts_per_tok of them a token, weighted by a softmax router (renormalized over the chosen with norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    router_bias: bool = False  # gpt-oss: the router has a bias, and the top k of its logits are softmaxed
    expert_bias: bool = False  # the experts' Linears have biases

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL

    def window(self, i: int) -> int:
        """The keys layer i's query sees (itself included), 0 for all up to it."""
        return self.sliding_window if self.layer_type(i) == SLIDING else 0

    @property
    def max_window(self) -> int:
        """The longest window of any layer, 0 when some layer sees every key (then no block falls out of use)."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return 0 if 0 in windows else max(windows)


def refuse_beyond_llama(cfg: ModelConfig, where: str) -> None:
    """The GPU kernels and the exported graph serve the Llama decoder as it was (llama, mistral, qwen2 without a
    sliding window): the families' other parts run on the CPU path (PyTorch eager, the kernels of kernels/)."""
    if cfg.model_type not in ("llama", "mistral", "qwen2") or cfg.sliding_window:
        kind = f"{cfg.model_type} with a sliding window" if cfg.sliding_window else cfg.model_type
        raise ValueError(f"model_type: {kind} is served by runtime torch on the CPU; {where} serves llama, mistral "
                         "and qwen2 without a sliding window")


def hf_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The model's ModelConfig; an architecture, rope type or feature not served is refused by name."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:  # before transformers reads it: a type it does not know is refused the same way
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    hf = hf_config(model_dir)
    family = FAMILIES[hf.model_type]
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(hf, name, None):
            raise ValueError(f"{name}: {hf.model_type} models with it are not served")
    for params in _rope_parameters(hf).values():
        if (kind := params.get("rope_type", "default")) not in ROPE_TYPES:
            raise ValueError(f"rope_scaling: rope type {kind!r} is not implemented (served: {', '.join(ROPE_TYPES)})")
    eos = hf.eos_token_id
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    window = getattr(hf, "sliding_window", None) or 0
    if getattr(hf, "use_sliding_window", True) is False:
        window = 0
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    if family.window_everywhere and window:
        layer_types = (SLIDING,) * hf.num_hidden_layers
    if not window or SLIDING not in layer_types:
        window, layer_types = 0, ()
    rotary = int(head_dim * _rope_parameters(hf).get(FULL, {}).get("partial_rotary_factor", 1.0))
    extra: dict = {}
    if family.gemma:
        extra = dict(activation="gelu_tanh", embed_scale=hf.hidden_size ** 0.5, sandwich_norms=True,
                     query_pre_attn_scalar=hf.query_pre_attn_scalar)
    if family.moe == "qwen3_moe":
        sparse = [i for i in range(hf.num_hidden_layers) if i not in (hf.mlp_only_layers or [])
                  and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0]
        extra = dict(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                     moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=hf.norm_topk_prob,
                     moe_layers=tuple(sparse))
    elif family.moe == "mixtral":
        extra = dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                     moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True,
                     moe_layers=tuple(range(hf.num_hidden_layers)))
    elif family.moe == "gpt_oss":
        extra = dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                     moe_intermediate_size=hf.intermediate_size, moe_layers=tuple(range(hf.num_hidden_layers)),
                     router_bias=True, expert_bias=True, activation="clamped_swiglu", swiglu_alpha=hf.swiglu_alpha,
                     swiglu_limit=hf.swiglu_limit, attention_sinks=True)
    return ModelConfig(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=family.qkv_bias or bool(getattr(hf, "attention_bias", False)),
        eos_token_ids=eos_ids,
        qk_norm=family.qk_norm,
        sliding_window=window,
        layer_types=layer_types,
        rotary_dim=0 if rotary == head_dim else rotary,
        final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
        o_proj_bias=family.o_bias and bool(getattr(hf, "attention_bias", False)),
        **extra,
    )


def _rope_parameters(hf) -> dict[str, dict]:
    """Rope parameters per layer kind (Gemma 3 has two; the others one, under FULL)."""
    params = getattr(hf, "rope_parameters", None) or {}
    return params if FULL in params else {FULL: params}


def rope_tables(model_dir: str | Path, cfg: ModelConfig, max_positions: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layer kind, cos/sin [max_positions, rotary dims] in float32, computed by the family's own HF rotary class,
    so exactly as HF does (every rope type in ROPE_TYPES). LongRoPE: HF picks the short or long factors by the longest
    position of each forward; here by each position (long from original_max_position_embeddings on), which is HF's
    choice for every decode step and for prompts up to that length."""
    hf = hf_config(model_dir)
    module = importlib.import_module(f"transformers.models.{cfg.family.modeling}.modeling_{cfg.family.modeling}")
    rotary = getattr(module, cfg.family.rotary)(hf)
    kinds = {cfg.layer_type(i) for i in range(cfg.num_layers)} if cfg.family.gemma else {FULL}
    tables = {}
    for kind in kinds:
        params = _rope_parameters(hf)[kind]
        split = params.get("original_max_position_embeddings") if params.get("rope_type") == "longrope" else None
        parts = [(0, max_positions)] if not split or split >= max_positions else [(0, split), (split, max_positions)]
        cos, sin = [], []
        for a, b in parts:
            dummy = torch.zeros(1, dtype=torch.float32)
            positions = torch.arange(a, b)[None]
            c, s = rotary(dummy, positions, kind) if cfg.family.gemma else rotary(dummy, positions)
            if 2 * c.shape[-1] == (cfg.rotary_dim or cfg.head_dim):  # gpt-oss's class: each frequency once, which
                c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)  # its two halves share (rotate_half's form)
            cos.append(c[0].float())
            sin.append(s[0].float())
        tables[kind] = (torch.cat(cos), torch.cat(sin))
    return tables
