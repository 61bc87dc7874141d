"""Triton decode attention over a shared prompt prefix and per-beam suffixes found by ancestry.

One new token per *slot row* (a beam or sample) attends to (1) its query's prompt, stored once per
query, and (2) the tokens generated on its own path so far, which live in the rows of the beams that
generated them. Beam search never copies a cache row: step ``s`` writes its tokens' K/V into
``ks[s, slot]`` and every row keeps an *ancestry table* ``anc[row, s]`` = the slot that holds the
K/V of its path's token at position ``s``. Reordering beams is then a gather of this small integer
table (``anc_new = anc[parent]``), not of the cache.

Tensors (``R`` slot rows, ``B`` slots per query so row ``r`` belongs to query ``r // B``; ``kv``
key/value heads, ``H = kv * g`` query heads, head size ``D``):

- ``q``: ``[R, H, D]`` (fp16 / bf16; any strides with a unit last stride).
- ``kp, vp``: ``[Qmax, kv, Lp, D]`` the prompt region; ``p_bias Float32[Qmax, Lp]`` additive (0 on
  real prompt keys, -inf on left padding); ``p_pos Long[Qmax, Lp]`` the keys' positions and
  ``p_len Long[Qmax]`` the prompt lengths (the new token sits at ``p_len + t``; used by sliding windows).
- ``ks, vs``: ``[S, Rmax, kv, D]`` the suffix region of one layer; ``anc Int[Rmax, S]``;
  ``t Long[1]`` (on the device, so one captured graph serves every step): positions ``0..t`` are
  attended, ``t`` being the token written this step.

Scores and the softmax are float32 (online softmax, one pass over prompt then suffix). Per program:
one query and one kv head; its ``B * g`` (beam, head) pairs are the rows of one tile, so the prompt's
keys are read once per query (a ``tl.dot`` tile, the beams acting as extra query heads), and the
suffix as gathered tiles of a few positions of every beam of the query (a second ``tl.dot``, each
tile row masked to its own beam's keys: B-fold redundant math on tensor cores instead of per-row
dot products).

:func:`decode_attention_reference` is the pure-torch reference (CPU path and tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(
    q_ptr, kp_ptr, vp_ptr, pb_ptr, ppos_ptr, plen_ptr, ks_ptr, vs_ptr, anc_ptr, t_ptr, out_ptr,
    s_qr, s_qh,                      # q strides (row, head); last stride 1
    s_pq, s_ph, s_pl,                # kp / vp strides (query, head, position); last stride 1
    s_bq,                            # p_bias / p_pos stride (query)
    s_ss, s_sr, s_sh,                # ks / vs strides (position, row, head); last stride 1
    s_ar,                            # anc stride (row)
    s_or, s_oh,                      # out strides (row, head)
    Lp, scale, window,
    B: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
    PRECISION: tl.constexpr,
):
    qi = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)        # (beam, head-in-group) pairs of this tile
    m_ok = offs_m < B * G
    beam = offs_m // G
    head = h * G + offs_m % G
    row = qi * B + beam
    offs_d = tl.arange(0, D)
    t = tl.load(t_ptr)
    plen = tl.load(plen_ptr + qi)
    qpos = plen + t

    q = tl.load(q_ptr + row[:, None] * s_qr + head[:, None] * s_qh + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # prompt: keys [Lp - plen, Lp) are real (left padding); start at the block holding the first
    start = ((Lp - plen) // BLOCK_N) * BLOCK_N
    kp_base = kp_ptr + qi * s_pq + h * s_ph
    vp_base = vp_ptr + qi * s_pq + h * s_ph
    for n0 in range(start, Lp, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Lp
        k = tl.load(kp_base + offs_n[:, None] * s_pl + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        bias = tl.load(pb_ptr + qi * s_bq + offs_n, mask=n_ok, other=float("-inf"))
        if window > 0:
            kpos = tl.load(ppos_ptr + qi * s_bq + offs_n, mask=n_ok, other=0)
            bias = tl.where(qpos - kpos >= window, float("-inf"), bias)
        s = s + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a tile whose keys are all masked so far keeps m = -inf: guard the exp against nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vp_base + offs_n[:, None] * s_pl + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # suffix: position s of row r's path lives in slot anc[r, s]. Per iteration the K/V of BLOCK_S
    # positions of ALL the query's beams are gathered as one [BLOCK_J = B_PAD * BLOCK_S, D] tile,
    # so both products are tensor-core dots; a tile row (beam b, head) keeps only beam b's keys.
    # (Per-row dot products on [rows, BLOCK_S, D] tiles took 46-48 % of a 10,240-row step.)
    s_first = tl.where(window > 0, tl.maximum(t - window + 1, 0), 0)
    offs_j = tl.arange(0, BLOCK_J)
    beam_j = offs_j // BLOCK_S
    pos_j = offs_j % BLOCK_S
    row_j = qi * B + beam_j
    own = beam[:, None] == beam_j[None, :]                                   # [M, J]
    for s0 in range(s_first, t + 1, BLOCK_S):
        s_j = s0 + pos_j
        j_ok = (beam_j < B) & (s_j <= t)
        src = tl.load(anc_ptr + row_j * s_ar + s_j, mask=j_ok, other=0).to(tl.int64)
        off = s_j.to(tl.int64)[:, None] * s_ss + src[:, None] * s_sr + h * s_sh + offs_d[None, :]
        k = tl.load(ks_ptr + off, mask=j_ok[:, None], other=0.0)            # [J, D]
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale     # [M, J]
        sc = tl.where(own & j_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))   # finite: every block holds each beam's position <= t
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vs_ptr + off, mask=j_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + row[:, None] * s_or + head[:, None] * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def _tile_rows(pairs: int) -> int:
    """Rows of one tile: all (beam, head) pairs of a query up to 64, at least 16 (``tl.dot``)."""
    return min(max(16, triton.next_power_of_2(pairs)), 64)


def decode_attention(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, p_bias: torch.Tensor,
                     p_pos: torch.Tensor, p_len: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                     anc: torch.Tensor, t: torch.Tensor, beams: int, scaling: float, window: int = 0,
                     out: torch.Tensor | None = None, block_j: int = 128, num_warps: int | None = None,
                     num_stages: int = 2) -> torch.Tensor:
    """Attention of ``R = Qb * beams`` one-token rows (see the module docstring for the tensors).

    ``kp/vp/p_bias/p_pos/p_len`` are read for queries ``0..Qb-1``; ``ks/vs/anc`` for rows
    ``0..R-1`` (and the slots their ancestry names). ``window > 0``: keys at distance ``>= window``
    from the new token are masked (sliding-window layers). Returns ``out [R, H, D]`` in q's dtype.
    Graph-safe: no host reads of device tensors. ``block_j`` (gathered (beam, position) keys per
    suffix iteration), ``num_warps`` (None: 2 when there are >= 512 programs, else 4), ``num_stages``:
    the launch configuration. Defaults from ``bench/step_profile.py --attention-sweep`` on the H200
    (bench/results/step_profile_*_engine3*.md): 128 / 2 / 2 took 113 us per layer at 10,240 rows of
    the default model vs 179 us for the first kernel's 64 / 4 / default; 128 / 4 / 2 best at 640
    rows (13.8 vs 18.0 us) and on the 8B shape at 8-128 rows.
    """
    R, H, D = q.shape
    kv = kp.shape[1]
    if R % beams or H % kv:
        raise ValueError(f"rows {R} not a multiple of beams {beams}, or heads {H} of kv heads {kv}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head size {D} must be a power of two >= 16")
    for name, x in (("q", q), ("kp", kp), ("vp", vp), ("ks", ks), ("vs", vs)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    if kp.stride() != vp.stride() or ks.stride() != vs.stride() or p_bias.stride() != p_pos.stride():
        raise ValueError("kp/vp, ks/vs and p_bias/p_pos must share strides")
    Qb, g = R // beams, H // kv
    if out is None:
        out = torch.empty(R, H, D, device=q.device, dtype=q.dtype)
    block_m = _tile_rows(beams * g)
    b_pad = triton.next_power_of_2(beams)
    block_s = max(1, block_j // b_pad)    # a [>= block_j, D] tile of (beam, position) keys per iteration
    grid = (Qb, kv, triton.cdiv(beams * g, block_m))
    if num_warps is None:
        num_warps = 2 if Qb * kv >= 512 else 4
    _decode_attention_kernel[grid](
        q, kp, vp, p_bias, p_pos, p_len, ks, vs, anc, t, out,
        q.stride(0), q.stride(1), kp.stride(0), kp.stride(1), kp.stride(2), p_bias.stride(0),
        ks.stride(0), ks.stride(1), ks.stride(2), anc.stride(0), out.stride(0), out.stride(1),
        kp.shape[2], float(scaling), int(window),
        B=beams, G=g, D=D, BLOCK_M=block_m, BLOCK_N=min(64, max(16, triton.next_power_of_2(kp.shape[2]))),
        BLOCK_S=block_s, BLOCK_J=block_s * b_pad,
        # fp32 models get fp32 products (Triton's default for fp32 dots is TF32: ~1e-3 relative,
        # which measured as 5e-3 score differences against HF's fp32 forward on the H200)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    return out


def gather_suffix(ks: torch.Tensor, anc: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """The K (or V) of each row's path at positions ``0..length-1``: ``ks [S, Rmax, kv, D]``,
    ``anc Int[Rmax, S]``, ``rows Long[N]`` -> ``[N, kv, length, D]``."""
    pos = torch.arange(length, device=ks.device)
    return ks[pos[None, :], anc[rows, :length].long()].transpose(1, 2)


def decode_attention_reference(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, p_bias: torch.Tensor,
                               p_pos: torch.Tensor, p_len: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                               anc: torch.Tensor, t: int, beams: int, scaling: float, window: int = 0,
                               rows: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch :func:`decode_attention` (``t`` a Python int), also over a subset of slot rows:
    ``rows: Long[n]`` (distinct; default all ``Qb * beams``) with ``q [n, H, D]``. One float32
    softmax over the query's prompt and the row's path ``0..t``.

    The prompt keys are read once per query, as the kernel does: the rows are scattered into a
    ``[Qb, beams]`` grid whose beams act as extra query heads of one matmul per query (on CPU,
    a copy of the prompt's K/V for every row plus the concatenation took ~20 % of a profiled step)."""
    n, H, D = q.shape
    Qb, kv, Lp = kp.shape[0], kp.shape[1], kp.shape[2]
    g, R = H // kv, Qb * beams
    rows = torch.arange(n, device=q.device) if rows is None else rows
    q_of = rows // beams

    def per_query(x: torch.Tensor) -> torch.Tensor:  # [n, kv, g, X] rows -> [Qb, kv, beams * g, X]
        grid = x.new_zeros(R, *x.shape[1:])
        grid[rows] = x
        return grid.view(Qb, beams, kv, g, -1).permute(0, 2, 1, 3, 4).reshape(Qb, kv, beams * g, -1)

    def per_row(x: torch.Tensor) -> torch.Tensor:  # the inverse
        return x.view(Qb, kv, beams, g, -1).permute(0, 2, 1, 3, 4).reshape(R, kv, g, -1)[rows]

    qf = q.float().view(n, kv, g, D)
    p_mask = p_bias
    if window > 0:
        p_mask = torch.where((p_len + t)[:, None] - p_pos >= window, float("-inf"), p_bias)
    sp = per_row(torch.matmul(per_query(qf), kp.float().transpose(-1, -2)))   # [n, kv, g, Lp]
    sp = sp * scaling + p_mask[q_of][:, None, None, :]
    kpath, vpath = gather_suffix(ks, anc, rows, t + 1), gather_suffix(vs, anc, rows, t + 1)  # [n, kv, t+1, D]
    ss = torch.matmul(qf, kpath.float().transpose(-1, -2)) * scaling          # [n, kv, g, t+1]
    if window > 0:
        ss = ss.masked_fill(t - torch.arange(t + 1, device=q.device) >= window, float("-inf"))
    prob = torch.cat([sp, ss], -1).softmax(-1)
    o = per_row(torch.matmul(per_query(prob[..., :Lp]), vp.float())) + torch.matmul(prob[..., Lp:], vpath.float())
    return o.reshape(n, H, D).to(q.dtype)


