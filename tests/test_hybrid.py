"""The dense channel and the fusion of both channels (issue 41): embeddings stored by the index and
reloaded byte-exact, the query embedder's identity checked, union scoring, fusion fitted at train time and
stored, the generate stage's hybrid output columns, and the refresh's invalidation when the fusion changes."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import pipelines.generate as pg
from adbatch.decoding import TargetSearchConfig
from adbatch.index.build import IndexConfig, build_index, load_index
from adbatch.index.corpus import CorpusConfig
from adbatch.index.clustering import ClusterConfig
from adbatch.index.dense import (DenseChannelError, DenseRetriever, check_query_embedder, load_embeddings,
                                 normalized_fp16)
from adbatch.serving.hybrid import (CHANNEL_DENSE, CHANNEL_GENERATIVE, Candidates, FusionMethod, FusionParams,
                                    fit_fusion, fused_scores, rank_candidates, union_candidates)
from test_generate_support import WORDS, target_requests, tiny_corpus, tiny_model_dir

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny model and an index whose ads the packaged MiniLM embedded (a dense channel)."""
    root = tmp_path_factory.mktemp("hybrid")
    ads = tiny_corpus(root / "ads.parquet", n=40)
    cfg = IndexConfig(cluster=ClusterConfig(branching=4, leaf_size=8))
    build_index(ads, root / "index", cfg, progress=False)
    return {"model": tiny_model_dir(root), "index": root / "index", "ads": ads, "root": root}


def test_embeddings_stored_and_reloaded_byte_exact(assets):
    from adbatch.index.embeddings import EmbeddingConfig, embed_texts
    from adbatch.index.corpus import read_corpus

    index = load_index(assets["index"])
    info = index.manifest["dense"]
    assert info["source"] == "computed" and info["dim"] == 384 and info["query_embedder"]["name"] == "default"
    stored = load_embeddings(index)
    assert stored.dtype == torch.float16 and stored.shape == (40, 384)
    corpus = read_corpus(assets["ads"], CorpusConfig())
    want = normalized_fp16(embed_texts(corpus.embedding_inputs(), EmbeddingConfig()))
    assert np.array_equal(stored.numpy().view(np.uint16), want.view(np.uint16))
    assert index.manifest["outputs"]["embeddings.safetensors"]


def test_corpus_embeddings_need_a_query_embedder(assets, tmp_path):
    cfg = IndexConfig(columns=CorpusConfig(embedding="vec"), cluster=ClusterConfig(branching=4, leaf_size=8))
    build_index(assets["ads"], tmp_path / "idx", cfg, progress=False)
    index = load_index(tmp_path / "idx")
    assert index.manifest["dense"]["source"] == "corpus" and index.manifest["dense"]["query_embedder"] is None
    with pytest.raises(DenseChannelError, match="query.embedder"):
        check_query_embedder(index.directory, index.manifest)
    # generate refuses in the driver, before any model loads, with one line
    req = target_requests(tmp_path / "req.parquet", n=3)
    job = pg.GenerateJobConfig(task="targets", requests=req, index=tmp_path / "idx", model=str(assets["model"]),
                               out=tmp_path / "out", executor="local", device="cpu", progress=False)
    with pytest.raises(DenseChannelError, match="no query embedder"):
        pg.run_generate(job)
    assert not (tmp_path / "out").exists()


def test_query_embedder_identity_is_checked(assets, tmp_path):
    index = load_index(assets["index"])
    manifest = json.loads(json.dumps(index.manifest))
    manifest["dense"]["query_embedder"]["sha256"] = "0" * 64
    with pytest.raises(DenseChannelError, match="another space"):
        check_query_embedder(index.directory, manifest)


