"""Speed at the sizes CPU users run (1-8B): our engine and llama.cpp on the same GGUF files, against the machine's own
limits measured in the same run.

Models: random weights of Llama-3.2-1B's and Qwen3-4B's shapes (and Llama-3-8B's; transformers' config classes),
converted and quantized by llama.cpp's own tools (load_tests/random_gguf.py: Q4_K_M, Q8_0), so both systems read one
file; ours serves it as stored (`quantization: gguf`). For each batch B and prompt length P: B prompts of P random
tokens prefilled (tok/s), then 32 decode steps of the B sequences (ms a step), timed apart; llama.cpp the same way
(load_tests/llamacpp_scale_runner.py).

The limits, measured here in the same run:
- DRAM read bandwidth: load_tests/read_bandwidth.c, 2 threads reading 1 GiB (past any last-level cache), built with
  this machine's gcc, before each system runs; the highest reading is the bound's (on a shared VM a neighbour's
  traffic takes a third of it in some minutes). A decode step's bound is the bytes it must read, every weight as the
  system holds it plus its KV cache (ours float32 unless `--kv-cache-dtype` says otherwise, llama.cpp's float16) at
  the step's context, over that bandwidth;
  each decode figure is printed as the bound's fraction of the step.
- The int8 GEMM rate: our q8_0_w8a8 kernel on a 4096 x 4096 weight at 512 rows (2 M N K ops a call), the rate the
  prefill's Linears could run at; each prefill figure is printed as its Linears' ops a second over that rate.

Rounds (`--rounds N`): on a shared 2-core VM the same run drifts by a quarter within minutes, so each file is measured
N times, the systems alternating and their order flipped each round; a row is each figure's median over the rounds,
and its ratio to ours the median of the ratios taken within a round (each round's kept in the JSON).

    python -m load_tests.bench_scale [--shapes llama-3.2-1b,qwen3-4b] [--ftypes Q4_K_M,Q8_0] [--batches 1,4,16]
        [--prompts 128,1024] [--steps 32] [--kv-cache-dtype auto] [--rounds 1] [--no-llamacpp]
        [--out results/scale.json]

bash load_tests/llama_cpp_env.sh first (llama.cpp, its converter and quantizer). `--shapes llama-3-8b`: Llama-3-8B's
shape, written a module at a time (~2 GiB of memory), but its 16 GB of bfloat16 safetensors and the converter's 16 GB
BF16 file are on disk at once (~33 GB free needed while it is made, once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from load_tests.bench_offline import LLAMACPP_PYTHON, REPO
from load_tests.machine import cpu_summary

DECODE_STEPS = 32
GEMM_SHAPE = (512, 4096, 4096)  # rows, out, in: the int8 rate's GEMM


@dataclasses.dataclass
class Point:
    """One (batch, prompt length) of one system on one file."""
    batch: int
    prompt_len: int
    prefill_s: float
    decode_step_s: float
    step_bytes: float  # what a decode step reads: weights + KV at the middle of the decode steps
    linear_ops_per_token: float  # 2 x the Linears' weights a prefill token passes (the lm_head only for the last)


def read_bandwidth(threads: int) -> float:
    """GB/s of load_tests/read_bandwidth.c, compiled here for this CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "read_bandwidth"
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", str(REPO / "load_tests" / "read_bandwidth.c"),
                        "-o", str(exe)], check=True)
        return float(subprocess.run([str(exe), str(threads)], check=True, capture_output=True,
                                    text=True).stdout)


