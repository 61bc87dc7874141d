"""The train stage's tuned query embedder (issue 41): tuning on labelled queries against the index's fixed ad
vectors, the validation gate, the record and folder it leaves in the model folder, generate answering with it,
its identity checks, and its copy in a compressed checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pipelines.generate as pg
from adbatch.index.build import IndexConfig, build_index, load_index
from adbatch.index.clustering import ClusterConfig
from adbatch.index.dense import (DenseChannelError, DenseRetriever, embedder_identity, refuse_custom_modules,
                                 tuned_query_embedder)
from adbatch.training.query_tuning import (QUERY_EMBEDDER_DIR, QueryTuneConfig, query_targets, tune_query_embedder,
                                           tuning_pairs)
from test_generate_support import target_requests, tiny_corpus, tiny_model_dir

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FAST = QueryTuneConfig(epochs=4, lr=2e-4, batch_size=16, min_queries=4)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny model and a 40-ad index the packaged MiniLM embedded (a dense channel)."""
    root = tmp_path_factory.mktemp("qtune")
    ads = tiny_corpus(root / "ads.parquet", n=40)
    build_index(ads, root / "index", IndexConfig(cluster=ClusterConfig(branching=4, leaf_size=8)), progress=False)
    return {"model": tiny_model_dir(root), "index": root / "index", "root": root}


def _pairs(index):
    # codes the base embedder cannot know ("zq7 k3" -> ad 7): only tuning maps them to their ads
    return [(f"zq{i} k{i % 5}", a) for i, a in enumerate(index.ad_ids)]


def _top1(dense, pairs):
    queries, rows = query_targets(dense.ad_ids, pairs)
    top = dense.search(dense.embed(queries), 1).rows[:, 0].tolist()
    return sum(t in r for t, r in zip(top, rows)) / len(queries)


def test_query_targets_group_rows_per_query_and_drop_unknown_ads():
    queries, rows = query_targets(["a", "b", "c"], [("x", "b"), ("x", "a"), ("y", "c"), ("y", "zz"), ("z", "zz")])
    assert queries == ["x", "y"] and rows == [[0, 1], [2]]


def test_tuning_pairs_fall_back_to_spans_without_labels():
    ids, texts = ["a", "b", "c"], ["red cordless drill kit", "white ceiling lamp", "garden hose 50 ft"]
    labelled, valid = [("drill", "a"), ("lamp", "b")], [("hose", "c")]
    cfg = QueryTuneConfig(min_queries=2, spans_per_ad=2)
    assert tuning_pairs(ids, texts, labelled, valid, cfg) == (labelled, valid, "labelled")
    pairs, held, source = tuning_pairs(ids, texts, labelled[:1], valid, cfg)
    assert source == "spans" and held == valid and len(pairs) == 6
    assert all(set(q.split()) <= set(texts[ids.index(a)].split()) for q, a in pairs)
    # no validation queries: one held-out span per ad, of another seed
    _, held, _ = tuning_pairs(ids, texts, [], [], cfg)
    assert len(held) == 3 and {a for _, a in held} == set(ids)
    assert tuning_pairs(ids, texts, [], [], cfg.replace(no_labels="skip")) == ([], [], "none")


def test_tuning_learns_the_labelled_queries_and_saves_a_loadable_folder(assets, tmp_path):
    index = load_index(assets["index"])
    base = DenseRetriever(index, "cpu")
    pairs = _pairs(index)
    rec = tune_query_embedder(base, pairs, FAST, tmp_path / "qe")
    assert rec is not None and rec["queries"] == 40 and rec["steps"] == 12 and rec["dir"] == QUERY_EMBEDDER_DIR
    assert rec["base"] == base.identity and rec["sha256"] == embedder_identity(str(tmp_path / "qe"))["sha256"]
    assert rec["loss_curve"][-1] < rec["loss_curve"][0]
    tuned = DenseRetriever(index, "cpu", query_embedder=embedder_identity(str(tmp_path / "qe")))
    # the ad vectors are the index's: only the query side moved
    assert torch.equal(tuned.matrix, base.matrix)
    assert _top1(tuned, pairs) > _top1(base, pairs) + 0.2


def test_a_tuned_embedder_that_does_not_beat_the_base_on_validation_is_not_kept(assets, tmp_path):
    index = load_index(assets["index"])
    pairs = _pairs(index)
    rec = tune_query_embedder(DenseRetriever(index, "cpu"), pairs, FAST.replace(lr=1e-12), tmp_path / "qe",
                              valid=pairs)
    assert rec is None and not (tmp_path / "qe").exists()


def test_too_few_queries_tune_nothing(assets, tmp_path):
    index = load_index(assets["index"])
    assert tune_query_embedder(DenseRetriever(index, "cpu"), _pairs(index)[:3], FAST, tmp_path / "qe") is None


