"""The sampler alone at the vocabularies 1-8B models have (SmolLM2 49,152; Llama 3 128,256; Qwen3 151,936), against
the sampler it replaced, which is vLLM's CPU sampler's method: top-p by sorting each whole row, and the draw as an
exponential race (argmax of probs over one Exp(1) variate per token, seeded per row). Ours: top-p among the likeliest
256 / 4,096 tokens before any full sort, and one uniform a row drawn by inverse transform (sampling.py).

The step's forward runs before the sampler and waits for it, so a sampler's milliseconds add to every token of every
sampled stream (a 1B model's decode step at 16 rows: ~110 ms on a 2-core Xeon).

Logits: `zipf`, a next-token distribution's shape (the likeliest token's logit 1.1 ln(rank) above the rank-th, in a
random order), and `flat` (every logit ~N(0, 0.1): a random-weight model's, whose nucleus is most of the vocabulary,
the worst case for ours). Both samplers take the same logits, alternating, each the median of --repeats calls.

    python -m load_tests.bench_sampler [--vocabs 49152,128256,151936] [--rows 1,16,64] [--repeats 5] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backend.engine.kernels import cpu_kernels
from backend.engine.sampling import SamplerRow, SamplingParams, SamplingState, sample
from load_tests.machine import cpu_summary

CONFIGS = {  # name: (logits, params)
    "temperature 0.7": ("zipf", SamplingParams(temperature=0.7)),
    "top_p 0.9": ("zipf", SamplingParams(temperature=0.7, top_p=0.9)),
    "top_k 40, top_p 0.95": ("zipf", SamplingParams(temperature=0.7, top_k=40, top_p=0.95)),
    "top_p 0.9, flat logits": ("flat", SamplingParams(temperature=0.7, top_p=0.9)),
}


def logits_of(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(rows, vocab, generator=gen) * 0.1
    zipf = -1.1 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    return torch.stack([zipf[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def replaced(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """The replaced sampler: temperature, top-k (torch.topk), top-p by a full sort (where asked), the exponential
    race."""
    logits = logits / torch.tensor([p.temperature for p in params])[:, None]
    ks = [p.top_k for p in params]
    if any(ks):
        kth = torch.topk(logits, max(ks), dim=-1).values[:, max(ks) - 1:max(ks)]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    for j, g in enumerate(generators):
        noise[j].exponential_(generator=g)
    return cpu_kernels.argmax(probs / noise)  # the argmax kernel, as the replaced sampler called it


def timed(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default="49152,128256,151936")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/sampler.json"))
    args = parser.parse_args()
    cpu_kernels.load()  # as the engine's CPU runner does: the draw's kernel (kernels/draw.cpp) and the greedy argmax
    cpu = cpu_summary()
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads")
    print(f"{'vocab':>7} {'rows':>4}  {'config':24} {'ours ms':>8} {'replaced ms':>11} {'speedup':>7}")
    results, gen = [], torch.Generator().manual_seed(0)
    for vocab in map(int, args.vocabs.split(",")):
        for rows in map(int, args.rows.split(",")):
            for name, (kind, params) in CONFIGS.items():
                logits = logits_of(kind, rows, vocab, gen)
                sampler_rows = [SamplerRow(params, SamplingState(seed=i), [0], []) for i in range(rows)]
                generators = [torch.Generator().manual_seed(i) for i in range(rows)]
                ours_ms, replaced_ms = [], []
                for _ in range(2):  # alternating, each a median of repeats
                    ours_ms.append(1e3 * timed(lambda: sample(logits, sampler_rows), args.repeats))
                    replaced_ms.append(1e3 * timed(lambda: replaced(logits, [params] * rows, generators),
                                                   args.repeats))
                row = {"vocab": vocab, "rows": rows, "config": name, "ours_ms": round(min(ours_ms), 3),
                       "replaced_ms": round(min(replaced_ms), 3)}
                row["speedup"] = round(row["replaced_ms"] / row["ours_ms"], 2)
                results.append(row)
                print(f"{vocab:>7} {rows:>4}  {name:24} {row['ours_ms']:>8.2f} {row['replaced_ms']:>11.2f} "
                      f"{row['speedup']:>6.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