def test_dense_retriever_is_exact_cosine(assets):
    index = load_index(assets["index"])
    dense = DenseRetriever(index, "cpu")
    q = dense.embed(["drill saw", "lamp bulb"])
    hits = dense.search(q, 5)
    full = q @ load_embeddings(index).float().T
    torch.testing.assert_close(hits.scores, full.topk(5, dim=1).values)
    torch.testing.assert_close(dense.score(q, hits.rows), hits.scores)
    assert dense.score(q, torch.tensor([[-1, 0], [1, -1]]))[0, 0] == float("-inf")


def _cands() -> Candidates:
    # query 0: rows 5 (gen + dense), 7 (gen), 9 (dense); query 1: rows 2 (gen), 3 (dense)
    return union_candidates(torch.tensor([[5, 7], [2, -1]]), torch.tensor([[-1.0, -2.0], [-0.5, float("-inf")]]),
                            torch.tensor([[0.5, 0.1], [0.2, float("-inf")]]),
                            torch.tensor([[9, 5], [3, -1]]), torch.tensor([[0.9, 0.5], [0.8, float("-inf")]]),
                            torch.tensor([[-6.0, -1.0], [-3.0, float("-inf")]]))


def test_union_keeps_each_row_once_with_both_flags():
    c = _cands()
    got = {r: (ch, g, d) for r, ch, g, d in zip(c.rows[0].tolist(), c.channel[0].tolist(), c.generative[0].tolist(),
                                                c.dense[0].tolist()) if r >= 0}
    assert got == {5: (CHANNEL_GENERATIVE | CHANNEL_DENSE, -1.0, 0.5), 7: (CHANNEL_GENERATIVE, -2.0, pytest.approx(0.1)),
                   9: (CHANNEL_DENSE, -6.0, pytest.approx(0.9))}
    assert sorted(r for r in c.rows[1].tolist() if r >= 0) == [2, 3]


def test_fused_scores_interpolation_and_rrf():
    c = _cands()
    interp = rank_candidates(c, fused_scores(c, FusionParams(method=FusionMethod.INTERPOLATION,
                                                             weight_generative=0.1)), 3)
    # 5: 0.5 - 0.1 = 0.4; 7: 0.1 - 0.2 = -0.1; 9: 0.9 - 0.6 = 0.3
    assert interp.rows[0].tolist() == [5, 9, 7]
    np.testing.assert_allclose(interp.score[0].numpy(), [0.4, 0.3, -0.1], atol=1e-6)
    rrf = rank_candidates(c, fused_scores(c, FusionParams()), 3)
    # ranks (gen, dense): 5 (1, 2), 7 (2, 3), 9 (3, 1)
    want = {5: 1 / 61 + 1 / 62, 7: 1 / 62 + 1 / 63, 9: 1 / 63 + 1 / 61}
    assert rrf.rows[0].tolist() == sorted(want, key=want.get, reverse=True)


def test_fit_fusion_picks_the_channel_that_ranks_relevant_ads():
    g = torch.Generator().manual_seed(0)
    Q, M = 40, 12
    rows = torch.arange(M).expand(Q, M).contiguous()
    dense = torch.rand(Q, M, generator=g)
    gen = -5 * torch.rand(Q, M, generator=g)
    rel_gen = [{int(gen[q].argmax())} for q in range(Q)]    # the generative channel knows the answer
    rel_dense = [{int(dense[q].argmax())} for q in range(Q)]
    c = Candidates(rows, gen, dense, torch.full((Q, M), 3, dtype=torch.int8))
    fit_g = fit_fusion(c, rel_gen, "validation", k=1)
    fit_d = fit_fusion(c, rel_dense, "validation", k=1)
    assert fit_g.method is FusionMethod.INTERPOLATION and fit_g.weight_generative >= 1.0
    assert fit_d.method is FusionMethod.INTERPOLATION and fit_d.weight_generative == 0.0
    assert fit_d.fit_metrics["hybrid_recall@1"] == 1.0 and fit_d.fit_metrics["dense_recall@1"] == 1.0
    assert FusionParams.from_dict(json.loads(json.dumps(fit_g.to_dict()))) == fit_g


