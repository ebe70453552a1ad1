"""load_tests/faults.py, the operator's fault script, against the real test server (tiny model): each check runs
to its end and prints what it counts. Its kill check is exercised by tests/test_supervision.py's scenario (it
needs a launcher-supervised server of its own)."""

from __future__ import annotations

import re

from load_tests.faults import main
from tests.conftest import LLM_TEST_SETTINGS


def run(server, capsys, *argv: str) -> str:
    main(["--url", server.url_grpc, "--http-url", server.url_http, "--metrics-url", server.url_metrics, *argv])
    return capsys.readouterr().out


def test_fairness_prints_both_tenants_ttft_and_the_ratio(server, capsys):
    out = run(server, capsys, "--checks", "fairness", "--flood", "4", "--flood-tokens", "40", "--requests", "3",
              "--max-tokens", "4")
    assert re.search(r"alone: p50 \d+\.\d+ s, p99 \d+\.\d+ s", out), out
    assert re.search(r"ratio \(flooded / alone\): p50 \d+\.\d+x, p99 \d+\.\d+x", out), out


def test_overload_refuses_past_the_queue_bound_and_counts_every_refusal(server, capsys):
    accepted = int(LLM_TEST_SETTINGS["max_num_seqs"]) + int(LLM_TEST_SETTINGS["max_waiting"])
    burst = 3 * accepted  # sent together: most arrive while the first `accepted` still run
    out = run(server, capsys, "--checks", "overload", "--burst", str(burst))
    served = int(re.search(r"(\d+) served", out).group(1))
    refused = int(re.search(r"(\d+) refused overloaded", out).group(1))
    counted = int(re.search(r'llm_requests_refused_total\{reason="overloaded"\} \+(\d+)', out).group(1))
    assert refused > 0 and served + refused == burst and counted == refused, out


def test_a_storm_round_loses_no_request_and_restarts_nothing(server, capsys):
    out = run(server, capsys, "--checks", "storm", "--storm-minutes", "0.01")
    assert re.search(r"storm: 1 rounds .* 0 tritonserver restarts", out), out
    assert "no final response" not in out and "failed" not in out, out
    assert "12 abandoned" in out and "12 finished" in out and "16 bad request refused" in out, out
