"""Ad codes from embeddings: hierarchical FAISS k-means (DSI-style semantic IDs), or residual k-means.

``ClusterConfig.method`` picks one (:class:`ClusterMethod`); both give a :class:`Hierarchy` (per ad
its code, unique and prefix-free), which the renderer, the trie and the index consume alike.

All ads are clustered into ``branching`` clusters; every cluster holding more than ``leaf_size``
ads is clustered again, recursively. An ad's code is its path of cluster indices followed by its
position inside its leaf, so codes are unique and prefix-free (a node is either split or a leaf).

The unit of work is :func:`split_node`: it sees only the rows of one cluster, so a scheduler can run
each split anywhere (``pipelines/index.py`` runs each as a Ray task) and the result equals the
sequential :func:`build_hierarchy`: every split is seeded from the config seed and the node's path,
never from execution order, and FAISS runs with a fixed thread count.

Degenerate inputs: a cluster with fewer ads than ``branching`` is split into at most that many
clusters; when k-means cannot split (identical embeddings, or one cluster takes every point) the
rows are split deterministically into near-equal consecutive chunks in row order. Finite but huge
(or tiny) embeddings are rescaled by a power of two before k-means (:func:`rescale_exactly`), so
squared distances never overflow float32 and the labels are those of the unscaled vectors.

**Residual k-means** (:func:`build_residual`, RQ-KMeans as in TIGER): level 0 is k-means of the
embeddings, level ``l`` k-means of what is left after subtracting the chosen centroids of levels
``< l``; each level has one codebook of at most ``rq_codebook`` centroids shared by all ads. An ad's
code is its ``rq_levels`` nearest-centroid indices; ads whose codes are equal get one more entry, a
counter in row order (TIGER's disambiguation), so codes are unique and prefix-free (every un-collided
code has exactly ``rq_levels`` entries, so none is a prefix of another). It has no incremental update:
:func:`require_updatable` refuses it (an ad's code would change when a new ad collides with it).

Why one module of ~600 lines: the two methods share the :class:`Hierarchy` they return, the node
bookkeeping (paths, leaf positions, prefix-freeness) and the FAISS k-means wrapper; split, each half
would import most of the other.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import zlib
from collections import deque
from typing import Callable

import numpy as np

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)


class ClusterMethod(str, enum.Enum):
    """How ads' codes are built from their embeddings (see the module docstring)."""

    HIERARCHICAL = "hierarchical"  # recursive k-means: cluster path + position in the leaf
    RESIDUAL = "residual"  # residual k-means: one shared codebook per level (+ a counter on collisions)


@dataclasses.dataclass
class ClusterConfig(ConfigBase):
    """Code-building knobs: ``method``; ``branching`` / ``leaf_size`` (hierarchical), ``rq_levels`` /
    ``rq_codebook`` (residual); k-means itself (``niter``, sampling, seed, threads) for both."""

    method: ClusterMethod = dataclasses.field(
        default=ClusterMethod.HIERARCHICAL,
        metadata={"help": "hierarchical: recursive k-means (cluster path + leaf position); residual: "
                          "residual k-means codes, one codebook per level (render with scheme codes)"})
    branching: int = dataclasses.field(default=10, metadata={"help": "k: clusters per split"})
    leaf_size: int = dataclasses.field(default=100, metadata={"help": "c: max ads per leaf"})
    niter: int = dataclasses.field(default=20, metadata={"help": "k-means iterations per split"})
    max_points_per_centroid: int = dataclasses.field(
        default=256, metadata={"help": "k-means trains on at most k*this sampled points"})
    seed: int = dataclasses.field(default=0, metadata={"help": "base seed (per node: seed+path)"})
    faiss_threads: int = dataclasses.field(
        default=1, metadata={"help": "OpenMP threads per split (fixed so results never depend "
                                     "on the machine; parallelism comes from splitting nodes)"})
    rq_levels: int = dataclasses.field(
        default=3, metadata={"help": "residual: code levels before the collision counter"})
    rq_codebook: int = dataclasses.field(
        default=256, metadata={"help": "residual: centroids per level (unused ones are dropped)"})

    def validate(self) -> None:
        if self.branching < 2:
            raise ConfigError("ClusterConfig.branching: must be >= 2")
        if self.leaf_size < 1:
            raise ConfigError("ClusterConfig.leaf_size: must be >= 1")
        if self.niter < 1:
            raise ConfigError("ClusterConfig.niter: must be >= 1")
        if self.max_points_per_centroid < 1:
            raise ConfigError("ClusterConfig.max_points_per_centroid: must be >= 1")
        if self.faiss_threads < 1:
            raise ConfigError("ClusterConfig.faiss_threads: must be >= 1")
        if self.rq_levels < 1:
            raise ConfigError("ClusterConfig.rq_levels: must be >= 1")
        if self.rq_codebook < 2:
            raise ConfigError("ClusterConfig.rq_codebook: must be >= 2")


