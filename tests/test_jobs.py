"""Jobs: the nightly refresh skips unchanged stages; batch generation runs in-process and under
``ray job submit`` against a Ray head started on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from test_generate_support import target_requests, tiny_index_dir, tiny_model_dir

REPO = Path(__file__).resolve().parent.parent
SEARCH = {"num_beams": 2, "top_k": 2, "verify": "off", "fusion": "generative"}  # the tiny index has no query embedder


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs_assets")
    return {"root": root, "model": tiny_model_dir(root), "index": tiny_index_dir(root)}


def _refresh_config(assets, work, requests):
    from jobs.nightly_refresh import RefreshConfig

    ads = assets["root"] / "tiny_ads.parquet"
    return RefreshConfig.from_dict({
        "work": str(work), "model": str(assets["model"]), "num_cpus": 2,
        "index": {"config": {"ads": str(ads), "index": {"columns": {"embedding": "vec"},
                                                        "cluster": {"branching": 4, "leaf_size": 8}}}},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": str(requests), "creatives_requests": None,
                     "config": {"executor": "local", "batch_size": 4, "partition_size": 4, "targets": SEARCH}},
    })


def test_refresh_skips_unchanged_stages(ray_local, assets, tmp_path):
    from jobs.nightly_refresh import run_refresh

    req = target_requests(tmp_path / "req.parquet", n=6)
    cfg = _refresh_config(assets, tmp_path / "work", req)
    first = run_refresh(cfg)
    assert {k: v["status"] for k, v in first["stages"].items()} == {"index": "ran", "generate_targets": "ran"}
    out = pq.read_table(first["outputs"]["targets"])
    assert sorted(set(out.column("request_id").to_pylist())) == [f"q{i:04d}" for i in range(6)]
    assert Path(first["work"], "refresh_summary.json").is_file()

    second = run_refresh(cfg)
    assert {k: v["status"] for k, v in second["stages"].items()} == {"index": "skipped",
                                                                     "generate_targets": "skipped"}

    # new requests: only generation runs again
    target_requests(req, n=7)
    third = run_refresh(cfg)
    assert third["stages"]["index"]["status"] == "skipped"
    assert third["stages"]["generate_targets"]["status"] == "ran"
    assert third["generate"]["targets"]["counts"]["answered"] == 7

    # a changed decoding config reruns generation; a changed index config reruns both
    cfg2 = cfg.replace(generate=cfg.generate.replace(config=cfg.generate.config.replace(
        targets=cfg.generate.config.targets.replace(top_k=1))))
    assert run_refresh(cfg2)["stages"]["generate_targets"]["status"] == "ran"
    cfg3 = cfg2.replace(index=cfg2.index.replace(config=cfg2.index.config.replace(
        index=cfg2.index.config.index.replace(cluster=cfg2.index.config.index.cluster.replace(leaf_size=6)))))
    fourth = run_refresh(cfg3)
    assert {k: v["status"] for k, v in fourth["stages"].items()} == {"index": "ran", "generate_targets": "ran"}

    # a deleted output is noticed even though config and inputs match
    (tmp_path / "work" / "generate" / "targets" / "manifest.json").unlink()
    assert run_refresh(cfg3)["stages"]["generate_targets"]["status"] == "ran"
    manifest = lambda: json.loads((tmp_path / "work" / "index" / "manifest.json").read_text())  # noqa: E731
    assert "stable_ids" not in manifest()  # the cluster config changed: a full build
    assert run_refresh(cfg3.replace(force=["index"]))["stages"]["index"]["status"] == "ran"
    n = manifest()["counts"]["ads_indexed"]
    assert manifest()["stable_ids"]["kept"] == n  # same corpus, same config: every id kept

    # the next night: one ad gone, one new -> the others keep their codes (stable ids)
    ads = pq.read_table(assets["root"] / "tiny_ads.parquet")
    import pyarrow as pa

    new_row = ads.slice(0, 1).to_pylist()[0] | {"ad_id": "ad-new"}
    table = pa.concat_tables([ads.slice(1), pa.Table.from_pylist([new_row], schema=ads.schema)])
    pq.write_table(table, tmp_path / "night2.parquet")
    before = dict(zip(*[pq.read_table(tmp_path / "work" / "index" / "ad_codes.parquet").column(c).to_pylist()
                        for c in ("ad_id", "code")]))
    cfg4 = cfg3.replace(index=cfg3.index.replace(config=cfg3.index.config.replace(ads=tmp_path / "night2.parquet")))
    assert run_refresh(cfg4)["stages"]["index"]["status"] == "ran"
    stable = manifest()["stable_ids"]
    assert stable["new"] == 1 and stable["kept"] + stable["resplit"] == n - 1
    after = dict(zip(*[pq.read_table(tmp_path / "work" / "index" / "ad_codes.parquet").column(c).to_pylist()
                       for c in ("ad_id", "code")]))
    assert sum(after[a] == before[a] for a in after if a in before) == stable["kept"] > 0


@pytest.mark.slow
def test_batch_generate_main_in_process(ray_local, assets, tmp_path):
    from jobs.batch_generate import main

    req = target_requests(tmp_path / "req.parquet", n=5)
    metrics = main(["--task", "targets", "--requests", str(req), "--index", str(assets["index"]),
                    "--model", str(assets["model"]), "--out", str(tmp_path / "out"), "--executor", "ray",
                    "--batch-size", "5", "--targets.num-beams", "2", "--targets.top-k", "2",
                    "--targets.verify", "off", "--targets.fusion", "generative", "--progress", "false"])
    assert metrics["counts"]["answered"] == 5 and metrics["counts"]["output_rows"] == 10
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["executor"] == "ray"


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports.

    The sockets stay bound until all ``n`` are picked: a port released right away may be handed out
    again by the next bind, and Ray refuses a head whose components share a port ("is trying to use a
    port number ... that is used by other components", seen in CI). Ports inside Ray's worker range
    (10002-19999) are skipped for the same reason.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if not 10002 <= port <= 19999:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head on loopback, stopped in teardown.

    ``ray start --block`` keeps the starting process in the foreground as the owner of the head's
    processes; signalling its own process group stops exactly this head (``ray stop`` would stop
    every Ray on the machine).
    """
    ray_bin = Path(sys.executable).parent / "ray"
    port, dash, agent_http, agent_grpc, runtime_env, metrics, client = _free_ports(7)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["HF_HUB_OFFLINE"] = "1"
    # Ray >= 2.5x enables token auth on new clusters; the CLI client must be told to use it too
    env.setdefault("RAY_AUTH_MODE", "token")
    log = open(tmp_path / "ray_head.log", "w")
    # `ray start` records its address in /tmp/ray/ray_current_cluster, and a later ray.init()
    # without an address would try to join it after we stop it: put back what was there
    current = Path("/tmp/ray/ray_current_cluster")
    before = current.read_text() if current.is_file() else None
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1", "--include-dashboard=true", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1",
         # the job agent's default ports (52365, ...) may be held by an in-process Ray that an
         # earlier test in this pytest process started; a head whose agent can't bind answers
         # every submission with "No available agent"
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
         f"--ray-client-server-port={client}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"address": f"http://127.0.0.1:{dash}", "env": env, "bin": ray_bin, "log": tmp_path / "ray_head.log"}
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(head.pid, signal.SIGKILL)
        log.close()
        if current.is_file() and f":{port}" in current.read_text():
            if before is None:
                current.unlink()
            else:
                current.write_text(before)


