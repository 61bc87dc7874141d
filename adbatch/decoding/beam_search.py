"""Trie-constrained batched beam search with prefix-tree parallel verification.

Scoring rule (identical in every verify mode): a candidate's raw score is the sum of the exact
log-probs of its target tokens, each a ``log_softmax`` over the FULL vocabulary (the trie only
masks which tokens may be chosen, it never renormalizes). Its final score is
``raw / len ** length_penalty`` (``len`` = target tokens; 0 = the plain sum, the default).
Running beams are ranked by raw score, finished candidates by final score, as in HF beam search.

Per step and query (mirrors HF ``generate(num_beams=B, early_stopping=False, length_penalty=0)``):
expand every running beam by its trie children; a terminal child ranked among the query's top
``B`` candidates enters the finished pool (its ``P = B`` best trie nodes kept); the top
``B`` candidates that have children become the next running beams. With the plain sum, scores only
decrease along a path, so a running beam scoring at or below the pool's worst cannot improve it and
is dropped: a query ends when its pool is full and no beam can enter, or when no beam runs.

Verification (``VerifyMode``): a newly chosen beam may instead be finished in one tree pass
(:mod:`adbatch.decoding.tree_verify`): every candidate below it enters the pool with its exact score,
competing with running beams' candidates on equal terms. The GPU->CPU sync happens once per step
(beam liveness, node sizes and parents in one small tensor), which the trigger and the cache
bookkeeping need.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

from adbatch.decoding.config import TargetSearchConfig, VerifyMode
from adbatch.decoding.cost_model import CostModel, load_or_calibrate
from adbatch.decoding.engine import (DecodeEngine, bucket_queries, check_supported, exact_logprobs_of,
                                     model_device, pad_token_id, serving_engine)
from adbatch.decoding.tree_verify import TrieAux, ancestors, final_scores, score_candidates, verify_trees

log = logging.getLogger(__name__)

NEG_INF = float("-inf")
#: candidate widths up to this are selected by a replayed graph on CUDA; wider steps (a wide trie
#: level) run eagerly: their [rows, width] work outweighs the launches, and a captured graph would
#: keep its [rows, width] temporaries in its memory pool
CAPTURE_MAX_WIDTH = 256

_PREPARED: "weakref.WeakKeyDictionary[Any, dict[str, tuple[Any | None, TrieAux]]]" = weakref.WeakKeyDictionary()


def _prepared_trie(trie: Any, dev: torch.device) -> tuple[Any, TrieAux]:
    """The trie on ``dev`` and its :class:`TrieAux`, made once per (trie, device) and kept while
    the trie lives: captured selection graphs read their arrays by address, and the copy + derived
    arrays of a full-catalogue trie (943k nodes) would otherwise be rebuilt on every call."""
    per_trie = _PREPARED.setdefault(trie, {})
    hit = per_trie.get(str(dev))
    if hit is None:
        moved = trie if trie.device == dev else trie.to(dev)
        # the trie itself is not stored as a value: the weak key would never be released
        hit = per_trie[str(dev)] = (None if moved is trie else moved, TrieAux(moved))
    return (trie if hit[0] is None else hit[0]), hit[1]


@dataclasses.dataclass
class TargetSearchResult:
    """Per query the best ``k`` ad rows.

    ``rows``: ``Long[Q, k]`` index rows (-1 padding), best first; rows sharing one target sequence
    (one terminal trie node) are consecutive, in ascending row order, with equal scores.
    ``scores``: ``Float32[Q, k]`` final scores (-inf on padding). ``stats``: counters (see docs).
    """

    rows: torch.Tensor
    scores: torch.Tensor
    stats: "SearchStats"


@dataclasses.dataclass
class DenseCandidates:
    """A dense retriever's answer: per query its top-``K`` index rows by cosine, ``rows Long[Q, K]``
    (-1 = none) and ``scores Float32[Q, K]`` (cosine, descending). With ``TargetSearchConfig.prior_weight
    > 0``, :func:`search_targets` steers its beams by them (:func:`dense_prior`); their exact generative
    scores come from :func:`score_targets`."""

    rows: torch.Tensor
    scores: torch.Tensor

    def slice(self, start: int, stop: int) -> "DenseCandidates":
        return DenseCandidates(self.rows[start:stop], self.scores[start:stop])


@dataclasses.dataclass
class DensePrior:
    """PAG's planning-ahead prior per query row of a batch: the best cosine among the query's dense
    candidates below each trie node. ``keys Long[Qb, M]``: nodes on the candidates' root paths,
    ascending, padded with ``num_nodes``; ``values Float32[Qb, M]`` their best candidate cosine;
    ``floor Float32[Qb]``: the value of every other node (the K-th candidate's cosine, an upper bound on
    any ad outside the top K)."""

    keys: torch.Tensor
    values: torch.Tensor
    floor: torch.Tensor

    def lookup(self, nodes: torch.Tensor) -> torch.Tensor:
        """``Float32[Qb, X]`` prior of ``nodes Long[Qb, X]`` (any node id; -1 reads the floor)."""
        idx = torch.searchsorted(self.keys, nodes.contiguous()).clamp(max=self.keys.shape[1] - 1)
        hit = self.keys.gather(1, idx) == nodes
        return torch.where(hit, self.values.gather(1, idx), self.floor[:, None])

    def select(self, src: torch.Tensor) -> "DensePrior":
        return DensePrior(self.keys[src], self.values[src], self.floor[src])


def dense_prior(aux: TrieAux, dense: DenseCandidates, Qb: int) -> DensePrior:
    """:class:`DensePrior` of ``dense`` (``Q <= Qb`` queries; rows ``Q..Qb-1`` padding: floor 0).

    Every candidate lends its cosine to each node on its root path; a node keeps the best (a stable
    sort by node after one by score puts each node's best first; duplicates are dropped)."""
    dev = dense.rows.device
    Q, K = dense.rows.shape
    N = aux.degree.shape[0]
    nodes = torch.where(dense.rows >= 0, aux.node_of_row[dense.rows.clamp(min=0)], -1)
    anc = ancestors(aux, nodes)                                            # [Q, K, D]
    D = anc.shape[-1]
    score = torch.where(dense.rows >= 0, dense.scores.float(), NEG_INF)[:, :, None].expand(Q, K, D).reshape(Q, -1)
    key = torch.where(anc >= 0, anc, N).reshape(Q, -1)
    order = score.sort(dim=1, descending=True, stable=True).indices
    key, score = key.gather(1, order), score.gather(1, order)
    order = key.sort(dim=1, stable=True).indices
    key, score = key.gather(1, order), score.gather(1, order)
    dup = torch.zeros_like(key, dtype=torch.bool)
    dup[:, 1:] = key[:, 1:] == key[:, :-1]
    key = torch.where(dup, N, key)
    order = key.sort(dim=1, stable=True).indices
    key, score = key.gather(1, order), score.gather(1, order)
    score = torch.where(key < N, score, 0.0)
    valid_k = (dense.rows >= 0).sum(1).clamp(min=1) - 1
    floor = torch.where((dense.rows >= 0).any(1), dense.scores.float().gather(1, valid_k[:, None])[:, 0], 0.0)
    pad = Qb - Q
    if pad:
        key = torch.cat([key, torch.full((pad, key.shape[1]), N, dtype=torch.long, device=dev)])
        score = torch.cat([score, torch.zeros(pad, score.shape[1], device=dev)])
        floor = torch.cat([floor, torch.zeros(pad, device=dev)])
    return DensePrior(key.contiguous(), score.contiguous(), floor.contiguous())


@dataclasses.dataclass
class SearchStats:
    """Counters of one :func:`search_targets` call (docs/decoding.md); :meth:`flat` for manifests and logs.

    ``mode``: the verify mode searched. ``steps``: decode forwards; ``decode_rows``: real beam rows they
    advanced, ``rows_computed``: rows computed (padding of graph-replayed buckets included). ``verify_*``,
    ``beams_verified``, ``tree_tokens_*``, ``verified_depths`` ({depth: beams}): prefix-tree verification.
    ``width_*``: running beams per step. ``compactions``: batch compactions after queries finished.
    ``phase_ms``: wall ms per phase when ``TargetSearchConfig.profile`` (synchronizing), else empty.
    """

    mode: str
    queries: int = 0
    prefill_rows: int = 0
    steps: int = 0
    decode_rows: int = 0
    rows_computed: int = 0
    verify_passes: int = 0
    beams_verified: int = 0
    verify_tokens: int = 0
    tree_tokens_sum: int = 0
    tree_tokens_max: int = 0
    width_max: int = 0
    width_sum: int = 0
    compactions: int = 0
    verified_depths: Counter = dataclasses.field(default_factory=Counter)
    phase_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def tree_tokens_mean(self) -> float | None:
        return self.tree_tokens_sum / self.beams_verified if self.beams_verified else None

    def flat(self) -> dict[str, Any]:
        """One level of JSON-ready values: the counters, ``verified_depths`` with int keys in depth order,
        ``tree_tokens_mean`` once a beam was verified, and ``ms_<phase>`` per profiled phase."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("verified_depths", "phase_ms")}
        out["verified_depths"] = {int(k): int(v) for k, v in sorted(self.verified_depths.items())}
        if self.beams_verified:
            out["tree_tokens_mean"] = self.tree_tokens_mean
        out.update({f"ms_{k}": v for k, v in self.phase_ms.items()})
        return out


def _merge_pool(pool_s: torch.Tensor, pool_n: torch.Tensor, new_s: torch.Tensor,
                new_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the best ``P`` of pool ``[Q, P]`` + new ``[Q, M]`` finished nodes (scores desc)."""
    s = torch.cat([pool_s, new_s], 1)
    n = torch.cat([pool_n, new_n], 1)
    top_s, idx = s.topk(pool_s.shape[1], dim=1)
    return top_s, n.gather(1, idx)


def _rows_from_pool(pool_s: torch.Tensor, pool_n: torch.Tensor, aux: TrieAux, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand pool nodes ``[Q, P]`` to their ad rows, truncated to ``k`` per query."""
    Q, P = pool_n.shape
    safe = pool_n.clamp(min=0)
    cnt = torch.where(pool_n >= 0, aux.terminal_ptr[safe + 1] - aux.terminal_ptr[safe], 0)
    cum = cnt.cumsum(1)                                                   # [Q, P]
    j = torch.arange(k, device=pool_n.device)[None].expand(Q, k).contiguous()
    which = torch.searchsorted(cum, j, right=True)                        # [Q, k]
    valid = which < P
    which = which.clamp(max=P - 1)
    node = safe.gather(1, which)
    offset = j - (cum - cnt).gather(1, which)
    rows = aux.terminal_rows[(aux.terminal_ptr[node] + offset).clamp(max=aux.terminal_rows.numel() - 1)]
    rows = torch.where(valid, rows, -1)
    scores = torch.where(valid, pool_s.gather(1, which), NEG_INF)
    return rows, scores


class _PhaseClock:
    """Accumulates wall time per phase into ``stats.phase_ms[<phase>]`` when profiling (syncs the
    device at each mark, so off by default)."""

    def __init__(self, stats: SearchStats, device: torch.device, on: bool) -> None:
        self.stats, self.device, self.on = stats, device, on
        self.t = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.on:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats.phase_ms[phase] = self.stats.phase_ms.get(phase, 0.0) + 1e3 * (now - self.t)
        self.t = now


def _choose_verified(pending: np.ndarray, fed: np.ndarray, height: np.ndarray,
                     cfg: TargetSearchConfig, cost: CostModel | None, beams: int = 1,
                     tree_width: Callable[[int], int] | None = None) -> np.ndarray:
    """Host-side trigger over the step's new real beams (flat slot arrays, ``beams`` slots per
    query). Returns a Bool mask.

    ``pending``: beams that would be decoded next step; ``fed``: tree tokens a verification of each
    would feed; ``height``: decode steps each still needs. Trees in one pass are right-padded to
    the largest, so a pass of ``n`` beams costs ``verify_ms(n * largest fed)``.

    ``always``: every beam that fits the caps (smallest trees first). ``auto``: (1) when every
    pending beam fits and one pass over all of them costs less than the rest of the search
    (``max height`` steps), verify all: the search ends now; (2) otherwise take the smallest trees
    first, as many as keep the pass cheaper than the decode work they retire, each beam charged its
    share of a step (``height x step_ms(rows) / rows``). What a pass and a step cost depends on how
    steps run:

    - eager steps (``tree_width=None``, CPU) compute only the pending rows, and a pass feeds each
      tree as it is;
    - graph-replayed steps (``tree_width``: the engine's) run every slot row of the query bucket, and
      a captured pass pads each tree to ``tree_width`` of the largest. A verified beam then saves
      nothing while its query still has a beam to decode, so only (1) applies. A pass retiring enough
      whole queries for a smaller bucket could pay too, but the steps after a pass run their selection
      eagerly (the verified beams' scores grow its inputs), which this cost model does not price:
      taken, such passes made ``auto`` 0.88-0.91x ``off`` on the default model (H200, 64-2,048
      queries, bench/decode.py).
    """
    out = np.zeros_like(pending)
    if cfg.verify is VerifyMode.OFF or not pending.any():
        return out
    fits = pending & (fed <= cfg.max_tree_tokens)
    idx = np.flatnonzero(fits)
    if idx.size == 0:
        return out
    idx = idx[np.argsort(fed[idx], kind="stable")]
    padded = np.arange(1, idx.size + 1) * fed[idx]             # pass tokens of the first j beams
    within = padded <= cfg.max_tokens_per_pass
    if cfg.verify is VerifyMode.ALWAYS:
        out[idx[within]] = True
        return out
    assert cost is not None, "verify=auto needs a cost model"
    rows = int(pending.sum())
    if tree_width is None:
        all_tokens, step = int(padded[-1]), float(cost.step_cost(rows))
    else:
        live = int(pending.reshape(-1, beams).any(1).sum())
        all_tokens = idx.size * tree_width(int(fed[idx[-1]]))
        step = float(cost.step_cost(bucket_queries(live) * beams))
    if (idx.size == rows and all_tokens <= cfg.max_tokens_per_pass
            and float(cost.verify_cost(all_tokens)) < height[idx].max() * step):
        out[idx] = True
        return out
    if tree_width is not None:
        return out
    saved = np.cumsum(height[idx]) * (step / rows)
    ok = within & (cost.verify_cost(padded) < saved)
    if ok.any():
        out[idx[: int(np.flatnonzero(ok)[-1]) + 1]] = True
    return out


def _trie_arrays(trie: Any, aux: TrieAux) -> tuple[torch.Tensor, ...]:
    """The trie tensors :func:`_expand_beams` reads (a captured graph reads them by address)."""
    return (trie.child_ptr, trie.child_tokens, trie.child_ids, aux.degree, aux.is_terminal, aux.depth,
            aux.fed, aux.height, aux.sub)


def _expand_beams(*, trie: Any, aux: TrieAux, logits: torch.Tensor, lse: torch.Tensor, B: int, C: int,
                  length_penalty: float, s_node: torch.Tensor, s_score: torch.Tensor, pool_s: torch.Tensor,
                  pool_n: torch.Tensor, logit_row: torch.Tensor, s_virtual: torch.Tensor,
                  s_vbase: torch.Tensor, vraw: torch.Tensor | None = None, prior_keys: torch.Tensor | None = None,
                  prior_values: torch.Tensor | None = None, prior_floor: torch.Tensor | None = None,
                  prior_weight: float = 0.0) -> tuple[torch.Tensor, ...]:
    """One step's selection over ``S = Qb * B`` beam slots (fixed shapes, no host sync: on CUDA it
    is replayed as a graph, see :meth:`DecodeEngine.run_captured`).

    Every slot's trie children (padded to ``C``) are scored ``s_score + log p`` from ``logits [R, V]``
    / ``lse`` at row ``logit_row[slot]``; virtual slots read their subtree's known raw scores from
    ``vraw`` (None: no slot is virtual). Terminal children among a query's top ``B`` enter the pool
    ``pool_s / pool_n [Qb, P]``; the top ``B`` children that can grow are the next beams. With a dense
    prior (``prior_*``, a :class:`DensePrior`'s tensors), both choices rank children by
    ``score + prior_weight * prior(child)``; the scores kept (pool, beams) stay the exact log-probs.

    Returns ``(pool_s, pool_n, run_s, run_c, run_t, alive, parent_slot, run_virtual, host)``: the new
    pool, per new slot ``[S]`` its score, node, token, liveness, parent slot and virtual flag, and
    ``host Long[7, S]`` (alive, virtual, fed, height, sub, degree, depth of the node): the step's one
    GPU->CPU read.
    """
    S = s_node.shape[0]
    Qb = S // B
    tok, child = trie.children_padded(s_node, width=C, check_width=False)    # [S, C]
    cand = s_score[:, None] + exact_logprobs_of(logits, lse, logit_row[:, None].expand(S, C), tok)
    virt = s_virtual[:, None].expand(S, C)
    if vraw is not None:
        cand = torch.where(virt, vraw[(s_vbase[:, None] + child.clamp(min=0)).clamp(0, vraw.numel() - 1)], cand)
    cand = torch.where((tok >= 0) & (s_node[:, None] >= 0), cand, NEG_INF)
    flat_s, flat_t, flat_c = cand.view(Qb, B * C), tok.view(Qb, B * C), child.view(Qb, B * C)
    flat_v = virt.reshape(Qb, B * C)
    rank_s = flat_s
    if prior_keys is not None:  # planning ahead: children that lead to the query's dense candidates first
        prior = DensePrior(prior_keys, prior_values, prior_floor).lookup(flat_c)
        rank_s = flat_s + prior_weight * prior

    # Finished: terminal children among the query's top-B candidates (HF's rule); virtual ones take
    # their rank but are in the pool already. (C >= 1, so a query has at least B candidates.)
    top_r, top_i = rank_s.topk(B, dim=1)
    top_s = top_r if prior_keys is None else flat_s.gather(1, top_i)
    top_c = flat_c.gather(1, top_i)
    fin = (torch.isfinite(top_s) & (top_c >= 0) & aux.is_terminal[top_c.clamp(min=0)]
           & ~flat_v.gather(1, top_i))
    fin_s = torch.where(fin, final_scores(top_s, aux.depth[top_c.clamp(min=0)], length_penalty), NEG_INF)
    pool_s, pool_n = _merge_pool(pool_s, pool_n, fin_s, torch.where(fin, top_c, -1))

    # Running: the top-B candidates that can still grow.
    grow = (flat_c >= 0) & (aux.degree[flat_c.clamp(min=0)] > 0)
    run_r, run_i = torch.where(grow, rank_s, NEG_INF).topk(B, dim=1)        # [Qb, B]
    run_s = run_r if prior_keys is None else flat_s.gather(1, run_i)  # the exact scores, not the ranking ones
    alive = torch.isfinite(run_r)
    if length_penalty == 0.0:  # bound: descendants score <= the beam; drop beams that cannot enter
        alive &= run_s > pool_s[:, -1:]
    run_c = flat_c.gather(1, run_i).reshape(-1)
    run_t = flat_t.gather(1, run_i).reshape(-1)
    run_s, alive = run_s.reshape(-1), alive.reshape(-1)
    q_of_slot = torch.arange(S, device=s_node.device) // B
    parent_slot = q_of_slot * B + run_i.reshape(-1) // C
    run_virtual = s_virtual[parent_slot] & alive
    nsafe = run_c.clamp(min=0)
    host = torch.stack([alive.long(), run_virtual.long(), aux.fed[nsafe], aux.height[nsafe],
                        aux.sub[nsafe], aux.degree[nsafe], aux.depth[nsafe]])
    return pool_s, pool_n, run_s, run_c, run_t, alive, parent_slot, run_virtual, host


@torch.no_grad()
def _search_batch(engine: DecodeEngine, prompts: list[list[int]], aux: TrieAux, trie: Any,
                  cfg: TargetSearchConfig, cost: CostModel | None, pad_id: int,
                  stats: SearchStats, dense: DenseCandidates | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One query batch on the engine's static cache. Query rows ``Qb`` (a power-of-two bucket)
    hold ``B`` beam slots each; slot ``q * B + b`` is also the slot's cache row. A slot is REAL
    (its prefix decoded step by step) or VIRTUAL (inside a verified subtree: every descendant's
    exact score is already known, so the slot keeps competing for beam places exactly as in ``off``
    mode, at no model cost; its terminals are already in the pool). When at most half of the query
    rows still have real beams, the rest are dropped and the batch continues at a smaller bucket.
    Returns ``(rows Long[Q, top_k], scores Float32[Q, top_k])`` on the device."""
    dev = engine.device
    # At most B terminals enter the pool per step, so fewer than top_k beams can leave the pool
    # short although the trie holds more ads (HF refuses num_return_sequences > num_beams): the
    # search runs max(num_beams, top_k) beams and keeps as many finished nodes.
    Q = len(prompts)
    B = P = cfg.pool_size
    lp_pen = cfg.length_penalty
    max_steps = min(cfg.max_steps or aux.max_depth, aux.max_depth)

    clock = _PhaseClock(stats, dev, cfg.profile)
    logits, lse, Qb = engine.prefill(prompts, B, max_steps, pad_id)          # [Qb, V], [Qb]
    qmap = torch.full((Qb,), -1, dtype=torch.long, device=dev)               # original query per row
    qmap[:Q] = torch.arange(Q, device=dev)
    # one spare row past the Q real ones: padding query rows flush into it (index writes with no boolean mask:
    # a masked write syncs with the device to count its rows)
    out_s = torch.full((Q + 1, P), NEG_INF, device=dev)
    out_n = torch.full((Q + 1, P), -1, dtype=torch.long, device=dev)
    S = Qb * B
    slot = torch.arange(S, device=dev)
    s_node = torch.where((slot % B == 0) & (slot // B < Q), 0, -1)
    s_score = torch.where(s_node == 0, 0.0, NEG_INF)
    s_virtual = torch.zeros(S, dtype=torch.bool, device=dev)
    s_vbase = torch.zeros(S, dtype=torch.long, device=dev)
    logit_row = slot // B    # the first step reads its query's prefill row, later steps its own row
    vraw = torch.zeros(1, device=dev)        # raw scores of verified subtrees, flat
    width = max(aux.root_degree, 1)
    pool_s = torch.full((Qb, P), NEG_INF, device=dev)
    pool_n = torch.full((Qb, P), -1, dtype=torch.long, device=dev)
    has_virtual = False  # set once a verification pass turns slots virtual (then steps stay eager)
    stats.prefill_rows += Q
    clock.mark("prefill")
    prior = None
    if dense is not None and cfg.prior_weight > 0:
        prior = dense_prior(aux, DenseCandidates(dense.rows.to(dev), dense.scores.to(dev)), Qb)

    def flush() -> None:  # the pools of real query rows into the batch's results (padding rows: the spare row)
        dst = torch.where(qmap >= 0, qmap, Q)
        out_s[dst] = pool_s
        out_n[dst] = pool_n

    for t in range(max_steps):
        S = Qb * B
        # width: the largest degree among the beams, known from the last step's sync; on CUDA a
        # power of two (few captured shapes; the padding columns are -1 children, never chosen)
        C = (1 << (width - 1).bit_length()) if engine.graphs_enabled else width
        state = {"s_node": s_node, "s_score": s_score, "pool_s": pool_s, "pool_n": pool_n,
                 "logit_row": logit_row, "s_virtual": s_virtual, "s_vbase": s_vbase}
        if prior is not None:
            state.update(prior_keys=prior.keys, prior_values=prior.values, prior_floor=prior.floor)
        expand = functools.partial(_expand_beams, trie=trie, aux=aux, logits=logits, lse=lse, B=B, C=C,
                                   length_penalty=lp_pen, prior_weight=cfg.prior_weight if prior is not None else 0.0)
        # graph-replayed: reads the logits of this bucket's step graph (t > 0) or prefill graph (t = 0) in place
        # (a first, eager prefill's logits sit at an address no later batch has: that key is never captured)
        if not has_virtual and C <= CAPTURE_MAX_WIDTH:
            key = ("expand", Qb, C, lp_pen) if prior is None else ("expand", Qb, C, lp_pen, cfg.prior_weight,
                                                                     prior.keys.shape[1])
            outs = engine.run_captured(key, expand, state,
                                       read_only=(logits, lse, *_trie_arrays(trie, aux)))
        else:  # verified subtrees' scores (vraw grows) or a wide level: eager
            outs = expand(**state, vraw=vraw)
        pool_s, pool_n, run_s, run_c, run_t, alive, parent_slot, run_virtual, host_dev = outs
        # The step's one GPU->CPU sync: everything the trigger and the bookkeeping need.
        host = host_dev.cpu().numpy()
        h_alive, h_virtual = host[0].astype(bool), host[1].astype(bool)
        pending = h_alive & ~h_virtual
        if not pending.any():
            break  # only virtual beams left: their candidates are all in the pool
        verify = _choose_verified(pending, host[2], host[3], cfg, cost, B,
                                  engine.tree_width if engine.graphs_enabled else None)
        cont = pending & ~verify
        clock.mark("select")

        new_vbase = s_vbase[parent_slot]
        if verify.any():
            vs = np.flatnonzero(verify)
            v_slots = torch.from_numpy(vs).to(dev)
            fed_max, sub_max = int(host[2][vs].max()), int(host[4][vs].max())
            scores, nodes, raw = verify_trees(
                engine, parent_slot[v_slots], t, run_c[v_slots], run_s[v_slots], aux,
                fed_max=fed_max, sub_max=sub_max, height_max=int(host[3][vs].max()),
                length_penalty=lp_pen)
            m = min(P, scores.shape[1])
            s_top, i_top = scores.topk(m, dim=1)                          # [V, m]
            buf_s = torch.full((S, m), NEG_INF, device=dev)
            buf_n = torch.full((S, m), -1, dtype=torch.long, device=dev)
            buf_s[v_slots], buf_n[v_slots] = s_top, nodes.gather(1, i_top)
            pool_s, pool_n = _merge_pool(pool_s, pool_n, buf_s.view(Qb, B * m), buf_n.view(Qb, B * m))
            # The verified slots turn virtual: node c of beam v's subtree scores vraw[vbase + c].
            offset = vraw.numel()
            vraw = torch.cat([vraw, raw.reshape(-1)])
            new_vbase[v_slots] = offset + torch.arange(vs.size, device=dev) * sub_max - run_c[v_slots]
            run_virtual = run_virtual.clone()  # (a captured graph's output buffer otherwise)
            run_virtual[v_slots] = True
            has_virtual = True
            stats.verify_passes += 1
            stats.beams_verified += int(vs.size)
            stats.verify_tokens += int(vs.size) * fed_max
            stats.verified_depths.update(host[6][vs].tolist())
            stats.tree_tokens_max = max(stats.tree_tokens_max, int(host[2][vs].max()))
            stats.tree_tokens_sum += int(host[2][vs].sum())
            clock.mark("verify")

        s_node = torch.where(alive, run_c, -1)
        s_score = torch.where(alive, run_s, NEG_INF)
        s_virtual, s_vbase = run_virtual, new_vbase
        width = max(int(host[5][h_alive].max()), 1)
        stats.width_max = max(stats.width_max, width)
        stats.width_sum += width
        if not cont.any() or t + 1 >= max_steps:
            break
        # = pending & ~verify on the device (verified slots turned virtual above): no upload
        cont_t = alive & ~run_virtual
        tokens = torch.where(cont_t, run_t, 0)
        # Query rows with no real beam left are final (virtual beams' terminals are all in the
        # pool): once they are half the bucket or more, continue on a smaller one.
        live_q = np.flatnonzero(cont.reshape(Qb, B).any(1))
        if engine.bucket(live_q.size) < Qb:
            flush()
            keep = torch.from_numpy(live_q).to(dev)
            new_qb = engine.compact(keep)
            src_q = torch.cat([keep, keep[-1:].expand(new_qb - keep.numel())])
            is_pad = torch.arange(new_qb, device=dev) >= keep.numel()
            src = (src_q[:, None] * B + torch.arange(B, device=dev)).reshape(-1)
            pad_slot = is_pad.repeat_interleave(B)
            qmap = torch.where(is_pad, -1, qmap[src_q])
            pool_s, pool_n = pool_s[src_q], pool_n[src_q]
            if prior is not None:
                prior = prior.select(src_q)
                prior.floor = torch.where(is_pad, 0.0, prior.floor)
            s_node = torch.where(pad_slot, -1, s_node[src])
            s_score = torch.where(pad_slot, NEG_INF, s_score[src])
            s_virtual, s_vbase = s_virtual[src] & ~pad_slot, s_vbase[src]
            tokens, parent_slot = tokens[src], parent_slot[src]  # parents: rows of the old layout
            cont_t = cont_t[src] & ~pad_slot
            Qb = new_qb
            stats.compactions += 1
        if engine.graphs_enabled:  # every slot row, one captured shape per bucket
            logits, lse = engine.step(tokens, t, Qb, parent_slot)
            logit_row = torch.arange(Qb * B, device=dev)
        else:  # eager: only the rows decoded on (dead, verified and finished slots cost nothing)
            live = cont_t.nonzero()[:, 0]
            logits, lse = engine.step_rows(tokens[live], t, live, parent_slot[live], Qb)
            logit_row = torch.zeros(Qb * B, dtype=torch.long, device=dev)
            logit_row[live] = torch.arange(live.numel(), device=dev)
        clock.mark("decode")
        stats.steps += 1
        stats.decode_rows += int(cont.sum())
        stats.rows_computed += Qb * B if engine.graphs_enabled else int(cont.sum())
    flush()
    rows, scores = _rows_from_pool(out_s[:Q], out_n[:Q], aux, cfg.top_k)
    clock.mark("finish")
    return rows, scores


def search_targets(model: Any, prompts: list[list[int]], trie: Any, config: TargetSearchConfig,
                   cost_model: CostModel | None = None, batch_size: int | None = None,
                   dense: DenseCandidates | None = None) -> TargetSearchResult:
    """Best ``config.top_k`` ads per prompt, by exact constrained log-probability.

    Args:
        model: a HF causal LM (eval mode) whose log-probs are ``log_softmax(lm_head(hidden))``.
        prompts: ``Q`` token-id lists (e.g. from ``encode_targeting_prompt``); the ad's target
            sequence follows each prompt directly.
        trie: an :class:`adbatch.index.trie.Trie` over the index's target sequences (any device; moved
            to the model's device).
        config: :class:`TargetSearchConfig`.
        cost_model: the trigger's measurements for ``verify=auto``; default: the saved calibration
            for this model/device/dtype, measured now if absent.
        batch_size: prompts searched together; None = all of them (the generators pass one batch, sized
            by the generate job's ``batch_size``).
        dense: the dense channel's candidates (``Q`` rows); with ``config.prior_weight > 0`` they steer
            the beams (:class:`DensePrior`), else they are not read.
    Returns:
        :class:`TargetSearchResult` with ``rows Long[Q, k]``, ``scores Float32[Q, k]`` (CPU) and
        ``stats`` (steps, decode rows, verify passes, beams verified, tree tokens, verified depths).
    """
    check_supported(model)
    if not isinstance(config, TargetSearchConfig):
        raise TypeError(f"config must be a TargetSearchConfig, got {type(config).__name__}")
    dev = model_device(model)
    head = model.get_output_embeddings()
    vocab = int(getattr(head, "out_features", 0) or model.config.vocab_size)
    if dense is not None and dense.rows.shape[0] != len(prompts):
        raise ValueError(f"dense candidates for {dense.rows.shape[0]} queries, {len(prompts)} prompts")
    if config.prior_weight > 0 and dense is None:
        raise ValueError("TargetSearchConfig.prior_weight > 0 needs the dense channel's candidates (dense=)")
    if trie.vocab_upper_bound > vocab:
        raise ValueError(f"trie uses token ids up to {trie.vocab_upper_bound - 1} but the model's "
                         f"vocabulary has {vocab} entries")
    trie, aux = _prepared_trie(trie, dev)
    if config.verify is VerifyMode.AUTO and cost_model is None and prompts:
        cost_model = load_or_calibrate(model)
    pad_id = pad_token_id(model)
    stats = SearchStats(mode=config.verify.value)
    rows, scores = [], []
    with serving_engine(model, config.linear_formats) as engine:
        step = batch_size or max(len(prompts), 1)
        for start in range(0, len(prompts), step):
            chunk = [list(map(int, p)) for p in prompts[start:start + step]]
            part = dense.slice(start, start + len(chunk)) if dense is not None else None
            r, s = _search_batch(engine, chunk, aux, trie, config, cost_model, pad_id, stats, part)
            rows.append(r.cpu())
            scores.append(s.cpu())
    stats.queries = len(prompts)
    log.debug("search_targets stats: %s", stats.flat())
    if not rows:  # no prompts: empty [0, k] results, not an error
        return TargetSearchResult(torch.empty(0, config.top_k, dtype=torch.long), torch.empty(0, config.top_k), stats)
    return TargetSearchResult(torch.cat(rows, 0), torch.cat(scores, 0), stats)


@dataclasses.dataclass
class ScoreStats:
    """Counters of :func:`score_targets` calls (accumulated): ``queries`` asked, ``queries_scored`` (those with a
    row to score: only they are prefilled), ``rows`` scored, ``passes`` (tree passes), ``tree_tokens`` (internal
    nodes fed) and ``tree_tokens_padded`` (fed with each pass's padding)."""

    queries: int = 0
    queries_scored: int = 0
    rows: int = 0
    passes: int = 0
    tree_tokens: int = 0
    tree_tokens_padded: int = 0


@torch.no_grad()
def score_targets(model: Any, prompts: list[list[int]], trie: Any, config: TargetSearchConfig, rows: torch.Tensor,
                  batch_size: int | None = None, stats: ScoreStats | None = None) -> torch.Tensor:
    """Exact scores of given ads per prompt: each row's target sequence teacher-forced after its prompt, the
    scoring rule of :func:`search_targets` applied (the same number a beam that finds the row reports).

    One prefill of the prompts that have a row to score (the others cost nothing), then one tree pass over
    each query's candidates: their root paths share prefixes in the trie and are fed as one token tree
    (:func:`adbatch.decoding.tree_verify.score_candidates`). The engine's cache is reserved as the search's
    (``config.pool_size`` slots per query), so both reuse one cache and one set of captured graphs.

    Args:
        rows: ``Long[Q, K]`` index rows per prompt (-1 = none; any device).
        stats: :class:`ScoreStats` to accumulate into (optional).
    Returns:
        ``Float32[Q, K]`` (CPU), ``-inf`` where ``rows`` is -1.
    """
    check_supported(model)
    if rows.shape[0] != len(prompts):
        raise ValueError(f"rows for {rows.shape[0]} queries, {len(prompts)} prompts")
    dev = model_device(model)
    trie, aux = _prepared_trie(trie, dev)
    stats = stats if stats is not None else ScoreStats()
    rows = rows.cpu()
    out = torch.full(rows.shape, NEG_INF)
    stats.queries += len(prompts)
    wanted = np.flatnonzero((rows >= 0).any(1).numpy())
    if not wanted.size:
        return out
    if int(rows.max()) >= aux.node_of_row.numel():
        raise ValueError(f"row {int(rows.max())} is not in the trie ({aux.node_of_row.numel()} rows)")
    max_steps = min(config.max_steps or aux.max_depth, aux.max_depth)
    pad_id = pad_token_id(model)
    with serving_engine(model, config.linear_formats) as engine:
        step = batch_size or wanted.size
        for start in range(0, wanted.size, step):
            q = wanted[start:start + step]
            logits, lse, _ = engine.prefill([list(map(int, prompts[i])) for i in q], config.pool_size, max_steps, pad_id)
            r = rows[q].to(dev)
            cand = torch.where(r >= 0, aux.node_of_row[r.clamp(min=0)], -1)
            out[q] = score_candidates(engine, aux, cand, logits, lse, config.length_penalty, counts=stats).cpu()
    stats.queries_scored += int(wanted.size)
    stats.rows += int((rows >= 0).sum())
    return out
