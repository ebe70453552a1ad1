"""Random-weight models of the shapes CPU users serve, as GGUF files made by llama.cpp's own tools, so that our engine
and llama.cpp read the same file: transformers' config class -> seeded random bfloat16 safetensors ->
llama.cpp's `convert_hf_to_gguf.py` (the copy llama-cpp-python vendors, run on .venv's torch and transformers with
the packages load_tests/llama_cpp_env.sh adds for it) -> a BF16 GGUF -> `llama_model_quantize` (Q4_K_M, Q8_0...).

The folder holds the HF config, SmolLM2's tokenizer (the converter pads its 49,152 tokens to the shape's vocabulary,
as it pads any) and the quantized file; the float weights and the BF16 file are deleted once quantized. Random
weights: speed only, no quality; a router of random weights spreads tokens over the experts about evenly.

    python -m load_tests.random_gguf --shape qwen3-moe-2.8b-a0.5b [--ftype Q4_K_M]   # prints the folder
    python -m load_tests.random_gguf --shape gpt-oss-1.6b-a0.4b --ftype MXFP4_MOE
    python -m load_tests.random_gguf --shape llama-3.2-1b --ftype hf   # the bfloat16 HF folder, kept (vLLM's input)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from load_tests.bench_offline import LLAMACPP_PYTHON, MODELS_DIR
from load_tests.gguf_variant import QUANTIZE

CONVERTER = next(LLAMACPP_PYTHON.parents[1].glob("lib/python3*/site-packages/bin/convert_hf_to_gguf.py"),
                 LLAMACPP_PYTHON.parents[1] / "convert_hf_to_gguf.py")
CONVERTER_LIBS = LLAMACPP_PYTHON.parents[1] / "converter"  # mistral_common & co. (llama_cpp_env.sh)
# The converter of llama-cpp-python 0.3.16 reads a config through transformers' to_dict(), which transformers 5 writes
# with new names (num_local_experts, rope_parameters); it reads the old ones (num_experts, rope_theta, rope_scaling),
# as the published config.json files have them: this runs it with those names added back.
CONVERT = """
import runpy, sys
converter = runpy.run_path(sys.argv[1], run_name="convert_hf_to_gguf")
load = converter["ModelBase"].load_hparams

def load_hparams(dir_model, is_mistral_format):
    config = load(dir_model, is_mistral_format)
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta"))
    if rope.get("rope_type", "default") != "default":  # gpt-oss's YaRN
        config.setdefault("rope_scaling", rope)
    if "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])
    return config

