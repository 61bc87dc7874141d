#!/usr/bin/env bash
# On the GPU device machine: stage, join and install what this call of a plan carried (built here by
# scripts/prepare_device_carry.sh PLAN), export PYTHONPATH (and ADBATCH_DEFAULT_GGUF once the GGUF is joined),
# and say whether the plan can run.
#
#   ADBATCH_PLAN=trained source scripts/device_ray_setup.sh   # exports; returns 0 ready, 3 staged only, 1 error
#   bash scripts/device_ray_setup.sh                          # plan ray; prints the export lines
#
# Plans and what "ready" checks: scripts/device_carry.py (PLANS). /tmp survives between calls only while the
# machine stays warm (30 s after a call): run a plan's calls back to back.
_adb_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_adb_env="${ADBATCH_DEVICE_ROOT:-/tmp}/adbatch_device_env.sh"
python3 "$_adb_repo/scripts/device_carry.py" setup --repo "$_adb_repo" --env-file "$_adb_env" --plan "${ADBATCH_PLAN:-ray}"
_adb_rc=$?
if [ -f "$_adb_env" ] && [ "$_adb_rc" != 1 ]; then
  echo "[device-setup] environment ($_adb_env):"
  sed 's/^/    /' "$_adb_env"
  # shellcheck disable=SC1090
  . "$_adb_env"
fi
if [ "$_adb_rc" = 0 ]; then export ADBATCH_DEVICE_READY=1; else unset ADBATCH_DEVICE_READY; fi
echo "[device-setup] plan ${ADBATCH_PLAN:-ray}: $([ "$_adb_rc" = 0 ] && echo ready || { [ "$_adb_rc" = 3 ] && echo 'staged, not ready' || echo error; })"
(return 0 2>/dev/null) && return "$_adb_rc"
exit "$_adb_rc"
