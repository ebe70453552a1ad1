"""Export the engine's own PagedLlama (the module TorchRunner runs) to ONNX, check it, and run it once
through ONNX Runtime against PyTorch. One graph serves ONNX Runtime and TensorRT.

- Exporter: `torch.onnx.export(dynamo=True)` (torch.export + onnxscript). The TorchScript exporter
  cannot convert `scaled_dot_product_attention(enable_gqa=True)`.
- Opset per runtime (OPSETS). From opset 23 the exporter emits SDPA as the `Attention` op, which
  takes grouped K/V heads as they are; below, it is MatMul/Softmax over K/V expanded to every query
  head, and ONNX Runtime spends most of a large decode step copying them (SmolLM2, 1 thread, decode
  at 128 tokens of context: batch 32 in 210 ms instead of 400, batch 64 in 390 instead of 760).
  TensorRT gets opset 18: TensorRT 10.0 parses opsets 9..20, and takes `Attention` only from 10.14.
- Every axis that depends on the batch or the pool is dynamic (backend/engine/runners/manifest.py), block
  size included, so one export serves every engine config of a model and dtype.
- The cache is read through block tables only, without any copy of it (see `_fold_cache_selects`).
- Weights go to an external data file beside the graph (no 2 GB protobuf limit).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from backend.engine.batch import ModelInput, build_model_input
from backend.engine.kv_cache import cdiv
from backend.engine.models.config import load_model_config, refuse_beyond_llama
from backend.engine.runners.base import DTYPES
from backend.engine.runners.manifest import (CACHE_INPUT, DYNAMIC_AXES, INPUT_NAMES, MANIFEST_FILE, OUTPUT_NAMES,
                                      EngineManifest, weights_fingerprint)
from backend.engine.runners.torch_runner import TorchRunner
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence
from backend.serving.model_store import REPO_ROOT
from build_engine.quantize_onnx import BITS, BLOCK_SIZE, dequantized_linears, quantize_linears

OPSETS = {"onnxruntime": 23, "tensorrt": 18}
ONNX_FILE = "model.onnx"
# Largest max-abs difference from PyTorch accepted at export, relative to the output's largest |value|
# (float32 sees ~1e-6).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
# Quantized graph: relative L2 distance of its logits from PyTorch's on the values its blocks hold: what is left is
# MatMulNBits's int8 rounding of the activations (accuracy_level 4). Measured: the tiny random Llama 0.036 (int4)
# and 0.029 (int8), SmolLM2 0.012 and 0.008.
QUANTIZED_TOLERANCE = 0.08
EXAMPLE_BLOCK_SIZE = 16
EXAMPLE_Q_TILE = 8

Stage = Callable[[str], AbstractContextManager]


@contextmanager
def _quiet(label: str) -> Iterator[None]:
    yield


@dataclass(frozen=True)
class ExportCheck:
    logits_max_diff: float | None  # None: not compared (see `skipped`)
    new_kv_max_diff: float | None
    skipped: str | None = None
    logits_relative_l2: float | None = None  # a quantized graph's distance from PyTorch on its weights' values

    def __str__(self) -> str:
        if self.skipped:
            return f"not compared with PyTorch: {self.skipped}"
        quantized = "" if self.logits_relative_l2 is None else \
            f", logits relative L2 {self.logits_relative_l2:.3f} (bound {QUANTIZED_TOLERANCE})"
        return (f"max |onnxruntime - torch|: logits {self.logits_max_diff:.2e}, new_kv {self.new_kv_max_diff:.2e}"
                f"{quantized}")


def cached_engine_dir(model_dir: str | Path, dtype: str, quantization: str = "none") -> Path:
    """The ONNX Runtime graph in `$LLM_ENGINE_CACHE` or `<repo>/.cache/engines`, in
    `<model-name>-<dtype>[-<quantization>]/`: exported on first use, and again only when the model's weight files
    (or the opset) change."""
    root = Path(os.environ.get("LLM_ENGINE_CACHE") or REPO_ROOT / ".cache" / "engines")
    engine_dir = root / "-".join([Path(model_dir).name, dtype] + ([quantization] if quantization != "none" else []))
    opset = OPSETS["onnxruntime"]
    try:
        manifest = EngineManifest.load(engine_dir)
        if (manifest.dtype, manifest.opset, manifest.weights, manifest.quantization) == \
                (dtype, opset, weights_fingerprint(model_dir), quantization):
            return engine_dir
    except FileNotFoundError:
        pass
    export_engine_dir(model_dir, engine_dir, dtype, opset, quantization=quantization)
    return engine_dir


def export_engine_dir(model_dir: str | Path, engine_dir: str | Path, dtype: str, opset: int,
                      stage: Stage = _quiet, quantization: str = "none") -> ExportCheck:
    """Export, check and compare into a temporary folder, then move it to `engine_dir` (replaced
    only if it is an engine folder or empty): a folder with a manifest is always complete. With `quantization`
    (int8 | int4) the checked float graph's Linears become MatMulNBits, held to QUANTIZED_TOLERANCE."""
    if quantization not in ("none", *BITS):
        raise ValueError(f"quantization: the exported graph takes none, int8 or int4, not {quantization!r}")
    if quantization != "none" and dtype != "float32":
        raise ValueError(f"quantization: {quantization} graphs are quantized from float32 weights, not {dtype}")
    refuse_beyond_llama(load_model_config(model_dir), "the exported graph (ONNX Runtime, TensorRT)")
    engine_dir = Path(engine_dir)
    if engine_dir.exists() and any(engine_dir.iterdir()) and not (engine_dir / MANIFEST_FILE).is_file():
        raise FileExistsError(f"{engine_dir} exists and is not an engine folder; not replacing it")
    engine_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{engine_dir.name}.", dir=engine_dir.parent))
    try:
        batches, num_blocks = sample_batches(load_model_config(model_dir).vocab_size)
        runner = TorchRunner(model_dir, dtype, num_blocks, EXAMPLE_BLOCK_SIZE, attention="gather",
                             gemm_backend="aten")  # the graph runs F.linear
        runner.forward(batches[0])  # a real prefill fills the cache that the mixed step reads
        with stage(f"exporting {Path(model_dir).name} ({dtype}) to ONNX opset {opset}"):
            export(runner, batches[1], tmp / ONNX_FILE, opset)
        with stage("checking the graph (onnx.checker; the cache is never copied)"):
            check_graph(tmp / ONNX_FILE)
        with stage("running a mixed batch (prefill chunk + decodes) through ONNX Runtime and PyTorch"):
            result = compare_with_torch(runner, batches[1], tmp / ONNX_FILE)
        if quantization != "none":
            with stage(f"quantizing the Linears to {quantization} (MatMulNBits, blocks of {BLOCK_SIZE})"):
                quantize_linears(tmp / ONNX_FILE, quantization)
            with stage("running the mixed batch through the quantized graph and PyTorch on its blocks' values"):
                use_graph_weights(runner, tmp / ONNX_FILE)
                result = compare_with_torch(runner, batches[1], tmp / ONNX_FILE, quantized=True)
        EngineManifest(runner.model_config, dtype, ONNX_FILE, opset, weights_fingerprint(model_dir),
                       quantization=quantization).save(tmp)
        shutil.rmtree(engine_dir, ignore_errors=True)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a server may run as another user
        tmp.rename(engine_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def sample_batches(vocab_size: int, seed: int = 0) -> tuple[list[ModelInput], int]:
    """Two real steps on shuffled blocks: a prefill of five sequences, then a mixed step (a 24-token
    chunk over three attention rows whose last 5 tokens get logits, as a prompt's logprobs ask, and four decodes).
    In the mixed step every dynamic axis is >= 2 and differs from the others (T28 L9 R7 Q8 B6 P52 N19 BS16), so
    torch.export specializes none of them."""
    rng = np.random.default_rng(seed)
    prompts = [50, 17, 33, 90, 9]
    first = [20, 16, 32, 89, 8]  # the decodes' prompts minus their last token
    second = [24, 1, 1, 1, 1]
    seqs = [Sequence(str(i), rng.integers(3, vocab_size, n).tolist(), SamplingParams(), i)
            for i, n in enumerate(prompts)]
    needed = [cdiv(a + b, EXAMPLE_BLOCK_SIZE) for a, b in zip(first, second)]
    num_blocks = sum(needed) + 4
    free = iter(rng.permutation(num_blocks).tolist())
    for seq, n in zip(seqs, needed):
        seq.block_ids = [next(free) for _ in range(n)]
    batches = []
    for chunks, logits_rows in ((first, None), (second, [5, 1, 1, 1, 1])):
        batches.append(build_model_input(list(zip(seqs, chunks)), EXAMPLE_BLOCK_SIZE, EXAMPLE_Q_TILE, logits_rows))
        for seq, n in zip(seqs, chunks):
            seq.num_computed_tokens += n
    return batches, num_blocks


def _example(runner: TorchRunner, batch: ModelInput) -> dict[str, torch.Tensor]:
    return {**{k: torch.from_numpy(v) for k, v in batch.graph_inputs().items()}, CACHE_INPUT: runner.kv_cache}


def export(runner: TorchRunner, batch: ModelInput, path: Path, opset: int) -> None:
    dims: dict[str, torch.export.Dim] = {}
    shapes = {name: {axis: dims.setdefault(dim, torch.export.Dim(dim)) for axis, dim in axes.items()}
              for name, axes in DYNAMIC_AXES.items()}
    with torch.inference_mode():
        program = torch.onnx.export(runner.model, (), kwargs=_example(runner, batch), dynamo=True,
                                    dynamic_shapes=shapes, input_names=list(INPUT_NAMES),
                                    output_names=list(OUTPUT_NAMES), opset_version=opset, verbose=False)
    program.save(str(path), external_data=True)
    graph_only = onnx.load(str(path), load_external_data=False)
    _fold_cache_selects(graph_only.graph)
    onnx.save(graph_only, str(path))


def _fold_cache_selects(graph: onnx.GraphProto) -> None:
    """Read every cache block straight from the whole cache, viewed as rows [L * 2 * N, BS, KVH, D].

    The exporter writes `kv_cache[layer, k_or_v][block_tables]` as Gather -> Gather -> GatherND.
    ONNX Runtime materializes each Gather (it even fuses them into a Split of the whole cache), so
    every step would copy the cache (SmolLM2, batch 8, 1 thread: 21 ms of a 91 ms decode step with a
    56 MiB pool, growing with the pool). A Reshape aliases its input, so we gather row
    (layer * 2 + k_or_v) * N + block of the reshaped cache instead.
    """
    all_nodes = list(graph.node)
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in all_nodes:
        for name in node.input:
            consumers[name].append(node)
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer
                 if t.data_location != TensorProto.EXTERNAL}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in all_nodes
                      if n.op_type == "Constant" and n.attribute[0].name == "value"})
    cache = next(i for i in graph.input if i.name == CACHE_INPUT)
    leading = [d.dim_value for d in cache.type.tensor_type.shape.dim[:2]]  # layers, 2

    selects: list[onnx.NodeProto] = []  # kv_cache[layer], then [k_or_v]
    reads: list[tuple[onnx.NodeProto, int]] = []  # (block gather, its row (layer * 2 + k_or_v))

    def walk(tensor: str, depth: int, row: int) -> None:
        for node in consumers[tensor]:
            if depth == 0 and node.op_type == "Shape":
                continue  # reads the dims only
            if depth < len(leading):
                index = constants.get(node.input[1]) if node.op_type == "Gather" else None
                if index is None or index.ndim != 0 or _attr(node, "axis") != 0:
                    raise RuntimeError(f"unexpected read of the KV cache: {node.op_type} {node.name}")
                selects.append(node)
                walk(node.output[0], depth + 1, row * leading[depth] + int(index))
            elif node.input[0] == tensor and _gathers_axis0(node):
                reads.append((node, row))
            else:
                raise RuntimeError(f"unexpected read of a KV cache slice: {node.op_type} {node.name}")

    walk(CACHE_INPUT, 0, 0)
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "kv_rows_lead"))
    front = [
        helper.make_node("Shape", [CACHE_INPUT], ["kv_num_blocks"], start=2, end=3),
        helper.make_node("Shape", [CACHE_INPUT], ["kv_row_shape_tail"], start=3),
        helper.make_node("Concat", ["kv_rows_lead", "kv_row_shape_tail"], ["kv_row_shape"], axis=0),
        helper.make_node("Reshape", [CACHE_INPUT, "kv_row_shape"], ["kv_rows"]),
    ]
    before: dict[int, list[onnx.NodeProto]] = {}
    for i, (node, row) in enumerate(reads):
        base = f"kv_read{i}"
        graph.initializer.append(helper.make_tensor(f"{base}_row", TensorProto.INT64, [1], [row]))
        before[id(node)] = [
            helper.make_node("Mul", ["kv_num_blocks", f"{base}_row"], [f"{base}_offset"]),
            helper.make_node("Add", [node.input[1], f"{base}_offset"], [f"{base}_index"]),
        ]
        node.input[0], node.input[1] = "kv_rows", f"{base}_index"
    dropped = {id(n) for n in selects}
    nodes = front + [m for n in all_nodes if id(n) not in dropped for m in (*before.get(id(n), ()), n)]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for n in nodes for name in n.input}
    orphans = {n.input[1] for n in selects} - used
    kept = [t for t in graph.initializer if t.name not in orphans]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), 0)


