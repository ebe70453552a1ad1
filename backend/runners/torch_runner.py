"""PyTorch runner: runs PagedLlama eagerly (CPU by default, CUDA when asked and present)."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.batch import ModelInput
from backend.models.llama import load_model
from backend.runners.base import torch_dtype


class TorchRunner:
    def __init__(self, model_dir: str | Path, dtype: str, num_blocks: int, block_size: int, device: str = "cpu"):
        self.device = torch.device(device)
        self.model = load_model(model_dir, torch_dtype(dtype), self.device)
        self.model_config = cfg = self.model.cfg
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=torch_dtype(dtype), device=self.device)
        self._flat_cache = self.kv_cache.view(cfg.num_layers, 2, num_blocks * block_size,
                                              cfg.num_kv_heads, cfg.head_dim)

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> torch.Tensor:
        inputs = {k: torch.from_numpy(v).to(self.device) for k, v in batch.graph_inputs().items()}
        logits, new_kv = self.model(**inputs, kv_cache=self.kv_cache)
        slots = torch.from_numpy(batch.slot_mapping).to(self.device)
        self._flat_cache.index_copy_(2, slots, new_kv)
        return logits.cpu()
