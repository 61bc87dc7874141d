"""The index stage end to end: artifact contract, rejected rows, determinism, Ray == sequential,
the CLI, and one run on a real Home Depot slice with MiniLM embeddings."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from adbatch.index.clustering import ClusterConfig, build_hierarchy
from adbatch.index.corpus import CorpusConfig
from adbatch.index.build import IndexConfig, build_index, load_index
from adbatch.index.ids import IdScheme, RenderConfig

WORDS = ["drill", "saw", "paint", "primer", "faucet", "sink", "lamp", "bulb", "rug", "tile",
         "hammer", "glue", "hose", "mower", "fence", "door"]


def synthetic_corpus(path, n: int = 1200, d: int = 16, seed: int = 0, bad_rows: bool = False):
    """A corpus with its own embeddings: topic blobs, titles drawn from each topic's words."""
    rng = np.random.default_rng(seed)
    topics = rng.integers(0, 8, n)
    mu = rng.normal(size=(8, d)).astype(np.float32) * 3
    emb = (mu[topics] + 0.5 * rng.normal(size=(n, d))).astype(np.float32)
    titles = [f"{WORDS[2 * t]} {WORDS[2 * t + 1]} {rng.choice(WORDS)} item {i}"
              for i, t in enumerate(topics)]
    ids = [f"ad-{i:05d}" for i in range(n)]
    emb_rows: list = [list(map(float, e)) for e in emb]
    if bad_rows:
        titles[3] = ""                     # empty text
        ids[5] = ids[4]                    # duplicate id
        emb_rows[7] = emb_rows[7][:-1]     # short vector
        emb_rows[9][0] = float("nan")      # NaN
    table = pa.table({"ad_id": ids, "title": titles,
                      "vec": pa.array(emb_rows, pa.list_(pa.float32()))})
    pq.write_table(table, path)
    return path


def cfg_for(scheme: IdScheme = IdScheme.TEXT, **cluster) -> IndexConfig:
    return IndexConfig(columns=CorpusConfig(embedding="vec"),
                       cluster=ClusterConfig(**({"leaf_size": 50} | cluster)),
                       render=RenderConfig(scheme=scheme))


def assert_index_contract(ix, n_ads: int):
    t = ix.ad_codes
    assert t.column_names == ["ad_id", "code", "token_ids", "text"]
    assert t.schema.field("code").type == pa.list_(pa.int32())
    assert t.schema.field("token_ids").type == pa.list_(pa.int32())
    assert t.num_rows == n_ads == len(ix.ad_ids) == ix.trie.num_rows
    codes = [tuple(c) for c in t.column("code").to_pylist()]
    assert len(set(codes)) == n_ads
    seqs = ix.sequences()
    width = max(map(len, seqs))
    padded = torch.full((n_ads, width), -1, dtype=torch.int64)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = torch.tensor(s)
    ends = ix.trie.walk(padded)
    assert (ends > 0).all()
    for row, node in enumerate(ends.tolist()):
        rows = ix.trie.rows_at(node).tolist()
        assert row in rows and all(seqs[r] == seqs[row] for r in rows)
    m = ix.manifest
    for key in ("scheme", "tokenizer", "base_vocab_size", "special_tokens", "index_hash",
                "inputs", "config", "counts", "timings_s", "code_version"):
        assert key in m, key
    assert len(ix.index_hash) == 64


