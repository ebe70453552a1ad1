"""The CPU runner's decoder layers in one C++ call a step (kernels/layer_program.cpp) instead of a Python loop.

A layer on the kernel path is eight kernel calls (its GEMMs, attend_qkv, two add_rms_norms, silu_mul). From Python each
cost 4-8 us of argument parsing and frames, and the layer's own Python as much again: ~2.5 ms of every step of a
16-layer model at any size. A 16-layer model of tiny widths stepped in 3.0-3.4 ms with the loop, 0.8-1.1 with the
program; SmolLM2 (30 layers, Q4_1) at batch 1 in 8.25 ms and 6.42 (1.29x), a Llama-3.2-1B shape Q4_K_M in 32.2 and
28.4 (1.13x) (AMD EPYC Zen 3, 2 threads, 2026-12-07, blocks of steps alternating in one process). The program holds
each layer's packed weights, norms and KV cache, and calls the same kernels with the same arguments: the same bits
(tests/test_layer_program.py).

It is built where the model's activations are float32, its layers have no experts and no attention sinks, their MLP
is SiLU's or Gemma's GeGLU, and every Linear runs on our kernels (runners/gemm.py kernel_calls); elsewhere, and for a
step with LoRA adapters, the model runs its Python loop.
"""

from __future__ import annotations

import torch

from backend.engine.models.config import SLIDING
from backend.engine.models.llama import PROJECTIONS, PagedLlama
from backend.engine.runners.gemm import kernel_calls


def layer_program(model: PagedLlama, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.ScriptObject | None:
    """The program of `model`'s layers over their caches `layer_kv`, or None where a layer needs the Python loop."""
    cfg, layers = model.cfg, list(model.layers)
    if (model.norm.weight.dtype != torch.float32 or cfg.activation not in ("silu", "gelu_tanh") or cfg.attention_sinks
            or any(layer.moe is not None for layer in layers)):
        return None
    calls = [[kernel_calls(getattr(layer, name).gemm) for name in PROJECTIONS] for layer in layers]
    if any(c is None for layer_calls in calls for c in layer_calls):
        return None
    program = torch.classes.llm_kernels.LayerProgram(cfg.num_heads, cfg.scale, cfg.rms_norm_eps)
    next_norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
    for layer, (k_cache, v_cache), next_norm, layer_calls in zip(layers, layer_kv, next_norms, calls):
        program.add_layer(k_cache, v_cache, layer.post_attention_layernorm.weight, next_norm.weight,
                          *((layer.q_norm.weight, layer.k_norm.weight) if cfg.qk_norm else (None, None)),
                          *((layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
                            if cfg.sandwich_norms else (None, None)),
                          layer.window, cfg.activation == "gelu_tanh", layer.rope_kind == SLIDING)
        for which, parts in enumerate(layer_calls):
            for part in parts:
                program.add_kernel_call(which, part.op, part.tensors, part.ints, part.bias)
    return program
