"""load_tests/faults.py, the operator's fault script, against a real tritonserver of its own (tiny model): each
check runs to its end and prints what it counts. Its own server, so that this load cannot take the shared test
server down with it. Not here: the kill check (tests/test_supervision.py kills a launcher-supervised server's
stub). The storm runs for seconds here, an hour by hand (README)."""

from __future__ import annotations

import re

import pytest

from load_tests.faults import main
from tests.conftest import LLM_TEST_SETTINGS, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with start_server(tmp_path_factory.mktemp("faults_repo"), tiny_model_dir, LLM_TEST_SETTINGS) as srv:
        srv.wait_ready(300)
        yield srv


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


def test_a_short_storm_on_the_default_door_loses_nothing(server, capsys):
    """Bad requests and streams abandoned by their clients, for a few rounds: every request gets its final
    response, and the server (not supervised here) stays up: 0 restarts."""
    out = run(server, capsys, "--checks", "storm", "--storm-minutes", "0.1", "--recovery-timeout", "5")
    line = re.search(r"storm: (\d+) rounds in .*: (\d+) tritonserver restarts; (.*)", out)
    assert line and int(line.group(1)) >= 1 and line.group(2) == "0", out
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) ([a-z ]+?)(?:,|$)", line.group(3))}
    rounds = int(line.group(1))
    assert counts == {"bad request refused": 16 * rounds, "abandoned": 12 * rounds, "finished": 12 * rounds}, out
