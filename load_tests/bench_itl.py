"""One stream's inter-token latency served against the offline engine on the same machine (the serving overhead a
single user sees, where bench_online's burst measures it at saturation).

Each round runs, one after the other and alone on the CPU:
  served   tritonserver on model_repository's `llm` (its shipped settings, `--quantization` as given), one
           tritonclient gRPC stream at a time, greedy, EOS ignored: the gaps between consecutive responses that add
           tokens, as the client receives them
  offline  bench_offline's engine run (LLMEngine in a fresh process, the same settings, one stream:
           BENCH_STREAMS=1) on the same prompt ids: the gaps between a request's consecutive outputs of `step()`
and prints served/offline of the two medians. The rounds alternate (served, offline, served, ...): on a VM whose
speed drifts within minutes, a ratio is only taken within a round.

    python -m load_tests.bench_itl [--model default|DIR] [--quantization auto] [--requests 4] [--max-tokens 128]
        [--rounds 3] [--threads 2] [--out results/itl]

Writes itl.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from backend.serving.openmp_env import openmp_env
from load_tests.bench_offline import resolve_model, run_system
from load_tests.bench_online import Item, make_items, ours_repository, triton_system
from load_tests.machine import cpu_summary
from load_tests.workload import Request, save_workload


def served_gaps(repo: Path, items: list[Item], timeout: float) -> list[float]:
    """The client-side gaps between responses that add tokens, one request at a time, after one untimed one."""
    gaps: list[float] = []
    with triton_system(repo, "llm", timeout) as served:
        served.send(dataclasses.replace(items[0], max_tokens=8))
        for item in items:
            record = served.send(item)
            if record.output_tokens != item.max_tokens:
                raise RuntimeError(f"served: {record.output_tokens} output tokens, wanted {item.max_tokens}")
            gaps += record.itls
    return gaps


def offline_itl_ms(model_dir: Path, quantization: str, items: list[Item], tmp: Path) -> float:
    workload = tmp / "itl_workload.json"
    save_workload([Request(i.prompt_ids, i.max_tokens) for i in items], workload)
    result = run_system(f"engine@quantization={quantization}", model_dir, "float32", workload, None, wait_idle_s=0)
    if result.error is not None:
        raise RuntimeError(f"offline engine failed: {result.error.strip().splitlines()[-1]}")
    return result.extra["itl_ms_median"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (SmolLM2) or a model folder (HF, or with a GGUF)")
    p.add_argument("--quantization", default="auto", help="the llm's `quantization` setting, for both")
    p.add_argument("--requests", type=int, default=4, help="requests per system and round, one at a time")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/itl"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.update(openmp_env(dict(os.environ)))  # the server's OpenMP defaults, for the offline engine too
    os.environ["BENCH_STREAMS"] = "1"
    model_dir = resolve_model(None if args.model == "default" else args.model)
    items = [dataclasses.replace(i, max_tokens=args.max_tokens)
             for i in make_items(model_dir, args.requests, args.seed)]
    machine = f"{cpu_summary()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
    print(f"{model_dir.name}, quantization {args.quantization}: {args.requests} requests of {args.max_tokens} tokens "
          f"a round; {machine}", file=sys.stderr)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = ours_repository(tmp, model_dir, {"quantization": args.quantization})
        for k in range(args.rounds):
            print(f"round {k + 1} of {args.rounds}: served", file=sys.stderr, flush=True)
            gaps = served_gaps(repo, items, timeout=120.0)
            offline = offline_itl_ms(model_dir, args.quantization, items, tmp)
            served_p50, served_p99 = (float(v) for v in 1000 * np.percentile(gaps, [50, 99]))
            rounds.append({"served_itl_ms_p50": round(served_p50, 2), "served_itl_ms_p99": round(served_p99, 2),
                           "offline_itl_ms_p50": offline, "served_over_offline": round(served_p50 / offline, 3)})
            print(f"  served ITL p50 {served_p50:.2f} ms (p99 {served_p99:.2f}), offline {offline:.2f} ms: "
                  f"{served_p50 / offline:.3f}x", file=sys.stderr, flush=True)
    ratios = [r["served_over_offline"] for r in rounds]
    print(f"{model_dir.name} ({args.quantization}), one stream, served / offline ITL (p50): median "
          f"{statistics.median(ratios):.3f}, rounds {ratios}; {cpu_summary()}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"model": str(model_dir), "quantization": args.quantization, "requests": args.requests,
            "max_tokens": args.max_tokens, "threads": args.threads, "machine": machine, "rounds": rounds,
            "served_over_offline_median": statistics.median(ratios)}
    (args.out / "itl.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
