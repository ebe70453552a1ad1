"""The GPU path measured on the GPU at hand, against HF transformers on the same GPU in the same run.

Random-weight Llamas built on the GPU (nothing fetched, nothing written but each shape's config.json): tiny,
Llama-3.2-1B shapes, Llama-3-8B shapes. Per shape and dtype:
- greedy output of the engine (runners/cuda_runner.py) vs HF `generate`: equal, or the first divergence and
  whether each side's token is in the other's top 5 there (a near-tie); logprobs of the first step vs HF's.
Llama-3-8B shapes, bfloat16 (the issue's headline), also:
- decode step time at batch 1/8/32/64 x context 512/2048, with and without CUDA graphs, against the HBM bound
  (weights + KV bytes over the measured copy bandwidth), and HF `generate` per decode step on the same batch;
- the whole engine step (schedule, batch, forward, sample, update) per decode step, greedy and top-p;
- prefill tokens/s against the bf16 GEMM rate measured here;
- the elementwise ops: Triton kernels vs torch eager vs torch.compile (compile time included);
- `quantization: int8 | int4` (kernels/triton_linear.py): decode step time with CUDA graphs at batch 1/8/32/64 x
  context 512 against bfloat16 weights, each against the HBM bound of its own bytes, and prefill tokens/s.
Writes every figure to --out (JSON) and prints a table. Run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backend.engine import EngineConfig, LLMEngine, SamplingParams
from backend.engine.batch import build_model_input
from backend.engine.models.llama import PagedLlama, RMSNorm, TorchOps, TritonOps, load_model
from backend.engine.runners.cuda_runner import CudaRunner
from backend.engine.sequence import Sequence

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=32000, initializer_range=0.5),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 140)), [100] * 3, list(range(300, 317))]
NEW_TOKENS = 32
results: dict = {}


def log(*args) -> None:
    print(*args, flush=True)


def median_ms(fn, repeat: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() in ms; fn ends with a device-to-host copy (or is synchronized here)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 GEMM rate, measured once on random data."""
    x = torch.randn(2**30 // 2, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x), repeat=20)
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    gemm_ms = median_ms(lambda: a @ b, repeat=20)
    del x, y, a, b
    return {"gpu": torch.cuda.get_device_name(0), "copy_GBps": 2 * 2**30 / copy_ms / 1e6,
            "gemm_bf16_TFLOPs": 2 * 8192**3 / gemm_ms / 1e9, "torch": torch.__version__,
            "triton": __import__("triton").__version__}


def build(shape: str, dtype: torch.dtype, folder: Path) -> LlamaForCausalLM:
    cfg = LlamaConfig(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, **SHAPES[shape])
    cfg.save_pretrained(folder)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def engine_for(folder: Path, model: PagedLlama, dtype: str, num_blocks: int = 512, **settings) -> LLMEngine:
    settings = {"max_num_batched_tokens": 2048, **settings}
    config = EngineConfig.create(model=str(folder), device="cuda", dtype=dtype, num_kv_blocks=num_blocks, **settings)
    runner = CudaRunner(model, num_blocks, config.cache.block_size, config.scheduler.max_num_seqs,
                        cuda_graphs=config.cuda_graphs)
    return LLMEngine(config, runner=runner)


def engine_figures(folder: Path, model: PagedLlama, context: int = 512, new_tokens: int = 64) -> list[dict]:
    """The whole engine step (schedule, batch, forward, sample, update) per decode step, greedy and sampled."""
    out = []
    eng = engine_for(folder, model, "bfloat16", num_blocks=64 * (context + new_tokens) // 16 + 64, max_num_seqs=64,
                     max_num_batched_tokens=8192)
    sampled = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0, top_p=0.9)
    for B in (1, 8, 32, 64):
        for name, params in (("greedy", SamplingParams(max_tokens=new_tokens, ignore_eos=True)), ("top_p", sampled)):
            rng = np.random.default_rng(B)
            for i in range(B):
                eng.add_request(f"{name}-{B}-{i}", rng.integers(10, 1000, context).tolist(), params)
            times = []
            while eng.has_unfinished():
                t = time.perf_counter()
                eng.step()
                if eng.stats().last_step_tokens == eng.stats().num_running == B:  # a decode step of all B
                    times.append((time.perf_counter() - t) * 1e3)
            ms = statistics.median(times)
            out.append({"batch": B, "sampling": name, "engine_step_ms": ms, "tokens_per_s": B / ms * 1e3})
            log(f"  engine B={B} {name}: {ms:.2f} ms per decode step, {B / ms * 1e3:.0f} tok/s")
    return out


