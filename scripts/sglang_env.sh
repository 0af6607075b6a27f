#!/usr/bin/env bash
# Builds .venv-sglang: the environment the SGLang HiCache backend's tests run in, against
# SGLang's real pools, cache controller and backend factory.
#
# It is apart from .venv because sglang 0.5.23 pins transformers==5.19.0 (the project pins
# 5.24.0), torch==2.14.1 and some thirty CUDA-only packages (flashinfer, sgl-kernel, deep-ep,
# cutlass, ...). None of those is needed by HiCache's storage path, which runs on CPU. So:
#   1. torch==2.13.0 CPU first (the wheel on disk), so nothing resolves a CUDA build;
#   2. sglang==0.5.23 with --no-deps;
#   3. the pure-Python (or CPU-only) packages that the import path of HiCache needs, pinned
#      one by one, also with --no-deps: the set below is what importing
#      sglang.srt.mem_cache.{hicache_storage,memory_pool,memory_pool_host},
#      sglang.srt.mem_cache.storage (the backend factory), sglang.srt.managers.cache_controller
#      and sglang.srt.mem_cache.hybrid_cache.{hybrid_pool_assembler,hybrid_cache_controller}
#      asks for, found by importing them and adding what each ImportError named;
#   4. torchvision==0.28.0 (the release paired with torch 2.13; sglang.srt.configs imports it):
#      the PyPI wheel is a CUDA build whose C extension does not load under CPU torch, so its
#      import fails with "operator torchvision::nms does not exist" unless the op schemas are
#      defined first; tests/sglang_backend/conftest.py defines them (HiCache never calls them);
#   5. this project, editable and without its dependencies (its transformers pin conflicts),
#      then its other dependencies and the test tools, under a constraint that keeps all the
#      pins above.
# Idempotent: a stamp file records a finished build of this script's version; rerunning is a
# no-op until this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
PY="$VENV/bin/python"
STAMP="$VENV/.installed"
SIG=$(sha256sum "$0" | cut -c1-16)

# The import the tests make, with the torchvision op schemas defined first.
CHECK='
import importlib.util, pathlib, torch
spec = importlib.util.find_spec("torchvision")
try:
    torch.ops.load_library(str(next(pathlib.Path(spec.origin).parent.glob("_C*.so"))))
except OSError:
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import sglang, kvstore
import sglang.srt.managers.cache_controller, sglang.srt.mem_cache.storage
import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("sglang", sglang.__version__, "torch", torch.__version__)
'

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SIG" ]] && "$PY" -c "$CHECK" >/dev/null 2>&1; then
    exit 0
fi

# Exact versions, installed with --no-deps: what HiCache's import path needs, nothing more.
PINS=(
    sglang==0.5.23
    transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface-hub==2.4.0
    triton==3.9.0
    numpy==2.4.6 regex==2026.12.2 pyyaml==6.0.4 tqdm==4.70.1 packaging==26.4
    filelock==4.3.2 fsspec==2026.9.0 dill==0.4.1 loguru==0.7.3 gguf==0.19.0
    sentencepiece==0.2.1 compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11
    orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
    pillow==13.0.0 ipython==9.19.1 traitlets==5.16.1 pygments==2.21.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    starlette==1.10.0 anyio==4.16.0 h11==0.16.0 httpx2==2.17.0 httpcore2==2.17.0
    truststore==0.10.5
    requests==2.34.2 urllib3==2.8.0 idna==3.21 certifi==2026.10.19.post1
    charset-normalizer==3.5.3
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
    frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
)

start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
# Nothing in the environment belongs in git.
echo '*' >"$VENV/.gitignore"
PIP=("$PY" -m pip install -q)
CONSTRAINTS="$VENV/constraints.txt"
{
    echo "torch==2.13.0"
    echo "torchvision==0.28.0"
    printf '%s\n' "${PINS[@]}"
} >"$CONSTRAINTS"

"$PY" -m pip install -q --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "${PINS[@]}" torchvision==0.28.0
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" -c "$CONSTRAINTS" \
    "grpcio>=1.85,<2" "grpcio-health-checking>=1.85,<2" "grpcio-reflection>=1.85,<2" \
    "protobuf>=7.35.1,<8" "redis>=5.0" "lz4>=4.3" "xxhash>=3.4" \
    "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.23" "hypothesis>=6.100"

"$PY" -c "$CHECK"
echo "$SIG" >"$STAMP"
echo "built $VENV in $(($(date +%s) - start)) s"
