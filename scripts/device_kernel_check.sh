#!/usr/bin/env bash
# The SparseGemv kernels' GPU check in one device call (issue 20): the interpreter tests' kernel checks
# run through the real inline PTX, then bench/kernels.py (ours vs cuBLAS fp16 vs torch int4 on the 8B and
# the default 135M model's shapes, then the 8B-shaped decode step), one run.
#
#   scripts/device_kernel_check.sh prepare     # here: pure-Python pytest wheels into the ignored .carry/pytest
#   scripts/device_kernel_check.sh run         # on the device (carry [".carry/pytest"]): tests, then the sweep
#
# The device image has torch, triton and numpy but no pytest and no network; the wheels are unpacked
# with the standard library's zipfile (they are py3-none-any). ~9 min in all: give it the call's whole
# 600 s (the sweep stops starting new shapes after ~330 s of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.carry/pytest
case "${1:-}" in
  prepare)
    PY="${PY:-.venv/bin/python}"
    git check-ignore -q .carry/x || { echo "error: .carry/ is not git-ignored" >&2; exit 1; }
    mkdir -p "$WHEELS"
    for p in pytest pluggy iniconfig packaging pygments; do
      v="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")"
      "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$p==$v"
    done
    ls -la "$WHEELS"
    ;;
  run)
    site="$(mktemp -d)"
    for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" "$site"; done
    export PYTHONPATH="$site:$PWD" ADBATCH_KERNEL_TEST_DEVICE=cuda
    unset TRITON_INTERPRET
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
    # the kernel checks on CUDA (emulation-only and CPU-dispatch tests skip themselves), then the format's
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_gemv.py tests/test_nm_int4_format.py \
      2>&1 | tail -8 || echo "kernel tests: exit $?"
    timeout 400 python3 bench/kernels.py --out "${OUT:-bench/out}" --batches 1,8,16,64 --time-budget 330 --tune-log \
      --shapes 8192x28672,28672x8192,4096x14336,14336x4096,1536x576,576x1536 2>&1 | grep -v Warning | tail -60
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
