"""The dense channel's decoding pieces: exact teacher-forced scores of given candidates (``score_targets``: a
prefill, then one tree pass) and the planning-ahead prior (best candidate cosine below each trie node)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adbatch.decoding import DenseCandidates, ScoreStats, TargetSearchConfig, score_targets, search_targets
from adbatch.decoding.beam_search import dense_prior
from adbatch.decoding.tree_verify import TrieAux, ancestors
from adbatch.index.trie import Trie
from conftest import make_tiny_llama
from test_decoding_search import EOS as EOS_, _exhaustive, _random_case


@pytest.fixture(scope="module")
def case():
    model = make_tiny_llama(vocab_size=48, seed=3)
    seqs, prompts = _random_case(7, n_seq=50, n_prompts=4, duplicate=True)
    trie = Trie.from_sequences(seqs)
    exact = [_exhaustive(model, p, seqs) for p in prompts]
    return model, seqs, prompts, trie, exact


def _candidates(n_rows: int, Q: int, K: int, seed: int) -> DenseCandidates:
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(n_rows, generator=g)[:K] for _ in range(Q)])
    rows[0, -1] = -1  # a query with fewer candidates than K
    scores = torch.rand(Q, K, generator=g).sort(1, descending=True).values
    return DenseCandidates(rows, torch.where(rows >= 0, scores, float("-inf")))


@pytest.mark.parametrize("length_penalty,pass_tokens", [(0.0, 65536), (1.0, 65536), (0.0, 8)])
def test_union_scoring_equals_a_plain_forward_of_each_candidate(case, length_penalty, pass_tokens, monkeypatch):
    """``pass_tokens`` 8: every query's tree in a pass of its own size (queries ordered by tree size)."""
    import functools

    import adbatch.decoding.beam_search as bs
    from adbatch.decoding.tree_verify import score_candidates

    monkeypatch.setattr(bs, "score_candidates", functools.partial(score_candidates, max_pass_tokens=pass_tokens))
    model, seqs, prompts, trie, exact = case
    dense = _candidates(len(seqs), len(prompts), 9, seed=0)
    dense.rows[2] = -1  # a query with nothing to score is not prefilled
    cfg = TargetSearchConfig(num_beams=3, top_k=3, verify="off", length_penalty=length_penalty)
    stats = ScoreStats()
    got = score_targets(model, prompts, trie, cfg, dense.rows, stats=stats)
    assert got.shape == dense.rows.shape
    assert (stats.queries, stats.queries_scored, stats.rows) == (4, 3, int((dense.rows >= 0).sum()))
    assert 0 < stats.tree_tokens <= stats.tree_tokens_padded and stats.passes >= 1
    for q in range(len(prompts)):
        for k, r in enumerate(dense.rows[q].tolist()):
            if r < 0:
                assert got[q, k] == float("-inf")
                continue
            want = exact[q][r] / (len(seqs[r]) ** length_penalty)
            np.testing.assert_allclose(got[q, k].item(), want, atol=2e-4)


def test_candidate_scores_agree_with_the_beams_own_scores(case):
    """A row both channels return gets one score: the beam's exact score is the teacher-forced one."""
    model, seqs, prompts, trie, _ = case
    off = search_targets(model, prompts, trie, TargetSearchConfig(num_beams=6, top_k=6, verify="off"))
    cfg = TargetSearchConfig(num_beams=6, top_k=6, verify="off")
    got = score_targets(model, prompts, trie, cfg, off.rows)
    ok = off.rows >= 0
    torch.testing.assert_close(got[ok], off.scores[ok], atol=2e-4, rtol=0)
    # batches split by batch_size keep each query's candidates with it
    split = score_targets(model, prompts, trie, cfg, off.rows, batch_size=3)
    torch.testing.assert_close(split, got, atol=2e-4, rtol=0)


