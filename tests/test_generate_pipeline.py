"""The generate stage without Ray (executor=local): outputs, rejected rows, resume after a crash,
errors before model load, and batch-size adaptation on out-of-memory. Tiny random Llama + tiny
index built by the index stage."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import pipelines.generate as pg
from adbatch.decoding import TargetSearchConfig
from adbatch.serving.generators import GenerateConfig, ModelSpec, TargetGenerator
from adbatch.index.build import load_index
from adbatch.serving.requests import RequestSchemaError
from test_generate_support import creative_requests, target_requests, tiny_index_dir, tiny_model_dir

SEARCH = {"num_beams": 3, "top_k": 3, "verify": "off", "fusion": "generative"}  # the tiny index has no query embedder


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_assets")
    return {"model": tiny_model_dir(root), "index": tiny_index_dir(root)}


def _cfg(assets, requests, out, **kw):
    base = dict(task="targets", requests=requests, index=assets["index"], model=str(assets["model"]),
                out=out, executor="local", batch_size=4, partition_size=5, targets=SEARCH,
                device="cpu", progress=False)
    base.update(kw)
    return pg.GenerateJobConfig(**base)


def _read_out(out, task="targets"):
    return pq.read_table(out / task)


def test_targets_end_to_end_with_rejected_rows(assets, tmp_path):
    req = tmp_path / "req.parquet"
    ids = [f"q{i:02d}" for i in range(12)] + ["bad1", "bad2", "q03"]
    queries = [f"drill saw {i}" for i in range(12)] + ["", None, "conflict"]
    pq.write_table(pa.table({"request_id": ids, "query": queries}), req)
    res = pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    out = _read_out(tmp_path / "out")
    counts = res["counts"]
    # q03 has two conflicting copies: both rejected; 11 good ids answered
    assert counts == {**counts, "rows_in": 15, "accepted": 11, "rejected_validation": 4,
                      "answered": 11, "partitions": 3, "partitions_run": 3, "output_rows": 33}
    got = out.column("request_id").to_pylist()
    assert sorted(set(got)) == sorted(i for i in ids[:12] if i != "q03")
    # exactly top_k ranked rows per request, ranks 1..k, scores non-increasing, ads from the index
    index_ads = set(str(a) for a in load_index(assets["index"]).ad_ids)
    for rid in set(got):
        rows = out.filter(pa.compute.equal(out.column("request_id"), rid)).to_pylist()
        assert [r["rank"] for r in rows] == [1, 2, 3]
        assert all(rows[j]["score"] >= rows[j + 1]["score"] - 1e-5 for j in range(2))
        assert {r["ad_id"] for r in rows} <= index_ads and len({r["ad_id"] for r in rows}) == 3
        assert all(len(r["code"]) >= 1 for r in rows)
    rej = pq.read_table(tmp_path / "out" / "rejected.parquet").to_pylist()
    assert sorted(r["request_id"] or "<null>" for r in rej) == ["bad1", "bad2", "q03", "q03"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["stage"] == "generate"
    assert manifest["inputs"]["index"] == load_index(assets["index"]).index_hash
    assert manifest["model"]["kind"] == "dense" and len(manifest["model"]["sha256"]) == 64
    assert manifest["throughput"]["requests_per_s"] > 0
    assert set(manifest["outputs"]) == {f"targets/part-{i:05d}.parquet" for i in range(3)} | {"rejected.parquet"}


def test_resume_after_crash_redoes_only_missing_partitions(assets, tmp_path, monkeypatch):
    req = target_requests(tmp_path / "req.parquet", n=14)
    clean = pg.run_generate(_cfg(assets, req, tmp_path / "clean"))
    assert clean["counts"]["partitions"] == 3

    real_commit = pg._commit_partition
    calls = {"n": 0}

    def crashing_commit(*args, **kwargs):
        if calls["n"] == 2:
            raise RuntimeError("simulated crash after two partitions")
        calls["n"] += 1
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(pg, "_commit_partition", crashing_commit)
    with pytest.raises(RuntimeError, match="simulated crash"):
        pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "out" / "targets").glob("*.parquet")) == [
        "part-00000.parquet", "part-00001.parquet"]
    # a torn write left behind must not count as done
    (tmp_path / "out" / "targets" / ".part-00002.parquet.x.tmp").write_bytes(b"torn")

    monkeypatch.setattr(pg, "_commit_partition", real_commit)
    redone = []
    orig_iter = pg._iter_local

    def spy(config, layout, pending):
        redone.extend(pending)
        return orig_iter(config, layout, pending)

    monkeypatch.setattr(pg, "_iter_local", spy)
    res = pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    assert redone == [2]
    assert res["counts"]["partitions_skipped"] == 2 and res["counts"]["partitions_run"] == 1
    out = _read_out(tmp_path / "out").sort_by([("request_id", "ascending"), ("rank", "ascending")])
    ref = _read_out(tmp_path / "clean").sort_by([("request_id", "ascending"), ("rank", "ascending")])
    assert out.num_rows == ref.num_rows == 14 * 3
    assert out.column("ad_id").to_pylist() == ref.column("ad_id").to_pylist()
    assert len(set(zip(out.column("request_id").to_pylist(), out.column("rank").to_pylist()))) == out.num_rows

    # a third run finds everything complete and runs nothing
    res3 = pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    assert res3["counts"]["partitions_run"] == 0 and res3["counts"]["answered"] == 14


def test_tampered_partition_is_redone(assets, tmp_path):
    req = target_requests(tmp_path / "req.parquet", n=8)
    pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    pq.write_table(pa.table({"x": [1]}), tmp_path / "out" / "targets" / "part-00001.parquet")
    res = pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    assert res["counts"]["partitions_run"] == 1 and res["counts"]["output_rows"] == 8 * 3


def test_other_run_in_out_dir_needs_overwrite(assets, tmp_path):
    req = target_requests(tmp_path / "req.parquet", n=4)
    pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    req2 = target_requests(tmp_path / "req2.parquet", n=5, start=100)
    with pytest.raises(pg.ConfigError, match="requests_sha256"):
        pg.run_generate(_cfg(assets, req2, tmp_path / "out"))
    res = pg.run_generate(_cfg(assets, req2, tmp_path / "out", overwrite=True))
    assert sorted(set(_read_out(tmp_path / "out").column("request_id").to_pylist())) == [
        f"q{i:04d}" for i in range(100, 105)]
    assert res["counts"]["answered"] == 5


@pytest.mark.parametrize("damage", ["missing_column", "corrupt"])
def test_bad_request_file_fails_before_model_load(assets, tmp_path, monkeypatch, damage):
    req = tmp_path / "req.parquet"
    if damage == "missing_column":
        pq.write_table(pa.table({"request_id": ["a"], "qry": ["x"]}), req)
    else:
        good = target_requests(tmp_path / "good.parquet", n=3)
        req.write_bytes(good.read_bytes()[:-20])

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the requests were validated")

    monkeypatch.setattr("adbatch.serving.generators.load_model", no_load)
    with pytest.raises(RequestSchemaError, match="query" if damage == "missing_column" else "Parquet"):
        pg.run_generate(_cfg(assets, req, tmp_path / "out"))


def test_creatives_local(assets, tmp_path):
    req = creative_requests(tmp_path / "c.parquet", n=5)
    res = pg.run_generate(_cfg(assets, req, tmp_path / "out", task="creatives",
                               creatives={"strategy": "greedy", "max_new_tokens": 4}))
    out = _read_out(tmp_path / "out", "creatives")
    assert res["counts"]["answered"] == 5
    assert out.column_names == ["request_id", "ad_id", "variant", "headline", "score", "flags"]
    assert all(isinstance(f, list) for f in out.column("flags").to_pylist())  # every headline: its checks' outcome
    assert out.column("request_id").to_pylist() == [f"c{i}" for i in range(5)]
    assert out.column("ad_id").to_pylist() == [f"ad-{i}" for i in range(5)]
    assert set(out.column("variant").to_pylist()) == {0}
    assert all(s <= 0 for s in out.column("score").to_pylist())  # mean log-prob


def test_oom_halves_batch_size_and_answers_everything(assets, tmp_path, monkeypatch, caplog):
    gen = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"],
                          TargetSearchConfig(num_beams=2, top_k=2, verify="off", fusion="generative"),
                          GenerateConfig(batch_size=8, device="cpu"))
    import adbatch.decoding as dec

    real = dec.search_targets
    sizes = []

    def fake_oom(model, prompts, trie, config, cost_model=None):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, prompts, trie, config, cost_model=cost_model)

    monkeypatch.setattr(dec, "search_targets", fake_oom)
    batch = pa.table({"request_id": [f"r{i}" for i in range(8)], "query": [f"lamp bulb {i}" for i in range(8)]})
    with caplog.at_level(logging.WARNING, logger="adbatch.serving.generators"):
        answers = gen(batch)
    assert sizes == [8, 4, 2, 2, 2, 2]  # 8 fails, 4 fails, then batches of 2 succeed
    assert gen.batch_size == 2  # and stays lowered for later calls
    assert answers.column("request_id").to_pylist() == [f"r{i}" for i in range(8)]
    assert answers.column("error").null_count == 8
    assert all(len(a) == 2 for a in answers.column("ad_ids").to_pylist())
    assert "halving to 4" in caplog.text and "halving to 2" in caplog.text
    assert gen.stats()["oom_events"] == 2


def test_repeated_queries_are_decoded_once(assets, monkeypatch):
    """A query stream's head repeats: each distinct query is decoded once (in this batch or from the answers an
    earlier batch left), every request still gets its own row, and the answers are the ones decoding each gives."""
    search = TargetSearchConfig(num_beams=2, top_k=2, verify="off", fusion="generative")
    gen = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"], search,
                          GenerateConfig(batch_size=8, device="cpu", answer_cache=2))
    import adbatch.decoding as dec

    real = dec.search_targets
    sizes = []

    def counting(model, prompts, trie, config, cost_model=None):
        sizes.append(len(prompts))
        return real(model, prompts, trie, config, cost_model=cost_model)

    monkeypatch.setattr(dec, "search_targets", counting)
    queries = ["lamp", "bulb", "lamp", "lamp", "drill", "bulb"]
    first = gen(pa.table({"request_id": [f"a{i}" for i in range(6)], "query": queries}))
    assert sizes == [3]  # lamp, bulb, drill
    assert first.column("request_id").to_pylist() == [f"a{i}" for i in range(6)]
    ids = first.column("ad_ids").to_pylist()
    assert ids[0] == ids[2] == ids[3] and ids[1] == ids[5] and all(len(a) == 2 for a in ids)
    # the cache keeps the 2 most recent (bulb, drill: lamp is evicted); a later batch decodes lamp and saw only
    second = gen(pa.table({"request_id": ["b0", "b1", "b2"], "query": ["drill", "lamp", "saw"]}))
    assert sizes == [3, 2]
    assert second.column("ad_ids").to_pylist()[:2] == [ids[4], ids[0]]
    assert gen.stats()["decoded"] == 5 and gen.stats()["requests"] == 9
    # the same answers as decoding every request (cache off)
    plain = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"], search,
                            GenerateConfig(batch_size=8, device="cpu", answer_cache=0))
    again = plain(pa.table({"request_id": [f"a{i}" for i in range(6)], "query": queries}))
    assert sizes[-1] == 6 and again.column("ad_ids").to_pylist() == ids
    for a, b in zip(again.column("scores").to_pylist(), first.column("scores").to_pylist()):
        assert a == pytest.approx(b, rel=1e-4)


def test_batch_size_defaults_by_device(assets):
    from adbatch.serving.generators import DEFAULT_BATCH_SIZE, default_batch_size

    gen = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"],
                          TargetSearchConfig(num_beams=2, top_k=2, verify="off", fusion="generative"), GenerateConfig(device="cpu"))
    assert gen.batch_size == DEFAULT_BATCH_SIZE["cpu"] == default_batch_size(torch.device("cpu"))
    assert default_batch_size(torch.device("cuda", 1)) == default_batch_size("cuda") == DEFAULT_BATCH_SIZE["cuda"]
    assert DEFAULT_BATCH_SIZE["cuda"] > DEFAULT_BATCH_SIZE["cpu"]


def test_oom_at_batch_size_one_rejects_the_request(assets, monkeypatch):
    gen = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"],
                          TargetSearchConfig(num_beams=2, top_k=2, verify="off", fusion="generative"),
                          GenerateConfig(batch_size=2, device="cpu"))
    import adbatch.decoding as dec

    real = dec.search_targets

    def oom_on_huge(model, prompts, trie, config, cost_model=None):
        if len(prompts) > 1 or len(prompts[0]) > 60:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, prompts, trie, config, cost_model=cost_model)

    monkeypatch.setattr(dec, "search_targets", oom_on_huge)
    answers = gen(pa.table({"request_id": ["ok", "huge"], "query": ["lamp", "lamp " * 40]}))
    errors = dict(zip(answers.column("request_id").to_pylist(), answers.column("error").to_pylist()))
    assert errors["ok"] is None
    assert errors["huge"].startswith("out of memory at batch size 1")


def test_out_holding_another_artifact_is_refused(assets, tmp_path):
    import shutil

    req = target_requests(tmp_path / "req.parquet", n=3)
    out = tmp_path / "index_copy"  # e.g. --out given the index folder by mistake
    shutil.copytree(assets["index"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(pg.ConfigError, match="holds an adbatch index artifact"):
        pg.run_generate(_cfg(assets, req, out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing replaced
    # an existing empty folder is claimed as before
    (tmp_path / "empty").mkdir()
    assert pg.run_generate(_cfg(assets, req, tmp_path / "empty"))["counts"]["answered"] == 3


def test_overwrite_with_the_other_task_leaves_no_stale_outputs(assets, tmp_path):
    out = tmp_path / "out"
    pg.run_generate(_cfg(assets, target_requests(tmp_path / "t.parquet", n=3), out))
    pg.run_generate(_cfg(assets, creative_requests(tmp_path / "c.parquet", n=2), out, task="creatives",
                         overwrite=True, creatives={"strategy": "greedy", "max_new_tokens": 2}))
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["outputs"]) == ["creatives/part-00000.parquet", "rejected.parquet"]
    assert not (out / "targets").exists()  # the replaced run's answers are gone, not mixed in


def test_answers_re_emitted_after_a_partition_committed_do_not_replace_it(tmp_path):
    from adbatch.serving.generators import answer_schema
    from adbatch.serving.requests import GenerateTask

    layout = pg.Layout(tmp_path / "out", GenerateTask.TARGETS)
    for d in (layout.work_dir, layout.parts_dir, layout.progress_dir):
        d.mkdir(parents=True)
    pq.write_table(pa.table({"request_id": ["a", "b"], "query": ["x", "y"],
                             "partition": pa.array([0, 0], pa.int64())}), layout.work_file(0))
    answers = pa.Table.from_pylist(
        [{"request_id": r, "error": None, "ad_ids": ["ad-1"], "scores": [-1.0], "scores_generative": [-1.0],
          "scores_dense": [None], "channels": ["generative"], "codes": [[1]], "verify_mode": "off", "beams_verified": 0} for r in ("a", "b")],
        schema=answer_schema(GenerateTask.TARGETS))
    answers = answers.append_column("partition", pa.array([0, 0], pa.int64()))
    collector = pg._PartitionCollector(layout, GenerateTask.TARGETS, {0: 2})
    collector.add(answers)
    committed = layout.part_file(0).read_bytes()
    collector.add(answers.slice(1, 1))  # a retried task re-emits an answer after the commit
    assert layout.part_file(0).read_bytes() == committed
    assert collector.records[0]["answered"] == 2 and collector.duplicates == 1
    assert collector.seen == {} and collector.pending == {}  # a committed partition's ids are not held on
    assert pq.read_table(layout.part_file(0)).num_rows == 2


def test_all_requests_rejected_still_writes_the_output_schema(assets, tmp_path):
    """Downstream readers of <out>/targets get the contract's columns even when nothing was answerable."""
    from adbatch.serving.requests import TARGETS_OUT_SCHEMA

    req = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"request_id": ["a", "b"], "query": ["", None]}), req)
    summary = pg.run_generate(_cfg(assets, req, tmp_path / "out"))
    assert summary["counts"]["accepted"] == 0 and summary["counts"]["rejected"] == 2
    table = pq.read_table(tmp_path / "out" / "targets")
    assert table.num_rows == 0 and table.schema.names == TARGETS_OUT_SCHEMA.names
    assert pg.run_generate(_cfg(assets, req, tmp_path / "out"))["counts"]["rejected"] == 2  # re-run: same