def _gathers_axis0(node: onnx.NodeProto) -> bool:
    return (node.op_type == "Gather" and _attr(node, "axis") == 0) or \
        (node.op_type == "GatherND" and _attr(node, "batch_dims") == 0)


def check_graph(path: Path) -> None:
    """onnx.checker (path-based: works past 2 GB), and the cache is only reshaped, never copied."""
    onnx.checker.check_model(str(path))
    graph = onnx.load(str(path), load_external_data=False).graph
    readers = {n.op_type for n in graph.node if CACHE_INPUT in n.input}
    if not readers <= {"Shape", "Reshape"}:
        raise RuntimeError(f"the graph reads the KV cache through {sorted(readers)}: that copies it every step")


def use_graph_weights(runner: TorchRunner, path: Path) -> None:
    """Give the runner's Linears the float values of the quantized graph's blocks (F.linear on them)."""
    for name, weight in dequantized_linears(onnx.load(str(path)).graph).items():
        linear = runner.model.get_submodule(name)
        linear.weight, linear.gemm = nn.Parameter(torch.from_numpy(weight), requires_grad=False), None


def compare_with_torch(runner: TorchRunner, batch: ModelInput, path: Path, quantized: bool = False) -> ExportCheck:
    """Run `batch` through ONNX Runtime (CPU) and the PyTorch module on the same cache; raise past TOLERANCE
    (a quantized graph, against PyTorch on its weights' values: past QUANTIZED_TOLERANCE, relative L2 of the
    logits)."""
    import onnxruntime as ort

    dtype = next(name for name, t in DTYPES.items() if t == runner.kv_cache.dtype)
    if dtype not in TOLERANCE:
        return ExportCheck(None, None, f"onnxruntime's CPU provider has no {dtype} kernels (Mul, MatMul)")
    inputs = _example(runner, batch)
    with torch.inference_mode():
        logits, new_kv = runner.model(**inputs)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ort_logits, ort_new_kv = session.run(list(OUTPUT_NAMES), {name: t.numpy() for name, t in inputs.items()})
    result = ExportCheck(float(np.abs(ort_logits - logits.numpy()).max()),
                         float(np.abs(ort_new_kv - new_kv.numpy()).max()))
    if quantized:
        error = float(np.linalg.norm(ort_logits - logits.numpy()) / np.linalg.norm(logits.numpy()))
        result = dataclasses.replace(result, logits_relative_l2=error)
        if error > QUANTIZED_TOLERANCE:
            raise RuntimeError(f"the quantized graph is too far from PyTorch on its weights' values: {result}")
    elif (result.logits_max_diff > TOLERANCE[dtype] * float(logits.abs().max())
            or result.new_kv_max_diff > TOLERANCE[dtype] * float(new_kv.abs().max())):
        raise RuntimeError(f"the exported graph disagrees with PyTorch: {result}")
    return result
