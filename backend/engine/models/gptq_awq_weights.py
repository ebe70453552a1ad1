"""GPTQ and AWQ checkpoints served as stored (`quantization: gptq | awq`, picked by itself from the folder's
config.json): the int4 checkpoints (and GPTQ's int8 ones) that vLLM and TensorRT-LLM serve, in the layouts AutoGPTQ /
GPTQModel and AutoAWQ write. Their weights are w = s (q - z), q and z unsigned, a scale and a zero per G weights along
an input row, read into the blocks compressed-tensors' checkpoints read into (`compressed_tensors_weights.blocks`):
4 bits `Q4Blocks` (`q4_1_w4a8`), 8 bits `Q8Blocks`, the same numbers exactly for float16 / bfloat16 scales.

- GPTQ, a Linear `x`: `x.qweight` int32 [K * bits / 32, N], value k of a column at bits (k mod 32 / bits) * bits
  of word k / (32 / bits); `x.scales` [K / G, N]; `x.qzeros` int32 [K / G, N * bits / 32], packed likewise along the
  output channels, holding z - 1 (`checkpoint_format: gptq`, AutoGPTQ's) or z (`gptq_v2`); `x.g_idx` [K], each
  input's group. `sym: true` means z = 2^(bits - 1), whatever qzeros holds (as vLLM reads it). With act-order
  (`desc_act: true`) g_idx is not k / G: the blocks then hold the inputs sorted by group (`InputsPermuted`), and the
  GEMM gathers x in that order (vLLM 0.32 refuses act-order folders).
- AWQ (`version: gemm`), a Linear `x`: `x.qweight` int32 [K, N / 8], packed along the output channels in AutoAWQ's
  order (the word's nibble i holds channel 8 c + AWQ_ORDER[i]); `x.qzeros` [K / G, N / 8] likewise, z itself;
  `x.scales` [K / G, N].
Refused by name: other bit widths, a g_idx whose groups are not G inputs each, AWQ's `gemv` layouts, groups that are
not whole 32-weight blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backend.engine.models.compressed_tensors_weights import blocks, read_state, stored_linears, unpack
from backend.engine.models.config import ModelConfig
from backend.engine.models.weight_blocks import InputsPermuted, Q4Blocks, Q8Blocks, Weight

METHODS = ("gptq", "awq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _bits(qconfig: dict) -> int:
    return qconfig.get("bits", qconfig.get("w_bit"))


def check_config(model_dir: str | Path, qconfig: dict) -> None:
    """Refuses by name what its quantization_config says is not served (module docstring)."""
    method, bits = qconfig["quant_method"], _bits(qconfig)
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"model: {model_dir} is {bits}-bit {method}; served are 4{' and 8' * (method == 'gptq')} bits")
    if method == "gptq" and qconfig.get("checkpoint_format", "gptq") not in GPTQ_FORMATS:
        raise ValueError(f"model: {model_dir} is gptq of checkpoint_format {qconfig['checkpoint_format']!r}; served "
                         f"are {', '.join(GPTQ_FORMATS)}")
    if method == "awq" and str(qconfig.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"model: {model_dir} is awq version {qconfig['version']!r}; served is gemm")


def _awq_channels(values: torch.Tensor) -> torch.Tensor:
    """[rows, N] in AutoAWQ's packed order -> the output channels in order."""
    rows, n = values.shape
    reverse = [AWQ_ORDER.index(j) for j in range(8)]
    return values.view(rows, n // 8, 8)[:, :, reverse].reshape(rows, n)


def load_gptq_awq(model_dir: str | Path, cfg: ModelConfig, qconfig: dict
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Weight]]:
    """The checkpoint's float tensors (embedding, norms, an unquantized lm_head: HF names), and PagedLlama's Linears
    as stored (`compressed_tensors_weights.stored_linears`)."""
    method, bits = qconfig["quant_method"], _bits(qconfig)
    state = read_state(model_dir)
    mask = (1 << bits) - 1

    def read(name: str) -> Q4Blocks | Q8Blocks | InputsPermuted | None:
        if f"{name}.qweight" not in state:
            return None
        packed, scales, zeros = (state.pop(f"{name}.{t}") for t in ("qweight", "scales", "qzeros"))
        groups, n = scales.shape
        if method == "awq":
            q = _awq_channels(unpack(packed, bits, packed.shape[0], n)).t()
            z = _awq_channels(unpack(zeros, bits, groups, n)).t().contiguous()
        else:
            k = packed.shape[0] * 32 // bits
            q = unpack(packed.t(), bits, n, k)
            in_groups = torch.arange(k) // (k // groups)
            g_idx = state.pop(f"{name}.g_idx", in_groups).long()
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], in_groups):
                raise ValueError(f"gptq: {name}'s g_idx does not give each of its {groups} groups {k // groups} inputs")
            if qconfig.get("sym", True):
                z = None
            else:
                z = unpack(zeros, bits, groups, n).t()
                if qconfig.get("checkpoint_format", "gptq") == "gptq":  # AutoGPTQ stores z - 1
                    z = ((z.int() + 1) & mask).to(torch.uint8)
                z = z.contiguous()
            if not torch.equal(order, torch.arange(k)):  # act-order: the inputs sorted by group
                return InputsPermuted(blocks(f"{method}: {name}", scales.t(), q[:, order].contiguous(), bits, z), order)
        return blocks(f"{method}: {name}", scales.t(), q.contiguous(), bits, z)

    return state, stored_linears(state, cfg, read)
