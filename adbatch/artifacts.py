"""Artifact plumbing shared by every stage: atomic writes, content hashes, manifests, and who owns
an output folder.

Contract (DESIGN.md section 2): each stage writes its outputs atomically (temp file + rename in the
same directory, so readers never see a half-written file) and a ``manifest.json`` recording the
inputs' hashes, the config, the code version, counts and timings.

Output folders (docs/INTERFACES.md, "Output folders"): a stage run holds its ``--out`` through
:func:`claim_output`, which

1. takes the folder's lock: ``fcntl.flock`` on ``.<name>.adbatch-lock`` beside the folder (beside,
   not inside, because the train stage replaces its whole folder by a rename). A second run on the
   same folder is refused at once with :class:`OutputLockedError` naming the holder's pid; the lock
   is the kernel's, so it ends with its process -- a killed writer never blocks the next run;
2. refuses a folder holding another stage's artifact, with or without ``--overwrite``
   (:class:`OutputOwnershipError`; which stage wrote a folder: :func:`artifact_kind`), and a
   non-empty folder no stage wrote;
3. marks the folder as the stage's (:data:`STAGE_MARKER`) before anything else is written, so a run
   killed half-way leaves a folder that is still recognisably its own.

Within its own folder a stage decides what to keep (resume) and what ``--overwrite`` replaces; it
never removes a file another stage wrote, because it never runs in another stage's folder.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import adbatch
from adbatch.config import ConfigError

MANIFEST_NAME = "manifest.json"
#: written first into every stage's output folder: ``{"stage": <ArtifactKind value>, ...}``
STAGE_MARKER = ".adbatch-stage.json"
LOCK_SUFFIX = ".adbatch-lock"
#: a temp file of an unknown writer (one written before temp names carried the pid) counts as stale
#: after this long
STALE_TEMP_S = 3600.0


class ArtifactKind(str, enum.Enum):
    """The stage that wrote an output folder (the ``stage`` of its marker and of its manifest)."""

    INDEX = "index"
    TRAIN = "train"
    COMPRESS = "compress"
    GENERATE = "generate"
    EVAL = "eval"
    REFRESH = "refresh"


#: folders written before stages marked them: a file only that stage writes names it
_UNMARKED_SIGNS = (("adbatch_training.json", ArtifactKind.TRAIN), ("refresh_summary.json", ArtifactKind.REFRESH),
                   ("_refresh", ArtifactKind.REFRESH), ("_progress/run.json", ArtifactKind.GENERATE),
                   (".staging", ArtifactKind.INDEX))


class OutputOwnershipError(ConfigError):
    """``--out`` holds another stage's artifact (or files no stage wrote): the stage refuses to write there."""


class OutputLockedError(ConfigError):
    """Another run is writing the same ``--out`` folder."""


class ArtifactIntegrityError(ValueError):
    """A file of an artifact differs from its manifest's sha256: damaged, edited or mixed with another run's."""


class OutputWriteError(OSError):
    """Writing an output folder failed: a full disk, a read-only file system, no permission. The message
    names the folder and the errno; every write is atomic, so a re-run once the cause is fixed resumes
    from the files that were complete."""


def _within(path: Any, folder: Path) -> bool:
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path, folder = os.path.abspath(os.fsdecode(path)), os.path.abspath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _as_os_error(exc: BaseException) -> OSError | None:
    """``exc`` as the ``OSError`` it reports: itself, or a failed write of safetensors, whose
    ``SafetensorError`` is not an ``OSError`` but carries the errno and the path in its text
    (``I/O error: No space left on device (os error 28) at path "..."``); None for anything else."""
    if isinstance(exc, OSError):
        return exc
    cls = getattr(sys.modules.get("safetensors"), "SafetensorError", None)  # loaded if it can have raised
    if cls is None or not isinstance(exc, cls):
        return None
    text = str(exc)
    code = re.search(r"\(os error (\d+)\)|code: (\d+)", text)
    if code is None:
        return None
    num = int(code.group(1) or code.group(2))
    path = re.search(r'at path "([^"]*)"', text)
    return OSError(num, os.strerror(num), path.group(1) if path else None)


