#!/usr/bin/env python3
"""Carried files for a GPU device run: manifests here, staging / joining / installing there.

Standard library only (the device's python3 has no ray, faiss, jsonschema or gguf; it gets them
from what this script installs). Two subcommands:

``manifest`` (here, from scripts/prepare_device_carry.sh): describe a file split into parts that
travel in different calls: ``PARTS.json`` (the file's name and sha256, each part's name and
sha256, where parts are staged and where the joined file goes, whether it is xz'd) is written into
every part's folder.

``setup`` (there, from scripts/device_ray_setup.sh), idempotent, for a machine that may have run an
earlier call (a warm machine keeps /tmp):

1. every carried ``.carry/*/PARTS.json``: copy its parts that came with this call into the stage
   folder (``/tmp/ray_parts`` for ray); once every part is staged (sha256-checked), join them into
   the destination (``/tmp/ray_wheel/<wheel>``), checked against the whole file's sha256, and
   decompress an xz'd file (``/tmp/adbatch_files/<name>.gguf``);
2. carried ``.carry/wheels/*.whl``: copied to ``/tmp/ray_parts/wheels`` for a later call;
3. install into ``/tmp/site``: from ``.carry/site/site.tar.xz`` when carried (one-call plan), else,
   once the ray wheel is joined, ``pip install --no-index --no-deps --target /tmp/site`` of it and
   the staged wheels (two-call plan); skipped when /tmp/site already holds the same set;
4. write an env file (PYTHONPATH=/tmp/site:<repo>, and ADBATCH_DEFAULT_GGUF when a GGUF was
   joined) and, when installed, import-check ray, faiss, jsonschema and gguf.

Exit status of ``setup``: 0 ready, 3 staged but not ready (a later call brings the rest), 1 error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: where everything goes on the device (a warm machine keeps /tmp between calls);
#: ADBATCH_DEVICE_ROOT moves it (a local rehearsal)
ROOT = Path(os.environ.get("ADBATCH_DEVICE_ROOT", "/tmp"))
SITE = ROOT / "site"
SITE_ID_FILE = ".adbatch_site_id"
WHEEL_STAGE = ROOT / "ray_parts" / "wheels"


def _at_root(p: str) -> Path:
    """A manifest's stage / dest folder: relative names live under ROOT."""
    return Path(p) if Path(p).is_absolute() else ROOT / p


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg: str) -> None:
    print(f"[device-setup] {msg}", flush=True)


# --- here --------------------------------------------------------------------------------------
def cmd_manifest(args: argparse.Namespace) -> int:
    f = Path(args.file)
    m = {
        "file": f.name,
        "sha256": sha256(f),
        "size": f.stat().st_size,
        "stage": args.stage,
        "dest": args.dest,
        "parts": [{"name": Path(p).name, "sha256": sha256(Path(p)), "size": Path(p).stat().st_size}
                  for p in args.parts],
    }
    if args.unxz:
        with lzma.open(f) as fh:
            h = hashlib.sha256()
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        m["unxz"] = {"name": f.name[:-3] if f.name.endswith(".xz") else f.name + ".out",
                     "sha256": h.hexdigest()}
    for out in args.out:
        Path(out).write_text(json.dumps(m, indent=1) + "\n")
    print(f"{f.name}: {len(m['parts'])} parts -> {', '.join(args.out)}")
    return 0


# --- there -------------------------------------------------------------------------------------
def _final(m: dict) -> tuple[Path, str]:
    """The path and sha256 of what the joined parts finally become."""
    if m.get("unxz"):
        return _at_root(m["dest"]) / m["unxz"]["name"], m["unxz"]["sha256"]
    return _at_root(m["dest"]) / m["file"], m["sha256"]


