"""The default model's GGUF requantized by llama.cpp itself into another file type (Q4_K_M by default, the type
most GGUF files on the hub have), in a model folder of its own beside the default one: the benchmarks' way to serve
a K-quant file without fetching one. Its folder links the default model's config, tokenizer and float weights.

The shipped file is Q4_1, so a Q4_K_M made from it is rounded twice (llama.cpp's `allow_requantize`): fine for
comparing two servers on one file, not for judging Q4_K_M's own quality. Runs llama.cpp's `llama_model_quantize` in
.venv-llamacpp (load_tests/llama_cpp_env.sh).

    python -m load_tests.gguf_variant [--ftype Q4_K_M]   # prints the folder
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from backend.engine.models.gguf_weights import gguf_file
from backend.serving.model_store import prepare_default_model
from load_tests.bench_offline import LLAMACPP_PYTHON

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def gguf_variant(ftype: str = "Q4_K_M") -> Path:
    source = prepare_default_model(verbose=False)
    folder = source.parent / f"{source.name}-{ftype}"
    out = folder / f"{source.name}.{ftype}.gguf"
    if out.is_file():
        return folder
    if not LLAMACPP_PYTHON.exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} is missing: run load_tests/llama_cpp_env.sh first")
    folder.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.suffix != ".gguf" and f.is_file() and not f.name.startswith(".") and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    tmp = out.with_suffix(".tmp")
    subprocess.run([str(LLAMACPP_PYTHON), "-c", QUANTIZE, str(gguf_file(source)), str(tmp), ftype], check=True)
    tmp.replace(out)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's LLAMA_FTYPE_MOSTLY_<FTYPE> (Q4_K_M, Q5_K_M, Q6_K...)")
    print(gguf_variant(p.parse_args().ftype))


if __name__ == "__main__":
    main()
