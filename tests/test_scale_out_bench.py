"""bench/scale_out.py without a GPU: ``--help`` and its argument checks (no Ray, torch or GPU touched),
and the helpers that judge its runs (utilisation per GPU, answered-once, 1 vs N rows). The runs
themselves are for a multi-GPU host (``--smoke`` runs them on CPU in about two minutes: not here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "scale_out.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_help_and_import_need_no_ray_or_torch():
    res = _run("--help")
    assert res.returncode == 0 and "--requests" in res.stdout and "--gpus" in res.stdout
    code = ("import sys; sys.path.insert(0, %r); import bench.scale_out; "
            "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))" % str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_arguments_are_checked_before_anything_runs(tmp_path):
    req = tmp_path / "req.parquet"
    pq.write_table(pa.table({"request_id": ["a"], "query": ["drill"]}), req)
    (tmp_path / "index").mkdir()
    cases = [
        ((), "--requests is required"),
        (("--requests", str(tmp_path / "none.parquet"), "--index", str(tmp_path)), "not found"),
        (("--requests", str(req), "--index", str(tmp_path / "index")), "not an index folder"),
        (("--phases", "generate,warp"), "--phases: ['warp']"),
    ]
    for args, message in cases:
        res = _run(*args)
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr[-500:])
    import bench.scale_out as so

    if so.visible_gpus() == 0:  # this machine: no GPU, and no --cpu -> a clear refusal
        (tmp_path / "index" / "manifest.json").write_text("{}")
        res = _run("--requests", str(req), "--index", str(tmp_path / "index"))
        assert res.returncode == 2 and "no GPU" in res.stderr and "--cpu" in res.stderr


def test_utilisation_per_gpu_and_kill_batch():
    from bench.scale_out import kill_batch_size, median_utilisation

    # two GPUs, one line each per sample; an [N/A] line keeps its place; the last sample cut after GPU 0
    lines = ["10", "90", "30", "[N/A]", "20", "70", "99"]
    assert median_utilisation(lines, 2) == [25.0, 80.0]  # GPU 0: 10 30 20 99, GPU 1: 90 70
    assert median_utilisation([], 2) == [None, None]
    # an actor call maps a block of BLOCK_BATCHES (8) batches: the default gives every actor two blocks
    assert kill_batch_size(100_000, 4, 1024) is None
    assert kill_batch_size(10_000, 4, 1024) == 104  # 10,000 // (3 blocks x 4 actors x 8)
    assert kill_batch_size(480, 2, 1024) == 10 and kill_batch_size(2, 4, 8) == 1


@pytest.mark.parametrize("task", ["targets", "creatives"])
def test_rows_compared_and_answered_once(tmp_path, task):
    from bench.scale_out import ROW_KEYS, compare_rows, exactly_once, output_rows

    rid, rank, value = ROW_KEYS[task]

    def write(name, rows):
        (tmp_path / name / task).mkdir(parents=True)
        pq.write_table(pa.table({rid: [r[0] for r in rows], rank: pa.array([r[1] for r in rows], pa.int32()),
                                 value: [r[2] for r in rows]}), tmp_path / name / task / "part-00000.parquet")
        return tmp_path / name

    one = write("one", [("q1", 1, "a"), ("q1", 2, "b"), ("q2", 1, "c")])
    many = write("many", [("q2", 1, "c"), ("q1", 2, "b"), ("q1", 1, "a")])  # other order, same answers
    other = write("other", [("q1", 1, "b"), ("q1", 2, "a"), ("q1", 2, "a"), ("q3", 1, "c")])
    assert compare_rows(output_rows(one, task), output_rows(many, task))["identical"]
    diff = compare_rows(output_rows(one, task), output_rows(other, task))
    assert diff == {"only_first": 1, "only_second": 1, "requests_differing": 1, "identical": False}
    assert exactly_once(one, task, ["q1", "q2"])["every_request_once"]
    got = exactly_once(other, task, ["q1", "q2"])
    assert got == {"rows": 4, "repeated_rows": 1, "missing": 1, "unexpected": 1, "every_request_once": False}
