"""python -m build_engine: HF checkpoint -> ONNX (checked, and run once against PyTorch) -> TensorRT plan
-> the `llm` model's config.pbtxt pointed at the engine. Progress per stage goes to stderr.

    python -m build_engine --model default --output engines/smollm2 --runtime onnxruntime
    python -m build_engine --model default --output engines/smollm2-int4 --runtime onnxruntime --quantization int4
    python -m build_engine --model default --output engines/smollm2-trt --runtime tensorrt --dtype bfloat16 \\
        --max-num-tokens 512 --max-num-seqs 64 --llm-config model_repository/llm/config.pbtxt
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from backend.engine.config import EngineConfig
from backend.engine.engine import kv_pool_blocks
from backend.engine.models.config import load_model_config
from backend.engine.runners.base import DTYPES
from backend.engine.runners.manifest import max_blocks_per_seq
from backend.serving.model_store import Stages, resolve_model_dir
from build_engine.quantize_onnx import BITS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = EngineConfig.create(model="")
    p = argparse.ArgumentParser(prog="python -m build_engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="HF safetensors folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True, help="engine folder to write (replaced if it is an engine folder)")
    p.add_argument("--runtime", choices=("onnxruntime", "tensorrt"), required=True)
    p.add_argument("--dtype", choices=list(DTYPES), default=defaults.dtype)
    p.add_argument("--quantization", choices=("none", *BITS), default="none",
                   help="onnxruntime: the Linears as MatMulNBits in int8 or int4 (from float32 weights)")
    p.add_argument("--opset", type=int, default=None,
                   help="ONNX opset (default: 23 for onnxruntime, 18 for tensorrt; 23 needs TensorRT >= 10.14)")
    p.add_argument("--max-num-tokens", type=int, default=defaults.scheduler.max_num_batched_tokens,
                   help="TensorRT profile: the engine's max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=defaults.scheduler.max_num_seqs, help="TensorRT profile")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help=f"TensorRT profile: KV pool size (default: {defaults.cache.kv_cache_memory_gb} GiB of blocks)")
    p.add_argument("--block-size", type=int, default=defaults.cache.block_size, help="TensorRT profile")
    p.add_argument("--max-model-len", type=int, default=None, help="TensorRT profile (default: the model's)")
    p.add_argument("--q-tile", type=int, default=defaults.q_tile, help="TensorRT profile: attention row width")
    p.add_argument("--workspace-gb", type=float, default=4.0, help="TensorRT builder workspace")
    p.add_argument("--llm-config", type=Path, default=None, help="config.pbtxt of the llm model to point here")
    args = p.parse_args(argv)
    # Fail before minutes of export, not after.
    if args.llm_config is not None and not args.llm_config.is_file():
        p.error(f"--llm-config: no file {args.llm_config}")
    if args.quantization != "none" and (args.runtime, args.dtype) != ("onnxruntime", "float32"):
        p.error(f"--quantization {args.quantization}: quantized graphs are built for --runtime onnxruntime from "
                f"--dtype float32")
    if args.runtime == "tensorrt" and importlib.util.find_spec("tensorrt") is None:
        p.error("--runtime tensorrt: the tensorrt package is not installed here (GPU hosts / the Docker image)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    output = Path(args.output).resolve()
    progress = Stages("build_engine", total=4 + 2 * (args.quantization != "none") + (args.runtime == "tensorrt")
                      + (args.llm_config is not None))
    with progress.stage(f"preparing model {args.model}"):
        model_dir = resolve_model_dir(args.model)
    from build_engine.export_onnx import OPSETS, export_engine_dir

    opset = args.opset or OPSETS[args.runtime]
    check = export_engine_dir(model_dir, output, args.dtype, opset, progress.stage, args.quantization)  # 2-4 (6)
    progress.say(str(check))
    if args.runtime == "tensorrt":
        from build_engine.tensorrt_build import BuildLimits, build_plan

        config = EngineConfig.create(model=str(model_dir), dtype=args.dtype, block_size=args.block_size,
                                     num_kv_blocks=args.num_kv_blocks)
        cfg = load_model_config(model_dir)
        num_blocks = kv_pool_blocks(config, cfg)
        limits = BuildLimits(max_num_tokens=args.max_num_tokens, max_num_seqs=args.max_num_seqs,
                             max_blocks_per_seq=max_blocks_per_seq(cfg, num_blocks, args.block_size,
                                                                   args.max_model_len),
                             num_kv_blocks=num_blocks, block_size=args.block_size, q_tile=args.q_tile)
        with progress.stage(f"building the TensorRT plan ({limits})"):
            build_plan(output, limits, args.workspace_gb)
    if args.llm_config is not None:
        from build_engine.llm_config import update_llm_config

        with progress.stage(f"pointing {args.llm_config} at {output}"):
            update_llm_config(args.llm_config, args.runtime, output, args.dtype, args.quantization)
    progress.say(f"engine ready in {output} ({time.perf_counter() - progress.start:.1f} s)")


if __name__ == "__main__":
    main()
