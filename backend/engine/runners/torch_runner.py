"""PyTorch runner: runs PagedLlama eagerly (CPU by default, CUDA when asked and present).

`attention` picks how the model reads the paged cache (see models/llama.py): "kernel", the CPU
C++ kernel; "gather", the graph that ONNX Runtime and TensorRT run; "auto", the kernel on the CPU
when it builds here, else the gather (with a warning that says why). On CUDA, "auto" and "triton" run
runners/cuda_runner.py instead (factory.py); this runner serves CUDA with the gather. `gemm_backend` picks each Linear's
GEMM (runners/gemm.py): "auto" measures the candidates on this CPU, a tactic name forces it; `quantization`
"int8" / "int4" makes the candidates the int8 / int4 tactics (weights rounded at load, float copies released);
"gguf" serves the model folder's GGUF file as stored (models/gguf_weights.py), its embedding table and norms
included (picked by itself where the folder has no other weights);
"compressed-tensors", "gptq", "awq" a checkpoint's int4 / int8 Linears as stored (models/compressed_tensors_weights.py,
models/gptq_awq_weights.py), picked from the folder's config.json by itself (models/checkpoint_format.py).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from backend.engine.batch import ModelInput
from backend.engine.models.checkpoint_format import AS_STORED, float_state, read_stored, served_quantization
from backend.engine.models.config import load_model_config
from backend.engine.models.llama import KernelLayout, load_model
from backend.engine.models.weight_blocks import BlockEmbedding
from backend.engine.runners.base import allocate_kv_cache, torch_dtype, write_new_kv
from backend.engine.runners.expert_gemm import stack_experts
from backend.engine.runners.gemm import may_keep_narrow, use_tactics
from backend.engine.runners.layer_program import layer_program

log = logging.getLogger(__name__)
ATTENTION = ("auto", "kernel", "gather", "triton")


def resolve_attention(attention: str, device: torch.device) -> str:
    if attention not in ATTENTION:
        raise ValueError(f"attention: expected one of {list(ATTENTION)}, got {attention!r}")
    if attention == "triton":
        raise ValueError(f"attention: triton (the GPU kernels) runs on CUDA only, not on {device}")
    if attention == "gather" or (attention == "auto" and device.type != "cpu"):
        return "gather"
    if device.type != "cpu":
        raise ValueError(f"attention: the paged-attention kernel runs on the CPU only, not on {device}")
    from backend.engine.kernels import cpu_kernels

    try:
        cpu_kernels.load()
    except Exception as e:  # no compiler, no ninja, a failed build: serve anyway, slower
        if attention == "kernel":
            raise
        log.warning("attention: the CPU kernel did not build (%s); using the gather path", e)
        return "gather"
    return "kernel"


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the OS. A load converts weights through transient copies (a GGUF's blocks
    unpacked, then packed for their tactic) that glibc keeps once freed: a 2.8B Qwen3-MoE Q4_K_M's process held 8.5 GB
    after load, 4.2 GB after this (AMD Zen 3, 2026-11-29)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class TorchRunner:
    def __init__(self, model_dir: str | Path, dtype: str, num_blocks: int, block_size: int, device: str = "cpu",
                 attention: str = "auto", gemm_backend: str = "auto", quantization: str = "none",
                 kv_cache_dtype: str = "auto", max_positions: int | None = None):
        self.device = torch.device(device)
        self.attention = resolve_attention(attention, self.device)
        quantization = served_quantization(model_dir, quantization, "torch", self.device.type)
        state = stored = None
        if quantization in AS_STORED:
            state, stored = read_stored(model_dir, quantization, load_model_config(model_dir))
            log.info("%s: %s's Linears served as stored", quantization, model_dir)
        else:
            state = float_state(model_dir, load_model_config(model_dir))
        self.model = load_model(model_dir, torch_dtype(dtype), self.device, state, stored, max_positions,
                                narrow_linears=may_keep_narrow(gemm_backend))
        if quantization == "gguf":
            self.model.embed_tokens = BlockEmbedding(stored.pop("embed_tokens"), torch_dtype(dtype))
        self.gemm_tactics = use_tactics(self.model, self.device, gemm_backend, quantization, stored, torch_dtype(dtype))
        if stacked := stack_experts(self.model):
            log.info("MoE: %d layers' experts stacked, one kernel call per Linear", stacked)
        del state, stored
        _return_freed_memory()
        self.model_config = cfg = self.model.cfg
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, torch_dtype(dtype), self.device, kv_cache_dtype)
        self.layer_kv = [(layer[0], layer[1]) for layer in self.kv_cache]  # views, made once (PagedLlama.forward)
        self.program = layer_program(self.model, self.layer_kv) if self.attention == "kernel" else None

    @torch.inference_mode()
    def forward(self, batch: ModelInput, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        def tensor(a) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        inputs = {k: tensor(v) for k, v in batch.graph_inputs().items()}
        if self.attention == "kernel":
            kernel = KernelLayout(tensor(batch.block_tables), tensor(batch.query_start), tensor(batch.context_lens),
                                  tensor(batch.slot_mapping), tensor(batch.prompt_lens))
            logits, _ = self.model(**inputs, kv_cache=self.layer_kv, kernel=kernel,  # writes K/V itself
                                   between_layers=between_layers, lora=batch.lora, program=self.program)
        else:
            logits, new_kv = self.model(**inputs, kv_cache=self.kv_cache, between_layers=between_layers,
                                        lora=batch.lora)
            write_new_kv(self.kv_cache, batch, new_kv)
        return logits.cpu()