# ---------------------------------------------------------------------------------- CPU row steps
# On the CPU a decode step runs only the rows still decoded on, and its time is the op count as much
# as the math: the reference above is ~35 small ops per layer (scatter / permute / gather copies, two
# products per part, a concatenated softmax), which cost a 135M model more per step than the old
# engine's whole attention (one SDPA over a per-row cache) on the 2-core VM. The function below does
# the same math in 5-12 ops per layer, with every index computed once per step (RowGather).

# Prompt attention on the per-query grid from this many rows on, if they fill at least a quarter of
# the grid (Qb * beams rows; empty slots cost compute there): below, copying each row's prompt K/V
# is cheaper than the grid's fixed cost (measured, one-layer attention on the 2-core VM, 1-2 threads:
# 4 rows of 1 query 0.31 vs 0.49 ms; 16 of 16 queries x 8 beams 1.2 vs 2.4 ms; 32 of 64 grid rows
# 2.0 vs 2.6 ms the other way; 128 of 128: 6-10 vs 15-26 ms).
GRID_MIN_ROWS = 16
GRID_MIN_FILL = 0.25


@dataclass
class RowGather:
    """Per-step indices of :func:`decode_attention_rows`, shared by every layer of one step.

    ``rows Long[n]`` the slot rows (distinct), ``q_of / b_of Long[n]`` their query row and beam,
    ``suffix Long[n * (t + 1)]`` the flat index ``s * Rmax + anc[row, s]`` of each row's path K/V
    in one layer's ``ks.view(S * Rmax, kv, D)``, ``t`` the suffix position being written, ``grid``
    the prompt-attention layout (see :data:`GRID_MIN_ROWS`), ``masks`` the additive masks of the
    per-row layout by sliding window, built on first use.
    """

    rows: torch.Tensor
    q_of: torch.Tensor
    b_of: torch.Tensor
    suffix: torch.Tensor
    t: int
    queries: int
    beams: int
    grid: bool
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


