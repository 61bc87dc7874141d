#!/usr/bin/env bash
# The SparseGemv kernels' GPU check in one device call (issue 20): the interpreter tests' kernel checks
# run through the real inline PTX, then bench/v3_probe.py (fragment-ordered vs format-2 tensor-core
# kernel vs cuBLAS fp16 vs torch int4, one run).
#
#   scripts/device_kernel_check.sh prepare     # here: pure-Python pytest wheels into the ignored .carry/pytest
#   scripts/device_kernel_check.sh run [quick] # on the device (carry [".carry/pytest"]): tests, then the probe
#
# The device image has torch, triton and numpy but no pytest and no network; the wheels are unpacked
# with the standard library's zipfile (they are py3-none-any). ~9-10 min in all: give it the call's
# whole 600 s (the probe stops itself after ~520 s of its own).
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
    # run [quick]: quick (~4-5 min) = the tensor-core tests and the probe on the headline 8B shape and the
    # default model's; the full run takes the call's whole 600 s
    quick="${2:-}"
    site="$(mktemp -d)"
    for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" "$site"; done
    export PYTHONPATH="$site:$PWD" ADBATCH_KERNEL_TEST_DEVICE=cuda
    unset TRITON_INTERPRET
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
    # the kernel checks on CUDA (emulation-only and CPU-dispatch tests skip themselves), then the format's
    if [ "$quick" = quick ]; then
      timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_gemv.py -k "dot or frag or tc or autotune" \
        2>&1 | tail -15 || echo "kernel tests: exit $?"
      timeout 200 python3 bench/v3_probe.py --time-budget 130 --shapes 8192x28672,1536x576,576x1536,576x576,192x576 \
        2>&1 | grep -v Warning | tail -70
    else
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_gemv.py tests/test_nm_int4_format.py \
        2>&1 | tail -15 || echo "kernel tests: exit $?"
      timeout 340 python3 bench/v3_probe.py --time-budget 240 2>&1 | grep -v Warning | tail -100
    fi
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
