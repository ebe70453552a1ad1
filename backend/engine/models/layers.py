"""The two parameter-holding layers every part of the decoder shares (models/llama.py, models/moe.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose GEMM the PyTorch runner may replace by a tactic measured on this CPU (runners/gemm.py);
    without one it is `F.linear`, which is what the exported graph runs."""

    gemm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.gemm is None else self.gemm(x)

    @property
    def call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Its GEMM tactic as is, or the module: what a forward calls without nn.Module's call around a tactic."""
        return self if self.gemm is None else self.gemm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
