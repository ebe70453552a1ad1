"""Weight-only quantization of the exported graph: every Linear becomes ONNX Runtime's `MatMulNBits`.

`quantization: int8 | int4` as the torch runtime reads it (backend/engine/runners/gemm.py), in ONNX Runtime's
own form: blocks of 32 weights along K, each with a float scale and an integer zero point (ORT's round-to-nearest
quantizer, `MatMulNBitsQuantizer`), int8 activations inside the kernel (`accuracy_level` 4, as the torch tactics
q8_0_w8a8 and q4_1_w4a8 do). int4 keeps lm_head in 8 bits, as the torch runtime and llama.cpp's Q4 files do. The
embedding stays float: a step reads a few of its rows, not all of them.

The exporter writes each Linear as `Gemm(x, W, transB=1)`; ORT's quantizer takes `MatMul(x, W^T)`, so the weights
are transposed into that form first (nothing is rounded there).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations: see docs/benchmarks-log.md "Quantized weights" for what level 0 measured
LM_HEAD_BITS = 8


def quantize_linears(path: Path, quantization: str) -> int:
    """Rewrite the graph at `path` (weights in its external data file) in place; returns the Linears quantized."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(str(path))
    linears = _gemms_to_matmuls(model.graph)
    head = [n.name for n in model.graph.node if n.name in linears and linears[n.name].startswith("lm_head")]
    # the layers first, lm_head left out; then lm_head, the one weight MatMul left
    for bits, excluded in ((BITS[quantization], head), (LM_HEAD_BITS, [])):
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=False,
                                         accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=excluded)
        quantizer.process()
        model = quantizer.model.model
    left = [n.name for n in model.graph.node if n.name in linears and n.op_type != "MatMulNBits"]
    if left:
        raise RuntimeError(f"Linears left in float after quantization: {left}")
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=data.name)
    return len(linears)


def _gemms_to_matmuls(graph: onnx.GraphProto) -> dict[str, str]:
    """Each `Gemm(x, W, transB=1)` on a weight becomes `MatMul(x, W^T)` (+ `Add(bias)`); {node: weight name}."""
    weights = {t.name: t for t in graph.initializer}
    linears: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "Gemm" or node.input[1] not in weights:
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (attrs.get("transA", 0), attrs.get("transB", 0), attrs.get("alpha", 1.0), attrs.get("beta", 1.0)) \
                != (0, 1, 1.0, 1.0):
            raise RuntimeError(f"unexpected Linear form {node.name}: {attrs}")
        weight = weights[node.input[1]]
        weight.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T), weight.name))
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        product = f"{node.name}_product" if bias else node.output[0]
        nodes.append(helper.make_node("MatMul", node.input[:2], [product], name=node.name))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], list(node.output), name=f"{node.name}_bias"))
        linears[node.name] = weight.name
    del graph.node[:]
    graph.node.extend(nodes)
    return linears


def dequantized_linears(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """{Linear's module name: its weight [out, in] as the graph's MatMulNBits blocks say, w = (q - zero) * scale}.

    The packing is ONNX Runtime's (contrib op MatMulNBits): B [N, K / block, block * bits / 8] uint8, 4-bit values
    low nibble first; scales [N, K / block]; zero points uint8 [N, blocks] (8 bits) or two per byte (4 bits),
    absent when symmetric (2^(bits - 1))."""
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    linears = {}
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
        blocks = -(-k // block)
        q = _unpack(weights[node.input[1]].reshape(n, -1), bits)[:, :blocks * block].reshape(n, blocks, block)
        scales = weights[node.input[2]].reshape(n, blocks, 1)
        has_zero = len(node.input) > 3 and node.input[3]
        zero = _unpack(weights[node.input[3]].reshape(n, -1), bits)[:, :blocks, None] if has_zero \
            else 2 ** (bits - 1)
        w = ((q.astype(np.float32) - zero) * scales).reshape(n, -1)[:, :k]
        linears[node.input[1].rsplit(".", 1)[0]] = np.ascontiguousarray(w, dtype=np.float32)
    return linears


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 rows of `bits`-bit values, low nibble first, as one value per element."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
