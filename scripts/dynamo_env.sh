#!/usr/bin/env bash
# Builds .venv-dynamo: NVIDIA Dynamo (frontend, router, worker runtime) plus this engine, in its own venv;
# Dynamo never enters the main .venv. Idempotent: with the stamp present it does nothing.
# A plain `pip install ai-dynamo` fails on these machines: it pins `aisimulate` (a stub that downloads
# from an unreachable index; only Dynamo's planner imports it) and a certifi newer than the mirror has.
# So: the runtime wheel, then ai-dynamo with --no-deps, then the requirements the frontend and the
# worker import, by hand. torch goes in as the pinned CPU build (the worker runs the engine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${DYNAMO_VENV:-.venv-dynamo}
DYNAMO=1.6.1
STAMP="$VENV/.installed-$DYNAMO-$(cat requirements.txt scripts/dynamo_env.sh | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
    echo "$VENV ready (ai-dynamo $DYNAMO)"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
echo "[1/3] the engine's requirements (torch CPU build, transformers, ...)"
"$PIP" install -q -r requirements.txt
echo "[2/3] ai-dynamo-runtime $DYNAMO and ai-dynamo $DYNAMO (no deps)"
"$PIP" install -q "ai-dynamo-runtime==$DYNAMO"
"$PIP" install -q --no-deps "ai-dynamo==$DYNAMO"
echo "[3/3] what the frontend and worker import"
"$PIP" install -q "aiohttp>=3.14.3,<4" "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1" "pyzmq>=26" \
    "tqdm>=4" "typing-extensions>=4.10" "zstandard>=0.23,<1" certifi "pydantic>=2.10.6,<=2.13.5" "uvloop>=0.21"
"$PIP" install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c 'import dynamo.frontend, dynamo.common.backend, backend.engine; print("dynamo ready")'
rm -f "$VENV"/.installed-*
touch "$STAMP"
