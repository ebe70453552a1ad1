"""The gauges send a value only when it changed, the histograms their series' growth when flushed: each update is a
round trip to the server process."""

from __future__ import annotations

import pytest

from backend.triton.metrics import Gauge, Histogram


class Recorded:
    """Where a python_backend Metric would send the value to the server: here, a list."""

    def __init__(self):
        self.sent = []

    def set(self, value: float) -> None:
        self.sent.append(value)

    def increment(self, value: float) -> None:
        self.sent.append(value)


def test_a_gauge_sends_only_changed_values():
    metric = Recorded()
    gauge = Gauge(metric)
    for value in (0, 0, 3, 3, 3, 1, 0, 0):
        gauge.set(value)
    assert metric.sent == [0, 3, 1, 0]  # the first value is sent even when it is 0


def test_a_histogram_sends_its_series_growth_when_flushed():
    counters: dict[str, Recorded] = {}

    def counter(name: str, doc: str, extra: dict[str, str] | None = None) -> Recorded:
        return counters.setdefault(name + "".join(f"{{{k}={v}}}" for k, v in (extra or {}).items()), Recorded())

    histogram = Histogram(counter, "h", "doc", [0.1, 1, 10])
    assert list(counters) == ["h_bucket{le=0.1}", "h_bucket{le=1.0}", "h_bucket{le=10.0}", "h_bucket{le=+Inf}",
                              "h_sum", "h_count"]
    for value in (0.05, 1.0, 2.5, 99.0):  # 1.0 is on a bound: le, so in its bucket
        histogram.observe(value)
    assert all(not c.sent for c in counters.values())  # nothing is sent before a flush
    histogram.flush()
    histogram.flush()  # nothing new: nothing sent
    assert {name: c.sent for name, c in counters.items()} == {
        "h_bucket{le=0.1}": [1], "h_bucket{le=1.0}": [2], "h_bucket{le=10.0}": [3], "h_bucket{le=+Inf}": [4],
        "h_sum": [pytest.approx(102.55)], "h_count": [4]}
    histogram.observe(5.0)
    histogram.flush()  # the counters that grew, by what they grew
    assert {name: c.sent[1:] for name, c in counters.items()} == {
        "h_bucket{le=0.1}": [], "h_bucket{le=1.0}": [], "h_bucket{le=10.0}": [1], "h_bucket{le=+Inf}": [1],
        "h_sum": [pytest.approx(5.0)], "h_count": [1]}
