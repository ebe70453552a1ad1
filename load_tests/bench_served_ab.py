"""Two builds of the served llm in one tritonserver, requests alternating: is A faster than B, measured seconds apart.

On these 2-core VMs a server's speed drifts up to 1.3x within minutes, so two servers run one after the other cannot
tell a few percent apart. Here `llm` runs this tree (A) and `llm_b` a copy of it whose model.py imports `backend`
from --b-tree (B: a checkout of another commit, e.g. `git worktree add /tmp/b HEAD~3`), both on the same settings,
each in its own stub process, idle while the other serves. Each pair sends the same requests (--streams at once) to
both, the order alternating; a pair's ratios are A's ITL p50 over B's and A's tokens/s over B's, and the report is
each ratio's median over the pairs, with its quartiles.

    python -m load_tests.bench_served_ab --b-tree DIR [--model default|DIR] [--quantization auto] [--streams 1]
        [--pairs 16] [--max-tokens 128] [--threads 2] [--out results/served_ab]

Writes served_ab.json to --out. B's stub checks that its `backend` is --b-tree's (the model fails to load if not);
B's kernels come from this tree's kernel cache ($LLM_KERNEL_CACHE), built there once if its sources differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backend.engine.kernels.cpu_kernels import REPO_ROOT
from backend.triton.launcher import TritonServer
from client.client import LLMClient
from load_tests.bench_itl import add_pair_args, median_and_quartiles, pair_workload
from load_tests.bench_online import Item, ours_repository
from load_tests.machine import cpu_summary
from load_tests.streams import grpc_stream

B_MODEL = "llm_b"


def add_b_model(repo: Path, b_tree: Path) -> None:
    """`llm_b`: the repository's llm (same settings), whose stub imports `backend` from `b_tree`."""
    shutil.copytree(repo / "llm", repo / B_MODEL)
    config = repo / B_MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "llm"', f'name: "{B_MODEL}"', 1))
    model_py = repo / B_MODEL / "1" / "model.py"
    prelude = (f"import sys\nsys.path.insert(0, {str(b_tree)!r})\nimport backend\n"
               f"assert backend.__file__.startswith({str(b_tree) + os.sep!r}), backend.__file__\n")
    model_py.write_text(prelude + model_py.read_text())


def run_side(clients: list[LLMClient], item: Item) -> tuple[float, float]:
    """One request on each client at once: the ITL p50 over all of them (ms), and their tokens/s together."""
    with ThreadPoolExecutor(len(clients)) as pool:
        records = list(pool.map(lambda c: grpc_stream(c, item.text, item.max_tokens), clients))
    for r in records:
        if r.output_tokens != item.max_tokens:
            raise RuntimeError(f"{r.output_tokens} output tokens, wanted {item.max_tokens}")
    seconds = max(r.end for r in records) - min(r.start for r in records)
    itl_ms = 1000 * float(np.median([g for r in records for g in r.itls]))
    return itl_ms, sum(r.output_tokens for r in records) / seconds


def run_pairs(a: list[LLMClient], b: list[LLMClient], items: list[Item], count: int) -> list[dict[str, float]]:
    """`count` pairs, the order alternating; after one untimed request on each side."""
    warm = dataclasses.replace(items[0], max_tokens=8)
    run_side(a, warm), run_side(b, warm)
    pairs = []
    for k in range(count):
        item = items[k % len(items)]
        if k % 2:
            (b_itl, b_tps), (a_itl, a_tps) = run_side(b, item), run_side(a, item)
        else:
            (a_itl, a_tps), (b_itl, b_tps) = run_side(a, item), run_side(b, item)
        pairs.append({"a_itl_ms_p50": round(a_itl, 6), "b_itl_ms_p50": round(b_itl, 6), "a_tok_s": round(a_tps, 2),
                      "b_tok_s": round(b_tps, 2), "itl_a_over_b": round(a_itl / b_itl, 6),
                      "tok_s_a_over_b": round(a_tps / b_tps, 4)})
        print(f"  pair {k + 1} of {count}: ITL p50 A {a_itl:.2f} ms, B {b_itl:.2f} ms; A {a_tps:.1f} tok/s, "
              f"B {b_tps:.1f}", file=sys.stderr, flush=True)
    return pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b-tree", type=Path, required=True, help="a checkout whose `backend` B runs")
    p.add_argument("--streams", type=int, default=1, help="requests at once on each side")
    add_pair_args(p, pairs=16, out="results/served_ab")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    b_tree = args.b_tree.resolve()
    if not (b_tree / "backend" / "__init__.py").is_file():
        raise SystemExit(f"--b-tree: {b_tree} holds no backend package")
    os.environ.setdefault("LLM_KERNEL_CACHE", str(REPO_ROOT / ".cache" / "kernels"))
    model_dir, items, machine = pair_workload(args)
    print(f"{model_dir.name}, quantization {args.quantization}: A this tree, B {b_tree}; {args.pairs} pairs of "
          f"{args.streams} x {args.max_tokens}-token requests; {machine}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp_name:
        repo = ours_repository(Path(tmp_name), model_dir, {"quantization": args.quantization})
        add_b_model(repo, b_tree)
        with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0,
                          extra_args=["--disable-auto-complete-config"]) as server:
            a = [LLMClient(server.url_grpc, "llm") for _ in range(args.streams)]
            b = [LLMClient(server.url_grpc, B_MODEL) for _ in range(args.streams)]
            try:
                pairs = run_pairs(a, b, items, args.pairs)
            finally:
                for client in a + b:
                    client.close()
    itl, tps = (median_and_quartiles([p[key] for p in pairs]) for key in ("itl_a_over_b", "tok_s_a_over_b"))
    print(f"{model_dir.name} ({args.quantization}), {args.streams} streams, A over B, median of {len(pairs)} pairs: "
          f"ITL p50 {itl['median']:.3f} (quartiles {itl['q1']:.3f}-{itl['q3']:.3f}), tokens/s {tps['median']:.3f} "
          f"({tps['q1']:.3f}-{tps['q3']:.3f}); {cpu_summary()}")
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"model": str(model_dir), "quantization": args.quantization, "b_tree": str(b_tree),
            "streams": args.streams, "max_tokens": args.max_tokens, "threads": args.threads, "machine": machine,
            "pairs": pairs, "itl_a_over_b": itl, "tok_s_a_over_b": tps}
    (args.out / "served_ab.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
