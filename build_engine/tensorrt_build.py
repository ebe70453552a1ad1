"""Build a TensorRT plan from the exported graph (TensorRT 10 Python API) into the same engine folder.

The network is strongly typed: the ONNX graph is exported in the engine dtype, with RMSNorm
statistics and the logits in float32 exactly where PyTorch computes them, and TensorRT keeps those
types. The FP16/BF16 builder flags are for weakly typed networks, where TensorRT picks each layer's
precision itself; TensorRT rejects them on a strongly typed network (and TensorRT 11 is always
strongly typed).

One optimization profile covers every batch the engine config can schedule (see
`backend.engine.runners.manifest.axis_maxima`), tuned for a full decode step. Both outputs have
input-defined shapes (logits [S, V], new_kv [L, 2, T, KVH, D]), so no output allocator is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from backend.engine.runners.manifest import DYNAMIC_AXES, AxisRange, EngineManifest, TensorRTPlan, axis_maxima

PLAN_FILE = "model.plan"


@dataclass(frozen=True)
class BuildLimits:
    max_num_tokens: int  # the engine's max_num_batched_tokens
    max_num_seqs: int
    max_blocks_per_seq: int
    num_kv_blocks: int
    block_size: int
    q_tile: int

    def axes(self) -> dict[str, AxisRange]:
        top = axis_maxima(self.max_num_tokens, self.q_tile, self.max_blocks_per_seq,
                          self.num_kv_blocks, self.block_size)
        decode = min(self.max_num_seqs, self.max_num_tokens)  # a full decode step: one token, one row, one logits
        # row and one scatter pair per sequence
        opt = {"T": decode, "L": decode, "R": decode, "Q": 1, "B": top["B"], "P": decode, "N": top["N"],
               "BS": self.block_size}
        low = {axis: 1 for axis in top} | {"BS": self.block_size}
        return {axis: AxisRange(low[axis], opt[axis], top[axis]) for axis in top}


def build_plan(engine_dir: str | Path, limits: BuildLimits, workspace_gb: float = 4.0) -> Path:
    """Parse `<engine_dir>/model.onnx`, build the plan, write it and add it to the manifest."""
    import tensorrt as trt

    engine_dir = Path(engine_dir)
    manifest = EngineManifest.load(engine_dir)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(engine_dir / manifest.onnx_file)):  # reads the external weights beside it
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {manifest.onnx_file}:\n{errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * 2**30))
    axes = limits.axes()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        named = DYNAMIC_AXES[tensor.name]
        shapes = [tuple(getattr(axes[named[d]], bound) if d in named else size for d, size in enumerate(tensor.shape))
                  for bound in ("min", "opt", "max")]
        profile.set_shape(tensor.name, *shapes)
    config.add_optimization_profile(profile)

    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the plan (see its log above)")
    (engine_dir / PLAN_FILE).write_bytes(bytes(plan))
    replace(manifest, tensorrt=TensorRTPlan(PLAN_FILE, trt.__version__, axes)).save(engine_dir)
    return engine_dir / PLAN_FILE