@pytest.mark.slow
def test_fusion_fitted_at_train_time_and_stored(assets, tmp_path):
    from adbatch.training import TrainConfig, train_on_index
    from adbatch.training.checkpoint import read_training_record

    index = load_index(assets["index"])
    qrels = {f"{WORDS[0]} {WORDS[1]}": {index.ad_ids[0]: 3.0}, "lamp": {index.ad_ids[3]: 3.0}}
    cfg = TrainConfig(max_steps=1, batch_tokens=512, compile=False, fusion_queries=8,
                      qat=TrainConfig().qat.replace(enabled=False))
    from adbatch.models import load_causal_lm

    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    train_on_index(index, tmp_path / "m", cfg, model=model, tokenizer=tok, device="cpu", progress=False,
                   valid_qrels=qrels)
    rec = read_training_record(tmp_path / "m")
    fusion = FusionParams.from_dict(rec["fusion"])
    assert fusion.fitted_on == "validation" and fusion.queries == 2
    assert set(fusion.fit_metrics) >= {"dense_recall@10", "generative_recall@10", "hybrid_recall@10"}
    # the refresh re-runs generate when the fusion changes: the model's input hash covers the record
    job = pg.GenerateJobConfig(task="targets", requests=target_requests(tmp_path / "r.parquet", n=2),
                               index=assets["index"], model=str(tmp_path / "m"), out=tmp_path / "o")
    before = pg.generate_inputs(job)
    rec["fusion"]["weight_generative"] = 123.0
    (tmp_path / "m" / "adbatch_training.json").write_text(json.dumps(rec))
    assert pg.generate_inputs(job)["model"] != before["model"]


def test_generate_hybrid_writes_both_scores_and_the_channel(assets, tmp_path):
    req = target_requests(tmp_path / "req.parquet", n=6)
    job = pg.GenerateJobConfig(task="targets", requests=req, index=assets["index"], model=str(assets["model"]),
                               out=tmp_path / "out", executor="local", device="cpu", progress=False, batch_size=3,
                               targets={"num_beams": 3, "top_k": 5, "verify": "off", "dense_k": 4})
    pg.run_generate(job)
    out = pq.read_table(tmp_path / "out" / "targets").to_pylist()
    assert len(out) == 30
    index = load_index(assets["index"])
    dense = DenseRetriever(index, "cpu")
    queries = {r["request_id"]: r["query"] for r in pq.read_table(req).to_pylist()}
    row_of = {str(a): i for i, a in enumerate(index.ad_ids)}
    for rid in queries:
        rows = [r for r in out if r["request_id"] == rid]
        assert [r["rank"] for r in rows] == [1, 2, 3, 4, 5]
        assert all(r["channel"] in ("generative", "dense", "both") for r in rows)
        # the beam's ads carry their exact log-prob; an untrained model's fusion is the dense order, which needs
        # no generative score for the dense channel's own candidates (their pass is skipped)
        assert all(r["score_generative"] is not None and math.isfinite(r["score_generative"])
                   for r in rows if r["channel"] != "dense")
        assert all(r["score"] == pytest.approx(r["score_dense"]) for r in rows)
        assert all(rows[j]["score"] >= rows[j + 1]["score"] - 1e-6 for j in range(4))
        q = dense.embed([queries[rid]])
        cos = dense.score(q, torch.tensor([[row_of[r["ad_id"]] for r in rows]]))[0]
        np.testing.assert_allclose([r["score_dense"] for r in rows], cos.numpy(), atol=1e-5)
        top_dense = dense.search(q, 4).rows[0].tolist()
        for r in rows:
            assert (row_of[r["ad_id"]] in top_dense) == (r["channel"] in ("dense", "both"))
    # dense alone: no model search, generative scores null
    job2 = job.replace(out=tmp_path / "dense", targets=job.targets.replace(fusion="dense"))
    pg.run_generate(job2)
    d = pq.read_table(tmp_path / "dense" / "targets").to_pylist()
    assert all(r["channel"] == "dense" and r["score_generative"] is None for r in d)


