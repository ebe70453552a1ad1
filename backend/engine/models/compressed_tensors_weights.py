"""A compressed-tensors checkpoint served as stored (`quantization: compressed-tensors`, picked by itself from the
folder's config.json): llm-compressor's and vLLM's `pack-quantized` format, the int4 / int8 weight-only checkpoints
(W4A16, W4A16_ASYM, W8A16) most quantized models on the HF hub ship in.

A Linear `x` is stored as `x.weight_packed` (int32 [N, K * bits / 32]: value i of a row at bits i * bits, as
q + 2^(bits-1)), `x.weight_scale` ([N, K / G] in the model's dtype: a scale per G weights along a row, G = K per
channel), `x.weight_shape` ([N, K]) and, if asymmetric, `x.weight_zero_point` (packed likewise along the output
channels); its weights are w = s (q - z). Everything is read from the tensors themselves (bits, group, symmetric),
so a checkpoint mixing schemes (down_proj in 8 bits, an ignored lm_head in float) needs no parsing of its targets.

- 4 bits -> `Q4Blocks`: q4 = the stored value (0..15), d = s, m = -s * (z + 8), per 32 weights (G a multiple of 32).
- 8 bits -> `Q8Blocks`: q the int8 value, scale s, m = -s * z where asymmetric.
Each is the checkpoint's value exactly where s is bfloat16 or float16 (every real checkpoint: s has 8 or 11 bits, so
s * q4 and s * (z + 8) are exact in float32); with float32 scales within float32's rounding of those products.
Unused Linears (an `ignore`d lm_head) stay float tensors, served by the float tactics. Refused by name: other
formats (int-quantized W8A8, float8, nvfp4), activation-ordered groups (`weight_g_idx`), groups that are not whole
32-weight blocks, groups that do not divide a row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from backend.engine.models.llama import ModelConfig
from backend.engine.models.weight_blocks import BLOCK, Q4Blocks, Q8Blocks, Weight, cat_rows

METHOD = "compressed-tensors"
PACKED = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def _quantization_config(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("quantization_config") if path.is_file() else None


def served_quantization(model_dir: str | Path, asked: str) -> str:
    """The `quantization` that serves `model_dir`: `asked`, or for a checkpoint quantized by compressed-tensors
    (config.json's `quantization_config`) compressed-tensors itself, which rounds nothing further."""
    qconfig = _quantization_config(model_dir)
    if qconfig is None:
        if asked == METHOD:
            raise ValueError(f"quantization: {METHOD} serves a checkpoint it quantized; {model_dir}/config.json has "
                             "no quantization_config")
        return asked
    method = qconfig.get("quant_method")
    if method != METHOD:
        raise ValueError(f"model: {model_dir} is a {method} checkpoint (config.json quantization_config.quant_method);"
                         f" served are {METHOD} (pack-quantized) checkpoints and GGUF files")
    if asked not in ("none", METHOD):
        raise ValueError(f"quantization: {asked} rounds a float checkpoint, and {model_dir} is quantized already "
                         f"({METHOD}): set none or {METHOD}")
    formats = {qconfig.get("format")} | {g.get("format") for g in qconfig.get("config_groups", {}).values()}
    if other := sorted(formats - {None, "pack-quantized"}):
        raise ValueError(f"model: {model_dir} is {METHOD} of format {other}; served is pack-quantized (W4A16, "
                         "W4A16_ASYM, W8A16)")
    return METHOD


def _unpack(packed: torch.Tensor, bits: int, rows: int, cols: int) -> torch.Tensor:
    """int32 [rows, words], value i at bits i * bits -> uint8 [rows, cols] as stored (q + 2^(bits-1))."""
    if sys.byteorder != "little":
        raise RuntimeError(f"{METHOD}: the packed words are read as little-endian bytes")
    raw = packed.contiguous().view(torch.uint8)
    values = raw if bits == 8 else torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(rows, -1)
    return values[:, :cols].contiguous()


def blocks(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
           zero_point: torch.Tensor | None) -> Q4Blocks | Q8Blocks:
    """One Linear's stored tensors as the blocks the kernels read (module docstring)."""
    rows, cols = (int(n) for n in shape)
    bits = packed.shape[1] * 32 // cols
    if bits not in (4, 8) or packed.shape[1] * 32 != bits * cols:
        raise ValueError(f"{METHOD}: {name} is {packed.shape[1] * 32 / cols:g}-bit; served are 4 and 8 bits")
    group = cols // scale.shape[1]
    if group * scale.shape[1] != cols or group % BLOCK:
        raise ValueError(f"{METHOD}: {name} has {scale.shape[1]} scales along rows of {cols} weights; served are "
                         f"groups of whole {BLOCK}-weight blocks that divide a row")
    q = _unpack(packed, bits, rows, cols)
    offset = 1 << (bits - 1)
    # z + offset per group (the zero point is packed along the output channels: unpack its transpose)
    z = torch.full(scale.shape, offset) if zero_point is None else \
        _unpack(zero_point.t(), bits, scale.shape[1], rows).t().int()
    per_block = group // BLOCK
    s = scale.float().repeat_interleave(per_block, dim=1)
    z = z.repeat_interleave(per_block, dim=1).float()
    if bits == 4:
        return Q4Blocks(q, s, -(s * z))
    return Q8Blocks((q.int() - offset).to(torch.int8), s, None if zero_point is None else -(s * (z - offset)))


def load_compressed_tensors(model_dir: str | Path, cfg: ModelConfig
                            ) -> tuple[dict[str, torch.Tensor], dict[str, Weight]]:
    """The checkpoint's float tensors (embedding, norms, an unquantized lm_head: HF names), and PagedLlama's Linears
    (`layers.0.qkv_proj`, ..., `lm_head`) as stored, q/k/v and gate/up fused."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if any(k.endswith(".weight_g_idx") for k in state):
        raise ValueError(f"{METHOD}: {model_dir} orders its groups by activation (weight_g_idx); served are "
                         "checkpoints without (actorder: null or weight)")

    def read(name: str) -> Q4Blocks | Q8Blocks | torch.Tensor:
        if f"{name}.weight_packed" not in state:
            return state[f"{name}.weight"]
        return blocks(name, *(state.pop(f"{name}.{p}", None) for p in PACKED))

    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    stored: dict[str, Weight] = {"lm_head": read(head)}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        stored[f"layers.{i}.qkv_proj"] = cat_rows([read(a + n + "_proj") for n in "qkv"])
        stored[f"layers.{i}.o_proj"] = read(a + "o_proj")
        stored[f"layers.{i}.gate_up_proj"] = cat_rows([read(m + "gate_proj"), read(m + "up_proj")])
        stored[f"layers.{i}.down_proj"] = read(m + "down_proj")
    return state, stored
