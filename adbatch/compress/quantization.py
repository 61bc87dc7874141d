"""Asymmetric INT4 group quantization of kept values with per-row adaptive group sizes.

Format (kernels/nm_int4.py): ``w = (q - zero) * scale``, ``q`` in [0, 15], fp16 ``scale``/``zero`` per
group of ``group_size[r]`` consecutive kept values of row ``r`` (last group may be partial). The range
of every group is widened to include 0 so ``zero`` lies in [0, 15] (exact in fp16 to ~0.008) and an
all-zero group is exact.

Group-size choice (SpQR-style sensitivity): the error of a row at size g is
``err_r(g) = G_r * sum_k H_{col(k)} * (v_rk - deq_g(v)_rk)^2`` with ``H_j = E[x_j^2]`` the input second
moment of the kept value's column and ``G_r = E[g_r^2]`` the output-gradient moment of the row (1 when
not collected). Bits of a row: ``4 * Kk + 32 * ceil(Kk / g)`` (INT4 values + fp16 scale + fp16 zero).
Budget: per layer, at most the bits the uniform ``reference_group_size`` would take, so adaptive and
uniform layers are byte-for-byte comparable. The assignment is a Lagrangian relaxation (bisection
on the price of a bit) followed by a greedy fill of the remaining bits.

Clip search (``clip_search``): a group's min/max range is set by its largest values; narrowing it
to ``ratio x [min, max]`` (:data:`CLIP_RATIOS`, 1.0 down to 0.5) clips those and rounds the rest on
a finer grid. Each group keeps the ratio with the least sensitivity-weighted squared error, so the
search optimises the same error the group-size choice prices. The stored format is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adbatch.compress.recipe import GroupPolicy

__all__ = ["QuantizedRows", "quantize_rows", "quantize_fixed", "choose_group_sizes", "row_bits",
           "dequantize_rows"]

SCALE_ZERO_BITS = 32  # fp16 scale + fp16 zero per group
VALUE_BITS = 4
_MIN_SCALE = 2.0 ** -24  # smallest fp16 subnormal; keeps division finite for all-zero groups


@dataclass
class QuantizedRows:
    """INT4 kept values of a layer, in the layout :func:`kernels.nm_int4.pack_nm_int4` takes.

    ``q`` uint8 [N, Kk]; ``scale``/``zero`` fp16 [G] (rows in order, groups of a row consecutive);
    ``group_size`` int32 [N]; ``dequant`` float32 [N, Kk] (the values the packed format reproduces);
    ``error`` float64 [N] the sensitivity-weighted squared error per row.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: torch.Tensor
    dequant: torch.Tensor
    error: torch.Tensor

    @property
    def bits(self) -> int:
        return int(row_bits(self.q.shape[1], self.group_size).sum())


def row_bits(kept: int, group_size: torch.Tensor) -> torch.Tensor:
    """int64 [N]: bits of each row's INT4 values + scale/zero pairs."""
    groups = (kept + group_size.to(torch.int64) - 1) // group_size.to(torch.int64)
    return VALUE_BITS * kept + SCALE_ZERO_BITS * groups


#: range shrink factors the clip search tries per group (1.0 = the full min/max range); the grid of
#: AWQ's clip search (shrink down to half the range, 20 steps), read for the idea
CLIP_RATIOS = tuple(1.0 - 0.025 * k for k in range(21))