def test_out_inside_requests_folder_is_refused(assets, tmp_path):
    """The requests folder is read recursively, so answers written inside it would be read as requests
    on the rerun: refused when the config is built, before anything runs."""
    req_dir = tmp_path / "requests"
    req_dir.mkdir()
    target_requests(req_dir / "part-0.parquet", n=3)
    for out in (req_dir / "answers", req_dir):
        with pytest.raises(pg.ConfigError, match="inside the requests folder"):
            _cfg(assets, req_dir, out)
    _cfg(assets, req_dir, tmp_path / "answers")  # a sibling folder is fine


def test_model_trained_on_another_index_is_refused_before_any_work(assets, tmp_path):
    """The model/index binding is checked on the driver from the index manifest, so a Ray run fails
    before actors load the model, and the output folder is left untouched."""
    import json
    import shutil

    from adbatch.serving.prompts import TARGETING_PROMPT_VERSION
    from adbatch.training import IndexMismatchError

    model = tmp_path / "model_other_index"
    shutil.copytree(assets["model"], model)
    (model / "adbatch_training.json").write_text(json.dumps(
        {"trained_on_index": "ff" * 32, "targeting_prompt_version": TARGETING_PROMPT_VERSION}))
    req = target_requests(tmp_path / "req.parquet", n=3)
    out = tmp_path / "out"
    with pytest.raises(IndexMismatchError, match="was trained on index ffffffffffff"):
        pg.run_generate(_cfg(assets, req, out, model=str(model), executor="ray"))
    assert not out.exists()


