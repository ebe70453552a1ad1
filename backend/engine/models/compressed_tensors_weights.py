"""A compressed-tensors checkpoint served as stored (`quantization: compressed-tensors`, picked by itself from the
folder's config.json): llm-compressor's formats for the int4 / int8 checkpoints vLLM serves, `pack-quantized`
(W4A16, W4A16_ASYM, W8A16: weight-only) and `int-quantized` (W8A8: int8 weights, activations rounded per token).

A `pack-quantized` Linear `x` is `x.weight_packed` (int32 [N, K * bits / 32]: value i of a row at bits i * bits, as
q + 2^(bits-1)), `x.weight_scale` ([N, K / G] in the model's dtype: a scale per G weights along a row, G = K per
channel), `x.weight_shape` ([N, K]) and, if asymmetric, `x.weight_zero_point` (packed likewise along the output
channels); an `int-quantized` one is `x.weight` (int8 [N, K]) and `x.weight_scale` (W8A8: per channel). Its
weights are w = s (q - z). Everything is read from the tensors themselves (bits, group, symmetric), so a checkpoint
mixing schemes (down_proj in 8 bits, an ignored lm_head in float) needs no parsing of its targets.

- 4 bits -> `Q4Blocks`: q4 = the stored value (0..15), d = s, m = -s * (z + 8), per 32 weights (G a multiple of 32).
- 8 bits -> `Q8Blocks`: q the int8 value, scale s, m = -s * z where asymmetric.
Each is the checkpoint's value exactly where s is bfloat16 or float16 (s has 8 or 11 bits, so s * q4 and s * (z + 8)
are exact in float32), and where s is float32 for symmetric 8 bits (W8A8's scales often are); otherwise within
float32's rounding of those products. W8A8's activations are rounded as the engine's kernels round them (per 32
values with `q8_0_w8a8`, not at all with `q8_0`), not per token. Unused Linears (an `ignore`d lm_head) stay float
tensors, served by the float tactics. Refused by name: other formats (float8, nvfp4, ...), activation-ordered groups
(`weight_g_idx`), groups that are not whole 32-weight blocks or do not divide a row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from backend.engine.models.config import ModelConfig
from backend.engine.models.llama import fused_linears
from backend.engine.models.weight_blocks import BLOCK, Q4Blocks, Q8Blocks, Weight, cat_rows

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized")  # W4A16, W4A16_ASYM, W8A16; W8A8


def check_config(model_dir: str | Path, qconfig: dict) -> None:
    """Refuses by name a compressed-tensors checkpoint of a format not served (float8, nvfp4, ...)."""
    formats = {qconfig.get("format")} | {g.get("format") for g in qconfig.get("config_groups", {}).values()}
    if other := sorted(formats - {None, *FORMATS}):
        raise ValueError(f"model: {model_dir} is {METHOD} of format {other}; served are {', '.join(FORMATS)}")


def unpack(packed: torch.Tensor, bits: int, rows: int, cols: int) -> torch.Tensor:
    """int32 [rows, words], value i at bits i * bits -> uint8 [rows, cols] as stored (q + 2^(bits-1))."""
    if sys.byteorder != "little":
        raise RuntimeError(f"{METHOD}: the packed words are read as little-endian bytes")
    raw = packed.contiguous().view(torch.uint8)
    values = raw if bits == 8 else torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(rows, -1)
    return values[:, :cols].contiguous()


def _packed(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
            zero_point: torch.Tensor | None) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """`pack-quantized` tensors -> (q + 2^(bits-1) as uint8 [N, K], bits, z + 2^(bits-1) [N, groups] or None)."""
    rows, cols = (int(n) for n in shape)
    bits = packed.shape[1] * 32 // cols
    if bits not in (4, 8) or packed.shape[1] * 32 != bits * cols:
        raise ValueError(f"{METHOD}: {name} is {packed.shape[1] * 32 / cols:g}-bit; served are 4 and 8 bits")
    # the zero point is packed along the output channels: unpack its transpose
    z = None if zero_point is None else unpack(zero_point.t(), bits, scale.shape[1], rows).t()
    return unpack(packed, bits, rows, cols), bits, z


def _int8(weight: torch.Tensor, zero_point: torch.Tensor | None) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """`int-quantized` (W8A8's int8 weight, its zero point unpacked) -> the same as `_packed`."""
    def offset(t: torch.Tensor) -> torch.Tensor:
        return (t.int() + 128).to(torch.uint8)

    return offset(weight), 8, None if zero_point is None else offset(zero_point)


def blocks(label: str, scale: torch.Tensor, q: torch.Tensor, bits: int, z: torch.Tensor | None
           ) -> Q4Blocks | Q8Blocks:
    """One Linear (`label`: its reader and name, for errors) as the blocks the kernels read (module docstring): w =
    s (q - z), q and z stored unsigned (0 .. 2^bits - 1), z None for 2^(bits-1). GPTQ and AWQ read into it too."""
    cols = q.shape[1]
    group = cols // scale.shape[1]
    if group * scale.shape[1] != cols or group % BLOCK:
        raise ValueError(f"{label} has {scale.shape[1]} scales along rows of {cols} weights; served are "
                         f"groups of whole {BLOCK}-weight blocks that divide a row")
    offset = 1 << (bits - 1)
    s = scale.float().repeat_interleave(group // BLOCK, dim=1)
    zf = torch.full_like(s, offset) if z is None else z.float().repeat_interleave(group // BLOCK, dim=1)
    if bits == 4:
        return Q4Blocks(q, s, -(s * zf))
    return Q8Blocks((q.int() - offset).to(torch.int8), s, None if z is None else -(s * (zf - offset)))


def read_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def stored_linears(state: dict[str, torch.Tensor], cfg: ModelConfig,
                   read: Callable[[str], Weight | None]) -> dict[str, Weight]:
    """PagedLlama's Linears (`layers.0.qkv_proj`, ..., `lm_head`), q/k/v and gate/up fused, each HF Linear (`read` by
    its HF name) as stored, or its float `.weight` where `read` gives None (an unquantized lm_head)."""
    def key(module: str) -> str:  # a LlamaForCausalLM checkpoint keeps all but its lm_head under `model.`
        return module if module == "lm_head" else f"model.{module}"

    def weight(name: str) -> Weight:
        stored = read(name)
        return state[f"{name}.weight"] if stored is None else stored

    return {name: cat_rows([weight(key(s)) for s in sources]) for name, sources in fused_linears(cfg).items()}


def load_compressed_tensors(model_dir: str | Path, cfg: ModelConfig
                            ) -> tuple[dict[str, torch.Tensor], dict[str, Weight]]:
    """The checkpoint's float tensors (embedding, norms, an unquantized lm_head: HF names), and PagedLlama's Linears
    as stored (`stored_linears`)."""
    state = read_state(model_dir)
    if any(k.endswith(".weight_g_idx") for k in state):
        raise ValueError(f"{METHOD}: {model_dir} orders its groups by activation (weight_g_idx); served are "
                         "checkpoints without (actorder: null or weight)")

    def read(name: str) -> Q4Blocks | Q8Blocks | None:
        scale, zero_point = state.pop(f"{name}.weight_scale", None), state.pop(f"{name}.weight_zero_point", None)
        if f"{name}.weight_packed" in state:
            unpacked = _packed(name, state.pop(f"{name}.weight_packed"), scale, state.pop(f"{name}.weight_shape"),
                               zero_point)
        elif scale is not None:
            unpacked = _int8(state.pop(f"{name}.weight"), zero_point)
        else:
            return None
        return blocks(f"{METHOD}: {name}", scale, *unpacked)

    return state, stored_linears(state, cfg, read)
