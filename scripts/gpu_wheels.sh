#!/usr/bin/env bash
# Downloads, here, the wheels scripts/gpu_check.sh installs on a GPU host that cannot reach PyPI:
# the project's dependencies that such a host's CUDA image lacks or holds in too old a version
# (the generated gRPC code needs grpcio and protobuf at least as new as the generator), plus the
# test plugins. Pure or manylinux x86-64 wheels for the host's Python (default 3.12).
#
#   scripts/gpu_wheels.sh [DIR]          # default var/wheels
#   KVSTORE_WHEELS=var/wheels scripts/gpu_check.sh   # on the GPU host
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-var/wheels}"
py="${GPU_PYTHON_VERSION:-3.12}"
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$dest"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$dest" \
  --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "grpcio>=1.85,<2" "grpcio-health-checking>=1.85,<2" "grpcio-reflection>=1.85,<2" \
  "protobuf>=7.35.1,<8" "redis>=5.0" "lz4>=4.3" "xxhash>=3.4" \
  "pytest-asyncio>=0.23" "pytest-timeout>=2.3"
ls -la "$dest"
du -sh "$dest"