@dataclasses.dataclass
class Child:
    """One cluster produced by a split: its path, its rows (global ad rows, ascending)."""

    path: tuple[int, ...]
    rows: np.ndarray  # int64 [n]


@dataclasses.dataclass
class Hierarchy:
    """The result: per ad row its code.

    ``code_flat int32 [sum(code_len)]`` holds the codes back to back in row order; ``code_len
    int32 [N]`` their lengths (hierarchical: cluster depth + 1 for the leaf position; residual:
    ``rq_levels``, + 1 for the counter of a collided code).

    Residual codes also carry ``codebooks``: per level ``float32 [K_l, D]`` (row ``j`` = code ``j``;
    :func:`residual_encode` assigns new vectors with them) and ``collisions``, the ads whose
    ``rq_levels`` codes equal another ad's (they got the counter). There ``num_splits`` counts
    k-means runs (levels), ``num_leaves`` distinct ``rq_levels`` codes, ``fallback_splits`` levels
    whose residuals were all identical (one centroid).
    """

    code_flat: np.ndarray
    code_len: np.ndarray
    num_splits: int
    num_leaves: int
    fallback_splits: int
    collisions: int = 0
    codebooks: list[np.ndarray] | None = None

    @property
    def num_ads(self) -> int:
        return int(self.code_len.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.code_len.max()) if self.num_ads else 0

    def codes(self) -> list[list[int]]:
        offs = np.concatenate([[0], np.cumsum(self.code_len)])
        flat = self.code_flat.tolist()
        return [flat[offs[i]:offs[i + 1]] for i in range(self.num_ads)]

    def padded(self) -> np.ndarray:
        """``int32 [N, max_depth]`` codes right-padded with -1."""
        out = np.full((self.num_ads, self.max_depth), -1, dtype=np.int32)
        out[np.arange(self.max_depth)[None, :] < self.code_len[:, None]] = self.code_flat
        return out


def node_seed(seed: int, path: tuple[int, ...]) -> int:
    """A seed that depends only on the base seed and the node's path."""
    return (seed * 1_000_003 + zlib.crc32(repr(path).encode())) % (2**31 - 1)


def _chunk_labels(n: int, k: int) -> np.ndarray:
    """Rows 0..n-1 into k near-equal consecutive chunks."""
    return (np.arange(n, dtype=np.int64) * k) // n


#: largest |value| an embedding block keeps as is; outside [1/SAFE_MAGNITUDE, SAFE_MAGNITUDE] it is
#: rescaled (see :func:`rescale_exactly`). Squared distances then stay below 4 * D * 2**48, far from
#: float32's 3.4e38 for any embedding width, and far above its smallest normal value.
SAFE_MAGNITUDE = 2.0**24


def _rescale_exponent(x: np.ndarray) -> int:
    """The power of two :func:`rescale_exactly` divides ``x`` by (0: ``x`` is left as is)."""
    top = max(float(x.max(initial=0.0)), -float(x.min(initial=0.0)))  # max |x| without an |x| copy
    if top == 0.0 or 1.0 / SAFE_MAGNITUDE <= top <= SAFE_MAGNITUDE:
        return 0
    if not np.isfinite(top):
        raise ValueError("embeddings hold NaN or infinity (the corpus rejects such rows)")
    _, exp = np.frexp(top)  # top = m * 2**exp with 0.5 <= m < 1 (exp != 0 out of the safe range)
    return int(exp)


