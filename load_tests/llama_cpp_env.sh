#!/usr/bin/env bash
# Builds .venv-llamacpp: llama-cpp-python (llama.cpp compiled from source for this CPU: -march=native, its
# AVX2 / AVX-512 paths as the CPU has them) in its own venv, for `bench_offline --llamacpp` only.
# LLAMACPP_MARCH (e.g. x86-64-v3: AVX2 and FMA) builds for that CPU level instead, into $LLAMACPP_VENV: the llama.cpp
# an AVX2-only CPU (AMD Zen 3) runs, beside our LLM_KERNEL_MARCH build, on a machine that has AVX-512 too.
# Idempotent: re-running with the stamp present does nothing. ~10 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
LLAMACPP=llama-cpp-python==0.3.16
STAMP="$VENV/.installed-$LLAMACPP"

# llama.cpp's converter (site-packages/bin/convert_hf_to_gguf.py, load_tests/random_gguf.py) runs on .venv's torch,
# transformers and gguf, plus what it imports besides: these, kept apart in $VENV/converter
CONVERTER_LIBS="mistral_common==1.13.1 pydantic_extra_types==2.11.1 pycountry==26.2.16 tiktoken==0.14.0 sentencepiece==0.2.3"
if [ ! -f "$STAMP" ]; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # GGML_NATIVE: the build machine's own ISA (what our kernels get too); no BLAS, llama.cpp's own GEMMs
    ISA="-DGGML_NATIVE=ON" CACHE=""
    if [ -n "${LLAMACPP_MARCH:-}" ]; then  # pip's wheel cache is keyed by the source, not CMAKE_ARGS: not read
        ISA="-DGGML_NATIVE=OFF -DCMAKE_C_FLAGS=-march=$LLAMACPP_MARCH -DCMAKE_CXX_FLAGS=-march=$LLAMACPP_MARCH"
        CACHE="--no-cache-dir"
    fi
    CMAKE_ARGS="$ISA -DGGML_BLAS=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/pip" install $CACHE --no-binary llama-cpp-python "$LLAMACPP" psutil  # psutil: bench_offline's CPU time
    "$VENV/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())'
    touch "$STAMP"
fi
if [ ! -f "$VENV/converter/.installed" ]; then
    .venv/bin/pip install -q --no-deps --target "$VENV/converter" $CONVERTER_LIBS
    touch "$VENV/converter/.installed"
fi
echo "$VENV ready ($LLAMACPP, llama.cpp's converter)"
