"""A float model folder quantized by compressed-tensors into a checkpoint as llm-compressor writes one (W4A16,
W4A16_ASYM, W8A16 `pack-quantized`; W8A8 `int-quantized`), the int4 / int8 checkpoints vLLM serves: the tests' and
benchmarks' way to serve one without fetching it. Round to nearest, as llm-compressor's QuantizationModifier rounds
without calibration data: each group's scale (and zero point) from its min and max (compressed-tensors'
`calculate_qparams`); the packing and config.json's `quantization_config` are compressed-tensors' own. The lm_head
stays float, as in llm-compressor's recipes. The weights are cast to `--dtype` first (a checkpoint's scales are in its
dtype).

    python -m load_tests.compressed_checkpoint [--model DIR] [--scheme W4A16] [--group-size 64]   # prints the folder
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _round_to_nearest(model: torch.nn.Module) -> None:
    """Each quantized Linear's scale and zero point from its groups' (or rows') min and max."""
    from compressed_tensors.quantization.utils import calculate_qparams

    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data
        w = w.unflatten(-1, (-1, args.group_size)) if args.strategy == "group" else w[:, None, :]
        scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point)


def compress_checkpoint(model_dir: Path, out: Path, scheme: str | dict[str, str] = "W4A16",
                        group_size: int | None = None, dtype: str = "bfloat16") -> Path:
    """`scheme`: a compressed-tensors preset for every Linear, or {target: preset} (targets as compressed-tensors
    reads them: `Linear`, `re:.*down_proj$`); `group_size` replaces the presets' 128 (None keeps it)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    groups = {}
    for i, (target, preset) in enumerate(({"Linear": scheme} if isinstance(scheme, str) else scheme).items()):
        s = preset_name_to_scheme(preset, [target])
        if group_size is not None and s.weights.strategy == "group":
            s = s.model_copy(update={"weights": s.weights.model_copy(update={"group_size": group_size})})
        groups[f"group_{i}"] = s
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]))
    _round_to_nearest(model)
    compressor = ModelCompressor.from_pretrained_model(model)  # the format llm-compressor would pick
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return out


def main() -> None:
    from backend.serving.model_store import prepare_default_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a float HF folder (default: the default model, converted)")
    p.add_argument("--scheme", default="W4A16", help="compressed-tensors preset: W4A16, W4A16_ASYM, W8A16, W8A8")
    p.add_argument("--group-size", type=int, help="weights per scale along a row (the presets': 128)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--out", type=Path, help="default: beside the model, named for the scheme")
    args = p.parse_args()
    model = args.model or prepare_default_model(verbose=False)
    tag = f"{args.scheme}" + (f"-g{args.group_size}" if args.group_size else "")
    print(compress_checkpoint(model, args.out or model.parent / f"{model.name}-{tag}", args.scheme, args.group_size,
                              args.dtype))


if __name__ == "__main__":
    main()
