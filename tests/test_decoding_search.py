"""Trie-constrained beam search with prefix-tree verification: exactness, modes, HF parity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adbatch.decoding import CostModel, TargetSearchConfig, VerifyMode, search_targets
from adbatch.decoding.beam_search import _choose_verified
from adbatch.index.trie import Trie
from conftest import make_tiny_llama

EOS = 2
#: a cost model under which auto verifies small trees (step 10 ms flat, verify 1 ms + 0.01 ms/token)
CHEAP_VERIFY = CostModel([1, 1024], [10.0, 10.0], [1, 4096], [1.0, 42.0])


def _random_case(seed: int, n_seq: int = 60, vocab: int = 48, alphabet: int = 8, max_len: int = 6,
                 n_prompts: int = 3, duplicate: bool = False):
    rng = np.random.default_rng(seed)
    seqs = [list(map(int, rng.integers(3, 3 + alphabet, size=rng.integers(1, max_len)))) + [EOS]
            for _ in range(n_seq)]
    if duplicate:
        seqs.append(list(seqs[0]))  # identical sequence -> two rows at one terminal node
    prompts = [list(map(int, rng.integers(3, vocab, size=rng.integers(2, 8)))) for _ in range(n_prompts)]
    return seqs, prompts


def _exhaustive(model, prompt: list[int], seqs: list[list[int]]) -> np.ndarray:
    """Log-prob of every sequence after ``prompt`` from one plain full forward each."""
    out = np.empty(len(seqs))
    with torch.no_grad():
        for i, s in enumerate(seqs):
            lp = torch.log_softmax(model(torch.tensor([prompt + s])).logits.float(), -1)[0]
            p = len(prompt)
            out[i] = float(sum(lp[p - 1 + j, t] for j, t in enumerate(s)))
    return out


@pytest.fixture(scope="module")
def case():
    model = make_tiny_llama(vocab_size=48, seed=0)
    seqs, prompts = _random_case(0, duplicate=True)
    trie = Trie.from_sequences(seqs)
    exact = [_exhaustive(model, p, seqs) for p in prompts]
    return model, seqs, prompts, trie, exact


@pytest.mark.parametrize("mode", list(VerifyMode))
@pytest.mark.parametrize("beams,top_k", [(2, 2), (4, 6), (8, 3)])
def test_rows_valid_unique_and_scores_exact(case, mode, beams, top_k):
    model, seqs, prompts, trie, exact = case
    cfg = TargetSearchConfig(num_beams=beams, top_k=top_k, verify=mode, max_tree_tokens=16,
                             max_tokens_per_pass=32)
    res = search_targets(model, prompts, trie, cfg, CHEAP_VERIFY)
    assert res.rows.shape == (len(prompts), top_k) and res.scores.shape == (len(prompts), top_k)
    for q in range(len(prompts)):
        rows = [r for r in res.rows[q].tolist() if r >= 0]
        assert rows, "every query gets results"
        assert all(0 <= r < len(seqs) for r in rows)
        assert len(rows) == len(set(rows)), "ads are unique per query"
        scores = res.scores[q, : len(rows)].numpy()
        np.testing.assert_allclose(scores, exact[q][rows], atol=2e-4)
        assert (np.diff(scores) <= 1e-6).all(), "best first"


@pytest.mark.parametrize("mode", list(VerifyMode))
def test_enough_beams_equals_exhaustive(case, mode):
    model, seqs, prompts, trie, exact = case
    cfg = TargetSearchConfig(num_beams=len(seqs) + 1, top_k=10, verify=mode)
    res = search_targets(model, prompts, trie, cfg, CHEAP_VERIFY)
    for q in range(len(prompts)):
        best = np.sort(exact[q])[::-1][:10]
        np.testing.assert_allclose(res.scores[q].numpy(), best, atol=2e-4)
        # the duplicated sequence (rows 0 and the last) shares one node: both or neither returned
        got = set(res.rows[q].tolist())
        if 0 in got and len(seqs) - 1 not in got:
            assert res.rows[q, -1].item() == 0, "a node's rows are only split by the k cut"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("beams", [2, 3, 5])
def test_verification_never_worse_than_off(seed, beams):
    model = make_tiny_llama(vocab_size=40, seed=seed)
    seqs, prompts = _random_case(100 + seed, n_seq=120, vocab=40, alphabet=6, max_len=7, n_prompts=4)
    trie = Trie.from_sequences(seqs)
    off = search_targets(model, prompts, trie, TargetSearchConfig(num_beams=beams, top_k=beams, verify="off"))
    verified = 0
    for mode, cap in ((VerifyMode.ALWAYS, 4), (VerifyMode.ALWAYS, 30), (VerifyMode.AUTO, 30)):
        cfg = TargetSearchConfig(num_beams=beams, top_k=beams, verify=mode, max_tree_tokens=cap,
                                 max_tokens_per_pass=max(cap, 12))
        res = search_targets(model, prompts, trie, cfg, CHEAP_VERIFY)
        verified += res.stats.beams_verified
        # Verified beams keep their places as virtual beams, so every off result is matched or beaten.
        assert (res.scores >= off.scores - 1e-4).all()
    assert verified > 0


def test_same_topk_as_hf_constrained_beam_search():
    model = make_tiny_llama(vocab_size=64, seed=1)
    rng = np.random.default_rng(1)
    seqs = sorted({tuple(map(int, rng.integers(3, 10, size=rng.integers(2, 7)))) + (EOS,) for _ in range(80)})
    trie = Trie.from_sequences([list(s) for s in seqs])
    prompts = [list(map(int, rng.integers(3, 64, size=6))) for _ in range(3)]
    beams = 4
    ours = search_targets(model, prompts, trie, TargetSearchConfig(num_beams=beams, top_k=beams, verify="off"))

    for q, prompt in enumerate(prompts):
        def allowed(batch_id, input_ids, _p=len(prompt)):
            gen = tuple(input_ids[_p:].tolist())
            nxt = {s[len(gen)] for s in seqs if s[: len(gen)] == gen and len(s) > len(gen)}
            return sorted(nxt) or [EOS]

        # length_penalty=0: HF's finished score is the plain sum (ours); early_stopping=False with
        # length_penalty=0 stops exactly when the best running beam cannot beat the worst finished.
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=beams, num_return_sequences=beams, prefix_allowed_tokens_fn=allowed,
                             max_new_tokens=trie.max_depth, length_penalty=0.0, early_stopping=False,
                             do_sample=False, eos_token_id=EOS, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        hf_rows = []
        for s in out.sequences[:, len(prompt):].tolist():
            hf_rows.append(seqs.index(tuple(s[: s.index(EOS) + 1])))
        assert ours.rows[q].tolist() == hf_rows
        np.testing.assert_allclose(ours.scores[q].numpy(), out.sequences_scores.numpy(), atol=1e-4)


@pytest.mark.parametrize("mode", [VerifyMode.OFF, VerifyMode.AUTO])
def test_a_batch_answers_each_query_as_alone(mode):
    """Queries of uneven depth in one batch (padding query rows, rows dropped to a smaller bucket as their
    queries finish) get exactly the rows and scores each gets searched alone: the batch's results are written
    back to the right query."""
    model = make_tiny_llama(vocab_size=48, seed=1)
    rng = np.random.default_rng(3)
    seqs = [list(map(int, rng.integers(3, 11, size=int(rng.integers(1, 6))))) + [EOS] for _ in range(120)]
    trie = Trie.from_sequences(seqs)
    prompts = [list(map(int, rng.integers(3, 48, size=int(rng.integers(2, 9))))) for _ in range(7)]
    cfg = TargetSearchConfig(num_beams=3, top_k=4, verify=mode)
    batch = search_targets(model, prompts, trie, cfg, CHEAP_VERIFY)
    if mode is VerifyMode.OFF:
        assert batch.stats.compactions > 0  # (auto verifies these shallow trees at once: no step, no compaction)
    for q, p in enumerate(prompts):
        alone = search_targets(model, [p], trie, cfg, CHEAP_VERIFY)
        assert batch.rows[q].tolist() == alone.rows[0].tolist()
        torch.testing.assert_close(batch.scores[q], alone.scores[0], atol=2e-5, rtol=0)


def test_length_penalty_applied_to_returned_scores(case):
    model, seqs, prompts, trie, exact = case
    lengths = np.array([len(s) for s in seqs], dtype=float)
    for mode in (VerifyMode.OFF, VerifyMode.ALWAYS):
        cfg = TargetSearchConfig(num_beams=len(seqs) + 1, top_k=5, verify=mode, length_penalty=1.0)
        res = search_targets(model, prompts, trie, cfg, CHEAP_VERIFY)
        for q in range(len(prompts)):
            rows = res.rows[q].tolist()
            np.testing.assert_allclose(res.scores[q].numpy(), exact[q][rows] / lengths[rows], atol=2e-4)
            np.testing.assert_allclose(res.scores[q].numpy(), np.sort(exact[q] / lengths)[::-1][:5], atol=2e-4)


def test_codes_scheme_terminal_with_children_and_stats():
    """No EOS: a code may be a prefix of another (terminal node with children), and leaves end."""
    model = make_tiny_llama(vocab_size=48, seed=3)
    rng = np.random.default_rng(3)
    seqs = [list(map(int, rng.integers(10, 14, size=rng.integers(1, 5)))) for _ in range(40)]
    trie = Trie.from_sequences(seqs)
    prompts = [[5, 6, 7], [9, 8]]
    exact = [_exhaustive(model, p, seqs) for p in prompts]
    for mode in VerifyMode:
        res = search_targets(model, prompts, trie, TargetSearchConfig(num_beams=64, top_k=8, verify=mode),
                             CHEAP_VERIFY)
        for q in range(2):
            np.testing.assert_allclose(res.scores[q].numpy(), np.sort(exact[q])[::-1][:8], atol=2e-4)
        assert res.stats.mode == mode.value
        if mode is VerifyMode.ALWAYS:
            assert res.stats.beams_verified > 0 and res.stats.verify_passes > 0
            assert sum(res.stats.verified_depths.values()) == res.stats.beams_verified
        if mode is VerifyMode.OFF:
            assert res.stats.beams_verified == 0


def test_trigger_rule():
    cfg_auto = TargetSearchConfig(verify="auto", max_tree_tokens=50, max_tokens_per_pass=100)
    pending = np.array([True, True, True, False])
    fed = np.array([10, 40, 60, 5])
    height = np.array([3, 3, 3, 3])
    # steps expensive, verification cheap: the two that fit the per-beam cap, within the pass cap
    cheap = CostModel([1, 100], [50.0, 50.0], [1, 1000], [1.0, 2.0])
    assert _choose_verified(pending, fed, height, cfg_auto, cheap).tolist() == [True, True, False, False]
    # verification far dearer than the steps it retires: none
    dear = CostModel([1, 100], [1.0, 1.0], [1, 1000], [100.0, 1000.0])
    assert not _choose_verified(pending, fed, height, cfg_auto, dear).any()
    # always ignores costs but keeps the caps; off never verifies
    always = cfg_auto.replace(verify=VerifyMode.ALWAYS)
    assert _choose_verified(pending, fed, height, always, None).tolist() == [True, True, False, False]
    assert not _choose_verified(pending, fed, height, cfg_auto.replace(verify=VerifyMode.OFF), None).any()


def test_rejects_trie_beyond_vocab():
    model = make_tiny_llama(vocab_size=32)
    trie = Trie.from_sequences([[3, 40]])
    with pytest.raises(ValueError, match="vocabulary"):
        search_targets(model, [[1, 2]], trie, TargetSearchConfig(verify="off"))


def test_config_validation():
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match="num_beams"):
        TargetSearchConfig(num_beams=0)
    with pytest.raises(ConfigError, match="max_tokens_per_pass"):
        TargetSearchConfig(max_tree_tokens=100, max_tokens_per_pass=10)
    cfg = TargetSearchConfig(verify="always", top_k=3)
    assert TargetSearchConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("mode", list(VerifyMode))
def test_fewer_beams_than_top_k_still_returns_top_k(mode):
    """Default config (num_beams=8 < top_k=10) on a codes-like trie (every id 3 tokens, 64 ads):
    every mode returns top_k distinct ads, not just num_beams of them."""
    import itertools

    model = make_tiny_llama(vocab_size=40, seed=0)
    seqs = [list(s) for s in itertools.product(range(10, 14), range(20, 24), range(30, 34))]
    trie = Trie.from_sequences(seqs)
    cfg = TargetSearchConfig(verify=mode)
    assert cfg.num_beams < cfg.top_k
    res = search_targets(model, [[5, 6, 7], [9, 8, 7, 6], [3]], trie, cfg, CHEAP_VERIFY)
    for q in range(3):
        rows = res.rows[q].tolist()
        assert -1 not in rows and len(set(rows)) == cfg.top_k


def test_no_prompts_gives_an_empty_result():
    model = make_tiny_llama(vocab_size=40, seed=0)
    trie = Trie.from_sequences([[10, 20], [11, 21]])
    for mode in VerifyMode:
        res = search_targets(model, [], trie, TargetSearchConfig(verify=mode, top_k=3))
        assert res.rows.shape == (0, 3) and res.scores.shape == (0, 3) and res.stats.queries == 0


def test_prepared_trie_is_made_once_per_trie_and_device(case):
    """Captured selection graphs read the trie's device arrays by address: one copy per trie."""
    from adbatch.decoding.beam_search import _prepared_trie

    _, _, _, trie, _ = case
    a = _prepared_trie(trie, torch.device("cpu"))
    b = _prepared_trie(trie, torch.device("cpu"))
    assert a[0] is trie and b[0] is trie and a[1] is b[1]  # already on the device: not copied; one TrieAux
    import gc
    import weakref

    t2 = Trie.from_sequences([[3, 4, 2], [5, 2]])
    _prepared_trie(t2, torch.device("cpu"))
    ref = weakref.ref(t2)
    del t2
    gc.collect()
    assert ref() is None  # the cache does not keep a trie alive


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", [VerifyMode.OFF, VerifyMode.AUTO])
def test_captured_selection_equals_eager_on_cuda(monkeypatch, mode):
    """The graph-replayed per-step selection gives the eager selection's rows and scores exactly."""
    import adbatch.decoding.beam_search as bs
    from adbatch.decoding.engine import engine_for

    model = make_tiny_llama(vocab_size=48, seed=0).cuda().eval()
    seqs, prompts = _random_case(1, n_seq=200, max_len=9, n_prompts=40)
    trie = Trie.from_sequences(seqs)
    cfg = TargetSearchConfig(num_beams=4, top_k=6, verify=mode)
    captured = [search_targets(model, prompts, trie, cfg, CHEAP_VERIFY, batch_size=8) for _ in range(3)]  # keys replayed
    monkeypatch.setattr(bs, "CAPTURE_MAX_WIDTH", 0)  # every step's selection eager
    eager = search_targets(model, prompts, trie, cfg, CHEAP_VERIFY, batch_size=8)
    for res in captured:
        assert torch.equal(res.rows, eager.rows)
        assert torch.equal(res.scores, eager.scores)
    if mode is VerifyMode.OFF:  # (auto verifies early here: slots turn virtual, later steps are eager)
        assert any(k[0] == "captured" for k in engine_for(model)._graphs)


