#!/usr/bin/env bash
# Installs Debian's etcd-server and nats-server, Dynamo's discovery and event planes for `make serve-dynamo
# DISCOVERY=etcd` and tests/test_dynamo_etcd.py (backend/dynamo/control_plane.py starts them), and iproute2 (`ip`:
# hosts of their own, HOSTS=1 and tests/test_dynamo_hosts.py). Idempotent: with the binaries present it does nothing. `apt-get update` runs only when the package lists lack a package, or the install
# fails on stale lists. Needs root (CI runs as root). The packages' services are not started. `sed -n 1p`, not `head -1`:
# head exits after one line, etcd dies of SIGPIPE writing the next, and pipefail made a fresh machine's install fail.
set -euo pipefail
if command -v etcd >/dev/null && command -v nats-server >/dev/null && command -v ip >/dev/null; then
    echo "etcd and nats-server ready ($(etcd --version | sed -n 1p); nats-server $(nats-server --version | awk '{print $2}'))"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends etcd-server nats-server iproute2; }
if ! apt-cache show etcd-server nats-server iproute2 >/dev/null 2>&1; then
    apt-get update -q
fi
install || { apt-get update -q && install; }
etcd --version | sed -n 1p
