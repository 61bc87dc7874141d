#!/usr/bin/env bash
# The README's main command: set up the venv (idempotent), then run the nightly refresh
# (index -> train -> compress -> generate -> eval) on the bundled example corpus on a local Ray.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python jobs/nightly_refresh.py --config examples/refresh.toml "$@"
