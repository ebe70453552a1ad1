"""bench_itl on a real tritonserver and the offline engine (the tiny Llama): each round's ratio is its served median
over its offline one, and every token's response is timed (the tiny model's ids often decode to no text)."""

from __future__ import annotations

import json
import statistics

from load_tests import bench_itl


def test_each_round_divides_the_served_median_gap_by_the_offline_one(tiny_model_dir, tmp_path, monkeypatch, capsys):
    gaps, served_gaps = [], bench_itl.served_gaps

    def counted(*args, **kwargs):
        gaps.append(served_gaps(*args, **kwargs))
        return gaps[-1]

    monkeypatch.setattr(bench_itl, "served_gaps", counted)
    out = tmp_path / "itl"
    bench_itl.main(["--model", str(tiny_model_dir), "--quantization", "none", "--requests", "2", "--max-tokens", "8",
                    "--rounds", "2", "--threads", "1", "--out", str(out)])
    report = json.loads((out / "itl.json").read_text())
    assert len(report["rounds"]) == 2 and [len(g) for g in gaps] == [2 * 7, 2 * 7]  # a gap per token after the first
    for r, g in zip(report["rounds"], gaps):
        assert r["served_itl_ms_p50"] == round(1000 * statistics.median(g), 2) > 0 and r["offline_itl_ms_p50"] > 0
        assert r["served_over_offline"] == round(1000 * statistics.median(g) / r["offline_itl_ms_p50"], 3)
    ratios = [r["served_over_offline"] for r in report["rounds"]]
    assert report["served_over_offline_median"] == statistics.median(ratios)
    assert f"median {statistics.median(ratios):.3f}" in capsys.readouterr().out
