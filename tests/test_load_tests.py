"""The load-test tooling against the real test server: locust runs headless (gRPC and HTTP users, constant and
Poisson shapes), summarize.py reads its CSV, and the static-batching baseline streams exact lengths."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# Never import locust in the test process: it monkey-patches threading and sockets (gevent) for every
# later test, and gRPC callbacks from real threads then never wake them. Locust runs as a subprocess.
if importlib.util.find_spec("locust") is None:
    pytest.skip("load-test extras: pip install -r requirements-load.txt", allow_module_level=True)

from load_tests.prompts import SYSTEM_PROMPT, make_prompts  # noqa: E402
from load_tests.summarize import format_summary, read_summary  # noqa: E402
from load_tests.summarize import main as summarize_main  # noqa: E402

LOCUST = Path(sys.executable).parent / "locust"
LOCUSTFILE = Path(__file__).resolve().parents[1] / "load_tests" / "locustfile.py"
RUN_SECONDS = 8


def run_locust(csv_prefix: Path, host: str, protocol: str, shape: str,
               *options: str) -> subprocess.CompletedProcess:
    # --stop-timeout: at the end, users finish the request in flight instead of being killed inside a gRPC
    # stream; killed there, a run hung at "Shape test stopping" until the subprocess timeout (2 CI rehearsals
    # in ~10, 2026-11-23)
    cmd = [str(LOCUST), "-f", str(LOCUSTFILE), "--headless", "--only-summary", "-H", host,
           "-t", f"{RUN_SECONDS}s", "--stop-timeout", "30", "--csv", str(csv_prefix), "--max-tokens", "4-12",
           "--prompt-set", "synthetic", *options]
    return subprocess.run(cmd, env={**os.environ, "LOAD_SHAPE": shape, "LOAD_PROTOCOL": protocol},
                          capture_output=True, text=True, timeout=RUN_SECONDS + 60)


@pytest.fixture(scope="module")
def grpc_run(server, tmp_path_factory) -> Path:
    """A constant-users locust run over gRPC; the path of its stats CSV."""
    prefix = tmp_path_factory.mktemp("locust") / "grpc"
    proc = run_locust(prefix, server.url_grpc, "grpc", "constant", "-u", "4", "-r", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(f"{prefix}_stats.csv")


def test_locust_grpc_users_report_ttft_itl_e2e_without_failures(grpc_run):
    summary = read_summary(grpc_run)
    assert {r.kind for r in summary.rows} == {"TTFT", "ITL", "E2E", "TOK/S"}
    assert {r.name for r in summary.rows} == {"grpc llm"}
    e2e, ttft, itl = summary.row("E2E"), summary.row("TTFT"), summary.row("ITL")
    assert e2e.count >= 10 and summary.errors == 0
    assert ttft.count == e2e.count  # one TTFT per request
    assert itl.count >= e2e.count * 3  # one per gap: 4..12 tokens, so 3..11 gaps a request
    assert 4 <= e2e.mean_content <= 12  # content size = output tokens, ignore_eos
    assert 0 < ttft.percentiles["50%"] <= e2e.percentiles["50%"]


def test_summarize_prints_the_table_from_the_csv(grpc_run, capsys):
    summary = read_summary(grpc_run)
    e2e = summary.row("E2E")
    assert summary.output_tok_s == pytest.approx(e2e.requests_per_s * e2e.mean_content)
    assert summarize_main([str(grpc_run)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_summary(summary)
    assert "errors: 0" in out and all(kind in out for kind in ("TTFT", "ITL", "E2E", "TOK/S"))


def test_poisson_shape_over_http_makes_about_rate_times_duration_requests(server, tmp_path):
    rate = 6.0
    proc = run_locust(tmp_path / "poisson", server.url_http, "http", "poisson", "-u", "3",
                      "--rate", str(rate))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(tmp_path / "poisson_stats.csv")
    assert summary.errors == 0
    arrivals = summary.row("E2E", "http llm").count
    expected = rate * RUN_SECONDS  # 48, Poisson sd ~7 (seeded: 39 arrive); a request or two cut at the end
    assert expected - 28 <= arrivals <= expected + 28, arrivals


def test_failures_are_reported_with_their_message(server, tmp_path):
    proc = run_locust(tmp_path / "bad", server.url_grpc, "grpc", "constant", "-u", "1", "-r", "1",
                      "--model", "no_such_model", "-t", "2s")
    assert proc.returncode == 1  # locust's exit code when any request failed
    summary = read_summary(tmp_path / "bad_stats.csv")
    assert summary.errors > 0 and summary.errors == summary.row("E2E").count
    assert any("no_such_model" in message for message, _ in summary.failures)


def test_prompt_sets_are_seeded_and_the_shared_set_shares_its_prefix():
    assert make_prompts("synthetic", 20, seed=1) == make_prompts("synthetic", 20, seed=1)
    assert make_prompts("synthetic", 20, seed=1) != make_prompts("synthetic", 20, seed=2)
    assert all(p.chat for p in make_prompts("chat", 10))
    shared = make_prompts("shared-system", 10)
    assert all(p.text.startswith(SYSTEM_PROMPT) for p in shared) and len({p.text for p in shared}) > 1


def test_static_batcher_streams_exactly_max_tokens_per_request(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from load_tests.static_batcher import Job, StaticBatcher

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batcher = StaticBatcher(model, pad_id=2, max_batch=8)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    wanted = [6, 3, 9]
    streams: list[list[tuple[list[int], bool]]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def job(i: int) -> Job:
        def emit(ids: list[int], final: bool) -> None:
            streams[i].append((ids, final))
            if final:
                done.release()

        return Job(prompts[i], wanted[i], emit, fail=lambda err: pytest.fail(str(err)))

    for i in range(len(prompts)):
        batcher.submit(job(i))
    for _ in prompts:
        assert done.acquire(timeout=120)
    batcher.close()
    for stream, n in zip(streams, wanted):
        assert [final for _, final in stream] == [False] * (n - 1) + [True]
        assert sum(len(ids) for ids, _ in stream) == n
    with torch.inference_mode():  # the unpadded (longest) prompt matches a plain greedy generate
        alone = model.generate(torch.tensor([prompts[0]]), max_new_tokens=6, min_new_tokens=6,
                               do_sample=False, pad_token_id=2)
    assert [ids[0] for ids, _ in streams[0]] == alone[0, len(prompts[0]):].tolist()
