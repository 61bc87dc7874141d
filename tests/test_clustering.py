"""Hierarchical k-means: code invariants, determinism, degenerate inputs, and rendering."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from adbatch.index.clustering import (
    ClusterConfig, ClusterMethod, build_codes, build_hierarchy, build_residual, residual_encode, split_labels,
    split_node,
)
from adbatch.config import ConfigError
from adbatch.index.ids import IdScheme, RenderConfig, render_ids
from adbatch.index.trie import Trie


def mixture(n: int, d: int = 16, centers: int = 30, seed: int = 0, spread: float = 0.3):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(centers, d)).astype(np.float32)
    return (mu[rng.integers(0, centers, n)] + spread * rng.normal(size=(n, d))).astype(np.float32)


def check_codes(h, n: int, cfg: ClusterConfig):
    codes = [tuple(c) for c in h.codes()]
    assert len(codes) == n and len(set(codes)) == n  # unique
    # prefix-free: no code is a proper prefix of another
    prefixes = {c[:i] for c in codes for i in range(1, len(c))}
    assert not prefixes & set(codes)
    # leaves: positions 0..size-1, size <= leaf_size; branch indices < branching
    leaves: dict[tuple, list[int]] = {}
    for c in codes:
        leaves.setdefault(c[:-1], []).append(c[-1])
        assert all(0 <= x < cfg.branching for x in c[:-1])
    for pos in leaves.values():
        assert sorted(pos) == list(range(len(pos))) and len(pos) <= cfg.leaf_size
    assert h.num_leaves == len(leaves)
    return codes


@pytest.mark.parametrize("n,k,c", [(1, 10, 100), (100, 10, 100), (101, 10, 100), (3000, 10, 100),
                                   (2000, 4, 30), (500, 2, 7)])
def test_codes_are_unique_prefix_free_and_leaves_small(n, k, c):
    cfg = ClusterConfig(branching=k, leaf_size=c)
    h = build_hierarchy(mixture(n), cfg)
    check_codes(h, n, cfg)
    if n <= c:
        assert h.num_splits == 0 and h.codes() == [[i] for i in range(n)]


def test_deterministic_for_fixed_seed_and_seed_matters():
    x = mixture(4000, seed=1)
    a = build_hierarchy(x, ClusterConfig(seed=3))
    b = build_hierarchy(x.copy(), ClusterConfig(seed=3))
    assert np.array_equal(a.code_flat, b.code_flat) and np.array_equal(a.code_len, b.code_len)
    c = build_hierarchy(x, ClusterConfig(seed=4))
    assert not (np.array_equal(a.code_len, c.code_len) and np.array_equal(a.code_flat, c.code_flat))


def test_clusters_follow_the_mixture():
    # well separated blobs: ads of one blob share their top-level cluster
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(10, 32)).astype(np.float32) * 10
    lab = np.repeat(np.arange(10), 150)
    x = mu[lab] + 0.01 * rng.normal(size=(1500, 32)).astype(np.float32)
    h = build_hierarchy(x, ClusterConfig())
    top = h.padded()[:, 0]
    for j in range(10):
        assert np.unique(top[lab == j]).shape[0] == 1
    assert np.unique(top).shape[0] == 10


def test_identical_embeddings_split_deterministically():
    x = np.ones((1050, 8), dtype=np.float32)
    cfg = ClusterConfig()
    h = build_hierarchy(x, cfg)
    check_codes(h, 1050, cfg)
    assert h.fallback_splits == h.num_splits == 11  # root + 10 chunks of 105
    # fallback = consecutive chunks in row order
    top = h.padded()[:, 0]
    assert np.array_equal(top, np.repeat(np.arange(10), 105))


def test_fewer_ads_than_branching_but_more_than_leaf():
    cfg = ClusterConfig(branching=10, leaf_size=2)
    x = mixture(6, seed=2)
    h = build_hierarchy(x, cfg)
    check_codes(h, 6, cfg)
    labels, _ = split_labels(x, cfg, ())
    assert 2 <= labels.max() + 1 <= 6


def test_one_giant_cluster_terminates():
    # 2000 identical points + 20 outliers: k-means puts the giant mass in one cluster again and
    # again; recursion must still end with leaves <= c
    rng = np.random.default_rng(0)
    x = np.concatenate([np.zeros((2000, 8), np.float32),
                        rng.normal(size=(20, 8)).astype(np.float32) * 5])
    cfg = ClusterConfig(leaf_size=50)
    h = build_hierarchy(x, cfg)
    check_codes(h, 2020, cfg)
    assert h.max_depth <= 6


def test_split_node_keeps_rows_and_embeddings_aligned():
    x = mixture(500, seed=5)
    rows = np.arange(1000, 1500, dtype=np.int64)
    children, embs, fallback = split_node(x, rows, (2, 1), ClusterConfig())
    assert not fallback
    assert sorted(np.concatenate([ch.rows for ch in children]).tolist()) == rows.tolist()
    for j, (ch, e) in enumerate(zip(children, embs)):
        assert ch.path == (2, 1, j)
        assert np.array_equal(e, x[ch.rows - 1000])
        assert (np.diff(ch.rows) > 0).all()


@pytest.mark.parametrize("kwargs", [dict(branching=1), dict(leaf_size=0), dict(niter=0)])
def test_config_validation(kwargs):
    with pytest.raises(ConfigError):
        ClusterConfig(**kwargs)


def test_codes_scheme_tokens_and_trie(default_tokenizer):
    n = 3000
    h = build_hierarchy(mixture(n, seed=7), ClusterConfig())
    r = render_ids(h, [f"ad {i}" for i in range(n)], default_tokenizer,
                   RenderConfig(scheme=IdScheme.CODES))
    base = len(default_tokenizer)
    assert r.base_vocab_size == base and r.eos_token_id is None
    seqs = r.sequences()
    for code, seq, text in zip(h.codes()[:50], seqs[:50], r.texts[:50]):
        assert len(seq) == len(code)
        assert text == "".join(f"<ad_L{lvl}_{i}>" for lvl, i in enumerate(code))
        assert [r.special_tokens[t - base] for t in seq] == [f"<ad_L{lvl}_{i}>"
                                                            for lvl, i in enumerate(code)]
    # adding the special tokens in order gives exactly the ids used
    tok = copy.deepcopy(default_tokenizer)
    tok.add_tokens(r.special_tokens, special_tokens=True)
    ids = tok.convert_tokens_to_ids(r.special_tokens)
    assert ids == list(range(base, base + len(r.special_tokens)))
    trie = Trie.from_flat(r.token_flat, r.token_len)
    assert trie.num_rows == n and int((trie.terminal_ptr[1:] - trie.terminal_ptr[:-1]).max()) == 1
    assert trie.nbytes() / n <= 64  # the codes target


def test_text_scheme_labels_prefixes_and_eos(default_tokenizer):
    # three topics of made-up product titles; every ad's sequence = labels + own text + EOS
    rng = np.random.default_rng(0)
    words = {0: ["drill", "cordless", "battery"], 1: ["paint", "gallon", "primer"],
             2: ["faucet", "chrome", "kitchen"]}
    lab = rng.integers(0, 3, 600)
    texts = [f"{' '.join(rng.choice(words[t], 2))} model {i}" for i, t in enumerate(lab)]
    mu = np.eye(3, 8, dtype=np.float32) * 5
    x = mu[lab] + 0.05 * rng.normal(size=(600, 8)).astype(np.float32)
    h = build_hierarchy(x, ClusterConfig(branching=3, leaf_size=100))
    r = render_ids(h, texts, default_tokenizer, RenderConfig(label_terms=2))
    eos = default_tokenizer.eos_token_id
    seqs = r.sequences()
    assert all(s[-1] == eos and eos not in s[:-1] for s in seqs)
    top_labels = r.clusters.filter(
        np.array([len(p) == 1 for p in r.clusters.column("path").to_pylist()])
    ).column("label").to_pylist()
    assert len(top_labels) == 3 and len(set(top_labels)) == 3
    # each top-level label is made of its topic's words
    for label in top_labels:
        assert any(set(label.split()) <= set(ws) for ws in words.values()), label
    # ads sharing a cluster path share the token prefix of its labels
    padded = h.padded()
    by_top: dict[int, list[list[int]]] = {}
    for i, s in enumerate(seqs):
        by_top.setdefault(int(padded[i, 0]), []).append(s)
    for group in by_top.values():
        first = default_tokenizer(r.texts[seqs.index(group[0])].split(" >")[0] + " >",
                                  add_special_tokens=False)["input_ids"]
        assert all(s[:len(first)] == first for s in group)
    # the trie maps every sequence back to exactly its ads
    trie = Trie.from_flat(r.token_flat, r.token_len)
    for i in range(0, 600, 37):
        node = trie.walk(__import__("torch").tensor([seqs[i]]))
        rows = trie.rows_at(int(node[0])).tolist()
        assert i in rows and all(seqs[j] == seqs[i] for j in rows)
    assert r.texts[0].endswith(default_tokenizer.eos_token)


def _blobs(n, seed=0, d=16):
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).standard_normal((8, d)) * 5
    return (centers[rng.integers(0, 8, n)] + rng.standard_normal((n, d))).astype(np.float32)


def test_update_hierarchy_keeps_codes_and_places_new_ads():
    from adbatch.index.clustering import update_hierarchy

    cfg = ClusterConfig(branching=4, leaf_size=40)
    x = _blobs(600)
    codes = build_hierarchy(x, cfg).codes()
    # identity: the same ads keep everything
    same, st = update_hierarchy(x, codes, cfg)
    assert same.codes() == codes and (st.kept, st.new, st.resplit) == (600, 0, 0)
    # night 2: 60 ads gone, 60 new ones from the same blobs
    new = _blobs(60, seed=1)
    x2 = np.concatenate([x[60:], new])
    prev = codes[60:] + [None] * 60
    h, st = update_hierarchy(x2, prev, cfg)
    got = h.codes()
    assert sum(got[i] == prev[i] for i in range(540)) == st.kept and st.kept + st.resplit == 540
    assert st.new == 60 and st.kept >= 0.8 * 540  # only ads of leaves that overflowed moved
    assert len({tuple(c) for c in got}) == 600  # unique
    leaves = {tuple(c[:-1]) for c in got}
    assert not any(p[:d] in leaves for p in leaves for d in range(len(p)))  # prefix-free
    import collections

    assert max(collections.Counter(tuple(c[:-1]) for c in got).values()) <= 40
    # a new ad joins the top-level cluster of its nearest kept neighbour (its blob)
    kept_x = x2[:540]
    near = [got[int(np.argmin(((kept_x - v) ** 2).sum(1)))][0] for v in new]
    assert np.mean([a == b[0] for a, b in zip(near, got[540:])]) > 0.9


def test_update_hierarchy_resplits_only_overflowing_leaves():
    from adbatch.index.clustering import update_hierarchy

    cfg = ClusterConfig(branching=4, leaf_size=40)
    x = _blobs(300)
    codes = build_hierarchy(x, cfg).codes()
    dup = np.repeat(x[:1], 80, axis=0) + 0.01 * np.random.default_rng(2).standard_normal((80, 16)).astype(np.float32)
    h, st = update_hierarchy(np.concatenate([x, dup]), codes + [None] * 80, cfg)
    got = h.codes()
    assert st.resplit_leaves >= 1 and st.resplit > 0 and st.kept == 300 - st.resplit
    assert len({tuple(c) for c in got}) == 380
    assert sum(got[i] == codes[i] for i in range(300)) == st.kept
    assert all(got[i][:len(codes[0]) - 1] == codes[0][:-1] for i in range(300) if got[i] != codes[i])


def test_update_hierarchy_rejects_inconsistent_codes():
    from adbatch.index.clustering import update_hierarchy

    x = _blobs(4)
    with pytest.raises(ValueError, match="two ads"):
        update_hierarchy(x, [[0, 0], [0, 0], None, None])
    with pytest.raises(ValueError, match="prefix-free"):
        update_hierarchy(x, [[0, 0], [0, 1, 0], None, None])
    with pytest.raises(ValueError, match="one previous code"):
        update_hierarchy(x, [[0, 0]])


# ----------------------------------------------------------------------------- residual k-means (RQ) codes
def rq(**kw) -> ClusterConfig:
    return ClusterConfig(method=ClusterMethod.RESIDUAL, **kw)


def check_rq_codes(h, n: int, cfg: ClusterConfig) -> list[tuple[int, ...]]:
    """Unique, prefix-free; ``rq_levels`` entries within each codebook, + a counter exactly on the ads
    whose level codes collide, numbered 0.. in row order."""
    codes = [tuple(c) for c in h.codes()]
    assert len(set(codes)) == n
    assert not {c[:i] for c in codes for i in range(1, len(c))} & set(codes)
    levels = cfg.rq_levels
    assert len(h.codebooks) == levels
    for c in codes:
        assert len(c) in (levels, levels + 1)
        assert all(0 <= c[lvl] < h.codebooks[lvl].shape[0] for lvl in range(levels))
    groups: dict[tuple, list[int]] = {}
    for row, c in enumerate(codes):
        groups.setdefault(c[:levels], []).append(row)
    for rows in groups.values():
        if len(rows) == 1:
            assert len(codes[rows[0]]) == levels  # no counter without a collision
        else:
            assert [codes[r][levels] for r in rows] == list(range(len(rows)))  # row order
    assert h.collisions == sum(len(r) for r in groups.values() if len(r) > 1)
    assert h.num_leaves == len(groups) and h.num_splits == levels
    # every codebook entry is used (dense indices), and re-encoding the ads gives their codes
    for lvl in range(levels):
        assert {c[lvl] for c in codes} == set(range(h.codebooks[lvl].shape[0]))
    assert residual_encode(mixture(1, seed=5), h.codebooks).shape == (1, levels)
    return codes


@pytest.mark.parametrize("n,levels,k", [(1, 3, 256), (40, 2, 64), (2000, 3, 16), (3000, 2, 256), (500, 4, 4)])
def test_rq_codes_are_unique_prefix_free_and_counted(n, levels, k):
    x = mixture(n)
    cfg = rq(rq_levels=levels, rq_codebook=k)
    h = build_residual(x, cfg)
    codes = check_rq_codes(h, n, cfg)
    assert h.codebooks[0].shape[0] <= min(k, n)
    assert np.array_equal(residual_encode(x, h.codebooks), h.padded()[:, :levels])
    assert build_codes(x, cfg).codes() == [list(c) for c in codes]  # the dispatcher gives the same


def test_rq_deterministic_for_a_seed_and_the_seed_matters():
    x = mixture(3000, seed=2)
    a = build_residual(x, rq(seed=3, rq_codebook=32))
    b = build_residual(x.copy(), rq(seed=3, rq_codebook=32))
    assert np.array_equal(a.code_flat, b.code_flat) and np.array_equal(a.code_len, b.code_len)
    assert all(np.array_equal(p, q) for p, q in zip(a.codebooks, b.codebooks))
    c = build_residual(x, rq(seed=4, rq_codebook=32))
    assert not np.array_equal(a.padded(), c.padded())


def test_rq_levels_refine_the_residual():
    """Level 0 separates well-apart blobs; each further level lowers the reconstruction error."""
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(8, 32)).astype(np.float32) * 10
    lab = np.repeat(np.arange(8), 200)
    x = mu[lab] + rng.normal(size=(1600, 32)).astype(np.float32)
    h = build_residual(x, rq(rq_levels=3, rq_codebook=8))
    top = h.padded()[:, 0]
    assert all(np.unique(top[lab == j]).shape[0] == 1 for j in range(8)) and np.unique(top).shape[0] == 8
    codes = h.padded()
    recon = np.zeros_like(x)
    errors = []
    for lvl, cb in enumerate(h.codebooks):
        recon += cb[codes[:, lvl]]
        errors.append(float(((x - recon) ** 2).sum(1).mean()))
    assert errors[0] > errors[1] > errors[2]


def test_rq_forced_collisions_get_the_counter():
    """Exact duplicates can only be told apart by the counter (in row order); all-identical vectors
    fall back to one centroid per level."""
    base = mixture(300, seed=3)
    x = np.concatenate([base, base[:5], base[:5], base[7:8]])  # rows 0-4 three times, row 7 twice
    cfg = rq(rq_levels=2, rq_codebook=16)
    h = build_residual(x, cfg)
    codes = check_rq_codes(h, 311, cfg)
    for r in range(5):
        assert codes[r][:2] == codes[r + 300][:2] == codes[r + 305][:2]
        assert len(codes[r]) == 3 and codes[r][2] < codes[r + 300][2] < codes[r + 305][2]
    assert codes[7][:2] == codes[310][:2] and codes[7][2] < codes[310][2]
    assert h.collisions >= 17
    same = build_residual(np.ones((12, 8), np.float32), cfg)
    assert same.codes() == [[0, 0, i] for i in range(12)]
    assert same.fallback_splits == 2 and same.collisions == 12


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**62])
def test_rq_codes_are_scale_free_for_huge_or_tiny_vectors(scale):
    x = mixture(300, d=8, seed=6)
    x /= np.abs(x).max()
    cfg = rq(rq_levels=2, rq_codebook=16)
    ref = build_residual(x, cfg)
    with np.errstate(over="raise", invalid="raise"):
        got = build_residual((x * np.float32(scale)).astype(np.float32), cfg)
        assert np.array_equal(residual_encode((x * np.float32(scale)).astype(np.float32), got.codebooks),
                              got.padded()[:, :2])
    assert got.codes() == ref.codes()


@pytest.mark.parametrize("kwargs", [dict(rq_levels=0), dict(rq_codebook=1), dict(method="rq")])
def test_rq_config_validation(kwargs):
    with pytest.raises(ConfigError):
        ClusterConfig(**kwargs)


def test_update_hierarchy_refuses_residual_codes():
    from adbatch.index.clustering import update_hierarchy

    x = mixture(50)
    codes = build_residual(x, rq(rq_codebook=8)).codes()
    with pytest.raises(ConfigError, match="no incremental update"):
        update_hierarchy(x, codes, rq(rq_codebook=8))


def test_rq_codes_render_as_code_tokens_and_walk_the_trie(default_tokenizer):
    n = 600
    h = build_residual(mixture(n, seed=8), rq(rq_levels=2, rq_codebook=16))
    r = render_ids(h, [f"ad {i}" for i in range(n)], default_tokenizer, RenderConfig(scheme=IdScheme.CODES))
    base = len(default_tokenizer)
    widths = [cb.shape[0] for cb in h.codebooks] + [int(h.padded()[:, 2].max()) + 1]
    assert len(r.special_tokens) == sum(widths) and r.eos_token_id is None
    for code, text in zip(h.codes(), r.texts):
        assert text == "".join(f"<ad_L{lvl}_{i}>" for lvl, i in enumerate(code))
    trie = Trie.from_flat(r.token_flat, r.token_len)
    seqs = r.sequences()
    padded = torch.full((n, 3), -1, dtype=torch.int64)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = torch.tensor(s)
    ends = trie.walk(padded)
    assert [trie.rows_at(int(e)).tolist() for e in ends] == [[i] for i in range(n)]
    assert min(r.token_flat) >= base
    # clusters.parquet rows: one per code prefix, with the level's code token
    assert r.clusters.num_rows == len({tuple(c[:d]) for c in h.codes() for d in range(1, len(c))})
