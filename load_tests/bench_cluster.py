"""Dynamo cluster benchmark: KV-aware routing vs round-robin vs random on multi-turn chats, one run.

Each router mode gets a fresh cluster (frontend + N workers from .venv-dynamo, `make dynamo-venv`) and the
same chat sessions, starting at the same Poisson times. Sessions share a few long system prompts; each
turn sends the whole conversation so far (the model's real earlier answers included) plus a new question,
after the previous answer and a think time, as a chat client does. Per mode: the prefix-cache hit rate
the ENGINES report (usage.prompt_tokens_details.cached_tokens over prompt tokens), TTFT and ITL p50/p99,
output throughput. Prints a table with the CPU, writes JSON and a plot.

    .venv/bin/python -m load_tests.bench_cluster [--workers 2] [--sessions 16] [--turns 5] [--session-rate 0.5]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from openai import OpenAI

from backend.dynamo import launcher
from load_tests.bench_offline import DYNAMO_PYTHON
from load_tests.bench_online import arrival_offsets, percentiles
from load_tests.machine import cpu_summary

REPO = Path(__file__).resolve().parents[1]
WORDS = ("system service request model token cache memory worker router latency answer question policy user "
         "data table engine batch prefill decode stream block queue network server client metric value").split()
MODEL = "bench"


@dataclass
class Session:
    system: str
    questions: list[str]
    think_seconds: list[float]  # before each turn after the first


@dataclass
class ModeResult:
    mode: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    seconds: float
    hit_rate: float
    throughput_tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_sessions(sessions: int, turns: int, system_prompts: int, system_words: int, think: float,
                  seed: int) -> list[Session]:
    rng = random.Random(seed)
    systems = [f"You are assistant {i}. {_text(rng, system_words)}" for i in range(system_prompts)]
    return [Session(systems[rng.randrange(system_prompts)],
                    [f"User: {_text(rng, 12)}?" for _ in range(turns)],
                    [rng.expovariate(1.0 / think) for _ in range(turns - 1)])
            for _ in range(sessions)]


class Recorder:
    """One row per request: TTFT, inter-token gaps, usage; thread-safe, with progress lines."""

    def __init__(self, mode: str, total: int):
        self.mode, self.total, self.rows, self.lock = mode, total, [], threading.Lock()

    def request(self, client: OpenAI, prompt: str, max_tokens: int, kind: str = "chat") -> str:
        row = {"kind": kind, "ttft": None, "itl": [], "prompt": 0, "cached": 0, "output": 0, "error": None}
        text, start = [], time.perf_counter()
        last = start
        try:
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    text.append(chunk.choices[0].text)
                    if row["ttft"] is None:
                        row["ttft"] = now - start
                    else:
                        row["itl"].append(now - last)
                    last = now
                if chunk.usage:
                    details = chunk.usage.prompt_tokens_details
                    row.update(prompt=chunk.usage.prompt_tokens, output=chunk.usage.completion_tokens,
                               cached=(details.cached_tokens or 0) if details else 0)
        except Exception as err:  # noqa: BLE001 - counted and reported
            row["error"] = repr(err)
        with self.lock:
            self.rows.append(row)
            if len(self.rows) % 10 == 0 or len(self.rows) == self.total:
                of = f"/{self.total}" if self.total else ""  # 0: open-ended
                print(f"[{self.mode}] {len(self.rows)}{of} requests done", flush=True)
        return "".join(text)


def run_mode(mode: str, args: argparse.Namespace, sessions: list[Session], starts: list[float]) -> ModeResult:
    print(f"[{mode}] starting the frontend and {args.workers} workers ...", flush=True)
    cluster = launcher.start(workers=args.workers, http_port=args.port, router_mode=mode, model=args.model,
                             served_model_name=MODEL, python=str(DYNAMO_PYTHON),
                             worker_args=("--num-kv-blocks", str(args.num_kv_blocks)))
    recorder = Recorder(mode, sum(len(s.questions) for s in sessions))
    try:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=600)
        client.completions.create(model=MODEL, prompt="warm up", max_tokens=4)

        def chat(session: Session) -> None:
            conversation = session.system
            for turn, question in enumerate(session.questions):
                if turn:
                    time.sleep(session.think_seconds[turn - 1])
                conversation += f"\n{question}\nAssistant:"
                conversation += recorder.request(client, conversation, args.max_tokens)

        threads, t0 = [], time.perf_counter()
        for session, offset in zip(sessions, starts):
            time.sleep(max(0.0, t0 + offset - time.perf_counter()))
            threads.append(threading.Thread(target=chat, args=(session,)))
            threads[-1].start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - t0
    finally:
        cluster.stop()
    rows = recorder.rows
    ok = [r for r in rows if r["error"] is None]
    for r in rows:
        if r["error"]:
            print(f"[{mode}] error: {r['error']}")
    prompt, cached, output = (sum(r[k] for r in ok) for k in ("prompt", "cached", "output"))
    ttft = percentiles([r["ttft"] for r in ok if r["ttft"] is not None], "ttft")
    itl = percentiles([x for r in ok for x in r["itl"]], "itl")
    return ModeResult(mode, len(rows), len(rows) - len(ok), prompt, cached, output, seconds,
                      cached / prompt if prompt else 0.0, output / seconds, ttft.get("ttft_p50", 0.0),
                      ttft.get("ttft_p99", 0.0), itl.get("itl_p50", 0.0), itl.get("itl_p99", 0.0))


def table(results: list[ModeResult]) -> str:
    lines = ["| router | requests (errors) | prefix hit rate | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | output tok/s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.mode} | {r.requests} ({r.errors}) | {r.hit_rate:.1%} | {r.ttft_p50:.2f} / {r.ttft_p99:.2f} "
                     f"| {r.itl_p50 * 1e3:.0f} / {r.itl_p99 * 1e3:.0f} | {r.throughput_tok_s:.1f} |")
    return "\n".join(lines)


def bars(names: list[str], panels: list[tuple[str, list[float], str]], path: Path, title: str) -> None:
    """One bar chart per panel (label, a value per name, unit), side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (label, values, unit) in zip(axes, panels):
        ax.bar(names, values, color=["tab:green", "tab:blue", "tab:gray"][:len(names)])
        ax.set_title(label)
        ax.set_ylabel(unit)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}" if unit != "%" else f"{v:.0f}%", ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--modes", default="kv,round-robin,random")
    p.add_argument("--model", default="default")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=200, help="~1.1 tokens per word (SmolLM2's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=48, help="each answer (EOS ignored)")
    p.add_argument("--session-rate", type=float, default=0.5, help="new sessions per second (Poisson)")
    p.add_argument("--think", type=float, default=2.0, help="mean seconds between an answer and the next turn")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="per worker, 16 tokens each")
    p.add_argument("--layout", default=None, metavar="agg,disagg,disagg-tcp",
                   help="instead of router modes: the mixed workload (long prompts arriving while short chats "
                        "decode) on 2 aggregated workers vs 1 prefill + 1 decode worker (KV over NIXL, or TCP)")
    p.add_argument("--decoders", type=int, default=6, help="--layout: short chats decoding throughout")
    p.add_argument("--long-prompts", type=int, default=12, help="--layout: long prompts, Poisson arrivals")
    p.add_argument("--long-words", type=int, default=900, help="--layout: words per long prompt")
    p.add_argument("--long-rate", type=float, default=0.25, help="--layout: long prompts per second")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "results" / "cluster")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a `kill` still stops the cluster (finally)
    if not DYNAMO_PYTHON.exists():
        raise SystemExit("no .venv-dynamo: run `make dynamo-venv` first")
    if args.layout:
        return run_layouts(args)

    sessions = make_sessions(args.sessions, args.turns, args.system_prompts, args.system_words, args.think,
                             args.seed)
    starts = arrival_offsets(args.session_rate, len(sessions), float("inf"), args.seed)
    cpu = cpu_summary()
    workload = (f"{args.sessions} chat sessions x {args.turns} turns ({args.system_prompts} shared system prompts, "
                f"{args.max_tokens}-token answers), {args.session_rate} new sessions/s, {args.workers} workers")
    print(f"{workload}; CPU: {cpu}", flush=True)
    results = [run_mode(mode, args, sessions, starts) for mode in args.modes.split(",")]
    panels = [("prefix-cache hit rate (engines)", [r.hit_rate * 100 for r in results], "%"),
              ("TTFT p50", [r.ttft_p50 for r in results], "s"), ("TTFT p99", [r.ttft_p99 for r in results], "s"),
              ("output throughput", [r.throughput_tok_s for r in results], "tok/s")]
    report(args, "cluster", f"{workload}\n{cpu}", table(results), results, [r.mode for r in results], panels)


