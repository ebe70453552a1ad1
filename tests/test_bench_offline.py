"""bench_offline --rounds: every system runs once a round, alternating, in processes of its own; the ratios are taken
within each round and their medians reported (a drifting VM's speed then weighs on both sides of a ratio alike)."""

from __future__ import annotations

import json
import statistics

from load_tests import bench_offline


def test_rounds_alternate_the_systems_and_report_each_ratios_median(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    bench_offline.main(["--model", str(tiny_model_dir), "--systems", "engine,engine@gemm_backend=aten",
                        "--rounds", "2", "--num-requests", "3", "--threads", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    runs = report["results"]
    assert report["rounds"] == 2 and [(r["system"], r["round"]) for r in runs] == [
        (system, k) for k in range(2) for system in ("engine", "engine@gemm_backend=aten")]
    assert all(r["error"] is None and r["output_tokens"] == runs[0]["output_tokens"] > 0 for r in runs)
    for k in range(2):
        ours, aten = (r for r in runs if r["round"] == k)
        assert ours["x_engine"] == 1.0 and aten["x_engine"] == round(aten["output_tok_s"] / ours["output_tok_s"], 2)
    medians = report["median_ratios"]
    assert medians["engine float32"]["x_engine"] == 1.0
    assert medians["engine@gemm_backend=aten float32"]["x_engine"] == statistics.median(
        r["x_engine"] for r in runs if r["system"] != "engine")
    printed = capsys.readouterr().out
    assert "round 2 of 2" in printed and "over 2 rounds" in printed
    assert out.with_suffix(".png").stat().st_size > 0