def rescale_exactly(x: np.ndarray) -> np.ndarray:
    """``x`` itself when its largest |value| is within ``[1/SAFE_MAGNITUDE, SAFE_MAGNITUDE]`` (or it is
    all zero); else ``x`` times the power of two that brings that value into ``[0.5, 1)``.

    k-means labels are invariant under a uniform scale, and a power-of-two scale changes no rounding
    (up to components negligible beside the largest), so the labels are those of ``x``; but squared
    norms and distances of huge finite vectors (e.g. 16 x 1e19: 1.6e39) no longer overflow float32
    into inf / NaN (``Probabilities contain NaN`` in the seeding, an abort inside FAISS), and tiny
    ones no longer underflow to 0.

    Args:
        x: ``float32 [n, D]``, finite.
    Returns:
        ``float32 [n, D]``.
    """
    exp = _rescale_exponent(x)
    return x if exp == 0 else np.ascontiguousarray(np.ldexp(x, -exp), dtype=np.float32)


def kmeanspp_init(x: np.ndarray, k: int, max_sample: int, seed: int) -> np.ndarray:
    """k-means++ seeding on a sample of at most ``max_sample`` rows.

    FAISS seeds with k random points, which with k equal-sized groups covers all of them with
    probability k!/k^k (0.04% for k=10); D^2 sampling makes one centroid per group likely.

    Args:
        x: ``float32 [n, D]``.
    Returns:
        ``float32 [k, D]``.
    """
    rng = np.random.default_rng(seed)
    n = x.shape[0]
    sample = x[np.sort(rng.choice(n, max_sample, replace=False))] if n > max_sample else x
    sq = np.einsum("ij,ij->i", sample, sample)
    centers = [int(rng.integers(sample.shape[0]))]
    d2 = np.maximum(sq - 2 * sample @ sample[centers[0]] + sq[centers[0]], 0.0)
    for _ in range(1, k):  # k iterations, each vectorized over the sample
        total = float(d2.sum())
        if not np.isfinite(total):
            raise ValueError("kmeanspp_init: squared distances overflow float32; rescale the "
                             "embeddings first (rescale_exactly)")
        nxt = int(rng.choice(sample.shape[0], p=d2 / total)) if total > 0 else \
            int(rng.integers(sample.shape[0]))
        centers.append(nxt)
        d2 = np.minimum(d2, np.maximum(sq - 2 * sample @ sample[nxt] + sq[nxt], 0.0))
    return np.ascontiguousarray(sample[centers], dtype=np.float32)