def quantize_fixed(values: torch.Tensor, group_size: int, weight: torch.Tensor | None = None,
                   clip_search: bool = False):
    """Quantize every row with the same group size.

    Args: values float [N, Kk]; group_size int; weight float [N, Kk] error weights (None = 1);
    clip_search: per group, try the ranges ``ratio x [min, max]`` for each ``ratio`` in
    :data:`CLIP_RATIOS` and keep the one with the least (weighted) squared error -- a narrower grid
    clips a group's outliers but rounds the rest finer; ratio 1.0 (plain min/max) is among them, so
    the error is never larger than without the search.
    Returns ``(q uint8 [N, Kk], scale fp16 [N, Gr], zero fp16 [N, Gr], dequant float32 [N, Kk],
    error float64 [N])`` with ``Gr = ceil(Kk / group_size)``.
    """
    if values.dim() != 2:
        raise ValueError(f"values: expected [N, Kk], got {tuple(values.shape)}")
    rows, kept = values.shape
    groups = -(-kept // group_size)
    padded = torch.zeros(rows, groups * group_size, dtype=torch.float32, device=values.device)
    padded[:, :kept] = values.float()
    g = padded.reshape(rows, groups, group_size)
    # padding is 0 and the range includes 0 anyway, so pads never move min/max
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)

    def grid(ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
        scale = ((hi - lo) * ratio / 15.0).clamp(min=_MIN_SCALE).half()
        zero = (-lo * ratio / scale.float()).clamp(0.0, 15.0).half()
        return scale, zero

    def dequant(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)  # quantize with the stored values
        q = torch.clamp(torch.round(g / s + z), 0, 15)
        return q, (q - z) * s

    scale, zero = grid(1.0)
    if clip_search:
        w = torch.zeros_like(padded)
        w[:, :kept] = 1.0 if weight is None else weight.float()
        w = w.reshape(rows, groups, group_size)  # pads weigh 0: their dequant is cut off below
        best = ((dequant(scale, zero)[1] - g).pow(2) * w).sum(-1)
        for ratio in CLIP_RATIOS[1:]:
            sc, zc = grid(ratio)
            err = ((dequant(sc, zc)[1] - g).pow(2) * w).sum(-1)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, sc, scale), torch.where(better, zc, zero)
    q, deq = dequant(scale, zero)
    deq = deq.reshape(rows, -1)[:, :kept]
    q = q.reshape(rows, -1)[:, :kept].to(torch.uint8)
    diff = (deq - values.float()).pow(2)
    if weight is not None:
        diff = diff * weight.float()
    error = diff.sum(dim=1, dtype=torch.float64)
    return q, scale, zero, deq, error


def _lagrangian_choice(err: torch.Tensor, bits: torch.Tensor, budget: float) -> torch.Tensor:
    """err float64 [S, N], bits int64 [S] per-row bits of each option -> long [N] option index with
    total bits <= budget (assumes the cheapest option fits)."""
    cheapest = int(torch.argmin(bits))
    b = bits.double().unsqueeze(1)

    def pick(lam: float) -> torch.Tensor:
        return torch.argmin(err + lam * b, dim=0)

    def total(ch: torch.Tensor) -> float:
        return float(bits[ch].sum())

    lo, hi = 0.0, 1.0
    if total(pick(lo)) <= budget:
        return pick(lo)
    scale = float(err.max()) + 1e-30
    hi = scale
    while total(pick(hi)) > budget and hi < scale * 2.0 ** 80:
        hi *= 2.0
    if total(pick(hi)) > budget:
        return torch.full((err.shape[1],), cheapest, dtype=torch.long, device=err.device)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if total(pick(mid)) <= budget:
            hi = mid
        else:
            lo = mid
    return pick(hi)


def choose_group_sizes(err: torch.Tensor, sizes: tuple[int, ...], kept: int, budget_bits: float) -> torch.Tensor:
    """Per-row group sizes minimizing the summed error under a bits budget.

    Args: err float64 [S, N] error of each row at each size in ``sizes`` (ascending); kept = Kk;
    budget_bits: total bits allowed for the layer's values + scales/zeros.
    Returns int32 [N] group sizes (total bits <= budget_bits whenever the largest size fits).
    """
    sizes_t = torch.tensor(sizes, dtype=torch.int64, device=err.device)
    bits = row_bits(kept, sizes_t)  # [S]
    idx = _lagrangian_choice(err, bits, budget_bits)
    used = float(bits[idx].sum())
    # greedy fill: move rows one size smaller (more groups) where it buys the most error per bit
    can = idx > 0
    if bool(can.any()):
        rows = torch.nonzero(can).squeeze(1)
        nxt = idx[rows] - 1
        gain = err[idx[rows], rows] - err[nxt, rows]
        cost = (bits[nxt] - bits[idx[rows]]).double()
        ratio = gain / cost.clamp(min=1.0)
        order = torch.argsort(-ratio, stable=True)
        cum = used + torch.cumsum(cost[order], 0)
        # the cumulative sum stays valid only for a prefix; cut at the first row that no longer fits
        fits = cum <= budget_bits
        first_bad = int(torch.nonzero(~fits)[0]) if bool((~fits).any()) else len(order)
        take = order[:first_bad]
        take = take[gain[take] > 0]
        idx = idx.clone()
        idx[rows[take]] = nxt[take]
    return sizes_t[idx].to(torch.int32)