def report(args: argparse.Namespace, name: str, title: str, text: str, results: list, names: list[str],
           panels: list[tuple[str, list[float], str]]) -> None:
    """Print the table under its title, write `name`.json and the bar charts `name`.png into --out."""
    print("\n" + title + "\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(
        {"cpu": cpu_summary(), "args": {k: str(v) for k, v in vars(args).items()},
         "results": [asdict(r) for r in results]}, indent=2))
    bars(names, panels, args.out / f"{name}.png", title)
    print(f"wrote {args.out / name}.json and .png")


# ---- disaggregated prefill/decode: --layout agg,disagg ---------------------------------------------------

@dataclass
class LayoutResult:
    layout: str
    requests: int
    errors: int
    seconds: float
    throughput_tok_s: float
    decode_itl_p50: float  # the short chats' inter-token latency: what long prefills disturb
    decode_itl_p99: float
    chat_ttft_p50: float
    chat_ttft_p99: float
    long_ttft_p50: float
    long_ttft_p99: float
    transfers: int
    transfer_ms_mean: float
    transfer_mb_mean: float


DISAGG = {"workers": 0, "prefill_workers": 1, "decode_workers": 1}
# layout -> (launcher layout, extra worker flags)
LAYOUTS = {"agg": ({"workers": 2}, ()), "disagg": (DISAGG, ("--kv-transport", "nixl")),
           "disagg-tcp": (DISAGG, ("--kv-transport", "tcp"))}


