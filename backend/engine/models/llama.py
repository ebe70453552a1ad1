"""The decoder every served family runs (models/config.py: Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, and the
Qwen3-MoE, Mixtral and gpt-oss mixtures of experts: models/moe.py), with a ragged, paged forward. A family's
differences are its ModelConfig's data: q/k norms, the MLP's activation, Gemma's norms around each sublayer and scaled
embeddings, sliding windows per layer, a partial rotary, rope tables per layer kind, experts in place of the MLP,
attention sinks.

`PagedLlama.forward` is one tensor function over a flat batch of tokens from many sequences: no
padding per sequence, no Python loop over sequences, no shape computed from data. That is what
lets `build_engine` export this very module to ONNX, and ONNX Runtime / TensorRT run it.

Attention reads the paged cache through block tables, in one of three ways:
- RowLayout (the graph every runtime shares, and the reference): gather only. The new tokens' K/V
  are returned, not written: the runner writes them in place at `slot_mapping` after the forward, so
  the compiled graph never copies the cache. Inside the graph, each attention row gets the new keys
  of its own sequence scattered into its small gathered copy, so a prefill chunk sees itself.
- KernelLayout (eager PyTorch on the CPU): the new K/V go into the cache first, then a C++ kernel
  (backend/engine/kernels/) reads each sequence's blocks in place, all in one call a layer from the qkv
  projection. Same math; the gather path pays for the longest sequence of the batch in every row, the
  kernel only for each row's own context.
- TritonLayout (eager PyTorch or a CUDA graph on the GPU): the same, with OpenAI Triton kernels
  (backend/engine/kernels/triton_attention.py) and TritonOps for the elementwise ops.

Layout of a row (see backend/engine/batch.py): up to Q query tokens of one sequence, and that sequence's
keys at positions 0..C-1, C = blocks per row * block_size. A query at position p sees keys c <= p.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from backend.engine.kv_quantization import as_stored, widened
from backend.engine.models.config import FULL, SLIDING, ModelConfig, load_model_config, rope_tables
from backend.engine.models.layers import Linear, RMSNorm
from backend.engine.models.moe import CHECKPOINT_NAMES, MoE, combine_experts, group_by_expert, split_stacked_experts
from backend.engine.models.weight_blocks import Weight, shape_of

class TorchOps:
    """The elementwise ops around the GEMMs as torch ops: HF's math, the reference, and what the exported
    graph runs. `KernelOps` (the CPU kernels) computes the same in one pass each."""

    @staticmethod
    def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
        return norm.weight * x32.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, delta: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm)."""
        residual = residual + delta
        return residual, cls.rms_norm(residual, norm)

    @classmethod
    def rotary(cls, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] rotated by cos/sin [T, R] (HF's rotate_half convention) on their first R dims."""
        if (rot := cos.shape[-1]) < q.shape[-1]:  # partial rotary: the other dims pass
            q_rot, k_rot = cls.rotary(q[..., :rot], k[..., :rot], cos, sin)
            return torch.cat((q_rot, q[..., rot:]), dim=-1), torch.cat((k_rot, k[..., rot:]), dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU: HF's gelu_pytorch_tanh of gate, times up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up

    @staticmethod
    def clamped_swiglu_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's activation, as HF computes it: gate clamped above, up both ways, (up + 1) * gate * sigmoid(alpha
        gate)."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    group_by_expert = staticmethod(group_by_expert)
    combine_experts = staticmethod(combine_experts)


class KernelOps:
    """TorchOps on the CPU kernels (backend/engine/kernels/fused_ops.cpp); residual and q/k change in place."""

    @staticmethod
    def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return torch.ops.llm_kernels.rms_norm(x, norm.weight, norm.eps)

    @staticmethod
    def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return residual, torch.ops.llm_kernels.add_rms_norm(delta, residual, norm.weight, norm.eps)

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.llm_kernels.rotary(q, k, cos, sin)
        return q, k

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_kernels.silu_mul(gate_up)

    @staticmethod
    def group_by_expert(h: torch.Tensor, experts: torch.Tensor, num_experts: int):
        return torch.ops.llm_kernels.group_by_expert(h, experts, num_experts)

    @staticmethod
    def combine_experts(ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_kernels.combine_experts(ys, weights, order)

    @staticmethod
    def clamped_swiglu_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return torch.ops.llm_kernels.clamped_swiglu_mul(gate_up, alpha, limit)

    gelu_tanh_mul = TorchOps.gelu_tanh_mul


class TritonOps:
    """TorchOps as OpenAI Triton kernels for the GPU (backend/engine/kernels/triton_ops.py); residual and q/k change
    in place."""

    @staticmethod
    def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        from backend.engine.kernels import triton_ops

        return triton_ops.rms_norm(x, norm.weight, norm.eps)

    @staticmethod
    def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        from backend.engine.kernels import triton_ops

        return residual, triton_ops.add_rms_norm(delta, residual, norm.weight, norm.eps)

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from backend.engine.kernels import triton_ops

        triton_ops.rotary(q, k, cos, sin)
        return q, k

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        from backend.engine.kernels import triton_ops

        return triton_ops.silu_mul(gate_up)

    gelu_tanh_mul = TorchOps.gelu_tanh_mul
    clamped_swiglu_mul = TorchOps.clamped_swiglu_mul


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # DecoderLayer.linears, by name
GATED = {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul", "clamped_swiglu": "clamped_swiglu_mul"}  # activation -> op


def _with_lora(call: Callable[[torch.Tensor], torch.Tensor], lora, index: int, name: str,
               x: torch.Tensor) -> torch.Tensor:
    return lora.add(index, name, x, call(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.window = cfg.window(index)
        self.rope_kind = cfg.layer_type(index) if cfg.family.gemma else FULL  # Gemma's sliding layers: their own rope
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # gpt-oss: a logit per head that every query's softmax counts in its sum, as a key of no value would be
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm normalizes the attention's output; these the MLP's
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoE(cfg) if index in cfg.moe_layers else None
        if self.moe is None:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.linears = tuple(getattr(self, name) for name in PROJECTIONS if hasattr(self, name))  # not registered again

    def projections(self, lora, index: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """The layer's Linears as callables: each one's GEMM tactic as is, not through nn.Module's call (with the
        lookups that named them, ~11 us a layer, 30 a step); in an export the modules, whose calls name the graph's
        nodes, which build_engine/quantize_onnx.py maps back to the Linears; `lora`'s deltas added."""
        if torch.compiler.is_compiling():
            return list(self.linears)
        calls = [linear.call for linear in self.linears]
        if lora is None:
            return calls
        return [functools.partial(_with_lora, call, lora, index, name) for call, name in zip(calls, PROJECTIONS)]

    def forward(self, x, h, next_norm: RMSNorm, cos, sin, layer_cache_k, layer_cache_v, rows, ops, lora=None,
                index: int = 0):
        """x: the residual stream, h: its input_layernorm. Returns the stream after this layer, its norm by
        `next_norm` (the next layer's input_layernorm, or the final norm), and this layer's new K and V. `lora`
        (lora.LoraBatch, eager only) adds its adapters' deltas to the Linears of layer `index`."""
        qkv, o, *mlp = self.projections(lora, index)
        attn, k, v = rows.attend_qkv(qkv(h), cos, sin, layer_cache_k, layer_cache_v, self)
        if self.cfg.sandwich_norms:
            x, h = ops.add_rms_norm(ops.rms_norm(o(attn), self.post_attention_layernorm), x,
                                    self.pre_feedforward_layernorm)
            x, h = ops.add_rms_norm(ops.rms_norm(self.mlp(h, mlp, ops), self.post_feedforward_layernorm), x, next_norm)
        else:
            x, h = ops.add_rms_norm(o(attn), x, self.post_attention_layernorm)
            x, h = ops.add_rms_norm(self.mlp(h, mlp, ops), x, next_norm)
        return x, h, k, v

    def mlp(self, h: torch.Tensor, projections: list[Callable[[torch.Tensor], torch.Tensor]], ops) -> torch.Tensor:
        gated = getattr(ops, GATED[self.cfg.activation])
        if self.cfg.activation == "clamped_swiglu":
            gated = functools.partial(gated, alpha=self.cfg.swiglu_alpha, limit=self.cfg.swiglu_limit)
        if self.moe is not None:
            return self.moe(h, gated, ops)
        gate_up, down = projections
        return down(gated(gate_up(h)))


def split_attend(rows: RowLayout | TritonLayout, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache_k: torch.Tensor, cache_v: torch.Tensor, layer: DecoderLayer):
    """A layout's attend_qkv: q, k, v of the fused projection qkv [T, (H + 2 KVH) D], q and k normed per head (where
    the model has q/k norms) and rotated by the layout's ops, then its attend. Returns (attention [T, H D], the new k
    and v [T, KVH, D])."""
    cfg = layer.cfg
    T, H, KVH, D = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = qkv.split_with_sizes([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
    if cfg.qk_norm:
        q = rows.ops.rms_norm(q.reshape(T * H, D), layer.q_norm).view(T, H, D)
        k = rows.ops.rms_norm(k.reshape(T * KVH, D), layer.k_norm).view(T, KVH, D)
    q, k = rows.ops.rotary(q, k, cos, sin)
    return rows.attend(q, k, v, cache_k, cache_v, cfg, layer.window, layer.sinks), k, v


@dataclass
class RowLayout:
    """Index tensors that place the flat tokens into attention rows (built by backend/engine/batch.py)."""

    block_tables: torch.Tensor  # [R, B] int64
    token_index: torch.Tensor  # [R, Q] flat token of each query slot (padding repeats a real token)
    query_positions: torch.Tensor  # [R, Q]
    kv_src: torch.Tensor  # [P] flat token whose new K/V go to ...
    kv_dst: torch.Tensor  # [P] ... key slot r * C + position of its row
    token_slot: torch.Tensor  # [T] r * Q + j: where each flat token's output sits
    ops = TorchOps
    attend_qkv = split_attend

    def attend(self, q, k, v, cache_k, cache_v, cfg: ModelConfig, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return _gather_attention(q, k, v, cache_k, cache_v, self, cfg, window, sinks)


@dataclass
class KernelLayout:
    """Per-sequence paging inputs of the CPU kernel (eager only: not part of the exported graph)."""

    block_tables: torch.Tensor  # [S, B] int64
    query_start: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]
    slot_mapping: torch.Tensor  # [T]
    prompt_lens: torch.Tensor | None = None  # [S]: prompt tokens attend in tiles, the rest one by one (the kernel's doc)
    ops = KernelOps

    def attend_qkv(self, qkv, cos, sin, cache_k, cache_v, layer: DecoderLayer):
        """split_attend in one kernel call (llm_kernels.attend_qkv); the new K/V are in the cache, not returned."""
        cfg = layer.cfg
        return torch.ops.llm_kernels.attend_qkv(
            qkv, cos, sin, cache_k, cache_v, self.slot_mapping, self.block_tables, self.query_start, self.context_lens,
            cfg.num_heads, cfg.scale, self.prompt_lens, layer.q_norm.weight if cfg.qk_norm else None,
            layer.k_norm.weight if cfg.qk_norm else None, cfg.rms_norm_eps, layer.window, layer.sinks), None, None

    def attend(self, q, k, v, cache_k, cache_v, cfg: ModelConfig, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.llm_kernels.write_and_attend(q, k, v, cache_k, cache_v, self.slot_mapping, self.block_tables,
                                                     self.query_start, self.context_lens, cfg.scale,
                                                     self.prompt_lens, window, sinks)
        return out.view(q.shape[0], cfg.num_heads * cfg.head_dim)


@dataclass
class TritonLayout:
    """Per-sequence paging inputs of the GPU kernels (eager or in a CUDA graph; not part of the exported graph).
    A slot < 0 (a padded row of a CUDA graph) writes nothing; a context of 0 attends to nothing."""

    block_tables: torch.Tensor  # [S, B] int64
    query_start: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]
    slot_mapping: torch.Tensor  # [T]
    max_query_len: int  # the longest chunk (the grid's size)
    segments: int  # context segments per program (kernels/triton_attention.py segments_for)
    ops = TritonOps
    attend_qkv = split_attend

    def attend(self, q, k, v, cache_k, cache_v, cfg: ModelConfig, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        from backend.engine.kernels.triton_attention import paged_attention, write_kv

        assert window == 0 and sinks is None, "the GPU kernels have no sliding window or sinks (refused at load)"

        write_kv(k, v, cache_k, cache_v, self.slot_mapping)
        out = paged_attention(q, cache_k, cache_v, self.block_tables, self.query_start, self.context_lens,
                              cfg.scale, self.max_query_len, self.segments)
        return out.view(q.shape[0], cfg.num_heads * cfg.head_dim)


def _gather_attention(q, k, v, cache_k, cache_v, rows: RowLayout, cfg: ModelConfig, window: int = 0,
                      sinks: torch.Tensor | None = None):
    KVH, D = cfg.num_kv_heads, cfg.head_dim
    R, B = rows.block_tables.shape
    Q = rows.token_index.shape[1]
    C = B * cache_k.shape[1]
    # [num_blocks, block_size, KVH, D] -> the rows' keys [R*C, KVH, D], then the new keys into their slots.
    # The gather makes a fresh tensor, so the scatter can be in place (out of place would copy it again).
    keys, values = cache_k[rows.block_tables], cache_v[rows.block_tables]
    if cache_k.dtype != q.dtype:  # a narrower cache (eager only): its rows, and the new K/V as it will hold them
        keys, values = widened(keys, q.dtype), widened(values, q.dtype)
        k, v = as_stored(k, cache_k.dtype), as_stored(v, cache_k.dtype)
    keys = keys.reshape(R * C, KVH, D)
    keys.index_copy_(0, rows.kv_dst, k[rows.kv_src])
    values = values.reshape(R * C, KVH, D)
    values.index_copy_(0, rows.kv_dst, v[rows.kv_src])
    keys_at = torch.arange(C, device=q.device).view(1, 1, C)
    visible = keys_at <= rows.query_positions.unsqueeze(-1)  # [R, Q, C]
    if window:  # a sliding layer: the last `window` keys, the query's own included
        visible = visible & (keys_at > rows.query_positions.unsqueeze(-1) - window)
    keys, values, mask = keys.view(R, C, KVH, D), values.view(R, C, KVH, D), visible.unsqueeze(1)
    if sinks is not None:  # one more key, zero in K and V, that every query sees with its head's sink as its score
        zero = keys.new_zeros(R, 1, KVH, D)
        keys, values = torch.cat((keys, zero), dim=1), torch.cat((values, zero), dim=1)
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        mask = torch.cat((mask.unsqueeze(1).expand(R, cfg.num_heads, Q, C),
                          sinks.to(q.dtype).view(1, -1, 1, 1).expand(R, -1, Q, 1)), dim=-1)  # [R, H, Q, C + 1]
    # Fused attention on strided views: no score tensor, no layout copies (4.5x the unfused version here).
    out = nn.functional.scaled_dot_product_attention(
        q[rows.token_index].transpose(1, 2),  # [R, H, Q, D]
        keys.transpose(1, 2),  # [R, KVH, C, D]
        values.transpose(1, 2),
        attn_mask=mask,
        scale=cfg.scale,
        enable_gqa=True,
    )  # [R, H, Q, D]
    return out.transpose(1, 2).reshape(R * Q, cfg.num_heads * D)[rows.token_slot]


class PagedLlama(nn.Module):
    def __init__(self, cfg: ModelConfig, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", ropes[FULL][0], persistent=False)
        self.register_buffer("rope_sin", ropes[FULL][1], persistent=False)
        if SLIDING in ropes:  # Gemma's sliding layers turn by a rope of their own
            self.register_buffer("rope_cos_sliding", ropes[SLIDING][0], persistent=False)
            self.register_buffer("rope_sin_sliding", ropes[SLIDING][1], persistent=False)
        # Gemma's embeddings times sqrt(hidden), as HF a float32 first
        self.register_buffer("embed_scale", None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale),
                             persistent=False)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        row_block_tables: torch.Tensor,  # [R, B]
        row_token_index: torch.Tensor,  # [R, Q]
        kv_src: torch.Tensor,  # [P]
        kv_dst: torch.Tensor,  # [P]
        token_slot: torch.Tensor,  # [T]
        logits_index: torch.Tensor,  # [L] the tokens whose logits are returned
        # [L, 2, num_blocks, block_size, KVH, D], read only (but with `kernel`); or its layers' (K, V) views, made once
        # by the CPU runner: the 3 selects a layer takes, ~4 us, left out of every step
        kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
        kernel: KernelLayout | TritonLayout | None = None,  # attend with a kernel, which writes the new K/V itself
        between_layers: Callable[[], None] | None = None,  # eager only: called after each layer but the last
        lora=None,  # eager only: a lora.LoraBatch, the tokens of sequences with a LoRA adapter
        program=None,  # with a KernelLayout and no `lora`: the layers in C++ (runners/layer_program.py)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [L, vocab] of the tokens at `logits_index`, new K/V [L, 2, T, KVH, D]); with
        `kernel` the new K/V are already in the cache, and None is returned for them. `between_layers` may run
        another forward over other sequences' blocks (the engine's cut-in): this one keeps its state in locals."""
        rows = kernel or RowLayout(row_block_tables, row_token_index, positions[row_token_index], kv_src, kv_dst,
                                   token_slot)
        ops = rows.ops
        x = self.embed_tokens(token_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        ropes = {FULL: (self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype))}
        if hasattr(self, "rope_cos_sliding"):
            ropes[SLIDING] = (self.rope_cos_sliding[positions].to(x.dtype), self.rope_sin_sliding[positions].to(x.dtype))
        layers = list(self.layers)  # not self.layers[1:]: a ModuleList's slice is a new ModuleList, 29 add_module calls
        h = ops.rms_norm(x, layers[0].input_layernorm)
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        new_kv = []
        if program is not None and lora is None:
            h = _program_layers(program, x, h, ropes, rows, len(layers), between_layers)
        else:
            for i, layer in enumerate(layers):
                layer_kv = kv_cache[i]
                cos, sin = ropes[layer.rope_kind]
                x, h, k, v = layer(x, h, norms[i], cos, sin, layer_kv[0], layer_kv[1], rows, ops, lora, i)
                if kernel is None:
                    new_kv.append(torch.stack((k, v)))
                if between_layers is not None and i + 1 < len(layers):
                    between_layers()
        logits = self.lm_head(h[logits_index]).float()
        if (cap := self.cfg.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits, torch.stack(new_kv) if new_kv else None


def _program_layers(program, x: torch.Tensor, h: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                    rows: KernelLayout, count: int, between_layers: Callable[[], None] | None) -> torch.Tensor:
    """PagedLlama's layers by `program` (x changes in place): one call, or one a layer with `between_layers`."""
    inputs = (*ropes[FULL], *ropes.get(SLIDING, (None, None)), rows.slot_mapping, rows.block_tables, rows.query_start,
              rows.context_lens, rows.prompt_lens)
    if between_layers is None:
        return program.run(x, h, *inputs, 0, count)
    for i in range(count):
        h = program.run(x, h, *inputs, i, i + 1)
        if i + 1 < count:
            between_layers()
    return h


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def fused_linears(cfg: ModelConfig) -> dict[str, list[str]]:
    """PagedLlama's Linears (q/k/v and gate/up fused) -> the HF modules they are made of, in order (HF names without
    their `model.` prefix). Phi's checkpoints hold them fused already; a mixture of experts' layers have an expert's
    gate/up and down in place of the MLP's (models/moe.py)."""
    out = {"lm_head": ["embed_tokens" if cfg.tie_word_embeddings else "lm_head"]}
    fused_in_checkpoint = cfg.model_type == "phi3"
    for i in range(cfg.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[f"layers.{i}.qkv_proj"] = [a + "qkv_proj"] if fused_in_checkpoint else [a + n + "_proj" for n in "qkv"]
        out[f"layers.{i}.o_proj"] = [a + "o_proj"]
        if i in cfg.moe_layers:
            prefix, _, (gate, up, down) = CHECKPOINT_NAMES[cfg.family.moe]
            for e in range(cfg.num_experts):
                expert = f"layers.{i}.{prefix}experts.{e}."
                out[f"layers.{i}.moe.experts.{e}.gate_up_proj"] = [expert + gate, expert + up]
                out[f"layers.{i}.moe.experts.{e}.down_proj"] = [expert + down]
        else:
            out[f"layers.{i}.gate_up_proj"] = [m + "gate_up_proj"] if fused_in_checkpoint else [m + "gate_proj",
                                                                                              m + "up_proj"]
            out[f"layers.{i}.down_proj"] = [m + "down_proj"]
    return out


def layer_norms(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Layer i's RMSNorms: PagedLlama's name -> HF's (without `model.`)."""
    p = f"layers.{i}."
    names = ["input_layernorm", "post_attention_layernorm"]
    names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if cfg.sandwich_norms else []
    out = {p + n: p + n for n in names}
    if cfg.qk_norm:
        out.update({p + "q_norm": p + "self_attn.q_norm", p + "k_norm": p + "self_attn.k_norm"})
    return out


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
               state: dict[str, torch.Tensor] | None = None, stored: Mapping[str, Weight] | None = None,
               max_positions: int | None = None, narrow_linears: bool = False) -> PagedLlama:
    """Build PagedLlama from an HF safetensors folder (q/k/v and gate/up are fused at load), or from the folder's
    config and an HF `state` dict already in memory (a GPU benchmark's random weights, never written to disk). The
    Linears named in `stored` (a quantized checkpoint's, which `state` lacks), and `embed_tokens` if there (a GGUF's),
    get a weight of no bytes, a zero expanded to their shape: runners/gemm.py serves them from `stored` and drops it.
    Rope tables cover `max_positions` (the KV pool's tokens: no sequence gets further), at most the model's length.
    With `narrow_linears`, a float32 model's Linear weights stored in bfloat16 / float16 stay so, for a GEMM tactic that
    widens them exactly as it reads them (runners/gemm.py f32_panels: half the bytes held and read a step)."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    ropes = rope_tables(model_dir, cfg, min(cfg.max_position_embeddings, max_positions or cfg.max_position_embeddings))
    if state is None:
        state = {}
        for f in _weight_files(model_dir):
            state.update(load_file(str(f)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if cfg.family.moe == "gpt_oss":
        state = split_stacked_experts(state, cfg)

    def weight(name: str, sources: list[str]) -> torch.Tensor:
        if stored is not None and name in stored:
            return torch.zeros((), dtype=dtype).expand(shape_of(stored[name]))
        tensors = [state[s + ".weight"] for s in sources]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    fused: dict[str, torch.Tensor] = {"embed_tokens.weight": weight("embed_tokens", ["embed_tokens"]),
                                      "norm.weight": state["norm.weight"]}
    linears = fused_linears(cfg)
    fused.update({name + ".weight": weight(name, sources) for name, sources in linears.items()})
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if cfg.attention_bias:
            fused[p + "qkv_proj.bias"] = torch.cat([state[p + "self_attn." + n + "_proj.bias"] for n in "qkv"])
        if cfg.o_proj_bias:
            fused[p + "o_proj.bias"] = state[p + "self_attn.o_proj.bias"]
        if cfg.attention_sinks:
            fused[p + "sinks"] = state[p + "self_attn.sinks"]
        fused.update({ours + ".weight": state[hf + ".weight"] for ours, hf in layer_norms(cfg, i).items()})
        if i in cfg.moe_layers:
            prefix, router, (gate, up, down) = CHECKPOINT_NAMES[cfg.family.moe]
            fused[p + "moe.router"] = state[p + prefix + router + ".weight"]
            if cfg.router_bias:
                fused[p + "moe.router_bias"] = state[p + prefix + router + ".bias"]
            for e in range(cfg.num_experts) if cfg.expert_bias else ():
                expert, ours = f"{p}{prefix}experts.{e}.", f"{p}moe.experts.{e}."
                fused[ours + "gate_up_proj.bias"] = torch.cat([state[expert + gate + ".bias"], state[expert + up + ".bias"]])
                fused[ours + "down_proj.bias"] = state[expert + down + ".bias"]
    if cfg.family.gemma:  # Gemma's RMSNorms scale by 1 + w, as HF computes it (in float32)
        fused.update({k: 1.0 + v.float() for k, v in fused.items() if k.endswith("norm.weight")})
    with torch.device("meta"):
        model = PagedLlama(cfg, ropes)
    # A tensor already in `dtype` would alias its file's mapping and hold all of that file's pages (a bfloat16 1B:
    # 2.3 GB of RSS beside the packed weights): all but the Linears' weights, which the GEMM tactics pack and drop, and
    # the stored ones (a zero expanded: no bytes to copy) are copied out of it.
    kept = {name + ".weight" for name in [*linears, *(stored or ())]}
    as_stored = narrow_linears and dtype == torch.float32

    def cast(k: str, v: torch.Tensor) -> torch.Tensor:
        if k not in kept:
            return v.to(dtype, copy=True)
        return v if as_stored and v.dtype in (torch.bfloat16, torch.float16) else v.to(dtype)

    model.load_state_dict({k: cast(k, v) for k, v in fused.items()}, strict=True, assign=True)
    model.rope_cos, model.rope_sin = ropes[FULL]
    if SLIDING in ropes:
        model.rope_cos_sliding, model.rope_sin_sliding = ropes[SLIDING]
    if cfg.embed_scale is not None:
        model.embed_scale = torch.tensor(cfg.embed_scale)
    return model.to(device).eval().requires_grad_(False)