@contextlib.contextmanager
def write_errors(folder: str | Path, only_within: bool = False) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block (or a safetensors write failure carrying one,
    :func:`_as_os_error`) as :class:`OutputWriteError` naming ``folder`` and the errno.

    ``only_within``: only errors about a file inside ``folder`` (a block that also reads inputs)."""
    folder = Path(folder)
    try:
        yield
    except OutputWriteError:
        raise
    except Exception as raised:
        exc = _as_os_error(raised)
        if exc is None or (only_within and not (_within(exc.filename, folder) or _within(exc.filename2, folder))):
            raise
        code = f"{errno.errorcode.get(exc.errno, '?')}, errno {exc.errno}" if exc.errno else "no errno"
        err = OutputWriteError(f"cannot write {folder} ({code}: {exc.strerror or exc}"
                               f"{f': {exc.filename}' if exc.filename and exc.strerror else ''}); fix the disk "
                               "space or permissions and re-run (complete files are kept)")
        err.errno = exc.errno
        raise err from raised


def file_mode() -> int:
    """The mode a plain ``open()`` gives a new file: ``0o666`` less this process's umask."""
    try:
        with open("/proc/self/status") as fh:
            mask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: read it the racy way
        mask = os.umask(0o22)
        os.umask(mask)
    return 0o666 & ~mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(final: str | Path) -> list[Path]:
    """Remove the temp files of earlier writes of ``final`` whose writer is gone: ``.<name>.<pid>.*.tmp``
    of a process that no longer runs, and unattributed ``.<name>.*.tmp`` older than :data:`STALE_TEMP_S`.
    Returns the removed paths."""
    final = Path(final)
    prefix = f".{final.name}."
    removed = []
    with os.scandir(final.parent) as entries:  # one pass of string tests: cheap beside the write itself
        candidates = [Path(e.path) for e in entries if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    for p in candidates:
        middle = p.name[len(prefix):-len(".tmp")]
        head = middle.split(".", 1)[0]
        try:
            if head.isdigit() and "." in middle:
                stale = int(head) != os.getpid() and not _pid_alive(int(head))
            else:
                stale = time.time() - p.stat().st_mtime > STALE_TEMP_S
            if stale:
                p.unlink()
                removed.append(p)
        except FileNotFoundError:
            continue
    return removed


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``final``; on clean exit rename it over ``final`` (atomic on POSIX).

    On an exception the temp file is removed and ``final`` is untouched. The file gets the mode a
    plain ``open()`` would give it (the umask applies; ``mkstemp`` alone would make it 0600), and a
    successful write removes the temp files that killed earlier writes of ``final`` left behind
    (the temp name carries the writer's pid: ``.<name>.<pid>.<random>.tmp``).
    """
    final = Path(final)
    # the block only writes the temp file: any OSError here is a write error of the folder (one line)
    with write_errors(final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".tmp", dir=final.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            yield tmp_path
            os.chmod(tmp_path, file_mode())
            os.replace(tmp_path, final)
            remove_stale_temps(final)
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
    (default: all listed). Raises FileNotFoundError for a missing file, :class:`ArtifactIntegrityError` (a
    ValueError) for a changed one."""
    directory = Path(directory)
    listed = manifest.get("outputs") or {}
    for name in (listed if names is None else names):
        if not (directory / name).is_file():  # named: a raw "[Errno 2]" line says nothing of the artifact
            raise FileNotFoundError(f"{directory / name}: listed in {directory / MANIFEST_NAME} but missing; the "
                                    "artifact is incomplete: rebuild it or restore the file")
        want, got = listed.get(name), sha256_file(directory / name)
        if want != got:
            raise ArtifactIntegrityError(f"{directory / name}: sha256 {got[:12]} does not match the manifest's "
                             f"{str(want)[:12]}; the artifact is damaged or mixed")



# --- output folders: ownership, marker, one writer --------------------------------------------------
def _read_json_or_none(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def artifact_kind(folder: str | Path) -> str | None:
    """Which stage wrote ``folder``: its marker's ``stage``, else its manifest's, else a file only one
    stage writes (folders from before the marker); None for a folder no stage wrote."""
    folder = Path(folder)
    for name in (STAGE_MARKER, MANIFEST_NAME):
        data = _read_json_or_none(folder / name)
        if isinstance(data, dict) and data.get("stage"):
            return str(data["stage"])
    for name, kind in _UNMARKED_SIGNS:
        if (folder / name).exists():
            return kind.value
    return None


def check_output_owner(out: str | Path, kind: ArtifactKind) -> None:
    """Raise :class:`OutputOwnershipError` unless ``out`` is absent, empty, or ``kind``'s own folder."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputOwnershipError(f"{out} is a file, not a folder: `adbatch {kind.value}` writes a folder there; "
                                   "choose another --out")
    found = artifact_kind(out)
    if found == kind.value:
        return
    if found is not None:
        raise OutputOwnershipError(
            f"{out} holds an adbatch {found} artifact: `adbatch {kind.value}` does not write into another "
            f"stage's folder, with or without --overwrite (which replaces only {kind.value} outputs); "
            "choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if entries:
        raise OutputOwnershipError(
            f"{out} is not empty and holds no adbatch artifact (found {entries[:5]}): `adbatch {kind.value}` "
            "writes only into a new or empty folder or its own earlier output, with or without --overwrite; "
            "choose another --out")


def mark_output(out: str | Path, kind: ArtifactKind) -> None:
    """Create ``out`` if needed and write its :data:`STAGE_MARKER` (kept when already ``kind``'s)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marker = _read_json_or_none(out / STAGE_MARKER)
    if isinstance(marker, dict) and marker.get("stage") == kind.value:
        return
    write_json_atomic(out / STAGE_MARKER, {"stage": kind.value, "adbatch_version": adbatch.__version__,
                                           "created_unix": time.time()})


def lock_path(out: str | Path) -> Path:
    """The lock file of an output folder: ``.<name>.adbatch-lock`` beside it."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def output_lock(out: str | Path, kind: ArtifactKind) -> Iterator[Path]:
    """Hold ``out``'s lock for this run, or raise :class:`OutputLockedError` at once if another holds it.

    ``flock`` on :func:`lock_path`: the kernel drops the lock when its holder exits, killed or not,
    and it is held per open file, so two claims in one process exclude each other too. The file's
    text names the holder (pid, stage, host, start) for the refusal message; it is never removed
    (removing it could let two runs lock two different files)."""
    path = lock_path(out)
    with write_errors(path.parent):  # a read-only file system or a parent folder without write permission
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = _read_json_or_none(path) or {}
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, adbatch {holder.get('stage')}, started "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(holder['started_unix']))}"
                   if isinstance(holder.get("started_unix"), (int, float)) else "pid unknown")
            raise OutputLockedError(f"{out} is being written by another adbatch run ({who}); wait for it to "
                                    f"finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(), "stage": kind.value,
                                 "started_unix": time.time()}).encode())
        yield path
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def claim_output(out: str | Path, kind: ArtifactKind, mark: bool = True) -> Iterator[Path]:
    """Hold ``out`` for one run of stage ``kind``: its lock (:func:`output_lock`), the ownership check
    (:func:`check_output_owner`) and, with ``mark``, its marker (:func:`mark_output`; a stage that
    replaces its whole folder at the end marks it after that). Yields ``out`` as a Path."""
    out = Path(out)
    with output_lock(out, kind):
        # an OSError about a file in the folder (a full disk, a read-only mount) is one line naming the
        # folder, however the stage wrote it; the lock is released as the error leaves this block
        with write_errors(out, only_within=True):
            check_output_owner(out, kind)
            if mark:
                mark_output(out, kind)
            yield out