def run_layout(layout: str, args: argparse.Namespace) -> LayoutResult:
    print(f"[{layout}] starting the frontend and its workers ...", flush=True)
    workers, flags = LAYOUTS[layout]
    cluster = launcher.start(http_port=args.port, router_mode="kv", model=args.model, served_model_name=MODEL,
                             python=str(DYNAMO_PYTHON),
                             worker_args=("--num-kv-blocks", str(args.num_kv_blocks), *flags), **workers)
    rng = random.Random(args.seed)
    longs = [f"Document {i}: {_text(rng, args.long_words)}\nSummary:" for i in range(args.long_prompts)]
    arrivals = arrival_offsets(args.long_rate, len(longs), float("inf"), args.seed)
    recorder, done = Recorder(layout, 0), threading.Event()
    try:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=600)
        client.completions.create(model=MODEL, prompt="warm up", max_tokens=4)

        def chat(i: int) -> None:
            while not done.is_set():
                recorder.request(client, f"User {i}: {_text(rng, 30)}?\nAssistant:", args.max_tokens * 2, "chat")

        def long_prompt(prompt: str) -> None:
            recorder.request(client, prompt, 8, "long")

        chats = [threading.Thread(target=chat, args=(i,)) for i in range(args.decoders)]
        for th in chats:
            th.start()
        t0, threads = time.perf_counter(), []
        for prompt, offset in zip(longs, arrivals):
            time.sleep(max(0.0, t0 + 3.0 + offset - time.perf_counter()))  # chats decode from the start
            threads.append(threading.Thread(target=long_prompt, args=(prompt,)))
            threads[-1].start()
        for th in threads:
            th.join()
        done.set()
        for th in chats:
            th.join()
        seconds = time.perf_counter() - t0
        transfer = _transfer_metrics(cluster) if layout.startswith("disagg") else (0, 0.0, 0.0)
    finally:
        cluster.stop()
    rows = recorder.rows
    ok = [r for r in rows if r["error"] is None]
    chat, long = [r for r in ok if r["kind"] == "chat"], [r for r in ok if r["kind"] == "long"]
    itl = percentiles([x for r in chat for x in r["itl"]], "itl")
    chat_ttft = percentiles([r["ttft"] for r in chat if r["ttft"] is not None], "ttft")
    long_ttft = percentiles([r["ttft"] for r in long if r["ttft"] is not None], "ttft")
    return LayoutResult(layout, len(rows), len(rows) - len(ok), seconds, sum(r["output"] for r in ok) / seconds,
                        itl.get("itl_p50", 0.0), itl.get("itl_p99", 0.0), chat_ttft.get("ttft_p50", 0.0),
                        chat_ttft.get("ttft_p99", 0.0), long_ttft.get("ttft_p50", 0.0), long_ttft.get("ttft_p99", 0.0),
                        *transfer)


