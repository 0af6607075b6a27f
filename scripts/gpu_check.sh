#!/usr/bin/env bash
# One prepared check for a GPU host, well under 5 minutes: installs CuPy (and the test tools) if
# missing, runs the CUDA tests (kernels, paged cache, the daemon's GPU tier over CUDA IPC), then
# the GPU benchmarks. Prints everything; exits non-zero if anything fails or if the CUDA tests
# were skipped.
#
#   scripts/gpu_check.sh
#   KVSTORE_WHEELS=/path/to/wheels scripts/gpu_check.sh   # offline host: install from wheels
#                                                         # (scripts/gpu_wheels.sh makes them)
#   KVSTORE_CUPY='cupy-cuda13x[ctk]' scripts/gpu_check.sh # another CuPy build
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
section() { printf '\n== %s (at %ds)\n' "$1" $((SECONDS - start)); }

install() {
  if [[ -n "${KVSTORE_WHEELS:-}" ]]; then
    "$PYTHON" -m pip install -q --no-index --find-links "$KVSTORE_WHEELS" "$@"
  else
    "$PYTHON" -m pip install -q "$@"
  fi
}

section "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
df -h /dev/shm || true  # the CPU tier's arena lives there; the GPU tier benchmark needs ~1 GiB
"$PYTHON" - <<'PY'
import torch

if not torch.cuda.is_available():
    raise SystemExit("gpu_check: torch sees no CUDA device (a CPU-only torch build?)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY

section "python packages"
# `import kvstore` loads the client too (grpc, ...): install the project's dependencies if they
# are missing (or, given wheels, older than the project needs), except torch, which stays the
# host's own CUDA build.
if [[ -n "${KVSTORE_WHEELS:-}" ]] || ! "$PYTHON" -c 'import kvstore' 2>/dev/null; then
  mapfile -t deps < <("$PYTHON" - <<'PY'
import tomllib

for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not dep.replace(" ", "").startswith(("torch>", "torch=", "torch<", "torch;")):
        print(dep)
PY
  )
  install "${deps[@]}"
fi
"$PYTHON" -c 'import pytest, hypothesis, pytest_asyncio, pytest_timeout' 2>/dev/null ||
  install pytest hypothesis pytest-asyncio pytest-timeout
# [ctk] brings NVRTC from PyPI: RawModule compiles the .cu sources at run time.
"$PYTHON" -c 'import cupy' 2>/dev/null || install "${KVSTORE_CUPY:-cupy-cuda12x[ctk]>=13}"
"$PYTHON" - <<'PY'
import cupy

print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
PY

section "CUDA tests"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider -rs -m cuda \
  tests/test_kernels.py tests/test_paged.py tests/test_gpu_service.py \
  2>&1 | tee "$log"
if grep -qi "skipped" "$log"; then
  echo "gpu_check: CUDA tests were skipped; this host should run them all" >&2
  exit 1
fi

section "GPU tier logic (no CUDA needed, run here too)"
timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu_tier.py

section "benchmark: kernels"
timeout 120 "$PYTHON" benchmarks/bench_paged.py --cuda

section "benchmark: GPU tier and transfers through the daemon"
timeout 120 "$PYTHON" benchmarks/bench_gpu_tier.py

section "done in $((SECONDS - start))s"