def quantize_rows(values: torch.Tensor, weight: torch.Tensor | None, policy: GroupPolicy,
                  sizes: tuple[int, ...], reference_size: int, clip_search: bool = False) -> QuantizedRows:
    """Quantize a layer's kept values with uniform or adaptive per-row group sizes.

    Args:
        values: float [N, Kk] kept values (rows' kept values in ascending column order).
        weight: float [N, Kk] sensitivity weights ``G_r * H_col`` (None = 1).
        policy: :class:`GroupPolicy`; sizes: candidate sizes; reference_size: the uniform size whose
            bits bound the adaptive choice; clip_search: see :func:`quantize_fixed` (the adaptive choice
            then compares sizes at their searched ranges).
    Returns: :class:`QuantizedRows`.
    """
    rows, kept = values.shape
    policy = GroupPolicy(policy)
    if policy is GroupPolicy.UNIFORM:
        chosen = torch.full((rows,), reference_size, dtype=torch.int32, device=values.device)
        return _quantize_with_sizes(values, weight, chosen, clip_search)
    # every row at every size prices the choice; the chosen rows are then taken from these passes
    # (not quantized again: with the clip search a pass is 21 trial grids). The dequantized values
    # are not kept per size (4 float32 copies of the layer); they are rebuilt from q, scale, zero.
    sizes = tuple(sorted(sizes))
    per_size = {}
    for g in sizes:  # each size's float32 dequant is dropped at once: one layer copy alive, not four
        q, sc, zs, _, er = quantize_fixed(values, g, weight, clip_search)
        per_size[g] = (q, sc, zs, er)
    err = torch.stack([per_size[g][3] for g in sizes])  # [S, N]
    budget = float(row_bits(kept, torch.full((rows,), reference_size)).sum())
    chosen = choose_group_sizes(err, sizes, kept, budget)
    return _quantize_with_sizes(values, weight, chosen, clip_search, per_size)


def _quantize_with_sizes(values: torch.Tensor, weight: torch.Tensor | None, chosen: torch.Tensor,
                         clip_search: bool, per_size: dict[int, tuple] | None = None) -> QuantizedRows:
    """Rows quantized at their ``chosen`` sizes: from ``per_size`` (size -> ``quantize_fixed`` of every
    row at that size, as ``(q, scale, zero, error)``) when given, else by one pass per distinct size."""
    rows, kept = values.shape
    dev = values.device
    chosen = chosen.to(dev)
    q = torch.empty(rows, kept, dtype=torch.uint8, device=dev)
    deq = torch.empty(rows, kept, dtype=torch.float32, device=dev)
    error = torch.empty(rows, dtype=torch.float64, device=dev)
    groups = (kept + chosen.to(torch.int64) - 1) // chosen.to(torch.int64)
    ptr = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(groups, 0)
    scale = torch.empty(int(ptr[-1]), dtype=torch.float16, device=dev)
    zero = torch.empty(int(ptr[-1]), dtype=torch.float16, device=dev)
    # one vectorized pass per distinct size (at most 4), not per row
    for g in sorted(set(chosen.tolist())):
        sel = torch.nonzero(chosen == g).squeeze(1)
        if per_size is None:
            w = weight[sel] if weight is not None else None
            qs, sc, zs, dq, er = quantize_fixed(values[sel], int(g), w, clip_search)
        else:
            qs, sc, zs, er = (t[sel] for t in per_size[int(g)])
            # quantize_fixed's own arithmetic, (q - zero) * scale in float32: the same values bit for bit
            dq = (qs.float() - zs.float().repeat_interleave(int(g), 1)[:, :kept]) * sc.float().repeat_interleave(int(g), 1)[:, :kept]
        q[sel], deq[sel], error[sel] = qs, dq, er
        slots = (ptr[sel].unsqueeze(1) + torch.arange(sc.shape[1], device=dev).unsqueeze(0)).reshape(-1)
        scale[slots] = sc.reshape(-1)
        zero[slots] = zs.reshape(-1)
    return QuantizedRows(q=q, scale=scale, zero=zero, group_size=chosen.to(torch.int32), dequant=deq, error=error)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: torch.Tensor) -> torch.Tensor:
    """Inverse map of the format: q uint8 [N, Kk], scale/zero fp16 [G], group_size int32 [N] ->
    float32 [N, Kk] ``(q - zero) * scale``."""
    rows, kept = q.shape
    gs = group_size.to(torch.int64)
    groups = (kept + gs - 1) // gs
    ptr = torch.zeros(rows + 1, dtype=torch.int64, device=q.device)
    ptr[1:] = torch.cumsum(groups, 0)
    gidx = ptr[:-1].unsqueeze(1) + torch.arange(kept, device=q.device).unsqueeze(0) // gs.unsqueeze(1)
    return (q.float() - zero.float()[gidx]) * scale.float()[gidx]
