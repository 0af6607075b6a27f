#!/usr/bin/env bash
# Regenerates the Python code of proto/kvstore/v1/kvstore.proto into kvstore/v1/.
#   scripts/gen_proto.sh          write the generated files
#   scripts/gen_proto.sh --check  fail if the committed files are stale
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/kvstore/v1/kvstore.proto
touch "$out/kvstore/v1/__init__.py"
if [[ "${1:-}" == "--check" ]]; then
    if ! diff -r "$out/kvstore/v1" kvstore/v1 -x __pycache__; then
        echo "kvstore/v1 is stale: run scripts/gen_proto.sh" >&2
        exit 1
    fi
    echo "generated protocol code is current"
else
    mkdir -p kvstore/v1
    cp "$out"/kvstore/v1/* kvstore/v1/
    echo "wrote kvstore/v1/"
fi
