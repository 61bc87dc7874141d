"""adbatch.artifacts: file modes, temp files of killed writes, which stage a folder belongs to, the
output lock; and the pruning of old local Ray session folders (pipelines.ray_runtime)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from adbatch.artifacts import (ArtifactKind, OutputLockedError, OutputOwnershipError, artifact_kind, atomic_path,
                               check_output_owner, claim_output, file_mode, lock_path, output_lock,
                               write_json_atomic)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, mode):
    """mkstemp makes 0600 files; an output must get what a plain open() gives (0666 & ~umask)."""
    old = os.umask(umask)
    try:
        assert file_mode() == mode
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == mode


def test_a_killed_writes_temp_file_is_removed_by_the_next_successful_write(tmp_path):
    """A write killed -9 between writing its temp file and the rename leaves the temp file; the next
    successful write of the same file removes it. A live writer's temp file (this process's, another
    running process's) is kept."""
    target = tmp_path / "dense.safetensors"
    script = ("import os, signal, sys\nfrom adbatch.artifacts import atomic_path\n"
              "with atomic_path(sys.argv[1]) as tmp:\n    tmp.write_bytes(b'half')\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(target)], cwd=REPO)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    stale = list(tmp_path.glob(".dense.safetensors.*.tmp"))
    assert len(stale) == 1 and f".{proc.pid}." in stale[0].name and not target.exists()
    live_other = tmp_path / f".dense.safetensors.{os.getppid()}.keepme.tmp"  # pytest's parent: running
    live_other.write_bytes(b"in progress")
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live_other.name])


def test_unattributed_temp_files_are_removed_only_when_old(tmp_path):
    """Temp names from before they carried the pid: removed once older than STALE_TEMP_S."""
    import adbatch.artifacts as art

    old = tmp_path / ".x.json.ab12cd34.tmp"
    new = tmp_path / ".x.json.ef56gh78.tmp"
    old.write_text("")
    new.write_text("")
    past = os.stat(old).st_mtime - art.STALE_TEMP_S - 10
    os.utime(old, (past, past))
    write_json_atomic(tmp_path / "x.json", {})
    assert not old.exists() and new.exists()


def test_artifact_kind_reads_the_marker_then_the_manifest_then_older_folders(tmp_path):
    (tmp_path / "m").mkdir()
    write_json_atomic(tmp_path / "m" / "manifest.json", {"stage": "compress"})
    assert artifact_kind(tmp_path / "m") == "compress"
    write_json_atomic(tmp_path / "m" / ".adbatch-stage.json", {"stage": "compress"})
    assert artifact_kind(tmp_path / "m") == "compress"
    for sign, kind in (("adbatch_training.json", "train"), ("refresh_summary.json", "refresh"),
                       ("_progress/run.json", "generate"), (".staging/x", "index")):
        d = tmp_path / kind
        (d / sign).parent.mkdir(parents=True, exist_ok=True)
        (d / sign).write_text("{}")
        assert artifact_kind(d) == kind
    (tmp_path / "none").mkdir()
    assert artifact_kind(tmp_path / "none") is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputOwnershipError, match="is a file, not a folder"):
        check_output_owner(tmp_path / "file", ArtifactKind.INDEX)


def test_claim_marks_a_new_folder_and_the_lock_lives_beside_it(tmp_path):
    out = tmp_path / "idx"
    with claim_output(out, ArtifactKind.INDEX) as claimed:
        assert claimed == out and artifact_kind(out) == "index"
        assert lock_path(out) == tmp_path / ".idx.adbatch-lock"
        holder = json.loads(lock_path(out).read_text())
        assert holder["pid"] == os.getpid() and holder["stage"] == "index"
        # a second claim -- even in this process -- is refused while the first holds the folder
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()} .*adbatch index"):
            with output_lock(out, ArtifactKind.INDEX):
                pass
    with claim_output(out, ArtifactKind.INDEX):  # released with the first
        pass
    assert sorted(p.name for p in out.iterdir()) == [".adbatch-stage.json"]


def test_old_local_ray_sessions_of_ended_runs_are_pruned(tmp_path):
    """Only folders a local run marked and whose driver has exited; the newest `keep` of those stay;
    a running driver's, an unmarked one and the current one are never touched."""
    from pipelines.ray_runtime import SESSION_MARK, prune_sessions

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, timeout=60)
    dead_pid = int(ended.stdout)

    def session(name, pid=None):
        d = tmp_path / f"session_2026-12-01_{name}"
        d.mkdir()
        if pid is not None:
            (d / SESSION_MARK).write_text(json.dumps({"pid": pid}))
        return d

    dead = [session(f"0{i}", dead_pid) for i in range(5)]
    live = session("10", os.getpid())
    unmarked = session("11")
    current = session("12", dead_pid)
    (tmp_path / "session_latest").symlink_to(current)
    removed = prune_sessions(tmp_path, keep=2, current=current)
    assert removed == dead[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [d.name for d in dead[3:]] + [live.name, unmarked.name, current.name, "session_latest"])
