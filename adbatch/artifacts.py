"""Artifact plumbing shared by every stage: atomic writes, content hashes, manifests.

Contract (DESIGN.md section 2): each stage writes its outputs atomically (temp file + rename in the
same directory, so readers never see a half-written file) and a ``manifest.json`` recording the
inputs' hashes, the config, the code version, counts and timings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import adbatch

MANIFEST_NAME = "manifest.json"


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``final``; on clean exit rename it over ``final`` (atomic on POSIX).

    On an exception the temp file is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_json_atomic(path: str | Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_parquet_atomic(table: Any, path: str | Path, **kwargs: Any) -> None:
    """Write a ``pyarrow.Table`` atomically."""
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, **kwargs)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_paths(paths: list[str | Path]) -> str:
    """One hash over several files (sorted by path), each contributing its name and content hash."""
    h = hashlib.sha256()
    for p in sorted(str(x) for x in paths):
        h.update(Path(p).name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def sha256_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def code_version() -> str:
    """Package version plus the git commit when run from a checkout (``-dirty`` if modified)."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        return f"{adbatch.__version__}+g{rev}{'-dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return adbatch.__version__


class StageTimer:
    """Collects wall time per named phase: ``with timer.phase("embed"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def build_manifest(
    *,
    stage: str,
    config: Any,
    inputs: dict[str, str],
    outputs: dict[str, str],
    counts: dict[str, int],
    timings: dict[str, float],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the standard manifest dict. ``inputs``/``outputs`` map a name to a sha256."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else config
    return {
        "stage": stage,
        "code_version": code_version(),
        "created_unix": time.time(),
        "host": platform.node(),
        "config": cfg,
        "config_hash": sha256_json(cfg),
        "inputs": inputs,
        "outputs": outputs,
        "counts": counts,
        "timings_s": {k: round(v, 4) for k, v in timings.items()},
        **(extra or {}),
    }


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST_NAME} in {directory}: not a finished adbatch artifact")
    return json.loads(path.read_text())


def verify_outputs(directory: str | Path, manifest: dict[str, Any], names: Any = None) -> None:
    """Check files of an artifact against its manifest's ``outputs`` (relative path -> sha256): ``names``
    (default: all listed). Raises FileNotFoundError for a missing file, ValueError for a changed one."""
    directory = Path(directory)
    listed = manifest.get("outputs") or {}
    for name in (listed if names is None else names):
        want, got = listed.get(name), sha256_file(directory / name)
        if want != got:
            raise ValueError(f"{directory / name}: sha256 {got[:12]} does not match the manifest's "
                             f"{str(want)[:12]}; the artifact is damaged or mixed")

