"""Pseudo-queries and validation-based model selection / early stopping (tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch

from adbatch.config import ConfigError
from adbatch.training import SparsityScheduleConfig, TrainConfig, train_on_index
from adbatch.training.data import ExampleKind, build_examples
from adbatch.training.pseudo_queries import PseudoQueryConfig, span_pseudo_queries, title_words
from adbatch.training.trainer import train_loop
from adbatch.training.quant_aware import QuantAwareConfig
from tests.test_training import QUERIES, TITLES, fake_index, tiny

#: the selection rules without QAT (the default turns it on for the last 20 % of the steps, and only evaluations
#: after it started compete: tests/test_training_qat.py)
NO_QAT = QuantAwareConfig(enabled=False)


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def test_title_words_keep_sizes_whole():
    assert title_words("Simpson 2x4 Joist-Hanger, 3/4 in. x 1.5 ft.") == [
        "simpson", "2x4", "joist-hanger", "3/4", "in", "x", "1.5", "ft"]
    assert title_words("  ,, ") == []


def test_span_pseudo_queries_are_distinct_spans_and_deterministic():
    cfg = PseudoQueryConfig(per_ad=4, min_words=1, max_words=3, subset_share=0.0, typo_rate=0.0, seed=7)
    pairs = span_pseudo_queries(TITLES + ["", "Drill"], cfg)
    assert pairs == span_pseudo_queries(TITLES + ["", "Drill"], cfg)  # same seed, same spans
    by_row: dict[int, list[str]] = {}
    for q, r in pairs:
        by_row.setdefault(r, []).append(q)
    assert 8 not in by_row  # an empty text yields nothing
    assert by_row[9] == ["drill"]  # one word: one distinct span only
    for r, qs in by_row.items():
        words = title_words((TITLES + ["", "Drill"])[r])
        assert len(qs) == len(set(qs)) <= 4
        for q in qs:
            w = q.split()
            assert 1 <= len(w) <= 3
            # contiguous span of the title's words
            assert any(words[i:i + len(w)] == w for i in range(len(words) - len(w) + 1)), (q, words)
    assert all(len(by_row[r]) == 4 for r in range(8))
    # a row's spans depend on (seed, row) only, not on the other texts
    alone = span_pseudo_queries([TITLES[0]], cfg)
    assert [q for q, _ in alone] == by_row[0]
    other = span_pseudo_queries(TITLES, cfg.replace(seed=8))
    assert other != pairs[: len(other)]
    assert span_pseudo_queries(TITLES, PseudoQueryConfig(per_ad=0)) == []
    assert PseudoQueryConfig().per_ad == 24  # on by default
    with pytest.raises(ConfigError):
        PseudoQueryConfig(min_words=3, max_words=2).validate()


def _is_ordered_subset(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(w in it for w in small)


def _one_edit(a: str, b: str) -> bool:
    """b is a with one deletion, one doubled letter or one swap of neighbours."""
    if len(b) == len(a) - 1:
        return any(a[:j] + a[j + 1:] == b for j in range(len(a)))
    if len(b) == len(a) + 1:
        return any(b[:j] + b[j + 1:] == a and b[j] == b[j - 1] for j in range(1, len(b)))
    return len(a) == len(b) and any(a[:j] + a[j + 1] + a[j] + a[j + 2:] == b for j in range(len(a) - 1))


def test_pseudo_query_subsets_and_typos():
    titles = TITLES + ["BEHR Premium 1 gal. Deck Stain Cedar Naturaltone"]
    cfg = PseudoQueryConfig(per_ad=6, max_words=4, subset_share=1.0, typo_rate=1.0, seed=3)
    pairs = span_pseudo_queries(titles, cfg)
    assert pairs == span_pseudo_queries(titles, cfg)
    edited = 0
    for q, r in pairs:
        words, got = title_words(titles[r]), q.split()
        diff = [i for i, w in enumerate(got) if w not in words]
        assert len(diff) <= 1, (q, words)  # at most one word carries a typo
        if diff:
            edited += 1
            typo = got[diff[0]]
            assert any(_one_edit(w, typo) for w in words if len(w) >= 4 and w.isalpha()), (typo, words)
            got = [w for w in got if w != typo]
        assert _is_ordered_subset(got, words), (q, words)  # title words, in title order
    assert edited >= len(pairs) // 2  # titles with a 4+ letter word always get their edit
    # non-contiguous picks do occur
    assert any(not any(title_words(titles[r])[i:i + len(q.split())] == q.split() for i in range(20))
               for q, r in span_pseudo_queries(titles, cfg.replace(typo_rate=0.0)))
    with pytest.raises(ConfigError):
        PseudoQueryConfig(typo_rate=1.5).validate()


def test_build_examples_adds_pseudo_queries(tok):
    idx = fake_index(tok, "text")
    targets = idx.ad_codes.column("token_ids").to_pylist()
    ex, stats = build_examples(tok, idx.ad_ids, targets, dict(zip(idx.ad_ids, TITLES)), QUERIES and
                               [(q, 100 + r) for q, r in QUERIES],
                               pseudo_queries=PseudoQueryConfig(per_ad=3, max_words=2))
    kinds = ex.kinds.tolist()
    assert stats["pseudo_query"] == kinds.count(int(ExampleKind.PSEUDO_QUERY)) == 24
    assert stats["indexing"] == 8 and stats["retrieval"] == 4 and len(ex) == 36
    for e in range(len(ex)):  # every example's target is its row's sequence
        tgt = ex.tokens[ex.offsets[e] + ex.prompt_lens[e]:ex.offsets[e + 1]].tolist()
        assert tgt == targets[int(ex.rows[e])]


def _examples(tok):
    idx = fake_index(tok, "text")
    ex, _ = build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                           dict(zip(idx.ad_ids, TITLES)), [(q, 100 + r) for q, r in QUERIES])
    return ex


def test_best_validation_weights_are_restored(tok):
    ex = _examples(tok)
    model = tiny(tok)
    scripted = iter([0.1, 0.9, 0.3, 0.2, 0.5, 0.4, 0.1, 0.0])
    seen: list[dict[str, torch.Tensor]] = []

    def evaluate(m):
        assert not m.training  # evaluated in eval mode
        seen.append({k: v.detach().clone() for k, v in m.state_dict().items()})
        return next(scripted)

    cfg = TrainConfig(epochs=4, lr=5e-3, batch_tokens=256, log_every=1, eval_every=1.0, qat=NO_QAT)
    stats, _ = train_loop(model, ex, cfg, pad_id=tok.pad_token_id, evaluate=evaluate, progress=False)
    assert model.training is False
    assert len(stats.evals) == 4 and [m for _, _, m in stats.evals] == [0.1, 0.9, 0.3, 0.2]
    assert stats.best["metric"] == 0.9 and stats.best["step"] == stats.evals[1][0]
    final = model.state_dict()
    for k, v in seen[1].items():  # the weights of the 2nd evaluation, not the last step's
        assert torch.equal(final[k], v), k
    assert not all(torch.equal(final[k], v) for k, v in seen[-1].items())
    assert stats.summary(model, torch.device("cpu"))["best"]["metric"] == 0.9


def test_early_stopping_after_patience(tok):
    ex = _examples(tok)
    scripted = iter([0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])
    cfg = TrainConfig(epochs=10, lr=5e-3, batch_tokens=256, eval_every=1.0, early_stop_patience=2, qat=NO_QAT)
    stats, _ = train_loop(tiny(tok), ex, cfg, pad_id=tok.pad_token_id, evaluate=lambda m: next(scripted),
                          progress=False)
    assert [m for _, _, m in stats.evals] == [0.5, 0.4, 0.3] and stats.stopped_early
    assert stats.best["metric"] == 0.5


def test_selection_with_sparsity_only_counts_frozen_masks(tok):
    ex = _examples(tok)
    metrics = iter([0.99, 0.98, 0.1, 0.2, 0.15, 0.1])  # the early (dense) peaks must not win
    sp = SparsityScheduleConfig(enabled=True, final_n=2, one_four_fraction=0.0, start_fraction=0.1,
                                end_fraction=0.4, rescore_every=1)
    cfg = TrainConfig(epochs=6, lr=3e-3, batch_tokens=256, eval_every=1.0, sparsity=sp, qat=NO_QAT)
    model = tiny(tok)
    stats, sparsity = train_loop(model, ex, cfg, pad_id=tok.pad_token_id, evaluate=lambda m: next(metrics),
                                 progress=False)
    assert sparsity.frozen and stats.best["metric"] == 0.2
    for name, mask in sparsity.masks.items():  # restored weights are still exactly N:M
        w = dict(model.named_modules())[name].weight
        assert torch.all(w[~mask.bool()] == 0), name


def test_train_on_index_with_validation_qrels(tok, tmp_path):
    """The real path: validation qrels -> generative recall@10 over the index's trie each epoch."""
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index, load_index
    from adbatch.index.ids import IdScheme, RenderConfig
    from tests.test_training import _tiny_corpus

    ads, _, titles = _tiny_corpus(tmp_path)
    icfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                       cluster=ClusterConfig(branching=2, leaf_size=6), render=RenderConfig(scheme=IdScheme.TEXT))
    build_index(ads, tmp_path / "index", icfg, progress=False)
    index = load_index(tmp_path / "index")
    cfg = TrainConfig(epochs=2, lr=5e-3, batch_tokens=2048, eval_every=1.0, valid_max_queries=2, qat=NO_QAT,
                      pseudo_queries=PseudoQueryConfig(per_ad=2))
    _, _, summary = train_on_index(index, None, cfg, ad_texts=dict(zip(range(1000, 1024), titles)),
                                   labelled=[("angle bracket", 1000)], model=tiny(tok), tokenizer=tok,
                                   device="cpu", progress=False,
                                   valid_qrels={"deck over": {1001: 3.0}, "microwave": {1003: 3.0},
                                                "never evaluated": {1004: 3.0}})
    assert summary.data["pseudo_query"] == 48
    evals = summary.train["evals"]
    assert len(evals) == 2 and all(0.0 <= m <= 1.0 for _, _, m in evals)
    assert summary.train["best"]["metric"] == max(m for _, _, m in evals)


@pytest.mark.parametrize("bad", [{"valid_metric": "recall@5"}, {"valid_metric": "recal@10"},
                                 {"valid_max_queries": 0}, {"valid_max_queries": -1}])
def test_validation_settings_refused_before_training(bad):
    """A validation metric evaluate_targeting does not report, or a query cap that evaluates no (or all
    but the last) query, is refused when the config is built, not by a KeyError at the first
    evaluation after an epoch of training."""
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match=next(iter(bad))):
        TrainConfig(eval_every=1.0, **bad)
    TrainConfig(eval_every=1.0, valid_metric="ndcg@10", valid_max_queries=1)  # valid ones still pass
