#!/usr/bin/env bash
# Compile every kernels/*.cu to PTX with nvcc, the way NVRTC compiles them at run time (no include
# paths, C++17), for each target architecture; any error or warning fails. Then check that the PTX
# holds every entry point kernels/cuda.py launches. Needs nvcc; the entry-point check also needs
# a Python that imports torch (set PYTHON, default .venv/bin/python or python3).
#
#   scripts/compile_kernels.sh                       # sm_80 and sm_90
#   KVSTORE_CUDA_ARCHS="sm_90" scripts/compile_kernels.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-nvcc}"
archs="${KVSTORE_CUDA_ARCHS:-sm_80 sm_90}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi

command -v "$nvcc" >/dev/null || { echo "compile_kernels: $nvcc not found" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

shopt -s nullglob
sources=("$root"/kernels/*.cu)
(( ${#sources[@]} > 0 )) || { echo "compile_kernels: no kernels/*.cu" >&2; exit 1; }

for src in "${sources[@]}"; do
  name="$(basename "$src" .cu)"
  for arch in $archs; do
    "$nvcc" -ptx -arch="$arch" -std=c++17 -Werror all-warnings -o "$out/$name.$arch.ptx" "$src"
    entries="$(grep -c '^\.visible \.entry' "$out/$name.$arch.ptx" || true)"
    echo "ok  kernels/$name.cu  $arch  $entries entry points"
  done
done

# Every name the launchers ask for must exist, or the first call on a GPU fails at run time.
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$out" <<'PY'
import pathlib
import re
import sys

from kvstore.kernels.cuda import KERNELS

out = pathlib.Path(sys.argv[1])
missing = []
for source, names in KERNELS.items():
    for ptx in sorted(out.glob(source.removesuffix(".cu") + ".*.ptx")):
        have = set(re.findall(r"^\.visible \.entry (\w+)\(", ptx.read_text(), re.M))
        missing += [f"{ptx.name}: {n}" for n in names if n not in have]
if missing:
    sys.exit("compile_kernels: entry points launched by kernels/cuda.py but missing:\n  "
             + "\n  ".join(missing))
print(f"ok  all {sum(map(len, KERNELS.values()))} launched entry points present")
PY