@torch.inference_mode()
def compare_with_hf(hf: LlamaForCausalLM, eng: LLMEngine) -> dict:
    refs = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    report = {"equal": [o == r for o, r in zip(outs, refs)], "first_divergence": [], "near_tie": [],
              "max_logprob_diff_step0": 0.0}
    for i, (p, o, r) in enumerate(zip(PROMPTS, outs, refs)):
        ours = _top5(eng, p)
        theirs = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
        report["max_logprob_diff_step0"] = max(report["max_logprob_diff_step0"],
                                               max(abs(lp - theirs[t].item()) for t, lp in ours))
        k = next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), None)
        report["first_divergence"].append(k)
        if k is not None:
            context = p + o[:k]
            hf_top = torch.topk(hf(torch.tensor([context], device="cuda")).logits[0, -1].float(), 5).indices.tolist()
            our_top = [t for t, _ in _top5(eng, context)]
            report["near_tie"].append(o[k] in hf_top and r[k] in our_top)
    return report


def _top5(eng: LLMEngine, prompt: list[int]) -> list[tuple[int, float]]:
    eng.add_request("top5", prompt, SamplingParams(max_tokens=1, top_logprobs=5))
    while True:
        for out in eng.step():
            if out.request_id == "top5" and out.new_top_logprobs:
                return out.new_top_logprobs[0]