@pytest.mark.parametrize("scheme", [IdScheme.TEXT, IdScheme.CODES])
def test_build_index_contract(tmp_path, scheme, default_tokenizer):
    ads = synthetic_corpus(tmp_path / "ads.parquet")
    manifest = build_index(ads, tmp_path / "idx", cfg_for(scheme), progress=False)
    ix = load_index(tmp_path / "idx")
    assert_index_contract(ix, 1200)
    assert ix.scheme is scheme and manifest["scheme"] == scheme.value
    assert ix.base_vocab_size == len(default_tokenizer)
    assert ix.ad_ids[:2] == ["ad-00000", "ad-00001"]
    if scheme is IdScheme.CODES:
        flat = [t for s in ix.sequences() for t in s]
        assert min(flat) >= ix.base_vocab_size
        assert max(flat) < ix.base_vocab_size + len(ix.special_tokens)
        assert ix.eos_token_id is None
        assert ix.trie.nbytes() / ix.num_ads <= 64
    else:
        eos = default_tokenizer.eos_token_id
        assert ix.eos_token_id == eos and all(s[-1] == eos for s in ix.sequences())
        # the rendered text contains the ad's own title after its cluster labels
        row = ix.ad_codes.slice(0, 1).to_pylist()[0]
        assert row["text"].endswith("item 0" + default_tokenizer.eos_token)
        assert ix.trie.nbytes() / ix.num_ads <= 1024
        clusters = pq.read_table(tmp_path / "idx" / "clusters.parquet")
        assert clusters.num_rows == manifest["counts"]["clusters"] > 8
    assert pq.read_table(tmp_path / "idx" / "rejected.parquet").num_rows == 0


def test_rejected_rows_are_written_and_counted(tmp_path):
    ads = synthetic_corpus(tmp_path / "ads.parquet", n=300, bad_rows=True)
    manifest = build_index(ads, tmp_path / "idx", cfg_for(), progress=False)
    rej = pq.read_table(tmp_path / "idx" / "rejected.parquet").to_pylist()
    got = sorted((r["source_row"], r["reason"]) for r in rej)
    assert got == [(3, "empty_text"), (5, "duplicate_ad_id"), (7, "bad_embedding_length"),
                   (9, "non_finite_embedding")]
    c = manifest["counts"]
    assert c["rejected"] == 4 and c["ads_indexed"] == 296 and c["input_rows"] == 300
    assert c["rejected_duplicate_ad_id"] == 1
    ix = load_index(tmp_path / "idx")
    assert "ad-00003" not in ix.ad_ids and ix.ad_ids.count("ad-00004") == 1
    assert_index_contract(ix, 296)


def test_deterministic_rebuild_and_tamper_detection(tmp_path):
    ads = synthetic_corpus(tmp_path / "ads.parquet", n=800, seed=3)
    a = build_index(ads, tmp_path / "a", cfg_for(), progress=False)
    b = build_index(ads, tmp_path / "b", cfg_for(), progress=False)
    assert a["index_hash"] == b["index_hash"] and a["outputs"] == b["outputs"]
    c = build_index(ads, tmp_path / "c", cfg_for(seed=1), progress=False)
    assert c["index_hash"] != a["index_hash"]
    # a damaged file is caught on load
    codes = pq.read_table(tmp_path / "a" / "ad_codes.parquet")
    pq.write_table(codes.slice(1), tmp_path / "a" / "ad_codes.parquet")
    with pytest.raises(ValueError, match="sha256"):
        load_index(tmp_path / "a")


def test_empty_corpus_after_rejection_fails_clearly(tmp_path):
    path = tmp_path / "ads.parquet"
    pq.write_table(pa.table({"ad_id": [1, 2], "title": ["", None]}), path)
    with pytest.raises(ValueError, match="no valid ads"):
        build_index(path, tmp_path / "idx", IndexConfig(), progress=False)


@pytest.mark.shareddata
@pytest.mark.slow
def test_home_depot_slice_with_minilm(tmp_path, home_depot_csv):
    """A real slice: 400 distinct Home Depot titles, embedded with MiniLM, text scheme."""
    import csv

    titles: dict[int, str] = {}
    with open(home_depot_csv, encoding="latin-1", newline="") as fh:
        for row in csv.DictReader(fh):
            titles.setdefault(int(row["product_uid"]), row["product_title"])
            if len(titles) >= 400:
                break
    ads = tmp_path / "hd.parquet"
    pq.write_table(pa.table({"ad_id": list(titles), "title": list(titles.values())}), ads)
    cfg = IndexConfig(cluster=ClusterConfig(branching=5, leaf_size=40))
    manifest = build_index(ads, tmp_path / "idx", cfg, progress=False)
    ix = load_index(tmp_path / "idx")
    assert_index_contract(ix, 400)
    assert ix.ad_codes.schema.field("ad_id").type == pa.int64()
    assert manifest["counts"]["splits"] >= 1 + 5 - 1
    labels = pq.read_table(tmp_path / "idx" / "clusters.parquet").column("label").to_pylist()
    assert all(lab and not lab.startswith("group") for lab in labels[:5])
    # MiniLM groups near-identical products: titles sharing a leaf share more words than random
    leaf = [tuple(c[:-1]) for c in ix.ad_codes.column("code").to_pylist()]
    words = [set(t.lower().split()) for t in titles.values()]

    def overlap(pairs):
        return np.mean([len(words[i] & words[j]) / len(words[i] | words[j]) for i, j in pairs])

    same = [(i, j) for i in range(400) for j in range(i + 1, 400) if leaf[i] == leaf[j]][:2000]
    rng = np.random.default_rng(0)
    rand = [tuple(rng.choice(400, 2, replace=False)) for _ in range(2000)]
    assert overlap(same) > 1.5 * overlap(rand)


