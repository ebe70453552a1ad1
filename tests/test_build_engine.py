"""build_engine without a GPU: the llm config.pbtxt rewrite, the profile ranges against real batches,
the manifest checks a runner makes at load, and the TensorRT build driven through a stand-in for the
`tensorrt` module (the real one runs in tests/test_tensorrt_runner.py on GPU hosts)."""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from backend.engine.batch import build_model_input
from backend.engine.models.config import ModelConfig
from backend.engine.runners.manifest import (DYNAMIC_AXES, INPUT_NAMES, OUTPUT_NAMES, AxisRange, EngineManifest,
                                      EngineMismatchError, TensorRTPlan, axis_maxima)
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence
from backend.triton.repository import REPOSITORY, set_string_parameters, string_parameters
from build_engine.llm_config import update_llm_config
from build_engine.tensorrt_build import BuildLimits, build_plan

SAMPLE_CONFIG = """\
name: "llm"
backend: "python"
# Engine settings
parameters { key: "model" value: { string_value: "default" } }
parameters: {
  key: "runtime"
  value: { string_value: "torch" }
}
parameters { key: "dtype" value: { string_value: "float32" } }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

CONFIG = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, attention_bias=False, eos_token_ids=(2,))


def test_update_llm_config_sets_existing_keys_and_adds_missing_ones(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(SAMPLE_CONFIG)
    update_llm_config(path, "tensorrt", tmp_path / "engines" / ".." / "engine", "bfloat16")
    text = path.read_text()
    assert 'key: "runtime"\n  value: { string_value: "tensorrt" }' in text
    assert 'parameters { key: "dtype" value: { string_value: "bfloat16" } }\n' in text
    engine_line = f'parameters {{ key: "engine_dir" value: {{ string_value: "{tmp_path / "engine"}" }} }}'
    assert engine_line in text
    assert text.index(engine_line) > text.index('key: "dtype"'), "added after the last parameters entry"
    unchanged = [line for line in SAMPLE_CONFIG.splitlines() if "torch" not in line and "float32" not in line]
    assert all(line in text for line in unchanged)
    assert set_string_parameters(text, {"runtime": "tensorrt"}) == text


def test_string_values_are_escaped_and_config_without_parameters_gets_them():
    text = set_string_parameters('name: "llm"\n', {"engine_dir": 'C:\\engines\\"x"'})
    assert text == 'name: "llm"\nparameters { key: "engine_dir" value: { string_value: "C:\\\\engines\\\\\\"x\\"" } }\n'


def test_string_parameters_read_back_what_was_written():
    text = set_string_parameters(SAMPLE_CONFIG, {"runtime": "tensorrt", "engine_dir": 'C:\\e\\"x"'})
    assert string_parameters(text) == {**string_parameters(SAMPLE_CONFIG), "runtime": "tensorrt",
                                       "engine_dir": 'C:\\e\\"x"'}
    shipped = string_parameters((REPOSITORY / "llm" / "config.pbtxt").read_text())
    assert shipped["model"] == "default" and shipped["quantization"] == "auto" and len(shipped) > 20


def _random_batch(rng: random.Random, max_tokens: int, max_seqs: int, q_tile: int, block_size: int):
    scheduled, budget = [], max_tokens
    while budget and len(scheduled) < max_seqs:
        computed = rng.randrange(0, 200)
        n = min(budget, rng.choice([1, 1, rng.randrange(1, max_tokens + 1)]))
        seq = Sequence(str(len(scheduled)), [5] * (computed + n), SamplingParams(), len(scheduled))
        seq.num_computed_tokens = computed
        seq.block_ids = list(range(-(-(computed + n) // block_size)))
        scheduled.append((seq, n))
        budget -= n
    return build_model_input(scheduled, block_size, q_tile)


@pytest.mark.parametrize("max_tokens,q_tile", [(64, 16), (37, 4), (512, 16)])
def test_axis_maxima_bound_every_batch_and_are_reached(max_tokens, q_tile):
    rng = random.Random(max_tokens)
    top = axis_maxima(max_tokens, q_tile, max_blocks_per_seq=64, num_blocks=100, block_size=16)
    for _ in range(200):
        b = _random_batch(rng, max_tokens, 8, q_tile, 16)
        seen = {"T": b.num_tokens, "L": len(b.logits_index), "R": len(b.row_block_tables), "Q": b.row_token_index.shape[1],
                "B": b.row_block_tables.shape[1], "P": len(b.kv_src)}
        assert all(seen[axis] <= top[axis] for axis in seen), (seen, top)
    seq = Sequence("0", [5] * max_tokens, SamplingParams(), 0)
    seq.block_ids = list(range(-(-max_tokens // 16)))
    one_chunk = build_model_input([(seq, max_tokens)], 16, q_tile, logits_rows=[max_tokens])
    assert len(one_chunk.kv_src) == top["P"], "a single full chunk has the most scatter pairs"
    assert len(one_chunk.logits_index) == top["L"], "a prompt's logprobs take logits for every token of its chunk"


def test_plan_verify_names_what_does_not_fit():
    axes = BuildLimits(max_num_tokens=128, max_num_seqs=16, max_blocks_per_seq=64, num_kv_blocks=256,
                       block_size=16, q_tile=16).axes()
    plan = TensorRTPlan("model.plan", "10.3.0", axes)
    fits = axis_maxima(128, 16, 64, 256, 16)
    plan.verify("10.3.0", fits)
    with pytest.raises(EngineMismatchError, match="TensorRT 10.3.0, this is 10.4.0"):
        plan.verify("10.4.0", fits)
    with pytest.raises(EngineMismatchError, match="block_size 16, the engine config has 32"):
        plan.verify("10.3.0", axis_maxima(128, 16, 64, 256, 32))
    with pytest.raises(EngineMismatchError, match="T needs 512.*N needs 1000"):
        plan.verify("10.3.0", axis_maxima(512, 16, 64, 1000, 16))


def test_manifest_round_trip_and_mismatch_messages(tmp_path):
    plan = TensorRTPlan("model.plan", "10.3.0", {"T": AxisRange(1, 8, 64)})
    manifest = EngineManifest(CONFIG, "bfloat16", "model.onnx", 18, [["model.safetensors", 1, 2]], plan)
    manifest.save(tmp_path)
    assert EngineManifest.load(tmp_path) == manifest
    manifest.verify(CONFIG, "bfloat16")
    with pytest.raises(EngineMismatchError, match="dtype bfloat16"):
        manifest.verify(CONFIG, "float32")
    with pytest.raises(EngineMismatchError, match="num_layers"):
        manifest.verify(ModelConfig(**{**CONFIG.__dict__, "num_layers": 3}), "bfloat16")
    raw = json.loads((tmp_path / "manifest.json").read_text())
    del raw["graph_inputs"]  # an engine exported before the graph took logits_index
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(EngineMismatchError, match="an older export.*rebuild it"):
        EngineManifest.load(tmp_path).verify(CONFIG, "bfloat16")


def _interface_only_onnx(path: Path) -> None:
    """A graph with the exported graph's inputs and outputs (no nodes): all the stand-in parser reads."""
    cache_shape = [CONFIG.num_layers, 2, 0, 0, CONFIG.num_kv_heads, CONFIG.head_dim]
    shapes = {name: [0] * (max(DYNAMIC_AXES[name]) + 1) for name in INPUT_NAMES} | {"kv_cache": cache_shape}
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64 if name != "kv_cache" else TensorProto.FLOAT,
                                            [DYNAMIC_AXES[name].get(d, s) for d, s in enumerate(shapes[name])])
              for name in INPUT_NAMES]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in OUTPUT_NAMES]
    onnx.save(helper.make_model(helper.make_graph([], "interface", inputs, outputs)), str(path))


