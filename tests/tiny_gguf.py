"""A GGUF file of a random Llama folder, written as llama.cpp's converter writes one (q/k rows permuted for its
rotary, tensors quantized by gguf-py, llama.cpp's reference rounding), plus a folder of the same model whose float
weights are that file's dequantized values: what `quantization: gguf` must serve without ever making them."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, dequantize,
                  get_tensor_name_map, quantize)
from safetensors.torch import load_file, save_file

from backend.engine.models.config import load_model_config
from backend.engine.models.moe import split_stacked_experts


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: per head, HF's rotary halves -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# byte offsets of a block's float16 scales (d, and m or dmin; llama.cpp's structs) where d does not simply lead it
SCALE_OFFSETS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}
# gguf-py cannot round to these: write_gguf writes random blocks
RANDOM_ONLY = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def scale_offsets(qtype: GGMLQuantizationType) -> tuple[int, ...]:
    return SCALE_OFFSETS.get(qtype.name, (0,))


def random_raw(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator, bound: float
               ) -> np.ndarray:
    """Random blocks of `qtype` (uint8 [rows, bytes per row]): random bytes, each float16 scale uniform in
    [-bound, bound], so every value is finite (MXFP4's E8M0 scale: a power of two in 2^-8..2^4, every byte too)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype.name == "MXFP4":
        raw[..., 0] = rng.integers(120, 133, (rows, cols // block))
        raw[0, 0, 0], raw[0, -1, 0] = 0, 1  # and the two subnormal scales
        return raw.reshape(rows, -1)
    for offset in scale_offsets(qtype):
        raw[..., offset:offset + 2] = rng.uniform(-bound, bound, (rows, cols // block, 1)).astype(np.float16).view(
            np.uint8)
    return raw.reshape(rows, -1)


def random_blocks(w: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Seeded random blocks of `qtype` (one gguf-py cannot quantize) whose values have w's standard deviation; the
    model's weights become those values."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def scale(value: float) -> None:
        for offset in scale_offsets(qtype):
            raw[..., offset:offset + 2] = np.array([value], np.float16).view(np.uint8)
    scale(1.0)  # the values are linear in the scales together
    scale(float(w.std() / dequantize(raw.reshape(rows, -1), qtype).std()))
    return raw.reshape(rows, -1)


# model_type -> the architecture llama.cpp's converter writes it as (and whether it permutes q/k rows: LlamaModel)
CONVERTER_ARCH = {"llama": (MODEL_ARCH.LLAMA, True), "mistral": (MODEL_ARCH.LLAMA, True),
                  "mixtral": (MODEL_ARCH.LLAMA, True), "qwen2": (MODEL_ARCH.QWEN2, False),
                  "qwen3": (MODEL_ARCH.QWEN3, False), "qwen3_moe": (MODEL_ARCH.QWEN3MOE, False),
                  "gpt_oss": (MODEL_ARCH.GPT_OSS, False)}
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.(weight|bias)$")


def _experts_apart(state: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked experts as one tensor per expert, gate and up apart, as llama.cpp's converter splits them."""
    inner = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return {k: v for k, v in state.items() if not k.startswith("model.")} | {
        "model." + k: v for k, v in split_stacked_experts(inner, load_model_config(model_dir)).items()}


def _experts_stacked(state: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
    """_experts_apart undone: HF's gpt-oss form, gate and up columns interleaved."""
    cfg = load_model_config(model_dir)
    out = {k: v for k, v in state.items() if not EXPERT.match(k)}
    for i in cfg.moe_layers:
        p = f"model.layers.{i}.mlp.experts."

        def each(name: str, kind: str) -> list[torch.Tensor]:
            return [state[f"{p}{e}.{name}.{kind}"] for e in range(cfg.num_experts)]

        def interleaved(gates: list[torch.Tensor], ups: list[torch.Tensor]) -> torch.Tensor:  # gate 0, up 0, gate 1..
            return torch.stack([torch.stack((g, u), dim=-1).flatten(-2) for g, u in zip(gates, ups)])

        out[p + "gate_up_proj"] = interleaved([w.t() for w in each("gate_proj", "weight")],
                                              [w.t() for w in each("up_proj", "weight")])
        out[p + "gate_up_proj_bias"] = interleaved(each("gate_proj", "bias"), each("up_proj", "bias"))
        out[p + "down_proj"] = torch.stack([w.t() for w in each("down_proj", "weight")])
        out[p + "down_proj_bias"] = torch.stack(each("down_proj", "bias"))
    return {k: v.contiguous() for k, v in out.items()}


def write_gguf(model_dir: Path, out_dir: Path, types: dict[str, str], arch: str | None = None,
               norms: bool = True) -> Path:
    """`out_dir` := model_dir with its weights replaced by their dequantized GGUF values, and `model.gguf` (those
    Linears and the embedding, and the float32 norms and routers) next to them, each named by gguf-py's own map of
    HF names (the converter's), a mixture of experts' per-expert weights stacked into one 3-D tensor per projection
    as the converter stacks them. `types`: GGUF tensor suffix (`attn_q`, `ffn_down`, `ffn_up_exps`, `token_embd`,
    `output`, ...) -> a type gguf-py quantizes (Q8_0, Q4_0, Q4_1, Q5_0, F16, ...) or one of RANDOM_ONLY (random
    blocks). `arch` (another header than the model's) and `norms` (False: none written) make files the reader must
    refuse."""
    cfg = json.loads((model_dir / "config.json").read_text())
    model_arch, permutes = CONVERTER_ARCH[cfg["model_type"]]
    names = get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    state = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    stacked = cfg["model_type"] == "gpt_oss"
    if stacked:
        state = _experts_apart(state, model_dir)
    groups: dict[str, list[str]] = {}  # GGUF name -> the HF weights it holds (an expert stack: one per expert)
    for hf_name in state:
        expert = EXPERT.match(hf_name)
        base, kind = (f"{expert[1]}.{expert[3]}", expert[4]) if expert else (
            hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "weight"))
        groups.setdefault(f"{names.get_name(base)}.{kind}", []).append(hf_name)
    by_expert = lambda h: int(e[2]) if (e := EXPERT.match(h)) else 0  # noqa: E731
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out_dir / "model.gguf"), arch or MODEL_ARCH_NAMES[model_arch])
    for name, hf_names in groups.items():
        if state[hf_names[0]].dim() == 1 or name.endswith("ffn_gate_inp.weight"):
            if norms:  # float32, as llama.cpp's converter writes norms and biases (and its quantizer leaves routers)
                values = [state[h].float().numpy() for h in sorted(hf_names, key=by_expert)]  # experts': stacked
                writer.add_tensor(name, np.stack(values) if len(values) > 1 else values[0])
            continue
        qtype = GGMLQuantizationType[types[name.split(".")[-2]]]
        raws = []
        for hf_name in sorted(hf_names, key=by_expert):
            w = state[hf_name].numpy()
            permute_heads = heads.get(hf_name.split(".")[-2]) if permutes else None
            if permute_heads:
                w = _permute(w, permute_heads)
            raw = (random_blocks(w, qtype, zlib.crc32(hf_name.encode())) if qtype.name in RANDOM_ONLY
                   else quantize(w, qtype))
            back = dequantize(raw, qtype).reshape(w.shape)
            if permute_heads:  # the inverse permutation: rows (half, i) <- (i, half)
                back = back.reshape(permute_heads, back.shape[0] // permute_heads // 2, 2, -1).swapaxes(1, 2).reshape(
                    back.shape)
            state[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
            raws.append(raw)
        writer.add_tensor(name, np.stack(raws) if len(raws) > 1 else raws[0], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy2(f, out_dir / f.name)
    if stacked:
        state = _experts_stacked(state, model_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