def row_gather(anc: torch.Tensor, rows: torch.Tensor, t: int, beams: int, queries: int) -> RowGather:
    """Indices for a step of slot ``rows: Long[n]`` at suffix position ``t`` over ``queries`` query
    rows of ``beams`` slots (``anc Int[Rmax, S]``, its rows' entries ``0..t`` already set)."""
    n, rmax = rows.shape[0], anc.shape[0]
    pos = torch.arange(t + 1, device=rows.device) * rmax
    suffix = (pos[None, :] + anc[rows, : t + 1]).reshape(-1)              # int32 + long -> long
    grid = (rows.device.type == "cpu" and n >= GRID_MIN_ROWS and n >= GRID_MIN_FILL * queries * beams
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))
    return RowGather(rows, rows // beams, rows % beams, suffix, t, queries, beams, grid)


def decode_attention_rows(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, p_bias: torch.Tensor,
                          p_pos: torch.Tensor, p_len: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                          idx: RowGather, scaling: float, window: int = 0) -> torch.Tensor:
    """:func:`decode_attention_reference` for rows ``idx.rows`` (``q [n, H, D]``), on the CPU.

    ``kp, vp [Qb, kv, Lp, D]`` (``Qb = idx.queries``), ``ks, vs [S, Rmax, kv, D]`` contiguous (one
    layer's suffix region). Scores and softmax in float32, returns ``[n, H, D]`` in q's dtype.
    Two layouts, the same math:

    - per row: the row's prompt K/V (a copy) and path K/V concatenated, one SDPA with an additive
      mask (padding, sliding window);
    - grid (many rows, no window): the prompt part as one SDPA per query whose beams are extra query
      rows (the prompt read once per query, no copy), the path part as one SDPA per row, merged by
      their log-sum-exps (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` returns
      them). A fully masked prompt would come back with a log-sum-exp of 0 there, so sliding-window
      layers always take the per-row layout (its keys include the new token: never fully masked).
    """
    n, H, D = q.shape
    Qb, kv = kp.shape[0], kp.shape[1]
    g, t, B = H // kv, idx.t, idx.beams
    if Qb != idx.queries:
        raise ValueError(f"prompt region holds {Qb} query rows, the step's indices {idx.queries}")
    S, rmax = ks.shape[0], ks.shape[1]
    qf = q.float().view(n, kv, g, D)
    ksuf = ks.view(S * rmax, kv, D).index_select(0, idx.suffix).view(n, t + 1, kv, D).transpose(1, 2)
    vsuf = vs.view(S * rmax, kv, D).index_select(0, idx.suffix).view(n, t + 1, kv, D).transpose(1, 2)
    ksuf, vsuf = ksuf.float(), vsuf.float()
    if idx.grid and window == 0:
        grid = qf.new_zeros(Qb, kv, B, g, D)
        grid[idx.q_of, :, idx.b_of] = qf
        op, lp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            grid.view(Qb, kv, B * g, D), kp.float(), vp.float(), attn_mask=p_bias[:, None, None, :],
            scale=scaling)
        op = op.view(Qb, kv, B, g, D)[idx.q_of, :, idx.b_of]                    # [n, kv, g, D]
        lp = lp.view(Qb, kv, B, g)[idx.q_of, :, idx.b_of]                       # [n, kv, g]
        os_, ls = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, ksuf, vsuf, scale=scaling)
        w = torch.stack([lp, ls]).softmax(0)[..., None]                         # [2, n, kv, g, 1]
        return torch.addcmul(op * w[0], os_, w[1]).view(n, H, D).to(q.dtype)
    mask = idx.masks.get(window)
    if mask is None:
        p_mask = p_bias
        if window > 0:
            p_mask = torch.where((p_len + t)[:, None] - p_pos >= window, float("-inf"), p_bias)
        s_mask = torch.zeros(t + 1, device=q.device)
        if window > 0:
            s_mask = s_mask.masked_fill(t - torch.arange(t + 1, device=q.device) >= window, float("-inf"))
        mask = torch.cat([p_mask[idx.q_of], s_mask.expand(n, t + 1)], 1)[:, None, None, :]
        idx.masks[window] = mask
    kk = torch.cat([kp.index_select(0, idx.q_of).float(), ksuf], 2)             # [n, kv, Lp + t + 1, D]
    vv = torch.cat([vp.index_select(0, idx.q_of).float(), vsuf], 2)
    o = F.scaled_dot_product_attention(qf, kk, vv, attn_mask=mask, scale=scaling)
    return o.reshape(n, H, D).to(q.dtype)


__all__ = ["decode_attention", "decode_attention_reference", "decode_attention_rows", "gather_suffix",
           "row_gather", "RowGather"]
