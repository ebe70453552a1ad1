"""Offline throughput benchmark: our engine against HF transformers and vLLM on one workload.

Systems, each run in a fresh child process (so peak RSS and thread pools are its own):
  engine     our LLMEngine, driven through add_request/step
  engine_int8, engine_int4, engine_gguf  the same with `quantization` set (engine_onnxruntime: the exported graph
             on ONNX Runtime; engine_onnxruntime_int8 / _int4: its Linears as MatMulNBits)
  engine@K=V+K=V  any engine system with engine settings changed by name, e.g. engine@gemm_backend=onednn
  hf_static  HF `generate` on static, left-padded batches of 8 (the picture before continuous batching)
  hf_cb      HF's own continuous batching manager, each request with its own max_new_tokens
  vllm       vLLM's CPU build in its own venv (.venv-vllm, made by load_tests/vllm_env.sh), with --vllm
  llamacpp   llama.cpp on the model folder's GGUF file, continuous batching over --streams slots as llama-server
             does (.venv-llamacpp, made by load_tests/llama_cpp_env.sh), with --llamacpp

--streams N submits the requests in N closed-loop streams (a stream's next request when its last one finishes;
engine systems and llamacpp), else all at once. Time to first token is from a request's submission.
Every request ignores EOS and must come back with exactly its max_tokens output ids. Only the
generation is timed: model load and a two-request warm-up run before the clock starts. On a
shared machine other processes steal the CPU: the table shows the process tree's CPU use
(`cpu util`, 1.0 = all threads busy) and the load average, and --wait-idle waits for a quiet CPU.
On a busy box, --omp-passive makes OpenMP threads sleep at barriers instead of spinning: a spinning
thread whose partner was descheduled burns its slice, which made 2-thread runs 10-50x slower here.

    python -m load_tests.bench_offline [--model DIR|random56m] [--dtype float32|bfloat16|both]
        [--systems engine,engine@gemm_backend=onednn,hf_static,hf_cb] [--vllm] [--llamacpp] [--streams N] [--num-requests 64] [--threads 2]
        [--rss-check] [--wait-idle SECONDS] [--omp-passive] [--rounds N] [--out results/offline.json]

--rounds N runs every system N times, alternating (engine, vllm, engine, vllm, ...), and prints each ratio's
median over the rounds and every round's: on a VM whose speed drifts by a quarter within minutes, one run of
each system decides nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TypeVar

from load_tests.machine import cpu_summary
from load_tests.workload import Request, load_workload, make_workload, model_vocab, save_workload

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / ".cache" / "models"
RANDOM56M = "random56m"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LLAMACPP_PYTHON = REPO / os.environ.get("LLAMACPP_VENV", ".venv-llamacpp") / "bin" / "python"  # llama_cpp_env.sh
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"  # `make dynamo-venv`
DTYPES = ("float32", "bfloat16")
QUANTIZED = ("int8", "int4", "gguf")
ONNX_QUANTIZED = ("int8", "int4")
ENGINES = ("engine", "engine_onnxruntime", *(f"engine_{q}" for q in QUANTIZED),
           *(f"engine_onnxruntime_{q}" for q in ONNX_QUANTIZED))
SYSTEMS = (*ENGINES, "hf_static", "hf_cb", "vllm", "llamacpp")
STREAMING = (*ENGINES, "llamacpp")  # take --streams
BASELINES = ("engine", "hf_cb", "vllm", "llamacpp")  # the table shows each system's ratio to these
STATIC_BATCH = 8
RSS_CHECK_REQUESTS = 1000
RSS_CHECK_WAVES = 10
RSS_CHECK_PROMPT_LEN = (16, 64)  # short requests keep 1,000 of them to minutes
RSS_CHECK_OUTPUT_LEN = (4, 16)
HF_CB_MAX_BATCH_TOKENS = 512  # tokens per step, as our engine's default max_num_batched_tokens
HF_CB_PAGE_SIZE = 256  # HF's default page size

Outputs = list[list[int]]
Generate = Callable[[list[Request], "Progress"], Outputs]


@dataclass
class SystemResult:
    """One system's run on the workload in one dtype."""

    system: str
    dtype: str
    num_requests: int
    output_tokens: int = 0
    wall_s: float = 0.0
    output_tok_s: float = 0.0
    peak_rss_mib: float = 0.0
    cpu_util: float = 0.0
    loadavg_1m: tuple[float, float] = (0.0, 0.0)
    extra: dict = field(default_factory=dict)
    error: str | None = None
    round: int = 0  # of --rounds


