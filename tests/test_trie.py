"""Trie: layout invariants, batched queries against a brute-force reference, persistence."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adbatch.index.trie import Trie, TrieFormatError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

seq_strategy = st.lists(st.integers(0, 12), min_size=1, max_size=7)
corpus_strategy = st.lists(seq_strategy, min_size=1, max_size=40)


def _prefixes(seqs):
    out = set()
    for s in seqs:
        for i in range(len(s) + 1):
            out.add(tuple(s[:i]))
    return out


def _walk(trie: Trie, seq) -> int:
    node = torch.zeros(1, dtype=torch.int64, device=trie.device)
    for t in seq:
        node = trie.step(node, torch.tensor([t], device=trie.device))
    return int(node[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus_strategy)
def test_every_sequence_walks_to_a_node_listing_its_row(seqs):
    trie = Trie.from_sequences(seqs)
    trie.validate()
    for row, s in enumerate(seqs):
        node = _walk(trie, s)
        assert node > 0
        assert row in trie.rows_at(node).tolist()
        # identical sequences share one terminal listing all of their rows
        assert trie.rows_at(node).tolist() == [i for i, x in enumerate(seqs) if x == s]
    assert trie.num_nodes == len(_prefixes(seqs))
    assert trie.num_rows == len(seqs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus_strategy, st.lists(seq_strategy, min_size=1, max_size=20))
def test_absent_sequence_never_reaches_a_terminal_listing_it(seqs, probes):
    trie = Trie.from_sequences(seqs)
    present = {tuple(s) for s in seqs}
    prefixes = _prefixes(seqs)
    for p in probes:
        node = _walk(trie, p)
        if tuple(p) in present:
            assert trie.rows_at(node).numel() > 0
            continue
        if tuple(p) in prefixes:  # a proper prefix of some sequence: reachable, lists no row
            assert node >= 0 and trie.rows_at(node).numel() == 0
        else:
            assert node == -1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus_strategy, st.data())
def test_suffixes_reproduce_the_remaining_sequences(seqs, data):
    trie = Trie.from_sequences(seqs)
    prefix = tuple(data.draw(st.sampled_from(sorted(_prefixes(seqs)))))
    node = _walk(trie, prefix)
    tree = trie.suffixes(node)
    assert len(tree) == int(trie.subtree_nodes[node]) - 1
    # parents precede children; depth follows the parent chain
    pi = tree.parent_index
    assert (pi < torch.arange(len(tree))).all()
    exp_depth = torch.where(pi >= 0, tree.depth[pi.clamp(min=0)] + 1, torch.ones_like(pi))
    assert torch.equal(tree.depth, exp_depth)
    got = {}
    for suffix, rows in trie.sequences_below(node):
        got[tuple(suffix)] = sorted(rows)
    want: dict[tuple, list[int]] = {}
    for row, s in enumerate(seqs):
        if tuple(s[: len(prefix)]) == prefix:
            want.setdefault(tuple(s[len(prefix):]), []).append(row)
    assert got == want
    assert int(trie.subtree_terminals[node]) == sum(len(v) for v in want.values())
    assert sorted(trie.rows_below(node).tolist()) == sorted(r for v in want.values() for r in v)
    # node ids of the tree walk to the same place as the tokens
    for i in range(len(tree)):
        assert int(trie.token[tree.node_ids[i]]) == int(tree.tokens[i])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus_strategy)
def test_counts_match_brute_force(seqs):
    trie = Trie.from_sequences(seqs)
    prefixes = sorted(_prefixes(seqs))
    for p in prefixes:
        node = _walk(trie, p)
        below = [s for s in seqs if tuple(s[: len(p)]) == p]
        assert int(trie.depth[node]) == len(p)
        assert int(trie.subtree_terminals[node]) == len(below)
        assert int(trie.height[node]) == max(len(s) for s in below) - len(p)
        assert int(trie.subtree_nodes[node]) == sum(
            1 for q in prefixes if q[: len(p)] == p)
        kids = sorted({s[len(p)] for s in below if len(s) > len(p)})
        a, b = int(trie.child_ptr[node]), int(trie.child_ptr[node + 1])
        assert trie.child_tokens[a:b].tolist() == kids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_queries_match_reference(device, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 30, rng.integers(1, 9)).tolist() for _ in range(300)]
    trie = Trie.from_sequences(seqs).to(device)
    nodes = torch.tensor(list(range(trie.num_nodes)) + [-1, -1], device=device)
    V = 32
    mask = trie.allowed_mask(nodes, V)
    tokens, kids = trie.children_padded(nodes)
    assert mask.shape == (nodes.numel(), V) and mask.dtype == torch.bool
    assert tokens.shape == kids.shape and tokens.shape[1] == trie.max_degree
    for b, n in enumerate(nodes.tolist()):
        if n < 0:
            assert not mask[b].any() and (tokens[b] == -1).all() and (kids[b] == -1).all()
            continue
        a, e = int(trie.child_ptr[n]), int(trie.child_ptr[n + 1])
        want = set(trie.child_tokens[a:e].tolist())
        assert set(torch.nonzero(mask[b]).flatten().tolist()) == want
        real = tokens[b][tokens[b] >= 0].tolist()
        assert real == sorted(want)
        assert (tokens[b][len(real):] == -1).all()
    # step for every (node, token) pair at once against the padded children
    B = nodes.numel()
    all_tok = torch.arange(V, device=device).repeat(B)
    all_nodes = nodes.repeat_interleave(V)
    nxt = trie.step(all_nodes, all_tok).view(B, V)
    ref = torch.full((B, V), -1, dtype=torch.int64, device=device)
    valid = tokens >= 0
    ref[torch.nonzero(valid)[:, 0], tokens[valid]] = kids[valid]
    assert torch.equal(nxt, ref)
    assert nxt.dtype == torch.int64


def test_walk_padded_batch():
    seqs = [[5, 1, 2], [5, 1], [7], [5, 3, 3, 3]]
    trie = Trie.from_sequences(seqs, rows=[10, 11, 12, 13])
    padded = torch.tensor([[5, 1, 2, -1], [5, 1, -1, -1], [7, -1, -1, -1], [5, 3, 3, 3],
                           [5, 9, -1, -1]])
    end = trie.walk(padded)
    assert end[-1] == -1
    assert [trie.rows_at(int(n)).tolist() for n in end[:4]] == [[10], [11], [12], [13]]
    assert trie.is_terminal(end).tolist() == [True, True, True, True, False]
    assert trie.vocab_upper_bound == 8


def test_allowed_mask_rejects_small_vocab():
    trie = Trie.from_sequences([[3, 40]])
    with pytest.raises(ValueError, match="vocab_upper_bound"):
        trie.allowed_mask(torch.tensor([0]), 16)


@pytest.mark.parametrize("bad", [[], [[]], [[1, -2]]])
def test_from_sequences_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        Trie.from_sequences(bad)


@pytest.mark.parametrize("mmap", [True, False])
def test_save_load_roundtrip(tmp_path, mmap):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 100, rng.integers(1, 12)).tolist() for _ in range(500)]
    seqs += seqs[:20]  # duplicates -> multi-row terminals
    trie = Trie.from_sequences(seqs)
    path = tmp_path / "trie.safetensors"
    trie.save(path)
    back = Trie.load(path, mmap=mmap)
    for name, arr in trie.arrays().items():
        assert torch.equal(arr, getattr(back, name)), name
    assert back.vocab_upper_bound == trie.vocab_upper_bound
    assert back.max_degree == trie.max_degree
    assert back.nbytes() == trie.nbytes() == 4 * (10 * trie.num_nodes + len(seqs))
    # the loaded trie answers queries identically
    nodes = torch.arange(trie.num_nodes)
    assert torch.equal(back.allowed_mask(nodes, 100), trie.allowed_mask(nodes, 100))


def _rewrite(path, header_fn=None, array_fn=None):
    raw = path.read_bytes()
    (hl,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hl])
    body = bytearray(raw[8 + hl:])
    if header_fn:
        header_fn(header)
    if array_fn:
        array_fn(header, body)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(body))


def _corrupt_token(header, body):
    a, _ = header["child_tokens"]["data_offsets"]
    body[a:a + 4] = struct.pack("<i", 99)  # first root child token out of order


@pytest.mark.parametrize("damage,match", [
    (dict(header_fn=lambda h: h["__metadata__"].update(format="other")), "not an adbatch trie"),
    (dict(header_fn=lambda h: h["__metadata__"].update(num_nodes="3")), "num_nodes"),
    (dict(header_fn=lambda h: h.pop("height")), "height"),
    (dict(array_fn=_corrupt_token), "invalid trie"),
])
def test_load_validates(tmp_path, damage, match):
    trie = Trie.from_sequences([[1, 2], [1, 3], [4], [5, 6, 7]])
    path = tmp_path / "t.safetensors"
    trie.save(path)
    _rewrite(path, **damage)
    with pytest.raises(TrieFormatError, match=match):
        Trie.load(path)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        Trie.load(tmp_path / "nope.safetensors")


def test_from_flat_equals_from_sequences():
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 20, rng.integers(1, 6)).tolist() for _ in range(200)]
    lengths = np.array([len(s) for s in seqs])
    flat = np.concatenate([np.array(s) for s in seqs])
    rows = rng.permutation(200)
    a = Trie.from_sequences(seqs, rows=rows.tolist())
    b = Trie.from_flat(flat, lengths, rows)
    for name, arr in a.arrays().items():
        assert torch.equal(arr, getattr(b, name)), name