def test_ancestors_are_the_root_paths(case):
    _, seqs, _, trie, _ = case
    aux = TrieAux(trie)
    nodes = torch.arange(trie.num_nodes)
    anc = ancestors(aux, nodes)
    for n in range(1, trie.num_nodes):
        path, cur = [], n
        while cur > 0:
            path.append(cur)
            cur = int(trie.parent[cur])
        want = path[::-1] + [-1] * (anc.shape[1] - len(path))
        assert anc[n].tolist() == want


def test_prior_per_node_equals_a_brute_force_max(case):
    _, seqs, _, trie, _ = case
    aux = TrieAux(trie)
    dense = _candidates(len(seqs), 3, 7, seed=1)
    prior = dense_prior(aux, dense, Qb=4)
    nodes = torch.arange(trie.num_nodes)
    got = prior.lookup(nodes[None].expand(4, -1).contiguous())
    for q in range(3):
        valid = [(r, s) for r, s in zip(dense.rows[q].tolist(), dense.scores[q].tolist()) if r >= 0]
        floor = min(s for _, s in valid)
        for n in range(1, trie.num_nodes):
            below = [s for r, s in valid if r in set(trie.rows_below(n).tolist())]
            want = max(below) if below else floor
            assert got[q, n].item() == pytest.approx(want), (q, n)
    assert (got[3] == 0).all(), "padding rows read 0"


def test_prior_steers_the_beam_toward_dense_candidates():
    """Sequences of one length, beams = top_k = K: a strong prior spends every beam on the paths to the K
    best dense candidates, so exactly those finish (plain beam search finds other ads); the scores
    reported stay the exact log-probs."""
    rng = np.random.default_rng(5)
    seqs = sorted({tuple(map(int, rng.integers(3, 9, size=3))) for _ in range(80)})
    seqs = [list(s) + [EOS_] for s in seqs]
    model = make_tiny_llama(vocab_size=48, seed=4)
    trie = Trie.from_sequences(seqs)
    prompts = [[5, 6, 7], [9, 10], [11, 3, 4, 12]]
    exact = [_exhaustive(model, p, seqs) for p in prompts]
    K = 3
    # the K least likely ads get cosine 1, one more 0 (the floor): what beam search alone never returns
    rows = torch.tensor([list(np.argsort(e)[:K + 1]) for e in exact])
    scores = torch.tensor([[1.0] * K + [0.0]] * len(prompts))
    plain = search_targets(model, prompts, trie, TargetSearchConfig(num_beams=K, top_k=K, verify="off"))
    cfg = TargetSearchConfig(num_beams=K, top_k=K, verify="off", prior_weight=1000.0)
    res = search_targets(model, prompts, trie, cfg, dense=DenseCandidates(rows, scores))
    for q in range(len(prompts)):
        assert set(res.rows[q].tolist()) == set(rows[q, :K].tolist())
        assert not set(plain.rows[q].tolist()) & set(rows[q, :K].tolist())
        np.testing.assert_allclose(res.scores[q].numpy(), exact[q][res.rows[q].numpy()], atol=2e-4)


def test_prior_weight_needs_candidates(case):
    model, _, prompts, trie, _ = case
    with pytest.raises(ValueError, match="dense"):
        search_targets(model, prompts, trie, TargetSearchConfig(prior_weight=1.0))


def test_tree_widths_per_octave():
    """Graph-captured passes pad trees to few widths: powers of two (verification), or ``steps`` per octave
    (score passes: <= 1 / steps padding); eager passes run the tree's own width."""
    from adbatch.decoding.engine import DecodeEngine

    class Captured:
        graphs_enabled = True

    tw = lambda fed, steps=1: DecodeEngine.tree_width(Captured(), fed, steps)  # noqa: E731
    assert [tw(f) for f in (1, 4, 5, 9, 129, 300, 520)] == [4, 4, 8, 16, 256, 512, 1024]
    assert [tw(f, 4) for f in (1, 5, 9, 129, 300, 520, 650)] == [4, 5, 10, 160, 320, 640, 768]
    for f in range(5, 2000):
        assert f <= tw(f, 4) <= 1.25 * f + 1
    Captured.graphs_enabled = False
    assert tw(300, 4) == 300