def test_train_stage_saves_the_tuned_embedder_and_generate_answers_with_it(assets, tmp_path):
    import pyarrow.parquet as pq

    from adbatch.models import load_causal_lm
    from adbatch.training import TrainConfig, train_on_index
    from adbatch.training.checkpoint import read_training_record

    index = load_index(assets["index"])
    cfg = TrainConfig(max_steps=1, batch_tokens=512, compile=False, fusion_queries=0, query_tuning=FAST,
                      qat=TrainConfig().qat.replace(enabled=False))
    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    train_on_index(index, tmp_path / "m", cfg, model=model, tokenizer=tok, device="cpu", progress=False,
                   labelled=_pairs(index))
    rec = read_training_record(tmp_path / "m")
    entry = rec["query_embedder"]
    assert (tmp_path / "m" / QUERY_EMBEDDER_DIR / "modules.json").is_file()
    assert not (tmp_path / f".m.{QUERY_EMBEDDER_DIR}").exists()  # the staging copy moved in
    tuned = tuned_query_embedder(tmp_path / "m", rec, index.directory, index.manifest)
    assert tuned["sha256"] == entry["sha256"]
    req = target_requests(tmp_path / "req.parquet", n=3)
    job = pg.GenerateJobConfig(task="targets", requests=req, index=assets["index"], model=str(tmp_path / "m"),
                               out=tmp_path / "out", executor="local", device="cpu", progress=False,
                               targets={"fusion": "dense", "top_k": 4})
    pg.run_generate(job)
    out = pq.read_table(tmp_path / "out" / "targets").to_pylist()
    dense = DenseRetriever(index, "cpu", query_embedder=tuned)
    query = pq.read_table(req).to_pylist()[0]
    rows = [r for r in out if r["request_id"] == query["request_id"]]
    want = dense.search(dense.embed([query["query"]]), 4)
    assert [r["ad_id"] for r in rows] == [str(index.ad_ids[i]) for i in want.rows[0].tolist()]
    assert [r["score_dense"] for r in rows] == pytest.approx(want.scores[0].tolist(), abs=1e-5)
    # compressed: the checkpoint carries the tuned embedder, and generate answers with it the same way
    from adbatch.compress import CalibrationConfig
    from pipelines.compress import CompressJobConfig, run_compress

    run_compress(CompressJobConfig(model=str(tmp_path / "m"), out=tmp_path / "c", use_ray=False, eval_texts=2,
                                   eval_seq_len=16, calibration=CalibrationConfig(num_texts=4, seq_len=16, batch_size=4)))
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["query_embedder"]["sha256"] == entry["sha256"]
    assert f"{QUERY_EMBEDDER_DIR}/modules.json" in manifest["outputs"]
    pg.run_generate(job.replace(model=None, compressed=str(tmp_path / "c"), out=tmp_path / "outc"))
    outc = pq.read_table(tmp_path / "outc" / "targets").to_pylist()
    assert [r["ad_id"] for r in outc if r["request_id"] == query["request_id"]] == [r["ad_id"] for r in rows]
    # a modified tuned embedder is refused before any actor starts
    cfg_path = tmp_path / "m" / QUERY_EMBEDDER_DIR / "config_sentence_transformers.json"
    cfg_path.write_text(cfg_path.read_text() + " ")
    with pytest.raises(DenseChannelError, match="was modified"):
        pg.run_generate(job.replace(out=tmp_path / "out2"))


def test_a_tuned_embedder_of_another_base_is_refused(assets, tmp_path):
    index = load_index(assets["index"])
    rec = {"query_embedder": {"dir": QUERY_EMBEDDER_DIR, "sha256": "1" * 64,
                              "base": {"name": "other", "sha256": "0" * 64}}}
    with pytest.raises(DenseChannelError, match="tuned its query embedder from 'other'"):
        tuned_query_embedder(tmp_path, rec, index.directory, index.manifest)
    assert tuned_query_embedder(tmp_path, {"query_embedder": None}, index.directory, index.manifest) is None


def test_modules_outside_sentence_transformers_are_refused(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "evil.Module"}]))
    with pytest.raises(DenseChannelError, match="evil.Module"):
        refuse_custom_modules(tmp_path)


def test_compressed_checkpoint_carries_the_tuned_embedder(default_tokenizer, tmp_path):
    from adbatch.compress import CheckpointError, CompressConfig, compress_, save_compressed
    from adbatch.compress.checkpoint import verify_checkpoint
    from conftest import make_tiny_llama

    src = tmp_path / "qe"
    (src / "1_Pooling").mkdir(parents=True)
    (src / "modules.json").write_text("[]")
    (src / "1_Pooling" / "config.json").write_text("{}")
    model = make_tiny_llama(seed=5)
    recipe = compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform"))
    save_compressed(model, default_tokenizer, recipe, tmp_path / "ckpt", folders={QUERY_EMBEDDER_DIR: src})
    manifest = verify_checkpoint(tmp_path / "ckpt")
    assert {f"{QUERY_EMBEDDER_DIR}/modules.json", f"{QUERY_EMBEDDER_DIR}/1_Pooling/config.json"} <= set(manifest["outputs"])
    assert embedder_identity(str(tmp_path / "ckpt" / QUERY_EMBEDDER_DIR)) == embedder_identity(str(src)) | {
        "name": str(tmp_path / "ckpt" / QUERY_EMBEDDER_DIR)}
    (tmp_path / "ckpt" / QUERY_EMBEDDER_DIR / "modules.json").write_text("[ ]")
    with pytest.raises(CheckpointError, match="modules.json"):
        verify_checkpoint(tmp_path / "ckpt")
    shutil.rmtree(src)
