"""bench/targeting_speed.py end to end on the CPU (--smoke: tiny random model over the default tokenizer)
on the tiny bundle of test_query_gen_speed_bench: one row per batch x verify mode with its median, the
profiled pass, and HF generate side by side on the same prompts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.test_query_gen_speed_bench import _bundle

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("targeting_speed", REPO / "bench" / "targeting_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_times_each_batch_and_mode_and_compares_with_hf(tmp_path):
    bundle = _bundle(tmp_path)
    out = tmp_path / "ts.json"
    got = _bench().main(["--smoke", "--index", str(bundle / "index_tiny_text"), "--queries",
                         str(bundle / "train_tiny.parquet"), "--batches", "2,4", "--verify", "off,auto",
                         "--repeats", "2", "--profile", "--hf-queries", "3", "--out-json", str(out)])
    assert json.loads(out.read_text())["rows"] == got["rows"]
    timed = [(r["batch"], r["verify"]) for r in got["rows"] if not r["profile"]]
    assert timed == [(2, "off"), (2, "auto"), (4, "off"), (4, "auto")]
    import pyarrow.parquet as pq

    distinct = len(set(pq.read_table(bundle / "train_tiny.parquet").column("query").to_pylist()))
    for r in got["rows"]:
        assert r["queries"] == distinct and r["queries_per_s"] > 0 and r["steps"] >= 1
        if not r["profile"]:
            assert len(r["runs_s"]) == 2
    profiled = [r for r in got["rows"] if r["profile"]]
    assert len(profiled) == 2 and all(r["ms_decode"] > 0 and r["ms_select"] > 0 for r in profiled)
    hf = got["hf"]
    assert hf["queries"] == 3 and hf["hf_queries_per_s"] > 0 and 0.0 <= hf["hf_top10_rows_also_ours"] <= 1.0


def test_runs_as_a_script():
    """As the device runs it (``python3 bench/targeting_speed.py``): a fresh interpreter, bench/ on
    the path, where bench/kernels.py must not shadow the kernels package."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / "targeting_speed.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--hf-queries" in done.stdout
