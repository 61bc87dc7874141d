#!/usr/bin/env bash
# The README's test command: set up the venv (idempotent), then run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
