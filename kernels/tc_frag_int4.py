"""Device code of the *fragment-ordered* tensor-core kernel, :func:`_nm_int4_tc_frag_kernel`: ``y[B, N] =
x[B, K] @ W.T`` like :mod:`kernels.tc_int4` (swap AB, B >= 8, batch tiles of 16-64 rows), but reading the
weight's fragment-ordered copy (:attr:`~kernels.nm_int4.PackedNMInt4.fragments`): each lane loads the two
value words (and one position word) of exactly the A-fragment registers it feeds, dequantizes them in
inline PTX, and the densified tile goes to the MMA from registers -- no shared-memory round trip (the
format-2 kernel writes every dequantized tile to shared memory and reads it back as the wgmma operand,
which holds it at 12-22 % occupancy). See the comment above :func:`_tc_frag_asm`.

Status: verified under the Triton interpreter and assembled by ptxas for sm_90 (CI), **not yet run on
a GPU**; the launcher runs it only for a forced ``KernelConfig(fragment=True)`` (tests, benchmarks), the
tuner does not offer it until an H200 run has checked it and measured it against :mod:`kernels.tc_int4`
(``bench/v3_probe.py``).

Grid: ``(cdiv(N, BLOCK_N), n_split, cdiv(B, BLOCK_B))``. Launched by :mod:`kernels.int4_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.int4_common import _finish, _row_groups, _sz_word
from kernels.tc_int4 import _emu_densify, _emu_tc_pair, _join_tree, _pairs_to_half, _scale_halves


# ---- one lane's share of a unit: dequantize + densify in inline PTX ----------------------------------
# The unit of work is 32 kept values of each of a row block's 16 rows; lane l = 4 lr + q holds rows lr and
# lr + 8 and, per unit, two value words (16 values) + one position word (nm_int4's fragment order). Per
# kept pair t of a value word:
#   shift + lop3 (the nibble pair into the mantissas of 16.0) and one ``fma.rn.f16x2`` = (16 + q) * s -
#   (16 + zero) * s -- the group scale is applied here in packed half math (pair t belongs to row
#   lr + 8 (t % 2) for dense / 2:4, whose (scale, zero) the caller passes as (sA, zA) / (sB, zB); a 1:4
#   pair holds one value of each row, so it gets the two rows' scales packed in one word);
#   2:4 / 1:4: ``prmt`` with byte selectors built from the positions scatters the pair into its
#   dense column group (zeros elsewhere): the selector of a column group is the constant 0x44444410
#   (bytes 0-1 of the pair into column 0, the rest from the zero operand) rotated left by 8 * p0
#   (one ``shf.l.wrap``), minus 0x12 << 8 * p1 for the pair's second value (2:4); the low 16 bits
#   select columns 0-1, ``>> 16`` columns 2-3. The rotate amounts of four values come out of one
#   shift + mask of the position word (byte-spread).
# The outputs are packed column pairs in the order the kernel reshapes into the [BLOCK_N, dense K] A tile:
# the layout Triton gives that reshape is the wgmma register operand itself, so nothing moves between
# lanes (checked in the TTGIR: the tile is ``#ttg.dot_op<{opIdx = 0}>`` straight from the asm).

def _tc_frag_asm(nkeep: int, bf16: bool) -> str:
    """PTX for one lane's share of a unit: outputs $0.. = 8 / 16 / 32 packed column pairs (dense / 2:4 /
    1:4; low half the even column), inputs w0, w1 (value words), pw (position word; unused for dense),
    sA, zA, sB, zB (fp16x2 scale and -(16 + zero) * scale): pair t uses (sA, zA) when t is even (row lr),
    (sB, zB) when odd (row lr + 8); for 1:4 the caller passes the two rows' values packed, A = B."""
    nreg = {4: 8, 2: 16, 1: 32}[nkeep]
    w_in = [f"${nreg}", f"${nreg + 1}"]
    p_in = f"${nreg + 2}"
    sc = [(f"${nreg + 3}", f"${nreg + 4}"), (f"${nreg + 5}", f"${nreg + 6}")]
    ops = [("shl.b32", 6), ("shl.b32", 2), ("shr.u32", 2), ("shr.u32", 6)]
    amt_ops = [("shl.b32", 3), ("shl.b32", 1), ("shr.u32", 1), ("shr.u32", 3)]
    body = ["mov.b32 kz, 0;"]
    if nkeep == 2:
        body.append("mov.b32 kc, 0x44444410; mov.b32 k12, 0x12;")
    elif nkeep == 1:
        body.append("mov.b32 kc, 0x44444410; mov.b32 kd, 0x44444432;")
    for t, (op, amount) in enumerate(ops):
        if nkeep < 4:
            aop, ash = amt_ops[t]
            body.append(f"{aop} am, {p_in}, {ash}; and.b32 am, am, 0x18181818; "
                        "shr.u32 a1, am, 8; shr.u32 a2, am, 16; shr.u32 a3, am, 24;")
        s_in, z_in = sc[t % 2] if nkeep > 1 else sc[0]
        for h in range(2):
            body.append(f"{op} d, {w_in[h]}, {amount}; lop3.b32 d, d, 0x03C003C0, 0x4C004C00, 0xEA; "
                        f"fma.rn.f16x2 d, d, {s_in}, {z_in};")
            if bf16:
                body.append("mov.b32 {l, hh}, d; cvt.f32.f16 fl, l; cvt.f32.f16 fh, hh; cvt.rn.bf16x2.f32 d, fh, fl;")
            ra, rb = ("am", "a1") if h == 0 else ("a2", "a3")
            if nkeep == 4:
                body.append(f"mov.b32 ${4 * h + t}, d;")
            elif nkeep == 2:
                j = 8 * h + 2 * t
                body.append(f"shf.l.wrap.b32 s, kc, kc, {ra}; shf.l.wrap.b32 u, kz, k12, {rb}; sub.u32 s, s, u; "
                            f"prmt.b32 ${j}, d, kz, s; shr.u32 s, s, 16; prmt.b32 ${j + 1}, d, kz, s;")
            else:
                for e, (k, r) in enumerate((("kc", ra), ("kd", rb))):
                    j = 16 * h + 4 * t + 2 * e
                    body.append(f"shf.l.wrap.b32 s, {k}, {k}, {r}; prmt.b32 ${j}, d, kz, s; shr.u32 s, s, 16; "
                                f"prmt.b32 ${j + 1}, d, kz, s;")
    decl = "{ .reg .b32 d, s, u, am, a1, a2, a3, kz, kc, kd, k12; .reg .b16 l, hh; .reg .f32 fl, fh; "
    return decl + " ".join(body) + " }"


