#!/usr/bin/env bash
# On the GPU device machine (python3 with torch/transformers/pyarrow, no ray/faiss, no network):
# stage, join and install the carried packages into /tmp/site, then export
# PYTHONPATH=/tmp/site:<repo> (and ADBATCH_DEFAULT_GGUF when a carried GGUF was joined).
#
#   source scripts/device_ray_setup.sh     # exports into this shell; returns 0 ready, 3 staged only
#   bash scripts/device_ray_setup.sh       # same checks; prints the export lines to use
#
# What it reads (built here by scripts/prepare_device_carry.sh; see scripts/device_carry.py):
#   one-call plan:  .carry/site/site.tar.xz (ray + faiss + jsonschema... + gguf for cp312, xz'd)
#   two-call plan:  call 1 carries .carry/ray_a + .carry/wheels  -> parts staged in /tmp/ray_parts
#                   call 2 carries .carry/ray_b                  -> joined in /tmp/ray_wheel, then
#                   pip install --no-index --no-deps --target /tmp/site (ray + staged wheels)
#   real model:     .carry/gguf_a, .carry/gguf_b (any calls, any order) -> /tmp/adbatch_files/*.gguf
# /tmp survives between calls only while the machine stays warm (30 s after a call).
_adb_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_adb_env="${ADBATCH_DEVICE_ROOT:-/tmp}/adbatch_device_env.sh"
python3 "$_adb_repo/scripts/device_carry.py" setup --repo "$_adb_repo" --env-file "$_adb_env" ${ADBATCH_SETUP_ARGS:-}
_adb_rc=$?
if [ -f "$_adb_env" ] && [ "$_adb_rc" != 1 ]; then
  echo "[device-setup] environment ($_adb_env):"
  sed 's/^/    /' "$_adb_env"
  # shellcheck disable=SC1090
  . "$_adb_env"
fi
if [ "$_adb_rc" = 0 ]; then export ADBATCH_DEVICE_READY=1; else unset ADBATCH_DEVICE_READY; fi
echo "[device-setup] status: $([ "$_adb_rc" = 0 ] && echo ready || { [ "$_adb_rc" = 3 ] && echo 'staged, not ready' || echo error; })"
(return 0 2>/dev/null) && return "$_adb_rc"
exit "$_adb_rc"
