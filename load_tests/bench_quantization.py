"""What `quantization` (int8, int4, gguf) costs in quality and gives in GEMM speed, next to float32, on one model
(SmolLM2 by default: its float32 weights are its shipped Q4_1 GGUF dequantized), named CPU.

Quality, each quantized tactic forced (backend/engine/runners/gemm.py; int4's Q8_0 lm_head picks its own) and
`gguf` (the model folder's file as stored), teacher-forced in one prefill per text:
- perplexity on a fixed text every Python install ships (its LICENSE.txt, first `--tokens` tokens);
- top-1 agreement with float32 over float32's own greedy outputs of fixed prompts (8 prompts x 64 tokens), and the
  largest |logit difference| there.
The same for the ONNX Runtime runner's int8 and int4 graphs (exported once into .cache/engines/), and for the 8-bit KV
cache (`kv_cache_dtype: int8`) under float32 weights (kv_int8) and under the GGUF (gguf_kv_int8); `llamacpp`:
perplexity and top-1 agreement of llama.cpp on the model folder's GGUF, the same token ids (.venv-llamacpp, from
load_tests/llama_cpp_env.sh; by default only where that venv exists); each `--checkpoint`, a quantized checkpoint
of the model (load_tests/compressed_checkpoint.py), served as stored.
Speed: SmolLM2's 30 layers of Linear shapes, one pass per token count (1, 16, 64); their weights (106 MB in int8,
60 MB in int4) do not fit in the caches, so each pass streams them from DRAM as a decode step does: float32 oneDNN
prepacked vs each quantized tactic.

    python -m load_tests.bench_quantization [--model DIR] [--tokens 1024] [--runs gguf,kv_int8,...]
        [--checkpoint DIR ...] [--out results/quantization.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from load_tests.bench_offline import LLAMACPP_PYTHON
from load_tests.machine import cpu_summary

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The history of the printing press", "def fibonacci(n):", "Explain photosynthesis to a child.",
           "List three uses of copper.", "The capital of France is", "Once upon a time, in a quiet village,",
           "SELECT name FROM users WHERE", "Water boils at"]
GREEDY_TOKENS = 64
TOKEN_COUNTS = (1, 16, 64)


def fixed_text() -> str:
    return (Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" /
            "LICENSE.txt").read_text()


def all_logits(runner, tokens: list[int]) -> torch.Tensor:
    from backend.engine.batch import build_model_input
    from backend.engine.kv_cache import KVCacheManager
    from backend.engine.sampling import SamplingParams
    from backend.engine.sequence import Sequence

    kv = KVCacheManager(runner.num_blocks, 16, enable_prefix_caching=False)
    seq = Sequence("0", tokens, SamplingParams(), 0)
    assert kv.allocate(seq, len(tokens))
    return runner.forward(build_model_input([(seq, len(tokens))], 16, 64, [len(tokens)]))


def quantized_tactics() -> list[str]:
    """The quantized tactics that run on this CPU (q8_0_w8a8 needs AVX512-VNNI)."""
    from backend.engine.runners import gemm

    return [n for n, t in gemm.TACTICS.items() if t.quantization != "none" and not gemm.why_not(n, torch.float32)]


def onnx_runner(model: Path, dtype: str, blocks: int, block_size: int, quantization: str):
    from backend.engine.runners.onnx_runner import OnnxRunner
    from build_engine.export_onnx import cached_engine_dir

    return OnnxRunner(cached_engine_dir(model, dtype, quantization), model, dtype, blocks, block_size,
                      quantization=quantization)


def quality(model: Path, max_tokens: int, only: set[str] | None = None, checkpoints: tuple[Path, ...] = ()
            ) -> dict[str, dict[str, float]]:
    from backend.engine import EngineConfig, LLMEngine
    from backend.engine.runners import gemm
    from backend.engine.runners.torch_runner import TorchRunner
    from backend.engine.sampling import SamplingParams
    from backend.serving.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(model)
    text = tokenizer(fixed_text())["input_ids"][:max_tokens]
    prompts = [encode(tokenizer, p, tokenizer.chat_template is not None) for p in PROMPTS]  # a base model: raw text
    greedy = LLMEngine(EngineConfig.create(model=str(model), quantization="none")).generate(  # the float reference
        prompts, SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True))
    blocks = 2 * (max_tokens + 16 * GREEDY_TOKENS) // 16

    def measure(runner) -> dict[str, object]:
        logits = all_logits(runner, text)
        nll = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(text[1:])[:, None]).mean()
        outs = [all_logits(runner, p + g)[len(p) - 1:-1] for p, g in zip(prompts, greedy)]
        return {"perplexity": float(nll.exp()), "logits": outs}

    reference = measure(TorchRunner(model, "float32", blocks, 16, gemm_backend="onednn"))
    report = {"float32": {"perplexity": round(reference["perplexity"], 4)}}
    runs = {name: functools.partial(TorchRunner, gemm_backend=name, quantization=gemm.TACTICS[name].quantization)
            for name in quantized_tactics()}
    runs["gguf"] = functools.partial(TorchRunner, quantization="gguf")
    runs["kv_int8"] = functools.partial(TorchRunner, kv_cache_dtype="int8")
    runs["gguf_kv_int8"] = functools.partial(TorchRunner, quantization="gguf", kv_cache_dtype="int8")
    for q in ("int8", "int4"):  # the exported graph's MatMulNBits (build_engine/quantize_onnx.py)
        runs[f"onnxruntime_{q}"] = functools.partial(onnx_runner, quantization=q)
    for folder in checkpoints:  # a quantized checkpoint of the model, served as stored (its config.json says how)
        runs[folder.name] = functools.partial(lambda folder, _model, *args: TorchRunner(folder, *args), folder)
    if only and (unknown := only - set(runs) - {"llamacpp"}):
        raise SystemExit(f"--runs: no run named {sorted(unknown)} (known: {sorted([*runs, 'llamacpp'])})")
    for tactic, runner in runs.items():
        if only and tactic not in only:
            continue
        got = measure(runner(model, "float32", blocks, 16))
        agree = [float((q.argmax(-1) == torch.tensor(g)).float().mean()) for q, g in zip(got["logits"], greedy)]
        error = max(float((q - r).abs().max()) for q, r in zip(got["logits"], reference["logits"]))
        report[tactic] = {"perplexity": round(got["perplexity"], 4), "top1_agreement": round(statistics.fmean(agree), 4),
                          "max_abs_logit_error": round(error, 3)}
        print(f"  {tactic}: {report[tactic]}", flush=True)
    if "llamacpp" in (only or ()) or (not only and LLAMACPP_PYTHON.exists()):
        report["llamacpp"] = llamacpp_quality(model, text, prompts, greedy)
        print(f"  llamacpp: {report['llamacpp']}", flush=True)
    return report


def llamacpp_quality(model: Path, text: list[int], prompts: list[list[int]], greedy: list[list[int]]) -> dict:
    """llama.cpp on the folder's GGUF, teacher-forced on the same ids (load_tests/llamacpp_quality.py)."""
    from backend.engine.models.gguf_weights import gguf_file

    if not LLAMACPP_PYTHON.exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} missing: run `bash load_tests/llama_cpp_env.sh` first")
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": str(gguf_file(model)), "threads": torch.get_num_threads(), "text": text,
                                   "sequences": [p + g for p, g in zip(prompts, greedy)],
                                   "starts": [len(p) for p in prompts]}))
        subprocess.run([str(LLAMACPP_PYTHON), "-m", "load_tests.llamacpp_quality", "--job", str(job), "--out",
                        str(out)], cwd=REPO, check=True)
        got = json.loads(out.read_text())
    agree = [statistics.fmean(a == b for a, b in zip(picks, g)) for picks, g in zip(got["argmax"], greedy)]
    return {"perplexity": round(got["perplexity"], 4), "top1_agreement": round(statistics.fmean(agree), 4),
            "llama_cpp": got["llama_cpp"]}


