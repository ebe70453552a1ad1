"""A compressed-tensors checkpoint (load_tests/compressed_checkpoint.py: W4A16 or W8A16 for GPTQ's symmetric form,
W4A16_ASYM for AWQ and asymmetric GPTQ) written again in the layout AutoGPTQ / GPTQModel or AutoAWQ write, the same
integers and scales (float16, as they store them; refused where a scale is not exactly a float16; make the source
with `--dtype float16`, as GPTQ and AWQ checkpoints are): the tests' and
benchmarks' way to serve a GPTQ or AWQ checkpoint without fetching one. The layouts are those vLLM's CPU kernels
unpack (`AWQ_ORDER`; GPTQ's z - 1); `bench_offline --vllm` serves the same folder with vLLM.

    python -m load_tests.gptq_awq_checkpoint CT_CHECKPOINT --method gptq|awq [--format gptq|gptq_v2]
        [--act-order-seed N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
from safetensors.torch import load_file, save_file

from backend.engine.models.gptq_awq_weights import AWQ_ORDER

SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint [rows, N] -> int32 [rows, N * bits / 32], value j of a word at bits j * bits."""
    return pack_to_int32((values.to(torch.int32) - (1 << (bits - 1))).to(torch.int8), bits, packed_dim=1)


def _scales(scale: torch.Tensor, name: str) -> torch.Tensor:
    half = scale.to(torch.float16)
    if not torch.equal(half.to(scale.dtype), scale):
        raise ValueError(f"{name}: its scales are not float16 values")
    return half.t().contiguous()


def convert(checkpoint: Path, out: Path, method: str, checkpoint_format: str = "gptq",
            act_order_seed: int | None = None) -> Path:
    """`act_order_seed` (GPTQ): each input's features shuffled by a seeded permutation P, its groups kept (column k
    holds the source's column P[k], g_idx[k] = P[k] / G): a `desc_act: true` checkpoint of another model, whose g_idx
    is what act-order writes. q/k/v share a P, and so do gate/up: act-order sorts an input by its own statistics."""
    generator = None if act_order_seed is None else torch.Generator().manual_seed(act_order_seed)
    orders: dict[str, torch.Tensor] = {}
    state = load_file(str(checkpoint / "model.safetensors"))
    config = json.loads((checkpoint / "config.json").read_text())
    names = [k.removesuffix(".weight_packed") for k in state if k.endswith(".weight_packed")]
    sym = not any(k.endswith(".weight_zero_point") for k in state)
    groups = {n: state[f"{n}.weight_scale"].shape[1] for n in names}
    cols = {n: int(state[f"{n}.weight_shape"][1]) for n in names}
    group_size, = {cols[n] // groups[n] for n in names}
    bits, = {state[f"{n}.weight_packed"].shape[1] * 32 // cols[n] for n in names}  # one width (and group) for all
    if method == "awq" and bits != 4:
        raise ValueError(f"{checkpoint}: AWQ is 4-bit, not {bits}")
    out_state = {k: v for k, v in state.items() if not k.rsplit(".", 1)[1].startswith("weight_")}
    for n in names:
        shape = [int(d) for d in state.pop(f"{n}.weight_shape")]
        offset = 1 << (bits - 1)
        q = unpack_from_int32(state.pop(f"{n}.weight_packed"), bits, shape) + offset  # [N, K], 0 .. 2^bits - 1
        scale = state.pop(f"{n}.weight_scale")
        zp = state.pop(f"{n}.weight_zero_point", None)
        z = (torch.full(scale.shape, offset) if zp is None else
             unpack_from_int32(zp, bits, scale.shape, packed_dim=0) + offset).t()  # [groups, N]
        if method == "awq":
            order = list(AWQ_ORDER)
            out_state[f"{n}.qweight"] = _pack_columns(q.t().reshape(shape[1], -1, 8)[..., order].flatten(1), 4)
            out_state[f"{n}.qzeros"] = _pack_columns(z.reshape(z.shape[0], -1, 8)[..., order].flatten(1), 4)
        else:
            module, linear = n.rsplit(".", 1)
            shared = f"{module}.{SHARED_INPUT.get(linear, linear)}"
            if shared not in orders:
                orders[shared] = torch.arange(shape[1]) if generator is None else torch.randperm(shape[1],
                                                                                                 generator=generator)
            inputs = orders[shared]
            q = q[:, inputs]
            out_state[f"{n}.qweight"] = _pack_columns(q, bits).t().contiguous()  # along the input: [K bits / 32, N]
            stored = z - 1 if checkpoint_format == "gptq" else z
            out_state[f"{n}.qzeros"] = _pack_columns(stored & ((1 << bits) - 1), bits)
            out_state[f"{n}.g_idx"] = (inputs // group_size).to(torch.int32)
        out_state[f"{n}.scales"] = _scales(scale, n)
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": generator is not None, "sym": sym,
                                         "checkpoint_format": checkpoint_format,
                                         "lm_head": False}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out_state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in checkpoint.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "recipe.yaml"):
            shutil.copy2(f, out / f.name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a compressed-tensors pack-quantized folder")
    p.add_argument("--method", choices=("gptq", "awq"), required=True)
    p.add_argument("--format", default="gptq", choices=("gptq", "gptq_v2"), help="GPTQ's checkpoint_format")
    p.add_argument("--act-order-seed", type=int, help="GPTQ: shuffle each Linear's inputs (desc_act: true)")
    p.add_argument("--out", type=Path, help="default: beside the checkpoint, named for the method")
    args = p.parse_args()
    out = args.out or args.checkpoint.parent / f"{args.checkpoint.name}-{args.method}"
    print(convert(args.checkpoint, out, args.method, args.format, args.act_order_seed))


if __name__ == "__main__":
    main()