class _StandInTensorRT(types.ModuleType):
    """Just the TensorRT 10 Python API that build_plan uses, recording the profile it is given."""

    __version__ = "10.3.0"

    def __init__(self):
        super().__init__("tensorrt")
        self.profile: dict[str, tuple] = {}
        self.flags: list[int] = []
        trt = self

        class Logger:
            WARNING = 2

            def __init__(self, severity):
                pass

        class Network:
            def __init__(self):
                self.inputs = []

            @property
            def num_inputs(self):
                return len(self.inputs)

            def get_input(self, i):
                return self.inputs[i]

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                self.network = network

            def parse_from_file(self, path):
                for value in onnx.load(path).graph.input:
                    dims = tuple(d.dim_value if not d.dim_param else -1 for d in value.type.tensor_type.shape.dim)
                    self.network.inputs.append(types.SimpleNamespace(name=value.name, shape=dims))
                return True

        class Profile:
            def set_shape(self, name, low, opt, high):
                trt.profile[name] = (low, opt, high)

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                trt.flags.append(flags)
                return Network()

            def create_builder_config(self):
                return types.SimpleNamespace(set_memory_pool_limit=lambda pool, size: None,
                                             add_optimization_profile=lambda profile: None)

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                return b"plan"

        self.Logger, self.OnnxParser, self.Builder = Logger, OnnxParser, Builder
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1)
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)


def test_build_plan_gives_every_input_a_profile_within_the_limits(tmp_path, monkeypatch):
    _interface_only_onnx(tmp_path / "model.onnx")
    EngineManifest(CONFIG, "float32", "model.onnx", 18, []).save(tmp_path)
    trt = _StandInTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    limits = BuildLimits(max_num_tokens=256, max_num_seqs=32, max_blocks_per_seq=64, num_kv_blocks=300,
                         block_size=16, q_tile=16)
    plan = build_plan(tmp_path, limits)

    assert plan.read_bytes() == b"plan" and trt.flags == [1 << 1], "strongly typed network"
    assert set(trt.profile) == set(INPUT_NAMES)
    L, KVH, D = CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim
    assert trt.profile["kv_cache"] == ((L, 2, 1, 16, KVH, D), (L, 2, 300, 16, KVH, D), (L, 2, 300, 16, KVH, D))
    assert trt.profile["token_ids"] == ((1,), (32,), (256,))
    assert trt.profile["row_token_index"] == ((1, 1), (32, 1), (256, 16))
    assert trt.profile["kv_src"][2] == (axis_maxima(256, 16, 64, 300, 16)["P"],)
    manifest = EngineManifest.load(tmp_path)
    assert manifest.tensorrt == TensorRTPlan("model.plan", "10.3.0", limits.axes())
    manifest.tensorrt.verify("10.3.0", axis_maxima(256, 16, 64, 300, 16))