class Progress:
    """Requests done / total on stderr, redrawn in place at most twice a second."""

    def __init__(self, label: str, total: int, quiet: bool = False):
        self.label, self.total, self.quiet = label, total, quiet
        self.done = 0
        self._start = self._shown = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.quiet and (now - self._shown >= 0.5 or self.done >= self.total):
            self._shown = now
            end = "\n" if self.done >= self.total else ""
            print(f"\r  {self.label}: {self.done}/{self.total} requests, {now - self._start:.1f}s",
                  end=end, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- measuring


def _process_tree() -> list:
    """This process and its live descendants (vLLM runs its engine in child processes)."""
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def peak_rss_mib() -> float:
    """Peak RSS of this process (getrusage) plus the peaks (VmHWM) of its live descendants."""
    total_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for proc in _process_tree()[1:]:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        total_kib += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return total_kib / 1024


def current_rss_mib() -> float:
    """This process's resident set size now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_seconds() -> float:
    """User + system CPU time used so far by this process tree."""
    return sum(sum(proc.cpu_times()[:2]) for proc in _process_tree())


def warmup_requests(requests: list[Request]) -> list[Request]:
    """Two short requests that touch the prefill and decode paths before the clock starts."""
    return [Request(r.prompt_token_ids, max_tokens=4) for r in requests[:2]]


@dataclass
class Timing:
    """One timed generation, with what tells whether other work shared the CPU meanwhile."""

    outputs: Outputs
    wall_s: float
    cpu_util: float  # CPU seconds of the process tree / (wall seconds * threads); well under 1: contended
    loadavg_1m: tuple[float, float]  # before, after


def timed_run(generate: Generate, requests: list[Request], label: str, threads: int) -> Timing:
    """Warm up untimed, then time one generation over all requests."""
    generate(warmup_requests(requests), Progress(label, 2, quiet=True))
    load_before, cpu_before = os.getloadavg()[0], cpu_seconds()
    start = time.perf_counter()
    outputs = generate(requests, Progress(label, len(requests)))
    wall_s = time.perf_counter() - start
    util = (cpu_seconds() - cpu_before) / (wall_s * threads)
    return Timing(outputs, wall_s, round(util, 2), (round(load_before, 2), round(os.getloadavg()[0], 2)))


def check_lengths(label: str, requests: list[Request], outputs: Outputs) -> None:
    """Each request must come back with exactly max_tokens output ids."""
    bad = [(i, len(o), r.max_tokens) for i, (o, r) in enumerate(zip(outputs, requests))
           if len(o) != r.max_tokens]
    if len(outputs) != len(requests) or bad:
        raise AssertionError(f"{label}: {len(outputs)} outputs for {len(requests)} requests; "
                             f"(index, got, wanted) mismatches: {bad[:5]}")


def make_result(system: str, dtype: str, requests: list[Request], timing: Timing, peak_rss: float,
                extra: dict) -> SystemResult:
    """Check the output lengths and compute the throughput of one timed run."""
    check_lengths(f"{system} {dtype}", requests, timing.outputs)
    tokens = sum(len(o) for o in timing.outputs)
    return SystemResult(system, dtype, len(requests), tokens, round(timing.wall_s, 3),
                        round(tokens / timing.wall_s, 1), round(peak_rss, 1), timing.cpu_util,
                        tuple(timing.loadavg_1m), extra)


def torch_threads() -> int:
    """The thread count the parent chose (children read it from OMP_NUM_THREADS)."""
    return int(os.environ["OMP_NUM_THREADS"])


def streams() -> int:
    """--streams (0: all requests at once), set by the parent for its children."""
    return int(os.environ.get("BENCH_STREAMS", "0"))


def measure(system: str, dtype: str, generate: Generate, requests: list[Request],
            extra: dict) -> SystemResult:
    """Time an in-process system and record this process's peak RSS."""
    timing = timed_run(generate, requests, f"{system} {dtype}", torch_threads())
    return make_result(system, dtype, requests, timing, peak_rss_mib(), extra)


# --------------------------------------------------------------------------- models


def build_random56m(path: Path = MODELS_DIR / RANDOM56M) -> Path:
    """A seeded random Llama of 56.0M parameters (no tokenizer), built once into `path`."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=28000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    tmp = path.with_name(path.name + ".tmp")
    LlamaForCausalLM(config).save_pretrained(tmp)
    tmp.rename(path)
    return path


def resolve_model(name: str | None) -> Path:
    """The HF folder for --model: the project default, the built-in random56m, or a path."""
    if name == RANDOM56M:
        return build_random56m()
    from backend.serving.model_store import resolve_model_dir

    return resolve_model_dir(name or "default")


# --------------------------------------------------------------------------- systems


def _load_hf(model_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def system_settings(system: str) -> dict[str, str]:
    """`engine@gemm_backend=onednn+max_num_seqs=32` (or bench_online's `ours@...`) -> the engine settings it names."""
    _, _, settings = system.partition("@")
    return dict(item.split("=", 1) for item in settings.split("+") if item)


def run_engine(model_dir: Path, dtype: str, requests: list[Request], rss_check: Path | None,
               runtime: str = "torch", quantization: str = "none", settings: dict[str, str] | None = None
               ) -> SystemResult:
    """Our engine through its online API, so progress shows as requests finish; `settings`: EngineConfig's, by name."""
    from backend.engine import LLMEngine
    from backend.engine.sampling import SamplingParams
    from backend.serving.settings import engine_config_from_settings

    params = {"model": str(model_dir), "dtype": dtype, "runtime": runtime, "quantization": quantization}
    if runtime == "onnxruntime":  # exported once into .cache/engines/, like `python -m build_engine`
        from build_engine.export_onnx import cached_engine_dir

        params["engine_dir"] = str(cached_engine_dir(model_dir, dtype, quantization))
    engine = LLMEngine(engine_config_from_settings({**params, **(settings or {})}))
    counter = iter(range(sys.maxsize))
    first_token_s: list[float] = []
    token_gaps_s: list[float] = []  # between a request's consecutive outputs, of the last generate call

    def generate(batch: list[Request], progress: Progress) -> Outputs:
        outputs: Outputs = [[] for _ in batch]
        waiting, ids, submitted, last_output = list(range(len(batch)))[::-1], {}, {}, {}
        token_gaps_s.clear()

        def submit() -> None:
            i = waiting.pop()
            ids[rid := f"r{next(counter)}"], submitted[i] = i, time.perf_counter()
            engine.add_request(rid, batch[i].prompt_token_ids,
                               SamplingParams(max_tokens=batch[i].max_tokens, ignore_eos=True))

        for _ in range(min(streams() or len(batch), len(batch))):
            submit()
        while engine.has_unfinished():
            for out in engine.step():
                i, now = ids[out.request_id], time.perf_counter()
                if out.new_token_ids:
                    if outputs[i]:
                        token_gaps_s.append(now - last_output[i])
                    else:
                        first_token_s.append(now - submitted[i])
                    last_output[i] = now
                outputs[i].extend(out.new_token_ids)
                if out.finished:
                    progress.update()
                    if waiting:
                        submit()
        return outputs

    system = "engine" + ("" if runtime == "torch" else f"_{runtime}") + ("" if quantization == "none" else
                                                                        f"_{quantization}")
    if settings:
        system += "@" + "+".join(f"{k}={v}" for k, v in settings.items())
    result = measure(system, dtype, generate, requests,
                     extra={"runtime": runtime, "quantization": engine.config.quantization})
    result.extra["ttft_ms_median"] = round(1000 * statistics.median(first_token_s[-len(requests):]), 1)
    if token_gaps_s:
        result.extra["itl_ms_median"] = round(1000 * statistics.median(token_gaps_s), 2)
    if rss_check is not None:
        # RSS after each tenth of the requests: allocator warm-up levels off, a leak keeps climbing
        more = load_workload(rss_check)
        curve = [round(current_rss_mib(), 1)]
        progress = Progress(f"engine {dtype} rss-check", len(more))
        for wave in range(RSS_CHECK_WAVES):
            part = more[wave * len(more) // RSS_CHECK_WAVES:(wave + 1) * len(more) // RSS_CHECK_WAVES]
            check_lengths("engine rss-check", part, generate(part, progress))
            curve.append(round(current_rss_mib(), 1))
        result.extra["rss_check"] = {"requests": len(more), "rss_curve_mib": curve}
        result.peak_rss_mib = round(peak_rss_mib(), 1)
    return result


def run_hf_static(model_dir: Path, dtype: str, requests: list[Request],
                  rss_check: Path | None) -> SystemResult:
    """HF `generate` on left-padded batches of 8 in workload order; a batch runs to its longest output."""
    import torch

    model = _load_hf(model_dir, dtype)
    pad_id = 0

    def generate(batch: list[Request], progress: Progress) -> Outputs:
        outputs: Outputs = []
        for start in range(0, len(batch), STATIC_BATCH):
            group = batch[start:start + STATIC_BATCH]
            width = max(len(r.prompt_token_ids) for r in group)
            pads = [width - len(r.prompt_token_ids) for r in group]
            ids = torch.tensor([[pad_id] * n + r.prompt_token_ids for n, r in zip(pads, group)])
            mask = torch.tensor([[0] * n + [1] * (width - n) for n in pads])
            new = max(r.max_tokens for r in group)
            with torch.inference_mode():  # min_new_tokens: EOS ignored
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
            outputs += [row[width:width + r.max_tokens].tolist() for row, r in zip(out, group)]
            progress.update(len(group))
        return outputs

    return measure("hf_static", dtype, generate, requests, extra={"batch_size": STATIC_BATCH})


def run_hf_cb(model_dir: Path, dtype: str, requests: list[Request], rss_check: Path | None) -> SystemResult:
    """HF's continuous batching manager (`generate_batch` takes one max_new_tokens for all requests, so
    this uses the manager it wraps: one add_request per request, with its own max_new_tokens)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _load_hf(model_dir, dtype)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                          max_generated_length=max(r.max_tokens for r in requests),
                          num_requests=len(requests))
    # On CPU its own sizing gives the KV cache 60% of the host's RAM: size it to hold every request at once.
    pages = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // HF_CB_PAGE_SIZE) for r in requests)
    settings = {"page_size": HF_CB_PAGE_SIZE, "max_batch_tokens": HF_CB_MAX_BATCH_TOKENS, "num_blocks": pages}
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)  # -1: no EOS
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=ContinuousBatchingConfig(**settings),
        workload_hints=hints,
    ) as manager:

        def generate(batch: list[Request], progress: Progress) -> Outputs:
            ids = {manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1): i
                   for i, r in enumerate(batch)}
            outputs: Outputs = [[] for _ in batch]
            while progress.done < len(batch):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("HF continuous batching thread died")
                elif result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"HF request {result.request_id} failed: {result.error}")
                    outputs[ids[result.request_id]] = list(result.generated_tokens)
                    progress.update()
            return outputs

        return measure("hf_cb", dtype, generate, requests, extra=settings)


def _in_own_venv(python: Path, setup: str, module: str, requests: list[Request], args: list[str],
                 env: dict[str, str] | None = None) -> dict:
    """Run a baseline's runner module in its own venv on `requests`; it times itself and writes a JSON report."""
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: run `bash load_tests/{setup}` first")
    with tempfile.TemporaryDirectory() as tmp:
        workload, report = Path(tmp) / "workload.json", Path(tmp) / "report.json"
        save_workload(requests, workload)
        subprocess.run([str(python), "-m", module, "--workload", str(workload), "--threads", str(torch_threads()),
                        "--out", str(report), *args], cwd=REPO, env={**os.environ, **(env or {})}, check=True)
        return json.loads(report.read_text())


def run_vllm(model_dir: Path, dtype: str, requests: list[Request], rss_check: Path | None) -> SystemResult:
    """vLLM in its own venv: load_tests/vllm_offline_runner.py times the generate call and writes JSON."""
    data = _in_own_venv(VLLM_PYTHON, "vllm_env.sh", "load_tests.vllm_offline_runner", requests,
                        ["--model", str(model_dir), "--dtype", dtype],
                        {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")})
    return make_result("vllm", dtype, requests, Timing(**data["timing"]), data["peak_rss_mib"],
                       data["settings"])


def run_llamacpp(model_dir: Path, dtype: str, requests: list[Request], rss_check: Path | None) -> SystemResult:
    """llama.cpp in its own venv on the model folder's GGUF: load_tests/llamacpp_offline_runner.py."""
    from backend.engine.models.gguf_weights import gguf_file

    data = _in_own_venv(LLAMACPP_PYTHON, "llama_cpp_env.sh", "load_tests.llamacpp_offline_runner", requests,
                        ["--gguf", str(gguf_file(model_dir)), "--streams", str(streams() or len(requests))])
    return make_result("llamacpp", "gguf", requests, Timing(**data["timing"]), data["peak_rss_mib"], data["settings"])


RUNNERS: dict[str, Callable[[Path, str, list[Request], Path | None], SystemResult]] = {
    "engine": run_engine, "hf_static": run_hf_static, "hf_cb": run_hf_cb, "vllm": run_vllm, "llamacpp": run_llamacpp,
    "engine_onnxruntime": functools.partial(run_engine, runtime="onnxruntime"),
    **{f"engine_{q}": functools.partial(run_engine, quantization=q) for q in QUANTIZED},
    **{f"engine_onnxruntime_{q}": functools.partial(run_engine, runtime="onnxruntime", quantization=q)
       for q in ONNX_QUANTIZED},
}


def _child(system: str, model_dir: Path, dtype: str, workload: Path, rss_check: Path | None) -> SystemResult:
    """Entry point of the child process that runs one system."""
    import torch

    torch.set_num_threads(torch_threads())
    base, _, _ = system.partition("@")
    if base.startswith("engine") and (settings := system_settings(system)):
        return RUNNERS[base](model_dir, dtype, load_workload(workload), rss_check, settings=settings)
    return RUNNERS[base](model_dir, dtype, load_workload(workload), rss_check)


def other_runnable() -> float:
    """Processes runnable besides this one, averaged over 2 s (from /proc/loadavg, Linux)."""
    samples = []
    for _ in range(10):
        samples.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(0.2)
    return sum(samples) / len(samples)


def wait_for_idle(max_wait_s: float) -> None:
    """Wait, up to max_wait_s, until no other process competes for the CPU (a shared box)."""
    if max_wait_s <= 0:
        return
    deadline = time.monotonic() + max_wait_s
    while (busy := other_runnable()) > 0.3 and time.monotonic() < deadline:
        print(f"\r  waiting for an idle CPU: {busy:.1f} other processes runnable", end="",
              file=sys.stderr, flush=True)
    print(f"\n  {'still busy: running anyway' if busy > 0.3 else 'CPU idle'}", file=sys.stderr)


def run_system(system: str, model_dir: Path, dtype: str, workload: Path, rss_check: Path | None,
               wait_idle_s: float) -> SystemResult:
    """Run one system in a fresh spawned process; a failure is recorded with its traceback."""
    print(f"[{system} {dtype}]", file=sys.stderr, flush=True)
    wait_for_idle(wait_idle_s)
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            return pool.submit(_child, system, model_dir, dtype, workload, rss_check).result()
    except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others' numbers
        text = "".join(traceback.format_exception(exc))  # the chain holds the child's own traceback
        print(text, file=sys.stderr)
        return SystemResult(system, dtype, 0, error=text)


# --------------------------------------------------------------------------- reporting


def ratios(results: list[SystemResult]) -> dict[tuple[str, str], dict[str, float]]:
    """Each result's throughput over each baseline's, in the same dtype."""
    base = {(r.system, r.dtype): r.output_tok_s for r in results if r.error is None}
    gguf = next((v for (system, _), v in base.items() if system == "llamacpp"), None)  # one file, any dtype
    return {
        (r.system, r.dtype): {f"x_{b}": round(r.output_tok_s / (gguf if b == "llamacpp" else base[(b, r.dtype)]), 2)
                              for b in BASELINES if (gguf if b == "llamacpp" else base.get((b, r.dtype)))}
        for r in results if r.error is None
    }


def by_round(results: list[SystemResult]) -> list[list[SystemResult]]:
    return [[r for r in results if r.round == k] for k in range(max((r.round for r in results), default=0) + 1)]


def round_ratios(results: list[SystemResult]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Each system's ratios to the baselines, one per round. A round runs every system once, so a ratio compares
    runs minutes apart; on a VM whose speed drifts by a quarter within minutes the rounds' spread and median say
    more than any one run."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for results_k in by_round(results):
        for key, xs in ratios(results_k).items():
            for name, x in xs.items():
                out.setdefault(key, {}).setdefault(name, []).append(x)
    return out


def rounds_summary(per_round: dict[tuple[str, str], dict[str, list[float]]], rounds: int) -> str:
    lines = [f"over {rounds} rounds, each system's ratio to each baseline: median (each round's)"]
    for (system, dtype), xs in per_round.items():
        parts = [f"{name} {statistics.median(v):.2f} ({' '.join(f'{x:.2f}' for x in v)})"
                 for name, v in xs.items() if name != f"x_{system}"]
        if parts:
            lines.append(f"  {system:<12} {dtype:<9} " + ", ".join(parts))
    return "\n".join(lines)


def table(results: list[SystemResult], threads: int) -> str:
    """A plain-text table of the results with ratios to our float engine, hf_cb and vLLM, and a warning when
    contended."""
    rel = ratios(results)
    head = (f"{'system':<12} {'dtype':<9} {'reqs':>5} {'out tok':>8} {'wall s':>8} {'out tok/s':>10} "
            f"{'x engine':>8} {'x hf_cb':>8} {'x vllm':>7} {'x llama':>7} {'TTFT ms':>8} {'peak RSS MiB':>13} "
            f"{'cpu util':>9} {'load 1m':>10}")
    lines = [head, "-" * len(head)]
    contended = False
    for r in results:
        if r.error is not None:
            lines.append(f"{r.system:<12} {r.dtype:<9} FAILED: {r.error.strip().splitlines()[-1]}")
            continue
        x = rel[(r.system, r.dtype)]
        load = f"{r.loadavg_1m[0]:.1f}>{r.loadavg_1m[1]:.1f}"
        lines.append(f"{r.system:<12} {r.dtype:<9} {r.num_requests:>5} {r.output_tokens:>8} {r.wall_s:>8.2f} "
                     f"{r.output_tok_s:>10.1f} {x.get('x_engine', float('nan')):>8.2f} "
                     f"{x.get('x_hf_cb', float('nan')):>8.2f} "
                     f"{x.get('x_vllm', float('nan')):>7.2f} {x.get('x_llamacpp', float('nan')):>7.2f} "
                     f"{r.extra.get('ttft_ms_median', float('nan')):>8.1f} {r.peak_rss_mib:>13.0f} {r.cpu_util:>9.2f} "
                     f"{load:>10}")
        if "rss_check" in r.extra:
            c = r.extra["rss_check"]
            lines.append(f"{'':<12} RSS (MiB) before and after each tenth of {c['requests']} more requests: "
                         + " ".join(f"{x:.0f}" for x in c["rss_curve_mib"]))
        contended |= max(r.loadavg_1m) > threads + 0.5
    if contended:
        lines.append(f"WARNING: load average above {threads} threads: other processes shared the CPU, "
                     "so these numbers are low and noisy")
    return "\n".join(lines)


def lower_median(runs: Iterable[T], key: Callable[[T], float]) -> T:
    """The run of median `key`: the lower middle one of an even count (a run that happened, not an average)."""
    ordered = sorted(runs, key=key)
    return ordered[(len(ordered) - 1) // 2]


def median_runs(results: list[SystemResult]) -> list[SystemResult]:
    """Each (system, dtype)'s run of median tok/s."""
    runs: dict[tuple[str, str], list[SystemResult]] = {}
    for r in results:
        runs.setdefault((r.system, r.dtype), []).append(r)
    return [lower_median(rs, lambda r: r.output_tok_s) for rs in runs.values()]


def plot(results: list[SystemResult], path: Path, title: str) -> None:
    """Grouped bars of output tok/s: one group per system, one bar per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.error is None]
    systems = list(dict.fromkeys(r.system for r in ok))
    dtypes = list(dict.fromkeys(r.dtype for r in ok))
    width = 0.8 / max(len(dtypes), 1)
    fig, ax = plt.subplots(figsize=(1.8 * len(systems) + 2, 4.5))
    for k, dtype in enumerate(dtypes):
        vals = {r.system: r.output_tok_s for r in ok if r.dtype == dtype}
        xs = [i + (k - (len(dtypes) - 1) / 2) * width for i, s in enumerate(systems) if s in vals]
        bars = ax.bar(xs, [vals[s] for s in systems if s in vals], width, label=dtype)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(systems)), systems)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"HF model folder, or '{RANDOM56M}' (default: the project's SmolLM2)")
    p.add_argument("--dtype", choices=[*DTYPES, "both"], default="float32")
    p.add_argument("--systems", default="engine,hf_static,hf_cb",
                   help="comma list from engine,hf_static,hf_cb")
    p.add_argument("--vllm", action="store_true", help="also run vLLM CPU from .venv-vllm")
    p.add_argument("--llamacpp", action="store_true", help="also run llama.cpp on the model's GGUF (.venv-llamacpp)")
    p.add_argument("--streams", type=int, default=0,
                   help="closed-loop streams for the engine systems and llamacpp (default: all requests at once)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times, alternating, and report each ratio's median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rss-check", action="store_true",
                   help=f"engine only: RSS before and after {RSS_CHECK_REQUESTS} more requests")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each system, wait up to this long for other processes to leave the CPU")
    p.add_argument("--omp-passive", action="store_true",
                   help="OMP_WAIT_POLICY=PASSIVE for every system (for a machine shared with other work)")
    p.add_argument("--out", type=Path, default=Path("results/offline.json"))
    args = p.parse_args(argv)
    args.systems = ([s for s in args.systems.split(",") if s] + (["vllm"] if args.vllm else [])
                    + (["llamacpp"] if args.llamacpp else []))
    bases = {s.partition("@")[0] for s in args.systems}
    if unknown := bases - set(SYSTEMS):
        p.error(f"unknown systems: {sorted(unknown)}")
    if any("@" in s and not s.startswith("engine") for s in args.systems):
        p.error("--systems: only engine systems take @settings (engine@gemm_backend=onednn)")
    if args.streams and bases - set(STREAMING):
        p.error(f"--streams: {sorted(bases - set(STREAMING))} take all requests at once")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every child
    os.environ["BENCH_STREAMS"] = str(args.streams)
    if args.omp_passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    model_dir = resolve_model(args.model)
    vocab_size, special = model_vocab(model_dir)
    requests = make_workload(args.num_requests, vocab_size=vocab_size, seed=args.seed, exclude_ids=special)
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)
    print(f"model {model_dir}: {len(requests)} requests, {prompt_tokens} prompt and {output_tokens} output "
          f"tokens, {args.threads} threads on {cpu_summary()}", file=sys.stderr)

    results: list[SystemResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.json"
        save_workload(requests, workload)
        rss_check = Path(tmp) / "rss_check.json" if args.rss_check else None
        if rss_check is not None:
            more = make_workload(RSS_CHECK_REQUESTS, RSS_CHECK_PROMPT_LEN, RSS_CHECK_OUTPUT_LEN, vocab_size,
                                 seed=args.seed + 1, exclude_ids=special)
            save_workload(more, rss_check)
        for k in range(args.rounds):
            for dtype in dtypes:
                for system in args.systems:
                    result = run_system(system, model_dir, dtype, workload,
                                        rss_check if system == "engine" and k == 0 else None, args.wait_idle)
                    result.round = k
                    results.append(result)
    print(f"CPU: {cpu_summary()}")
    for k, results_k in enumerate(by_round(results)):
        if args.rounds > 1:
            print(f"round {k + 1} of {args.rounds}")
        print(table(results_k, args.threads))
    per_round = round_ratios(results)
    if args.rounds > 1:
        print(rounds_summary(per_round, args.rounds))

    rel = {(system, dtype, k): x for k, results_k in enumerate(by_round(results))
           for (system, dtype), x in ratios(results_k).items()}
    report = {
        "model": str(model_dir),
        "workload": {"num_requests": len(requests), "seed": args.seed, "prompt_tokens": prompt_tokens,
                     "output_tokens": output_tokens, "vocab_size": vocab_size,
                     "excluded_special_ids": special,
                     "prompts": "random token ids", "ignore_eos": True},
        "threads": args.threads,
        "streams": args.streams or len(requests),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "machine": {"cpu": cpu_summary(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "results": [{**asdict(r), **rel.get((r.system, r.dtype, r.round), {})} for r in results],
        "rounds": args.rounds,
        "median_ratios": {f"{system} {dtype}": {name: statistics.median(v) for name, v in xs.items()}
                          for (system, dtype), xs in per_round.items()},
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    chart = args.out.with_suffix(".png")
    plot(median_runs(results), chart, f"{model_dir.name}: {len(requests)} requests, {args.threads} threads"
         + (f", each system's median run of {args.rounds}" if args.rounds > 1 else "") + f"\n{cpu_summary()}")
    print(f"wrote {args.out} and {chart}", file=sys.stderr)


if __name__ == "__main__":
    main()
