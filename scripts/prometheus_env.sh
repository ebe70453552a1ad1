#!/usr/bin/env bash
# Installs Debian's prometheus package (prometheus and promtool), which tests/test_dashboard.py runs against a
# test tritonserver. Idempotent: with /usr/bin/prometheus present it does nothing. `apt-get update` runs only
# when the package lists lack the package, or the install fails on stale lists. Needs root (CI runs as root).
set -euo pipefail
if [ -x /usr/bin/prometheus ] && [ -x /usr/bin/promtool ]; then
    echo "prometheus ready ($(/usr/bin/prometheus --version 2>&1 | sed -n 1p))"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends prometheus; }  # its service is not started
if ! apt-cache show prometheus >/dev/null 2>&1; then
    apt-get update -q
fi
install || { apt-get update -q && install; }
/usr/bin/prometheus --version 2>&1 | sed -n 1p
