"""The ONNX Runtime runner on the exported graph: greedy outputs equal the torch runner's and HF
`generate` token for token, under chunked prefill and preemption; the bound cache is the runner's
own memory; engine folders are checked and cached."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import onnx
import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.engine.models.config import load_model_config
from backend.engine.runners.manifest import DYNAMIC_AXES, INPUT_NAMES, OUTPUT_NAMES, EngineManifest, EngineMismatchError
from backend.engine.runners.onnx_runner import OnnxRunner
from backend.engine.runners.torch_runner import TorchRunner
from build_engine import export_onnx
from build_engine.export_onnx import EXAMPLE_BLOCK_SIZE, ONNX_FILE, OPSETS, export_engine_dir, sample_batches
from tests.reference import hf_greedy
from tests.test_engine_correctness import SCENARIOS, run, workload


@pytest.fixture(scope="session")
def smollm2_engine_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine_dir = tmp_path_factory.mktemp("smollm2_onnx") / "engine"
    export_engine_dir(smollm2_dir, engine_dir, "float32", OPSETS["onnxruntime"])
    return engine_dir


@functools.cache
def hf_reference(model_dir: Path) -> list[list[int]]:
    """HF greedy outputs for the shared workload (the same for every scenario)."""
    reqs = workload(load_model_config(model_dir).vocab_size)
    return hf_greedy(model_dir, [r.prompt for r in reqs], [r.max_tokens for r in reqs])


def check_against_torch_and_hf(model_dir: Path, engine_dir: Path, scenario: str) -> None:
    settings = dict(model=str(model_dir), **SCENARIOS[scenario])
    onnx_engine = LLMEngine(EngineConfig.create(runtime="onnxruntime", engine_dir=str(engine_dir), **settings))
    reqs = workload(onnx_engine.model_config.vocab_size)
    outs = run(onnx_engine, reqs, use_priority=False)
    # float32 weights, as the graph and HF's reference (the default serves SmolLM2's GGUF as stored)
    torch_outs = run(LLMEngine(EngineConfig.create(quantization="none", **settings)), reqs, use_priority=False)
    refs = hf_reference(model_dir)
    assert [i for i, (o, t) in enumerate(zip(outs, torch_outs)) if o != t] == [], "differs from the torch runner"
    assert [i for i, (o, r) in enumerate(zip(outs, refs)) if o != r] == [], "differs from HF generate"
    assert onnx_engine.kv.num_free_blocks == onnx_engine.kv.num_blocks, "KV blocks leaked"
    if scenario == "preemption":
        assert onnx_engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_tiny_onnx_matches_torch_and_hf(tiny_model_dir, tiny_engine_dir, scenario):
    check_against_torch_and_hf(tiny_model_dir, tiny_engine_dir, scenario)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_smollm2_onnx_matches_torch_and_hf(smollm2_dir, smollm2_engine_dir, scenario):
    check_against_torch_and_hf(smollm2_dir, smollm2_engine_dir, scenario)


def test_graph_interface_is_the_contract(tiny_engine_dir):
    """The exported inputs and outputs, and exactly the dynamic axes the TensorRT profile fills."""
    graph = onnx.load(str(tiny_engine_dir / ONNX_FILE), load_external_data=False).graph
    assert [o.name for o in graph.output] == list(OUTPUT_NAMES)
    assert [i.name for i in graph.input] == list(INPUT_NAMES)
    for value in graph.input:
        dynamic = {axis for axis, dim in enumerate(value.type.tensor_type.shape.dim) if not dim.dim_value}
        assert dynamic == set(DYNAMIC_AXES[value.name]), value.name
    assert {n.op_type for n in graph.node if "kv_cache" in n.input} == {"Shape", "Reshape"}


def test_graph_reads_and_runner_writes_the_bound_cache_in_place(tiny_model_dir, tiny_engine_dir):
    """Random K/V written into the cache tensor after binding are what the graph reads (no copy was
    taken at bind time), and the step's new K/V land in that same tensor, as with the torch runner."""
    batches, num_blocks = sample_batches(load_model_config(tiny_model_dir).vocab_size)
    runner = OnnxRunner(tiny_engine_dir, tiny_model_dir, "float32", num_blocks, EXAMPLE_BLOCK_SIZE)
    reference = TorchRunner(tiny_model_dir, "float32", num_blocks, EXAMPLE_BLOCK_SIZE)
    pointer = runner.kv_cache.data_ptr()
    cache = torch.randn_like(reference.kv_cache)
    runner.kv_cache.copy_(cache)
    reference.kv_cache.copy_(cache)
    for batch in batches:
        torch.testing.assert_close(runner.forward(batch), reference.forward(batch), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(runner.kv_cache, reference.kv_cache, rtol=1e-4, atol=1e-4)
    assert runner.kv_cache.data_ptr() == pointer


def test_engine_folder_is_checked_against_the_engine_config(tiny_model_dir, tiny_engine_dir):
    with pytest.raises(EngineMismatchError, match="dtype float32"):
        OnnxRunner(tiny_engine_dir, tiny_model_dir, "float16", 8, 16)
    with pytest.raises(ValueError, match="no bfloat16 kernels"):
        OnnxRunner(tiny_engine_dir, tiny_model_dir, "bfloat16", 8, 16)
    with pytest.raises(FileNotFoundError, match="not an engine folder"):
        OnnxRunner(tiny_model_dir, tiny_model_dir, "float32", 8, 16)


def test_other_model_is_refused(tiny_engine_dir, tmp_path):
    from tests.tiny_model import make_tiny_llama

    other = make_tiny_llama(tmp_path / "wider", hidden_size=128)
    with pytest.raises(EngineMismatchError, match="hidden_size"):
        OnnxRunner(tiny_engine_dir, other, "float32", 8, 16)


def test_cached_engine_dir_exports_once_and_again_when_weights_change(tiny_model_dir, tiny_engine_dir, tmp_path,
                                                                      monkeypatch):
    """build_engine's cache for tools and tests: <cache>/<model>-<dtype>/, exported only when it is missing or
    the model's weight files changed."""
    monkeypatch.setenv("LLM_ENGINE_CACHE", str(tmp_path))
    exports: list[Path] = []

    def fake_export(model_dir, engine_dir, dtype, opset, quantization="none"):
        exports.append(Path(engine_dir))
        shutil.copytree(tiny_engine_dir, engine_dir, dirs_exist_ok=True)

    monkeypatch.setattr(export_onnx, "export_engine_dir", fake_export)
    first = export_onnx.cached_engine_dir(tiny_model_dir, "float32")
    assert export_onnx.cached_engine_dir(tiny_model_dir, "float32") == first
    assert exports == [tmp_path / f"{tiny_model_dir.name}-float32"]
    LLMEngine(EngineConfig.create(model=str(tiny_model_dir), runtime="onnxruntime", engine_dir=str(first),
                                  num_kv_blocks=32))
    manifest = EngineManifest.load(exports[0])
    manifest.weights[0][2] += 1  # as if the model's safetensors had been rewritten since
    manifest.save(exports[0])
    export_onnx.cached_engine_dir(tiny_model_dir, "float32")
    assert len(exports) == 2


def test_the_engine_never_exports_it_asks_for_engine_dir(tiny_model_dir):
    with pytest.raises(ValueError, match="engine_dir: .*python -m build_engine --runtime onnxruntime"):
        LLMEngine(EngineConfig.create(model=str(tiny_model_dir), runtime="onnxruntime", num_kv_blocks=32))
