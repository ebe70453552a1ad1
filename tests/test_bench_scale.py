"""load_tests/bench_scale.py's own parts on this machine: the read-bandwidth probe compiles and measures, and the
engine side prefills a batch, then times decode steps in which every sequence of the batch takes a token (it
refuses a step that gives fewer), counting the bytes its GEMM tactics hold. The llama.cpp side needs .venv-llamacpp,
which only the benchmarks build."""

from __future__ import annotations

from pathlib import Path

from backend.engine.models.config import load_model_config
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