def kmeans_fit(emb: np.ndarray, k: int, config: ClusterConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS k-means (k-means++ seeded) centroids and assignments.

    Args:
        emb: ``float32 [n, D]``, ``n >= k``.
    Returns:
        (``float32 [k, D]`` centroids, ``int64 [n]`` labels in ``[0, k)``; some clusters may be empty).
    """
    import faiss

    n, d = emb.shape
    x = np.ascontiguousarray(emb, dtype=np.float32)
    init = kmeanspp_init(x, k, config.max_points_per_centroid * k, seed)
    prev_threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(config.faiss_threads)
    try:
        km = faiss.Kmeans(d, k, niter=config.niter, seed=seed, verbose=False,
                          max_points_per_centroid=config.max_points_per_centroid,
                          min_points_per_centroid=1)
        km.train(x, init_centroids=init)
        _, labels = km.index.search(x, 1)
    finally:
        faiss.omp_set_num_threads(prev_threads)
    return np.ascontiguousarray(km.centroids, dtype=np.float32), labels[:, 0].astype(np.int64)


def split_labels(emb: np.ndarray, config: ClusterConfig, path: tuple[int, ...]
                 ) -> tuple[np.ndarray, bool]:
    """Cluster labels for one node's embeddings, compacted to ``0..k'-1`` with ``k' >= 2``.

    Args:
        emb: ``float32 [n, D]`` with ``n > leaf_size`` (and ``n >= 2``).
    Returns:
        (``int64 [n]`` labels, whether the deterministic fallback was used).
    """
    n = emb.shape[0]
    k = min(config.branching, n)
    fallback = False
    emb = rescale_exactly(emb)
    # k-means cannot separate identical points; skip it rather than rely on FAISS's handling.
    if np.ptp(emb, axis=0).max(initial=0.0) == 0.0:
        labels, fallback = _chunk_labels(n, k), True
    else:
        _, labels = kmeans_fit(emb, k, config, node_seed(config.seed, path))
        if np.unique(labels).shape[0] < 2:
            labels, fallback = _chunk_labels(n, k), True
    # Keep FAISS's centroid order but drop empty clusters, so indices stay dense.
    _, labels = np.unique(labels, return_inverse=True)
    return labels.astype(np.int64), fallback


def split_node(emb: np.ndarray, rows: np.ndarray, path: tuple[int, ...], config: ClusterConfig
               ) -> tuple[list[Child], list[np.ndarray], bool]:
    """Split one cluster.

    Args:
        emb: ``float32 [n, D]`` embeddings of exactly this node's rows.
        rows: ``int64 [n]`` their global ad rows (ascending).
        path: the node's cluster path.
    Returns:
        (children in label order, each child's ``float32 [n_j, D]`` embeddings, fallback used).
    """
    labels, fallback = split_labels(emb, config, path)
    order = np.argsort(labels, kind="stable")  # keeps row order inside each child
    bounds = np.searchsorted(labels[order], np.arange(int(labels.max()) + 2))
    children, child_embs = [], []
    for j in range(bounds.shape[0] - 1):
        idx = order[bounds[j]:bounds[j + 1]]
        children.append(Child(path + (j,), rows[idx]))
        child_embs.append(np.ascontiguousarray(emb[idx]))
    return children, child_embs, fallback


class HierarchyBuilder:
    """Collects leaves and splits into a :class:`Hierarchy`; shared by both schedulers."""

    def __init__(self, num_ads: int, config: ClusterConfig) -> None:
        self.num_ads = num_ads
        self.config = config
        self.leaves: list[Child] = []
        self.num_splits = 0
        self.fallback_splits = 0

    def is_leaf(self, n: int) -> bool:
        return n <= self.config.leaf_size

    def add_leaf(self, child: Child) -> None:
        self.leaves.append(child)

    def add_split(self, fallback: bool) -> None:
        self.num_splits += 1
        self.fallback_splits += int(fallback)

    def finish(self) -> Hierarchy:
        n = self.num_ads
        code_len = np.zeros(n, dtype=np.int32)
        covered = np.zeros(n, dtype=bool)
        for leaf in self.leaves:
            code_len[leaf.rows] = len(leaf.path) + 1
            if covered[leaf.rows].any():
                raise AssertionError("a row landed in two leaves")
            covered[leaf.rows] = True
        if not covered.all():
            raise AssertionError(f"{int((~covered).sum())} rows are in no leaf")
        offs = np.concatenate([[0], np.cumsum(code_len, dtype=np.int64)])
        flat = np.zeros(int(offs[-1]), dtype=np.int32)
        for leaf in self.leaves:  # loop over leaves (~N/c), vectorized over their rows
            depth = len(leaf.path)
            start = offs[leaf.rows]
            for lvl, idx in enumerate(leaf.path):
                flat[start + lvl] = idx
            flat[start + depth] = np.arange(leaf.rows.shape[0], dtype=np.int32)
        return Hierarchy(code_flat=flat, code_len=code_len, num_splits=self.num_splits,
                         num_leaves=len(self.leaves), fallback_splits=self.fallback_splits)


def build_hierarchy(emb: np.ndarray, config: ClusterConfig | None = None,
                    on_progress: Callable[[int], None] | None = None) -> Hierarchy:
    """Sequential hierarchical k-means over all rows.

    Args:
        emb: ``float32 [N, D]``.
        on_progress: called with the number of ads that reached a leaf, as they do.
    """
    cfg = config or ClusterConfig()
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] == 0:
        raise ValueError(f"embeddings must be [N>0, D], got {emb.shape}")
    builder = HierarchyBuilder(emb.shape[0], cfg)
    queue: deque[tuple[Child, np.ndarray]] = deque(
        [(Child((), np.arange(emb.shape[0], dtype=np.int64)), emb)])
    while queue:
        node, node_emb = queue.popleft()
        if builder.is_leaf(node.rows.shape[0]):
            builder.add_leaf(node)
            if on_progress:
                on_progress(int(node.rows.shape[0]))
            continue
        children, child_embs, fallback = split_node(node_emb, node.rows, node.path, cfg)
        builder.add_split(fallback)
        queue.extend(zip(children, child_embs))
    return builder.finish()


#: rows per block of the nearest-centroid search (bounds the [rows, K] distance matrix)
_ENCODE_BLOCK = 65_536


def _nearest(r: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """``int64 [n]``: the nearest row of ``codebook float32 [K, D]`` (L2; ties: the lower index) to
    each row of ``r float32 [n, D]``."""
    c_sq = np.einsum("ij,ij->i", codebook, codebook)
    out = np.empty(r.shape[0], dtype=np.int64)
    for a in range(0, r.shape[0], _ENCODE_BLOCK):  # ||r||^2 is the same for every centroid: left out
        out[a:a + _ENCODE_BLOCK] = np.argmin(c_sq[None, :] - 2.0 * (r[a:a + _ENCODE_BLOCK] @ codebook.T), axis=1)
    return out


def residual_encode(x: np.ndarray, codebooks: list[np.ndarray]) -> np.ndarray:
    """Greedy residual codes of ``x`` (ads or queries) under :attr:`Hierarchy.codebooks`: level ``l``'s
    code is the nearest centroid of ``codebooks[l]`` to ``x`` minus the centroids chosen at levels ``< l``.
    For the ads a :func:`build_residual` was built from this gives exactly their first ``rq_levels``
    code entries.

    ``x`` and the codebooks are scaled by the power of two :func:`rescale_exactly` picks for ``x``
    (exact), so huge or tiny finite vectors cannot overflow the float32 distances.

    Args:
        x: ``float32 [n, D]``.
        codebooks: per level ``float32 [K_l, D]``.
    Returns:
        ``int64 [n, len(codebooks)]``.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    exp = _rescale_exponent(x)
    r = np.ldexp(x, -exp).astype(np.float32) if exp else x.copy()
    out = np.empty((x.shape[0], len(codebooks)), dtype=np.int64)
    for lvl, cb in enumerate(codebooks):
        cb = np.ldexp(cb, -exp).astype(np.float32) if exp else cb
        out[:, lvl] = _nearest(r, cb)
        r -= cb[out[:, lvl]]
    return out


def build_residual(emb: np.ndarray, config: ClusterConfig | None = None) -> Hierarchy:
    """Residual k-means codes over all rows (module docstring), with the collision counter.

    Per level: FAISS k-means (:func:`kmeans_fit`: k-means++ seeded from ``seed`` and the level, fixed
    threads) of the current residuals into ``min(rq_codebook, N)`` centroids; every ad takes its
    nearest centroid (:func:`_nearest`, the same search :func:`residual_encode` uses for a query);
    duplicate centroids and those no ad took are dropped (indices stay dense, in FAISS's order).
    Residuals that are all identical (e.g. every embedding equal) get one centroid, that value, and
    count as a fallback.
    ``faiss.ResidualQuantizer`` is not used: its codebook training has its own random seeding (no
    k-means++) and beam-searched assignments, so it would not share this module's seeding, threads,
    rescaling and degenerate-input handling with the hierarchical path.

    Args:
        emb: ``float32 [N, D]``.
    """
    cfg = config or ClusterConfig()
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] == 0:
        raise ValueError(f"embeddings must be [N>0, D], got {emb.shape}")
    n = emb.shape[0]
    exp = _rescale_exponent(emb)  # work at a safe scale; codebooks are returned at the input's
    r = np.ldexp(emb, -exp).astype(np.float32) if exp else emb.copy()  # [N, D] residuals
    codes = np.empty((n, cfg.rq_levels), dtype=np.int64)
    codebooks: list[np.ndarray] = []
    fallback = 0
    for lvl in range(cfg.rq_levels):
        if np.ptp(r, axis=0).max(initial=0.0) == 0.0:  # nothing left to separate
            cb = r[:1].copy()
            fallback += 1
        else:
            lexp = _rescale_exponent(r)  # residuals shrink level by level: k-means on a normal scale
            cb, _ = kmeans_fit(np.ldexp(r, -lexp).astype(np.float32) if lexp else r,
                               min(cfg.rq_codebook, n), cfg, node_seed(cfg.seed, (lvl,)))
            cb = np.ldexp(cb, lexp).astype(np.float32) if lexp else cb
            # k-means puts several centroids on one point when k nears the distinct points; equal
            # vectors would then take either one by rounding of the distance products: keep the first
            _, first = np.unique(cb, axis=0, return_index=True)
            cb = cb[np.sort(first)]
        labels = _nearest(r, cb)
        used, labels = np.unique(labels, return_inverse=True)
        cb = np.ascontiguousarray(cb[used])
        codes[:, lvl] = labels
        r -= cb[labels]
        codebooks.append(np.ldexp(cb, exp).astype(np.float32) if exp else cb)
    # the counter: ads sharing all rq_levels codes are numbered in row order
    _, group, count = np.unique(codes, axis=0, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    collided = count[group] > 1
    order = np.argsort(group, kind="stable")
    first = np.searchsorted(group[order], np.arange(count.shape[0]))
    counter = np.empty(n, dtype=np.int64)
    counter[order] = np.arange(n) - first[group[order]]
    code_len = (cfg.rq_levels + collided).astype(np.int32)
    full = np.concatenate([codes, counter[:, None]], axis=1)
    code_flat = full[np.arange(cfg.rq_levels + 1)[None, :] < code_len[:, None]].astype(np.int32)
    return Hierarchy(code_flat=code_flat, code_len=code_len, num_splits=cfg.rq_levels,
                     num_leaves=int(count.shape[0]), fallback_splits=fallback,
                     collisions=int(collided.sum()), codebooks=codebooks)


def build_codes(emb: np.ndarray, config: ClusterConfig | None = None,
                on_progress: Callable[[int], None] | None = None) -> Hierarchy:
    """Every ad's code under ``config.method``: :func:`build_hierarchy` or :func:`build_residual`.

    Args:
        emb: ``float32 [N, D]``.
        on_progress: called with the number of ads that got their code, as they do.
    """
    cfg = config or ClusterConfig()
    if cfg.method is ClusterMethod.HIERARCHICAL:
        return build_hierarchy(emb, cfg, on_progress)
    hierarchy = build_residual(emb, cfg)
    if on_progress:
        on_progress(hierarchy.num_ads)
    return hierarchy


def require_updatable(config: ClusterConfig) -> None:
    """Raise :class:`ConfigError` unless :func:`update_hierarchy` can keep earlier codes under
    ``config``: only the hierarchical method can. Residual codes would not stay stable: a new ad equal
    to a kept ad's ``rq_levels`` codes forces a counter onto that ad's code, and codebooks retrained
    on today's ads move every assignment."""
    if config.method is not ClusterMethod.HIERARCHICAL:
        raise ConfigError(
            f"ClusterConfig.method {config.method.value!r}: no incremental update (stable ids) for residual "
            "codes; build without an earlier index (no --previous; nightly refresh: index.stable_ids false) "
            "or use method 'hierarchical'")


@dataclasses.dataclass
class UpdateStats:
    """What :func:`update_hierarchy` kept and changed (row counts)."""

    kept: int  # ads whose code is unchanged
    new: int  # ads with no previous code, placed under the nearest existing cluster
    resplit: int  # previously coded ads whose leaf overflowed and was split again (new codes)
    resplit_leaves: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _check_prefix_free(paths: set[tuple[int, ...]]) -> None:
    for path in paths:
        for d in range(len(path)):
            if path[:d] in paths:
                raise ValueError(f"previous codes are not prefix-free: leaf {path[:d]} is also a cluster of {path}")


def update_hierarchy(emb: np.ndarray, previous: list[list[int] | None], config: ClusterConfig | None = None
                     ) -> tuple[Hierarchy, UpdateStats]:
    """Today's hierarchy from yesterday's: ads that keep a previous code keep it exactly.

    A nightly catalogue changes only partly; re-clustering it from scratch moves almost every ad
    (measured on 5,000 Home Depot titles with 10 % replaced: 1.9 % of the unchanged ads kept their
    ``text`` sequence), so a model trained last night must relearn the whole index. Here:

    - ads with a previous code (``previous[i]`` = cluster path + leaf position) keep it;
    - every other ad descends from the root to the nearest child cluster at each level (L2 to the
      mean embedding of the child's kept ads, today's embeddings) until it reaches a leaf, where it
      takes the smallest position no ad in that leaf uses;
    - a leaf that now holds more than ``leaf_size`` ads is clustered again below its path (hierarchical
      k-means on its ads alone), so only its ads get new codes;
    - clusters whose ads all left disappear; sibling indices are never renumbered.

    Args:
        emb: ``float32 [N, D]`` embeddings of today's ads (same space as the previous build's).
        previous: ``N`` codes or None, as stored in the previous index's ``code`` column.
    Returns:
        (hierarchy, what was kept / placed / re-split). With no previous code at all this is
        :func:`build_hierarchy`.
    """
    cfg = config or ClusterConfig()
    require_updatable(cfg)
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    n = emb.shape[0]
    if emb.ndim != 2 or n == 0 or len(previous) != n:
        raise ValueError(f"embeddings must be [N>0, D] with one previous code (or None) per row, got "
                         f"{emb.shape} and {len(previous)} codes")
    emb = rescale_exactly(emb)  # the descent's float32 distances below
    kept_rows = [i for i, c in enumerate(previous) if c]
    if not kept_rows:
        return build_hierarchy(emb, cfg), UpdateStats(0, n, 0, 0)
    leaves: dict[tuple[int, ...], dict[int, int]] = {}  # leaf path -> {position: row}
    for i in kept_rows:
        code = tuple(int(v) for v in previous[i])
        slot = leaves.setdefault(code[:-1], {})
        if code[-1] in slot:
            raise ValueError(f"previous code {list(code)} is given to two ads (rows {slot[code[-1]]} and {i})")
        slot[code[-1]] = i
    _check_prefix_free(set(leaves))
    # children (with kept ads) of every cluster node, and their centroids from today's embeddings
    sums: dict[tuple[int, ...], np.ndarray] = {}
    counts: dict[tuple[int, ...], int] = {}
    children: dict[tuple[int, ...], set[int]] = {}
    for path, slot in leaves.items():
        rows = np.fromiter(slot.values(), dtype=np.int64)
        total = emb[rows].sum(axis=0, dtype=np.float64)
        for d in range(1, len(path) + 1):
            key = path[:d]
            sums[key] = sums.get(key, 0.0) + total
            counts[key] = counts.get(key, 0) + rows.shape[0]
            children.setdefault(path[:d - 1], set()).add(path[d - 1])
    # descend the new ads level by level, one distance matrix per cluster node
    new_rows = np.array([i for i, c in enumerate(previous) if not c], dtype=np.int64)
    frontier: dict[tuple[int, ...], np.ndarray] = {(): new_rows} if new_rows.size else {}
    placed: dict[tuple[int, ...], list[int]] = {}
    while frontier:
        nxt: dict[tuple[int, ...], np.ndarray] = {}
        for node, rows in frontier.items():
            if node in leaves or node not in children:  # a leaf (a root leaf when everything fit in one)
                placed.setdefault(node, []).extend(rows.tolist())
                continue
            kids = sorted(children[node])
            cent = np.stack([sums[node + (j,)] / counts[node + (j,)] for j in kids]).astype(np.float32)
            x = emb[rows]
            d2 = (x * x).sum(1)[:, None] - 2.0 * x @ cent.T + (cent * cent).sum(1)[None, :]
            pick = np.argmin(d2, axis=1)
            for k_idx, j in enumerate(kids):  # a child has one parent: each key is written once
                sel = rows[pick == k_idx]
                if sel.size:
                    nxt[node + (j,)] = sel
        frontier = nxt
    for path, rows in placed.items():
        slot = leaves.setdefault(path, {})
        free = (p for p in range(len(slot) + len(rows)) if p not in slot)
        for row in rows:
            slot[next(free)] = row
    # overflowing leaves: split again from their path (their ads get new codes)
    code_of: dict[int, tuple[int, ...]] = {}
    resplit = resplit_leaves = fallback_splits = 0
    for path, slot in leaves.items():
        if len(slot) > cfg.leaf_size:
            rows = np.array(sorted(slot.values()), dtype=np.int64)
            resplit += int(sum(1 for r in rows.tolist() if previous[r]))
            resplit_leaves += 1
            sub = build_hierarchy(emb[rows], cfg)
            fallback_splits += sub.fallback_splits
            for local, code in enumerate(sub.codes()):
                code_of[int(rows[local])] = path + tuple(code)
            continue
        for pos, row in slot.items():
            code_of[row] = path + (pos,)
    code_len = np.fromiter((len(code_of[i]) for i in range(n)), dtype=np.int32, count=n)
    code_flat = np.fromiter((v for i in range(n) for v in code_of[i]), dtype=np.int32, count=int(code_len.sum()))
    num_leaves = len({code_of[i][:-1] for i in range(n)})
    num_splits = len({code_of[i][:d] for i in range(n) for d in range(len(code_of[i]) - 1)})
    hierarchy = Hierarchy(code_flat=code_flat, code_len=code_len, num_splits=num_splits, num_leaves=num_leaves,
                          fallback_splits=fallback_splits)
    # a kept ad's code changes only when its leaf is re-split
    return hierarchy, UpdateStats(kept=len(kept_rows) - resplit, new=int(new_rows.size), resplit=resplit,
                                  resplit_leaves=resplit_leaves)
