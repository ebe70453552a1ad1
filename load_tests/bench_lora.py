"""What serving LoRA adapters costs: offline greedy tok/s of one batch whose requests spread over 0, 1, 4 and 16
distinct adapters, against the base model alone, in one run; and the time to load an adapter.

Seeded random PEFT adapters (load_tests/lora_adapters.py) of `--rank` on all seven Linears of every layer, written
once to a temporary folder. Every configuration runs the same prompts (the benchmarks' seeded random ones) as one
batch of `--batch` requests, request i on adapter i mod N, `--tokens` new tokens, EOS ignored; each once warm, then
`--repeats` rounds of every configuration in turn, the median kept. "base" is an engine without adapters; the others one engine with all of them
loaded (0: loaded, none used). Prints tok/s and the ratio to base; the CPU named.

    python -m load_tests.bench_lora [--model default|DIR] [--rank 16] [--batch 32] [--tokens 64] [--adapters 0,1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from load_tests.bench_offline import resolve_model
from load_tests.lora_adapters import make_adapter
from load_tests.machine import cpu_summary
from load_tests.workload import make_workload, model_vocab


def timed(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> float:
    """tok/s of one batch: request i runs adapters[i]."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt, lora in zip(ids, prompts, adapters):
        engine.add_request(rid, prompt, params, lora_name=lora)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--adapters", default="0,1,4,16", help="numbers of distinct adapters in the batch")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = resolve_model(None if args.model == "default" else args.model)
    counts = list(map(int, args.adapters.split(",")))
    vocab, special = model_vocab(model)
    prompts = [r.prompt_token_ids for r in make_workload(args.batch, prompt_len=(64, 128), vocab_size=vocab, seed=0,
                                                          exclude_ids=special)]
    print(f"{cpu_summary()} | {model.name} | float32, batch {args.batch}, {args.tokens} new tokens, adapters of rank "
          f"{args.rank} on all seven Linears", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        n = max(counts)
        started = time.perf_counter()
        folders = {f"lora{i}": str(make_adapter(model, Path(tmp) / f"lora{i}", args.rank, seed=i)) for i in range(n)}
        print(f"{n} adapters written in {time.perf_counter() - started:.1f} s", flush=True)
        # no prefix caching: every repeat computes its prompts, as the first did
        base = LLMEngine(EngineConfig.create(model=str(model), enable_prefix_caching=False))
        loras = LLMEngine(EngineConfig.create(model=str(model), enable_prefix_caching=False, max_loras=max(n, 1),
                                              max_lora_rank=args.rank))
        loads = []
        for name, folder in folders.items():
            started = time.perf_counter()
            loras.load_lora(name, folder)
            loads.append(time.perf_counter() - started)
        if loads:
            print(f"load_lora: median {1e3 * statistics.median(loads):.1f} ms (min {1e3 * min(loads):.1f}, max "
                  f"{1e3 * max(loads):.1f}) per adapter", flush=True)
        runs = [("base", base, [None] * args.batch)]
        runs += [(f"{k} adapters", loras, [f"lora{i % k}" if k else None for i in range(args.batch)]) for k in counts]
        for _, engine, adapters in runs:
            timed(engine, prompts[:4], adapters[:4], 8)  # warm
        # the configurations in turn, `repeats` rounds: a drift of the machine touches them all alike
        rates = {label: [] for label, _, _ in runs}
        for _ in range(args.repeats):
            for label, engine, adapters in runs:
                rates[label].append(timed(engine, prompts, adapters, args.tokens))
                assert engine.kv.num_used_blocks == 0
        base_tps = statistics.median(rates["base"])
        for label, values in rates.items():
            tps = statistics.median(values)
            print(f"{label:12} {tps:7.1f} tok/s ({tps / base_tps:.2f}x base; runs {', '.join(f'{v:.1f}' for v in values)})",
                  flush=True)


if __name__ == "__main__":
    main()
