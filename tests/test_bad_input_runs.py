"""Bad-input runs (issue 19, part A): kill -9 and re-run of a stage, one stage's --out pointed at
another stage's artifact, two writers on one folder, config mistakes through the CLI, inputs checked
before Ray starts, a one-CPU Ray, and no network attempt beyond loopback.

Shared per module: one guarded local Ray of ONE CPU started by our own ``init_ray`` (every Ray process
imports ``tests/netguard/sitecustomize.py``, which refuses and records any connect beyond loopback;
the last test reads the record), one tiny model / corpus / index, and one real artifact of every stage.
Subprocesses only where the process boundary is the point (kill -9, a second writer, the exit status);
those that need Ray join the module's cluster (``RAY_ADDRESS``) instead of starting one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adbatch.artifacts import ArtifactKind, OutputLockedError, OutputOwnershipError, artifact_kind, mark_output
from test_generate_support import target_requests, tiny_corpus, tiny_model_dir

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
NETGUARD = TESTS / "netguard"
SEARCH = {"num_beams": 3, "top_k": 3, "verify": "off", "fusion": "generative"}  # the tiny index has no query embedder
INDEX_CFG = {"columns": {"embedding": "vec"}, "cluster": {"branching": 4, "leaf_size": 8}}
KINDS = [k.value for k in ArtifactKind]
SUBPROCESS_TIMEOUT = 120


# --- shared fixtures --------------------------------------------------------------------------------
def _load_netguard():
    spec = importlib.util.spec_from_file_location("adbatch_test_netguard", NETGUARD / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def netlog(tmp_path_factory):
    """The guard's record file; the guard is installed here and in every process started from here on."""
    log = tmp_path_factory.mktemp("netguard") / "attempts.jsonl"
    guard = _load_netguard()
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", guard.LOG_ENV)}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(NETGUARD)] + ([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else []))
    os.environ[guard.LOG_ENV] = str(log)
    guard.install(str(log))
    yield log
    guard.uninstall()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray1(netlog):
    """A local Ray of one CPU, started by the stages' own ``init_ray``."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    from pipelines.ray_runtime import init_ray

    init_ray(num_cpus=1)
    assert ray.cluster_resources()["CPU"] == 1.0
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_runs_assets")
    from adbatch.index.build import IndexConfig, build_index

    corpus = tiny_corpus(root / "ads.parquet", n=40)
    index = root / "index"
    build_index(corpus, index, IndexConfig.from_dict(INDEX_CFG), progress=False)
    requests = root / "requests.parquet"
    ids = [f"q{i:02d}" for i in range(10)] + ["blank", None]
    queries = [f"drill saw {i}" for i in range(10)] + ["   ", "lost id"]
    pq.write_table(pa.table({"request_id": ids, "query": queries}), requests)
    return {"root": root, "model": tiny_model_dir(root), "corpus": corpus, "index": index, "requests": requests}


def _index_job(a, out, **kw):
    from pipelines.index import IndexJobConfig

    return IndexJobConfig.from_dict({"ads": str(a["corpus"]), "out": str(out), "index": INDEX_CFG,
                                     "progress": False, **kw})


def _compress_job(a, out):
    from adbatch.compress import CalibrationConfig
    from pipelines.compress import CompressJobConfig

    return CompressJobConfig(model=str(a["model"]), out=out, use_ray=False, eval_texts=2, eval_seq_len=16,
                             calibration=CalibrationConfig(num_texts=4, seq_len=16, batch_size=4))


def _generate_job(a, out, overwrite=False, executor="local", requests=None, **kw):
    from pipelines.generate import GenerateJobConfig

    base = dict(task="targets", requests=requests or a["requests"], index=a["index"], model=str(a["model"]),
                out=out, executor=executor, batch_size=4, partition_size=4, targets=SEARCH, device="cpu",
                progress=False, overwrite=overwrite)
    base.update(kw)
    return GenerateJobConfig(**base)


def _eval_job(out):
    from pipelines.evaluate import EvalJobConfig

    return EvalJobConfig.from_dict({"out": str(out), "targeting": {"enabled": False},
                                    "creatives": {"enabled": False}})


def _refresh_job(a, work):
    from jobs.nightly_refresh import RefreshConfig

    return RefreshConfig.from_dict({
        "work": str(work), "model": str(a["model"]), "num_cpus": 1,
        "index": {"config": {"ads": str(a["corpus"]), "index": INDEX_CFG}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": None, "creatives_requests": None}})


def run_stage(kind: str, a, out, overwrite=False):
    """Run stage ``kind`` with valid inputs into ``out``."""
    if kind == "index":
        from pipelines.index import run_index

        return run_index(_index_job(a, out))
    if kind == "train":
        from pipelines.train import TrainJobConfig, run_train

        return run_train(TrainJobConfig(index=a["index"], out=out, num_cpus=1))
    if kind == "compress":
        from pipelines.compress import run_compress

        return run_compress(_compress_job(a, out))
    if kind == "generate":
        from pipelines.generate import run_generate

        return run_generate(_generate_job(a, out, overwrite=overwrite))
    if kind == "eval":
        from pipelines.evaluate import run_eval

        return run_eval(_eval_job(out))
    from jobs.nightly_refresh import run_refresh

    return run_refresh(_refresh_job(a, out))


@pytest.fixture(scope="module")
def artifacts(assets, ray1, tmp_path_factory):
    """One real output folder of every stage (train: the training checkpoint writer + the stage's marker,
    as run_train leaves it; training itself is another module's subject)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adbatch.index.build import load_index
    from adbatch.training.checkpoint import save_trained

    root = tmp_path_factory.mktemp("artifacts")
    out = {kind: root / kind for kind in KINDS}
    for kind in ("index", "compress", "generate", "eval", "refresh"):
        run_stage(kind, assets, out[kind])
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    tok = AutoTokenizer.from_pretrained(assets["model"])
    save_trained(model, tok, out["train"], {"trained_on_index": load_index(assets["index"]).index_hash})
    mark_output(out["train"], ArtifactKind.TRAIN)
    for kind, folder in out.items():
        assert artifact_kind(folder) == kind, folder
    return out


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if a stage starts (or joins) Ray."""
    import pipelines.index
    import pipelines.ray_runtime

    def started(*a, **k):
        pytest.fail("Ray started before the inputs and the --out folder were checked")

    monkeypatch.setattr(pipelines.ray_runtime, "init_ray", started)
    monkeypatch.setattr(pipelines.index, "init_ray", started)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


KILL_ON_REPLACE = '''
import os, signal, sys
_real_replace = os.replace
def _replace(src, dst, *a, **k):
    if _kill_here(str(src), str(dst)):
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_replace(src, dst, *a, **k)
os.replace = _replace
'''


def _run_killed(script: str, **env) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter that SIGKILLs itself where ``_kill_here`` says; it must die so."""
    proc = subprocess.run([sys.executable, "-c", KILL_ON_REPLACE + script], env=_env(**env), capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT, cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    return proc


def _rows_check(res: dict, out: Path, task: str = "targets") -> pa.Table:
    """rows in = answered + rejected, answered ids appear once each with top_k ranks, nothing else."""
    c = res["counts"]
    assert c["rows_in"] == c["answered"] + c["rejected"]
    table = pq.read_table(out / task)
    keys = list(zip(table.column("request_id").to_pylist(), table.column("rank").to_pylist()))
    assert len(keys) == len(set(keys)) == c["answered"] * SEARCH["top_k"]
    assert pq.read_table(out / "rejected.parquet").num_rows == c["rejected"]
    return table


# --- kill -9 and re-run -----------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_generate_killed_between_part_and_record_reruns_exactly(assets, artifacts, tmp_path):
    """Killed after partition 1's answers are written but before its completion record: the re-run
    keeps partition 0, redoes 1 and 2, and answers every accepted request exactly once."""
    from pipelines.generate import run_generate

    out = tmp_path / "gen"
    cfg = _generate_job(assets, out)
    _run_killed(f'''
def _kill_here(src, dst):
    return dst.endswith("_progress/part-00001.json")
from pipelines.generate import GenerateJobConfig, run_generate
run_generate(GenerateJobConfig.from_json({cfg.to_json()!r}))
''')
    assert (out / "targets" / "part-00001.parquet").is_file() and not (out / "_progress" / "part-00001.json").exists()
    res = run_generate(cfg)
    assert res["counts"]["partitions_skipped"] == 1 and res["counts"]["partitions_run"] == 2
    assert res["counts"] == {**res["counts"], "rows_in": 12, "answered": 10, "rejected": 2}
    table = _rows_check(res, out)
    # the same answers as an uninterrupted run of the same job (the generate artifact)
    order = [("request_id", "ascending"), ("rank", "ascending")]
    ref = pq.read_table(artifacts["generate"] / "targets").sort_by(order)
    assert table.sort_by(order).column("ad_id").to_pylist() == ref.column("ad_id").to_pylist()
    assert ref.num_rows == 10 * SEARCH["top_k"]


@pytest.mark.timeout(300)
def test_index_killed_while_moving_files_in_reruns_to_a_whole_index(assets, ray1, tmp_path):
    """An index rebuilt over an earlier one, killed after the first file left the staging folder
    (the folder then holds new and old files): the re-run leaves one whole, verified index."""
    from adbatch.index.build import load_index
    from pipelines.index import run_index

    out = tmp_path / "index"
    run_index(_index_job(assets, out))
    bigger = tiny_corpus(tmp_path / "ads60.parquet", n=60, seed=1)
    cfg = _index_job(assets, out, ads=str(bigger))
    _run_killed(f'''
def _kill_here(src, dst):
    return "/.staging/" in src and os.path.dirname(dst) == {str(out)!r}
from pipelines.index import IndexJobConfig, run_index
run_index(IndexJobConfig.from_json({cfg.to_json()!r}))
''', RAY_ADDRESS=ray1.get_runtime_context().gcs_address)
    assert (out / ".staging").is_dir()
    res = run_index(cfg)
    index = load_index(out)  # verifies every file against the manifest
    c = res["counts"]
    assert c["input_rows"] == 60 == c["ads_indexed"] + c["rejected"]
    ids = [str(x) for x in index.ad_ids]
    assert len(ids) == len(set(ids)) == c["ads_indexed"]
    assert not (out / ".staging").exists()


@pytest.mark.timeout(300)
def test_compress_killed_mid_save_reruns_and_leaves_no_temp_file(assets, tmp_path):
    """Killed with a shard written to its temp file but not renamed: the re-run writes a checkpoint that
    loads, and the killed save's temp file is gone."""
    from adbatch.compress.checkpoint import load_compressed
    from pipelines.compress import run_compress

    out = tmp_path / "compressed"
    cfg = _compress_job(assets, out)
    _run_killed(f'''
def _kill_here(src, dst):
    return dst.endswith(".safetensors") and os.path.basename(src).endswith(".tmp")
from pipelines.compress import CompressJobConfig, run_compress
run_compress(CompressJobConfig.from_json({cfg.to_json()!r}))
''')
    stale = list(out.glob(".*.tmp"))
    assert stale, "the kill left no temp file: the test killed nothing mid-write"
    run_compress(cfg)
    assert not list(out.glob(".*.tmp")), list(out.glob(".*.tmp"))
    load_compressed(out)  # checks every shard against the manifest


# --- one stage's --out on another stage's artifact --------------------------------------------------
MISUSE = [(stage, foreign, False) for stage in KINDS for foreign in KINDS if foreign != stage]
MISUSE += [("generate", foreign, True) for foreign in KINDS if foreign != "generate"]


@pytest.mark.parametrize("stage,foreign,overwrite", MISUSE,
                         ids=[f"{s}-into-{f}{'-overwrite' if o else ''}" for s, f, o in MISUSE])
def test_stage_refuses_another_stages_folder(assets, artifacts, stage, foreign, overwrite, no_ray):
    """Refused before anything is written (or Ray starts), with or without --overwrite; the other
    stage's folder is byte-for-byte unchanged."""
    folder = artifacts[foreign]
    before = snapshot(folder)
    with pytest.raises(OutputOwnershipError, match=f"holds an adbatch {foreign} artifact.*with or without --overwrite"):
        run_stage(stage, assets, folder, overwrite=overwrite)
    assert snapshot(folder) == before


@pytest.mark.parametrize("stage", KINDS)
def test_stage_refuses_a_folder_of_user_files(assets, stage, tmp_path, no_ray):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("not an adbatch file")
    with pytest.raises(OutputOwnershipError, match=r"holds no adbatch artifact \(found \['notes.txt'\]\)"):
        run_stage(stage, assets, folder, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_cli_index_into_a_compressed_checkpoint_exits_2_and_keeps_it(assets, artifacts, capsys):
    """Issue 19 item 3: `index --out <checkpoint>` replaced the checkpoint's manifest.json."""
    from adbatch.compress.checkpoint import load_compressed
    from jobs.cli import main

    before = snapshot(artifacts["compress"])
    argv = ["index", "--ads", str(assets["corpus"]), "--out", str(artifacts["compress"]),
            "--index.columns.embedding", "vec"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adbatch index: error: ") and "compress artifact" in err[0]
    assert snapshot(artifacts["compress"]) == before
    load_compressed(artifacts["compress"])


def test_cli_generate_overwrite_into_an_index_exits_2_and_keeps_it(assets, artifacts, capsys):
    """Issue 19 item 4: `generate --out <index> --overwrite true` deleted the index's manifest.json."""
    from adbatch.index.build import load_index
    from jobs.cli import main

    before = snapshot(artifacts["index"])
    argv = ["generate", "--requests", str(assets["requests"]), "--index", str(assets["index"]),
            "--model", str(assets["model"]), "--out", str(artifacts["index"]), "--overwrite", "true",
            "--executor", "local", "--device", "cpu", "--targets.fusion", "generative"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an adbatch index artifact" in err[0]
    assert snapshot(artifacts["index"]) == before
    load_index(artifacts["index"])


def test_every_stage_marks_its_folder_and_writes_with_the_umask_mode(artifacts):
    """The marker is each stage's own, and manifests / markers get 0666 & ~umask (they were 0600)."""
    from adbatch.artifacts import STAGE_MARKER, file_mode

    for kind, folder in artifacts.items():
        marker = json.loads((folder / STAGE_MARKER).read_text())
        assert marker["stage"] == kind
        for name in (STAGE_MARKER, "manifest.json", "refresh_summary.json", "adbatch_training.json"):
            if (folder / name).is_file():
                assert (folder / name).stat().st_mode & 0o777 == file_mode(), (kind, name)


def test_generate_overwrite_replaces_only_its_own_outputs(assets, artifacts, tmp_path):
    """In its own folder --overwrite replaces the earlier generate run, and only what generate wrote."""
    import shutil

    from pipelines.generate import run_generate

    out = tmp_path / "gen"
    shutil.copytree(artifacts["generate"], out)
    (out / "notes.txt").write_text("the user's own file")
    other = target_requests(tmp_path / "other.parquet", n=5)
    with pytest.raises(Exception, match="holds another generate run"):
        run_generate(_generate_job(assets, out, requests=other))
    res = run_generate(_generate_job(assets, out, overwrite=True, requests=other))
    table = _rows_check(res, out)
    assert sorted(set(table.column("request_id").to_pylist())) == [f"q{i:04d}" for i in range(5)]
    assert artifact_kind(out) == "generate" and (out / "notes.txt").read_text() == "the user's own file"


# --- two writers on one folder ----------------------------------------------------------------------
HOLDER = '''
import sys, time
from pathlib import Path
from contextlib import ExitStack
from adbatch.artifacts import ArtifactKind, output_lock
with ExitStack() as stack:
    for arg in sys.argv[1:]:
        kind, folder = arg.split("=", 1)
        stack.enter_context(output_lock(Path(folder), ArtifactKind(kind)))
    print("held", flush=True)
    time.sleep(120)
'''


@pytest.fixture
def lock_holder(artifacts):
    """Another process holding the lock of every stage's folder, killed -9 at the end."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER] + [f"{k}={p}" for k, p in artifacts.items()],
                            env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("kind", KINDS)
def test_second_writer_is_refused_naming_the_holder(kind, assets, artifacts, lock_holder, no_ray):
    """Every stage refuses a folder another process writes, naming that process; nothing is touched."""
    before = snapshot(artifacts[kind])
    with pytest.raises(OutputLockedError, match=f"being written by another adbatch run \\(pid {lock_holder.pid} "
                                               f"on .*, adbatch {kind}"):
        run_stage(kind, assets, artifacts[kind], overwrite=True)
    assert snapshot(artifacts[kind]) == before


def test_a_killed_writers_lock_does_not_block_the_next_run(assets, artifacts, lock_holder):
    """Once the holder is killed -9 its lock is gone with it: the next run proceeds at once."""
    lock_holder.send_signal(signal.SIGKILL)
    lock_holder.wait(timeout=30)
    res = run_stage("generate", assets, artifacts["generate"])
    assert res["counts"]["partitions_skipped"] == res["counts"]["partitions"]  # the same run: resumed, intact


SLOW_GENERATE = '''
import time
from pathlib import Path
import pipelines.generate as pg
_real = pg._commit_partition
def _slow(layout, task, i, answers):
    rec = _real(layout, task, i, answers)
    while True:  # the first partition is committed; hold the folder until killed
        time.sleep(0.2)
pg._commit_partition = _slow
pg.run_generate(pg.GenerateJobConfig.from_json(CFG))
'''


@pytest.mark.timeout(300)
def test_concurrent_overwrite_refused_and_the_crashed_writer_leaves_no_stale_rows(assets, tmp_path):
    """Issue 19 item 5: a second run with --overwrite while the first writes. It is refused (naming the
    first run's pid); after the first is killed -9 it runs, and the folder holds exactly its rows."""
    from pipelines.generate import run_generate

    out = tmp_path / "gen"
    first = _generate_job(assets, out, requests=target_requests(tmp_path / "r12.parquet", n=12))
    second = _generate_job(assets, out, overwrite=True, requests=target_requests(tmp_path / "r8.parquet", n=8, start=100))
    proc = subprocess.Popen([sys.executable, "-c", f"CFG = {first.to_json()!r}\n" + SLOW_GENERATE], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while not (out / "_progress" / "part-00000.json").is_file():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first writer never committed a partition"
            time.sleep(0.2)
        with pytest.raises(OutputLockedError, match=f"pid {proc.pid} .*adbatch generate"):
            run_generate(second)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    res = run_generate(second)
    table = _rows_check(res, out)
    ids = sorted(set(table.column("request_id").to_pylist()))
    assert ids == [f"q{i:04d}" for i in range(100, 108)]
    assert res["counts"]["rows_in"] == 8 and res["counts"]["answered"] == 8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["answered"] == 8 and len(manifest["outputs"]) == 3  # 2 parts + rejected


# --- config mistakes, through the CLI ---------------------------------------------------------------
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _symlink_loop(tmp_path):
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    return str(tmp_path / "loop_a")


def _gen_argv(a, t, *extra):
    return ["generate", "--requests", str(a["requests"]), "--out", str(t / "o"), "--index", str(a["index"]), *extra]


CLI_MISTAKES = {
    "unknown-key-in-file": (lambda a, t: ["generate", "--config", _write(t, "c.toml", "[generate]\nbogus = 1\n")],
                            "unknown field(s) ['bogus']"),
    "wrong-type-in-file": (lambda a, t: ["generate", "--config", _write(t, "c.toml", '[generate]\nbatch_size = "many"\n'),
                                         "--requests", str(a["requests"]), "--out", str(t / "o"), "--index", str(a["index"])],
                           "GenerateJobConfig.batch_size: expected int, got 'many'"),
    "bad-value-flag": (lambda a, t: ["index", "--ads", str(a["corpus"]), "--out", str(t / "o"), "--num-cpus", "0"],
                       "IndexJobConfig.num_cpus: must be >= 1"),
    "bad-nested-value": (lambda a, t: ["generate", "--requests", str(a["requests"]), "--out", str(t / "o"),
                                       "--index", str(a["index"]), "--partition-size", "0"],
                         "GenerateJobConfig.partition_size must be >= 1"),
    "missing-required": (lambda a, t: ["index", "--out", str(t / "o")], "IndexJobConfig.ads: required"),
    "config-file-missing": (lambda a, t: ["index", "--config", str(t / "nope.toml")], "config file not found"),
    "config-file-suffix": (lambda a, t: ["index", "--config", _write(t, "c.json", "{}")], "must end in .toml, .yaml or .yml"),
    "yaml-not-a-mapping": (lambda a, t: ["index", "--config", _write(t, "c.yaml", "- a\n- b\n")], "top level must be a mapping"),
    "targets-without-index": (lambda a, t: ["generate", "--requests", str(a["requests"]), "--out", str(t / "o")],
                              "GenerateJobConfig.index: required for task targets"),
    "model-and-compressed": (lambda a, t: ["generate", "--requests", str(a["requests"]), "--out", str(t / "o"),
                                           "--index", str(a["index"]), "--model", "m", "--compressed", "c"],
                             "give --model or --compressed, not both"),
    "requests-missing": (lambda a, t: ["generate", "--requests", str(t / "none.parquet"), "--out", str(t / "o"),
                                       "--index", str(a["index"])], "requests not found"),
    "requests-wrong-schema": (lambda a, t: ["generate", "--requests", str(a["corpus"]), "--out", str(t / "o"),
                                            "--index", str(a["index"]), "--model", str(a["model"]), "--executor", "local"],
                              "request"),
    "index-not-an-index": (lambda a, t: ["generate", "--requests", str(a["requests"]), "--out", str(t / "o"),
                                         "--index", str(a["root"]), "--model", str(a["model"]), "--executor", "local"],
                           "not a finished adbatch artifact"),
    "corpus-missing": (lambda a, t: ["index", "--ads", str(t / "none.parquet"), "--out", str(t / "o")],
                       "no such file, folder, or glob match"),
    "calib-missing": (lambda a, t: ["compress", "--model", str(a["model"]), "--calib", str(t / "none.txt"),
                                    "--out", str(t / "o"), "--use-ray", "false"], "CalibrationConfig.path"),
    "calib-wrong-kind": (lambda a, t: ["compress", "--model", str(a["model"]), "--calib", _write(t, "c.csv", "a,b\n"),
                                       "--out", str(t / "o"), "--use-ray", "false"], "must be .txt/.md or .parquet"),
    "model-missing": (lambda a, t: ["compress", "--model", str(t / "no_model"), "--out", str(t / "o")], "model not found"),
    "train-on-a-non-index": (lambda a, t: ["train", "--index", str(a["root"]), "--out", str(t / "o")],
                             "is not an index folder"),
    "train-queries-without-ad-id": (lambda a, t: ["train", "--index", str(a["index"]), "--out", str(t / "o"),
                                                  "--queries", str(a["requests"])],
                                    "labelled queries need column(s) ['ad_id']"),
    "refresh-unknown-force": (lambda a, t: ["refresh", "--force", "everything"], "RefreshConfig.force: unknown stage"),
    "refresh-ads-missing": (lambda a, t: ["refresh", "--work", str(t / "w"), "--index.config.ads", str(t / "none.parquet")],
                            "RefreshConfig.index.config.ads"),
    # issue 43 items 5-8
    "toml-malformed": (lambda a, t: ["generate", "--config", _write(t, "c.toml", "[generate\nbatch_size = 4\n")],
                       "c.toml: not valid TOML"),
    "yaml-malformed": (lambda a, t: ["index", "--config", _write(t, "c.yaml", "index: [1, 2\nout: x\n")],
                       "c.yaml: not valid YAML"),
    "int-beyond-int64-in-file": (lambda a, t: _gen_argv(a, t, "--config", _write(
        t, "c.toml", "[generate]\npartition_size = 99999999999999999999\n")),
        "GenerateJobConfig.partition_size: 99999999999999999999 is out of range"),
    "int-beyond-int64-flag": (lambda a, t: ["index", "--ads", str(a["corpus"]), "--out", str(t / "o"),
                                            "--index.cluster.seed", str(2**64)], "ClusterConfig.seed: 18446744073709551616 is out of range"),
    "float-nan-flag": (lambda a, t: _gen_argv(a, t, "--targets.length-penalty", "nan"),
                       "TargetSearchConfig.length_penalty: expected a finite number, got nan"),
    "float-inf-flag": (lambda a, t: _gen_argv(a, t, "--targets.length-penalty", "inf"),
                       "TargetSearchConfig.length_penalty: expected a finite number, got inf"),
    "float-inf-in-file": (lambda a, t: _gen_argv(a, t, "--config", _write(t, "c.toml", "[generate.targets]\nlength_penalty = -inf\n")),
                          "TargetSearchConfig.length_penalty: expected a finite number, got -inf"),
    # issue 43 item 1, as reproduced: `generate --executor local` ran a tokenizer's custom code on a "y"
    "generate-custom-code-model": (lambda a, t: _gen_argv(a, t, "--model", _model_copy(a, t, _declares_code),
                                                          "--executor", "local", "--device", "cpu"),
                                   "ships its own Python code (auto_map in config.json (modeling_evil.py)); adbatch "
                                   "does not run it"),
    "requests-symlink-loop": (lambda a, t: ["generate", "--requests", _symlink_loop(t), "--out", str(t / "o"),
                                            "--index", str(a["index"])], "requests not found: "),
    # issue 58, on Ray (the CLI's default executor): every one refused by the driver before Ray starts
    "generate-record-fusion-nan": (lambda a, t: _gen_argv(a, t, "--model", _trained_copy(
        a, t, fusion={"method": "interpolation", "weight_generative": float("nan")}), "--targets.fusion", "generative"),
        "adbatch_training.json: FusionParams.weight_generative: expected a finite number, got nan"),  # case 1
    "generate-record-truncated": (lambda a, t: _gen_argv(a, t, "--model", _trained_copy(a, t, truncate=True),
                                                         "--targets.fusion", "generative"),
                                  "adbatch_training.json: not valid JSON"),  # case 2
    "generate-record-fusion-a-list": (lambda a, t: _gen_argv(a, t, "--model", _trained_copy(a, t, fusion=[1, 2]),
                                                             "--targets.fusion", "generative"),
                                      "adbatch_training.json: fusion must be a mapping"),  # case 2
    "generate-embeddings-without-the-tensor": (lambda a, t: _gen_argv(a, t, "--index", _index_copy(a, t, _dense_channel(
        tensors={"vectors": np.ones((40, 8), np.float16)})), "--targets.fusion", "dense"),
        "embeddings.safetensors: holds no 'embeddings' tensor (found ['vectors'])"),  # case 3
    "index-query-embedder-empty-folder": (lambda a, t: _index_argv(a, t, "--index.embedding.query-embedder", _empty_dir(t)),
                                          "the folder is empty"),  # case 4
    "train-valid-ids-int-for-str-index": (lambda a, t: _train_argv(a, t, _valid_pairs(t, [1, 2, 3])),
                                          "its ad ids are int, the index's str"),  # case 5
    "train-valid-ids-not-in-the-index": (lambda a, t: _train_argv(a, t, _valid_pairs(t, ["nope-1", "nope-2", "nope-3"])),
                                         "none of the 3 ad ids of"),  # case 6
    "generate-top-k-1e9": (lambda a, t: _gen_argv(a, t, "--targets.top-k", "1000000000"),
                           "TargetSearchConfig.top_k must be in [1, 1024], got 1000000000"),  # case 7
    "generate-num-beams-2e62": (lambda a, t: _gen_argv(a, t, "--targets.num-beams", str(2**62)),
                                f"TargetSearchConfig.num_beams must be in [1, 1024], got {2**62}"),  # case 7
    # issue 58, also seen
    "generate-record-query-embedder-leaves-the-model": (lambda a, t: _gen_argv(a, t, "--model", _trained_copy(
        a, t, query_embedder={"dir": "../../x", "sha256": "0" * 64, "base": {"name": "default", "sha256": "0" * 64}}),
        "--targets.fusion", "generative"), "dir '../../x' leaves the model folder"),
    "index-query-embedder-code-in-a-module-folder": (lambda a, t: _index_argv(
        a, t, "--index.embedding.query-embedder", _minilm_copy(t, _code_in_a_module_folder)),
        "1_Pooling ships its own Python code (auto_map in config.json (configuration_evil.py))"),
    "generate-embeddings-deleted": (lambda a, t: _gen_argv(a, t, "--index", _index_copy(a, t, _unlink_embeddings),
                                                           "--targets.fusion", "generative"),
                                    "embeddings.safetensors: listed in"),
    "index-query-embedder-names-the-index-embedder": (lambda a, t: _index_argv(
        a, t, "--index.embedding.query-embedder", "index:embedder"), "an index built from the corpus's embeddings keeps none"),
}


# --- issue 58: the inputs of the dense channel and the fusion ----------------------------------------------------
def _trained_copy(a, t, truncate=False, **record):
    """A copy of the tiny model bound to the module's index by a training record with ``record`` merged in (the
    record's file cut in half with ``truncate``)."""
    import shutil

    from adbatch.serving.prompts import TARGETING_PROMPT_VERSION

    d = t / "trained_copy"
    shutil.copytree(a["model"], d)
    index_hash = json.loads((Path(a["index"]) / "manifest.json").read_text())["index_hash"]
    text = json.dumps({"trained_on_index": index_hash, "targeting_prompt_version": TARGETING_PROMPT_VERSION, **record})
    (d / "adbatch_training.json").write_text(text[:len(text) // 2] if truncate else text)
    return str(d)


def _index_copy(a, t, edit):
    """A copy of the module's index, ``edit(folder, manifest)`` applied and the manifest written back."""
    import shutil

    d = t / "index_copy"
    shutil.copytree(a["index"], d)
    manifest = json.loads((d / "manifest.json").read_text())
    edit(d, manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return str(d)


def _dense_channel(embedder="default", tensors=None):
    """An index edit: a dense channel answered by ``embedder`` (by its identity); ``tensors`` replace the
    embeddings file's content, the manifest's sha256 following it (only the content is wrong)."""
    def edit(d, manifest):
        from adbatch.artifacts import sha256_file
        from adbatch.index.dense import embedder_identity

        manifest["dense"]["query_embedder"] = embedder_identity(embedder)
        if tensors is not None:
            from safetensors.numpy import save_file

            save_file(tensors, str(d / "embeddings.safetensors"))
            manifest["outputs"]["embeddings.safetensors"] = sha256_file(d / "embeddings.safetensors")
    return edit


def _unlink_embeddings(d, manifest):
    (d / "embeddings.safetensors").unlink()


def _index_argv(a, t, *extra):
    return ["index", "--ads", str(a["corpus"]), "--out", str(t / "o"), "--index.columns.embedding", "vec", *extra]


def _empty_dir(t):
    (t / "empty").mkdir()
    return str(t / "empty")


def _minilm_copy(t, edit):
    """The packaged MiniLM folder with its files linked, not copied, then ``edit(folder)`` (which replaces a file
    by unlinking it first: never writing through the link into the installed package)."""
    import shutil

    from adbatch.index.embeddings import default_embedding_model_dir

    d = t / "minilm_copy"
    shutil.copytree(default_embedding_model_dir(), d, copy_function=os.symlink)
    edit(d)
    return str(d)


def _replace_file(path, text):
    path.unlink()
    path.write_text(text)


def _code_in_a_module_folder(d):
    cfg = json.loads((d / "1_Pooling" / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    _replace_file(d / "1_Pooling" / "config.json", json.dumps(cfg))
    (d / "1_Pooling" / "configuration_evil.py").write_text("raise SystemExit('custom code ran')\n")


def _module_that_is_not_a_module(d):
    mods = json.loads((d / "modules.json").read_text())
    mods[-1]["type"] = "sentence_transformers.util.cos_sim"  # in the package, but a function
    _replace_file(d / "modules.json", json.dumps(mods))


def _valid_pairs(t, ad_ids):
    path = t / "valid.parquet"
    pq.write_table(pa.table({"query": [f"validation query {i}" for i in range(len(ad_ids))], "ad_id": ad_ids}), path)
    return str(path)


def _train_argv(a, t, valid):
    return ["train", "--index", str(a["index"]), "--out", str(t / "o"), "--valid-queries", valid,
            "--train.eval-every", "1"]


@pytest.mark.parametrize("case", sorted(CLI_MISTAKES))
def test_cli_user_error_is_one_line_and_exit_2(case, assets, tmp_path, capsys, no_ray):
    """A config / input mistake: exit status 2, one line on stderr naming the mistake, nothing on
    stdout, no traceback, no output folder and no Ray started."""
    from jobs.cli import main

    argv, expected = CLI_MISTAKES[case]
    assert main(argv(assets, tmp_path)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("adbatch ") and ": error: " in lines[0] and expected in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def _our_lines(err: str, stage: str) -> list[str]:
    """The error lines of ours in ``err`` (loading a model also draws transformers' progress bar on stderr)."""
    return [line for line in err.splitlines() if line.startswith(f"adbatch {stage}: error: ")]


INDEX_EMBEDDER_LOADS = {  # issue 58 case 4: refusals that need the embedder loaded (and its progress bar drawn)
    "other-dimension": (lambda t: "default", "embeds queries as 384-d vectors, but the ads' embeddings are 8-d"),
    "module-that-is-not-a-module": (lambda t: _minilm_copy(t, _module_that_is_not_a_module),
                                    "not a loadable sentence-transformers folder (AttributeError: "),
}


@pytest.mark.parametrize("case", sorted(INDEX_EMBEDDER_LOADS))
def test_index_loads_the_query_embedder_once_before_ray(case, assets, tmp_path, capsys, no_ray):
    """Issue 58 case 4: `index` with --index.embedding.query-embedder naming an embedder that cannot answer the
    corpus's vectors exited 0 with a dense channel that could not work. Now it loads the embedder once, with the
    refusals generate makes, and checks its width against the vectors: one line, exit 2, before Ray, no folder."""
    from jobs.cli import main

    embedder, expected = INDEX_EMBEDDER_LOADS[case]
    assert main(_index_argv(assets, tmp_path, "--index.embedding.query-embedder", embedder(tmp_path))) == 2
    err = capsys.readouterr().err
    ours = _our_lines(err, "index")
    assert len(ours) == 1 and expected in ours[0] and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "o").exists()


def test_generate_maps_an_embedder_load_failure_to_one_line(assets, tmp_path, capsys):
    """Issue 58 case 4, generate's side: an index naming (by its true hash) an embedder whose modules.json names a
    sentence_transformers attribute that is not a module raised an AttributeError traceback in the generator."""
    from jobs.cli import main

    index = _index_copy(assets, tmp_path, _dense_channel(embedder=_minilm_copy(tmp_path, _module_that_is_not_a_module)))
    argv = _gen_argv(assets, tmp_path, "--index", index, "--model", str(assets["model"]), "--executor", "local",
                     "--device", "cpu", "--targets.fusion", "dense", "--progress", "false")
    assert main(argv) == 2
    err = capsys.readouterr().err
    ours = _our_lines(err, "generate")
    assert len(ours) == 1 and "minilm_copy: not a loadable sentence-transformers folder (AttributeError" in ours[0], err[-3000:]
    assert "Traceback" not in err


def test_some_validation_ids_outside_the_index_are_named(assets, tmp_path, caplog):
    """Issue 58 case 6, the partial case: allowed (the index may hold a subset of the catalogue), with a warning
    that says how many validation ad ids name no ad of the index."""
    import logging

    from pipelines.train import check_pairs_in_index

    valid = _valid_pairs(tmp_path, ["ad-000", "ad-001", "nope-1"])
    with caplog.at_level(logging.WARNING, logger="pipelines.train"):
        check_pairs_in_index(assets["index"], valid, ["ad-000", "ad-001", "nope-1", "ad-000"], "valid_queries")
    assert "1 of 3 ad ids of" in caplog.text and "'nope-1'" in caplog.text and "score 0" in caplog.text


@pytest.mark.timeout(300)
def test_index_on_a_full_disk_is_one_line_and_frees_the_folder(assets, ray1, tmp_path, monkeypatch, capsys):
    """Issue 58 case 8: ENOSPC while the index stage writes its embeddings. safetensors raises its own
    SafetensorError, not an OSError, so the stage ended in a traceback (exit 1). Now, as generate: exit 2, one line
    naming the folder and the errno; the lock is free and the re-run builds a whole index."""
    import safetensors
    import safetensors.torch

    from adbatch.index.build import load_index
    from jobs.cli import main

    real = safetensors.torch.save_file

    def full(tensors, filename, *a, **k):  # the text safetensors 0.8 gives a write that hit a full disk
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28) "
                                          f'at path "{Path(filename).parent}/.tmpENOSPC"')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "index"
    argv = _index_argv(assets, tmp_path, "--index.cluster.branching", "4", "--index.cluster.leaf-size", "8",
                       "--progress", "false")
    argv[argv.index("--out") + 1] = str(out)
    assert main(argv) == 2
    err = capsys.readouterr().err
    ours = _our_lines(err, "index")
    assert len(ours) == 1 and f"cannot write {out}" in ours[0] and "ENOSPC, errno 28" in ours[0], err[-3000:]
    assert "Traceback" not in err
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert main(argv) == 0  # the lock was released; the staging folder the failed run left is dropped
    assert load_index(out).num_ads == 40 and not (out / ".staging").exists()


def test_cli_model_folder_mistake_is_one_line_and_exit_2(tmp_path, capsys):
    """A pickle-only --model folder (adbatch.models.ModelFolderError, part B's check) is a user error too."""
    import torch

    from conftest import make_tiny_llama
    from jobs.cli import main

    model = make_tiny_llama(vocab_size=32)
    model.config.save_pretrained(tmp_path / "pickled")
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    calib = _write(tmp_path, "calib.txt", "one text\nanother text\n")
    assert main(["compress", "--model", str(tmp_path / "pickled"), "--calib", calib, "--out", str(tmp_path / "o"),
                 "--use-ray", "false"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pytorch_model.bin" in lines[0] and "safetensors" in lines[0], lines


def test_cli_debug_shows_the_traceback_and_a_bug_is_not_hidden(assets, tmp_path, monkeypatch):
    from adbatch.config import ConfigError
    from jobs.cli import main

    with pytest.raises(ConfigError, match="num_cpus"):
        main(["--debug", "index", "--ads", str(assets["corpus"]), "--out", str(tmp_path / "o"), "--num-cpus", "0"])
    with pytest.raises(ConfigError, match="num_cpus"):
        main(["index", "--debug", "--ads", str(assets["corpus"]), "--out", str(tmp_path / "o"), "--num-cpus", "0"])
    import jobs.batch_generate
    from jobs.config_cli import run_entrypoint

    argv = ["--requests", str(tmp_path / "none.parquet"), "--out", str(tmp_path / "o"), "--index", str(assets["index"])]
    assert run_entrypoint(jobs.batch_generate.main, "batch_generate", argv) == 2
    with pytest.raises(ValueError, match="requests not found"):  # RequestSchemaError; the scripts' --debug
        run_entrypoint(jobs.batch_generate.main, "batch_generate", argv + ["--debug"])
    import pipelines.index

    def broken(config):
        raise KeyError("a bug of ours, not the user's mistake")

    monkeypatch.setattr(pipelines.index, "run_index", broken)
    with pytest.raises(KeyError):  # not a user error: it keeps its traceback
        main(["index", "--ads", str(assets["corpus"]), "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("script", ["cli", "batch_generate", "nightly_refresh"])
def test_entry_point_exit_status_2_and_one_line(script, assets, tmp_path):
    """The real processes: ``adbatch`` (python -m jobs.cli), ``jobs/batch_generate.py`` and
    ``jobs/nightly_refresh.py`` exit 2 with one stderr line; with --debug the traceback is back
    (exit 1; as a process once, on ``adbatch``; the scripts' ``run_entrypoint`` in-process above)."""
    cmd = {"cli": [sys.executable, "-m", "jobs.cli", "generate"],
           "batch_generate": [sys.executable, str(REPO / "jobs" / "batch_generate.py")],
           "nightly_refresh": [sys.executable, str(REPO / "jobs" / "nightly_refresh.py")]}[script]
    if script == "nightly_refresh":
        args = ["--work", str(tmp_path / "w"), "--index.config.ads", str(tmp_path / "none.parquet")]
        expected = "RefreshConfig.index.config.ads"
    else:
        args = ["--requests", str(tmp_path / "none.parquet"), "--out", str(tmp_path / "o"), "--index", str(assets["index"])]
        expected = "requests not found"
    proc = subprocess.run(cmd + args, env=_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]
    if script != "cli":  # the in-process tests above cover `adbatch --debug`
        return
    debug = subprocess.run(cmd + args + ["--debug"], env=_env(), capture_output=True, text=True,
                           timeout=SUBPROCESS_TIMEOUT, cwd=REPO)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr and expected in debug.stderr


# --- I/O errors while writing: one line, the folder and the errno, the lock released (issue 43 items 2, 9) ---
DISK_FULL = '''
import errno, os, sys
import pyarrow.parquet as pq
_real_write = pq.write_table
def _full(table, where, *a, **k):  # the disk fills up as partition 1's answers are written
    if "/targets/" in os.fspath(where) and "part-00001" in os.fspath(where):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real_write(table, where, *a, **k)
pq.write_table = _full
from jobs.cli import main
sys.exit(main(ARGV))
'''


@pytest.mark.timeout(300)
def test_generate_on_a_full_disk_ends_at_once_with_one_line_and_frees_the_folder(assets, ray1, tmp_path):
    """ENOSPC while a partition is committed, with the Ray pipeline mid-flight: the driver printed the
    traceback and never exited (Ray Data's threads), holding the lock. Now: exit 2 well within the bound,
    one line naming the folder and the errno; the next run takes the folder at once and resumes exactly."""
    from pipelines.generate import run_generate

    out = tmp_path / "gen"
    req = target_requests(tmp_path / "r.parquet", n=40)
    argv = ["generate", "--requests", str(req), "--index", str(assets["index"]), "--model", str(assets["model"]),
            "--out", str(out), "--batch-size", "4", "--partition-size", "4", "--device", "cpu", "--progress", "false",
            *[x for k, v in SEARCH.items() for x in (f"--targets.{k.replace('_', '-')}", str(v))]]
    proc = subprocess.run([sys.executable, "-c", f"ARGV = {argv!r}\n" + DISK_FULL], capture_output=True, text=True,
                          env=_env(RAY_ADDRESS=ray1.get_runtime_context().gcs_address), timeout=SUBPROCESS_TIMEOUT,
                          cwd=REPO)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("adbatch generate: error: ")]
    assert proc.returncode == 2 and len(ours) == 1, proc.stderr[-3000:]
    assert f"cannot write {out}" in ours[0] and "ENOSPC, errno 28" in ours[0] and "Traceback" not in proc.stderr
    assert (out / "_progress" / "part-00000.json").is_file() and not (out / "targets" / "part-00001.parquet").exists()
    res = run_generate(_generate_job(assets, out, requests=req))  # the lock is free; the same run resumes
    assert res["counts"]["partitions_skipped"] == 1 and res["counts"]["answered"] == 40
    _rows_check(res, out)


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """``tmp_path/ro``: a folder that refuses every write as a read-only mount does (EROFS)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(path):
        if os.path.abspath(os.fsdecode(path)).startswith(str(ro) + os.sep):
            raise OSError(30, os.strerror(30), os.fsdecode(path))

    def ro_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_open(path, flags, *a, **k)

    def ro_mkdir(path, *a, **k):
        if os.path.isdir(path):  # what Linux answers first on a read-only mount too
            raise FileExistsError(17, os.strerror(17), os.fsdecode(path))
        refuse(path)
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(os, "mkdir", ro_mkdir)
    return ro


@pytest.mark.parametrize("stage", ["index", "generate"])
def test_out_on_a_read_only_file_system_is_one_line(stage, assets, read_only, capsys, no_ray):
    from jobs.cli import main

    out = read_only / "out"
    argv = (["index", "--ads", str(assets["corpus"]), "--index.columns.embedding", "vec"] if stage == "index" else
            ["generate", "--requests", str(assets["requests"]), "--index", str(assets["index"]), "--model",
             str(assets["model"]), "--executor", "local", "--device", "cpu", "--targets.fusion", "generative"])
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"adbatch {stage}: error: cannot write {read_only} (EROFS, errno 30"), err


# --- inputs are checked before Ray starts -----------------------------------------------------------
def _bad_corpus(t):
    p = t / "bad_ads.parquet"
    pq.write_table(pa.table({"ad_id": ["a", "b"], "title": ["", None]}), p)
    return p


def _model_copy(a, t, mutate):
    import shutil

    d = t / "model_copy"
    shutil.copytree(a["model"], d)
    mutate(d)
    return str(d)


def _pickle_only(d):
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


def _declares_code(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modeling_evil.py").write_text("raise SystemExit('custom code ran')\n")


def _smaller_vocab(d):
    """The same tokenizer, a model of 1000 token embeddings: the trie's token ids go beyond it."""
    from conftest import make_tiny_llama

    for f in d.glob("*.safetensors"):
        f.unlink()
    make_tiny_llama(vocab_size=1000, hidden=32, intermediate=64, heads=2, kv_heads=1).save_pretrained(d)


def _damaged_trie(a, t):
    import shutil

    d = t / "index_copy"
    shutil.copytree(a["index"], d)
    trie = d / "trie.safetensors"
    data = bytearray(trie.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = b"\xff" * 16
    trie.write_bytes(bytes(data))
    return d


def _compressed_with_flipped_byte(a, t):
    from transformers import AutoTokenizer

    from adbatch.compress import CompressConfig, compress_, save_compressed
    from conftest import make_tiny_llama

    model = make_tiny_llama(vocab_size=1000, hidden=32, intermediate=64, heads=2, kv_heads=1)
    recipe = compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform"))
    d = t / "compressed"
    save_compressed(model, AutoTokenizer.from_pretrained(a["model"], trust_remote_code=False), recipe, d)
    shard = next(d.glob("packed-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[int(len(data) * 0.75)] ^= 0x01
    shard.write_bytes(bytes(data))
    return d


def _tokenizer_without_eos(a, t):
    """The model's tokenizer (and config.json, which names a model folder) with its EOS token removed."""
    import shutil

    d = t / "tokenizer_without_eos"
    d.mkdir()
    for f in list(Path(a["model"]).glob("tokenizer*")) + [Path(a["model"]) / "config.json"]:
        shutil.copy(f, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


def _refresh_with(a, t, ads=None, index=INDEX_CFG, targets=None, model=None):
    from jobs.nightly_refresh import RefreshConfig

    return RefreshConfig.from_dict({
        "work": str(t / "o"), "model": model or str(a["model"]), "num_cpus": 1,
        "index": {"config": {"ads": str(ads or a["corpus"]), "index": index}, "stable_ids": False},
        "train": {"enabled": False}, "compress": {"enabled": False}, "eval": {"enabled": False},
        "generate": {"targets_requests": None if targets is None else str(targets), "creatives_requests": None}})


def _requests_with_corrupt_pages(t):
    """Bytes flipped in the middle of the data pages; the footer (the schema) stays readable."""
    path = target_requests(t / "corrupt_requests.parquet", n=3000)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    pq.read_schema(path)
    return path


BEFORE_RAY = {
    "index-no-valid-ads": lambda a, t: ("index", _index_job(a, t / "o", ads=str(_bad_corpus(t)), index={}), "no valid ads"),
    "generate-requests-schema": lambda a, t: ("generate", _generate_job(a, t / "o", executor="ray", requests=a["corpus"]), "request"),
    "train-index-missing": lambda a, t: ("train", __import__("pipelines.train", fromlist=["x"]).TrainJobConfig(
        index=t / "none", out=t / "o"), "index folder not found"),
    "compress-calib-missing": lambda a, t: ("compress", _compress_job(a, t / "o").replace(calib=t / "none.txt"), "not found"),
    # issue 43 item 10
    "index-text-scheme-tokenizer-without-eos": lambda a, t: ("index", _index_job(a, t / "o", index={
        **INDEX_CFG, "tokenizer": _tokenizer_without_eos(a, t), "render": {"scheme": "text"}}),
        r"scheme 'text' ends every ad's sequence with an end-of-sequence token, and the tokenizer .* has none"),
    # issue 43 item 3: the model, checkpoint and index the actors would load, checked by the driver
    "generate-pickle-only-model": lambda a, t: ("generate", _generate_job(a, t / "o", executor="ray", model=_model_copy(
        a, t, _pickle_only)), r"only pickle weight files \(pytorch_model.bin\)"),
    "generate-custom-code-model": lambda a, t: ("generate", _generate_job(a, t / "o", executor="ray", model=_model_copy(
        a, t, _declares_code)), r"ships its own Python code \(auto_map in config.json \(modeling_evil.py\)\)"),
    "generate-model-vocab-below-the-trie": lambda a, t: ("generate", _generate_job(a, t / "o", executor="ray", model=_model_copy(
        a, t, _smaller_vocab)), "has a vocabulary of 1000 tokens but index .* trie uses token ids up to"),
    "generate-trie-overwritten": lambda a, t: ("generate", _generate_job(a, t / "o", executor="ray", index=_damaged_trie(a, t)),
                                               r"trie.safetensors: sha256 \w+ does not match the manifest"),
    "generate-compressed-byte-flipped": lambda a, t: ("generate", _generate_job(
        a, t / "o", executor="ray", model=None, compressed=_compressed_with_flipped_byte(a, t)),
        r"packed-00000.safetensors: sha256 .* \(file was modified\)"),
    "compress-custom-code-model": lambda a, t: ("compress", _compress_job(a, t / "o").replace(
        model=_model_copy(a, t, _declares_code), use_ray=True), "ships its own Python code"),
    "train-pickle-only-init-model": lambda a, t: ("train", __import__("pipelines.train", fromlist=["x"]).TrainJobConfig(
        index=a["index"], out=t / "o", init_model=_model_copy(a, t, _pickle_only)), "only pickle weight files"),
    # issue 43 item 4: the refresh checks every stage's outside inputs before running the first
    "refresh-corpus-without-valid-ads": lambda a, t: ("refresh", _refresh_with(a, t, ads=_bad_corpus(t), index={}),
                                                      "no valid ads"),
    "refresh-request-file-corrupt-inside": lambda a, t: ("refresh", _refresh_with(
        a, t, targets=_requests_with_corrupt_pages(t)), "corrupt_requests.parquet: corrupt Parquet data"),
    "refresh-pickle-only-model": lambda a, t: ("refresh", _refresh_with(a, t, model=_model_copy(a, t, _pickle_only)),
                                               "only pickle weight files"),
    "refresh-ads-missing": lambda a, t: ("refresh", _refresh_job(a, t / "o").replace(
        index=_refresh_job(a, t / "o").index.replace(config=_refresh_job(a, t / "o").index.config.replace(
                       ads=t / "none.parquet"))), "not found"),
}


@pytest.mark.parametrize("case", sorted(BEFORE_RAY))
def test_bad_input_is_refused_before_ray_starts(case, assets, tmp_path, no_ray):
    from jobs.config_cli import is_user_error

    stage, cfg, expected = BEFORE_RAY[case](assets, tmp_path)
    runner = {"index": "pipelines.index:run_index", "generate": "pipelines.generate:run_generate",
              "train": "pipelines.train:run_train", "compress": "pipelines.compress:run_compress",
              "refresh": "jobs.nightly_refresh:run_refresh"}[stage]
    module, fn = runner.split(":")
    with pytest.raises((ValueError, FileNotFoundError), match=expected) as info:
        getattr(importlib.import_module(module), fn)(cfg)
    assert is_user_error(info.value)  # one line and exit 2 from the CLI
    assert not (tmp_path / "o").exists()


def test_index_render_failure_leaves_no_staging_folder(assets, tmp_path):
    """The library path (no driver check): rendering refuses the tokenizer before the staging folder exists."""
    from adbatch.config import ConfigError
    from adbatch.index.build import IndexConfig, build_index

    out = tmp_path / "index"
    cfg = IndexConfig.from_dict({**INDEX_CFG, "tokenizer": _tokenizer_without_eos(assets, tmp_path)})
    with pytest.raises(ConfigError, match="has none"):
        build_index(assets["corpus"], out, cfg, progress=False)
    assert not (out / ".staging").exists()


# --- a one-CPU Ray ------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_generate_on_a_one_cpu_ray_completes(assets, ray1, tmp_path):
    """Issue 19 item 1: on a 1-CPU Ray the actor took 0.5 CPU and Ray Data's file listing waited
    forever for a whole one. The timeout bounds the test; the run must finish and answer everything."""
    from pipelines.generate import run_generate

    out = tmp_path / "gen"
    res = run_generate(_generate_job(assets, out, executor="ray", num_cpus=1, batch_size=3))
    assert ray1.cluster_resources()["CPU"] == 1.0
    assert res["counts"]["answered"] == 10 and res["counts"]["partitions_run"] == 3
    _rows_check(res, out)


# --- no network beyond loopback (keep last: it reads what every test above did) ----------------------
LOOPBACK_RAY = '''
from pipelines.ray_runtime import init_ray
init_ray(num_cpus=1)
import ray
print(sorted({n["NodeManagerAddress"] for n in ray.nodes()} | {ray.util.get_node_ip_address()}))
'''


@pytest.mark.timeout(120)
def test_a_local_ray_started_by_init_ray_listens_on_loopback_only():
    """Started before anything imported Ray (as every entry point does): the node's address is
    127.0.0.1, so no Ray port listens on the machine's other interfaces and Ray does not look up its
    address by a UDP connect to 8.8.8.8 (C code the guard cannot see; strace shows it otherwise)."""
    env = _env()
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", LOOPBACK_RAY], env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "['127.0.0.1']"


@pytest.mark.timeout(120)
def test_no_connect_beyond_loopback(ray1, netlog):
    """Every Python process of the module's runs -- this driver, the subprocess drivers, and Ray's
    dashboard, agents and workers -- ran the guard (positive control: a worker's connect to
    10.255.255.1 is refused and recorded), and nothing else tried to leave loopback. Without the
    local-Ray settings of pipelines.ray_runtime the dashboard's probes of 169.254.169.254 and
    metadata.google.internal are recorded here."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    # the dashboard's usage-stats module probes at start-up, then logs this line: wait for it
    dash_log = session / "logs" / "dashboard.log"
    deadline = time.monotonic() + 60
    while "Usage reporting is" not in (dash_log.read_text() if dash_log.is_file() else ""):
        assert time.monotonic() < deadline, "the dashboard's usage-stats module never ran"
        time.sleep(0.5)

    @ray.remote(num_cpus=0.01)
    def try_to_leave():
        import socket

        with socket.socket() as s:
            s.settimeout(2)
            try:
                s.connect(("10.255.255.1", 9))
            except OSError as exc:
                return os.getpid(), str(exc)
        return os.getpid(), "connected"

    pid, outcome = ray.get(try_to_leave.remote(), timeout=60)
    assert "netguard" in outcome
    records = [json.loads(line) for line in netlog.read_text().splitlines()]
    loaded = {r["pid"]: " ".join(r["argv"]) for r in records if r["what"] == "loaded"}
    assert any("dashboard/dashboard.py" in a for a in loaded.values()), loaded
    assert any("default_worker.py" in a for a in loaded.values()) and pid in loaded
    assert os.getpid() in {r["pid"] for r in records}
    attempts = [r for r in records if r["what"] != "loaded"]
    control = [r for r in attempts if r["pid"] == pid and "10.255.255.1" in r["where"]]
    assert len(control) == 1
    others = [r for r in attempts if r not in control]
    assert not others, json.dumps(others, indent=1)[:4000]
    assert (session / "adbatch_driver.json").is_file()  # init_ray marked its session for pruning