def int8_gemm_rate(threads: int) -> float:
    """ops/s of q8_0_w8a8 at GEMM_SHAPE (best of 5)."""
    import torch

    from backend.engine.runners import gemm

    torch.set_num_threads(threads)
    m, n, k = GEMM_SHAPE
    run = gemm.TACTICS["q8_0_w8a8"].prepare(torch.randn(n, k) * 0.02, None)
    x = torch.randn(m, k)
    run(x)
    best = min(_seconds(lambda: run(x)) for _ in range(5))
    return 2 * m * n * k / best


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _tensors(obj, seen: dict[int, int]) -> None:
    """The bytes of every tensor a GEMM tactic holds (its packed weight, scales), by storage (oneDNN's opaque packed
    weight by object): in its dataclasses, partials and closures (a tactic's `prepare` may return a lambda over its
    packed tensors)."""
    import functools

    import torch

    if isinstance(obj, torch.Tensor) and obj.is_mkldnn:  # oneDNN's prepacked weight: an opaque tensor, no storage
        seen[id(obj)] = obj.numel() * obj.element_size()
    elif isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, functools.partial):
        for part in (*obj.args, *obj.keywords.values()):
            _tensors(part, seen)
    elif isinstance(obj, (list, tuple)):
        for part in obj:
            _tensors(part, seen)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), seen)
    elif getattr(obj, "__closure__", None):
        for cell in obj.__closure__:
            _tensors(cell.cell_contents, seen)


