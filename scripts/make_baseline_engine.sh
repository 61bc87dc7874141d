#!/usr/bin/env bash
# Extract the decoding package as of a fixed commit ("today's engine") into a git-ignored package,
# adbatch_baseline_decoding, so bench/decode.py can time it next to the current adbatch.decoding in
# one run (method "old"). Its other adbatch imports (adbatch.config, adbatch.artifacts,
# adbatch.models) stay: those modules are shared, only the decoding package is frozen.
# Usage: scripts/make_baseline_engine.sh [commit]   (default 93c19ce)
set -euo pipefail
commit="${1:-93c19ce}"
root="$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)"
dest="$root/.carry/baseline_decoding/adbatch_baseline_decoding"
rm -rf "$dest"
mkdir -p "$dest"
for f in __init__.py beam_search.py config.py cost_model.py creative.py kv.py tree_verify.py; do
  git -C "$root" show "$commit:adbatch/decoding/$f" > "$dest/$f"
done
# internal imports only: "adbatch.decoding." (with the dot) never matches adbatch.config etc.
sed -i 's/\badbatch\.decoding\./adbatch_baseline_decoding./g' "$dest"/*.py
echo "$commit $(git -C "$root" rev-parse "$commit")" > "$dest/COMMIT"
echo "baseline decoding engine from $commit -> $dest"
