"""Device code of the SparseGemv *tensor-core* kernel, :func:`_nm_int4_tc_kernel`: ``y[B, N] = x[B, K] @ W.T``
with W in :class:`~kernels.nm_int4.PackedNMInt4` (format version 2), for B >= 8 (batch tiles of 16-64
rows), "swap AB": ``out^T = W_dense @ x^T`` with the weight rows on the MMA's M side. Per unit of 16 kept
values one inline-PTX block dequantizes with the GEMV's shift + ``lop3`` (:mod:`kernels.gemv_int4`) and
applies the group scale in the same ``fma.rn.f16x2``, then scatters each kept pair into its dense column
group with two ``prmt`` (selectors from the positions by a rotate); see the comment above :func:`_tc_asm`.
Under ``TRITON_INTERPRET=1`` the constexpr ``ASM`` selects the emulation (see :mod:`kernels.int4_common`,
which also holds the split-K output write).

Grid: ``(cdiv(N, BLOCK_N), n_split, cdiv(B, BLOCK_B))``. Launched by :mod:`kernels.int4_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_common import _emu_fma2, _emu_nibble_pair, _f32_to_half, _finish, _half_to_f32, _prmt_emul, _row_groups, _sz_word


# ---- tensor-core path: dequantize + densify in inline PTX, swap AB ----------------------------------
# The unit of work is 16 kept values of one output row (two ``qweight`` words + one ``qpos`` word, as in
# the GEMV). One inline-PTX block per unit turns them into the unit's *dense* columns (16 / 32 / 64
# fp16 or bf16 values for dense / 2:4 / 1:4), already scaled, with per kept pair:
#   shift + lop3 (nibble pair into the mantissas of 16.0) and one ``fma.rn.f16x2`` = (16 + q) * s -
#   (16 + zero) * s -- the group scale is applied here, in packed half math, so the fp32 accumulator
#   needs no per-group rescale and a K step may span several groups;
#   2:4 / 1:4: ``prmt`` with byte selectors built from the positions scatters the pair into its
#   dense column group(s) (zeros elsewhere): the selector of a column group is the constant
#   0x44444410 (bytes 0-1 of the pair into column 0, everything else from the zero operand) rotated
#   left by 8 * p0 bytes-bits (one ``shf.l.wrap``), minus 0x12 << 8 * p1 for the pair's second value
#   (2:4); the low 16 bits select columns 0-1, ``>> 16`` columns 2-3. The rotate amounts of four
#   values come out of one shift + mask of the position word (byte-spread layout).
# The dense tile [BLOCK_N, 4 * BLOCK_KK / n] is the *A* operand ("swap AB": out^T = W @ x^T), so the
# weight rows fill the M = 64 side of a Hopper wgmma and the batch (16..64) is the N side.

def _tc_asm(nkeep: int, bf16: bool, pairs: bool = False) -> str:
    """PTX for one unit: outputs $0..$(nreg-1), the nout dense columns in order -- one 16-bit register
    each, or with ``pairs`` one 32-bit register per two columns (nreg = nout / 2); inputs value words
    w0, w1 ($nreg, $nreg+1), position word ($nreg+2, ignored for dense), s2 = scale in both halves
    ($nreg+3), nzs2 = -(16 + zero) * scale in both halves ($nreg+4), all fp16."""
    nout = 16 * 4 // nkeep
    nreg = nout // 2 if pairs else nout  # pairs: one 32-bit output per two dense columns
    p_in, s_in, z_in = f"${nreg + 2}", f"${nreg + 3}", f"${nreg + 4}"

    def put(c: int, reg: str) -> str:  # dense columns c, c + 1 from the packed pair in reg
        return f"mov.b32 ${c // 2}, {reg};" if pairs else f"mov.b32 {{${c}, ${c + 1}}}, {reg};"

    ops = [("shl.b32", 6), ("shl.b32", 2), ("shr.u32", 2), ("shr.u32", 6)]
    amt_ops = [("shl.b32", 3), ("shl.b32", 1), ("shr.u32", 1), ("shr.u32", 3)]
    body = ["mov.b32 kz, 0;"]
    if nkeep == 2:
        body.append("mov.b32 kc, 0x44444410; mov.b32 k12, 0x12;")
    elif nkeep == 1:
        body.append("mov.b32 kc, 0x44444410; mov.b32 kd, 0x44444432;")
    for t, (op, amount) in enumerate(ops):
        if nkeep < 4:
            # byte 2h+e of am: 8 * position of value 8h + 2t + e (bits 3-4; bits 0-2 and 5-7 zero)
            aop, ash = amt_ops[t]
            body.append(f"{aop} am, {p_in}, {ash}; and.b32 am, am, 0x18181818; "
                        "shr.u32 a1, am, 8; shr.u32 a2, am, 16; shr.u32 a3, am, 24;")
        for h in range(2):
            w = f"${nreg + h}"
            body.append(f"{op} d, {w}, {amount}; lop3.b32 d, d, 0x03C003C0, 0x4C004C00, 0xEA; "
                        f"fma.rn.f16x2 d, d, {s_in}, {z_in};")
            if bf16:
                body.append("mov.b32 {l, hh}, d; cvt.f32.f16 fl, l; cvt.f32.f16 fh, hh; cvt.rn.bf16x2.f32 d, fh, fl;")
            ra, rb = ("am", "a1") if h == 0 else ("a2", "a3")
            if nkeep == 4:
                c = 8 * h + 2 * t
                body.append(put(c, "d"))
            elif nkeep == 2:
                c = 16 * h + 4 * t
                body.append(f"shf.l.wrap.b32 s, kc, kc, {ra}; shf.l.wrap.b32 u, kz, k12, {rb}; sub.u32 s, s, u; "
                            f"prmt.b32 lo, d, kz, s; shr.u32 s, s, 16; prmt.b32 hi, d, kz, s; "
                            + put(c, "lo") + " " + put(c + 2, "hi"))
            else:
                for e, (k, r) in enumerate((("kc", ra), ("kd", rb))):
                    c = 32 * h + 8 * t + 4 * e
                    body.append(f"shf.l.wrap.b32 s, {k}, {k}, {r}; prmt.b32 lo, d, kz, s; shr.u32 s, s, 16; "
                                "prmt.b32 hi, d, kz, s; " + put(c, "lo") + " " + put(c + 2, "hi"))
    decl = ("{ .reg .b32 d, s, u, lo, hi, am, a1, a2, a3, kz, kc, kd, k12; .reg .b16 l, hh; .reg .f32 fl, fh; ")
    return decl + " ".join(body) + " }"


# dense: 16 outputs, one 16-bit register per dense column (ptxas packs them as well as the pairs variant:
# measured equal or faster on the H200, round 8); 2:4 / 1:4: packed pairs, 32-bit outputs, each two
# dense columns (low half = the even column) -- no 16-bit unpack / repack (SASS per kept value: 2:4
# 11.4 -> 10.6, 1:4 17.9 -> 16.3; median 2.7 % faster at B = 16-64, round 8). Inputs w0, w1, pw, s2, nzs2.
_TC_ASM_4_F16, _TC_ASM_4_BF16 = tl.constexpr(_tc_asm(4, False)), tl.constexpr(_tc_asm(4, True))
_TC_CONS_4 = tl.constexpr("=h," * 16 + "r,r,r,r,r")
_TC_DT_4_F16, _TC_DT_4_BF16 = tl.constexpr((tl.float16,) * 16), tl.constexpr((tl.bfloat16,) * 16)
_TC_PASM = {(n, bf): tl.constexpr(_tc_asm(n, bf, pairs=True)) for n in (1, 2) for bf in (False, True)}
_TC_PASM_2_F16, _TC_PASM_2_BF16 = _TC_PASM[2, False], _TC_PASM[2, True]
_TC_PASM_1_F16, _TC_PASM_1_BF16 = _TC_PASM[1, False], _TC_PASM[1, True]
_TC_PCONS_2 = tl.constexpr("=r," * 16 + "r,r,r,r,r")
_TC_PCONS_1 = tl.constexpr("=r," * 32 + "r,r,r,r,r")
_TC_PDT_2 = tl.constexpr((tl.int32,) * 16)
_TC_PDT_1 = tl.constexpr((tl.int32,) * 32)


@triton.jit
def _scale_halves(v):
    """(scale, zero) word (fp16 scale low, zero high) -> (scale, -(16 + zero) * scale) as fp16 bits in the
    low 16 bits of int32: the fma operands of the PTX's dequantization, before packing into halves."""
    s = _half_to_f32(v, False)
    zh = _f32_to_half(-(_half_to_f32(v >> 16, False) + 16.0) * s, False)
    return v & 0xFFFF, zh


