#!/usr/bin/env bash
# The SparseGemv kernels' GPU check in one device call (issue 20): the interpreter tests' kernel checks
# run through the real inline PTX, then bench/kernels.py (ours vs cuBLAS fp16 vs torch int4 on the 8B and
# the default 135M model's shapes, then the 8B-shaped decode step), one run.
#
#   scripts/prepare_device_carry.sh kernels    # here: pure-Python pytest wheels into the ignored .carry/pytest
#   scripts/device_kernel_check.sh run         # on the device (carry [".carry/pytest"]): tests, then the sweep
#
# The carried pytest is unpacked with the standard library's zipfile (py3-none-any wheels) so the tests run
# with the pytest of this repo's venv whatever the image holds. ~9 min in all: give it the call's whole
# 600 s (the sweep stops starting new shapes after ~330 s of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.carry/pytest
case "${1:-}" in
  prepare)  # the kit's kernels plan (kept under this name for the commands already written down)
    exec scripts/prepare_device_carry.sh kernels
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
