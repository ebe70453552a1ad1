"""What a decode step costs as the context grows: the share of a step that reads the KV cache, and what the 8-bit KV
cache (`kv_cache_dtype: int8`, backend/engine/kv_quantization.py) saves of it.

For each weight format (float32 and the default model's GGUF as shipped), KV cache dtype and batch size, B sequences
of C-token random prompts are prefilled, then 8 decode steps are timed (median); the KV a step reads is B x C x
layers x 2 x kv_heads x its row's bytes (head_dim x 4 in float32, head_dim + 4 in int8). Prints ms per step and the
part of it above the shortest context's step, the CPU named; --plot draws ms per step against context, a line per
weight format, KV dtype and batch.

    python -m load_tests.bench_context [--contexts 128,512,1024,2048] [--batches 1,16] [--quantizations none,gguf]
        [--kv-cache-dtypes auto,int8] [--plot docs/context.png]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.kv_quantization import row_bytes
from backend.engine.runners.base import torch_dtype
from load_tests.bench_offline import resolve_model
from load_tests.machine import cpu_summary

DECODE_STEPS = 8


def decode_ms(engine: LLMEngine, batch: int, context: int, vocab: int, seed: int) -> float:
    """The median ms of a decode step of `batch` sequences that hold `context` tokens each."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=engine.max_model_len - context, ignore_eos=True)  # aborted below
    ids = [f"{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(100, vocab - 100, context).tolist(), params)
    engine.step()
    while engine.stats().last_step.decode_requests < batch:  # until a step decoded them all: every prompt is cached
        engine.step()
    times = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        assert engine.stats().last_step.decode_requests == batch
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return 1000 * statistics.median(times)


def plot(lines: dict[str, list[float]], contexts: list[int], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    colors: dict[str, str] = {}  # a color per weights and batch; the int8 KV's line dashed beside its float32 one
    for label, ms in lines.items():
        color = colors.setdefault(label.replace("int8 KV", "float32 KV"), f"C{len(colors)}")
        ax.plot(contexts, ms, marker="o", label=label, color=color, linestyle="--" if "int8 KV" in label else "-")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("ms per decode step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--contexts", default="128,512,1024,2048")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--quantizations", default="none,gguf")
    p.add_argument("--kv-cache-dtypes", default="auto,int8")
    p.add_argument("--plot", default=None, metavar="PNG")
    args = p.parse_args()
    model = resolve_model(None if args.model == "default" else args.model)
    contexts = list(map(int, args.contexts.split(",")))
    title = f"{cpu_summary()} | {model.name} | {DECODE_STEPS} decode steps timed, median"
    print(title)
    lines: dict[str, list[float]] = {}
    for quantization in args.quantizations.split(","):
        for kv_dtype in args.kv_cache_dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                blocks = batch * (max(contexts) + 256) // 16 + 16
                engine = LLMEngine(EngineConfig.create(
                    model=str(model), quantization=quantization, kv_cache_dtype=kv_dtype, max_num_seqs=batch,
                    num_kv_blocks=blocks, max_num_batched_tokens=2048, enable_prefix_caching=False))
                cfg = engine.model_config
                kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * row_bytes(cfg.head_dim, torch_dtype("float32"),
                                                                             kv_dtype)
                kv_name = "float32" if kv_dtype == "auto" else kv_dtype
                decode_ms(engine, batch, 32, cfg.vocab_size, seed=0)  # warm
                base = None
                for i, context in enumerate(contexts):
                    ms = decode_ms(engine, batch, context, cfg.vocab_size, seed=i + 1)
                    lines.setdefault(f"{'float32' if quantization == 'none' else quantization} weights, {kv_name} KV, "
                                     f"batch {batch}", []).append(ms)
                    base = base if base is not None else ms
                    print(f"{quantization:5} KV {kv_name:7} batch {batch:2} context {context:5}: {ms:7.1f} ms/step, "
                          f"KV read {batch * context * kv_bytes / 1e6:6.0f} MB, {100 * (ms - base) / ms:3.0f} % of "
                          f"the step above context {contexts[0]}", flush=True)
                del engine
    if args.plot:
        plot(lines, contexts, args.plot, title.replace(" | ", "\n", 1))


if __name__ == "__main__":
    main()
