"""`quantization: int8 | int4` on the ONNX Runtime runner: the exported graph's Linears as MatMulNBits.

Exactness is checked where the arithmetic allows it: with float activations (`accuracy_level` 0) the quantized
graph computes what its blocks hold, so its greedy outputs equal the torch engine's run on those same weight values
token for token, under chunked prefill and preemption. The shipped build rounds activations to int8 too
(`accuracy_level` 4), held to QUANTIZED_TOLERANCE at export; here it must serve a workload to the end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from backend.engine import EngineConfig, LLMEngine
from backend.engine.runners.manifest import EngineMismatchError
from backend.engine.runners.onnx_runner import OnnxRunner
from build_engine import quantize_onnx
from build_engine.__main__ import parse_args
from build_engine.export_onnx import ONNX_FILE, OPSETS, export_engine_dir, use_graph_weights
from tests.test_engine_correctness import SCENARIOS, run, workload


def _export(model_dir: Path, engine_dir: Path, quantization: str):
    return export_engine_dir(model_dir, engine_dir, "float32", OPSETS["onnxruntime"], quantization=quantization)


@pytest.fixture(scope="module")
def float_activation_engines(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """int8 and int4 graphs whose MatMulNBits keep activations in float32 (accuracy_level 0)."""
    root = tmp_path_factory.mktemp("onnx_quantized_acc0")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantize_onnx, "ACCURACY_LEVEL", 0)
        checks = {q: _export(tiny_model_dir, root / q, q) for q in ("int8", "int4")}
    for check in checks.values():
        assert check.logits_relative_l2 < 1e-5, check  # the export compared the graph with its blocks' values
    return {q: root / q for q in checks}


@pytest.fixture(scope="module")
def int4_engine(tiny_model_dir, tmp_path_factory) -> Path:
    engine_dir = tmp_path_factory.mktemp("onnx_int4") / "engine"
    _export(tiny_model_dir, engine_dir, "int4")
    return engine_dir


def _matmul_nbits(engine_dir: Path) -> list[dict]:
    graph = onnx.load(str(engine_dir / ONNX_FILE), load_external_data=False).graph
    assert not [n.name for n in graph.node if n.op_type in ("Gemm", "MatMul")], "a Linear left in float"
    return [{a.name: helper.get_attribute_value(a) for a in n.attribute} | {"weight": n.input[1]}
            for n in graph.node if n.op_type == "MatMulNBits"]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_every_linear_is_matmul_nbits_in_its_bits(float_activation_engines, quantization):
    """Layers in the setting's bits and lm_head in 8, blocks of 32, each a float32 scale and a uint8 zero point
    (two per byte in 4 bits): what the graph stores per weight."""
    engine_dir = float_activation_engines[quantization]
    nodes = _matmul_nbits(engine_dir)
    layers = [n for n in nodes if n["weight"].startswith("layers.")]
    assert len(layers) == 4 * 2 and len(nodes) == len(layers) + 1  # qkv, o, gate_up, down per layer; lm_head
    head_bits = {n["bits"] for n in nodes if n["weight"].startswith("lm_head")}
    assert ({n["bits"] for n in layers}, head_bits) == ({quantize_onnx.BITS[quantization]}, {8})
    assert {n["block_size"] for n in nodes} == {32}
    graph = onnx.load(str(engine_dir / ONNX_FILE), load_external_data=False).graph
    size = {t.name: np.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize for t in graph.initializer}
    stored = sum(size[name] for n in graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("layers.")
                 for name in n.input[1:4])
    value = quantize_onnx.BITS[quantization] / 8  # bytes of a weight, and of a block's zero point
    assert stored == sum(n["K"] * n["N"] for n in layers) * (value + (4 + value) / 32)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_float_activation_graph_matches_torch_on_its_weights(tiny_model_dir, float_activation_engines,
                                                              quantization, scenario):
    engine_dir = float_activation_engines[quantization]
    settings = dict(model=str(tiny_model_dir), **SCENARIOS[scenario])
    onnx_engine = LLMEngine(EngineConfig.create(runtime="onnxruntime", engine_dir=str(engine_dir),
                                                quantization=quantization, **settings))
    torch_engine = LLMEngine(EngineConfig.create(gemm_backend="aten", attention="gather", **settings))
    use_graph_weights(torch_engine.runner, engine_dir / ONNX_FILE)
    float_engine = LLMEngine(EngineConfig.create(**settings))
    reqs = workload(onnx_engine.model_config.vocab_size)
    outs = run(onnx_engine, reqs, use_priority=False)
    assert outs == run(torch_engine, reqs, use_priority=False)
    assert outs != run(float_engine, reqs, use_priority=False), "the weights were meant to be rounded"
    assert onnx_engine.kv.num_free_blocks == onnx_engine.kv.num_blocks, "KV blocks leaked"


def test_int8_activation_graph_serves_a_workload(tiny_model_dir, int4_engine):
    engine = LLMEngine(EngineConfig.create(model=str(tiny_model_dir), runtime="onnxruntime",
                                           engine_dir=str(int4_engine), quantization="int4",
                                           **SCENARIOS["chunked_prefill"]))
    reqs = workload(engine.model_config.vocab_size)
    outs = run(engine, reqs, use_priority=False)
    assert [len(o) for o in outs] == [r.max_tokens for r in reqs]
    assert {n["accuracy_level"] for n in _matmul_nbits(int4_engine)} == {4}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"


def test_quantization_must_match_the_engine_folder(tiny_model_dir, int4_engine, tiny_engine_dir):
    with pytest.raises(EngineMismatchError, match="quantization: engine was built with quantization int4"):
        OnnxRunner(int4_engine, tiny_model_dir, "float32", 8, 16)
    with pytest.raises(EngineMismatchError, match="built with quantization none, the engine config asks for int8"):
        OnnxRunner(tiny_engine_dir, tiny_model_dir, "float32", 8, 16, quantization="int8")


def test_export_and_build_engine_refuse_by_name(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="quantization: int4 graphs are quantized from float32 weights, not float16"):
        export_engine_dir(tiny_model_dir, tmp_path / "e", "float16", OPSETS["onnxruntime"], quantization="int4")
    with pytest.raises(ValueError, match="quantization: the exported graph takes none, int8 or int4, not 'gguf'"):
        _export(tiny_model_dir, tmp_path / "e", "gguf")
    with pytest.raises(SystemExit):
        parse_args(["--output", str(tmp_path), "--runtime", "tensorrt", "--quantization", "int4"])
    assert "--quantization int4: quantized graphs are built for --runtime onnxruntime" in capsys.readouterr().err
