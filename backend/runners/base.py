"""The runner contract: one forward over a flat batch, KV cache owned by the runner.

`forward(batch)` returns float32 logits [S, vocab] (on the host) for the last token of each
sequence and writes the batch's new K/V into the runner's cache at `batch.slot_mapping`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from backend.batch import ModelInput
from backend.models.llama import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


class Runner(Protocol):
    model_config: ModelConfig
    num_blocks: int
    block_size: int

    def forward(self, batch: ModelInput) -> torch.Tensor: ...
