"""Device code of the SparseGemv *GEMV* kernel, :func:`_nm_int4_gemv_kernel`: ``y[B, N] = x[B, K] @ W.T``
with W in :class:`~kernels.nm_int4.PackedNMInt4` (format version 2), for batch tiles of 1, 2, 4 or 8 rows.

Its unit of work ("element") is 16 kept values of one output row: two ``qweight`` words and one ``qpos``
word. Per element, one inline-PTX block (shared by the batch rows of the tile) dequantizes all 16 values
into 8 packed fp16x2 (bf16x2) pairs ``q - zero`` -- a shift and one ``lop3`` put each nibble pair into
the mantissas of ``16.0``, one ``sub.f16x2`` subtracts ``16 + zero`` -- and builds the 8 ``prmt``
selectors of the kept positions (a shift, an ``and`` and one ``mad`` per two pairs). Per batch row a
second block picks the activations of each kept pair with one ``prmt`` (2:4; two and a merge for 1:4;
none for dense) and multiply-adds the 8 pairs with ``fma.f16x2``, so each product costs half an
instruction; the 16 products are summed in fp16x2 and leave the block as one fp32 value, scaled in
fp32 and accumulated in fp32 across the K loop (``fp16 partial sums of 16 products, fp32 beyond``).
Under ``TRITON_INTERPRET=1`` the constexpr ``ASM`` selects an emulation with the same bit operations
and fp16/bf16 rounding after every packed operation (see :mod:`kernels.int4_common`, which also holds
the split-K output write).

Grid: ``(cdiv(N, BLOCK_N), n_split, cdiv(B, BLOCK_B))``. Launched by :mod:`kernels.int4_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_common import _emu_fma2, _emu_nibble_pair, _f32_to_half, _finish, _half_to_f32, _prmt_emul, _row_groups, _sz_word


_ZZ_ASM = tl.constexpr(  # $0 = fp16 (16 + zero) in both halves; $1 = (scale, zero) word: one HADD2 of the high half
    "{ .reg .b16 l, h; .reg .b32 c; mov.b32 {l, h}, $1; mov.b32 $0, {h, h}; mov.b32 c, 0x4C004C00; add.rn.f16x2 $0, $0, c; }")


@triton.jit
def _gemv_scale(sz_ptr, gp0, gp_last, gsh, kk_first, row_mask, EVEN: tl.constexpr, ASM: tl.constexpr):
    """GEMV operands of each row's group at kept offset ``kk_first``: ``(scale fp32, zz)``, zz = fp16
    ``16 + zero`` in both halves. With EVEN (every row valid, ``kk_first < KP``) the load needs no mask
    and no clamp: a row's ``ceil(Kk / g)`` groups cover every kept offset below ``KP = ceil(Kk / 32) * 32``
    because g is a multiple of 32; the clamp of :func:`_sz_word` only guards the prefetch past the end."""
    if EVEN:
        v = tl.load(sz_ptr + gp0 + (kk_first >> gsh))
    else:
        v = _sz_word(sz_ptr, gp0, gp_last, gsh, kk_first, row_mask)
    s = _half_to_f32(v, False)
    if ASM:
        zz = tl.inline_asm_elementwise(asm=_ZZ_ASM, constraints="=r,r", args=[v], dtype=tl.int32, is_pure=True, pack=1)
    else:
        zz = _f32_to_half(_half_to_f32(v >> 16, False) + 16.0, False)
        zz = zz | (zz << 16)
    return s, zz


# ---- GEMV building blocks: inline PTX on the GPU, a bit-for-bit emulation under the interpreter -------
# ``ASM`` is a constexpr fixed at trace time: True when compiling for the GPU, False under
# TRITON_INTERPRET=1 (the interpreter cannot run PTX). The emulation performs the same integer
# operations (masks, shifts, byte permutes) and rounds to fp16/bf16 after every packed operation.

def _dq_asm(bf16: bool) -> str:
    """PTX: $0..$7 = packed pairs (q - zero) of words $8 (pairs 0-3) and $9 (pairs 4-7); $10 = zz."""
    if bf16:  # bf16 16.0 = 0x4180; 7 mantissa bits: nibble at bits 3..6 makes 16 + q
        mask, magic, sub = 0x00780078, 0x41804180, "sub.rn.bf16x2"
        ops = [("shl.b32", 3), ("shr.u32", 1), ("shr.u32", 5), ("shr.u32", 9)]
    else:  # fp16 16.0 = 0x4C00; 10 mantissa bits: nibble at bits 6..9 makes 16 + q
        mask, magic, sub = 0x03C003C0, 0x4C004C00, "sub.rn.f16x2"
        ops = [("shl.b32", 6), ("shl.b32", 2), ("shr.u32", 2), ("shr.u32", 6)]
    body = []
    for w in range(2):
        for t, (op, amount) in enumerate(ops):
            body.append(f"{op} t, ${8 + w}, {amount}; lop3.b32 t, t, {mask:#010x}, {magic:#010x}, 0xEA; "
                        f"{sub} ${4 * w + t}, t, $10;")
    return "{ .reg .b32 t; " + " ".join(body) + " }"


_DQ_ASM_F16 = tl.constexpr(_dq_asm(False))
_DQ_ASM_BF16 = tl.constexpr(_dq_asm(True))
_SEL_ASM = tl.constexpr(  # $0..$7 = prmt selectors of the 8 kept pairs of position word $8
    "{ .reg .b32 u; "
    + " ".join(
        ("and.b32 u, $8, 0x03030303; " if t == 0 else f"shr.u32 u, $8, {2 * t}; and.b32 u, u, 0x03030303; ")
        + f"mad.lo.u32 ${t}, u, 0x22, 0x10101010; shr.u32 ${4 + t}, ${t}, 16;"
        for t in range(4)
    )
    + " }"
)


def _row_asm(nkeep: int, bf16: bool) -> str:
    """PTX: $0 = fp32 sum over the 8 pairs of d_i * x_i, where d_i = $(1+i) (fp16x2 q - zero) and x_i is
    the activation pair of kept pair i: for dense $(9+i); for 2:4 ``prmt(lo_i, hi_i, sel_i)`` over the
    column group's 4 activations (lo_i = $(17+2i), hi_i = $(18+2i), sel_i = $(9+i)); for 1:4 the two kept
    values of a pair live in column groups 2i and 2i+1 (lo/hi = $(17+4i)..$(20+4i)): one prmt each, one
    prmt merges. fp16 activations: ``fma.f16x2`` (half an instruction per product), summed in fp16x2 and
    converted once. bf16 activations: bf16 products would lose too much (8-bit mantissa), so the weights
    are converted to fp32 (``cvt``), the activations by a shift / mask (bf16 is the top half of fp32),
    and accumulated with fp32 FMA."""
    body = []
    for i in range(8):
        if nkeep == 4:
            xp = f"${9 + i}"
        elif nkeep == 2:
            body.append(f"prmt.b32 p, ${17 + 2 * i}, ${18 + 2 * i}, ${9 + i};")
            xp = "p"
        else:
            body.append(f"prmt.b32 a, ${17 + 4 * i}, ${18 + 4 * i}, ${9 + i}; "
                        f"prmt.b32 b, ${19 + 4 * i}, ${20 + 4 * i}, ${9 + i}; prmt.b32 p, a, b, 0x7610;")
            xp = "p"
        if bf16:
            body.append(f"mov.b32 {{l, h}}, ${1 + i}; cvt.f32.f16 wl, l; cvt.f32.f16 wh, h; "
                        f"shl.b32 xl, {xp}, 16; and.b32 xh, {xp}, 0xFFFF0000; "
                        + ("mul.rn.f32 facc, wl, xl; " if i == 0 else "fma.rn.f32 facc, wl, xl, facc; ")
                        + "fma.rn.f32 facc, wh, xh, facc;")
        elif i == 0:
            body.append(f"mul.rn.f16x2 acc, ${1 + i}, {xp};")
        else:
            body.append(f"fma.rn.f16x2 acc, ${1 + i}, {xp}, acc;")
    if bf16:
        body.append("mov.b32 $0, facc;")
        decl = "{ .reg .b32 p, a, b, xl, xh; .reg .b16 l, h; .reg .f32 wl, wh, facc; "
    else:
        body.append("mov.b32 {l, h}, acc; cvt.f32.f16 fl, l; cvt.f32.f16 fh, h; add.f32 $0, fl, fh;")
        decl = "{ .reg .b32 p, a, b, acc; .reg .b16 l, h; .reg .f32 fl, fh; "
    return decl + " ".join(body) + " }"


_ROW_ASM_4_F16 = tl.constexpr(_row_asm(4, False))
_ROW_ASM_4_BF16 = tl.constexpr(_row_asm(4, True))
_ROW_ASM_2_F16 = tl.constexpr(_row_asm(2, False))
_ROW_ASM_2_BF16 = tl.constexpr(_row_asm(2, True))
_ROW_ASM_1_F16 = tl.constexpr(_row_asm(1, False))
_ROW_ASM_1_BF16 = tl.constexpr(_row_asm(1, True))


@triton.jit
def _emu_sub2(t, zz, IS_BF16: tl.constexpr):
    lo = _f32_to_half(_half_to_f32(t, IS_BF16) - _half_to_f32(zz, IS_BF16), IS_BF16)
    hi = _f32_to_half(_half_to_f32(t >> 16, IS_BF16) - _half_to_f32(zz >> 16, IS_BF16), IS_BF16)
    return lo | (hi << 16)


@triton.jit
def _dequant16(w0, w1, zz, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """8 int32 holding packed (q - zero) pairs of the 16 kept values in value words w0 (pairs 0-3) and w1
    (pairs 4-7); ``zz`` = 16 + zero in both halves."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_DQ_ASM_BF16 if IS_BF16 else _DQ_ASM_F16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", args=[w0, w1, zz],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )
    else:
        return (
            _emu_sub2(_emu_nibble_pair(w0, 0, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w0, 1, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w0, 2, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w0, 3, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w1, 0, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w1, 1, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w1, 2, IS_BF16), zz, IS_BF16),
            _emu_sub2(_emu_nibble_pair(w1, 3, IS_BF16), zz, IS_BF16),
        )