def _stage_and_join(m: dict, src_dirs: list[Path]) -> tuple[bool, Path]:
    """Stage the parts found in ``src_dirs``; join once all are staged. (done, final path)."""
    final, final_sha = _final(m)
    stage = _at_root(m["stage"])
    stage.mkdir(parents=True, exist_ok=True)
    (stage / f"PARTS-{m['file']}.json").write_text(json.dumps(m))
    if final.is_file() and final.with_name(final.name + ".ok").is_file():
        return True, final
    for p in m["parts"]:
        dst = stage / p["name"]
        if dst.is_file() and dst.stat().st_size == p["size"]:
            continue
        src = next((d / p["name"] for d in src_dirs if (d / p["name"]).is_file()), None)
        if src is not None:
            if sha256(src) != p["sha256"]:
                raise SystemExit(f"error: {src} differs from its PARTS.json sha256 (damaged carry?)")
            shutil.copyfile(src, dst.with_suffix(".tmp"))
            os.replace(dst.with_suffix(".tmp"), dst)
            log(f"staged {p['name']} ({p['size'] / 2**20:.1f} MiB) in {stage}")
    missing = [p["name"] for p in m["parts"] if not (stage / p["name"]).is_file()]
    if missing:
        log(f"{m['file']}: waiting for {missing} (carry the folder that holds them in the next call, "
            f"on this same warm machine)")
        return False, final
    for p in m["parts"]:
        if sha256(stage / p["name"]) != p["sha256"]:
            raise SystemExit(f"error: staged {stage / p['name']} is damaged; carry it again")
    dest = _at_root(m["dest"])
    dest.mkdir(parents=True, exist_ok=True)
    joined = dest / m["file"]
    tmp = joined.with_name(joined.name + ".tmp")
    with tmp.open("wb") as out:
        for p in m["parts"]:
            with (stage / p["name"]).open("rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 22)
    if sha256(tmp) != m["sha256"]:
        raise SystemExit(f"error: joined {joined} does not match its sha256")
    os.replace(tmp, joined)
    log(f"joined {len(m['parts'])} parts -> {joined}")
    if m.get("unxz"):
        tmp = final.with_name(final.name + ".tmp")
        with lzma.open(joined) as src, tmp.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        if sha256(tmp) != final_sha:
            raise SystemExit(f"error: decompressed {final} does not match its sha256")
        os.replace(tmp, final)
        joined.unlink()
        log(f"decompressed -> {final} ({final.stat().st_size / 2**20:.1f} MiB)")
    final.with_name(final.name + ".ok").write_text(final_sha + "\n")
    for p in m["parts"]:  # disk: the joined file replaces its parts
        (stage / p["name"]).unlink(missing_ok=True)
    return True, final


def _compile(folder: Path) -> None:
    """Byte-compile what was installed (the wheels went in with --no-compile): otherwise every
    process of a fresh Ray cluster compiles ray's modules as it imports them, and the raylet gives its
    dashboard agent only seconds to come up (seen failing on a loaded 2-core machine)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(folder)],
                   check=False, stdout=subprocess.DEVNULL)
    log(f"byte-compiled {folder} in {time.perf_counter() - t0:.1f} s")


def _site_id() -> str | None:
    f = SITE / SITE_ID_FILE
    return f.read_text().strip() if f.is_file() else None


def _install_bundle(bundle: Path) -> None:
    want = sha256(bundle)
    if _site_id() == f"bundle:{want}":
        log(f"{SITE} already holds {bundle.name} ({want[:12]}): skipped")
        return
    sums = bundle.with_name(bundle.name + ".sha256")
    if sums.is_file() and sums.read_text().split()[0] != want:
        raise SystemExit(f"error: {bundle} does not match {sums.name} (damaged carry?)")
    t0 = time.perf_counter()
    tmp = SITE.with_name(SITE.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(bundle, "r:xz") as tf:
        try:
            tf.extractall(tmp, filter="data")
        except TypeError:  # a Python without extraction filters
            tf.extractall(tmp)
    shutil.rmtree(SITE, ignore_errors=True)
    os.replace(tmp, SITE)
    log(f"extracted {bundle.name} -> {SITE} in {time.perf_counter() - t0:.1f} s")
    _compile(SITE)
    (SITE / SITE_ID_FILE).write_text(f"bundle:{want}\n")


def _install_wheels(wheels: list[Path]) -> None:
    ident = "wheels:" + hashlib.sha256("\n".join(sorted(w.name for w in wheels)).encode()).hexdigest()
    if _site_id() == ident:
        log(f"{SITE} already holds these {len(wheels)} wheels: skipped")
        return
    t0 = time.perf_counter()
    shutil.rmtree(SITE, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--target", str(SITE), *map(str, wheels)]
    log("running: " + " ".join(cmd[:11]) + f" <{len(wheels)} wheels>")
    subprocess.run(cmd, check=True)
    log(f"installed {len(wheels)} wheels -> {SITE} in {time.perf_counter() - t0:.1f} s")
    _compile(SITE)
    (SITE / SITE_ID_FILE).write_text(ident + "\n")


def cmd_setup(args: argparse.Namespace) -> int:
    repo = Path(args.repo).resolve()
    carry = repo / ".carry"
    joined: dict[str, Path] = {}
    pending: list[str] = []
    # 1. split files: the manifests carried now, then those staged by an earlier call
    manifests = [(p, p.parent) for p in sorted(carry.glob("*/PARTS.json"))]
    manifests += [(p, None) for stage in (ROOT / "ray_parts", ROOT / "adbatch_parts")
                  for p in sorted(stage.glob("PARTS-*.json"))]
    by_file: dict[str, tuple[dict, list[Path]]] = {}
    for path, src in manifests:
        m = json.loads(path.read_text())
        entry = by_file.setdefault(m["file"], (m, []))
        if src is not None:
            entry[1].append(src)
    for name, (m, srcs) in by_file.items():
        done, final = _stage_and_join(m, srcs)
        if done:
            joined[name] = final
        else:
            pending.append(name)
    # 2. the other wheels of the two-call plan
    carried_wheels = sorted((carry / "wheels").glob("*.whl"))
    if carried_wheels:
        WHEEL_STAGE.mkdir(parents=True, exist_ok=True)
        for w in carried_wheels:
            dst = WHEEL_STAGE / w.name
            if not dst.is_file() or dst.stat().st_size != w.stat().st_size:
                shutil.copyfile(w, dst)
        log(f"staged {len(carried_wheels)} wheels in {WHEEL_STAGE}")
    # 3. install
    bundle = carry / "site" / "site.tar.xz"
    ray_wheels = [p for n, p in joined.items() if n.startswith("ray-") and n.endswith(".whl")]
    ready = False
    if bundle.is_file():
        _install_bundle(bundle)
        ready = True
    elif ray_wheels:
        others = sorted(WHEEL_STAGE.glob("*.whl"))
        if not others:
            log(f"the ray wheel is joined but no other wheels are staged in {WHEEL_STAGE}: carry "
                f".carry/wheels too")
        else:
            _install_wheels(ray_wheels + others)
            ready = True
    elif _site_id():
        log(f"{SITE} installed by an earlier call ({_site_id()[:40]}...): reusing it")
        ready = True
    # 4. environment
    py_path = [str(SITE), str(repo)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    lines = [f"export PYTHONPATH={':'.join(dict.fromkeys(py_path))}"]
    ggufs = [p for p in joined.values() if p.suffix == ".gguf"]
    if ggufs and not os.environ.get("ADBATCH_DEFAULT_GGUF"):
        lines.append(f"export ADBATCH_DEFAULT_GGUF={ggufs[0]}")
    Path(args.env_file).write_text("\n".join(lines) + "\n")
    if pending:
        log(f"still waiting for parts of: {pending}")
    if not ready:
        log(f"not ready: nothing is installed in {SITE} yet (this call staged what it carried)")
        return 3
    check = ("import ray, faiss, jsonschema, gguf; "
             "print('[device-setup] ok: ray', ray.__version__, '| faiss', faiss.__version__, "
             "'| gguf', getattr(gguf, '__version__', '?'))")
    env = dict(os.environ, PYTHONPATH=":".join(dict.fromkeys(py_path)))
    r = subprocess.run([sys.executable, "-c", check], env=env)
    if r.returncode != 0:
        log("error: the installed packages do not import (see above)")
        return 1
    return 3 if pending and args.need_all else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="write PARTS.json for a split file (here)")
    m.add_argument("--file", required=True, help="the whole file (before the split)")
    m.add_argument("--dest", required=True,
                   help="folder the joined file goes to, on the device (relative: under /tmp)")
    m.add_argument("--stage", required=True,
                   help="folder the parts wait in, on the device (relative: under /tmp)")
    m.add_argument("--unxz", action="store_true", help="the file is xz'd: decompress once joined")
    m.add_argument("--parts", nargs="+", required=True)
    m.add_argument("--out", nargs="+", required=True, help="PARTS.json paths (one per part folder)")
    s = sub.add_parser("setup", help="stage, join and install what was carried (device)")
    s.add_argument("--repo", default=".")
    s.add_argument("--env-file", default="/tmp/adbatch_device_env.sh")
    s.add_argument("--need-all", action="store_true",
                   help="exit 3 while any split file (e.g. the GGUF) is still incomplete")
    args = ap.parse_args(argv)
    return cmd_manifest(args) if args.cmd == "manifest" else cmd_setup(args)


if __name__ == "__main__":
    sys.exit(main())