@triton.jit
def _emu_rotl(c, amt):
    """``shf.l.wrap.b32 d, c, c, amt`` for a constant c < 2**31 and amt in {0, 8, 16, 24} (+ junk >= 32)."""
    v = c.to(tl.int64) << (amt & 31).to(tl.int64)
    return ((v | (v >> 32)) & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _emu_tc_pair(w, t: tl.constexpr, s2, nzs2, IS_BF16: tl.constexpr):
    """Emulation of one kept pair's dequantization in _tc_asm: fp16 fma, then bf16 conversion."""
    d = _emu_fma2(_emu_nibble_pair(w, t, False), s2, nzs2, False)
    if IS_BF16:
        lo = _f32_to_half(_half_to_f32(d, False), True)
        hi = _f32_to_half(_half_to_f32(d >> 16, False), True)
        d = lo | (hi << 16)
    return d


@triton.jit
def _emu_halves(v, IS_BF16: tl.constexpr):
    """int32 word -> (low, high) 16-bit halves as fp16 / bf16 tensors."""
    lo = (v & 0xFFFF).to(tl.int16)
    hi = ((v >> 16) & 0xFFFF).to(tl.int16)
    if IS_BF16:
        return lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)
    else:
        return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def _tc_unit_dense(w0, w1, s2, nzs2, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """The 16 dense columns of one dense unit (tuple of fp16/bf16 tensors, column order); see _tc_asm."""
    if ASM:
        return tl.inline_asm_elementwise(
            # the block's position operand is unused for dense: w0 fills the slot
            asm=_TC_ASM_4_BF16 if IS_BF16 else _TC_ASM_4_F16, constraints=_TC_CONS_4, args=[w0, w1, w0, s2, nzs2],
            dtype=_TC_DT_4_BF16 if IS_BF16 else _TC_DT_4_F16, is_pure=True, pack=1)
    else:
        out = ()
        for h in tl.static_range(2):
            for t in tl.static_range(4):
                a, b = _emu_halves(_emu_tc_pair(w0 if h == 0 else w1, t, s2, nzs2, IS_BF16), IS_BF16)
                out = out + (a, b)
        return out


@triton.jit
def _tc_unit_pairs(w0, w1, pw, s2, nzs2, NKEEP: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """Dense columns of one 2:4 / 1:4 unit as packed pairs: tuple of 8 * 4 / NKEEP int32 tensors, word j =
    columns (2j, 2j + 1), the even one in the low half; see _tc_asm."""
    if ASM:
        if NKEEP == 2:
            return tl.inline_asm_elementwise(
                asm=_TC_PASM_2_BF16 if IS_BF16 else _TC_PASM_2_F16, constraints=_TC_PCONS_2, args=[w0, w1, pw, s2, nzs2],
                dtype=_TC_PDT_2, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                asm=_TC_PASM_1_BF16 if IS_BF16 else _TC_PASM_1_F16, constraints=_TC_PCONS_1, args=[w0, w1, pw, s2, nzs2],
                dtype=_TC_PDT_1, is_pure=True, pack=1)
    else:
        out = ()
        zero = tl.zeros_like(pw)
        for h in tl.static_range(2):
            w = w0 if h == 0 else w1
            for t in tl.static_range(4):
                out = out + _emu_densify(_emu_tc_pair(w, t, s2, nzs2, IS_BF16), pw, h, t, zero, NKEEP)
        return out


@triton.jit
def _emu_densify(d, pw, h: tl.constexpr, t: tl.constexpr, zero, NKEEP: tl.constexpr):
    """Emulation of the ``prmt`` scatter in the PTX of both tensor-core kernels: the dense column words of
    the dequantized pair ``d`` = kept pair t of value word h, positions from the byte-spread word ``pw``
    (2:4: two words = one column group; 1:4: four words = two groups)."""
    if t < 2:  # the same shifts as the PTX (a left shift by 3 - 2t would drop the top position)
        am = (pw << (3 - 2 * t)) & 0x18181818
    else:
        am = (pw.to(tl.uint32, bitcast=True) >> (2 * t - 3)).to(tl.int32, bitcast=True) & 0x18181818
    am = (am.to(tl.uint32, bitcast=True) >> (16 * h)).to(tl.int32, bitcast=True)
    if NKEEP == 2:
        s = _emu_rotl(zero + 0x44444410, am) - ((zero + 0x12) << ((am >> 8) & 31))
        return _emu_scatter_pairs(d, zero, s)
    else:
        s0 = _emu_rotl(zero + 0x44444410, am)
        s1 = _emu_rotl(zero + 0x44444432, am >> 8)
        return _emu_scatter_pairs(d, zero, s0) + _emu_scatter_pairs(d, zero, s1)


@triton.jit
def _emu_scatter_pairs(d, zero, s):
    """The 4 dense columns of one column group as two packed words: ``prmt`` of the pair ``d`` with
    selector ``s`` (columns 0-1) and ``s >> 16`` (columns 2-3)."""
    return _prmt_emul(d, zero, s), _prmt_emul(d, zero, (s.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True))


_UNPACK_ASM = tl.constexpr("mov.b32 $0, $1;")  # pack=2: both inputs are the same word; its halves are the outputs


@triton.jit
def _pairs_to_half(wp, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """int32 [M, D] of packed pairs -> fp16 / bf16 [M, 2 * D] (low half first), without unpacking: on the
    GPU an inline-asm ``mov`` with ``pack=2`` hands the word through as the two 16-bit elements."""
    M: tl.constexpr = wp.shape[0]
    D: tl.constexpr = wp.shape[1]
    if ASM:
        two = tl.inline_asm_elementwise(asm=_UNPACK_ASM, constraints="=r,r,r", args=[tl.join(wp, wp)],
                                        dtype=tl.bfloat16 if IS_BF16 else tl.float16, is_pure=True, pack=2)
    else:
        lo, hi = _emu_halves(wp, IS_BF16)
        two = tl.join(lo, hi)
    return tl.reshape(two, [M, 2 * D])


@triton.jit
def _join_tree(v, LOG: tl.constexpr):
    """Stack the 2**LOG same-shape tensors of tuple v along new trailing axes, v[i] at flat index i."""
    cur = v
    for lvl in tl.static_range(LOG):
        nxt = ()
        for i in tl.static_range(1 << (LOG - 1 - lvl)):
            nxt = nxt + (tl.join(cur[i], cur[i + (1 << (LOG - 1 - lvl))]),)
        cur = nxt
    return cur[0]


@triton.jit(do_not_specialize=["B", "part_stride"])
def _nm_int4_tc_kernel(
    x_ptr,  # [B, K] fp16/bf16, stride (stride_xb, 1)
    qw_ptr,  # int32 [KP/8, N]
    qp_ptr,  # int32 [KP/16, N] (unused when NKEEP == 4)
    sz_ptr,  # int32 [G] (= fp16 [G, 2] scale_zero)
    gptr_ptr,  # int32 [N+1]
    gshift_ptr,  # int32 [N]
    bias_ptr,  # [N] or dummy
    out_ptr,  # [B, N] in x's dtype
    part_ptr,
    cnt_ptr,
    B,
    N,
    K,
    KP,
    stride_xb,
    stride_ob,
    kk_per_split,
    n_split,
    part_stride,
    NKEEP: tl.constexpr,
    BLOCK_B: tl.constexpr,  # batch rows: the N side of the MMA (>= 16)
    BLOCK_N: tl.constexpr,  # weight rows: the M side of the MMA (64 fills one Hopper warpgroup)
    BLOCK_KK: tl.constexpr,  # kept values per row per K step (multiple of 32)
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_BF16: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (GPU) or its emulation (interpreter)
    DOT_F32: tl.constexpr,  # interpreter only: numpy has no bf16 matmul
):
    """Tensor-core path, swap AB: acc^T [BLOCK_N, BLOCK_B] += dense W tile [BLOCK_N, 4*BLOCK_KK/n] @ x^T.
    Tiles are 3-D [BLOCK_N, SB, 2] over units (16 kept values; SB = BLOCK_KK / 32 sub-blocks of one
    (scale, zero) each), so a sub-block's scale broadcasts over its two units without a layout change."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2)
    SB: tl.constexpr = BLOCK_KK // 32
    LOG: tl.constexpr = 4 if NKEEP == 4 else (5 if NKEEP == 2 else 6)
    DCOL: tl.constexpr = 4 * BLOCK_KK // NKEEP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    nm2 = n_mask[:, None]
    gp0, gp_last, gsh = _row_groups(gptr_ptr, gshift_ptr, offs_n[:, None], nm2)
    n3 = offs_n[:, None, None]
    nm3 = n_mask[:, None, None]
    sb3 = tl.arange(0, SB)[None, :, None]
    u3 = tl.arange(0, 2)[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)

    k_lo = pid_k * kk_per_split
    k_hi = tl.minimum(k_lo + kk_per_split, KP)
    for kk0 in range(k_lo, k_hi, BLOCK_KK):
        # unit (sb, u) = kept values kk0 + 32 sb + 16 u ..: value words 2 * unit, 2 * unit + 1; position word unit
        unit = (kk0 // 16) + 2 * sb3 + u3  # [1, SB, 2]
        m3 = nm3 & (unit < KP // 16)
        w0 = tl.load(qw_ptr + (2 * unit) * N + n3, mask=m3, other=0)
        w1 = tl.load(qw_ptr + (2 * unit + 1) * N + n3, mask=m3, other=0)
        if NKEEP == 4:
            pw = w0
        else:
            pw = tl.load(qp_ptr + unit * N + n3, mask=m3, other=0)
        # (scale, zero) of each sub-block: s2 = scale, nzs2 = -(16 + zero) * scale, both halves, fp16
        v = _sz_word(sz_ptr, gp0, gp_last, gsh, kk0 + 32 * tl.arange(0, SB)[None, :], nm2)  # [BLOCK_N, SB]
        sh, zh = _scale_halves(v)
        s2 = (sh | (sh << 16))[:, :, None]
        nzs2 = (zh | (zh << 16))[:, :, None]
        if NKEEP == 4:
            wt = tl.reshape(_join_tree(_tc_unit_dense(w0, w1, s2, nzs2, IS_BF16, ASM), LOG), [BLOCK_N, DCOL])
        else:
            words = _tc_unit_pairs(w0, w1, pw, s2, nzs2, NKEEP, IS_BF16, ASM)
            wt = _pairs_to_half(tl.reshape(_join_tree(words, LOG - 1), [BLOCK_N, DCOL // 2]), IS_BF16, ASM)
        offs_k = (kk0 // NKEEP) * 4 + tl.arange(0, DCOL)
        xt = tl.load(x_ptr + offs_b[None, :] * stride_xb + offs_k[:, None], mask=(offs_k < K)[:, None] & b_mask[None, :],
                     other=0.0)  # [DCOL, BLOCK_B]
        if DOT_F32:
            acc += tl.dot(wt.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(wt, xt, acc)
    tile_id = pid_b * tl.num_programs(0) + pid_n
    _finish(tl.trans(acc), offs_b, b_mask, offs_n, n_mask, N, out_ptr, bias_ptr, part_ptr, cnt_ptr, stride_ob, pid_k,
            n_split, tile_id, part_stride, SPLIT, HAS_BIAS)
