"""N:M sparsity: element scores, exactly-N-of-4 masks, per-layer importance and pattern allocation.

Element score (DESIGN.md section 1, extending Wanda)::

    S_ij = |W_ij| * ||X_j||_2 + grad_weight * |W_ij| * |dE/dW_ij|

``||X_j||_2`` is the l2 norm of input column j over all calibration tokens; ``|dE/dW_ij|`` is the
l2 norm over calibration batches of the gradient of each batch's summed token loss (see
:mod:`adbatch.compress.calibration`).

Layer importance (what decides 2:4 vs 1:4): the *proxy loss increase* of pruning a layer, in loss
units so that layers are comparable. With the diagonal (K-FAC-style) curvature
``F_ij ~ E[g_i^2] * E[x_j^2]`` (g = dE/dy, the gradient at the layer's output; x its input),
pruning the set P costs ``dL(P) ~ 1/2 * sum_{ij in P} F_ij * W_ij^2``. A layer's importance is
``(dL(1:4) - dL(2:4)) / (weights removed going 2:4 -> 1:4)``: the loss paid per weight saved. The
allocator then spends the density budget where it buys the most loss (a greedy knapsack). Unlike
OWL's outlier ratio, this uses the gradient statistics we already collect, and unlike a layer-local
reconstruction error it weights each layer by how much the loss reacts to its output.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass

import torch

from adbatch.compress.recipe import PATTERN_DENSITY, ScoreMethod, SparsityPattern

log = logging.getLogger(__name__)

__all__ = [
    "ScoreMethod", "element_scores", "nm_mask", "kept_positions", "proxy_loss", "LayerImportance",
    "allocate_patterns", "interleaved_patterns",
]

M = 4


def element_scores(
    weight: torch.Tensor,
    act_norm: torch.Tensor | None,
    grad_abs: torch.Tensor | None,
    method: ScoreMethod,
    grad_weight: float = 1.0,
) -> torch.Tensor:
    """Element importance of a linear weight.

    Args:
        weight: [N, K] (any float dtype), the ``out x in`` weight.
        act_norm: float [K], ``||X_j||_2`` over the calibration tokens (wanda, paper).
        grad_abs: float [N, K], ``|dE/dW_ij|`` (paper).
        method: :class:`ScoreMethod`.
        grad_weight: factor on the gradient term (1.0 = the paper's formula).
    Returns: float32 [N, K], larger = more important.
    """
    method = ScoreMethod(method)
    w = weight.detach().float().abs()
    if method is ScoreMethod.MAGNITUDE:
        return w
    if act_norm is None:
        raise ValueError(f"score {method.value!r} needs act_norm ([K] input column norms); got None")
    if act_norm.shape != (weight.shape[1],):
        raise ValueError(f"act_norm: expected [{weight.shape[1]}], got {tuple(act_norm.shape)}")
    score = w * act_norm.float().unsqueeze(0)
    if method is ScoreMethod.WANDA:
        return score
    if grad_abs is None:
        raise ValueError("score 'paper' needs grad_abs ([N, K] |dE/dW|); got None")
    if grad_abs.shape != weight.shape:
        raise ValueError(f"grad_abs: expected {tuple(weight.shape)}, got {tuple(grad_abs.shape)}")
    return score + grad_weight * w * grad_abs.float().abs()


def _check_groups(scores: torch.Tensor, n: int, m: int) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores: expected [N, K], got shape {tuple(scores.shape)}")
    if scores.shape[1] % m != 0:
        raise ValueError(f"scores: K={scores.shape[1]} is not a multiple of m={m}")
    if not 1 <= n <= m:
        raise ValueError(f"n={n} must be in [1, m={m}]")


def kept_positions(scores: torch.Tensor, n: int, m: int = M) -> torch.Tensor:
    """Positions of the ``n`` best scores inside every group of ``m`` consecutive columns.

    Args: scores float [N, K] (K a multiple of m). Returns uint8 [N, K // m * n]: for each group the
    kept positions in ascending order (ties go to the lower column: a stable sort).
    """
    _check_groups(scores, n, m)
    rows, k = scores.shape
    grouped = scores.float().reshape(rows, k // m, m)
    order = torch.argsort(grouped, dim=-1, descending=True, stable=True)[..., :n]
    return order.sort(dim=-1).values.reshape(rows, -1).to(torch.uint8)


def nm_mask(scores: torch.Tensor, n: int, m: int = M) -> torch.Tensor:
    """Keep the ``n`` highest scores of every group of ``m`` consecutive input columns of a row.

    Args: scores float [N, K], K a multiple of m. Returns bool [N, K] with exactly n True per group.
    """
    _check_groups(scores, n, m)
    rows, k = scores.shape
    pos = kept_positions(scores, n, m).reshape(rows, k // m, n).to(torch.int64)
    mask = torch.zeros(rows, k // m, m, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, pos, True)
    return mask.reshape(rows, k)


def proxy_loss(weight: torch.Tensor, mask: torch.Tensor, col_moment: torch.Tensor,
               row_moment: torch.Tensor | None) -> float:
    """Proxy loss increase ``1/2 sum_{pruned} G_i H_j W_ij^2`` of zeroing ``~mask``.

    Args: weight [N, K]; mask bool [N, K] (True = kept); col_moment float [K] (H_j = E[x_j^2]);
    row_moment float [N] (G_i = E[g_i^2]) or None (= 1). Returns a Python float (float64 sum).
    """
    pruned = weight.detach().float().pow(2) * (~mask)
    per_row = (pruned * col_moment.float().unsqueeze(0)).sum(dim=1, dtype=torch.float64)  # [N]
    if row_moment is not None:
        per_row = per_row * row_moment.double()
    # exact sum of the rows: a whole-tensor sum's last bits depend on torch's thread count (Ray
    # workers run one thread), and importance must not
    return 0.5 * math.fsum(per_row.tolist())


@dataclass
class LayerImportance:
    """Per-layer input of the pattern allocator."""

    name: str
    params: int
    proxy_loss: dict[SparsityPattern, float]  #: pattern -> proxy loss increase (DENSE = 0)
    sparsifiable: bool = True  #: False when K is not a multiple of 4 (the layer stays dense)

    @property
    def importance(self) -> float | None:
        if not self.sparsifiable:
            return None
        removed = self.params * (PATTERN_DENSITY[SparsityPattern.TWO_FOUR] - PATTERN_DENSITY[SparsityPattern.ONE_FOUR])
        return (self.proxy_loss[SparsityPattern.ONE_FOUR] - self.proxy_loss[SparsityPattern.TWO_FOUR]) / removed


def _ordered(allowed: tuple[SparsityPattern, ...]) -> list[SparsityPattern]:
    return sorted(set(allowed), key=lambda p: PATTERN_DENSITY[p])


def allocate_patterns(layers: list[LayerImportance], target_density: float,
                      allowed: tuple[SparsityPattern, ...],
                      fixed: dict[str, SparsityPattern] | None = None) -> dict[str, SparsityPattern]:
    """Choose a pattern per layer minimizing the summed proxy loss at parameter-weighted density
    <= ``target_density``.

    Greedy multiple-choice knapsack: every layer starts at the sparsest allowed pattern; the
    upgrade (to the layer's next denser pattern) with the largest proxy-loss reduction per added
    kept weight is applied while it fits the budget. Deterministic (ties broken by layer order).
    Non-sparsifiable layers are dense and count against the budget; so do the layers in ``fixed``
    (e.g. masks learned in training), at their fixed pattern's density.
    """
    fixed = fixed or {}
    ladder = _ordered(allowed)
    total = sum(x.params for x in layers)
    if total == 0:
        return {}
    budget = target_density * total
    choice: dict[str, int] = {}
    used = 0.0
    for x in layers:
        if x.name in fixed:
            used += x.params * PATTERN_DENSITY[fixed[x.name]]
        elif x.sparsifiable:
            choice[x.name] = 0
            used += x.params * PATTERN_DENSITY[ladder[0]]
        else:
            used += x.params
    by_name = {x.name: (i, x) for i, x in enumerate(layers)}
    if used > budget + 1e-9 * total:
        log.warning("target density %.4f is below what the sparsest pattern allows (%.4f)",
                    target_density, used / total)

    def push(heap: list, name: str) -> None:
        i, x = by_name[name]
        level = choice[name]
        if level + 1 >= len(ladder):
            return
        cur, nxt = ladder[level], ladder[level + 1]
        cost = x.params * (PATTERN_DENSITY[nxt] - PATTERN_DENSITY[cur])
        gain = x.proxy_loss[cur] - x.proxy_loss[nxt]
        heapq.heappush(heap, (-gain / cost, i, name, cost))

    heap: list = []
    for name in choice:
        push(heap, name)
    while heap:
        _, _, name, cost = heapq.heappop(heap)
        if used + cost > budget + 1e-9 * total:
            continue  # this upgrade does not fit; a cheaper one further down may
        used += cost
        choice[name] += 1
        push(heap, name)
    out = {name: ladder[level] for name, level in choice.items()}
    for x in layers:
        if x.name in fixed:
            out[x.name] = SparsityPattern(fixed[x.name])
        elif not x.sparsifiable:
            out[x.name] = SparsityPattern.DENSE
    return out


def interleaved_patterns(layers: list[LayerImportance], target_density: float,
                         allowed: tuple[SparsityPattern, ...],
                         fixed: dict[str, SparsityPattern] | None = None) -> dict[str, SparsityPattern]:
    """Importance-blind baseline at the same density: layers in model order take turns being
    upgraded (sparsest -> denser) while the budget allows, so every depth gets the same mix.

    Used only for the uniform-vs-adaptive ablation; mirrors :func:`allocate_patterns`'s budget rule.
    """
    fixed = fixed or {}
    ladder = _ordered(allowed)
    total = sum(x.params for x in layers)
    budget = target_density * total
    choice = {x.name: 0 for x in layers if x.sparsifiable and x.name not in fixed}
    used = sum(x.params * (PATTERN_DENSITY[fixed[x.name]] if x.name in fixed
                           else PATTERN_DENSITY[ladder[0]] if x.sparsifiable else 1.0) for x in layers)
    sparse = [x for x in layers if x.name in choice]
    for level in range(len(ladder) - 1):
        cur, nxt = ladder[level], ladder[level + 1]
        # stride through the layers so upgrades are spread evenly over depth, not front-loaded
        n_fit = 0
        step_cost = [x.params * (PATTERN_DENSITY[nxt] - PATTERN_DENSITY[cur]) for x in sparse]
        remaining = budget - used
        for c in step_cost:
            if remaining - c < -1e-9 * total:
                break
            remaining -= c
            n_fit += 1
        if n_fit == 0:
            break
        stride = len(sparse) / n_fit
        picks = sorted({int(math.floor(j * stride)) for j in range(n_fit)})
        for j in picks:
            x = sparse[j]
            cost = step_cost[j]
            if used + cost <= budget + 1e-9 * total:
                choice[x.name] += 1
                used += cost
        if n_fit < len(sparse):
            break
    out = {name: ladder[level] for name, level in choice.items()}
    for x in layers:
        if x.name in fixed:
            out[x.name] = SparsityPattern(fixed[x.name])
        elif not x.sparsifiable:
            out[x.name] = SparsityPattern.DENSE
    return out