def _transfer_metrics(cluster: launcher.Cluster) -> tuple[int, float, float]:
    """(transfers, mean ms, mean MB) from the decode worker's metrics (the launcher's last worker)."""
    import re
    import urllib.request

    port = int(cluster.url.rsplit(":", 1)[1]) + len(cluster.workers)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))

    count = total("llm_kv_transfer_seconds_count")
    if not count:
        return 0, 0.0, 0.0
    return int(count), total("llm_kv_transfer_seconds_sum") / count * 1e3, \
        total("llm_kv_transfer_bytes_total") / count / 1e6


def layout_table(results: list[LayoutResult]) -> str:
    lines = ["| layout | requests (errors) | chats' ITL p50 / p99 (ms) | chats' TTFT p50 / p99 (s) | long prompts' TTFT "
             "p50 / p99 (s) | output tok/s | KV transfers: n, mean ms, mean MB |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.layout} | {r.requests} ({r.errors}) | {r.decode_itl_p50 * 1e3:.0f} / {r.decode_itl_p99 * 1e3:.0f} "
                     f"| {r.chat_ttft_p50:.2f} / {r.chat_ttft_p99:.2f} | {r.long_ttft_p50:.2f} / {r.long_ttft_p99:.2f} "
                     f"| {r.throughput_tok_s:.1f} | {r.transfers}, {r.transfer_ms_mean:.1f}, {r.transfer_mb_mean:.2f} |")
    return "\n".join(lines)


def run_layouts(args: argparse.Namespace) -> None:
    cpu = cpu_summary()
    workload = (f"{args.decoders} short chats decoding ({args.max_tokens * 2}-token answers) while {args.long_prompts} "
                f"long prompts (~{args.long_words} words, 8-token answers) arrive at {args.long_rate}/s")
    print(f"{workload}; CPU: {cpu}", flush=True)
    results = [run_layout(layout, args) for layout in args.layout.split(",")]
    panels = [("chats' ITL p99", [r.decode_itl_p99 * 1e3 for r in results], "ms"),
              ("chats' TTFT p99", [r.chat_ttft_p99 for r in results], "s"),
              ("long prompts' TTFT p99", [r.long_ttft_p99 for r in results], "s"),
              ("output throughput", [r.throughput_tok_s for r in results], "tok/s")]
    report(args, "layouts", f"{workload}\n{cpu}", layout_table(results), results, [r.layout for r in results],
           panels)


if __name__ == "__main__":
    main()
