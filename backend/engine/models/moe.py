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
                    "mixtral": ("block_sparse_moe.", "gate", ("w1", "w3", "w2"))}


ExpertsCall = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.moe_intermediate_size, bias=False)
        self.down_proj = Linear(cfg.moe_intermediate_size, cfg.hidden_size, bias=False)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.experts: nn.ModuleList | None = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))
        # (gate_up, down) of every expert in one call each: (rows sorted by expert, experts, offsets) -> rows
        self.stacked: tuple[ExpertsCall, ExpertsCall] | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in h's dtype, experts [T, k]) of each token: the top k of the router's softmax (float32)."""
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, h: torch.Tensor, gated: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]; `gated`: the MLP's activation of gate times up, [T, 2 I] -> [T, I]."""
        weights, experts = self.route(h)
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, choice) pairs, grouped by expert
        counts = torch.bincount(chosen, minlength=self.router.shape[0]).tolist()
        tokens = order // self.top_k
        rows = h[tokens]  # one gather; each expert's rows are a slice of it
        used = [e for e, n in enumerate(counts) if n]
        offsets = [0, *itertools.accumulate(n for n in counts if n)]
        if self.stacked is not None:
            gate_up, down = self.stacked
            ys = down(gated(gate_up(rows, used, offsets)), used, offsets)
        else:
            ys = torch.cat([self.experts[e].down_proj.call(gated(self.experts[e].gate_up_proj.call(rows[a:b])))
                            for e, a, b in zip(used, offsets, offsets[1:])]) if used else rows
        # one weighted add, in the pairs' order: each token's experts in ascending order, as HF's loop adds them
        return torch.zeros_like(h).index_add_(0, tokens, ys * weights.flatten()[order].unsqueeze(-1))