@triton.jit
def _emu_sel(pw, t: tl.constexpr):
    u = ((pw.to(tl.uint32, bitcast=True) >> (2 * t)).to(tl.int32, bitcast=True) & 0x03030303) * 0x22 + 0x10101010
    return u, (u.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)


@triton.jit
def _selectors16(pw, ASM: tl.constexpr):
    """8 prmt selectors (low 16 bits) of the kept pairs of position word ``pw``: byte j of selector i is
    ``0x22 * p + 0x10`` for the position p of value j of pair i (the nibbles of half p)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_SEL_ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[pw],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )
    else:
        a0, b0 = _emu_sel(pw, 0)
        a1, b1 = _emu_sel(pw, 1)
        a2, b2 = _emu_sel(pw, 2)
        a3, b3 = _emu_sel(pw, 3)
        return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _x_pick(x_lo, x_hi, i: tl.constexpr, sel, NKEEP: tl.constexpr):
    """Emulation: activation pair of kept pair i (see _row_asm); x_lo/x_hi are tuples of int32."""
    if NKEEP == 4:
        return x_lo[i]
    elif NKEEP == 2:
        return _prmt_emul(x_lo[i], x_hi[i], sel)
    else:
        a = _prmt_emul(x_lo[2 * i], x_hi[2 * i], sel)
        b = _prmt_emul(x_lo[2 * i + 1], x_hi[2 * i + 1], sel)
        return (a & 0xFFFF) | (b & -65536)


@triton.jit
def _x_row(x64_row, kk_e, kmask, G, NKEEP: tl.constexpr, EVEN: tl.constexpr):
    """The activations element ``kk_e`` ([E, 1], first kept index) needs from one x row (int64 words of 4
    activations), as tuples (lo words, hi words): dense 4 words (x pairs in order), 2:4 8 column groups,
    1:4 16 column groups. ``G`` is the number of int64 words in a row (K / 4); past it: zeros."""
    if NKEEP == 4:
        g0 = kk_e // 4
        NW: tl.constexpr = 4
    elif NKEEP == 2:
        g0 = kk_e // 2
        NW: tl.constexpr = 8
    else:
        g0 = kk_e
        NW: tl.constexpr = 16
    lo = ()
    hi = ()
    for j in tl.static_range(NW):
        if EVEN:  # no padding and whole steps: every word exists
            v = tl.load(x64_row + g0 + j)
        else:
            v = tl.load(x64_row + g0 + j, mask=kmask & (g0 + j < G), other=0)
        lo = lo + (v.to(tl.int32),)
        hi = hi + ((v >> 32).to(tl.int32),)
    if NKEEP == 4:  # words 0..3 hold pairs (0,1),(2,3) | (4,5),(6,7) | ...: pair i = half i % 2 of word i // 2
        lo = (lo[0], hi[0], lo[1], hi[1], lo[2], hi[2], lo[3], hi[3])
    return lo, hi


@triton.jit
def _interleave(lo, hi, COUNT: tl.constexpr):
    """(lo[0], hi[0], lo[1], hi[1], ...) over the first COUNT entries: the x operands of _row_asm."""
    xs = ()
    for i in tl.static_range(COUNT):
        xs = xs + (lo[i], hi[i])
    return xs


@triton.jit
def _row_dot16(d, sel, x_lo, x_hi, NKEEP: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """fp32 sum of the 16 products of one element with one x row (fp16x2 / bf16x2 partial sums)."""
    if ASM:
        if NKEEP == 4:
            return tl.inline_asm_elementwise(
                asm=_ROW_ASM_4_BF16 if IS_BF16 else _ROW_ASM_4_F16, constraints="=r" + ",r" * 16, args=d + x_lo,
                dtype=tl.float32, is_pure=True, pack=1)
        elif NKEEP == 2:
            xs = _interleave(x_lo, x_hi, 8)
            return tl.inline_asm_elementwise(
                asm=_ROW_ASM_2_BF16 if IS_BF16 else _ROW_ASM_2_F16, constraints="=r" + ",r" * 32, args=d + sel + xs,
                dtype=tl.float32, is_pure=True, pack=1)
        else:
            xs = _interleave(x_lo, x_hi, 16)
            return tl.inline_asm_elementwise(
                asm=_ROW_ASM_1_BF16 if IS_BF16 else _ROW_ASM_1_F16, constraints="=r" + ",r" * 48, args=d + sel + xs,
                dtype=tl.float32, is_pure=True, pack=1)
    elif IS_BF16:
        xp = _x_pick(x_lo, x_hi, 0, sel[0], NKEEP)
        acc = _half_to_f32(d[0], False) * _half_to_f32(xp, True)
        acc += _half_to_f32(d[0] >> 16, False) * _half_to_f32(xp >> 16, True)
        for i in tl.static_range(1, 8):
            xp = _x_pick(x_lo, x_hi, i, sel[i], NKEEP)
            acc += _half_to_f32(d[i], False) * _half_to_f32(xp, True)
            acc += _half_to_f32(d[i] >> 16, False) * _half_to_f32(xp >> 16, True)
        return acc
    else:
        acc = _emu_fma2(d[0], _x_pick(x_lo, x_hi, 0, sel[0], NKEEP), tl.zeros_like(d[0]), False)
        for i in tl.static_range(1, 8):
            acc = _emu_fma2(d[i], _x_pick(x_lo, x_hi, i, sel[i], NKEEP), acc, False)
        return _half_to_f32(acc, False) + _half_to_f32(acc >> 16, False)


@triton.jit
def _row_step(acc, x64_row, kk_e, kmask, G, d, sel, s, NKEEP: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr,
              EVEN: tl.constexpr):
    x_lo, x_hi = _x_row(x64_row, kk_e, kmask, G, NKEEP, EVEN)
    return acc + s * _row_dot16(d, sel, x_lo, x_hi, NKEEP, IS_BF16, ASM)


@triton.jit
def _gemv_stage(qw_ptr, qp_ptr, sz_ptr, gp0, gp_last, gsh, kk0, e_idx, col, nm2, k_hi, N,
                NKEEP: tl.constexpr, BLOCK_KK: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """Global loads of one K step: value words (w0, w1), position word, and the per-element scale and
    16 + zero (gathered as [1, BLOCK_N] rows per 32-value sub-block and spread over the elements by
    selects: a gather of the element shape makes Triton 3.6 pick a transposed layout and shuttle the
    dequantized pairs through shared memory, 12-16 layout conversions per step)."""
    kk_e = kk0 + 16 * e_idx
    w_off = (kk_e // 8) * N + col
    if EVEN:  # no masks: no zero-fill of the destination registers, no predicates
        w0 = tl.load(qw_ptr + w_off)
        w1 = tl.load(qw_ptr + w_off + N)
        if NKEEP == 4:
            pw = w0
        else:
            pw = tl.load(qp_ptr + (kk_e // 16) * N + col)
    else:
        m2 = (kk_e < k_hi) & nm2
        w0 = tl.load(qw_ptr + w_off, mask=m2, other=0)
        w1 = tl.load(qw_ptr + w_off + N, mask=m2, other=0)
        if NKEEP == 4:
            pw = w0
        else:
            pw = tl.load(qp_ptr + (kk_e // 16) * N + col, mask=m2, other=0)
    s, zz = _gemv_scale(sz_ptr, gp0, gp_last, gsh, kk0, nm2, EVEN, ASM)
    for sb in tl.static_range(1, BLOCK_KK // 32):
        s_b, zz_b = _gemv_scale(sz_ptr, gp0, gp_last, gsh, kk0 + 32 * sb, nm2, EVEN, ASM)
        in_b = e_idx >= 2 * sb
        s = tl.where(in_b, s_b, s)
        zz = tl.where(in_b, zz_b, zz)
    return w0, w1, pw, s, zz


@triton.jit(do_not_specialize=["B", "part_stride"])
def _nm_int4_gemv_kernel(
    x64_ptr,  # [B, K] fp16/bf16 activations viewed as int64 [B, K/4], row stride stride_x64
    qw_ptr,  # int32 [KP/8, N]
    qp_ptr,  # int32 [KP/16, N] (unused when NKEEP == 4)
    sz_ptr,  # int32 [G] (= fp16 [G, 2] scale_zero)
    gptr_ptr,  # int32 [N+1]
    gshift_ptr,  # int32 [N]
    bias_ptr,  # [N] or dummy
    out_ptr,  # [B, N] in x's dtype
    part_ptr,  # fp32 split-K scratch (SPLIT)
    cnt_ptr,  # int32 per-tile counters (SPLIT), zero between launches
    B,
    N,
    G4,  # K / 4: int64 words per x row
    KP,
    stride_x64,
    stride_ob,
    kk_per_split,
    n_split,
    part_stride,
    NKEEP: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 1, 2, 4 or 8 activation rows sharing the dequantized weights
    BLOCK_N: tl.constexpr,
    BLOCK_KK: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_BF16: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (GPU) or its emulation (interpreter)
    EVEN: tl.constexpr,  # N % BLOCK_N == 0, KP % BLOCK_KK == 0, no padding: no load masks at all
):
    """GEMV path; see the module docstring. Every tensor in the loop has the 2-D element shape
    ``[BLOCK_KK / 16, BLOCK_N]`` (one element = 16 kept values of one row), so nothing needs a layout
    shuffle; the one cross-thread reduction happens after the loop."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2)
    E: tl.constexpr = BLOCK_KK // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    n_mask = offs_n < N
    nm2 = n_mask[None, :]
    gp0, gp_last, gsh = _row_groups(gptr_ptr, gshift_ptr, offs_n[None, :], nm2)
    e_idx = tl.arange(0, E)[:, None]  # [E, 1]
    row0 = pid_b * BLOCK_B
    # rows past B re-read row B-1 (their results are masked at the store): no per-row load masks
    y0 = x64_ptr + row0 * stride_x64
    y1 = x64_ptr + tl.minimum(row0 + 1, B - 1) * stride_x64
    y2 = x64_ptr + tl.minimum(row0 + 2, B - 1) * stride_x64
    y3 = x64_ptr + tl.minimum(row0 + 3, B - 1) * stride_x64
    y4 = x64_ptr + tl.minimum(row0 + 4, B - 1) * stride_x64
    y5 = x64_ptr + tl.minimum(row0 + 5, B - 1) * stride_x64
    y6 = x64_ptr + tl.minimum(row0 + 6, B - 1) * stride_x64
    y7 = x64_ptr + tl.minimum(row0 + 7, B - 1) * stride_x64
    acc0 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc4 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc5 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc6 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    acc7 = tl.zeros([E, BLOCK_N], dtype=tl.float32)
    col = offs_n[None, :]

    k_lo = pid_k * kk_per_split
    k_hi = tl.minimum(k_lo + kk_per_split, KP)
    # software pipelining in registers: the loads of step i + 1 are issued before the math of step i
    # (Triton does not pipeline loops without tl.dot); the last prefetch re-reads the last step. (Two
    # steps ahead, +16 registers, measured no faster on the H200, round 8.)
    w0, w1, pw, s, zz = _gemv_stage(qw_ptr, qp_ptr, sz_ptr, gp0, gp_last, gsh, k_lo, e_idx, col, nm2, k_hi, N,
                                    NKEEP, BLOCK_KK, EVEN, ASM)
    for kk0 in range(k_lo, k_hi, BLOCK_KK):
        kk_e = kk0 + 16 * e_idx  # [E, 1] first kept index of each element
        kmask = kk_e < k_hi  # KP and kk_per_split are multiples of 32: whole elements in or out
        if EVEN:
            kk_next = tl.minimum(kk0 + BLOCK_KK, k_hi - BLOCK_KK)
        else:
            kk_next = kk0 + BLOCK_KK
        nw0, nw1, npw, ns, nzz = _gemv_stage(qw_ptr, qp_ptr, sz_ptr, gp0, gp_last, gsh, kk_next, e_idx, col, nm2, k_hi,
                                             N, NKEEP, BLOCK_KK, EVEN, ASM)
        d = _dequant16(w0, w1, zz, False, ASM)  # fp16 pairs for both activation types (exact q - zero)
        if NKEEP == 4:
            sel = d  # unused
        else:
            sel = _selectors16(pw, ASM)
        acc0 = _row_step(acc0, y0, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
        if BLOCK_B > 1:
            acc1 = _row_step(acc1, y1, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
        if BLOCK_B > 2:
            acc2 = _row_step(acc2, y2, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
            acc3 = _row_step(acc3, y3, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
        if BLOCK_B > 4:
            acc4 = _row_step(acc4, y4, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
            acc5 = _row_step(acc5, y5, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
            acc6 = _row_step(acc6, y6, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
            acc7 = _row_step(acc7, y7, kk_e, kmask, G4, d, sel, s, NKEEP, IS_BF16, ASM, EVEN)
        w0, w1, pw, s, zz = nw0, nw1, npw, ns, nzz

    offs_b = row0 + tl.arange(0, BLOCK_B)
    rb = tl.arange(0, BLOCK_B)[:, None]
    acc = tl.where(rb == 0, tl.sum(acc0, axis=0)[None, :], 0.0)
    if BLOCK_B > 1:
        acc = tl.where(rb == 1, tl.sum(acc1, axis=0)[None, :], acc)
    if BLOCK_B > 2:
        acc = tl.where(rb == 2, tl.sum(acc2, axis=0)[None, :], acc)
        acc = tl.where(rb == 3, tl.sum(acc3, axis=0)[None, :], acc)
    if BLOCK_B > 4:
        acc = tl.where(rb == 4, tl.sum(acc4, axis=0)[None, :], acc)
        acc = tl.where(rb == 5, tl.sum(acc5, axis=0)[None, :], acc)
        acc = tl.where(rb == 6, tl.sum(acc6, axis=0)[None, :], acc)
        acc = tl.where(rb == 7, tl.sum(acc7, axis=0)[None, :], acc)
    tile_id = pid_b * tl.num_programs(0) + pid_n
    _finish(acc, offs_b, offs_b < B, offs_n, n_mask, N, out_ptr, bias_ptr, part_ptr, cnt_ptr, stride_ob, pid_k,
            n_split, tile_id, part_stride, SPLIT, HAS_BIAS)
