"""bench_online --rounds on a real tritonserver (the tiny Llama): every round starts the servers and the offline
engine afresh; ratios are taken within a round, and the report's rows are each system's median round."""

from __future__ import annotations

import json
import statistics

from load_tests import bench_online
from load_tests.streams import triton_sse_stream


def test_rounds_rerun_every_system_and_report_the_ratios_median(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "online"
    bench_online.main(["--model", str(tiny_model_dir), "--systems", "ours", "--rates", "4", "--num-requests", "3",
                       "--rounds", "2", "--threads", "1", "--out", str(out)])
    report = json.loads((out / "online.json").read_text())
    runs, offline = report["results"], report["offline_rounds"]
    assert report["errors"] == {} and report["info"]["rounds"] == 2
    assert [(r["system"], r["rate"], r["round"]) for r in runs] == [
        ("ours", rate, k) for k in range(2) for rate in ("4", "burst")]
    assert all(not r["failures"] and r["completed"] == r["sent"] == 3 for r in runs)
    bursts = [r["output_tok_s"] for r in runs if r["rate"] == "burst"]
    served = [round(b / o["engine"]["tok_s"], 3) for b, o in zip(bursts, offline)]
    assert report["summary"]["rounds"] == {
        "ours served over offline": {"median": statistics.median(served), "each": served}}
    assert report["summary"]["saturation_tok_s"] == {"ours": min(bursts)}  # the lower middle of two rounds
    printed = capsys.readouterr().out
    assert "Over 2 rounds" in printed and "ours served over offline" in printed
    assert (out / "throughput.png").stat().st_size > 0


def test_http_protocol_streams_from_tritons_generate_stream(tiny_model_dir, tmp_path, monkeypatch):
    streams = []  # the model each request streamed from; the stream itself is the real one

    def counted(*args, **kwargs):
        streams.append(args[2])
        return triton_sse_stream(*args, **kwargs)

    monkeypatch.setattr(bench_online, "triton_sse_stream", counted)
    out = tmp_path / "online"
    bench_online.main(["--model", str(tiny_model_dir), "--systems", "ours", "--rates", "4", "--num-requests", "3",
                       "--protocol", "http", "--no-offline", "--threads", "1", "--out", str(out)])
    report = json.loads((out / "online.json").read_text())
    assert report["errors"] == {} and report["info"]["protocol"] == "http"
    runs = report["results"]
    assert [r["rate"] for r in runs] == ["4", "burst"]
    assert all(not r["failures"] and r["completed"] == r["sent"] == 3 for r in runs)
    assert all(r["output_tokens"] == report["info"]["output_tokens"] for r in runs if r["rate"] == "burst")
    assert "ours streamed over http" in (out / "online.md").read_text()
    assert streams == ["llm"] * (2 + 3 + 3)  # the warm-up's, the rate's and the burst's requests, all over generate_stream


def test_the_dynamo_door_is_served_and_held_to_the_offline_engine(tiny_model_dir, tmp_path):
    """`dynamo`: Dynamo's frontend and one worker of our engine (.venv-dynamo), streamed over its OpenAI API."""
    out = tmp_path / "online"
    bench_online.main(["--model", str(tiny_model_dir), "--systems", "dynamo", "--rates", "4", "--num-requests", "3",
                       "--threads", "1", "--out", str(out)])
    report = json.loads((out / "online.json").read_text())
    assert report["errors"] == {}
    runs = report["results"]
    assert [(r["system"], r["rate"]) for r in runs] == [("dynamo", "4"), ("dynamo", "burst")]
    assert all(not r["failures"] and r["completed"] == r["sent"] == 3 and r["server_cpu_s"] > 0 for r in runs)
    burst = runs[-1]
    assert burst["output_tokens"] == report["info"]["output_tokens"]
    assert report["summary"]["served_over_offline@dynamo"] == round(
        burst["output_tok_s"] / report["offline_rounds"][0]["engine"]["tok_s"], 3)
    assert (out / "dynamo-logs" / "worker0.log").is_file()