def test_a_new_prompt_rendering_is_a_new_run_not_a_resume(monkeypatch):
    """The run key (resume identity) covers the prompt's rendering version of each task."""
    import adbatch.serving.prompts
    from adbatch.decoding import CreativeConfig
    from adbatch.serving.generators import generator_fingerprint
    from adbatch.serving.requests import GenerateTask

    gc = GenerateConfig(device="cpu")
    before = {t: generator_fingerprint(t, cfg, gc) for t, cfg in
              ((GenerateTask.TARGETS, TargetSearchConfig()), (GenerateTask.CREATIVES, CreativeConfig()))}
    monkeypatch.setattr(adbatch.serving.prompts, "CREATIVE_PROMPT_VERSION", adbatch.serving.prompts.CREATIVE_PROMPT_VERSION + 1)
    assert generator_fingerprint(GenerateTask.CREATIVES, CreativeConfig(), gc) != before[GenerateTask.CREATIVES]
    assert generator_fingerprint(GenerateTask.TARGETS, TargetSearchConfig(), gc) == before[GenerateTask.TARGETS]
    monkeypatch.setattr(adbatch.serving.prompts, "TARGETING_PROMPT_VERSION", adbatch.serving.prompts.TARGETING_PROMPT_VERSION + 1)
    assert generator_fingerprint(GenerateTask.TARGETS, TargetSearchConfig(), gc) != before[GenerateTask.TARGETS]


