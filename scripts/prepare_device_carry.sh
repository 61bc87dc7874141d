#!/usr/bin/env bash
# Build, on this CPU machine, what a GPU device run of one plan carries (the git-ignored .carry/ and the .whl/
# cache), and print each device call's carry list, sized from the real working tree (64 MiB a call).
#
#   scripts/prepare_device_carry.sh PLAN    # ray | ray-model | trained | creatives | kernels
#   scripts/device_carry.py plans           # what each plan runs (docs/device.md: which benchmark uses which)
#
# The names before plans had names still work: no argument = ray, --with-gguf = ray-model,
# --trained-check = trained + creatives. Only what the plan carries is built, and a built artifact is rebuilt
# when its inputs change (scripts/device_carry.py). On the device: ADBATCH_PLAN=PLAN source scripts/device_ray_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
# .whl/ caches wheels and xz'd payloads: ignored, so it never travels with the tree
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
exec "$PY" scripts/device_carry.py prepare -- "${1:-}"
