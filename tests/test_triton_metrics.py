"""The gauges send a value only when it changed: each update is a round trip to the server process."""

from __future__ import annotations

from backend.triton.metrics import Gauge


class Recorded:
    """Where a python_backend Metric would send the value to the server: here, a list."""

    def __init__(self):
        self.sent = []

    def set(self, value: float) -> None:
        self.sent.append(value)


def test_a_gauge_sends_only_changed_values():
    metric = Recorded()
    gauge = Gauge(metric)
    for value in (0, 0, 3, 3, 3, 1, 0, 0):
        gauge.set(value)
    assert metric.sent == [0, 3, 1, 0]  # the first value is sent even when it is 0
