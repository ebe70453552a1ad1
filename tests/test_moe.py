"""The mixture-of-experts MLP (backend/engine/models/moe.py): tokens grouped by expert, one GEMM pair per expert that
has tokens, equal to a reference that runs each token through its chosen experts one by one; on a batch where the
router sends every token to the same two experts (six get none), and on one where choices spread. Its int8 experts
stacked into one kernel call per Linear (runners/expert_gemm.py) equal the same experts called one by one, bit for bit;
the grouping and the weighted sum in one kernel call each (kernels/expert_routing.cpp) equal torch's ops, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import dataclasses

from backend.engine.models.config import ModelConfig
from backend.engine.kernels import cpu_kernels
from backend.engine.models.llama import KernelOps, TorchOps
from backend.engine.models.moe import MoE
from backend.engine.runners.expert_gemm import stack_experts
from backend.engine.runners.gemm import use_tactics

HIDDEN, EXPERTS, TOP_K = 32, 8, 2
CFG = ModelConfig("qwen3_moe", 100, HIDDEN, 64, 1, 4, 2, 8, 1024, 1e-6, False, False, (), num_experts=EXPERTS,
                  num_experts_per_tok=TOP_K, moe_intermediate_size=16, norm_topk_prob=True, moe_layers=(0,))


def random_moe(seed: int, cfg: ModelConfig = CFG) -> MoE:
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(cfg)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    return moe.requires_grad_(False)


def routed(moe: MoE, routing: str) -> torch.Tensor:
    """37 tokens' hidden states for `moe`: spread over the experts, or (all_to_two) all sent to experts 3 and 5."""
    h = torch.randn(37, moe.router.shape[1], generator=torch.Generator().manual_seed(1))
    if routing == "all_to_two":  # positive activations; experts 3 and 5 score highest for every token
        h = h.abs()
        moe.router.zero_()
        moe.router[3], moe.router[5] = 1.0, 0.5
    return h


def per_token(moe: MoE, h: torch.Tensor) -> torch.Tensor:
    """Each token alone: the softmax router's top k, renormalized, its experts' outputs weighted and summed."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = torch.softmax(h[t] @ moe.router.T, dim=-1)
        weights, chosen = torch.topk(probs, TOP_K)
        weights = weights / weights.sum()
        for w, e in sorted(zip(weights.tolist(), chosen.tolist()), key=lambda pair: pair[1]):
            expert = moe.experts[e]
            out[t] += w * expert.down_proj(TorchOps.silu_mul(expert.gate_up_proj(h[t:t + 1])))[0]
    return out


@pytest.mark.parametrize("routing", ["spread", "all_to_two"])
def test_grouped_experts_equal_each_token_alone(routing):
    moe = random_moe(0)
    h = routed(moe, routing)
    _, chosen = moe.route(h)
    used = torch.bincount(chosen.flatten(), minlength=EXPERTS)
    if routing == "all_to_two":
        assert used.tolist() == [0, 0, 0, 37, 0, 37, 0, 0]
    else:
        assert (used > 0).sum() >= 6
    got = moe(h, TorchOps.silu_mul, TorchOps)
    torch.testing.assert_close(got, per_token(moe, h), rtol=1e-4, atol=1e-5)  # the GEMMs sum in other orders


def test_no_tokens_no_work():
    moe = random_moe(2)
    assert moe(torch.empty(0, HIDDEN), TorchOps.silu_mul, TorchOps).shape == (0, HIDDEN)


@pytest.mark.parametrize("quantization, tactic", [("int4", "q4_1_w4a8"), ("int8", "q8_0_w8a8")])
@pytest.mark.parametrize("routing", ["spread", "all_to_two"])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_experts_equal_the_experts_one_by_one(quantization, tactic, routing, bias):
    """One kernel call per Linear over every expert's rows (some experts without a row, one or two rows, all of them)
    computes what a call per expert does, bit for bit: decode (1 token), a batch, no tokens; with experts' biases
    (gpt-oss's) too."""
    moe = random_moe(3, dataclasses.replace(CFG, moe_intermediate_size=96, expert_bias=bias))  # down's K: 3 blocks
    use_tactics(moe, torch.device("cpu"), tactic, quantization)
    h = routed(moe, routing)
    batches = [h[:1], h[:2], h, h[:0]]
    one_by_one = [moe(x, TorchOps.silu_mul, TorchOps) for x in batches]
    assert stack_experts(moe) == 1 and moe.experts is None
    for x, want in zip(batches, one_by_one):
        assert torch.equal(moe(x, TorchOps.silu_mul, TorchOps), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["spread", "all_to_two"])
def test_the_kernels_group_and_sum_as_torch_does(routing, dtype):
    """KernelOps' group_by_expert and combine_experts (one C++ call each) give torch's rows, order, experts and offsets,
    and its weighted sum bit for bit (each product and sum rounded to the dtype, in the pairs' order): spread choices,
    all tokens to two experts, one token, none; the whole layer then the same either way."""
    cpu_kernels.load()
    moe = random_moe(5).to(dtype)
    h = routed(moe, routing).to(dtype)
    for x in (h, h[:1], h[:0]):
        weights, experts = moe.route(x)
        want, got = TorchOps.group_by_expert(x, experts, EXPERTS), KernelOps.group_by_expert(x, experts, EXPERTS)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and list(got[2:]) == list(want[2:])
        ys = torch.randn(x.shape[0] * TOP_K, HIDDEN, generator=torch.Generator().manual_seed(6)).to(dtype)
        assert torch.equal(KernelOps.combine_experts(ys, weights, got[1]), TorchOps.combine_experts(ys, weights, got[1]))
    assert torch.equal(moe(h, TorchOps.silu_mul, KernelOps), moe(h, TorchOps.silu_mul, TorchOps))


def test_float_experts_stay_one_by_one():
    moe = random_moe(4)
    use_tactics(moe, torch.device("cpu"), "aten")
    assert stack_experts(moe) == 0 and moe.stacked is None and moe.experts is not None