# per pattern (n kept of 4) and dtype: the PTX, its constraints (8 / 16 / 32 packed outputs, 7 inputs) and
# output dtypes; module-level constexprs because @triton.jit code can only read globals of that type
_ASM = {(n, bf): tl.constexpr(_tc_frag_asm(n, bf)) for n in (1, 2, 4) for bf in (False, True)}
_ASM_4_F16, _ASM_4_BF16, _ASM_2_F16, _ASM_2_BF16, _ASM_1_F16, _ASM_1_BF16 = (
    _ASM[4, False], _ASM[4, True], _ASM[2, False], _ASM[2, True], _ASM[1, False], _ASM[1, True])
_CONS_4 = tl.constexpr("=r," * 8 + "r," * 6 + "r")
_CONS_2 = tl.constexpr("=r," * 16 + "r," * 6 + "r")
_CONS_1 = tl.constexpr("=r," * 32 + "r," * 6 + "r")
_OUT_4 = tl.constexpr((tl.int32,) * 8)
_OUT_2 = tl.constexpr((tl.int32,) * 16)
_OUT_1 = tl.constexpr((tl.int32,) * 32)



@triton.jit
def _tc_frag_unit(w0, w1, pw, sA, zA, sB, zB, NKEEP: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """One lane's densified share of a unit as a tuple of packed column pairs (int32 tensors); see _tc_frag_asm."""
    if ASM:
        if NKEEP == 4:
            return tl.inline_asm_elementwise(asm=_ASM_4_BF16 if IS_BF16 else _ASM_4_F16, constraints=_CONS_4,
                                             args=[w0, w1, pw, sA, zA, sB, zB], dtype=_OUT_4, is_pure=True, pack=1)
        elif NKEEP == 2:
            return tl.inline_asm_elementwise(asm=_ASM_2_BF16 if IS_BF16 else _ASM_2_F16, constraints=_CONS_2,
                                             args=[w0, w1, pw, sA, zA, sB, zB], dtype=_OUT_2, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(asm=_ASM_1_BF16 if IS_BF16 else _ASM_1_F16, constraints=_CONS_1,
                                             args=[w0, w1, pw, sA, zA, sB, zB], dtype=_OUT_1, is_pure=True, pack=1)
    else:
        out = ()
        zero = tl.zeros_like(pw)
        for h in tl.static_range(2):
            w = w0 if h == 0 else w1
            for t in tl.static_range(4):
                if NKEEP == 4:
                    if t % 2 == 0:
                        out = out + (_emu_tc_pair(w, t, sA, zA, IS_BF16),)
                    else:
                        out = out + (_emu_tc_pair(w, t, sB, zB, IS_BF16),)
                else:
                    if t % 2 == 0 or NKEEP == 1:
                        d = _emu_tc_pair(w, t, sA, zA, IS_BF16)
                    else:
                        d = _emu_tc_pair(w, t, sB, zB, IS_BF16)
                    out = out + _emu_densify(d, pw, h, t, zero, NKEEP)
        return out


@triton.jit(do_not_specialize=["B", "part_stride", "n_split"])
def _nm_int4_tc_frag_kernel(
    x_ptr,  # [B, K] fp16/bf16, stride (stride_xb, 1)
    qw_ptr,  # int32 [N16/16, KP/32, 32, 2]: PackedNMInt4.fragments[0]
    qp_ptr,  # int32 [N16/16, KP/32, 32]: fragments[1] (unused when NKEEP == 4)
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
    BLOCK_N: tl.constexpr,  # weight rows: the M side of the MMA (multiple of 16; 64 fills one warpgroup)
    BLOCK_KK: tl.constexpr,  # kept values per row per K step (multiple of 32)
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_BF16: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (GPU) or its emulation (interpreter)
    DOT_F32: tl.constexpr,  # interpreter only: numpy has no bf16 matmul
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and whole K steps: no masks on the weight, scale and x loads
):
    """Tensor-core path, swap AB: acc^T [BLOCK_N, BLOCK_B] += dense W tile [BLOCK_N, 4*BLOCK_KK/n] @ x^T.
    Tiles are [U, RB, 8, 4] over (unit, row block, lane // 4, lane % 4): one element per lane and unit,
    so the loads are 8-byte vectors per lane and the asm's outputs already sit where the MMA wants them."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2)
    RB: tl.constexpr = BLOCK_N // 16
    U: tl.constexpr = BLOCK_KK // 32
    DCOL: tl.constexpr = 4 * BLOCK_KK // NKEEP
    n_units = KP // 32
    n_rb = (N + 15) // 16
    # logical tile dims [U, RB, 8 (lane // 4), 4 (lane % 4)]: unit outermost so the warps go to row blocks
    u4 = tl.arange(0, U)[:, None, None, None]
    rb4 = pid_n * RB + tl.arange(0, RB)[None, :, None, None]
    lr4 = tl.arange(0, 8)[None, None, :, None]
    q4 = tl.arange(0, 4)[None, None, None, :]
    lane4 = 4 * lr4 + q4
    rb_ok = rb4 < n_rb
    rows_a = 16 * rb4 + lr4
    rows_b = rows_a + 8
    gp0a, gpla, gsha = _row_groups(gptr_ptr, gshift_ptr, rows_a, rows_a < N)
    gp0b, gplb, gshb = _row_groups(gptr_ptr, gshift_ptr, rows_b, rows_b < N)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    # x^T tile rows: permuted column c -> original 16 (c // 16) + 4 ((c % 8) // 2) + 2 ((c % 16) // 8) + c % 2
    cp = tl.arange(0, DCOL)
    xcol = tl.max_contiguous(tl.multiple_of(16 * (cp // 16) + 4 * ((cp % 8) // 2) + 2 * ((cp % 16) // 8) + cp % 2, 2), 2)
    k_lo = pid_k * kk_per_split
    k_hi = tl.minimum(k_lo + kk_per_split, KP)
    for kk0 in range(k_lo, k_hi, BLOCK_KK):
        unit = kk0 // 32 + u4
        m4 = rb_ok & (unit < n_units)
        base = (rb4 * n_units + unit) * 32 + lane4  # [U, RB, 8, 4]
        wp = qw_ptr + 2 * base[:, :, :, :, None] + tl.arange(0, 2)[None, None, None, None, :]
        if EVEN:
            ww = tl.load(wp)
        else:
            ww = tl.load(wp, mask=m4[:, :, :, :, None], other=0)
        w0, w1 = tl.split(ww)
        if NKEEP == 4:
            pw = w0
        elif EVEN:
            pw = tl.load(qp_ptr + base)
        else:
            pw = tl.load(qp_ptr + base, mask=m4, other=0)
        kf = 32 * unit
        if EVEN:
            va = tl.load(sz_ptr + gp0a + (kf >> gsha))
            vb = tl.load(sz_ptr + gp0b + (kf >> gshb))
        else:
            va = _sz_word(sz_ptr, gp0a, gpla, gsha, kf, rows_a < N)
            vb = _sz_word(sz_ptr, gp0b, gplb, gshb, kf, rows_b < N)
        sa, za = _scale_halves(va)  # row lr
        sb, zb = _scale_halves(vb)  # row lr + 8
        if NKEEP == 1:  # a 1:4 pair holds one value of each row: the two rows' values side by side
            sA = sa | (sb << 16)
            zA = za | (zb << 16)
            sB = sA
            zB = zA
        else:  # a dense / 2:4 pair belongs to one row: its value in both halves
            sA = sa | (sa << 16)
            zA = za | (za << 16)
            sB = sb | (sb << 16)
            zB = zb | (zb << 16)
        words = _tc_frag_unit(w0, w1, pw, sA, zA, sB, zB, NKEEP, IS_BF16, ASM)
        if NKEEP == 4:
            # trailing (h, hc, rowhalf) then e: dims [U, RB, lr, q, h, hc, rh, e]
            t = _pairs_to_half(tl.reshape(_join_tree(words, 3), [U * RB * 32, 8]), IS_BF16, ASM)
            t = tl.reshape(t, [U, RB, 8, 4, 2, 2, 2, 2])
            t = tl.permute(t, [1, 6, 2, 0, 4, 5, 3, 7])  # rows (rb, rh, lr), cols (u, h, hc, q, e)
        elif NKEEP == 2:
            # trailing (h, tb, rh, h') then e: [U, RB, lr, q, blk(h,tb)=4, rh, h', e]
            t = _pairs_to_half(tl.reshape(_join_tree(words, 4), [U * RB * 32, 16]), IS_BF16, ASM)
            t = tl.reshape(t, [U, RB, 8, 4, 4, 2, 2, 2])
            t = tl.permute(t, [1, 5, 2, 0, 4, 6, 3, 7])
        else:
            # trailing (h, t1, t0, rh, h') then e: [U, RB, lr, q, blk=8, rh, h', e]
            t = _pairs_to_half(tl.reshape(_join_tree(words, 5), [U * RB * 32, 32]), IS_BF16, ASM)
            t = tl.reshape(t, [U, RB, 8, 4, 8, 2, 2, 2])
            t = tl.permute(t, [1, 5, 2, 0, 4, 6, 3, 7])
        wt = tl.reshape(t, [BLOCK_N, DCOL])
        offs_k = (kk0 // NKEEP) * 4 + xcol
        if EVEN:
            xt = tl.load(x_ptr + offs_b[None, :] * stride_xb + offs_k[:, None], mask=b_mask[None, :], other=0.0)
        else:
            xt = tl.load(x_ptr + offs_b[None, :] * stride_xb + offs_k[:, None],
                         mask=(offs_k < K)[:, None] & b_mask[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(wt.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(wt, xt, acc)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    tile_id = pid_b * tl.num_programs(0) + pid_n
    _finish(tl.trans(acc), offs_b, b_mask, offs_n, n_mask, N, out_ptr, bias_ptr, part_ptr, cnt_ptr, stride_ob, pid_k,
            n_split, tile_id, part_stride, SPLIT, HAS_BIAS)
