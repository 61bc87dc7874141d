"""The generate stage on Ray Data: an actor pool, and a generation actor killed mid-run.

The fault hook (``ADBATCH_FAULT_KILL_ONCE`` = a flag file) makes the first actor to reach its
second batch delete the flag and ``os._exit``; Ray restarts the actor and retries its batch
(``max_restarts`` / ``max_task_retries``), and the job must still answer every request exactly once.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

import pipelines.generate as pg
from test_generate_support import target_requests, tiny_index_dir, tiny_model_dir

pytestmark = pytest.mark.slow

SEARCH = {"num_beams": 3, "top_k": 3, "verify": "off", "fusion": "generative"}  # the tiny index has no query embedder


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_ray_assets")
    return {"model": tiny_model_dir(root), "index": tiny_index_dir(root)}


def _cfg(assets, requests, out, executor, **kw):
    # batch 1: blocks of BLOCK_BATCHES (8) requests, so 24 requests are 3 blocks and one of the 2 actors gets a second
    base = dict(task="targets", requests=requests, index=assets["index"], model=str(assets["model"]), out=out,
                executor=executor, batch_size=1, partition_size=6, concurrency=2, targets=SEARCH, device="cpu",
                progress=False)
    return pg.GenerateJobConfig(**{**base, **kw})


def test_actor_killed_mid_run_every_request_answered_once(ray_local, assets, tmp_path, monkeypatch):
    req = target_requests(tmp_path / "req.parquet", n=24)
    flag = tmp_path / "kill-once.flag"
    flag.write_text("kill one generation actor")
    monkeypatch.setenv(pg.FAULT_KILL_ENV, str(flag))
    res = pg.run_generate(_cfg(assets, req, tmp_path / "ray_out", "ray"))
    assert not flag.exists(), "no actor reached the fault hook: the test did not kill anything"
    assert res["counts"]["answered"] == 24 and res["counts"]["partitions_run"] == 4
    out = pq.read_table(tmp_path / "ray_out" / "targets")
    keys = list(zip(out.column("request_id").to_pylist(), out.column("rank").to_pylist()))
    assert len(keys) == len(set(keys)) == 24 * 3  # nothing lost, nothing duplicated

    # same partitions and batches as the in-process executor -> the same ranking
    monkeypatch.delenv(pg.FAULT_KILL_ENV)
    pg.run_generate(_cfg(assets, req, tmp_path / "local_out", "local"))
    ref = pq.read_table(tmp_path / "local_out" / "targets")
    order = [("request_id", "ascending"), ("rank", "ascending")]
    assert out.sort_by(order).column("ad_id").to_pylist() == ref.sort_by(order).column("ad_id").to_pylist()


def test_ray_run_with_repeated_queries_writes_each_request_once(ray_local, assets, tmp_path):
    """Requests whose queries repeat, on Ray (one actor; blocks of 8 batches of 3 = 24 requests, spanning
    partitions of 5): each accepted request written once with its own rows, rejected rows kept, the model's calls
    full but for each block's last (the manifest's counts), and the ranking the local executor gives."""
    import json

    import pyarrow as pa

    from adbatch.serving.generators import BLOCK_BATCHES

    pool = [f"{w} {v}" for w in ("lamp", "drill", "saw", "pipe") for v in ("bulb", "tile", "glue")]  # 12
    queries = pool + pool[::-1] + ["hose door", "fence door", pool[0], "hose door", pool[3], "fence door"]
    ids = [f"q{i:03d}" for i in range(30)]
    req = tmp_path / "req.parquet"
    pq.write_table(pa.table({"request_id": ids + ["bad"], "query": queries + [None]}), req)
    res = pg.run_generate(_cfg(assets, req, tmp_path / "ray_out", "ray", batch_size=3, partition_size=5,
                               concurrency=1))
    assert res["counts"]["answered"] == 30 and res["counts"]["rejected"] == 1 and res["counts"]["partitions_run"] == 6
    out = pq.read_table(tmp_path / "ray_out" / "targets")
    keys = list(zip(out.column("request_id").to_pylist(), out.column("rank").to_pylist()))
    assert len(keys) == len(set(keys)) == 30 * 3 and {k[0] for k in keys} == set(ids)
    assert pq.read_table(tmp_path / "ray_out" / "rejected.parquet").column("request_id").to_pylist() == ["bad"]
    # blocks of 24 and 6 requests: block one has 12 distinct queries (4 full calls), block two 2 new ones (1 call)
    block = 3 * BLOCK_BATCHES
    first, second = set(queries[:block]), set(queries[block:]) - set(queries[:block])
    assert (len(first), len(second)) == (12, 2)
    # Ray may hand the one actor the two blocks in either order: the 6-request block first decodes its 4 distinct
    # queries (calls of 3 + 1), then the 24-request block its 10 uncached ones (3 + 3 + 3 + 1)
    thr = res["throughput"]
    assert thr["decoded"] == 14 and (thr["model_calls"], thr["model_call_fill"]) in {(5, 2.8), (6, 2.33)}
    assert json.loads((tmp_path / "ray_out" / "manifest.json").read_text())["throughput"]["model_calls"] == thr["model_calls"]

    local = pg.run_generate(_cfg(assets, req, tmp_path / "local_out", "local", batch_size=3, partition_size=5))
    assert local["throughput"]["model_calls"] == 5
    ref = pq.read_table(tmp_path / "local_out" / "targets")
    assert out.column("request_id").to_pylist() == ref.column("request_id").to_pylist()
    assert out.column("ad_id").to_pylist() == ref.column("ad_id").to_pylist()
