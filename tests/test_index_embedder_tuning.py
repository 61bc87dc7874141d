"""Ids from a query-aligned embedding (issue 55 item 2): the index stage tunes its encoder on labelled queries,
embeds and clusters the ads with it, keeps it as the index's own query embedder; an incremental build reuses it;
a corpus with its own vectors and a tuning that does not beat the base keep the base."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from adbatch.index.build import (INDEX_FILES, STAGING_DIR, TUNING_DIR, IndexConfig, build_index,
                                 finish_interrupted_write, load_index)
from adbatch.index.clustering import ClusterConfig
from adbatch.index.corpus import CorpusConfig
from adbatch.index.dense import INDEX_EMBEDDER, INDEX_EMBEDDER_DIR, DenseChannelError, DenseRetriever, embedder_identity
from adbatch.index.embedder_tuning import EmbedderTuneConfig, query_rows, recall_at_10
from adbatch.index.embeddings import EmbeddingConfig
from test_generate_support import tiny_corpus

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FAST = EmbedderTuneConfig(epochs=6, lr=2e-4, batch_size=16, min_queries=4)


def _config(tune: EmbedderTuneConfig = FAST, **cols) -> IndexConfig:
    return IndexConfig(columns=CorpusConfig(**cols), embedding=EmbeddingConfig(tune=tune),
                       cluster=ClusterConfig(branching=4, leaf_size=8))


def _pairs(ads_file):
    # code words the base encoder cannot know ("zq7 k2" -> ad 7): only a tuned encoder maps them to their ads
    ids = pq.read_table(ads_file).column("ad_id").to_pylist()
    return [(f"zq{i} k{i % 5}", a) for i, a in enumerate(ids)]


def _top1(dense: DenseRetriever, pairs) -> float:
    queries, rows = query_rows(dense.ad_ids, pairs)
    top = dense.search(dense.embed(queries), 1).rows[:, 0].tolist()
    return sum(t in r for t, r in zip(top, rows)) / len(queries)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("idxtune")
    ads = tiny_corpus(root / "ads.parquet", n=40)
    pairs = _pairs(ads)
    base = build_index(ads, root / "base", _config(), progress=False)  # no queries: the packaged MiniLM
    tuned = build_index(ads, root / "tuned", _config(), progress=False, queries=pairs)
    return {"root": root, "ads": ads, "pairs": pairs, "base": base, "tuned": tuned}


def test_without_queries_the_index_keeps_the_configured_encoder(built):
    m = built["base"]
    assert m["dense"]["query_embedder"]["name"] == "default" and m["embedder_tuning"] is None
    assert not (built["root"] / "base" / INDEX_EMBEDDER_DIR).exists()


def test_tuned_encoder_embeds_clusters_and_answers_the_queries(built):
    root, pairs, m = built["root"], built["pairs"], built["tuned"]
    rec = m["embedder_tuning"]
    assert rec["kept"] and rec["queries"] == 40 and rec["steps"] == 18
    assert rec["loss_curve"][-1] < rec["loss_curve"][0]
    assert m["dense"]["query_embedder"] == embedder_identity(INDEX_EMBEDDER, root / "tuned")
    assert (root / "tuned" / INDEX_EMBEDDER_DIR / "modules.json").is_file()
    assert not (root / "tuned" / TUNING_DIR).exists() and not (root / "tuned" / STAGING_DIR).exists()
    base, tuned = DenseRetriever(load_index(root / "base"), "cpu"), DenseRetriever(load_index(root / "tuned"), "cpu")
    # both towers moved: the stored ad vectors are the tuned encoder's, not MiniLM's
    assert not np.allclose(base.matrix.numpy(), tuned.matrix.numpy(), atol=1e-3)
    assert tuned.embedder_path == root / "tuned" / INDEX_EMBEDDER_DIR
    assert _top1(tuned, pairs) > _top1(base, pairs) + 0.3


def test_a_moved_index_still_finds_its_encoder(built, tmp_path):
    import shutil

    shutil.copytree(built["root"] / "tuned", tmp_path / "moved")
    dense = DenseRetriever(load_index(tmp_path / "moved"), "cpu")
    assert dense.embedder_path == tmp_path / "moved" / INDEX_EMBEDDER_DIR
    assert dense.embed(["zq3 k3"]).shape == (1, 384)


def test_a_modified_index_encoder_is_refused(built, tmp_path):
    import shutil

    shutil.copytree(built["root"] / "tuned", tmp_path / "t")
    with open(tmp_path / "t" / INDEX_EMBEDDER_DIR / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(DenseChannelError, match="hashes to"):
        DenseRetriever(load_index(tmp_path / "t"), "cpu")


def test_incremental_build_reuses_the_encoder_and_keeps_the_ids(built, tmp_path):
    import shutil

    out = tmp_path / "night2"
    shutil.copytree(built["root"] / "tuned", out)
    before = load_index(out)
    m = build_index(built["ads"], out, _config(), progress=False, previous=out, queries=built["pairs"][:10])
    after = load_index(out)
    assert m["embedder_tuning"] == {"reused_from_index": before.index_hash}  # not re-tuned on other queries
    assert m["dense"]["query_embedder"]["sha256"] == before.manifest["dense"]["query_embedder"]["sha256"]
    assert after.ad_codes.column("code").to_pylist() == before.ad_codes.column("code").to_pylist()
    assert after.manifest["outputs"]["embeddings.safetensors"] == before.manifest["outputs"]["embeddings.safetensors"]


def test_corpus_vectors_are_not_tuned(built, tmp_path):
    m = build_index(built["ads"], tmp_path / "own", _config(embedding="vec"), progress=False, queries=built["pairs"])
    assert m["embedder_tuning"] is None and m["dense"]["query_embedder"] is None
    assert not (tmp_path / "own" / INDEX_EMBEDDER_DIR).exists()


def test_a_tuning_that_does_not_beat_the_base_on_validation_is_dropped(built, tmp_path):
    m = build_index(built["ads"], tmp_path / "gate", _config(FAST.replace(lr=1e-12, epochs=0.1)), progress=False,
                    queries=built["pairs"], valid_queries=built["pairs"])
    rec = m["embedder_tuning"]
    assert not rec["kept"] and rec["valid_recall@10"]["tuned"] <= rec["valid_recall@10"]["base"]
    assert m["dense"]["query_embedder"]["name"] == "default"
    assert not (tmp_path / "gate" / INDEX_EMBEDDER_DIR).exists() and not (tmp_path / "gate" / TUNING_DIR).exists()


def test_too_few_queries_or_tuning_off_tune_nothing(built, tmp_path):
    m = build_index(built["ads"], tmp_path / "few", _config(), progress=False, queries=built["pairs"][:3])
    assert m["embedder_tuning"] is None and m["dense"]["query_embedder"]["name"] == "default"
    m = build_index(built["ads"], tmp_path / "off", _config(FAST.replace(enabled=False)), progress=False,
                    queries=built["pairs"])
    assert m["embedder_tuning"] is None


def test_roll_forward_moves_the_encoder_and_a_plain_index_drops_a_stale_one(built, tmp_path):
    import shutil

    out = tmp_path / "crash"
    shutil.copytree(built["root"] / "base", out)
    # a tuned build that stopped after staging every file (manifest included), before moving them
    staging = out / STAGING_DIR
    staging.mkdir()
    for name in [*INDEX_FILES, "manifest.json"]:
        shutil.copy(built["root"] / "tuned" / name, staging / name)
    shutil.copytree(built["root"] / "tuned" / INDEX_EMBEDDER_DIR, staging / INDEX_EMBEDDER_DIR)
    finish_interrupted_write(out)
    assert (out / INDEX_EMBEDDER_DIR / "modules.json").is_file()
    assert DenseRetriever(load_index(out), "cpu").identity["name"] == INDEX_EMBEDDER
    # a crash after the folder moved but before the manifest did: the roll-forward keeps the folder
    staging.mkdir()
    shutil.copy(out / "manifest.json", staging / "manifest.json")
    finish_interrupted_write(out)
    assert (out / INDEX_EMBEDDER_DIR).is_dir()
    # then a plain (untuned) index replaces it: its stale encoder folder goes
    staging.mkdir()
    for name in [*INDEX_FILES, "manifest.json"]:
        shutil.copy(built["root"] / "base" / name, staging / name)
    finish_interrupted_write(out)
    assert not (out / INDEX_EMBEDDER_DIR).exists() and os.listdir(out)
    assert DenseRetriever(load_index(out), "cpu").identity["name"] == "default"


def test_recall_at_10_and_query_rows():
    q, rows = query_rows(["a", "b", "c"], [("x", "b"), ("x", "a"), ("y", "c"), ("", "a"), ("z", "zz")])
    assert q == ["x", "y"] and rows == [[0, 1], [2]]
    ads = np.eye(3, dtype=np.float32)
    assert recall_at_10(ads[[0, 2]], ads, [[0, 1], [2]]) == pytest.approx(1.0)


def test_config_validation():
    from adbatch.config import ConfigError

    for bad in ({"epochs": 0}, {"lr": float("nan")}, {"batch_size": 1}, {"min_queries": 0}):
        with pytest.raises(ConfigError):
            EmbedderTuneConfig(**bad)
