"""A GGUF file of a random Llama folder, written as llama.cpp's converter writes one (q/k rows permuted for its
rotary, tensors quantized by gguf-py, llama.cpp's reference rounding), plus a folder of the same model whose float
weights are that file's dequantized values: what `quantization: gguf` must serve without ever making them."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, dequantize, quantize
from safetensors.torch import load_file, save_file


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
    [-bound, bound], so every value is finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
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


def write_gguf(model_dir: Path, out_dir: Path, types: dict[str, str], arch: str = "llama",
               norms: bool = True) -> Path:
    """`out_dir` := model_dir with its weights replaced by their dequantized GGUF values, and `model.gguf` (those
    Linears and the embedding, and the float32 norms) next to them. `types`: GGUF tensor suffix (`attn_q`,
    `ffn_down`, `token_embd`, `output`, ...) -> a type gguf-py quantizes (Q8_0, Q4_0, Q4_1, Q5_0, F16, ...) or one of
    RANDOM_ONLY (random blocks). `arch` and `norms` (False: none written) make files the reader must refuse."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    names = {"model.embed_tokens.weight": ("token_embd.weight", None), "lm_head.weight": ("output.weight", None)}
    for i in range(cfg["num_hidden_layers"]):
        hf, g = f"model.layers.{i}.", f"blk.{i}."
        names.update({hf + "self_attn.q_proj.weight": (g + "attn_q.weight", heads),
                      hf + "self_attn.k_proj.weight": (g + "attn_k.weight", kv_heads),
                      hf + "self_attn.v_proj.weight": (g + "attn_v.weight", None),
                      hf + "self_attn.o_proj.weight": (g + "attn_output.weight", None),
                      hf + "mlp.gate_proj.weight": (g + "ffn_gate.weight", None),
                      hf + "mlp.up_proj.weight": (g + "ffn_up.weight", None),
                      hf + "mlp.down_proj.weight": (g + "ffn_down.weight", None)})
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out_dir / "model.gguf"), arch)
    for hf_name, (name, permute_heads) in names.items():
        w = state[hf_name].numpy()
        if permute_heads:
            w = _permute(w, permute_heads)
        qtype = GGMLQuantizationType[types[name.split(".")[-2]]]
        raw = random_blocks(w, qtype, zlib.crc32(name.encode())) if qtype.name in RANDOM_ONLY else quantize(w, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        back = dequantize(raw, qtype).reshape(w.shape)
        if permute_heads:  # the inverse permutation: rows (half, i) <- (i, half)
            back = back.reshape(permute_heads, back.shape[0] // permute_heads // 2, 2, -1).swapaxes(1, 2).reshape(
                back.shape)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    norm_names = {"model.norm.weight": "output_norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        norm_names.update({f"model.layers.{i}.input_layernorm.weight": f"blk.{i}.attn_norm.weight",
                      f"model.layers.{i}.post_attention_layernorm.weight": f"blk.{i}.ffn_norm.weight"})
    for hf_name, name in norm_names.items() if norms else ():  # float32, as llama.cpp's converter writes norms
        writer.add_tensor(name, state[hf_name].float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy2(f, out_dir / f.name)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