@pytest.mark.parametrize("backend", ["faiss_flat", "faiss_hnsw"])
def test_faiss_backends_agree_with_the_exact_search(assets, backend):
    index = load_index(assets["index"])
    exact = DenseRetriever(index, "cpu")
    other = DenseRetriever(index, "cpu", backend=backend, embedder=exact.embedder)
    q = exact.embed(["drill saw", "lamp bulb", "pipe valve"])
    a, b = exact.search(q, 5), other.search(q, 5)
    assert (a.rows == b.rows).float().mean() >= (1.0 if backend == "faiss_flat" else 0.8)
    torch.testing.assert_close(b.scores, exact.score(q, b.rows), atol=1e-3, rtol=0)


def test_a_fusion_that_ignores_the_generative_score_skips_its_pass(assets):
    """Fitted weight 0 (a barely trained model): the union is ranked by cosine, and the dense candidates'
    teacher-forced pass is skipped (their generative score stays NaN unless the beam found them)."""
    from adbatch.models import load_causal_lm
    from adbatch.serving.hybrid import HybridRanker

    index = load_index(assets["index"])
    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    dense = DenseRetriever(index, "cpu")
    search = TargetSearchConfig(num_beams=3, top_k=5, verify="off", dense_k=6)
    queries = ["drill saw", "lamp bulb"]
    zero = HybridRanker(model, tok, index, search, dense=dense,
                        fusion=FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.0)).rank(queries)
    full = HybridRanker(model, tok, index, search, dense=dense,
                        fusion=FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=1e-9)).rank(queries)
    assert zero.rows.tolist() == full.rows.tolist()  # the same ranking: cosine decides
    only_dense = zero.channel == CHANNEL_DENSE
    assert only_dense.any() and torch.isnan(zero.generative[only_dense]).all()
    assert torch.isfinite(full.generative[zero.rows >= 0]).all()


def test_hybrid_scores_only_the_dense_candidates_the_beams_did_not_find(assets):
    """The beam search runs first; the dense candidates it did not find get their exact log-prob from one
    ``score_targets`` pass, those it found keep the beam's (the same number): every union row's generative score
    equals a plain teacher-forced scoring of that row."""
    from adbatch.decoding import score_targets, search_targets
    from adbatch.models import load_causal_lm
    from adbatch.serving.hybrid import HybridRanker
    from adbatch.serving.prompts import encode_targeting_prompts

    index = load_index(assets["index"])
    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    dense = DenseRetriever(index, "cpu")
    search = TargetSearchConfig(num_beams=3, top_k=5, verify="off", dense_k=12)
    queries = ["drill saw", "lamp bulb", "pipe valve", "paint brush"]
    hr = HybridRanker(model, tok, index, search, dense=dense,
                      fusion=FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.05))
    c = hr.candidates(queries)
    prompts = encode_targeting_prompts(tok, queries)
    with torch.inference_mode():  # as the ranker's calls: one engine, its buffers made in inference mode
        beams = search_targets(model, prompts, index.trie, search).rows
        want = score_targets(model, prompts, index.trie, search, c.rows)
    hits = dense.search(dense.embed(queries), search.dense_k).rows
    not_found = sum(len(set(h) - set(b)) for h, b in zip(hits.tolist(), beams.tolist()))
    assert hr.last_exact.rows == not_found > 0
    ok = c.rows >= 0
    torch.testing.assert_close(c.generative[ok], want[ok], atol=1e-4, rtol=1e-6)


