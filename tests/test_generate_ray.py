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


def _cfg(assets, requests, out, executor):
    return pg.GenerateJobConfig(task="targets", requests=requests, index=assets["index"],
                                model=str(assets["model"]), out=out, executor=executor, batch_size=3,
                                partition_size=6, concurrency=2, targets=SEARCH, device="cpu",
                                progress=False)


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
