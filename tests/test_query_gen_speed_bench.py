"""bench/query_gen_speed.py end to end on the CPU (--smoke: tiny random model over the default
tokenizer) on a bundle written here in bench/train_eval.py's layout: the table has one row per
dtype x batch size, each a median of its runs, and the profile names the best one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("query_gen_speed", REPO / "bench" / "query_gen_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bundle(tmp_path: Path) -> Path:
    """A 24-ad catalogue ``tiny``: titles, train pairs, test qrels and its ``text`` index."""
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.ids import IdScheme, RenderConfig
    from tests.test_training import _tiny_corpus

    ads, _, titles = _tiny_corpus(tmp_path)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    ids = list(range(1000, 1000 + len(titles)))
    pq.write_table(pa.table({"ad_id": pa.array(ids, pa.int64()), "title": titles}), bundle / "titles_tiny.parquet")
    pq.write_table(pa.table({"query": [t.split(" model")[0] for t in titles[:12]],
                             "ad_id": pa.array(ids[:12], pa.int64())}), bundle / "train_tiny.parquet")
    (bundle / "qrels_test_tiny.json").write_text(json.dumps({"held out query": {"1013": 3.0}}))
    cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                      cluster=ClusterConfig(branching=2, leaf_size=6), render=RenderConfig(scheme=IdScheme.TEXT))
    build_index(ads, bundle / "index_tiny_text", cfg, progress=False)
    return bundle


def test_smoke_times_each_dtype_and_batch_and_profiles_the_best(tmp_path):
    bench = _bench()
    out = tmp_path / "qgs.json"
    got = bench.main(["--bundle", str(_bundle(tmp_path)), "--catalogue", "tiny", "--smoke", "--ads", "6",
                      "--pairs", "12", "--batches", "2,6", "--dtypes", "float32", "--repeats", "2",
                      "--out-json", str(out)])
    assert json.loads(out.read_text())["best"] == got["best"]
    assert got["ads"] == 6 and [(r["dtype"], r["batch_size"]) for r in got["rows"]] == [("float32", 2), ("float32", 6)]
    for r in got["rows"]:
        assert len(r["runs_s"]) == 2 and min(r["runs_s"]) <= r["median_s"] <= max(r["runs_s"])
        assert r["rows_per_batch"] == r["batch_size"] * got["queries_per_ad"] and r["samples_per_s"] > 0
        # every sample is (query, ad_id, source) of one of the timed ads
        assert all(len(s) == 3 for s in r["samples"])
    assert got["fine_tune"]["steps"] >= 1
    fastest = min(got["rows"], key=lambda r: r["median_s"])
    assert got["best"] == {"dtype": "float32", "batch_size": fastest["batch_size"]}
    assert got["profile"]["wall_s"] > 0 and "Self CPU" in got["profile"]["by_self_cpu"]
