#!/usr/bin/env bash
# Issue 42's layer-level GPU check in one device call: the FP8 tests on CUDA, our formats at the 8B shapes
# (bench/fp8_layers.py), the public kernels of the same formats (the anchor script), and the 8B-width decode
# step with the int4 and fp8 plans (bench/large_rows.py).
#
#   device call: carry [".carry/anchors"] -- torchao (the optional GPU dependency of 2:4 FP8) and mslk-cuda
#   wheels, and the anchor script (from shared/tools): 46 MiB, built by scripts/prepare_device_carry.sh fp8-check.
#   command: scripts/device_fp8_check.sh            (ANCHORS=0 skips the public kernels, ~1 min less)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out}"
mkdir -p "$OUT"
SITE=/tmp/anchor_site
if ls .carry/anchors/*.whl >/dev/null 2>&1 && [ ! -d "$SITE/torchao" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .carry/anchors/*.whl >/dev/null 2>&1 || echo "wheel install failed"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_fp8_linear.py tests/test_decoding_engine.py \
  > "$OUT/tests.txt" 2>&1; grep -E "passed|failed|FAILED|Error" "$OUT/tests.txt" | tail -12
timeout 200 python3 bench/fp8_layers.py --rows "${FP8_ROWS:-64,256,1024,4096,8192}" --out "$OUT/fp8_layers.md" \
  > "$OUT/fp8_layers.log" 2>&1; tail -25 "$OUT/fp8_layers.md"
if [ "${ANCHORS:-1}" = 1 ] && [ -f .carry/anchors/anchors_torchao_int4.py ]; then
  OUT="$OUT" timeout 200 python3 .carry/anchors/anchors_torchao_int4.py \
    --layouts ao_w4a8,sp24_fp16,sp24_fp8 --shapes 6144x4096,4096x4096,28672x4096,4096x14336 \
    --batches "${ANCHOR_BATCHES:-64,256,1024,4096}" --budget-s 150 2>&1 | grep -v '^{' | tail -40
fi
timeout 240 python3 bench/large_rows.py --layers 4 --queries "${LR_QUERIES:-16,128,512,1024}" --repeats 10 \
  --out "$OUT/large_rows.md" > "$OUT/large_rows.log" 2>&1; head -12 "$OUT/large_rows.md"; grep -c "" "$OUT/large_rows.md"