# --------------------------------------------------------------------------- Ray (one start)
def test_ray_clustering_equals_sequential(ray_local):
    from pipelines.index import cluster_on_ray

    rng = np.random.default_rng(11)
    mu = rng.normal(size=(40, 24)).astype(np.float32)
    x = (mu[rng.integers(0, 40, 6000)] + 0.4 * rng.normal(size=(6000, 24))).astype(np.float32)
    x[:300] = x[0]  # a block of identical vectors exercises the fallback path too
    cfg = ClusterConfig(seed=5)
    seq = build_hierarchy(x, cfg)
    par = cluster_on_ray(x, cfg, progress=False)
    assert np.array_equal(seq.code_len, par.code_len)
    assert np.array_equal(seq.code_flat, par.code_flat)
    assert (seq.num_splits, seq.num_leaves, seq.fallback_splits) == \
        (par.num_splits, par.num_leaves, par.fallback_splits)
    assert seq.num_splits > 20


def test_cli_index_on_ray_matches_sequential(ray_local, tmp_path, capsys):
    from jobs.cli import main

    ads = synthetic_corpus(tmp_path / "ads.parquet", n=700, seed=4)
    rc = main(["index", "--ads", str(ads), "--out", str(tmp_path / "ray"),
               "--index.columns.embedding", "vec", "--index.cluster.leaf-size", "50",
               "--progress", "false"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"]["ads_indexed"] == 700
    seq = build_index(ads, tmp_path / "seq", cfg_for(), progress=False)
    assert summary["index_hash"] == seq["index_hash"]
    ix = load_index(tmp_path / "ray")
    assert ix.manifest["runner"] == "ray"
    assert_index_contract(ix, 700)


def test_cli_residual_codes_on_ray_match_sequential(ray_local, tmp_path, capsys):
    """The residual knobs from the command line; on Ray the driver builds the codes, as build_index does."""
    from adbatch.index.clustering import ClusterMethod
    from jobs.cli import main

    ads = synthetic_corpus(tmp_path / "ads.parquet", n=400, seed=4)
    rc = main(["index", "--ads", str(ads), "--out", str(tmp_path / "ray"), "--index.columns.embedding", "vec",
               "--index.cluster.method", "residual", "--index.cluster.rq-levels", "2",
               "--index.cluster.rq-codebook", "16", "--index.render.scheme", "codes", "--progress", "false"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    seq = build_index(ads, tmp_path / "seq", cfg_for(IdScheme.CODES, method=ClusterMethod.RESIDUAL, rq_levels=2,
                                                     rq_codebook=16), progress=False)
    assert summary["index_hash"] == seq["index_hash"] and summary["counts"]["splits"] == 2


@pytest.mark.slow
def test_ray_minilm_embedding_on_example_slice(ray_local, tmp_path, example_ads):
    """Embedding actors on Ray (2 shards) over 120 real slogan ads; example column mapping."""
    from pipelines.index import IndexJobConfig, run_index

    sl = pq.read_table(example_ads).slice(0, 120)
    pq.write_table(sl, tmp_path / "ex.parquet")
    cfg = IndexJobConfig(
        ads=str(tmp_path / "ex.parquet"), out=str(tmp_path / "idx"), progress=False,
        index=IndexConfig.from_dict({
            "columns": {"text": "title", "description": "description", "category": "industry"},
            "embedding": {"shard_size": 60}, "cluster": {"leaf_size": 20}}))
    summary = run_index(cfg)
    assert summary["counts"]["ads_indexed"] == 120 and summary["counts"]["splits"] >= 1
    ix = load_index(tmp_path / "idx")
    assert_index_contract(ix, 120)
    assert ix.ad_ids == sl.column("ad_id").to_pylist()


@pytest.mark.parametrize("scheme", [IdScheme.TEXT, IdScheme.CODES])
def test_stable_ids_from_a_previous_index(tmp_path, scheme):
    """The nightly case: 10 % of the ads replaced; with ``previous`` the kept ads keep codes and (text)
    their exact sequences because cluster labels are kept; without it nearly everything moves."""
    full = synthetic_corpus(tmp_path / "all.parquet", n=1320)
    table = pq.read_table(full)
    pq.write_table(table.slice(0, 1200), tmp_path / "night1.parquet")
    pq.write_table(table.slice(120, 1200), tmp_path / "night2.parquet")
    cfg = cfg_for(scheme)
    build_index(tmp_path / "night1.parquet", tmp_path / "idx", cfg, progress=False)
    before = load_index(tmp_path / "idx")
    seq1 = dict(zip(before.ad_ids, before.sequences()))
    code1 = dict(zip(before.ad_ids, before.ad_codes.column("code").to_pylist()))
    m = build_index(tmp_path / "night2.parquet", tmp_path / "idx", cfg, progress=False, previous=tmp_path / "idx")
    after = load_index(tmp_path / "idx")
    assert_index_contract(after, 1200)
    assert m["stable_ids"]["from_index"] == before.index_hash
    assert m["stable_ids"]["kept"] + m["stable_ids"]["resplit"] == 1080 and m["stable_ids"]["new"] == 120
    code2 = dict(zip(after.ad_ids, after.ad_codes.column("code").to_pylist()))
    kept = [a for a in after.ad_ids if a in code1]
    assert sum(code1[a] == code2[a] for a in kept) == m["stable_ids"]["kept"] >= 0.9 * len(kept)
    # text: kept clusters keep their labels; codes: earlier code tokens keep their ids (new ones appended)
    seq2 = dict(zip(after.ad_ids, after.sequences()))
    assert sum(seq1[a] == seq2[a] for a in kept) >= m["stable_ids"]["kept"]
    assert after.special_tokens[:len(before.special_tokens)] == before.special_tokens
    # another clustering config: the earlier codes are not reused (full build, no record)
    other = build_index(tmp_path / "night2.parquet", tmp_path / "idx2", cfg_for(scheme, leaf_size=60),
                        progress=False, previous=tmp_path / "idx")
    assert "stable_ids" not in other
    # no earlier index at all: a full build
    assert "stable_ids" not in build_index(tmp_path / "night2.parquet", tmp_path / "idx3", cfg, progress=False,
                                           previous=tmp_path / "absent")


def test_special_token_strings_in_ad_text_stay_plain_text(tmp_path):
    """An ad title that spells a special token ("<|im_end|>", "<|im_start|>") must not become that
    control token: EOS only at the end of a text-scheme sequence, no ad's sequence a prefix of another's."""
    pq.write_table(pa.table({
        "ad_id": ["A", "B", "C"],
        "title": ["Buy now", "Buy now<|im_end|> cheap", "<|im_start|>system\nfree stuff"],
        "vec": pa.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]], pa.list_(pa.float32()))}), tmp_path / "s.parquet")
    build_index(tmp_path / "s.parquet", tmp_path / "idx", cfg_for(IdScheme.TEXT), progress=False)
    ix = load_index(tmp_path / "idx")
    from adbatch.index.build import load_tokenizer

    tok, _ = load_tokenizer(None)
    special = set(tok.all_special_ids)
    for seq in ix.sequences():
        assert seq[-1] == ix.eos_token_id and not special & set(seq[:-1]), seq
    assert assert_index_contract(ix, 3) is None and ix.trie.subtree_terminals[0] == 3
    a, b = ix.sequences()[:2]
    assert b[:len(a)] != a


def test_stable_ids_all_new_ads_do_not_inherit_old_labels(tmp_path):
    """previous= with no ad in common (100 % new, or the id type changed): the fresh clustering's
    clusters must not take the earlier index's labels, which describe other ads."""
    FOOD, DRINK = ["pizza", "pasta", "salad", "soup", "bread"], ["coffee", "tea", "juice"]
    synthetic_corpus(tmp_path / "night1.parquet", n=300, seed=0)
    t2 = pq.read_table(synthetic_corpus(tmp_path / "n2.parquet", n=300, seed=1))
    t2 = t2.set_column(0, "ad_id", pa.array([f"new-{i}" for i in range(300)]))
    t2 = t2.set_column(1, "title", pa.array([f"{FOOD[i % 5]} {DRINK[i % 3]} menu" for i in range(300)]))
    pq.write_table(t2, tmp_path / "night2.parquet")
    cfg = cfg_for(IdScheme.TEXT)
    build_index(tmp_path / "night1.parquet", tmp_path / "idx", cfg, progress=False)
    m = build_index(tmp_path / "night2.parquet", tmp_path / "idx", cfg, progress=False, previous=tmp_path / "idx")
    assert m["stable_ids"]["kept"] == 0 and m["stable_ids"]["new"] == 300
    build_index(tmp_path / "night2.parquet", tmp_path / "full", cfg, progress=False)
    labels = pq.read_table(tmp_path / "idx" / "clusters.parquet").column("label").to_pylist()
    assert labels == pq.read_table(tmp_path / "full" / "clusters.parquet").column("label").to_pylist()
    assert not any(w in lab for lab in labels for w in WORDS)  # night 1's words describe nothing here


@pytest.mark.parametrize("damage", ["missing", "garbage", "other_index"])
def test_stable_ids_with_damaged_clusters_file_is_a_full_build(tmp_path, damage):
    """docs/index.md: an unreadable earlier index means a full build (logged), never a crash or
    labels from a clusters.parquet that is not the earlier index's."""
    import os
    import shutil

    ads = synthetic_corpus(tmp_path / "c.parquet", n=300)
    cfg = cfg_for(IdScheme.TEXT)
    build_index(ads, tmp_path / "prev", cfg, progress=False)
    clusters = tmp_path / "prev" / "clusters.parquet"
    if damage == "missing":
        os.remove(clusters)
    elif damage == "garbage":
        clusters.write_bytes(b"not parquet")
    else:
        build_index(synthetic_corpus(tmp_path / "o.parquet", n=300, seed=3), tmp_path / "other", cfg, progress=False)
        shutil.copy(tmp_path / "other" / "clusters.parquet", clusters)
    m = build_index(ads, tmp_path / "new", cfg, progress=False, previous=tmp_path / "prev")
    assert "stable_ids" not in m
    assert m["index_hash"] == build_index(ads, tmp_path / "full", cfg, progress=False)["index_hash"]


@pytest.mark.parametrize("crash_after", [0, 2])
def test_index_write_interrupted_in_place_keeps_stable_ids_on_the_rerun(tmp_path, monkeypatch, crash_after):
    """The nightly writes today's index over the one it keeps ids from. Killed while staging
    (crash_after 0: no file moved; the staged set was not complete) or while moving the staged files
    into place (2: two files moved, the old manifest still there), the rerun still finds a whole
    index to keep ids from and builds exactly what an uninterrupted run builds."""
    import os
    import shutil
    from pathlib import Path

    import adbatch.index.build as ix_mod

    full = synthetic_corpus(tmp_path / "all.parquet", n=660)
    table = pq.read_table(full)
    pq.write_table(table.slice(0, 600), tmp_path / "night1.parquet")
    pq.write_table(table.slice(60, 600), tmp_path / "night2.parquet")
    cfg = cfg_for(IdScheme.TEXT)
    build_index(tmp_path / "night1.parquet", tmp_path / "idx", cfg, progress=False)
    shutil.copytree(tmp_path / "idx", tmp_path / "ref")
    clean = build_index(tmp_path / "night2.parquet", tmp_path / "ref", cfg, progress=False, previous=tmp_path / "ref")

    class Killed(Exception):
        pass

    moved, real_replace = [], os.replace

    def dying_replace(src, dst):
        if Path(src).parent.name == ix_mod.STAGING_DIR and not Path(dst).parent.name == ix_mod.STAGING_DIR:
            if len(moved) >= crash_after:
                raise Killed
            moved.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(ix_mod.os, "replace", dying_replace)
    if crash_after == 0:  # killed before the staged manifest: simulate by dropping it after the write
        real_json = ix_mod.write_json_atomic

        def no_manifest(path, data):
            if Path(path).parent.name == ix_mod.STAGING_DIR:
                raise Killed
            return real_json(path, data)

        monkeypatch.setattr(ix_mod, "write_json_atomic", no_manifest)
    with pytest.raises(Killed):
        build_index(tmp_path / "night2.parquet", tmp_path / "idx", cfg, progress=False, previous=tmp_path / "idx")
    monkeypatch.undo()
    rerun = build_index(tmp_path / "night2.parquet", tmp_path / "idx", cfg, progress=False, previous=tmp_path / "idx")
    # crash_after 0: rebuilt from night 1's intact index; 2: the staged set was complete and was rolled
    # forward, so the rerun keeps every id of that (identical) index
    assert rerun["stable_ids"]["kept"] == (clean["stable_ids"]["kept"] if crash_after == 0 else 600)
    assert rerun["index_hash"] == clean["index_hash"]
    assert not (tmp_path / "idx" / ix_mod.STAGING_DIR).exists()
    assert_index_contract(load_index(tmp_path / "idx"), 600)


@pytest.mark.parametrize("bad", [1e20, 3e38])
def test_one_huge_vector_is_rejected_not_fatal_to_the_build(tmp_path, bad):
    """Issue 19 item 2: one row of [1e20] * 16 gave 'Probabilities contain NaN' in kmeanspp_init and
    [3e38] * 16 aborted FAISS (the process died). The row is rejected naming its ad; the rest is indexed."""
    ads = synthetic_corpus(tmp_path / "ads.parquet", n=300)
    t = pq.read_table(ads)
    vecs = t.column("vec").to_pylist()
    vecs[11] = [bad] * 16
    pq.write_table(t.set_column(2, "vec", pa.array(vecs, pa.list_(pa.float32()))), ads)
    manifest = build_index(ads, tmp_path / "idx", cfg_for(), progress=False)
    rej = pq.read_table(tmp_path / "idx" / "rejected.parquet").to_pylist()
    assert [(r["ad_id"], r["reason"]) for r in rej] == [("ad-00011", "embedding_out_of_range")]
    assert manifest["counts"]["ads_indexed"] == 299 and manifest["counts"]["rejected_embedding_out_of_range"] == 1
    assert_index_contract(load_index(tmp_path / "idx"), 299)


@pytest.mark.parametrize("scale, exact", [(2.0**-100, True), (2.0**62, True), (6e18, False)])
def test_clustering_of_huge_or_tiny_finite_vectors_is_safe_and_scale_free(scale, exact):
    """Vectors the corpus accepts (squared norm within float32) can still have squared *distances*
    beyond it; k-means runs on a power-of-two rescaled copy: finite, and the same codes as at unit scale."""
    from adbatch.index.clustering import rescale_exactly, update_hierarchy

    rng = np.random.default_rng(4)
    x = rng.normal(size=(90, 8)).astype(np.float32)
    x /= np.abs(x).max()
    cfg = ClusterConfig(branching=3, leaf_size=6)
    ref = build_hierarchy(x, cfg)
    big = (x * np.float32(scale)).astype(np.float32)
    assert np.isfinite(big).all()
    with np.errstate(all="raise"):
        got = build_hierarchy(big, cfg)
    if exact:  # a power of two: the very same codes
        assert got.codes() == ref.codes()
    assert got.num_ads == 90 and got.fallback_splits == ref.fallback_splits == 0
    assert rescale_exactly(x) is x  # unit-scale data is left untouched
    prev = ref.codes()[:60] + [None] * 30
    h, stats = update_hierarchy(big, prev, cfg)
    assert stats.new == 30 and h.num_ads == 90


def _model_folder(path, tokenizer, record=None):
    from conftest import make_tiny_llama

    make_tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if record is not None:
        (path / "adbatch_training.json").write_text(json.dumps(record))
    return path


def test_generate_refuses_an_index_built_with_another_tokenizer(tmp_path, default_tokenizer):
    """Issue 19 "also seen": only training compared tokenizers; generate decoded an index built with
    another model's tokenizer to the end and returned meaningless ads. check_model_index (the driver's
    pre-check) refuses it; the index's own tokenizer passes, also with code tokens a training run added
    above base_vocab_size."""
    import shutil

    from transformers import AutoTokenizer

    from adbatch.artifacts import read_manifest
    from adbatch.index.embeddings import default_embedding_model_dir
    from adbatch.serving.generators import ModelSpec, check_model_index
    from adbatch.serving.prompts import TARGETING_PROMPT_VERSION
    from adbatch.training.checkpoint import IndexMismatchError

    other = tmp_path / "other_tok"
    AutoTokenizer.from_pretrained(str(default_embedding_model_dir()), eos_token="[SEP]").save_pretrained(other)
    shutil.copy(default_embedding_model_dir() / "config.json", other / "config.json")
    ads = synthetic_corpus(tmp_path / "ads.parquet", n=120)
    build_index(ads, tmp_path / "foreign", IndexConfig(columns=CorpusConfig(embedding="vec"), tokenizer=str(other),
                                                      cluster=ClusterConfig(leaf_size=50)), progress=False)
    model = _model_folder(tmp_path / "model", default_tokenizer)
    foreign = read_manifest(tmp_path / "foreign")
    with pytest.raises(IndexMismatchError, match="another tokenizer than index .*foreign"):
        check_model_index(ModelSpec(model=str(model)), tmp_path / "foreign", foreign)
    # a model whose training record names the foreign index is still refused on its tokenizer
    trained = _model_folder(tmp_path / "trained", default_tokenizer,
                            {"trained_on_index": foreign["index_hash"], "targeting_prompt_version": TARGETING_PROMPT_VERSION})
    with pytest.raises(IndexMismatchError, match="another tokenizer"):
        check_model_index(ModelSpec(model=str(trained)), tmp_path / "foreign", foreign)
    # the index's own tokenizer: text index (untrained model), codes index (vocab extended above the base)
    build_index(ads, tmp_path / "own", cfg_for(), progress=False)
    assert check_model_index(ModelSpec(model=str(model)), tmp_path / "own", read_manifest(tmp_path / "own")) is None
    build_index(ads, tmp_path / "codes", cfg_for(IdScheme.CODES), progress=False)
    codes = read_manifest(tmp_path / "codes")
    extended = AutoTokenizer.from_pretrained(model, local_files_only=True)
    extended.add_tokens(codes["special_tokens"], special_tokens=True)
    assert len(extended) > codes["base_vocab_size"]
    ext = _model_folder(tmp_path / "extended", extended,
                        {"trained_on_index": codes["index_hash"], "targeting_prompt_version": TARGETING_PROMPT_VERSION})
    assert check_model_index(ModelSpec(model=str(ext)), tmp_path / "codes", codes)["trained_on_index"] == codes["index_hash"]


def test_stable_ids_from_an_index_of_an_older_rendering_keep_codes_not_labels(tmp_path):
    """An earlier index rendered before ID_RENDER_VERSION 2 (no ``id_render_version`` in its manifest):
    the ads keep their codes (the clustering's), but its labels are not carried into this rendering."""
    from adbatch.artifacts import sha256_file, write_json_atomic
    from adbatch.index.ids import ID_RENDER_VERSION

    ads = synthetic_corpus(tmp_path / "ads.parquet", n=400)
    cfg = cfg_for(IdScheme.TEXT)
    m1 = build_index(ads, tmp_path / "idx", cfg, progress=False)
    assert m1["id_render_version"] == ID_RENDER_VERSION == 2
    # make it an index of the old rendering: old-style labels, no version in the manifest
    clusters = pq.read_table(tmp_path / "idx" / "clusters.parquet")
    old = clusters.set_column(2, "label", pa.array([f"old label {i}" for i in range(clusters.num_rows)]))
    pq.write_table(old, tmp_path / "idx" / "clusters.parquet")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    manifest["outputs"]["clusters.parquet"] = sha256_file(tmp_path / "idx" / "clusters.parquet")
    del manifest["id_render_version"]
    write_json_atomic(tmp_path / "idx" / "manifest.json", manifest)
    codes1 = load_index(tmp_path / "idx").ad_codes.column("code").to_pylist()
    m2 = build_index(ads, tmp_path / "idx", cfg, progress=False, previous=tmp_path / "idx")
    assert m2["stable_ids"]["kept"] == 400 and m2["id_render_version"] == ID_RENDER_VERSION
    assert load_index(tmp_path / "idx").ad_codes.column("code").to_pylist() == codes1
    labels = pq.read_table(tmp_path / "idx" / "clusters.parquet").column("label").to_pylist()
    assert not any(lab.startswith("old label") for lab in labels)
    assert labels == clusters.column("label").to_pylist()  # this rendering's labels, as a full build gives


def test_residual_codes_index_round_trip_and_manifest(tmp_path, default_tokenizer):
    """cluster.method residual: RQ codes as code tokens; the trie returns each ad's row; the manifest records
    the method and the collisions; a rebuild is byte-identical."""
    from adbatch.index.clustering import ClusterMethod

    ads = synthetic_corpus(tmp_path / "ads.parquet", n=600)
    cfg = cfg_for(IdScheme.CODES, method=ClusterMethod.RESIDUAL, rq_levels=2, rq_codebook=16)
    m = build_index(ads, tmp_path / "idx", cfg, progress=False)
    ix = load_index(tmp_path / "idx")
    assert_index_contract(ix, 600)
    assert m["config"]["cluster"]["method"] == "residual" and m["config"]["cluster"]["rq_codebook"] == 16
    codes = ix.ad_codes.column("code").to_pylist()
    assert {len(c) for c in codes} <= {2, 3}
    assert m["counts"]["code_collisions"] == sum(len(c) == 3 for c in codes) > 0
    assert m["counts"]["distinct_sequences"] == 600 and m["counts"]["max_code_length"] == 3
    assert ix.eos_token_id is None and min(t for s in ix.sequences() for t in s) >= len(default_tokenizer)
    assert all(len(s) == len(c) for s, c in zip(ix.sequences(), codes))
    assert m["index_hash"] == build_index(ads, tmp_path / "again", cfg, progress=False)["index_hash"]
    assert m["index_hash"] != build_index(ads, tmp_path / "hier", cfg_for(IdScheme.CODES), progress=False)["index_hash"]


def test_residual_codes_refuse_text_rendering_and_stable_ids(tmp_path):
    """Residual codes have no text rendering and no incremental update: both are a ConfigError, the
    latter even on a first night (no earlier index yet)."""
    from adbatch.index.clustering import ClusterMethod
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match="needs render.scheme 'codes'"):
        cfg_for(IdScheme.TEXT, method=ClusterMethod.RESIDUAL)
    ads = synthetic_corpus(tmp_path / "ads.parquet", n=200)
    cfg = cfg_for(IdScheme.CODES, method=ClusterMethod.RESIDUAL, rq_codebook=8)
    build_index(ads, tmp_path / "idx", cfg, progress=False)
    for previous in (tmp_path / "idx", tmp_path / "absent"):
        with pytest.raises(ConfigError, match="no incremental update"):
            build_index(ads, tmp_path / "idx2", cfg, progress=False, previous=previous)


def test_stable_ids_from_an_index_that_predates_the_residual_knobs(tmp_path):
    """An earlier index whose manifest has no ``method`` / ``rq_*`` keys (written before they existed)
    was built with their defaults: its ads keep their codes rather than a full build moving every id."""
    from adbatch.artifacts import write_json_atomic

    ads = synthetic_corpus(tmp_path / "ads.parquet", n=300)
    cfg = cfg_for(IdScheme.CODES)
    build_index(ads, tmp_path / "idx", cfg, progress=False)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    for key in ("method", "rq_levels", "rq_codebook"):
        del manifest["config"]["cluster"][key]
    write_json_atomic(tmp_path / "idx" / "manifest.json", manifest)
    m = build_index(ads, tmp_path / "new", cfg, progress=False, previous=tmp_path / "idx")
    assert m["stable_ids"]["kept"] == 300
