"""The contract between `build_engine` and the compiled-graph runners: the graph's interface, the
range of each dynamic axis, and `<engine_dir>/manifest.json` (what the graph and plan were made from).

`build_engine` writes the manifest last, so a folder with a manifest is complete; the runners read it
at load and refuse, with the reason, an engine that does not fit the engine config they serve.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from backend.engine.batch import GRAPH_INPUTS
from backend.engine.kv_cache import cdiv
from backend.engine.models.config import ModelConfig

MANIFEST_FILE = "manifest.json"
CACHE_INPUT = "kv_cache"
INPUT_NAMES = (*GRAPH_INPUTS, CACHE_INPUT)
OUTPUT_NAMES = ("logits", "new_kv")
# tokens T, logits rows L, attention rows R, row width Q, blocks per row B, scatter pairs P, pool N, block size BS
DYNAMIC_AXES: dict[str, dict[int, str]] = {
    "token_ids": {0: "T"},
    "positions": {0: "T"},
    "row_block_tables": {0: "R", 1: "B"},
    "row_token_index": {0: "R", 1: "Q"},
    "kv_src": {0: "P"},
    "kv_dst": {0: "P"},
    "token_slot": {0: "T"},
    "logits_index": {0: "L"},
    CACHE_INPUT: {2: "N", 3: "BS"},
}


class EngineMismatchError(ValueError):
    """The engine folder was built for something else (model, dtype, TensorRT version or limits)."""


def axis_maxima(max_num_tokens: int, q_tile: int, max_blocks_per_seq: int, num_blocks: int,
                block_size: int) -> dict[str, int]:
    """The largest value each dynamic axis takes under an engine config (see backend/engine/batch.py).

    Rows never outnumber tokens, and logits rows never either (a prompt's logprobs take one per token). Scatter pairs peak when one sequence's chunk fills the budget: row k
    of a chunk receives the chunk's new keys up to its last query, min((k + 1) * Q, chunk)."""
    q = min(q_tile, max_num_tokens)
    pairs = sum(min((k + 1) * q, max_num_tokens) for k in range(cdiv(max_num_tokens, q)))
    return {"T": max_num_tokens, "L": max_num_tokens, "R": max_num_tokens, "Q": q,
            "B": max_blocks_per_seq, "P": pairs, "N": num_blocks, "BS": block_size}


def max_blocks_per_seq(model_config: ModelConfig, num_blocks: int, block_size: int,
                       max_model_len: int | None = None) -> int:
    """Blocks of the longest sequence the engine admits (its context length, as LLMEngine caps it)."""
    limit = min(max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings,
                num_blocks * block_size)
    return cdiv(limit, block_size)


@dataclass(frozen=True)
class AxisRange:
    min: int
    opt: int
    max: int


@dataclass(frozen=True)
class TensorRTPlan:
    plan_file: str
    tensorrt_version: str
    axes: dict[str, AxisRange]  # the optimization profile, per dynamic axis name

    def verify(self, tensorrt_version: str, needed: dict[str, int]) -> None:
        if self.tensorrt_version != tensorrt_version:
            raise EngineMismatchError(f"plan was built with TensorRT {self.tensorrt_version}, this is "
                                      f"{tensorrt_version}: rebuild it (python -m build_engine --runtime tensorrt)")
        if self.axes["BS"].min != needed["BS"]:
            raise EngineMismatchError(f"plan was built for block_size {self.axes['BS'].min}, the engine config "
                                      f"has {needed['BS']}")
        short = [f"{axis} needs {value}, the plan's profile allows up to {self.axes[axis].max}"
                 for axis, value in needed.items() if value > self.axes[axis].max]
        if short:
            raise EngineMismatchError("engine config exceeds the plan's profile (rebuild with larger limits or "
                                      f"lower the engine's): {'; '.join(short)}")


@dataclass(frozen=True)
class EngineManifest:
    model_config: ModelConfig
    dtype: str
    onnx_file: str
    opset: int
    weights: list[list]  # [file name, size, mtime_ns] of the source safetensors, to spot a changed model
    tensorrt: TensorRTPlan | None = None
    graph_inputs: list[str] = dataclasses.field(default_factory=lambda: list(INPUT_NAMES))  # as exported
    quantization: str = "none"  # none, or int8 / int4: the Linears as MatMulNBits (build_engine/quantize_onnx.py)

    def save(self, engine_dir: str | Path) -> None:
        (Path(engine_dir) / MANIFEST_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, engine_dir: str | Path) -> EngineManifest:
        path = Path(engine_dir) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: {engine_dir} is not an engine folder "
                                    "(build one with `python -m build_engine`)")
        raw = json.loads(path.read_text())
        cfg, trt = raw["model_config"], raw["tensorrt"]
        return cls(
            model_config=ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}),
            dtype=raw["dtype"],
            onnx_file=raw["onnx_file"],
            opset=raw["opset"],
            weights=raw["weights"],
            graph_inputs=raw.get("graph_inputs", []),
            quantization=raw.get("quantization", "none"),
            tensorrt=None if trt is None else TensorRTPlan(
                plan_file=trt["plan_file"],
                tensorrt_version=trt["tensorrt_version"],
                axes={name: AxisRange(**r) for name, r in trt["axes"].items()},
            ),
        )

    def verify(self, model_config: ModelConfig, dtype: str, quantization: str = "none") -> None:
        if self.graph_inputs != list(INPUT_NAMES):
            raise EngineMismatchError(f"engine's graph takes {self.graph_inputs or 'other inputs (an older export)'}, "
                                      f"this runner feeds {list(INPUT_NAMES)}: rebuild it (python -m build_engine)")
        if self.dtype != dtype:
            raise EngineMismatchError(f"engine was built for dtype {self.dtype}, the engine config asks for {dtype}")
        if self.quantization != quantization:
            raise EngineMismatchError(f"quantization: engine was built with quantization {self.quantization}, the "
                                      f"engine config asks for {quantization} (build_engine --quantization)")
        if self.model_config != model_config:
            diff = {f.name: (getattr(self.model_config, f.name), getattr(model_config, f.name))
                    for f in dataclasses.fields(ModelConfig)
                    if getattr(self.model_config, f.name) != getattr(model_config, f.name)}
            raise EngineMismatchError(f"engine was built for another model; (engine, model) differ in {diff}")


def weights_fingerprint(model_dir: str | Path) -> list[list]:
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(Path(model_dir).glob("*.safetensors"))]
