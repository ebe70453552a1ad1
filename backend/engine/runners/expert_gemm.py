"""A mixture-of-experts layer's experts in one kernel call each for gate_up and down (kernels/expert_groups.h).

Called one expert at a time, a decode step of a 2.8B Qwen3-MoE (8 of 64 experts, 16 layers) made 256 GEMM calls, each
paying Python frames, a thread wake-up and its activations' rounding for ~50 us of weights; llama.cpp's
ggml_mul_mat_id takes a layer's experts in one op, as vLLM's fused_moe does on the GPU. Where both of a layer's
Linears run a tactic with an experts kernel (q4_1_w4a8, q8_0_w8a8: the int8-activation kernels that GGUF's Q4_K,
Q6_K and Q8_0 experts take), the experts' packed panels are stacked into one weight and the layer calls it once per
Linear; the rows are each expert's as before, rounded as before, so the outputs are the same bit for bit (tested).
Elsewhere (float experts, q8_0, the GPU) the layer calls its experts one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.engine.models.layers import Linear
from backend.engine.models.moe import MoE
from backend.engine.runners.gemm import FloatBias, PackedKernel


@dataclass(frozen=True)
class ExpertsGemm:
    """[rows sorted by expert, K] -> [rows, N]: rows offsets[g] .. offsets[g + 1] - 1 times expert experts[g], plus
    that expert's bias (gpt-oss) as FloatBias adds it, in float32."""
    kernel: PackedKernel  # every expert's panels stacked
    bias: torch.Tensor | None  # [experts, N] float32

    def __call__(self, x: torch.Tensor, experts: list[int], offsets: list[int]) -> torch.Tensor:
        k = self.kernel
        y = k.experts_op(x.float().contiguous(), *k.panels, *k.shared, k.out_features, experts, offsets)
        if self.bias is not None and experts:  # each row's expert's: one index_select (repeat_interleave took
            # ~100 us a call at decode, 24 calls a gpt-oss step: AMD Zen 3)
            rows = torch.tensor([e for e, a, b in zip(experts, offsets, offsets[1:]) for _ in range(b - a)])
            y += self.bias.index_select(0, rows)
        return y.to(x.dtype)


def _stacked(linears: list[Linear]) -> ExpertsGemm | None:
    """The experts' Linears as one ExpertsGemm, or None where a tactic has no experts kernel."""
    kernels = [linear.gemm.gemm if isinstance(linear.gemm, FloatBias) else None for linear in linears]
    if not all(isinstance(k, PackedKernel) and k.experts_op is not None for k in kernels):
        return None
    first = kernels[0]
    if any(k.experts_op is not first.experts_op or k.out_features != first.out_features or
           any(not torch.equal(a, b) for a, b in zip(k.shared, first.shared)) for k in kernels):
        return None
    panels = tuple(torch.cat(parts) for parts in zip(*(k.panels for k in kernels)))
    biases = [linear.gemm.bias for linear in linears]
    if any((b is None) != (biases[0] is None) for b in biases):
        return None
    return ExpertsGemm(PackedKernel.of(first.op, first.experts_op, panels, first.shared, first.out_features),
                       None if biases[0] is None else torch.stack(biases))


def stack_experts(model: nn.Module) -> int:
    """Give each MoE layer whose gate_up and down both have an experts kernel its stacked pair (and drop the experts'
    own copies); the number of layers stacked."""
    stacked = 0
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        gate_up = _stacked([e.gate_up_proj for e in moe.experts])
        down = _stacked([e.down_proj for e in moe.experts]) if gate_up else None
        if gate_up and down:
            moe.stacked, moe.experts = (gate_up, down), None
            stacked += 1
    return stacked