def _POW2_TREES(fed: int) -> int:  # as a graphed engine pads a pass's trees
    return max(4, 1 << max(fed - 1, 0).bit_length())


def test_trigger_rule_graphed_ends_the_search_or_nothing():
    """Graph-replayed steps run every slot row of the bucket: a pass pays only when it ends the
    search (every pending beam verified), priced against steps at the bucket's rows."""
    cfg = TargetSearchConfig(verify="auto", max_tree_tokens=50, max_tokens_per_pass=1000)
    B = 2
    pending = np.ones(8, dtype=bool)
    height = np.full(8, 10)
    flat = CostModel([1, 100], [2.0, 2.0], [1, 1000], [1.0, 5.0])
    # the eager rule takes the smallest trees alone; here a beam left pending keeps every step: none
    fed = np.array([5, 5, 6, 6, 40, 40, 60, 60])      # query 3's trees exceed the per-beam cap
    assert _choose_verified(pending, fed, height, cfg, CostModel([1, 100], [50.0, 50.0], [1, 1000], [1.0, 2.0])).any()
    assert not _choose_verified(pending, fed, height, cfg, flat, B, tree_width=_POW2_TREES).any()
    # every beam fits and the pass (8 x 8 tokens) costs less than 10 steps: all of it ends now
    fed_ok = np.array([5, 5, 6, 6, 7, 7, 8, 8])
    assert _choose_verified(pending, fed_ok, height, cfg, flat, B, tree_width=_POW2_TREES).all()
    # a pass dearer than the steps left, or over the per-pass cap: nothing
    dear = CostModel([1, 100], [2.0, 2.0], [1, 1000], [25.0, 30.0])
    assert not _choose_verified(pending, fed_ok, height, cfg, dear, B, tree_width=_POW2_TREES).any()
    assert not _choose_verified(pending, fed_ok, height, cfg.replace(max_tree_tokens=8, max_tokens_per_pass=32), flat, B,
                                tree_width=_POW2_TREES).any()
    # steps priced at the bucket's rows, not the pending ones: 1 pending beam of 4 queries' bucket
    pend1 = np.zeros(8, dtype=bool)
    pend1[0] = True
    rowcost = CostModel([1, 8], [1.0, 8.0], [1, 1000], [25.0, 30.0])
    assert not _choose_verified(pend1, fed_ok, height, cfg, rowcost, B, tree_width=_POW2_TREES).any()  # 1 query: 2 rows
    pend4 = np.zeros(8, dtype=bool)
    pend4[[0, 2, 4, 6]] = True                       # one beam of each query: the bucket of 4 (8 rows)
    assert _choose_verified(pend4, fed_ok, height, cfg, rowcost, B, tree_width=_POW2_TREES).tolist() == pend4.tolist()
    # the pass is priced at its padded width: trees of 9 tokens run as 16 (8 x 16 = 128 tokens, not 72)
    fed9 = np.full(8, 9)
    lin = CostModel([1, 100], [2.0, 2.0], [0, 1000], [0.0, 200.0])   # 0.2 ms per pass token
    assert 0.2 * 72 < 10 * 2.0 < 0.2 * 128
    assert not _choose_verified(pending, fed9, height, cfg, lin, B, tree_width=_POW2_TREES).any()
    assert _choose_verified(pending, fed9, height, cfg, lin, B, tree_width=lambda f: f).all()
