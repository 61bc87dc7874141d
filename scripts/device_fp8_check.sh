#!/usr/bin/env bash
# Issue 42's layer-level GPU check in one device call: the FP8 tests on CUDA, our formats at the 8B shapes
# (bench/fp8_layers.py), the public kernels of the same formats (the anchor script, when its wheels are carried
# in .carry/anchors), and the 8B-width decode step with the int4 and fp8 plans (bench/large_rows.py).
#
#   device call: carry [".carry/anchors"] (torchao 0.18.0 + mslk-cuda 1.1.0 wheels and anchors_torchao_int4.py,
#   46 MiB), command: scripts/device_fp8_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py 2>&1 | tail -6
timeout 150 python3 bench/fp8_layers.py --rows "${FP8_ROWS:-64,256,1024,4096,8192}" --out "$OUT/fp8_layers.md" 2>&1 \
  | grep -v '^{' | tail -30
if ls .carry/anchors/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/anchor_site \
    .carry/anchors/*.whl >/dev/null 2>&1
  OUT="$OUT" PYTHONPATH=/tmp/anchor_site timeout 200 python3 .carry/anchors/anchors_torchao_int4.py \
    --layouts ao_w4a8,sp24_fp16,sp24_fp8 --shapes 6144x4096,4096x4096,28672x4096,4096x14336 \
    --batches "${ANCHOR_BATCHES:-64,256,1024,4096}" --budget-s 150 2>&1 | grep -v '^{' | tail -40
fi
timeout 240 python3 bench/large_rows.py --layers 4 --queries "${LR_QUERIES:-16,128,512,1024}" --repeats 10 \
  --out "$OUT/large_rows.md" 2>&1 | tail -60
