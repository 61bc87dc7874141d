"""Ranking metrics: hand-computed values, padding/duplicate handling, batch averaging."""

from __future__ import annotations

import math

import pytest

from adbatch.eval.metrics import (mrr_at_k, ndcg_at_k, ranking_metrics, recall_at_k, relevant_set,
                             success_at_k)
from adbatch.eval.targeting import EmbeddingRanker, SearchBackend, evaluate_targeting

GRADES = {"a": 3.0, "b": 2.67, "c": 2.0, "d": 1.0}


def test_relevant_set_threshold():
    assert relevant_set(GRADES) == {"a", "b"}
    assert relevant_set(GRADES, 2.0) == {"a", "b", "c"}


@pytest.mark.parametrize("ranked,k,recall,success,mrr", [
    (["x", "b", "a"], 1, 0.0, 0.0, 0.0),
    (["x", "b", "a"], 2, 0.5, 1.0, 0.5),
    (["x", "b", "a"], 10, 1.0, 1.0, 0.5),
    (["a", "a", "a", "b"], 2, 1.0, 1.0, 1.0),  # duplicates count once: top-2 distinct = a, b
    ([-1, None, "b"], 1, 0.5, 1.0, 1.0),  # padding is skipped
    ([], 10, 0.0, 0.0, 0.0),
])
def test_recall_success_mrr(ranked, k, recall, success, mrr):
    rel = relevant_set(GRADES)
    assert recall_at_k(ranked, rel, k) == pytest.approx(recall)
    assert success_at_k(ranked, rel, k) == success
    assert mrr_at_k(ranked, rel, k) == pytest.approx(mrr)


def test_recall_undefined_without_relevant():
    with pytest.raises(ValueError, match="no relevant"):
        recall_at_k(["a"], set(), 10)
    with pytest.raises(ValueError, match="k must be"):
        success_at_k(["a"], {"a"}, 0)


def test_ndcg_graded_hand_computed():
    # gains = grade - 1: a=2, b=1.67, c=1, d=0; ideal order a, b, c
    idcg = 2 / math.log2(2) + 1.67 / math.log2(3) + 1 / math.log2(4)
    dcg = 0 / math.log2(2) + 1 / math.log2(3) + 2 / math.log2(4)  # ranked d, c, a
    assert ndcg_at_k(["d", "c", "a"], GRADES, 3) == pytest.approx(dcg / idcg)
    assert ndcg_at_k(["a", "b", "c"], GRADES, 3) == pytest.approx(1.0)
    assert ndcg_at_k(["z"], GRADES, 3) == 0.0
    assert ndcg_at_k(["a"], {"a": 1.0}, 3) == 0.0  # no positive gain -> 0, not NaN


def test_ranking_metrics_averages_and_skips():
    qrels = {"q1": {"a": 3.0}, "q2": {"b": 3.0, "c": 3.0}, "q3": {"d": 1.0}}
    ranked = {"q1": ["a"], "q2": ["x", "c"], "q3": []}
    rep = ranking_metrics(ranked, qrels, ks=(1, 10))
    assert rep.num_queries == 2 and rep.num_skipped == 1
    assert rep.metrics["recall@1"] == pytest.approx(0.5)
    assert rep.metrics["recall@10"] == pytest.approx((1.0 + 0.5) / 2)
    assert rep.metrics["mrr@10"] == pytest.approx((1.0 + 0.5) / 2)
    assert rep.metrics["success@10"] == pytest.approx(1.0)
    with pytest.raises(KeyError, match="q2"):
        ranking_metrics({"q1": ["a"]}, qrels)


def test_evaluate_targeting_with_embedding_ranker_exact():
    np = pytest.importorskip("numpy")

    class FakeEncoder:  # query text "i" -> one-hot of ad i (so ad i is the exact nearest)
        def encode(self, texts, **_):
            out = np.zeros((len(texts), 4), np.float32)
            for r, t in enumerate(texts):
                out[r, int(t)] = 1.0
            return out

    emb = np.eye(4, dtype=np.float32)
    qrels = {"0": {10: 3.0}, "1": {11: 3.0}, "2": {10: 3.0}, "3": {13: 2.0}}
    for backend in (SearchBackend.TORCH, SearchBackend.FAISS):
        if backend is SearchBackend.FAISS:
            pytest.importorskip("faiss")
        ranker = EmbeddingRanker(FakeEncoder(), [10, 11, 12, 13], emb, k=2, backend=backend)
        assert ranker(["1"])[0][0] == 11
        out = evaluate_targeting(ranker, qrels, ks=(1, 2), batch_size=2)
        # q0, q1 hit at rank 1; q2 wants ad 10 but its vector is nearest ad 12
        assert out["queries"] == 3.0  # q3 has no relevant ad (grade 2 < 2.67)
        assert out["recall@1"] == pytest.approx(2 / 3)
        assert out["queries_per_s"] > 0


@pytest.mark.parametrize("ours, theirs", [([7, 8], {"7": 3.0}), (["7", "8"], {7: 3.0})], ids=["int-vs-str", "str-vs-int"])
def test_ids_of_another_type_than_the_qrels_are_an_error_not_a_zero(ours, theirs):
    """Issue 43: int ranker ids against str qrels ids scored recall 0.0 without a word."""
    qrels = {"drill": theirs}
    with pytest.raises(ValueError, match=r"ranker's ad ids are (int|str) .* but the qrels' are (int|str)"):
        evaluate_targeting(lambda batch: [ours for _ in batch], qrels)
    with pytest.raises(ValueError, match="no id can match"):
        ranking_metrics({"drill": ours}, qrels)


def test_id_kinds_that_compare_equal_are_accepted():
    """numpy and Python integers compare equal (as dict keys too); -1 / None padding is not an id."""
    import numpy as np

    qrels = {"drill": {7: 3.0}}
    out = evaluate_targeting(lambda batch: [[np.int64(7), -1] for _ in batch], qrels)
    assert out["recall@1"] == 1.0
    assert evaluate_targeting(lambda batch: [[-1] for _ in batch], {"drill": {"a7": 3.0}})["recall@1"] == 0.0


def test_minilm_baseline_checks_id_types_before_embedding(monkeypatch):
    import adbatch.eval.targeting as targeting

    monkeypatch.setattr(targeting, "load_minilm", lambda **k: pytest.fail("embedded before checking the ids"))
    with pytest.raises(ValueError, match="catalogue's ad ids are int"):
        targeting.minilm_faiss_baseline([1, 2], ["a drill", "a saw"], {"drill": {"1": 3.0}})