def test_the_drivers_checks_import_neither_torch_nor_transformers(assets, tmp_path):
    """A Ray run's driver parses its flags, validates requests and checks the model against the index, then
    hands the work to its actors: it never decodes. Building every stage's flags (their modules), importing
    torch + triton (the decoding package) and loading the tokenizer through transformers made that cost the
    H200 run's driver seconds before Ray started.
    The tokenizer.json fingerprint it uses instead equals the one transformers' tokenizer gives."""
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from adbatch.models import tokenizer_file_fingerprint, tokenizer_fingerprint

    tok = AutoTokenizer.from_pretrained(str(assets["model"]), local_files_only=True)
    assert tokenizer_file_fingerprint(assets["model"]) == tokenizer_fingerprint(tok)
    assert tokenizer_file_fingerprint(assets["model"], below=100) == tokenizer_fingerprint(tok, below=100)
    assert tokenizer_file_fingerprint(tmp_path) is None  # no tokenizer.json: the caller loads the tokenizer

    req = target_requests(tmp_path / "req.parquet", n=3)
    script = f"""
import sys
import jobs.cli, pipelines.generate
jobs.cli.build_parser(only="generate").parse_args(["generate", "--task", "targets", "--requests", "r", "--out", "o"])
from adbatch.artifacts import read_manifest
from adbatch.serving.generators import ModelSpec, check_model_index
from adbatch.serving.requests import GenerateTask, RequestValidationConfig, validate_requests
v = validate_requests({str(req)!r}, GenerateTask.TARGETS, RequestValidationConfig())
spec = ModelSpec(model={str(assets["model"])!r})
spec.identity()
spec.check()
from adbatch.artifacts import verify_outputs
verify_outputs({str(assets["index"])!r}, read_manifest({str(assets["index"])!r}))
check_model_index(spec, {str(assets["index"])!r}, read_manifest({str(assets["index"])!r}))
assert v.accepted.num_rows == 3
print(sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules))
"""
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_answer_cache_must_not_be_negative():
    with pytest.raises(pg.ConfigError, match="answer_cache must be >= 0"):
        pg.GenerateJobConfig(answer_cache=-1)
    with pytest.raises(pg.ConfigError, match="answer_cache must be >= 0"):
        GenerateConfig(answer_cache=-1)
    assert pg.GenerateJobConfig(answer_cache=0).generate_config().answer_cache == 0