@pytest.mark.slow
def test_ray_job_submit_batch_generate(ray_head, assets, tmp_path):
    req = target_requests(tmp_path / "req.parquet", n=6)
    out = tmp_path / "out"
    cmd = [str(ray_head["bin"]), "job", "submit", "--address", ray_head["address"],
           "--runtime-env-json", json.dumps({"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}),
           "--", sys.executable, str(REPO / "jobs" / "batch_generate.py"),
           "--task", "targets", "--requests", str(req), "--index", str(assets["index"]),
           "--model", str(assets["model"]), "--out", str(out), "--executor", "ray", "--batch-size", "3",
           "--targets.num-beams", "2", "--targets.top-k", "2", "--targets.verify", "off", "--targets.fusion", "generative",
           "--progress", "false"]
    t0 = time.time()
    while True:
        proc = subprocess.run(cmd, env=ray_head["env"], capture_output=True, text=True, timeout=600)
        # a fresh head's dashboard and job agent take a while to come up on a loaded machine
        text = proc.stdout + proc.stderr
        not_up = any(m in text for m in ("No available agent", "Connection refused", "Failed to connect",
                                         "Max retries exceeded"))
        if proc.returncode == 0 or not not_up or time.time() - t0 > 180:
            break
        time.sleep(5)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + ray_head["log"].read_text()[-2000:]
    assert "succeeded" in (proc.stdout + proc.stderr).lower()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["answered"] == 6 and manifest["executor"] == "ray"
    table = pq.read_table(out / "targets")
    assert sorted(set(table.column("request_id").to_pylist())) == [f"q{i:04d}" for i in range(6)]
    assert time.time() - t0 < 600


class _StopFit(Exception):
    pass


@pytest.fixture
def fake_ray_train(monkeypatch):
    """run_train up to Ray Train without Ray: init_ray does nothing, no GPU is asked about (that reads the
    running cluster), and the trainer records the job it is handed and stops. Yields that record. The test
    using it passed only after an earlier test had started Ray ("Ray has not been started yet" alone)."""
    import ray.train.torch

    import pipelines.ray_runtime
    import pipelines.train

    seen = {}

    class FakeTrainer:
        def __init__(self, fn, train_loop_config, **kwargs):
            seen.clear()
            seen.update(train_loop_config["job"].to_dict())

        def fit(self):
            raise _StopFit

    monkeypatch.setattr(pipelines.ray_runtime, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(pipelines.train, "resolve_use_gpu", lambda use_gpu, num_workers: bool(use_gpu))
    monkeypatch.setattr(ray.train.torch, "TorchTrainer", FakeTrainer)
    return seen


def test_train_job_passes_absolute_paths_to_the_workers(tmp_path, monkeypatch, fake_ray_train):
    """A relative --init-model is found by the driver but not by Ray Train's workers (another cwd):
    run_train hands the workers absolute paths, the starting model included."""
    from conftest import make_tiny_llama
    from pipelines.train import TrainJobConfig, run_train

    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "manifest.json").write_text('{"stage": "index"}')  # what run_train checks first
    make_tiny_llama(vocab_size=32).save_pretrained(tmp_path / "base")  # the driver checks the model folder
    seen = fake_ray_train
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_StopFit):
        run_train(TrainJobConfig(index=Path("index"), out=Path("model"), init_model="base"))
    assert seen["init_model"] == str(tmp_path.resolve() / "base")
    assert seen["index"] == str(tmp_path.resolve() / "index")
    with pytest.raises(_StopFit):
        run_train(TrainJobConfig(index=Path("index"), out=Path("model"), init_model="default"))
    assert seen["init_model"] == "default"


def _refresh_without_ray(monkeypatch, **stage_runs):
    """Patch the refresh for in-process stage-logic tests: no Ray, a base-model hash of "base", an
    index stage that only writes its manifest, and ``stage_runs`` (``"compress": fn``, ...) as the
    ``pipelines.<stage>.run_<stage>`` functions. Returns ``jobs.nightly_refresh``."""
    import importlib

    import jobs.nightly_refresh as nr
    import pipelines.index
    import pipelines.ray_runtime
    import pipelines.stage
    from adbatch.artifacts import write_json_atomic

    def fake_index(job):
        write_json_atomic(Path(job.out) / "manifest.json", {"stage": "index", "index_hash": "h"})
        return {}

    monkeypatch.setattr(pipelines.ray_runtime, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(pipelines.index, "run_index", fake_index)
    monkeypatch.setattr(pipelines.stage, "model_hash", lambda model: "base")
    for module, fn in stage_runs.items():
        name = {"eval": "evaluate"}.get(module, module)
        monkeypatch.setattr(importlib.import_module(f"pipelines.{name}"), f"run_{module}", fn)
    return nr


def _manifest_writer(stage: str, seen: list | None = None):
    """A stage run that records its job and writes only ``{"stage": stage}`` as its manifest."""
    from adbatch.artifacts import write_json_atomic

    def run(job):
        if seen is not None:
            seen.append(job)
        write_json_atomic(Path(job.out) / "manifest.json", {"stage": stage})
        return {}
    return run


def test_refresh_stamp_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    """The same config started from the repository and from elsewhere (cron, ray job submit): a
    relative input path resolves to the same file, so the unchanged stage is skipped."""
    nr = _refresh_without_ray(monkeypatch)
    cfg = nr.RefreshConfig.from_dict({
        "work": str(tmp_path / "work"), "index": {"config": {"ads": "examples/slogan_ads.parquet"}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": None, "creatives_requests": None}})
    monkeypatch.chdir(REPO)
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "ran"
    monkeypatch.chdir(tmp_path)
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "skipped"


@pytest.mark.parametrize("bad", [{"num_cpus": 0}, {"train": {"config": {"num_workers": 0}}},
                                 {"compress": {"config": {"eval_texts": 0}}}, {"compress": {"config": {"eval_seq_len": 1}}},
                                 {"generate": {"config": {"batch_size": 0}}}, {"generate": {"config": {"partition_size": 0}}},
                                 {"generate": {"config": {"concurrency": 0}}}])
def test_refresh_config_refuses_bad_stage_values_up_front(bad):
    """Refused when the config is read, naming the key, not hours later when that stage's job is built."""
    from adbatch.config import ConfigError
    from jobs.nightly_refresh import RefreshConfig

    key = bad
    while isinstance(next(iter(key.values())), dict):  # the innermost key: the value refused
        key = next(iter(key.values()))
    with pytest.raises(ConfigError, match=next(iter(key))):
        RefreshConfig.from_dict(bad)


def test_refresh_config_refuses_residual_ids_with_stable_ids_up_front():
    """Residual codes have no incremental update: with index.stable_ids (the default) the config is refused
    when read, not when the index stage starts; without stable ids it is accepted."""
    from adbatch.config import ConfigError
    from jobs.nightly_refresh import RefreshConfig

    residual = {"config": {"ads": "examples/slogan_ads.parquet",
                           "index": {"cluster": {"method": "residual"}, "render": {"scheme": "codes"}}}}
    with pytest.raises(ConfigError, match="stable_ids false"):
        RefreshConfig.from_dict({"index": residual})
    assert RefreshConfig.from_dict({"index": {**residual, "stable_ids": False}}).index.config.index.cluster.method.value == "residual"


def test_refresh_reruns_a_stage_whose_listed_outputs_were_damaged(tmp_path, monkeypatch):
    """The skip check covers the files the stage's manifest lists, not only the manifest itself."""
    import jobs.nightly_refresh as nr
    import pipelines.index
    import pipelines.ray_runtime
    import pipelines.stage
    from adbatch.artifacts import sha256_file, write_json_atomic

    def fake_index(job):
        out = Path(job.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ad_codes.parquet").write_bytes(b"codes")
        write_json_atomic(out / "manifest.json", {"stage": "index", "index_hash": "h",
                                                  "outputs": {"ad_codes.parquet": sha256_file(out / "ad_codes.parquet")}})
        return {}

    monkeypatch.setattr(pipelines.ray_runtime, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(pipelines.index, "run_index", fake_index)
    monkeypatch.setattr(pipelines.stage, "model_hash", lambda model: "base")
    cfg = nr.RefreshConfig.from_dict({
        "work": str(tmp_path / "work"), "index": {"config": {"ads": str(REPO / "examples/slogan_ads.parquet")}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": None, "creatives_requests": None}})
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "ran"
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "skipped"
    (tmp_path / "work" / "index" / "ad_codes.parquet").write_bytes(b"damaged")
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "ran"
    (tmp_path / "work" / "index" / "ad_codes.parquet").unlink()
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "ran"



def test_refresh_reruns_eval_when_what_it_reads_changes(tmp_path, monkeypatch):
    """The eval stage's stamp covers the evaluation data files and explicitly configured model folders
    by content, not only by path: an updated test file or a re-trained override model re-runs it."""
    import pipelines.stage
    from adbatch.artifacts import sha256_paths

    nr = _refresh_without_ray(monkeypatch, eval=_manifest_writer("eval"))
    monkeypatch.setattr(pipelines.stage, "model_hash", lambda model: "base" if model is None else sha256_paths(
        sorted(Path(model).glob("*.safetensors"))))
    slogans, hd = tmp_path / "slogans.csv", tmp_path / "hd.csv"
    # the columns the eval stage's pre-flight checks (the refresh runs it before the night); the rows are never read
    slogans.write_text("desc,output,company,industry,url,alias\n1,2,c,i,u,a\n")
    hd.write_text("id,product_uid,product_title,search_term,relevance\n1,2,t,s,3\n")
    override = tmp_path / "override_model"
    override.mkdir()
    (override / "model.safetensors").write_bytes(b"weights v1")
    cfg = nr.RefreshConfig.from_dict({
        "work": str(tmp_path / "work"), "index": {"config": {"ads": str(REPO / "examples/slogan_ads.parquet")}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False},
        "eval": {"enabled": True, "config": {"creatives": {"csv": str(slogans), "model": str(override)},
                                             "targeting": {"home_depot": {"csv_path": str(hd)}}}},
        "generate": {"targets_requests": None, "creatives_requests": None}})
    assert nr.run_refresh(cfg)["stages"]["eval"]["status"] == "ran"
    assert nr.run_refresh(cfg)["stages"]["eval"]["status"] == "skipped"
    slogans.write_text("desc,output,company,industry,url,alias\n1,3,c,i,u,a\n")  # the test file changed, same path
    assert nr.run_refresh(cfg)["stages"]["eval"]["status"] == "ran"
    assert nr.run_refresh(cfg)["stages"]["eval"]["status"] == "skipped"
    (override / "model.safetensors").write_bytes(b"weights v2")  # the override model re-trained in place
    assert nr.run_refresh(cfg)["stages"]["eval"]["status"] == "ran"
    assert nr.run_refresh(cfg)["stages"]["eval"]["status"] == "skipped"


def test_refresh_calibrates_compress_on_its_own_index_and_queries(tmp_path, monkeypatch):
    """Without compress.calib the compress stage calibrates on the refresh's index (its ads) and its
    labelled queries; a changed queries file or a new id rendering re-runs what depends on it."""
    import pyarrow as pa

    import adbatch.index.ids

    jobs_seen = []
    nr = _refresh_without_ray(monkeypatch, compress=_manifest_writer("compress", jobs_seen))
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": ["red sofa"], "ad_id": ["a1"]}), queries)
    ads = REPO / "examples/slogan_ads.parquet"
    cfg = nr.RefreshConfig.from_dict({
        "work": str(tmp_path / "work"), "index": {"config": {"ads": str(ads)}, "stable_ids": False},
        "train": {"enabled": False, "config": {"queries": str(queries)}}, "eval": {"enabled": False},
        "generate": {"targets_requests": None, "creatives_requests": None}})
    stages = nr.run_refresh(cfg)["stages"]
    assert stages["compress"]["status"] == "ran"
    job = jobs_seen[-1]
    assert job.calib is None and job.index == tmp_path / "work" / "index"
    assert job.queries == queries and job.ads == ads
    assert nr.run_refresh(cfg)["stages"]["compress"]["status"] == "skipped"
    pq.write_table(pa.table({"query": ["blue sofa"], "ad_id": ["a1"]}), queries)  # same path, new pairs
    assert nr.run_refresh(cfg)["stages"]["compress"]["status"] == "ran"
    # a new id rendering rebuilds the index even with the same ads and config
    monkeypatch.setattr(adbatch.index.ids, "ID_RENDER_VERSION", adbatch.index.ids.ID_RENDER_VERSION + 1)
    assert nr.run_refresh(cfg)["stages"]["index"]["status"] == "ran"
    # an explicit calibration file is used as before, and the index is not
    calib = tmp_path / "calib.txt"
    calib.write_text("one text\n")
    nr.run_refresh(cfg.replace(compress=cfg.compress.replace(config=cfg.compress.config.replace(calib=calib))))
    assert jobs_seen[-1].calib == calib and jobs_seen[-1].index is None and jobs_seen[-1].queries is None


def test_refresh_rewrites_creatives_when_the_creative_prompt_changes(tmp_path, monkeypatch):
    """The generate-creatives stage keys on the creative prompt's rendering version."""
    import adbatch.serving.prompts

    nr = _refresh_without_ray(monkeypatch, generate=_manifest_writer("generate"))
    cfg = nr.RefreshConfig.from_dict({
        "work": str(tmp_path / "work"), "index": {"config": {"ads": str(REPO / "examples/slogan_ads.parquet")}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": None,
                     "creatives_requests": str(REPO / "examples/requests_creatives.parquet")}})
    stage = "generate_creatives"
    assert nr.run_refresh(cfg)["stages"][stage]["status"] == "ran"
    assert nr.run_refresh(cfg)["stages"][stage]["status"] == "skipped"
    monkeypatch.setattr(adbatch.serving.prompts, "CREATIVE_PROMPT_VERSION", adbatch.serving.prompts.CREATIVE_PROMPT_VERSION + 1)
    assert nr.run_refresh(cfg)["stages"][stage]["status"] == "ran"
