"""What quantization serves a model folder (vLLM reads it from the folder too): a checkpoint quantized by
compressed-tensors, GPTQ or AWQ (config.json's `quantization_config.quant_method`) is served as stored by its own
reader, and a folder whose only weights are a GGUF file (a bare `.gguf` given as the model) as `gguf`. `int8` / `int4`
round float weights, so they are refused for a folder that has none. `read_stored` calls the reader of each."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.engine.models import compressed_tensors_weights, gguf_weights, gptq_awq_weights
from backend.engine.models.config import ModelConfig
from backend.engine.models.weight_blocks import Weight

CHECKPOINT_METHODS = (compressed_tensors_weights.METHOD, *gptq_awq_weights.METHODS)
AS_STORED = ("gguf", *CHECKPOINT_METHODS)  # served as the folder stores them, each by its reader


def quantization_config(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("quantization_config") if path.is_file() else None


def served_quantization(model_dir: str | Path, asked: str, runtime: str = "torch", device: str = "cpu") -> str:
    """The `quantization` that serves `model_dir`: `asked`, or the checkpoint's own method, or `gguf` (module
    docstring); what does not fit is refused by name. `auto` (the default) serves the weights as shipped: a folder's
    GGUF file as stored where the torch runtime runs on the CPU (the default model's folder has one beside the float
    weights made from it, as llama.cpp and Ollama users expect), a quantized checkpoint by its method, else float."""
    folder = Path(model_dir)
    if gguf_only(folder):
        if asked not in ("auto", "none", "gguf"):
            raise ValueError(f"quantization: {asked} rounds float weights, and {folder} has only a GGUF file: set none "
                             "(its values dequantized) or gguf (as stored)")
        return "none" if asked == "none" else "gguf"
    if asked == "auto" and any(folder.glob("*.gguf")) and (runtime, device) == ("torch", "cpu"):
        return "gguf"
    qconfig = quantization_config(model_dir)
    if qconfig is None:
        if asked == "auto":
            return "none"
        if asked in CHECKPOINT_METHODS:
            raise ValueError(f"quantization: {asked} serves a checkpoint it quantized; {model_dir}/config.json has no "
                             "quantization_config")
        return asked
    method = qconfig.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"model: {model_dir} is a {method} checkpoint (config.json quantization_config.quant_method);"
                         f" served are {', '.join(CHECKPOINT_METHODS)} checkpoints and GGUF files")
    if asked not in ("auto", "none", method):
        raise ValueError(f"quantization: {asked} rounds a float checkpoint, and {model_dir} is quantized already "
                         f"({method}): set none or {method}")
    if method == compressed_tensors_weights.METHOD:
        compressed_tensors_weights.check_config(model_dir, qconfig)
    else:
        gptq_awq_weights.check_config(model_dir, qconfig)
    return method


def gguf_only(folder: str | Path) -> bool:
    """The folder's weights are a GGUF file (a bare `.gguf` given as the model), no float checkpoint beside it."""
    return not any(Path(folder).glob("*.safetensors")) and any(Path(folder).glob("*.gguf"))


def float_state(model_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor] | None:
    """The float weights `quantization: none` serves when they are not the folder's safetensors (which the loader
    reads itself, None here): a GGUF file's, dequantized as transformers reads it."""
    return gguf_weights.dequantized_state(model_dir, cfg) if gguf_only(model_dir) else None


def read_stored(model_dir: str | Path, quantization: str, cfg: ModelConfig
                ) -> tuple[dict[str, torch.Tensor], dict[str, Weight]]:
    """For a `quantization` in AS_STORED: (the folder's float tensors, HF names; PagedLlama's Linears as stored)."""
    if quantization == "gguf":
        return gguf_weights.load_gguf(model_dir, cfg)
    if quantization == compressed_tensors_weights.METHOD:
        return compressed_tensors_weights.load_compressed_tensors(model_dir, cfg)
    return gptq_awq_weights.load_gptq_awq(model_dir, cfg, quantization_config(model_dir))
