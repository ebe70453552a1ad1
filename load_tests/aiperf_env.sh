#!/usr/bin/env bash
# Builds .venv-aiperf: NVIDIA AIPerf (the OpenAI-endpoint benchmark), in its own venv, for `make aiperf`.
# Idempotent: re-running with the stamp present does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${AIPERF_VENV:-.venv-aiperf}
AIPERF=aiperf==0.13.0
STAMP="$VENV/.installed-$AIPERF"

if [ -f "$STAMP" ]; then
    echo "$VENV ready ($AIPERF)"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$AIPERF"
"$VENV/bin/aiperf" --version
touch "$STAMP"
