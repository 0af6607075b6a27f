#!/usr/bin/env bash
# Builds .venv-mooncake: Mooncake Store (mooncake-transfer-engine-non-cuda from PyPI), the peer
# benchmarks/bench_trace.py replays the trace through beside kvstore and Redis.
#
# It is apart from .venv because the wheel brings its own binaries (mooncake_master, the store
# client's extension) and nothing of this project runs inside it: bench_trace starts
# benchmarks/_mooncake_peer.py with this environment's Python and reads back its JSON. The
# driver needs only numpy beside the wheel.
#
# The wheel links against libibverbs, librdmacm and libnuma even when it only speaks TCP: run as
# root, this script installs the Debian packages that are missing (libibverbs1 librdmacm1
# libnuma1); otherwise it says which to install and stops.
# Idempotent: a stamp file records a finished build of this script's version; rerunning is a
# no-op until this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${MOONCAKE_VENV:-.venv-mooncake}
PY="$VENV/bin/python"
STAMP="$VENV/.installed"
SIG=$(sha256sum "$0" | cut -c1-16)
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
APT_PACKAGES=(libibverbs1 librdmacm1 libnuma1)

check() {
    "$PY" -c "from mooncake.store import MooncakeDistributedStore; import numpy" 2>/dev/null &&
        test -x "$VENV/bin/mooncake_master"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SIG" ]] && check; then
    exit 0
fi

start=$(date +%s)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "mooncake_env: missing Debian packages: ${missing[*]} (apt-get install ${missing[*]}, as root)" >&2
        exit 1
    fi
    echo "installing ${missing[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

test -x "$PY" || "$PYTHON" -m venv "$VENV"
# git leaves the environment alone without an entry in .gitignore
echo "*" >"$VENV/.gitignore"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" numpy

if ! check; then
    echo "mooncake_env: the wheel installed, but MooncakeDistributedStore or mooncake_master is not usable:" >&2
    "$PY" -c "from mooncake.store import MooncakeDistributedStore" || true
    ls "$VENV/bin" | grep -i mooncake >&2 || true
    exit 1
fi
"$PY" -m pip show mooncake-transfer-engine-non-cuda | sed -n 's/^Version: /mooncake-transfer-engine-non-cuda /p'
echo "$SIG" >"$STAMP"
echo "built $VENV in $(($(date +%s) - start)) s"