def decode_batch(batch_size: int, context: int, block_size: int) -> object:
    seqs = []
    blocks_per_seq = -(-(context + 1) // block_size)
    for s in range(batch_size):
        seq = Sequence(f"b{s}", list(range(context + 1)), SamplingParams(), arrival_index=s)
        seq.block_ids = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        seq.num_computed_tokens = context
        seqs.append((seq, 1))
    return build_model_input(seqs, block_size, q_tile=16)


def weight_bytes(model: PagedLlama) -> int:
    """The bytes a decode step reads of the weights: the parameters but the embedding, and each quantized Linear's."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name) + \
        sum(getattr(m.gemm, "nbytes", 0) for m in model.modules() if isinstance(m, torch.nn.Linear))


@torch.inference_mode()
def decode_figures(model: PagedLlama, hf: LlamaForCausalLM | None, ceil: dict, kv_item: int) -> list[dict]:
    cfg = model.cfg
    block_size, batches, contexts = 16, (1, 8, 32, 64), (512, 2048)
    num_blocks = max(batches) * -(-(max(contexts) + 1) // block_size)
    rows = []
    if hf is not None:  # HF first: its cache and ours need not coexist
        for B in batches:
            for C in contexts:
                ids = torch.randint(10, 1000, (B, C), device="cuda")
                one = median_ms(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                                    pad_token_id=0), repeat=2, warmup=1)
                many = median_ms(lambda: hf.generate(ids, max_new_tokens=17, min_new_tokens=17, do_sample=False,
                                                     pad_token_id=0), repeat=2, warmup=0)
                rows.append({"batch": B, "context": C, "hf_ms": (many - one) / 16})
                log(f"  HF generate B={B} ctx={C}: {rows[-1]['hf_ms']:.2f} ms/step")
        torch.cuda.empty_cache()
    runner = CudaRunner(model, num_blocks, block_size, max(batches), max_model_len=max(contexts) + 64)
    runner.kv_cache.normal_()
    graphs = runner.graphs
    for B in batches:
        for C in contexts:
            batch = decode_batch(B, C, block_size)
            row = next((r for r in rows if r["batch"] == B and r["context"] == C), None)
            if row is None:
                rows.append(row := {"batch": B, "context": C})
            for name, g in (("graphs", graphs), ("eager", {})):
                runner.graphs = g
                row[f"{name}_ms"] = median_ms(lambda: runner.forward(batch).argmax(-1).tolist())
            kv = B * (C + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_item
            row["bound_ms"] = (weight_bytes(model) + kv) / (ceil["copy_GBps"] * 1e6)
            row["graphs_of_bound"] = row["bound_ms"] / row["graphs_ms"]
            row["eager_of_bound"] = row["bound_ms"] / row["eager_ms"]
            log(f"  ours B={B} ctx={C}: graphs {row['graphs_ms']:.2f} ms, eager {row['eager_ms']:.2f} ms, bound "
                f"{row['bound_ms']:.2f} ms ({100 * row['graphs_of_bound']:.0f} % with graphs)")
    runner.graphs = graphs
    results["prefill"] = prefill_figures(runner, ceil)
    return rows


def prefill_figures(runner: CudaRunner, ceil: dict) -> list[dict]:
    cfg = runner.model_config
    out = []
    linear = sum(m.in_features * m.out_features for name, m in runner.model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head")
    for S, n in ((1, 2048), (4, 2048), (16, 512)):
        seqs = []
        blocks = -(-n // 16)
        for s in range(S):
            seq = Sequence(f"p{s}", list(range(10, 10 + n)), SamplingParams(), arrival_index=s)
            seq.block_ids = list(range(s * blocks, (s + 1) * blocks))
            seqs.append((seq, n))
        batch = build_model_input(seqs, 16, q_tile=16)
        ms = median_ms(lambda: runner.forward(batch).argmax(-1).tolist(), repeat=5, warmup=2)
        flops = 2 * S * n * linear + 2 * S * cfg.vocab_size * cfg.hidden_size + \
            S * cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
        out.append({"seqs": S, "tokens_each": n, "ms": ms, "tokens_per_s": S * n / ms * 1e3,
                    "TFLOPs": flops / ms / 1e9, "of_gemm_peak": flops / ms / 1e9 / ceil["gemm_bf16_TFLOPs"]})
        log(f"  prefill {S} x {n}: {out[-1]['tokens_per_s']:.0f} tok/s, {out[-1]['TFLOPs']:.0f} TFLOP/s "
            f"({100 * out[-1]['of_gemm_peak']:.0f} % of the measured GEMM rate)")
    return out


@torch.inference_mode()
def elementwise_figures(cfg, dtype: torch.dtype) -> list[dict]:
    out = []
    H, KVH, D, hidden, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    norm = RMSNorm(hidden, 1e-5).cuda().to(dtype)
    for T in (64, 8192):
        x, delta = (torch.randn(T, hidden, dtype=dtype, device="cuda") for _ in range(2))
        qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=dtype, device="cuda")
        q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
        cos, sin = (torch.randn(T, D, dtype=dtype, device="cuda") for _ in range(2))
        gate_up = torch.randn(T, 2 * inter, dtype=dtype, device="cuda")

        def layer(ops):  # the elementwise work of one decoder layer
            ops.add_rms_norm(delta, x, norm)
            ops.rotary(q, k, cos, sin)
            ops.silu_mul(gate_up)
            ops.add_rms_norm(delta, x, norm)

        row = {"tokens": T, "triton_ms": median_ms(lambda: layer(TritonOps), 50),
               "torch_eager_ms": median_ms(lambda: layer(TorchOps), 50)}
        compiled = type("Compiled", (), {n: staticmethod(torch.compile(getattr(TorchOps, n), dynamic=False))
                                         for n in ("add_rms_norm", "rotary", "silu_mul")})
        t = time.perf_counter()
        layer(compiled)
        torch.cuda.synchronize()
        row["torch_compile_first_call_s"] = time.perf_counter() - t
        row["torch_compile_ms"] = median_ms(lambda: layer(compiled), 50)
        out.append(row)
        log(f"  elementwise, one layer, {T} tokens: triton {row['triton_ms']:.3f} ms, torch eager "
            f"{row['torch_eager_ms']:.3f} ms, torch.compile {row['torch_compile_ms']:.3f} ms "
            f"(compile {row['torch_compile_first_call_s']:.1f} s)")
    return out


@torch.inference_mode()
def quantized_figures(ceil: dict) -> list[dict]:
    folder = Path(tempfile.mkdtemp())
    hf = build("llama-3-8b", torch.bfloat16, folder)
    state = hf.state_dict()
    block_size, context, batches = 16, 512, (1, 8, 32, 64)
    num_blocks = max(batches) * -(-(context + 1) // block_size)
    rows = []
    for quantization in ("none", "int8", "int4"):
        model = load_model(folder, torch.bfloat16, "cuda", state=state)
        runner = CudaRunner(model, num_blocks, block_size, max(batches), max_model_len=context + 64,
                            quantization=quantization)
        runner.kv_cache.normal_()
        row = {"quantization": quantization, "weight_GB": weight_bytes(model) / 1e9}
        for B in batches:
            batch = decode_batch(B, context, block_size)
            ms = median_ms(lambda: runner.forward(batch).argmax(-1).tolist())
            kv = B * (context + 1) * model.cfg.num_layers * 2 * model.cfg.num_kv_heads * model.cfg.head_dim * 2
            bound = (weight_bytes(model) + kv) / (ceil["copy_GBps"] * 1e6)
            row[f"B{B}_ms"], row[f"B{B}_of_bound"] = ms, bound / ms
        log(f"  {quantization}: {row['weight_GB']:.2f} GB of weights; ms per decode step (graphs, context {context}): "
            + ", ".join(f"B={B} {row[f'B{B}_ms']:.2f} ({100 * row[f'B{B}_of_bound']:.0f} % of bound)" for B in batches))
        row["prefill"] = prefill_figures(runner, ceil)
        rows.append(row)
        del runner, model
        torch.cuda.empty_cache()
    return rows


def section(name: str, fn):
    log(f"== {name}")
    t = time.time()
    try:
        results[name] = fn()
    except Exception:
        traceback.print_exc()
        results[name] = {"error": traceback.format_exc(limit=3)}
    log(f"   ({time.time() - t:.0f} s)")


def correctness(shape: str, dtype_name: str) -> dict:
    folder = Path(tempfile.mkdtemp())
    hf = build(shape, DTYPES[dtype_name], folder)
    model = load_model(folder, DTYPES[dtype_name], "cuda", state=hf.state_dict())
    report = {}
    for graphs in (True, False):
        eng = engine_for(folder, model, dtype_name, cuda_graphs=graphs, max_num_seqs=8)
        report["graphs" if graphs else "eager"] = compare_with_hf(hf, eng)
        del eng
    log(f"  {shape} {dtype_name}: {report}")
    del hf, model
    torch.cuda.empty_cache()
    return report


def plot(figures: Path, png: Path) -> None:
    """The decode figures of a gpu_bench.json as a picture: ms per step against batch, one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(figures.read_text())
    rows = data["decode/llama-3-8b/bfloat16"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, context in zip(axes, (512, 2048)):
        mine = [r for r in rows if r["context"] == context]
        batches = [r["batch"] for r in mine]
        for key, label, style in (("hf_ms", "HF generate (static batch)", "s:"), ("eager_ms", "ours, eager", "o--"),
                                  ("graphs_ms", "ours, CUDA graphs", "o-"), ("bound_ms", "HBM bound", "k-")):
            ax.plot(batches, [r[key] for r in mine], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (sequences)")
        ax.set_title(f"context {context}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms per decode step")
    axes[0].legend(fontsize=8, loc="center right")
    fig.suptitle(f"Llama-3-8B shapes, bfloat16, {data['ceilings']['gpu']}: decode step time")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/gpu_bench.json")
    parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="draw a run's decode figures, run nothing")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="sections to skip: correctness decode quantized elementwise")
    parser.add_argument("--only-engine", action="store_true", help="the engine step figures alone (8B shapes)")
    args = parser.parse_args()
    if args.plot:
        return plot(Path(args.plot[0]), Path(args.plot[1]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    section("ceilings", ceilings)
    log(json.dumps(results["ceilings"]))
    if args.only_engine:
        folder = Path(tempfile.mkdtemp())
        hf = build("llama-3-8b", torch.bfloat16, folder)
        model = load_model(folder, torch.bfloat16, "cuda", state=hf.state_dict())
        del hf
        section("engine_decode", lambda: engine_figures(folder, model))
        out.write_text(json.dumps(results, indent=1))
        return
    if "correctness" not in args.skip:
        for shape, dtypes in (("tiny", ("float32", "bfloat16", "float16")), ("llama-3.2-1b", ("float32", "bfloat16")),
                              ("llama-3-8b", ("bfloat16",))):
            for d in dtypes:
                section(f"correctness/{shape}/{d}", lambda: correctness(shape, d))
                out.write_text(json.dumps(results, indent=1))
    if "decode" not in args.skip:
        def decode():
            folder = Path(tempfile.mkdtemp())
            hf = build("llama-3-8b", torch.bfloat16, folder)
            model = load_model(folder, torch.bfloat16, "cuda", state=hf.state_dict())
            rows = decode_figures(model, hf, results["ceilings"], 2)
            del hf
            torch.cuda.empty_cache()
            results["engine_decode"] = engine_figures(folder, model)
            return rows
        section("decode/llama-3-8b/bfloat16", decode)
        out.write_text(json.dumps(results, indent=1))
    if "quantized" not in args.skip:
        section("quantized/llama-3-8b/bfloat16", lambda: quantized_figures(results["ceilings"]))
        out.write_text(json.dumps(results, indent=1))
    if "elementwise" not in args.skip:
        folder = Path(tempfile.mkdtemp())
        LlamaConfig(**SHAPES["llama-3-8b"]).save_pretrained(folder)
        from backend.engine.models.config import load_model_config
        section("elementwise/llama-3-8b/bfloat16", lambda: elementwise_figures(load_model_config(folder), torch.bfloat16))
    out.write_text(json.dumps(results, indent=1))
    log(f"figures in {out}")


if __name__ == "__main__":
    main()
