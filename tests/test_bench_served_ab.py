"""bench_served_ab on a real tritonserver (the tiny Llama): B's stub runs the `backend` of --b-tree (here a folder
whose `backend` links to this tree's, so the stub's check that its package lives under --b-tree is what lets the
model load), and each pair's ratios are A's figures over B's."""

from __future__ import annotations

import json
import statistics

import pytest

from backend.engine.kernels.cpu_kernels import REPO_ROOT
from load_tests import bench_served_ab


def test_pairs_alternate_between_this_tree_and_the_b_tree(tiny_model_dir, tmp_path, capsys):
    b_tree = tmp_path / "b"
    b_tree.mkdir()
    (b_tree / "backend").symlink_to(REPO_ROOT / "backend")
    out = tmp_path / "ab"
    bench_served_ab.main(["--b-tree", str(b_tree), "--model", str(tiny_model_dir), "--quantization", "none",
                          "--streams", "2", "--pairs", "3", "--max-tokens", "8", "--threads", "1", "--out", str(out)])
    report = json.loads((out / "served_ab.json").read_text())
    assert report["b_tree"] == str(b_tree.resolve()) and len(report["pairs"]) == 3
    for p in report["pairs"]:
        assert min(p["a_itl_ms_p50"], p["b_itl_ms_p50"], p["a_tok_s"], p["b_tok_s"]) > 0
        assert p["itl_a_over_b"] == pytest.approx(p["a_itl_ms_p50"] / p["b_itl_ms_p50"], rel=1e-3)
        assert p["tok_s_a_over_b"] == pytest.approx(p["a_tok_s"] / p["b_tok_s"], rel=1e-3)
    itl = statistics.median(p["itl_a_over_b"] for p in report["pairs"])
    assert report["itl_a_over_b"]["median"] == round(itl, 4)
    # the line prints the report's median (rounded to 4 places first: 0.245549 prints 0.245, not 0.246)
    assert f"ITL p50 {report['itl_a_over_b']['median']:.3f}" in capsys.readouterr().out


def test_a_b_tree_without_a_backend_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="holds no backend package"):
        bench_served_ab.main(["--b-tree", str(tmp_path)])
