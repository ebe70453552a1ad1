"""load_tests/bench_scale.py's own parts on this machine: the read-bandwidth probe compiles and measures, and the
engine side prefills a batch, then times decode steps in which every sequence of the batch takes a token (it
refuses a step that gives fewer), counting the bytes its GEMM tactics hold. The llama.cpp side needs .venv-llamacpp,
which only the benchmarks build."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.engine.models.config import load_model_config
from backend.engine.runners import gemm
from load_tests import bench_scale
from tests.test_gguf import Q4_K_M, write_gguf
from tests.tiny_model import make_tiny_llama


def test_the_read_bandwidth_probe_measures_this_machine():
    assert 1.0 < bench_scale.read_bandwidth(2) < 2000.0  # GB/s: DDR4 on one core to HBM


def test_the_engine_side_times_decode_steps_of_the_whole_batch(tmp_path: Path):
    model = make_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64)
    folder = write_gguf(model, tmp_path / "gguf", Q4_K_M)
    gguf_bytes = next(folder.glob("*.gguf")).stat().st_size
    [point] = bench_scale.engine_points(folder, [(3, 40)], steps=4, threads=2, kv_cache_dtype="auto")
    assert (point.batch, point.prompt_len) == (3, 40) and point.prefill_s > 0 and point.decode_step_s > 0
    # its Linears as stored (the embedding is not read by a step; the file's F16 attn_output is float32 here)
    assert 0.5 * gguf_bytes < point.step_bytes < 4 * gguf_bytes
    # a float16 cache: half the KV bytes of 3 sequences at 42 tokens (the middle of the steps), 2 bytes a value
    [half] = bench_scale.engine_points(folder, [(3, 40)], steps=4, threads=2, kv_cache_dtype="float16")
    cfg = load_model_config(folder)
    assert point.step_bytes - half.step_bytes == 3 * 42 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def test_every_gemm_tactics_held_bytes_are_counted():
    """Which tactic a Linear gets is timed on the machine: the bytes must count whichever it is (CI once drew oneDNN,
    whose prepacked weight is an opaque tensor without storage)."""
    weight, bias = torch.randn(96, 64), torch.randn(96)
    for name in ("aten", "onednn"):
        seen: dict[int, int] = {}
        bench_scale._tensors(gemm.TACTICS[name].prepare(weight, bias), seen)
        assert sum(seen.values()) == (96 * 64 + 96) * 4, name


def test_rounds_combine_to_medians_and_ratios_taken_within_a_round():
    def row(rnd: int, system: str, step_ms: float, prefill: float) -> dict:
        return {"round": rnd, "system": system, "file": "m.gguf", "batch": 1, "prompt_len": 128, "step_mb": 100.0,
                "bound_ms": 2.0, "prefill_tok_s": prefill, "prefill_of_int8_rate": 0.5, "decode_step_ms": step_ms,
                "decode_tok_s": 1000 / step_ms, "of_bound": 2.0 / step_ms}

    # the machine slows by half in round 1: both systems' steps take longer, their ratio holds
    per_round = [row(0, "engine", 10.0, 200.0), row(0, "llamacpp", 12.0, 100.0),
                 row(1, "llamacpp", 24.0, 50.0), row(1, "engine", 20.0, 100.0),
                 row(2, "engine", 11.0, 200.0), row(2, "llamacpp", 11.0, 100.0)]
    rows = {r["system"]: r for r in bench_scale.combine(per_round)}
    assert set(rows) == {"engine", "llamacpp"}
    theirs, ours = rows["llamacpp"], rows["engine"]
    assert theirs["decode_step_ms_rounds"] == [12.0, 24.0, 11.0] and theirs["decode_step_ms"] == 12.0
    assert theirs["engine_x_decode_rounds"] == [1.2, 1.2, 1.0] and theirs["engine_x_decode"] == 1.2
    assert theirs["engine_x_prefill"] == 2.0 and ours["engine_x_decode"] == 1.0
    assert ours["decode_step_ms"] == 11.0 and ours["of_bound"] == round(2.0 / 11.0, 3)
