"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral): a softmax router picks `num_experts_per_tok` of `num_experts`
gated MLPs for each token (their weights renormalized over the chosen where the model says: Mixtral always, Qwen3-MoE
with norm_topk_prob), and the token's output is their weighted sum.

On the CPU, the tokens are grouped by expert (one stable sort of the (token, choice) pairs) and each expert with a
token runs one GEMM pair over its rows, as llama.cpp's ggml_mul_mat_id does (vLLM's fused_moe sorts the same way on
the GPU), not a loop over tokens; an expert's Linears take GEMM tactics like any other Linear, int8/int4 included. The
router stays a float weight (llama.cpp keeps ffn_gate_inp in F32 too): its top-k is where a rounding would change
which experts run. Each token's outputs are added in ascending expert order into zeros, as HF's loop over the experts
hit does, so float32 sums round as HF's. Where the experts' tactics allow, the runner stacks a layer's experts into one
kernel call per Linear (runners/expert_gemm.py: `stacked`), the same rows and the same sums.

gpt-oss's MoE: a router with a bias whose top k logits (not probabilities) are softmaxed, experts with biases, and its
clamped SwiGLU (models/llama.py TorchOps.clamped_swiglu_mul); its checkpoint stacks each layer's experts in one tensor
per projection, [experts, in, out], gate and up interleaved column by column, which `split_stacked_experts` turns into
the per-expert Linears the other families' checkpoints hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from backend.engine.models.config import ModelConfig
from backend.engine.models.layers import Linear

# The checkpoint's names, per family: the MLP's prefix in a layer, its router, an expert's (gate, up, down) Linears
CHECKPOINT_NAMES = {"qwen3_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),
                    "mixtral": ("block_sparse_moe.", "gate", ("w1", "w3", "w2")),
                    "gpt_oss": ("mlp.", "router", ("gate_proj", "up_proj", "down_proj"))}  # after split_stacked_experts


ExpertsCall = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.moe_intermediate_size, bias=cfg.expert_bias)
        self.down_proj = Linear(cfg.moe_intermediate_size, cfg.hidden_size, bias=cfg.expert_bias)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.router_bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        self.experts: nn.ModuleList | None = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))
        # (gate_up, down) of every expert in one call each: (rows sorted by expert, experts, offsets) -> rows
        self.stacked: tuple[ExpertsCall, ExpertsCall] | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in h's dtype, experts [T, k]) of each token: the top k of the router's softmax (float32), or
        with a router bias (gpt-oss) the softmax of its top k logits."""
        logits = F.linear(h, self.router, self.router_bias).float()
        if self.router_bias is not None:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(h.dtype), experts
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, h: torch.Tensor, gated: Callable[[torch.Tensor], torch.Tensor], ops) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; `gated`: the MLP's activation of gate times up, [T, 2 I] -> [T, I]; `ops`
        (models/llama.py TorchOps, or KernelOps in one call each) group the rows by expert and sum their outputs."""
        weights, experts = self.route(h)
        rows, order, used, offsets = ops.group_by_expert(h, experts, self.router.shape[0])
        if self.stacked is not None:
            gate_up, down = self.stacked
            ys = down(gated(gate_up(rows, used, offsets)), used, offsets)
        else:
            ys = torch.cat([self.experts[e].down_proj.call(gated(self.experts[e].gate_up_proj.call(rows[a:b])))
                            for e, a, b in zip(used, offsets, offsets[1:])]) if used else rows
        return ops.combine_experts(ys, weights, order)


def group_by_expert(h: torch.Tensor, experts: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """h [T, hidden], experts [T, k] -> (each (token, choice) pair's row of h, grouped by expert: one gather, each
    expert's rows a slice of it; the pairs' order, t k + choice of each; the experts with pairs, ascending; their
    first rows and the end)."""
    chosen = experts.flatten()
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=num_experts).tolist()
    used = [e for e, n in enumerate(counts) if n]
    return h[order // experts.shape[1]], order, used, [0, *itertools.accumulate(n for n in counts if n)]


def combine_experts(ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The grouped pairs' outputs ys times their weights [T, k], added into their tokens' rows in the pairs' order: each
    token's experts in ascending order, as HF's loop over the experts adds them."""
    out = torch.zeros(weights.shape[0], ys.shape[1], dtype=ys.dtype, device=ys.device)
    return out.index_add_(0, order // weights.shape[1], ys * weights.flatten()[order].unsqueeze(-1))


def split_stacked_experts(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked experts (`layers.i.mlp.experts.gate_up_proj` [E, hidden, 2 I] with gate and up interleaved,
    `down_proj` [E, I, hidden], their `_bias`es) as the per-expert gate_proj / up_proj / down_proj weights and biases
    of CHECKPOINT_NAMES; the rest of `state` as it is (a GGUF's experts: per expert already)."""
    out = dict(state)
    for i in cfg.moe_layers:
        p = f"layers.{i}.mlp.experts."
        if p + "gate_up_proj" not in out:
            continue
        gate_up, gate_up_bias = out.pop(p + "gate_up_proj"), out.pop(p + "gate_up_proj_bias")
        down, down_bias = out.pop(p + "down_proj"), out.pop(p + "down_proj_bias")
        for e in range(cfg.num_experts):
            for name, w, b in (("gate_proj", gate_up[e, :, 0::2], gate_up_bias[e, 0::2]),
                               ("up_proj", gate_up[e, :, 1::2], gate_up_bias[e, 1::2]),
                               ("down_proj", down[e], down_bias[e])):
                out[f"{p}{e}.{name}.weight"], out[f"{p}{e}.{name}.bias"] = w.t().contiguous(), b.contiguous()
    return out
