"""load_tests/bench_planner.py's arithmetic: worker-seconds from a worker count's timeline, and per-phase results
(a request in the phase it started in; errors counted, not timed). The planner itself is tested on real processes
in tests/test_dynamo_planner.py."""

from __future__ import annotations

import pytest

from load_tests.bench_planner import phase_of, phase_results, worker_seconds
from load_tests.streams import StreamRecord


def test_worker_seconds_integrate_the_count_until_the_end():
    assert worker_seconds([(0.0, 1)], 90.0) == 90.0
    assert worker_seconds([(0.0, 1), (30.0, 2), (70.0, 1)], 90.0) == pytest.approx(30 + 80 + 20)
    assert worker_seconds([(0.0, 2), (100.0, 1)], 90.0) == 180.0  # a decision after the end adds nothing


def test_requests_belong_to_the_phase_they_started_in():
    assert [phase_of(t, 100.0, 30.0, 3) for t in (100.0, 129.9, 130.0, 189.0, 195.0)] == [0, 0, 1, 2, 2]
    fast, slow = StreamRecord(0.0, 1.0, 3, [0.1, 0.2, 0.3]), StreamRecord(0.0, 4.0, 2, [2.0, 3.0])
    [low, high] = phase_results("planner", [1, 8], [(0, fast), (1, slow), (1, None), (1, fast)])
    assert (low.requests, low.errors, low.streams) == (1, 0, 1) and low.ttft_p50 == pytest.approx(0.1)
    assert (high.requests, high.errors) == (3, 1) and high.ttft_p50 == pytest.approx((0.1 + 2.0) / 2)
    assert high.itl_p99 == pytest.approx(1.0, rel=0.05) and low.itl_p50 == pytest.approx(0.1)
