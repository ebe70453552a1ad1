"""The runner contract: one forward over a flat batch, KV cache owned by the runner.

`forward(batch, between_layers)` returns float32 logits [L, vocab] (on the host; on the GPU for the CUDA runner,
whose logits the sampler reads there) for the tokens at
`batch.logits_index` (each sequence's last token, and more where it asks: batch.py) and writes the batch's new K/V into the runner's cache at `batch.slot_mapping`. A runner that runs
the model layer by layer (PyTorch) calls `between_layers`, when given, between its layers; a compiled graph
(ONNX Runtime, TensorRT) runs whole and never calls it. The cache,
`kv_cache` [layers, 2, num_blocks, block_size, kv_heads, head_dim], is a torch tensor on every runtime, so
blocks can be copied in and out of it (disaggregated prefill, backend/engine/kv_transfer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from backend.engine.batch import ModelInput
from backend.engine.kv_quantization import SCALE_BYTES, cache_dtype, stored
from backend.engine.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


class Runner(Protocol):
    model_config: ModelConfig
    num_blocks: int
    block_size: int
    kv_cache: torch.Tensor

    def forward(self, batch: ModelInput, between_layers: Callable[[], None] | None = None) -> torch.Tensor: ...


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """The runner-owned cache [layers, 2, num_blocks, block_size, kv_heads, head_dim], zeroed, in `kv_cache_dtype`
    (kv_quantization.py; int8: rows of head_dim + 4 int8s)."""
    int8 = kv_cache_dtype == "int8"
    return torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim + SCALE_BYTES * int8,
                       dtype=cache_dtype(dtype, kv_cache_dtype), device=device)


def graph_outputs(cfg: ModelConfig, batch: ModelInput, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of the compiled graph, bound by pointer: logits [L, vocab] float32, new K/V
    [layers, 2, T, kv_heads, head_dim]."""
    logits = torch.empty(len(batch.logits_index), cfg.vocab_size, dtype=torch.float32, device=device)
    new_kv = torch.empty(cfg.num_layers, 2, batch.num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                         device=device)
    return logits, new_kv


def write_new_kv(kv_cache: torch.Tensor, batch: ModelInput, new_kv: torch.Tensor) -> None:
    """The step's new K/V [layers, 2, T, kv_heads, head_dim] into the cache, in place, at `slot_mapping` (rounded to
    a narrower cache's dtype)."""
    layers, _, num_blocks, block_size, kv_heads, width = kv_cache.shape
    slots = torch.from_numpy(batch.slot_mapping).to(kv_cache.device)
    new_kv = stored(new_kv, kv_cache.dtype)
    kv_cache.view(layers, 2, num_blocks * block_size, kv_heads, width).index_copy_(2, slots, new_kv)
