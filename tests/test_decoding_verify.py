"""Tree verification pass and the measured cost model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adbatch.decoding import CostModel, load_or_calibrate
from adbatch.decoding.cost_model import CALIBRATION_VERSION
from adbatch.decoding.engine import engine_for
from adbatch.decoding.tree_verify import TrieAux, verify_trees
from adbatch.index.trie import Trie
from conftest import make_tiny_llama


@pytest.mark.parametrize("n_beams", [1, 3])
def test_tree_pass_matches_full_forward(n_beams):
    """Every candidate's score from one tree pass == a plain full forward of prompt + branch."""
    model = make_tiny_llama(vocab_size=40, seed=2)
    rng = np.random.default_rng(2)
    seqs = [[5] + list(map(int, rng.integers(6, 10, size=rng.integers(1, 5)))) for _ in range(25)]
    trie = Trie.from_sequences(seqs)
    aux = TrieAux(trie)
    prompts = [list(map(int, rng.integers(3, 40, size=n))) for n in (4, 7, 2)][:n_beams]
    engine = engine_for(model)
    engine.prefill(prompts, 1, 8)            # one slot per query: slot row b holds prompt b, t = 0
    node = int(trie.step(torch.tensor([0]), torch.tensor([5]))[0])   # beam at "5", token pending
    nodes = torch.full((n_beams,), node)
    base = torch.zeros(n_beams)
    scores, cand, raw = verify_trees(
        engine, torch.arange(n_beams), 0, nodes, base, aux,
        fed_max=int(aux.fed[node]), sub_max=int(aux.sub[node]), height_max=int(aux.height[node]))
    assert raw.shape == (n_beams, int(aux.sub[node]))
    for b, prompt in enumerate(prompts):
        for s, c in zip(scores[b].tolist(), cand[b].tolist()):
            if c < 0:
                continue
            depth = int(trie.depth[c])
            toks, n = [], c
            while n != 0:
                toks.append(int(trie.token[n]))
                n = int(trie.parent[n])
            toks = toks[::-1]
            assert len(toks) == depth and toks[0] == 5
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + toks])).logits.float(), -1)[0]
            # base score 0 stands for the prefix "5": the tree adds log-probs of tokens after it
            want = float(sum(lp[len(prompt) + j, t] for j, t in enumerate(toks[1:])))
            assert s == pytest.approx(want, abs=1e-4)
        below = torch.arange(node + 1, node + int(trie.subtree_nodes[node]))
        assert sorted(c for c in cand[b].tolist() if c >= 0) == below[trie.is_terminal(below)].tolist()


def test_trie_aux_fed_counts():
    trie = Trie.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5], [6]])
    aux = TrieAux(trie)
    one = int(trie.step(torch.tensor([0]), torch.tensor([1]))[0])
    # node "1": itself + internal "1 2" (leaves 3, 4, 5 are read at their parents)
    assert int(aux.fed[one]) == 2
    assert int(aux.fed[0]) == 3  # root, "1", "1 2"
    assert aux.max_depth == 3 and aux.root_degree == 2


def test_cost_model_interpolation_and_json(tmp_path):
    cm = CostModel([1, 10, 100], [2.0, 3.0, 12.0], [10, 100], [5.0, 50.0], key="k")
    assert float(cm.step_cost(1)) == 2.0
    assert float(cm.step_cost(55)) == pytest.approx(7.5)
    assert float(cm.step_cost(200)) == pytest.approx(22.0)      # linear beyond the last point
    assert float(cm.verify_cost(1000)) == pytest.approx(500.0)
    path = tmp_path / "c.json"
    cm.save(path)
    assert CostModel.load(path) == cm
    assert json.loads(path.read_text())["version"] == CALIBRATION_VERSION
    with pytest.raises(ValueError, match="ascending"):
        CostModel([4, 2], [1.0, 1.0], [1], [1.0])


def test_calibration_measures_and_is_reused(tmp_path, monkeypatch):
    model = make_tiny_llama(vocab_size=64)
    cm = load_or_calibrate(model, cache_dir=tmp_path, rows=(8, 32), tokens=(8, 32), context_len=8, repeats=1)
    assert len(cm.step_ms) == 2 and all(t > 0 for t in cm.step_ms + cm.verify_ms)
    files = list(tmp_path.glob("*.json"))
    assert [f.stem for f in files] == [cm.key]

    def boom(*a, **k):
        raise AssertionError("a saved calibration must be loaded, not measured again")
    monkeypatch.setattr("adbatch.decoding.cost_model.calibrate", boom)
    assert load_or_calibrate(model, cache_dir=tmp_path) == cm
    other = make_tiny_llama(vocab_size=64, layers=3)
    with pytest.raises(AssertionError):
        load_or_calibrate(other, cache_dir=tmp_path)  # another model: another key


def test_calibration_measured_once_when_callers_start_together(tmp_path, monkeypatch):
    """Generation actors starting together on one host share one measurement (file lock per key): the
    first measures, the others wait and load it, so all of them take the same `auto` decisions."""
    import threading
    import time

    from adbatch.decoding import cost_model

    model = make_tiny_llama(vocab_size=64)
    calls = []

    def slow_calibrate(m, **kwargs):
        calls.append(threading.get_ident())
        time.sleep(0.3)  # the others arrive while this one measures
        return CostModel([8, 32], [1.0, 2.0], [8, 32], [0.5, 1.5], key=cost_model.calibration_key(m))

    monkeypatch.setattr(cost_model, "calibrate", slow_calibrate)
    got = [None] * 4

    def call(i):
        got[i] = load_or_calibrate(model, cache_dir=tmp_path)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(g == got[0] for g in got)


def test_tree_pass_after_decoded_suffix_matches_full_forward():
    """A tree hanging below a beam that already decoded suffix tokens (t > 0, reordered rows) sees
    the shared prompt, the beam's own suffix and its ancestors: scores == a plain full forward."""
    model = make_tiny_llama(vocab_size=40, seed=3)
    trie = Trie.from_sequences([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 10], [5, 11]])
    aux = TrieAux(trie)
    prompts = [[3, 4, 12, 13], [20, 21]]
    engine = engine_for(model)
    engine.prefill(prompts, 2, 8)
    # two slots per query; feed "5" (t = 0) then "6" (t = 1) with the slots' parents swapped
    with torch.no_grad():
        engine.step(torch.tensor([5, 5, 5, 5]), 0, 2, torch.tensor([0, 0, 2, 2]))
        engine.step(torch.tensor([6, 6, 6, 6]), 1, 2, torch.tensor([1, 0, 3, 2]))
    node = int(trie.walk(torch.tensor([[5, 6, 7]]))[0])           # beam at "5 6 7", "7" pending
    rows = torch.tensor([1, 2])
    scores, cand, _ = verify_trees(engine, rows, 2, torch.full((2,), node), torch.zeros(2), aux,
                                   fed_max=int(aux.fed[node]), sub_max=int(aux.sub[node]),
                                   height_max=int(aux.height[node]))
    for b, prompt in enumerate([prompts[0], prompts[1]]):
        for s, c in zip(scores[b].tolist(), cand[b].tolist()):
            if c < 0:
                continue
            last = int(trie.token[c])
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + [5, 6, 7, last]])).logits.float(), -1)[0]
            assert s == pytest.approx(float(lp[len(prompt) + 2, last]), abs=1e-4)
