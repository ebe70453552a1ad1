"""The TensorRT runner on a plan built from the exported graph (GPU hosts with `tensorrt` only): greedy
outputs equal the torch runner's on CUDA and HF `generate`, under chunked prefill and preemption; an
engine config beyond the plan's profile is refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.engine.runners.manifest import EngineMismatchError
from tests.test_engine_correctness import SCENARIOS, run, workload
from tests.test_onnx_runner import hf_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT needs a CUDA device; none here"),
]
trt = pytest.importorskip("tensorrt", reason="tensorrt is not installed (GPU hosts / the Docker image only)")

from build_engine.export_onnx import OPSETS, export_engine_dir  # noqa: E402
from build_engine.tensorrt_build import BuildLimits, build_plan  # noqa: E402

LIMITS = BuildLimits(max_num_tokens=128, max_num_seqs=64, max_blocks_per_seq=64, num_kv_blocks=512, block_size=16,
                     q_tile=16)


@pytest.fixture(scope="session")
def tiny_plan_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine_dir = tmp_path_factory.mktemp("tiny_trt") / "engine"
    export_engine_dir(tiny_model_dir, engine_dir, "float32", OPSETS["tensorrt"])
    build_plan(engine_dir, LIMITS, workspace_gb=1.0)
    return engine_dir


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preemption"])
def test_tiny_tensorrt_matches_torch_and_hf(tiny_model_dir, tiny_plan_dir, scenario):
    settings = {"model": str(tiny_model_dir), "device": "cuda", "num_kv_blocks": LIMITS.num_kv_blocks,
                **SCENARIOS[scenario]}
    engine = LLMEngine(EngineConfig.create(runtime="tensorrt", engine_dir=str(tiny_plan_dir), **settings))
    reqs = workload(engine.model_config.vocab_size)
    outs = run(engine, reqs, use_priority=False)
    torch_outs = run(LLMEngine(EngineConfig.create(**settings)), reqs, use_priority=False)
    assert [i for i, (o, t) in enumerate(zip(outs, torch_outs)) if o != t] == [], "differs from the torch runner"
    assert [i for i, (o, r) in enumerate(zip(outs, hf_reference(tiny_model_dir))) if o != r] == [], \
        "differs from HF generate"
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0


def test_config_beyond_the_profile_is_refused(tiny_model_dir, tiny_plan_dir):
    config = EngineConfig.create(model=str(tiny_model_dir), runtime="tensorrt", engine_dir=str(tiny_plan_dir),
                          device="cuda", num_kv_blocks=LIMITS.num_kv_blocks, max_num_batched_tokens=256)
    with pytest.raises(EngineMismatchError, match="T needs 256"):
        LLMEngine(config)