def gemm_speed(layers: int = 30) -> dict[str, dict[int, float]]:
    """ms per pass over `layers` layers of SmolLM2's Linear shapes, weights in as many copies as keep them past the
    caches (each pass reads its weights from DRAM, as a decode step does)."""
    from backend.engine.runners import gemm

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    result: dict[str, dict[int, float]] = {}
    for name in ("onednn", *quantized_tactics()):
        g = torch.Generator().manual_seed(0)
        gemms = [[gemm.TACTICS[name].prepare(torch.randn(n, k, generator=g) * 0.02, None) for n, k in shapes]
                 for _ in range(layers)]
        result[name] = {}
        for m in TOKEN_COUNTS:
            xs = {k: torch.randn(m, k) for _, k in shapes}
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for layer in gemms:
                    for run, (_, k) in zip(layer, shapes):
                        run(xs[k])
                times.append(time.perf_counter() - start)
            result[name][m] = round(1000 * statistics.median(times[1:]), 2)
        print(f"  {name}: ms per pass at {TOKEN_COUNTS} tokens: {list(result[name].values())}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / ".cache" / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", default=None, help="comma-separated quality runs (default: all)")
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="a quantized checkpoint of --model (load_tests/compressed_checkpoint.py): a run named for it")
    p.add_argument("--out", type=Path, default=Path("results/quantization.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_summary()} | {args.threads} threads | {args.model.name}", flush=True)
    print("quality (teacher-forced):", flush=True)
    report = {"cpu": cpu_summary(), "threads": args.threads, "model": args.model.name,
              "quality": quality(args.model, args.tokens, set(args.runs.split(",")) if args.runs else None,
                                 tuple(args.checkpoint))}
    print("GEMM speed (30 layers of SmolLM2's Linear shapes):", flush=True)
    report["gemm_ms"] = speed = gemm_speed()
    for name, row in speed.items():
        print(f"  {name:<10} " + "  ".join(f"{m} tok: {ms:7.2f} ms ({speed['onednn'][m] / ms:.2f}x float32)"
                                            for m, ms in row.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
