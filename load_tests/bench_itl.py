"""One stream's inter-token latency served against the offline engine on the same machine (the serving overhead a
single user sees, where bench_online's burst measures it at saturation).

One tritonserver on model_repository's `llm` (its shipped settings, `--quantization` as given) and the offline
engine (LLMEngine in this process, the same settings) take the same requests in pairs, one after the other and
alone on the CPU, the pair's order alternating:
  served   one stream, greedy, EOS ignored: the gaps between consecutive responses that add tokens, as the client
           receives them; over tritonclient's gRPC stream (--protocol grpc, as `python -m client`) or Triton's HTTP
           generate_stream (--protocol http: server-sent events, read by `requests`, whose client takes less CPU
           beside the server on the same cores)
  offline  the gaps between the request's consecutive outputs of `step()`
Each pair's ratio is its served median gap over its offline one; the report is the median of the pairs' ratios. On
a VM whose speed drifts within a minute (1.3x seen on these 2-core machines), only a ratio taken seconds apart
means anything: rounds of a whole server run against a whole offline run read 1.03-1.30x within ten minutes.

    python -m load_tests.bench_itl [--model default|DIR] [--quantization auto] [--protocol grpc|http] [--requests 4]
        [--max-tokens 128] [--pairs 12] [--threads 2] [--out results/itl]

Writes itl.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from backend.engine import LLMEngine
from backend.engine.sampling import SamplingParams
from backend.serving.openmp_env import openmp_env
from backend.serving.settings import engine_config_from_settings
from backend.triton.repository import string_parameters
from load_tests.bench_offline import resolve_model
from load_tests.bench_online import Item, System, make_items, ours_repository, triton_system
from load_tests.machine import cpu_summary

_ids = itertools.count()


def served_gaps(served: System, item: Item) -> list[float]:
    """The client-side gaps between the responses that add tokens."""
    record = served.send(item)
    if record.output_tokens != item.max_tokens:
        raise RuntimeError(f"served: {record.output_tokens} output tokens, wanted {item.max_tokens}")
    return record.itls


def offline_gaps(engine: LLMEngine, item: Item) -> list[float]:
    """The gaps between the request's consecutive outputs of `step()`, as bench_offline times them."""
    engine.add_request(f"r{next(_ids)}", item.prompt_ids, SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
    gaps, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def run_pairs(served: System, engine: LLMEngine, items: list[Item], count: int) -> list[dict[str, float]]:
    """`count` pairs of the same request, served and offline, the order alternating; after one untimed pair."""
    pairs = []
    warm = dataclasses.replace(items[0], max_tokens=8)
    served_gaps(served, warm), offline_gaps(engine, warm)
    for k in range(count):
        item = items[k % len(items)]
        if k % 2:
            offline, gaps = offline_gaps(engine, item), served_gaps(served, item)
        else:
            gaps, offline = served_gaps(served, item), offline_gaps(engine, item)
        s50, s99 = (float(v) for v in 1000 * np.percentile(gaps, [50, 99]))
        o50 = 1000 * statistics.median(offline)
        threads = engine.stats().cpu_threads  # fewer than --threads: it saw another process (cpu_share.py)
        pairs.append({"served_itl_ms_p50": round(s50, 3), "served_itl_ms_p99": round(s99, 3),
                      "offline_itl_ms_p50": round(o50, 3), "offline_threads": threads,
                      "served_over_offline": round(s50 / o50, 4)})
        print(f"  pair {k + 1} of {count}: served ITL p50 {s50:.2f} ms (p99 {s99:.2f}), offline {o50:.2f} "
              f"ms on {threads} threads: {s50 / o50:.3f}x", file=sys.stderr, flush=True)
    return pairs


def add_pair_args(p: argparse.ArgumentParser, pairs: int, out: str) -> None:
    """The options of a benchmark that runs requests in pairs (this one, bench_served_ab)."""
    p.add_argument("--model", default="default", help="'default' (SmolLM2) or a model folder (HF, or with a GGUF)")
    p.add_argument("--quantization", default="auto", help="the llm's `quantization` setting, for both")
    p.add_argument("--requests", type=int, default=4, help="distinct prompts, taken in turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=pairs)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(out))


def median_and_quartiles(values: list[float]) -> dict[str, float]:
    q1, q3 = (float(v) for v in np.percentile(values, [25, 75]))
    return {"median": round(statistics.median(values), 4), "q1": round(q1, 4), "q3": round(q3, 4)}


def pair_workload(args: argparse.Namespace) -> tuple[Path, list[Item], str]:
    """From add_pair_args' options: the OpenMP environment both sides start with, the model folder, the requests and
    the machine's description."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.update(openmp_env(dict(os.environ)))  # the server's OpenMP defaults, for an engine in this process too
    model_dir = resolve_model(None if args.model == "default" else args.model)
    items = [dataclasses.replace(i, max_tokens=args.max_tokens)
             for i in make_items(model_dir, args.requests, args.seed)]
    machine = f"{cpu_summary()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
    return model_dir, items, machine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p, pairs=12, out="results/itl")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"], help="the served client's stream")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir, items, machine = pair_workload(args)
    print(f"{model_dir.name}, quantization {args.quantization}: {args.pairs} pairs of {args.max_tokens}-token "
          f"requests, served over {args.protocol}; {machine}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp_name:
        repo = ours_repository(Path(tmp_name), model_dir, {"quantization": args.quantization})
        engine = LLMEngine(engine_config_from_settings(string_parameters((repo / "llm" / "config.pbtxt").read_text())))
        with triton_system(repo, "llm", timeout=120.0, protocol=args.protocol) as served:
            pairs = run_pairs(served, engine, items, args.pairs)
    ratio = median_and_quartiles([p["served_over_offline"] for p in pairs])
    print(f"{model_dir.name} ({args.quantization}), one {args.protocol} stream, served / offline ITL (p50): median of "
          f"{len(pairs)} pairs {ratio['median']:.3f} (quartiles {ratio['q1']:.3f}-{ratio['q3']:.3f}); {cpu_summary()}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"model": str(model_dir), "quantization": args.quantization, "protocol": args.protocol,
            "requests": args.requests, "max_tokens": args.max_tokens, "threads": args.threads, "machine": machine,
            "pairs": pairs, "served_over_offline": ratio}
    (args.out / "itl.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