converter["ModelBase"].load_hparams = staticmethod(load_hparams)
sys.argv = sys.argv[1:]
converter["main"]()
"""


def _qwen3_moe():  # Qwen3-30B-A3B's design, scaled: 2.8B parameters, 0.54B read per token (lm_head included)
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=128, intermediate_size=3072, moe_intermediate_size=768,
                          num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                          max_position_embeddings=32768,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _qwen3_1_7b():  # Qwen3-1.7B's config
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=151936, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, tie_word_embeddings=True,
                       max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _gpt_oss():  # gpt-oss-20b's design (its vocabulary, heads of 64, 8:1 GQA, windows of 128, YaRN), scaled: 1.6B
    from transformers import GptOssConfig  # parameters, 0.39B read per token (lm_head included); --ftype MXFP4_MOE
    return GptOssConfig(vocab_size=201088, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                        num_key_value_heads=2, head_dim=64, intermediate_size=1024, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False)


def _llama_3_2_1b():  # Llama-3.2-1B's config (its llama3 rope scaling, tied embeddings)
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, intermediate_size=8192, tie_word_embeddings=True,
                       max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192})


def _qwen3_4b():  # Qwen3-4B's config
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=151936, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
                       max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _llama_3_8b():  # Llama-3-8B's config
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                       max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


SHAPES: dict[str, Callable] = {"qwen3-moe-2.8b-a0.5b": _qwen3_moe, "qwen3-1.7b": _qwen3_1_7b,
                               "gpt-oss-1.6b-a0.4b": _gpt_oss, "llama-3.2-1b": _llama_3_2_1b, "qwen3-4b": _qwen3_4b,
                               "llama-3-8b": _llama_3_8b}


def save_random_hf(config, folder: Path, seed: int = 0, shard_bytes: int = 1 << 30) -> Path:
    """A transformers config's seeded random bfloat16 weights as an HF folder (safetensors, config, SmolLM2's
    tokenizer). The model is built on the meta device and its modules are given memory one at a time, initialised by
    the model class's own `_init_weights` (as transformers initialises a new model) and written in shards of about
    `shard_bytes` as they fill: an 8B shape takes ~2 GiB of memory here, not its 16 GB. Tensors are written under
    the checkpoint's names and layout, as save_pretrained writes them: transformers 5 holds a Qwen3-MoE layer's experts
    as two 3-D tensors, which llama.cpp's converter does not read; the published files have one Linear per expert."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from backend.serving.model_store import prepare_default_model

    print(f"random {config.model_type}: bfloat16 weights (seed {seed}) -> {folder}", flush=True)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    todo = {id(p): n for n, p in model.named_parameters()}  # each tensor once (a tied lm_head is the embedding's)
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:  # a module's tensors share a shard, so each conversion finds all of its sources in it
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        written = {k: t.contiguous() for k, t in revert_weight_conversion(model, shard).items()}
        save_file(written, tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(written, name))
        shard.clear()

    with torch.no_grad():
        for module in model.modules():
            own = {attr: todo.pop(id(p)) for attr, p in module.named_parameters(recurse=False) if id(p) in todo}
            if not own:
                continue
            module.to_empty(device="cpu", recurse=False)
            model._init_weights(module)
            shard.update({name: getattr(module, attr).data for attr, name in own.items()})
            module.to_empty(device="meta", recurse=False)  # the shard holds the values until it is written
            if sum(t.nbytes for t in shard.values()) >= shard_bytes:
                flush()
    if shard:
        flush()
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # the tensors' bytes, as save_pretrained's
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    model.config.architectures = [type(model).__name__]  # as save_pretrained writes it (llama.cpp's converter reads it)
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer = prepare_default_model(verbose=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, tmp / name)
    tmp.rename(folder)
    return folder


def random_hf(shape: str, seed: int = 0) -> Path:
    """The shape in bfloat16 as an HF folder, kept (what vLLM and our bfloat16 path load), built once."""
    folder = MODELS_DIR / f"random-{shape}-bf16"
    return folder if (folder / "config.json").is_file() else save_random_hf(SHAPES[shape](), folder, seed)


def random_gguf(shape: str, ftype: str = "Q4_K_M", seed: int = 0) -> Path:
    folder = MODELS_DIR / f"random-{shape}-{ftype}"
    out = folder / f"{shape}.{ftype}.gguf"
    if out.is_file():
        return folder
    for need, how in ((LLAMACPP_PYTHON, "load_tests/llama_cpp_env.sh"), (CONVERTER, "llama-cpp-python's converter"),
                      (CONVERTER_LIBS, "load_tests/llama_cpp_env.sh (its converter packages)")):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run {how} first")
    shutil.rmtree(folder / "hf", ignore_errors=True)  # an interrupted run's
    hf = save_random_hf(SHAPES[shape](), folder / "hf", seed)
    bf16 = folder / f"{shape}.bf16.gguf"
    print(f"  llama.cpp's converter -> {bf16.name}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(CONVERTER_LIBS), os.environ.get("PYTHONPATH"))))}
    subprocess.run([sys.executable, "-c", CONVERT, str(CONVERTER), str(hf), "--outtype", "bf16", "--outfile", str(bf16)], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    for f in hf.iterdir():  # the folder keeps the config and tokenizer, not the float weights (gone before quantizing:
        if f.suffix == ".safetensors" or f.name.endswith(".index.json"):  # an 8B's 16 GB twice would not fit the disk)
            f.unlink()
        else:
            f.rename(folder / f.name)
    hf.rmdir()
    print(f"  llama.cpp's quantizer -> {out.name}", flush=True)
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(LLAMACPP_PYTHON), "-c", QUANTIZE, str(bf16), str(tmp), ftype], check=True)
    tmp.replace(out)
    bf16.unlink()
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), required=True)
    p.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's LLAMA_FTYPE_MOSTLY_<FTYPE> (Q4_K_M, Q8_0, ...), or "
                   "hf: the bfloat16 HF folder itself, kept")
    args = p.parse_args()
    print(random_hf(args.shape) if args.ftype == "hf" else random_gguf(args.shape, args.ftype))


if __name__ == "__main__":
    main()
