"""PyTorch runner: runs PagedLlama eagerly (CPU by default, CUDA when asked and present).

`attention` picks how the model reads the paged cache (see models/llama.py): "kernel", the CPU
C++ kernel; "gather", the graph that ONNX Runtime and TensorRT run; "auto", the kernel on the CPU
when it builds here, else the gather (with a warning that says why).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from backend.batch import ModelInput
from backend.models.llama import KernelLayout, load_model
from backend.runners.base import torch_dtype

log = logging.getLogger(__name__)
ATTENTION = ("auto", "kernel", "gather")


def resolve_attention(attention: str, device: torch.device) -> str:
    if attention not in ATTENTION:
        raise ValueError(f"attention: expected one of {list(ATTENTION)}, got {attention!r}")
    if attention == "gather" or (attention == "auto" and device.type != "cpu"):
        return "gather"
    if device.type != "cpu":
        raise ValueError(f"attention: the paged-attention kernel runs on the CPU only, not on {device}")
    from backend.kernels import paged_attention

    try:
        paged_attention.load()
    except Exception as e:  # no compiler, no ninja, a failed build: serve anyway, slower
        if attention == "kernel":
            raise
        log.warning("attention: the CPU kernel did not build (%s); using the gather path", e)
        return "gather"
    return "kernel"


class TorchRunner:
    def __init__(self, model_dir: str | Path, dtype: str, num_blocks: int, block_size: int, device: str = "cpu",
                 attention: str = "auto"):
        self.device = torch.device(device)
        self.attention = resolve_attention(attention, self.device)
        self.model = load_model(model_dir, torch_dtype(dtype), self.device)
        self.model_config = cfg = self.model.cfg
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=torch_dtype(dtype), device=self.device)
        self._flat_cache = self.kv_cache.view(cfg.num_layers, 2, num_blocks * block_size,
                                              cfg.num_kv_heads, cfg.head_dim)

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> torch.Tensor:
        def tensor(a) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        inputs = {k: tensor(v) for k, v in batch.graph_inputs().items()}
        slots = tensor(batch.slot_mapping)
        if self.attention == "kernel":
            kernel = KernelLayout(tensor(batch.block_tables), tensor(batch.query_start), tensor(batch.context_lens),
                                  slots)
            logits, _ = self.model(**inputs, kv_cache=self.kv_cache, kernel=kernel)  # K/V already written
        else:
            logits, new_kv = self.model(**inputs, kv_cache=self.kv_cache)
            self._flat_cache.index_copy_(2, slots, new_kv)
        return logits.cpu()