def engine_points(model_dir: Path, points: list[tuple[int, int]], steps: int, threads: int,
                  kv_cache_dtype: str) -> list[Point]:
    """Our engine (child process): each point's prefill and decode, as the module docstring says."""
    import numpy as np
    import torch
    from torch import nn

    from backend.engine import LLMEngine
    from backend.engine.kv_quantization import row_bytes
    from backend.engine.models.config import load_model_config
    from backend.engine.sampling import SamplingParams
    from backend.serving.settings import engine_config_from_settings

    torch.set_num_threads(threads)
    cfg = load_model_config(model_dir)
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * row_bytes(cfg.head_dim, torch.float32, kv_cache_dtype)
    # the first prompts done decode while the last are prefilled (continuous batching; at worst one prompt's chunk a
    # step): tokens enough for that, then `steps` steps of all B, and the requests cancelled
    budget = {(b, p): 1 + steps + b * -(-p // 512) + 8 for b, p in [(1, 16), *points]}
    tokens = max(b * (p + budget[b, p]) for b, p in budget)
    engine = LLMEngine(engine_config_from_settings({"model": str(model_dir), "quantization": "gguf",
                                                    "kv_cache_memory_gb": str(1.2 * tokens * kv_per_token / 2**30),
                                                    "kv_cache_dtype": kv_cache_dtype,
                                                    "max_model_len": str(max(p + n for (_, p), n in budget.items()))}))
    seen: dict[int, int] = {}
    linears = [m for m in engine.runner.model.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        _tensors(linear.gemm, seen)
    weight_bytes = sum(seen.values())
    head = engine.runner.model.lm_head
    layer_params = sum(m.in_features * m.out_features for m in linears if m is not head)
    rng = np.random.default_rng(0)
    out = []
    for batch, prompt_len in [(1, 16), *points]:  # the first: a warm-up, not reported
        ids = [f"{batch}x{prompt_len}.{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(rid, rng.integers(100, 32000, prompt_len).tolist(),
                               SamplingParams(max_tokens=budget[batch, prompt_len], ignore_eos=True))
        started, first = time.perf_counter(), set()
        while len(first) < batch:
            first.update(o.request_id for o in engine.step() if o.new_token_ids)
        prefill_s, steps_s = time.perf_counter() - started, []
        for _ in range(steps):
            start = time.perf_counter()
            rows = sum(1 for o in engine.step() if o.new_token_ids)
            steps_s.append(time.perf_counter() - start)
            if rows != batch:
                raise AssertionError(f"{batch}x{prompt_len}: a decode step gave {rows} tokens, not one per sequence")
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        kv = batch * (prompt_len + steps / 2) * kv_per_token
        out.append(Point(batch, prompt_len, prefill_s, statistics.median(steps_s), weight_bytes + kv,
                         2 * (layer_params + head.in_features * head.out_features / prompt_len)))
    return out[1:]


def llamacpp_points(gguf: Path, points: list[tuple[int, int]], steps: int, threads: int) -> list[Point]:
    """llama.cpp on the same file (its own venv); its step bytes from the file: every weight it reads (the embedding
    only where it is the tied lm_head) and its float16 KV."""
    import gguf as gguf_py

    if not LLAMACPP_PYTHON.exists():
        raise FileNotFoundError(f"{LLAMACPP_PYTHON} missing: run `bash load_tests/llama_cpp_env.sh` first")
    reader = gguf_py.GGUFReader(gguf)
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    weight_bytes = sum(int(t.n_bytes) for name, t in tensors.items() if name != "token_embd.weight" or tied)
    field = {f.name: f for f in reader.fields.values()}
    arch = bytes(field["general.architecture"].parts[-1]).decode()

    def value(key: str) -> int:
        return int(field[f"{arch}.{key}"].parts[-1][0])

    layers, kv_heads = value("block_count"), value("attention.head_count_kv")
    head_dim = (value("attention.key_length") if f"{arch}.attention.key_length" in field
                else value("embedding_length") // value("attention.head_count"))
    kv_per_token = layers * 2 * kv_heads * head_dim * 2  # float16
    head = tensors["output.weight" if not tied else "token_embd.weight"]
    head_params = int(head.n_elements)
    layer_params = sum(int(t.n_elements) for name, t in tensors.items()
                       if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([str(LLAMACPP_PYTHON), "-m", "load_tests.llamacpp_scale_runner", "--gguf", str(gguf),
                        "--points", json.dumps(points), "--steps", str(steps), "--threads", str(threads),
                        "--out", str(report)], cwd=REPO, check=True)
        data = json.loads(report.read_text())
    return [Point(p["batch"], p["prompt_len"], p["prefill_s"], p["decode_step_s"],
                  weight_bytes + p["batch"] * (p["prompt_len"] + steps / 2) * kv_per_token,
                  2 * (layer_params + head_params / p["prompt_len"])) for p in data["points"]]


def _in_child(fn, *args):
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def rows(system: str, file: str, points: list[Point], bandwidth: float, int8_rate: float) -> list[dict]:
    out = []
    for p in points:
        bound_s = p.step_bytes / (bandwidth * 1e9)
        prefill_tok_s = p.batch * p.prompt_len / p.prefill_s
        out.append({"system": system, "file": file, "batch": p.batch, "prompt_len": p.prompt_len,
                    "prefill_tok_s": round(prefill_tok_s, 1),
                    "prefill_of_int8_rate": round(prefill_tok_s * p.linear_ops_per_token / int8_rate, 3),
                    "decode_step_ms": round(1000 * p.decode_step_s, 2),
                    "decode_tok_s": round(p.batch / p.decode_step_s, 1),
                    "step_mb": round(p.step_bytes / 1e6, 1), "bound_ms": round(1000 * bound_s, 2),
                    "of_bound": round(bound_s / p.decode_step_s, 3)})
    return out


def _point(r: dict) -> tuple:
    return r["file"], r["batch"], r["prompt_len"]


def combine(per_round: list[dict]) -> list[dict]:
    """One row a (system, file, batch, prompt) from rows of every round (each with its "round"): each figure's median
    over the rounds, and ours / theirs the median of the ratios within a round (both systems ran side by side)."""
    ours = {(r["round"], *_point(r)): r for r in per_round if r["system"] == "engine"}
    groups: dict[tuple, list[dict]] = {}
    for r in per_round:
        o = ours[(r["round"], *_point(r))]
        groups.setdefault((r["system"], *_point(r)), []).append(
            {**r, "engine_x_decode": r["decode_step_ms"] / o["decode_step_ms"],  # ours / theirs, tok/s
             "engine_x_prefill": o["prefill_tok_s"] / r["prefill_tok_s"]})
    out = []
    for rs in groups.values():
        row = {k: rs[0][k] for k in ("system", "file", "batch", "prompt_len", "step_mb", "bound_ms")}
        for k, digits in (("prefill_tok_s", 1), ("prefill_of_int8_rate", 3), ("decode_step_ms", 2),
                          ("decode_tok_s", 1), ("of_bound", 3), ("engine_x_decode", 2), ("engine_x_prefill", 2)):
            row[k] = round(statistics.median(r[k] for r in rs), digits)
        row["decode_step_ms_rounds"] = [r["decode_step_ms"] for r in rs]
        row["engine_x_decode_rounds"] = [round(r["engine_x_decode"], 2) for r in rs]
        out.append(row)
    return out


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = sorted({r["file"] for r in results})
    fig, axes = plt.subplots(2, len(files), figsize=(max(4.5 * len(files), 8), 7), squeeze=False)
    for col, file in enumerate(files):
        for system, style in (("engine", "o-"), ("llamacpp", "s--")):
            for prompt_len in sorted({r["prompt_len"] for r in results}):
                pts = sorted((r["batch"], r["decode_tok_s"], r["of_bound"]) for r in results
                             if r["file"] == file and r["system"] == system and r["prompt_len"] == prompt_len)
                if pts:
                    label = f"{system}, prompt {prompt_len}"
                    axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
                    axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], style, label=label)
        axes[0][col].set_title(file, fontsize=9)
        axes[0][col].set_ylabel("decode tok/s")
        axes[1][col].set_ylabel("fraction of the DRAM bound")
        axes[1][col].set_ylim(0, 1.05)
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (sequences)")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from load_tests.random_gguf import random_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-3.2-1b,qwen3-4b")
    p.add_argument("--ftypes", default="Q4_K_M,Q8_0")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompts", default="128,1024")
    p.add_argument("--steps", type=int, default=DECODE_STEPS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", help="ours: auto (float32) | float16 (llama.cpp's) | int8")
    p.add_argument("--rounds", type=int, default=1, help="each file's systems this many times, alternating")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--out", type=Path, default=Path("results/scale.json"))
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    points = [(b, pl) for pl in map(int, args.prompts.split(",")) for b in map(int, args.batches.split(","))]
    cpu = cpu_summary()
    print(f"CPU: {cpu}, {args.threads} threads", flush=True)
    int8_rate = _in_child(int8_gemm_rate, args.threads)
    print(f"int8 GEMM (q8_0_w8a8, {'x'.join(map(str, GEMM_SHAPE))}): {int8_rate / 1e12:.2f} Tops/s", flush=True)
    measured, readings = [], []  # (round, system, file, points), and the bandwidth before each
    systems = ("engine", *(() if args.no_llamacpp else ("llamacpp",)))
    for shape in args.shapes.split(","):
        for ftype in args.ftypes.split(","):
            folder = random_gguf(shape, ftype)
            gguf = next(folder.glob("*.gguf"))
            for rnd in range(args.rounds):
                for system in systems if rnd % 2 == 0 else systems[::-1]:
                    readings.append(read_bandwidth(args.threads))
                    print(f"[{gguf.name}] round {rnd + 1}/{args.rounds}: {system} "
                          f"(DRAM read just before: {readings[-1]:.1f} GB/s)", flush=True)
                    measured.append((rnd, system, gguf.name,
                                     _in_child(engine_points, folder, points, args.steps, args.threads,
                                               args.kv_cache_dtype)
                                     if system == "engine" else llamacpp_points(gguf, points, args.steps, args.threads)))
    bandwidth = max(readings)
    print(f"DRAM read: {bandwidth:.1f} GB/s, the best of {len(readings)} readings ({min(readings):.1f} the lowest)")
    results = combine([{**r, "round": rnd} for rnd, system, file, pts in measured
                       for r in rows(system, file, pts, bandwidth, int8_rate)])
    header = ("system", "file", "batch", "prompt_len", "prefill_tok_s", "prefill_of_int8_rate", "decode_step_ms",
              "decode_tok_s", "step_mb", "bound_ms", "of_bound", "engine_x_decode", "engine_x_prefill")
    print("  ".join(f"{h:>12}" for h in header))
    for r in results:
        print("  ".join(f"{str(r[h]):>12}" for h in header))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "kv_cache_dtype": args.kv_cache_dtype,
                                    "rounds": args.rounds,
                                    "read_gb_s": bandwidth,
                                    "read_gb_s_readings": readings,
                                    "int8_ops_s": int8_rate, "steps": args.steps, "results": results}, indent=1))
    plot(results, args.out.with_suffix(".png"), f"{cpu}, {args.threads} threads; DRAM read {bandwidth:.0f} GB/s")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
