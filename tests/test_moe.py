"""The mixture-of-experts MLP (backend/engine/models/moe.py): tokens grouped by expert, one GEMM pair per expert that
has tokens, equal to a reference that runs each token through its chosen experts one by one; on a batch where the
router sends every token to the same two experts (six get none), and on one where choices spread."""

from __future__ import annotations

import pytest
import torch

from backend.engine.models.config import ModelConfig
from backend.engine.models.llama import TorchOps
from backend.engine.models.moe import MoE

HIDDEN, EXPERTS, TOP_K = 32, 8, 2
CFG = ModelConfig("qwen3_moe", 100, HIDDEN, 64, 1, 4, 2, 8, 1024, 1e-6, False, False, (), num_experts=EXPERTS,
                  num_experts_per_tok=TOP_K, moe_intermediate_size=16, norm_topk_prob=True, moe_layers=(0,))


def random_moe(seed: int) -> MoE:
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(CFG)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    return moe.requires_grad_(False)


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
    h = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    if routing == "all_to_two":  # positive activations; experts 3 and 5 score highest for every token
        h = h.abs()
        moe.router.zero_()
        moe.router[3], moe.router[5] = 1.0, 0.5
    _, chosen = moe.route(h)
    used = torch.bincount(chosen.flatten(), minlength=EXPERTS)
    if routing == "all_to_two":
        assert used.tolist() == [0, 0, 0, 37, 0, 37, 0, 0]
    else:
        assert (used > 0).sum() >= 6
    got = moe(h, TorchOps.silu_mul)
    torch.testing.assert_close(got, per_token(moe, h), rtol=1e-4, atol=1e-5)  # the GEMMs sum in other orders


def test_no_tokens_no_work():
    moe = random_moe(2)
    assert moe(torch.empty(0, HIDDEN), TorchOps.silu_mul).shape == (0, HIDDEN)
