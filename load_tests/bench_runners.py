"""Decode step time of each runner against this machine's GEMM bound (a script, not a test).

For each batch size: that many sequences of ~`--context` tokens are prefilled, then `--steps` decode
steps (one token per sequence) are timed, runner.forward only. Right before each step, torch.mm of
the model's shapes ([batch, hidden] x [hidden, 3 * hidden]) measures the machine's matmul rate, and

    gemm bound = (2 * non-embedding params * batch + lm_head FLOPs) / measured FLOP/s

is the step time if the step were nothing but its weight GEMMs at that rate (attention over the
context adds ~4 % FLOPs at 128 tokens and is left out). ratio = step time / gemm bound, per step.

    python load_tests/bench_runners.py --model default [--dtype bfloat16]

The machine may be shared with other benchmarks: measuring the rate next to each step keeps the
ratio meaningful when the absolute times swing with the load; the table gives medians over steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime
import torch

from backend.engine.batch import build_model_input
from backend.engine.config import EngineConfig
from backend.engine.runners.factory import create_runner
from backend.engine.runners.onnx_runner import check_supported
from backend.serving.model_store import resolve_model_dir
from build_engine.export_onnx import cached_engine_dir
from backend.engine.kv_cache import cdiv
from backend.engine.models.config import ModelConfig, load_model_config
from backend.engine.runners.base import Runner, torch_dtype
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence

BLOCK_SIZE = 16
PREFILL_TOKENS = 512  # per prefill step, as the engine's default token budget
WARMUP_STEPS = 2


@dataclass
class Row:
    runtime: str
    batch: int
    ms_per_step: float  # median over the timed steps
    ms_min: float
    tokens_per_s: float
    matmul_gflops: float  # median of the rates measured next to the steps
    gemm_bound_ms: float  # at that rate
    ratio: float  # median over steps of step time / that step's gemm bound


def gemm_flops(cfg: ModelConfig, batch: int) -> float:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    non_embedding = cfg.num_layers * per_layer  # norms' weights are not GEMM work
    return 2.0 * batch * (non_embedding + cfg.hidden_size * cfg.vocab_size)


def matmul_rate(batch: int, hidden: int, dtype: torch.dtype, seconds: float = 0.05) -> float:
    """FLOP/s of torch.mm([batch, hidden] x [hidden, 3 * hidden]) on this machine, now."""
    x, w = torch.randn(batch, hidden, dtype=dtype), torch.randn(hidden, 3 * hidden, dtype=dtype)
    torch.mm(x, w)
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(x, w)
        n += 1
    return 2.0 * batch * hidden * 3 * hidden * n / elapsed


def make_sequences(batch: int, context: int, vocab: int, blocks_per_seq: int, seed: int) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(batch):
        seq = Sequence(str(i), rng.integers(3, vocab, context).tolist(), SamplingParams(), i)
        seq.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(seq)
    return seqs


def step(runner: Runner, scheduled: list[tuple[Sequence, int]], q_tile: int) -> float:
    """One forward; each sequence that caught up appends its greedy token. Returns the forward's seconds."""
    batch = build_model_input(scheduled, BLOCK_SIZE, q_tile)
    start = time.perf_counter()
    logits = runner.forward(batch)
    elapsed = time.perf_counter() - start
    for (seq, n), token in zip(scheduled, logits.argmax(-1).tolist()):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)
    return elapsed


def measure(runtime: str, runner: Runner, seqs: list[Sequence], steps: int, q_tile: int, cfg: ModelConfig,
            dtype: torch.dtype) -> Row:
    per_step = max(1, PREFILL_TOKENS // len(seqs[0].prompt_token_ids))
    for i in range(0, len(seqs), per_step):
        step(runner, [(s, s.num_tokens) for s in seqs[i:i + per_step]], q_tile)
    times, rates = [], []
    for i in range(WARMUP_STEPS + steps):
        rate = matmul_rate(len(seqs), cfg.hidden_size, dtype)
        elapsed = step(runner, [(s, 1) for s in seqs], q_tile)
        if i >= WARMUP_STEPS:
            times.append(elapsed)
            rates.append(rate)
    b, flops = len(seqs), gemm_flops(cfg, len(seqs))
    median, rate = statistics.median(times), statistics.median(rates)
    ratio = statistics.median(t * r / flops for t, r in zip(times, rates))
    return Row(runtime, b, median * 1e3, min(times) * 1e3, b / median, rate / 1e9, flops / rate * 1e3, ratio)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="HF folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--runtimes", nargs="+", default=["torch", "onnxruntime"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads, and onnxruntime's intra-op threads (the runner follows torch)")
    p.add_argument("--output", type=Path, default=Path("results/bench_runners.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model)
    cfg = load_model_config(model_dir)
    dtype = torch_dtype(args.dtype)
    blocks_per_seq = cdiv(args.context + WARMUP_STEPS + args.steps + 1, BLOCK_SIZE)
    num_blocks = max(args.batch_sizes) * blocks_per_seq
    config = EngineConfig.create(model=str(model_dir), dtype=args.dtype, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                                 quantization="none")  # every runner on the float weights

    runners: dict[str, Runner] = {}
    unsupported: dict[str, str] = {}
    for runtime in args.runtimes:
        try:
            engine_dir = None
            if runtime == "onnxruntime":
                check_supported("cpu", args.dtype)  # before minutes of export
                engine_dir = str(cached_engine_dir(model_dir, args.dtype))
            runners[runtime] = create_runner(replace(config, runtime=runtime, engine_dir=engine_dir), num_blocks)
        except ValueError as e:  # e.g. onnxruntime's CPU provider has no bfloat16 kernels
            unsupported[runtime] = str(e)
    rows = [measure(runtime, runner, make_sequences(b, args.context, cfg.vocab_size, blocks_per_seq, seed=b),
                    args.steps, config.q_tile, cfg, dtype)
            for b in args.batch_sizes for runtime, runner in runners.items()]

    print(f"\n{model_dir.name} {args.dtype}, decode steps at ~{args.context} tokens of context, "
          f"{torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'runtime':>12} {'ms/step':>9} {'min ms':>8} {'tok/s':>8} {'GFLOP/s':>8} "
          f"{'bound ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r.batch:>5} {r.runtime:>12} {r.ms_per_step:>9.1f} {r.ms_min:>8.1f} {r.tokens_per_s:>8.1f} "
              f"{r.matmul_gflops:>8.1f} {r.gemm_bound_ms:>9.1f} {r.ratio:>6.2f}")
    for runtime, reason in unsupported.items():
        print(f"{runtime}: not run ({reason})")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "model": model_dir.name, "dtype": args.dtype, "context": args.context, "steps": args.steps,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "processor": platform.processor(),
        "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "gemm_flops_per_step": {b: gemm_flops(cfg, b) for b in args.batch_sizes},
        "results": [asdict(r) for r in rows], "unsupported": unsupported,
    }, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