def test_beam_floor_fuses_unscored_dense_candidates_at_the_lowest_beam_score():
    """``dense_scoring = beam_floor``: a candidate only the dense channel found is fused as if its log-prob were
    the query's lowest beam score; the ranking equals the interpolation over the union with that value filled in,
    and a query the beams found nothing for keeps its dense order."""
    from adbatch.serving.hybrid import beam_floor_view

    c = beam_floor_view(_cands())
    # query 0: beams 5 (-1.0) and 7 (-2.0); 9 only dense -> its exact -6.0 is dropped, the floor is -2.0
    assert c.floor.tolist() == [-2.0, -0.5]
    got = {r: g for r, g in zip(c.rows[0].tolist(), c.generative[0].tolist()) if r >= 0}
    assert got[5] == -1.0 and got[7] == -2.0 and math.isnan(got[9])
    p = FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.1)
    ranked = rank_candidates(c, fused_scores(c, p), 3)
    # 5: 0.5 - 0.1 = 0.4; 7: 0.1 - 0.2 = -0.1; 9: 0.9 - 0.2 = 0.7 (the floor, not its exact -6.0)
    assert ranked.rows[0].tolist() == [9, 5, 7]
    np.testing.assert_allclose(ranked.score[0].numpy(), [0.7, 0.4, -0.1], atol=1e-6)
    assert math.isnan(float(ranked.generative[0, 0]))  # not computed: null in the Parquet
    # a query the beams found nothing for: every row gets the same stand-in (0), so cosine decides
    none = torch.tensor([[-1, -1]])
    e = beam_floor_view(union_candidates(none, torch.full((1, 2), float("-inf")), torch.full((1, 2), float("-inf")),
                                         torch.tensor([[4, 8]]), torch.tensor([[0.3, 0.6]]),
                                         torch.tensor([[-9.0, -1.0]])))
    assert e.floor.tolist() == [0.0]
    assert rank_candidates(e, fused_scores(e, p), 2).rows[0].tolist() == [8, 4]


def test_fusion_params_serve_the_fit_of_their_scoring():
    from adbatch.decoding.config import DenseScoring

    floor = FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.05, fitted_on="validation")
    exact = FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.01, fitted_on="validation",
                         beam_floor=floor.to_dict())
    back = FusionParams.from_dict(json.loads(json.dumps(exact.to_dict())))
    assert back.for_scoring(DenseScoring.EXACT) == back and back.for_scoring(DenseScoring.EXACT).weight_generative == 0.01
    assert back.for_scoring(DenseScoring.BEAM_FLOOR) == floor
    old = FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.01)  # a record from before the floor
    assert old.for_scoring(DenseScoring.BEAM_FLOOR) is old


def test_hybrid_beam_floor_runs_no_score_pass_and_fits_its_own_fusion(assets):
    """The ranker with ``beam_floor`` never calls the exact pass; its candidates equal the exact ones with the
    dense-only scores replaced by the floor, and ``fit_fusion_on`` stores a fit for each scoring."""
    from adbatch.models import load_causal_lm
    from adbatch.serving.hybrid import HybridRanker, beam_floor_view, fit_fusion_on

    index = load_index(assets["index"])
    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    dense = DenseRetriever(index, "cpu")
    search = TargetSearchConfig(num_beams=3, top_k=5, verify="off", dense_k=12)
    queries = ["drill saw", "lamp bulb", "pipe valve", "paint brush"]
    fus = FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.05)
    exact = HybridRanker(model, tok, index, search, dense=dense, fusion=fus)
    floor = HybridRanker(model, tok, index, search.replace(dense_scoring="beam_floor"), dense=dense, fusion=fus)
    ce, cf = exact.candidates(queries), floor.candidates(queries)
    assert exact.last_exact.rows > 0 and floor.last_exact.rows == 0 and floor.last_exact.passes == 0
    want = beam_floor_view(ce)
    assert cf.rows.tolist() == ce.rows.tolist()
    torch.testing.assert_close(cf.floor, want.floor)
    torch.testing.assert_close(cf.generative, want.generative, equal_nan=True)
    rel = [{int(ce.rows[q, 0])} for q in range(len(queries))]
    fitted = fit_fusion_on(model, tok, index, queries, rel, "validation", dense, search=search)
    assert fitted.beam_floor is not None
    assert fitted.for_scoring(search.replace(dense_scoring="beam_floor").dense_scoring).fit_metrics
