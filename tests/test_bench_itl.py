"""bench_itl on a real tritonserver and the offline engine (the tiny Llama): each pair's ratio is its served median
gap over its offline one, every token's response is timed (the tiny model's ids often decode to no text), and the
offline engine runs the served config's settings; over either client stream."""

from __future__ import annotations

import json
import statistics

import pytest

from load_tests import bench_itl


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_each_pair_divides_the_served_median_gap_by_the_offline_one(protocol, tiny_model_dir, tmp_path, monkeypatch,
                                                                    capsys):
    served, offline = [], []
    served_gaps, offline_gaps = bench_itl.served_gaps, bench_itl.offline_gaps

    def counted(gaps: list, fn):
        def call(*args):
            gaps.append(fn(*args))
            return gaps[-1]
        return call

    monkeypatch.setattr(bench_itl, "served_gaps", counted(served, served_gaps))
    monkeypatch.setattr(bench_itl, "offline_gaps", counted(offline, offline_gaps))
    out = tmp_path / "itl"
    bench_itl.main(["--model", str(tiny_model_dir), "--quantization", "none", "--requests", "2", "--max-tokens", "8",
                    "--pairs", "3", "--threads", "1", "--protocol", protocol, "--out", str(out)])
    report = json.loads((out / "itl.json").read_text())
    # one untimed pair of 8 tokens first, then 3 timed: a gap per token after the first
    assert [len(g) for g in served] == [len(g) for g in offline] == [7] * 4 and len(report["pairs"]) == 3
    assert report["protocol"] == protocol
    for p, s, o in zip(report["pairs"], served[1:], offline[1:]):
        assert p["served_itl_ms_p50"] == round(1000 * statistics.median(s), 3) > 0
        assert p["offline_itl_ms_p50"] == round(1000 * statistics.median(o), 3) > 0
        assert p["served_over_offline"] == round(statistics.median(s) / statistics.median(o), 4)
    ratios = [p["served_over_offline"] for p in report["pairs"]]
    assert report["served_over_offline"]["median"] == round(statistics.median(ratios), 4)
    assert f"one {protocol} stream" in (printed := capsys.readouterr().out)
    assert f"median of 3 pairs {statistics.median(ratios):.3f}" in printed
