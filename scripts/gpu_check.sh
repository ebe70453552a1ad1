#!/usr/bin/env bash
# The GPU path on a GPU host, from the repository root, nothing fetched: the CUDA tests (tests/test_cuda.py and the
# Triton kernels' tests, compiled for the GPU), then scripts/gpu_bench.py (greedy vs HF on random Llamas of three
# shapes, decode and prefill figures against the measured HBM and GEMM ceilings). Needs torch with CUDA, triton,
# transformers and pytest (a GPU host's usual Python). Figures: $RESULTS/gpu_bench.json (default results/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-results/gpu}
PY=${PY:-python3}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RESULTS/gpu.txt"
"$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_triton_kernels.py \
    2>&1 | tee "$RESULTS/pytest.txt"
tests=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 "$PY" -m scripts.gpu_bench --out "$RESULTS/gpu_bench.json" "$@" 2>&1 | tee "$RESULTS/bench.txt"
bench=${PIPESTATUS[0]}
exit $(( tests || bench ))
