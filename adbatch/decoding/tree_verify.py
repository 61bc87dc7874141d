"""Prefix-tree parallel verification: score every candidate below a beam in ONE forward pass.

For a beam at trie node ``n`` whose own token is still pending (chosen this step, not yet fed), the
tree fed to the model is ``n`` itself plus every *internal* node of its subtree (nodes with
children). Leaves are never fed: their log-prob is read at their parent's position. Each fed token
attends to its row's cached prefix and to its own ancestors inside the tree (ancestor-or-self),
with ``position_ids = next position of the beam + depth below n``. So the log-prob of a tree
token equals the one a plain step-by-step decode of its branch would give.

The trie keeps node ids in depth-first preorder (adbatch/index/trie.py), so the subtree of ``n`` is the
id range ``[n, n + subtree_nodes[n])`` and "a is an ancestor of b" is the interval test
``a <= b < a + subtree_nodes[a]``: trees, masks and path sums are built on the device with no
per-beam Python. Several beams of several queries share one pass (trees right-padded). The pass
reads the engine's static cache in place (the query's shared prompt row and the parent slot's suffix)
and writes nothing there: the tree tokens' K/V live only inside the pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from adbatch.decoding.engine import DecodeEngine, exact_logprobs_of


class TrieAux:
    """Per-node arrays derived once from a trie, on its device (all ``Long[N]`` unless noted).

    ``degree``, ``is_terminal`` (Bool), ``height``, ``depth``, ``sub`` (subtree_nodes),
    ``parent``, ``token``, ``fed`` (tokens a verification of the node feeds: the node itself
    plus the internal nodes below it), ``terminal_ptr`` / ``terminal_rows``.
    """

    def __init__(self, trie: Any) -> None:
        self.degree = (trie.child_ptr[1:] - trie.child_ptr[:-1]).long()
        self.terminal_ptr = trie.terminal_ptr.long()
        self.terminal_rows = trie.terminal_rows.long()
        self.is_terminal = self.terminal_ptr[1:] > self.terminal_ptr[:-1]
        self.height = trie.height.long()
        self.depth = trie.depth.long()
        self.sub = trie.subtree_nodes.long()
        self.parent = trie.parent.long()
        self.token = trie.token.long()
        n = self.degree.shape[0]
        ids = torch.arange(n, device=self.degree.device)
        # Preorder check: every non-root node lies inside its parent's id interval, after it.
        if n > 1:
            p = self.parent[1:]
            ok = bool(((p >= 0) & (p < ids[1:]) & (ids[1:] < p + self.sub[p.clamp(min=0)])).all())
            if not ok or int(self.sub[0]) != n:
                raise ValueError("trie node ids are not in depth-first preorder; adbatch.decoding "
                                 "relies on the contiguous-subtree layout of adbatch.index.trie")
        internal = (self.degree > 0).long()
        csum = torch.zeros(n + 1, dtype=torch.long, device=ids.device)
        csum[1:] = internal.cumsum(0)
        # The node's own (pending) token is always fed, internal or not.
        self.fed = csum[ids + self.sub] - csum[ids] + (1 - internal)
        self.max_depth = int(self.height[0])
        self.root_degree = int(self.degree[0])
        # row -> its terminal node (the inverse of terminal_ptr / terminal_rows): dense candidates
        # arrive as index rows
        counts = self.terminal_ptr[1:] - self.terminal_ptr[:-1]
        self.node_of_row = torch.empty(self.terminal_rows.numel(), dtype=torch.long, device=ids.device)
        self.node_of_row[self.terminal_rows] = torch.repeat_interleave(ids, counts)


#: score passes (:func:`score_candidates`): trees padded to one of this many widths per octave, and at most this
#: many padded tree tokens per pass (a power of two of queries). Power-of-two widths and 65,536 tokens padded the
#: trained 5k model's passes to 1.68x their real tokens (20 dense candidates per query; 2.06x at 10) and kept a
#: 6 GiB logits buffer per captured shape; these settings pad the same queries to 1.11x (1.25x) in 7 (6) shapes of
#: at most 16,384 tokens (replayed on the CPU from that run's candidates)
SCORE_WIDTH_STEPS = 4
SCORE_PASS_TOKENS = 16384


def final_scores(raw: torch.Tensor, length: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """The documented scoring rule: ``raw / length ** length_penalty`` (``raw`` itself when 0)."""
    if length_penalty == 0.0:
        return raw
    return raw / length.clamp(min=1).to(raw.dtype).pow(length_penalty)


def ancestors(aux: TrieAux, nodes: torch.Tensor) -> torch.Tensor:
    """``Long[..., D]`` (D = the trie's height): entry ``d - 1`` is the ancestor-or-self of each of
    ``nodes`` (``Long[...]``, -1 = none) at depth ``d``; -1 below the node's own depth."""
    D = max(aux.max_depth, 1)
    out = torch.full((*nodes.shape, D), -1, dtype=torch.long, device=nodes.device)
    cur = nodes.clone()
    for _ in range(D):  # pointer chasing over the depth: every node reaches the root in <= D rounds
        ok = cur > 0
        safe = cur.clamp(min=0)
        d = (aux.depth[safe] - 1).clamp(min=0)
        out.scatter_(-1, d[..., None], torch.where(ok, cur, out.gather(-1, d[..., None])[..., 0])[..., None])
        cur = torch.where(ok, aux.parent[safe], -1)
    return out


def _sorted_unique(nodes: torch.Tensor, big: int) -> torch.Tensor:
    """Per row of ``nodes Long[Q, M]`` (-1 = none) its distinct nodes in ascending id order, then ``big``."""
    vals = torch.where(nodes >= 0, nodes, big).sort(1).values
    dup = torch.zeros_like(vals, dtype=torch.bool)
    dup[:, 1:] = vals[:, 1:] == vals[:, :-1]
    return torch.where(dup, big, vals).sort(1).values


@torch.no_grad()
def score_candidates(engine: DecodeEngine, aux: TrieAux, cand_nodes: torch.Tensor, logits0: torch.Tensor,
                     lse0: torch.Tensor, length_penalty: float = 0.0, max_pass_tokens: int | None = None,
                     counts: Any = None) -> torch.Tensor:
    """Exact scores of given complete candidates, teacher-forced right after the prefill, by the tree pass.

    Each query's candidates share prefixes in the trie: the union ``U`` of their root paths is one token
    tree. Its *internal* nodes (parents of another node of ``U``; ids in preorder, so parents come first)
    are fed in one :meth:`DecodeEngine.tree_forward` below the query's prompt (suffix position 0), exactly
    as :func:`verify_trees` feeds a beam's subtree; every node's log-prob is read at its parent's row (the
    prefill's row under the root), so leaves are never fed, and a path's log-probs are summed by pointer
    chasing over the depth.

    Args:
        engine: holding the batch's prefill (query ``q`` at slot row ``q * engine.B``; not modified).
        cand_nodes: ``Long[Q, K]`` terminal trie node of each candidate (-1 = none).
        logits0 / lse0: the prefill's ``[Qb, V]`` logits and ``Float32[Qb]`` log-sum-exp (first tokens).
        max_pass_tokens: cap on padded tree tokens per pass (queries are split into passes below it; default
            :data:`SCORE_PASS_TOKENS`).
        counts: an object whose ``passes``, ``tree_tokens`` and ``tree_tokens_padded`` are incremented
            (:class:`adbatch.decoding.beam_search.ScoreStats`), or None.
    Returns:
        ``Float32[Q, K]``: the scoring rule applied to each candidate's summed log-probs (-inf at -1).
    """
    dev = cand_nodes.device
    Q, K = cand_nodes.shape
    N = aux.degree.shape[0]
    union = _sorted_unique(ancestors(aux, cand_nodes).reshape(Q, -1), N)      # [Q, K*D] ascending, N = none
    u_valid = union < N
    u_safe = torch.where(u_valid, union, 0)
    u_par = torch.where(u_valid, aux.parent[u_safe], -1)                  # parent of each union node (0 = root)
    parents = _sorted_unique(torch.where(u_par > 0, u_par, -1), N)        # the union's internal nodes
    u_count, f_count = u_valid.sum(1), (parents < N).sum(1)
    sizes = torch.cat([u_count.max().reshape(1), f_count]).cpu() if Q else torch.ones(1, dtype=torch.long)
    U = max(int(sizes[0]), 1)                                             # the call's one host sync
    f_host = sizes[1:].numpy()
    union, u_valid, u_safe, u_par = union[:, :U], u_valid[:, :U], u_safe[:, :U], u_par[:, :U]
    out = torch.full((Q, K), float("-inf"), device=dev)
    # Queries in order of tree size, each pass padded to its own largest tree (one of SCORE_WIDTH_STEPS widths
    # per octave where passes are graph-captured): one padding for the whole batch made the average pass ~2x its
    # real tokens (text ids, 20 candidates: 420 internal nodes on average, 650 at most -> 1,024 for all).
    if counts is not None:
        counts.tree_tokens += int(f_host.sum())
    order = np.argsort(f_host, kind="stable")
    order_dev = torch.from_numpy(order).to(dev)
    max_pass_tokens = max_pass_tokens or SCORE_PASS_TOKENS
    width = lambda f: engine.tree_width(max(int(f), 1), SCORE_WIDTH_STEPS)  # noqa: E731
    s = 0
    while s < Q:
        Fw = width(f_host[order[s]])
        while True:  # the longest run from s whose padded tokens stay within the cap (sizes ascend), a power of
            # two of queries: a captured pass runs its query count rounded up to one
            per = max(1, max_pass_tokens // Fw)
            e = min(Q, s + (1 << per.bit_length() - 1))
            widest = width(f_host[order[e - 1]])
            if widest <= Fw:
                break
            Fw = widest
        q = order_dev[s:e]
        node = parents[q, :Fw] if parents.shape[1] >= Fw else torch.cat(
            [parents[q], torch.full((e - s, Fw - parents.shape[1]), N, dtype=torch.long, device=dev)], 1)
        local = torch.arange(e - s, device=dev)
        s = e
        valid = node < N
        safe = torch.where(valid, node, 0)
        tok = torch.where(valid, aux.token[safe], 0)
        pos = engine.prompt_len[q][:, None] + (aux.depth[safe] - 1).clamp(min=0)
        a, b = safe[:, None, :], safe[:, :, None]
        vis = (a <= b) & (b < a + aux.sub[a]) & valid[:, None, :] & valid[:, :, None]
        vis |= torch.eye(Fw, dtype=torch.bool, device=dev)[None]
        logits, lse = engine.tree_forward(q * engine.B, 0, tok, pos, vis)  # [V*Fw, vocab]
        if counts is not None:
            counts.passes += 1
            counts.tree_tokens_padded += local.numel() * Fw
        # every union node's log-prob: at its parent's fed row, or the prefill row under the root
        un, up, uv = union[q], u_par[q], u_valid[q]
        utok = torch.where(uv, aux.token[u_safe[q]], 0)
        at_par = torch.searchsorted(node, up.clamp(min=0).contiguous()).clamp(max=Fw - 1)
        from_tree = exact_logprobs_of(logits, lse, local[:, None] * Fw + at_par, utok)
        from_prompt = exact_logprobs_of(logits0, lse0, q[:, None].expand_as(utok), utok)
        edge = torch.where(uv, torch.where(up == 0, from_prompt, from_tree), 0.0)
        local_par = torch.searchsorted(un, up.clamp(min=0).contiguous()).clamp(max=U - 1)
        has_par = uv & (up > 0)
        cum = edge
        for _ in range(max(aux.max_depth - 1, 0)):
            cum = edge + torch.where(has_par, cum.gather(1, local_par), 0.0)
        c = cand_nodes[q]
        at = torch.searchsorted(un, c.clamp(min=0).contiguous()).clamp(max=U - 1)
        sc = final_scores(cum.gather(1, at), aux.depth[c.clamp(min=0)], length_penalty)
        out[q] = torch.where(c >= 0, sc, float("-inf"))
    return out


@torch.no_grad()
def verify_trees(engine: DecodeEngine, parent_rows: torch.Tensor, t: int, nodes: torch.Tensor,
                 base_scores: torch.Tensor, aux: TrieAux, fed_max: int, sub_max: int, height_max: int,
                 length_penalty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact scores of every complete candidate strictly below each verified beam.

    Args:
        engine: the decode engine holding the batch's cache (not modified).
        parent_rows: ``Long[V]`` slot row holding each beam's prefix (suffix positions ``[0, t)``).
        t: tokens fed so far (each beam's own token goes at suffix position ``t``).
        nodes: ``Long[V]`` trie node of each beam (its token not yet fed).
        base_scores: ``Float32[V]`` sum of log-probs of each beam's tokens up to ``nodes``.
        fed_max: ``max(aux.fed[nodes])``; sub_max: ``max(aux.sub[nodes])``;
        height_max: ``max(aux.height[nodes])`` (host ints, known from the step's one sync).
    Returns:
        ``(scores Float32[V, sub_max - 1], cand_nodes Long[V, sub_max - 1], raw Float32[V, sub_max])``:
        final scores (scoring rule applied) of the terminal nodes strictly below each beam
        (``-inf`` / -1 elsewhere), and the raw score (sum of log-probs) of every subtree node by
        its offset ``node - nodes[v]`` (the beam's own score at offset 0).
    """
    dev = nodes.device
    V = nodes.shape[0]
    fed_max = engine.tree_width(fed_max)  # padded columns are unused tree slots (fed_node -1)
    j = torch.arange(sub_max, device=dev)
    sub = aux.sub[nodes]                                                  # [V]
    in_tree = j[None, :] < sub[:, None]                                   # [V, S]
    ids = torch.where(in_tree, nodes[:, None] + j[None, :], 0)            # [V, S]
    internal = in_tree & ((aux.degree[ids] > 0) | (j[None, :] == 0))      # fed positions
    fed_idx = internal.long().cumsum(1) - 1                               # [V, S]
    fed_node = torch.full((V, fed_max + 1), -1, dtype=torch.long, device=dev)
    fed_node.scatter_(1, torch.where(internal, fed_idx, fed_max), ids)
    fed_node = fed_node[:, :fed_max]                                      # [V, F]
    fed_valid = fed_node >= 0
    fed_safe = fed_node.clamp(min=0)
    fed_tok = torch.where(fed_valid, aux.token[fed_safe], 0)
    rel_depth = torch.where(fed_valid, aux.depth[fed_safe] - aux.depth[nodes][:, None], 0)
    pos = engine.prompt_len[parent_rows // engine.B][:, None] + t + rel_depth  # [V, F]

    a = fed_node[:, None, :]                                              # key   [V, 1, F]
    b = fed_node[:, :, None]                                              # query [V, F, 1]
    tree_vis = (a <= b) & (b < a + aux.sub[a.clamp(min=0)]) & fed_valid[:, None, :]
    tree_vis |= torch.eye(fed_max, dtype=torch.bool, device=dev)[None]   # padding sees itself
    logits, lse = engine.tree_forward(parent_rows, t, fed_tok, pos, tree_vis)  # [V*F, vocab]

    par_local = torch.where(in_tree & (j[None, :] > 0), aux.parent[ids] - nodes[:, None], 0)
    par_fed = fed_idx.gather(1, par_local)                                # [V, S]
    src = torch.arange(V, device=dev)[:, None] * fed_max + par_fed         # [V, S] fed row
    edge = exact_logprobs_of(logits, lse, src, aux.token[ids])
    edge = torch.where(in_tree & (j[None, :] > 0), edge, 0.0)              # [V, S]
    # Path sums by pointer chasing over the tree depth (entries at depth d are final after d rounds).
    cum = edge
    for _ in range(max(height_max - 1, 0)):
        cum = edge + cum.gather(1, par_local)
    raw = base_scores[:, None] + cum
    is_cand = in_tree & (j[None, :] > 0) & aux.is_terminal[ids]
    scores = final_scores(raw, aux.depth[ids], length_penalty)
    scores = torch.where(is_cand, scores, float("-inf"))
    cand_nodes = torch.where(is_cand, ids, -1)
    return scores[:, 1:], cand_nodes[:, 1:], raw
