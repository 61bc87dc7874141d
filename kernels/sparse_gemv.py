"""Triton SparseGemv: ``y[B, N] = x[B, K] @ W.T`` with W in :class:`~kernels.nm_int4.PackedNMInt4`.

Two kernels, specialised by constexprs, read the packed format (version 2) directly:

- :func:`_nm_int4_gemv_kernel`, the *GEMV* path for batch tiles of 1, 2, 4 or 8 rows. Its unit of
  work ("element") is 16 kept values of one output row: two ``qweight`` words and one ``qpos`` word.
  Per element, one inline-PTX block (shared by the batch rows of the tile) dequantizes all 16 values
  into 8 packed fp16x2 (bf16x2) pairs ``q - zero`` -- a shift and one ``lop3`` put each nibble pair into
  the mantissas of ``16.0``, one ``sub.f16x2`` subtracts ``16 + zero`` -- and builds the 8 ``prmt``
  selectors of the kept positions (a shift, an ``and`` and one ``mad`` per two pairs). Per batch row a
  second block picks the activations of each kept pair with one ``prmt`` (2:4; two and a merge for 1:4;
  none for dense) and multiply-adds the 8 pairs with ``fma.f16x2``, so each product costs half an
  instruction; the 16 products are summed in fp16x2 and leave the block as one fp32 value, scaled in
  fp32 and accumulated in fp32 across the K loop (``fp16 partial sums of 16 products, fp32 beyond``).
  Under ``TRITON_INTERPRET=1`` the constexpr ``ASM`` selects an emulation with the same bit operations
  and fp16/bf16 rounding after every packed operation.
- :func:`_nm_int4_tc_kernel`, the *tensor-core* path for B >= 8 (batch tiles of 16-64 rows), "swap
  AB": ``out^T = W_dense @ x^T`` with the weight rows on the MMA's M side. Per unit of 16 kept values
  one inline-PTX block dequantizes with the GEMV's shift + ``lop3`` and applies the group scale in the
  same ``fma.rn.f16x2``, then scatters each kept pair into its dense column group with two ``prmt``
  (selectors from the positions by a rotate); see the comment above :func:`_tc_asm`.

Split-K (``SPLIT``): each of the ``n_split`` programs of an output tile writes its fp32 partial tile to
a scratch buffer, then increments the tile's counter; the program that sees the count reach
``n_split - 1`` sums the partials in a fixed order, adds the bias, writes the output in x's dtype and
resets the counter. One launch, no zero-fill, no cast kernel, deterministic; the counters reset
themselves, so CUDA-graph replays work. Scratch and counters are shared per device, so launches that
share them must not run concurrently on different streams.

Grid: ``(cdiv(N, BLOCK_N), n_split, cdiv(B, BLOCK_B))``.

:func:`nm_int4_linear_triton` is the entry point. The first call for a (layer, dtype, batch bucket,
bias) binds a launcher: it picks a :class:`KernelConfig` (timed once per shape and bucket, cached as
JSON under ``$ADBATCH_CACHE/kernels/``; a heuristic under the interpreter or with
``ADBATCH_NM_INT4_AUTOTUNE=0``; timed in CUDA-graph replays, with a warm L2 unless
``ADBATCH_NM_INT4_TUNE_L2=cold``, see :func:`time_graphed_ms`), compiles, and keeps the compiled kernel and every argument that does
not change between calls (weight pointers as ints, grid, scratch). Later calls do one dict lookup, a
few shape checks, ``torch.empty`` for the output and the raw launch (no Triton argument binding,
specialization or pointer checks).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import threading
import weakref
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.nm_int4 import PackedNMInt4, SparsityPattern

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GEMV_BATCH_TILES = (1, 2, 4, 8)  # batch tiles of the GEMV kernel
GEMV_MAX_BATCH = GEMV_BATCH_TILES[-1]
GEMV_TUNE_MAX_BATCH = 16  # largest bucket whose tuner also times GEMV configs (several batch tiles)
KERNEL_VERSION = 7  # part of the tuning-cache file name: configs tuned for older kernels are not reused


# ---- small helpers shared by both kernels -----------------------------------------------------------
@triton.jit
def _half_to_f32(h, IS_BF16: tl.constexpr):
    """fp32 value of the fp16 / bf16 bit pattern in the low 16 bits of int32 ``h``."""
    if IS_BF16:
        return ((h & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32_to_half(v, IS_BF16: tl.constexpr):
    """int32 holding (in its low 16 bits) fp32 ``v`` rounded to nearest-even fp16 / bf16."""
    if IS_BF16:
        b = v.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    else:
        return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _row_groups(gptr_ptr, gshift_ptr, rows, row_mask):
    """First and last group index and log2 group size of each row, in the shape of ``rows`` (the GEMV
    passes [1, BLOCK_N], the tensor-core kernel [BLOCK_N, 1]); masked rows get a harmless one-group
    row of size 32."""
    gp0 = tl.load(gptr_ptr + rows, mask=row_mask, other=0)
    gp_last = tl.load(gptr_ptr + rows + 1, mask=row_mask, other=1) - 1
    gsh = tl.load(gshift_ptr + rows, mask=row_mask, other=5)
    return gp0, gp_last, gsh


@triton.jit
def _sz_word(sz_ptr, gp0, gp_last, gsh, kk_first, row_mask):
    """int32 (scale, zero) word of each row's group holding kept offset ``kk_first`` (broadcast shapes):
    sz_ptr is scale_zero viewed as int32, low half = scale, high half = zero (fp16)."""
    gidx = tl.minimum(gp0 + (kk_first >> gsh), gp_last)  # clamp keeps the padding inside the row
    return tl.load(sz_ptr + gidx, mask=row_mask, other=0)


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


@triton.jit
def _finish(acc, offs_b, b_mask, offs_n, n_mask, N, out_ptr, bias_ptr, part_ptr, cnt_ptr, stride_ob, pid_k,
            n_split, tile_id, part_stride, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write acc [BB, BN] fp32 (+ bias) to out in its dtype; with SPLIT, via the partial-sum scratch and
    the last-arriving program of the tile (see the module docstring)."""
    mask = b_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tile = offs_b[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * part_stride + tile, acc, mask=mask)
        # every thread's partial store precedes the (single, release) counter update of the program
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            acc = tl.zeros_like(acc)
            for k in range(0, n_split):
                # .cg: read from L2; L1 lines of this SM may hold partials of an earlier launch
                acc += tl.load(part_ptr + k * part_stride + tile, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_b[:, None] * stride_ob + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile_id, 0)  # ready for the next launch (kernel boundary orders it)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_b[:, None] * stride_ob + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


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
def _emu_fma2(a, b, c, IS_BF16: tl.constexpr):
    lo = _f32_to_half(_half_to_f32(a, IS_BF16) * _half_to_f32(b, IS_BF16) + _half_to_f32(c, IS_BF16), IS_BF16)
    hi = _f32_to_half(_half_to_f32(a >> 16, IS_BF16) * _half_to_f32(b >> 16, IS_BF16) + _half_to_f32(c >> 16, IS_BF16), IS_BF16)
    return lo | (hi << 16)


@triton.jit
def _emu_nibble_pair(w, t: tl.constexpr, IS_BF16: tl.constexpr):
    """The shift + lop3 of pair t (see _dq_asm): nibbles (t, t + 4) of w as 16 + q in both halves."""
    if IS_BF16:
        if t == 0:
            v = w << 3
        else:
            v = (w.to(tl.uint32, bitcast=True) >> (4 * t - 3)).to(tl.int32, bitcast=True)
        return (v & 0x00780078) | 0x41804180
    else:
        if t == 0:
            v = w << 6
        elif t == 1:
            v = w << 2
        else:
            v = (w.to(tl.uint32, bitcast=True) >> (4 * t - 6)).to(tl.int32, bitcast=True)
        return (v & 0x03C003C0) | 0x4C004C00


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
def _prmt_emul(lo, hi, sel):
    """``prmt.b32 d, lo, hi, sel`` (default mode, selector nibbles 0..7) in plain integer ops."""
    full = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    d = ((full >> (8 * (sel & 7)).to(tl.int64)) & 0xFF).to(tl.int32)
    d = d | (((full >> (8 * ((sel >> 4) & 7)).to(tl.int64)) & 0xFF).to(tl.int32) << 8)
    d = d | (((full >> (8 * ((sel >> 8) & 7)).to(tl.int64)) & 0xFF).to(tl.int32) << 16)
    d = d | (((full >> (8 * ((sel >> 12) & 7)).to(tl.int64)) & 0xFF).to(tl.int32) << 24)
    return d


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
                d = _emu_tc_pair(w, t, s2, nzs2, IS_BF16)
                if t < 2:  # the same shifts as _tc_asm (a left shift by 3 - 2t would drop the top position)
                    am = (pw << (3 - 2 * t)) & 0x18181818
                else:
                    am = (pw.to(tl.uint32, bitcast=True) >> (2 * t - 3)).to(tl.int32, bitcast=True) & 0x18181818
                am = (am.to(tl.uint32, bitcast=True) >> (16 * h)).to(tl.int32, bitcast=True)
                if NKEEP == 2:
                    s = _emu_rotl(zero + 0x44444410, am) - ((zero + 0x12) << ((am >> 8) & 31))
                    out = out + _emu_scatter_pairs(d, zero, s)
                else:
                    for e in tl.static_range(2):
                        s = _emu_rotl(zero + (0x44444410 if e == 0 else 0x44444432), am >> (8 * e))
                        out = out + _emu_scatter_pairs(d, zero, s)
        return out


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
        s = _half_to_f32(v, False)
        z = _half_to_f32(v >> 16, False)
        sh = v & 0xFFFF
        zh = _f32_to_half(-(z + 16.0) * s, False)
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


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the GEMV or tensor-core kernel (see the module docstring)."""

    block_b: int
    block_n: int
    block_kk: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 3

    def validate(self, pattern: SparsityPattern) -> None:
        if self.block_kk not in (32, 64, 128):
            raise ValueError(f"block_kk={self.block_kk} must be 32, 64 or 128")
        if not self.use_dot and self.block_b not in GEMV_BATCH_TILES:
            raise ValueError(f"the GEMV path takes block_b in {GEMV_BATCH_TILES}: {self}")
        if self.use_dot and (self.block_b < 16 or 4 * self.block_kk // pattern.n < 16 or self.block_n < 16):
            raise ValueError(f"tl.dot needs block_b, block_n and the dense K tile >= 16: {self}")
        for name in ("block_b", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.use_dot and self.block_kk % 32:
            raise ValueError(f"the tensor-core kernel takes whole 32-value sub-blocks: {self}")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")


_BUCKET_OF = [0] + [next(b for b in BATCH_BUCKETS if n <= b) for n in range(1, BATCH_BUCKETS[-1] + 1)]


def batch_bucket(batch: int) -> int:
    """Smallest bucket in BATCH_BUCKETS holding ``batch`` (64 for anything larger)."""
    return _BUCKET_OF[batch] if 0 < batch <= BATCH_BUCKETS[-1] else BATCH_BUCKETS[-1]


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pow2_floor(v: float) -> int:
    return 1 << max(0, int(v).bit_length() - 1) if v >= 1 else 1


def _split_for(p: PackedNMInt4, block_n: int, block_kk: int, n_bblocks: int, num_sms: int, waves: float = 4.0) -> int:
    """Split-K so the grid has about ``waves`` programs per SM, keeping >= 4 K steps per program."""
    programs = triton.cdiv(p.out_features, block_n) * n_bblocks
    steps = triton.cdiv(p.padded_kept, block_kk)
    want = _pow2_floor(waves * num_sms / programs) if programs < waves * num_sms else 1
    return max(1, min(want, _pow2_floor(steps / 4), 32))


def _gemv_ok(p: PackedNMInt4) -> bool:
    """The GEMV kernel reads x as int64 words of 4 activations: K must be a multiple of 4 (always true
    for n:4 patterns)."""
    return p.in_features % 4 == 0


def tc_block_kk(pattern: SparsityPattern) -> int:
    """Kept values per K step of the tensor-core kernel: a 128-column dense tile for every pattern (4
    sub-blocks of dense, 2 of 2:4, 1 of 1:4). Longer steps amortize the per-step barriers, scale loads
    and address math: sm_90 SASS per kept value at BLOCK_N = 64, B = 16 (bench/kernel_sass.py): dense
    6.5 -> 4.9 (64 -> 128), 2:4 16.8 -> 12.9 (32 -> 64)."""
    return 128 * pattern.n // 4


def heuristic_config(p: PackedNMInt4, batch: int, num_sms: int) -> KernelConfig:
    """A reasonable config without timing (interpreter, or autotuning disabled): the GEMV up to 8 rows,
    the tensor-core kernel above (or where the GEMV cannot run)."""
    bucket = batch_bucket(batch)
    use_dot = bucket > GEMV_MAX_BATCH or not _gemv_ok(p)
    block_b = max(16, bucket) if use_dot else bucket
    block_kk = tc_block_kk(p.pattern) if use_dot else 64
    block_n = 128 if use_dot else 64  # see candidate_configs
    n_bblocks = triton.cdiv(batch, block_b)
    split = _split_for(p, block_n, block_kk, n_bblocks, num_sms)
    return KernelConfig(block_b, block_n, block_kk, split, use_dot)


def candidate_configs(p: PackedNMInt4, batch: int, num_sms: int) -> list[KernelConfig]:
    """The configs the autotuner times for this (shape, batch bucket), at most 32: GEMV tiles up to
    bucket 16 (fewer where tensor-core tiles compete), tensor-core tiles from bucket 8 up (one batch
    tile of max(16, bucket) rows: the MMA's N side); each with the split-K choices of
    :func:`_with_splits`; the first tensor-core tile also with 2 and 4 pipeline stages."""
    bucket = batch_bucket(batch)
    out: list[KernelConfig] = []
    if bucket <= GEMV_TUNE_MAX_BATCH and _gemv_ok(p):
        tiles = ((64, 64, 4), (128, 64, 4), (128, 32, 4), (64, 128, 4))
        tiles = tiles[: {8: 2, 16: 1}.get(bucket, 4)]
        for block_n, block_kk, warps in tiles:
            cfg = KernelConfig(min(bucket, GEMV_MAX_BATCH), block_n, block_kk, 1, False, warps)
            out += _with_splits(p, batch, cfg, num_sms)
    if bucket >= 8 or not _gemv_ok(p):
        kk = tc_block_kk(p.pattern)
        kk2 = 2 * kk if 2 * kk <= 128 else kk // 2
        # (block_n, block_kk, warps): 64 weight rows fill one warpgroup's wgmma M side; 128 rows on one
        # warpgroup amortize the per-step overhead best (sm_90 SASS per kept value at B = 16: 2:4 11.4
        # vs 13.5, 1:4 17.9 vs 22.4, dense 4.1 vs 5.3); the longer K step spills at 64 batch rows
        # 8 warps (two warpgroups, 64 rows each) halve the registers per thread of a 128-row tile (2:4:
        # 158 -> 88), so more CTAs fit per SM; 256 rows on 8 warps amortize like 128 on 4
        if bucket <= 16:
            tiles = [(128, kk, 4), (128, kk, 8), (128, kk2, 4), (256, kk, 8), (64, kk, 4), (64, kk2, 4)]
        else:
            tiles = [(128, kk, 4), (64, kk, 4), (64, kk2, 4), (128, kk, 8)]
        tiles = tiles[: {8: 3, 16: 4}.get(bucket, 4)] if _gemv_ok(p) else tiles
        for i, (block_n, block_kk, warps) in enumerate(tiles):
            cfg = KernelConfig(max(16, bucket), block_n, block_kk, 1, True, warps)
            out += _with_splits(p, batch, cfg, num_sms)
            if i == 0:  # pipeline depth of the weight loads: 2 frees shared memory for wide x tiles, 4 hides more latency
                split = _split_for(p, block_n, block_kk, triton.cdiv(batch, cfg.block_b), num_sms)
                out += [dataclasses.replace(cfg, split_k=split, num_stages=st) for st in (2, 4)]
    return list(dict.fromkeys(out))


def _with_splits(p: PackedNMInt4, batch: int, cfg: KernelConfig, num_sms: int) -> list[KernelConfig]:
    """No split; splits giving about 4 and 16 programs per SM; and a half and a quarter of the first.
    Fewer splits than "4 per SM" win at large B, where each split writes a [B, N] fp32 partial tile
    (H200 round 8, 8192x28672 2:4 B = 64: split 4 125.7 us, split 8 144.8 us, split 32 256 us)."""
    n_b = triton.cdiv(batch, cfg.block_b)
    base = _split_for(p, cfg.block_n, cfg.block_kk, n_b, num_sms)
    splits = {1, max(1, base // 4), max(1, base // 2), base, _split_for(p, cfg.block_n, cfg.block_kk, n_b, num_sms, 16.0)}
    return [dataclasses.replace(cfg, split_k=v) for v in sorted(splits)]


# ---- launcher ---------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(x: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x: dtype {x.dtype} not supported by the Triton kernel; expected float16 or bfloat16")
    if x.dim() < 1 or x.shape[-1] != p.in_features:
        raise ValueError(f"x: expected [..., {p.in_features}] (in_features), got {tuple(x.shape)}")
    if x.device != p.device:
        raise ValueError(f"x is on {x.device} but the packed weight is on {p.device}")
    if not (x.is_cuda or _interpreting()):
        raise ValueError("nm_int4_linear_triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if bias is not None and (bias.shape != (p.out_features,) or bias.device != x.device):
        raise ValueError(f"bias: expected [{p.out_features}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    if p.padded_kept % 32 or p.out_features >= 2**31 // max(1, p.padded_kept // 8):
        raise ValueError(f"packed weight of shape {p.out_features}x{p.in_features} exceeds the int32 indexing of the kernel")


class _Scratch:
    """Per-device split-K scratch: fp32 partial tiles and int32 per-tile counters (zero between launches).
    Grow-only; replaced buffers stay referenced by the launchers bound to them (CUDA graphs captured with
    them stay valid)."""

    def __init__(self) -> None:
        self._buf: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, cnt = self._buf.get(device, (None, None))
        if part is None or part.numel() < part_elems or cnt.numel() < tiles:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split-K scratch must grow, which is not allowed during CUDA-graph capture: run once before capturing")
            n_part = max(part_elems, 0 if part is None else part.numel(), 1 << 20)
            n_cnt = max(tiles, 0 if cnt is None else cnt.numel(), 1 << 14)
            part = torch.empty(n_part, dtype=torch.float32, device=device)
            cnt = torch.zeros(n_cnt, dtype=torch.int32, device=device)
            self._buf[device] = (part, cnt)
        return part, cnt


_SCRATCH = _Scratch()


@dataclasses.dataclass
class _Plan:
    """Per-call launch geometry of a config on a layer (everything but the activations)."""

    grid0: int
    n_split: int
    kk_per_split: int

    @staticmethod
    def of(p: PackedNMInt4, cfg: KernelConfig) -> "_Plan":
        steps = triton.cdiv(p.padded_kept, cfg.block_kk)
        split = max(1, min(cfg.split_k, steps))
        kk_per_split = triton.cdiv(steps, split) * cfg.block_kk
        return _Plan(triton.cdiv(p.out_features, cfg.block_n), triton.cdiv(p.padded_kept, kk_per_split), kk_per_split)


def _x_words(x2: torch.Tensor) -> torch.Tensor:
    """x2 [B, K] viewed as int64 [B, K/4] (4 activations per word) for the GEMV kernel."""
    if x2.stride(0) % 4 or x2.data_ptr() % 8 or x2.shape[1] % 4:
        raise ValueError("x: rows must start on 8-byte boundaries (the launcher copies misaligned inputs)")
    return x2.view(torch.int64)


def _kernel_args(x2: torch.Tensor, p: PackedNMInt4, bias, out, part, cnt, cfg: KernelConfig, plan: _Plan) -> tuple[list, dict]:
    """Positional arguments and constexprs of one launch (order = the kernel signature)."""
    batch = x2.shape[0]
    n_out = p.out_features
    # the GEMV reads x as int64 words of 4 activations: its K and row stride count words
    xk = x2 if cfg.use_dot else _x_words(x2)
    k_arg = p.in_features if cfg.use_dot else p.in_features // 4
    args = [xk, p.qweight, p.qpos if p.pattern.is_sparse else p.qweight, p.scale_zero_words, p.group_ptr, p.group_shift,
            bias if bias is not None else out, out, part, cnt, batch, n_out, k_arg, p.padded_kept, xk.stride(0),
            out.stride(0), plan.kk_per_split, plan.n_split, batch * n_out]
    even = n_out % cfg.block_n == 0 and p.padded_kept % cfg.block_kk == 0 and p.kept == p.padded_kept
    meta = _kernel_meta(cfg, p.pattern, plan.n_split > 1, bias is not None, x2.dtype == torch.bfloat16,
                        asm=not _interpreting(), even=even)
    return args, meta


def _kernel_meta(cfg: KernelConfig, pattern: SparsityPattern, split: bool, has_bias: bool, bf16: bool, asm: bool,
                 even: bool) -> dict:
    """The constexprs of one kernel variant (a launch and :func:`compile_offline` build them here)."""
    meta = dict(NKEEP=pattern.n, BLOCK_B=cfg.block_b, BLOCK_N=cfg.block_n, BLOCK_KK=cfg.block_kk, SPLIT=split,
                HAS_BIAS=has_bias, IS_BF16=bf16, ASM=asm)
    if cfg.use_dot:
        meta["DOT_F32"] = not asm and bf16  # interpreter only: numpy has no bf16 matmul
    else:
        meta["EVEN"] = even
    return meta


def _kernel_fn(cfg: KernelConfig):
    if not cfg.use_dot:
        return _nm_int4_gemv_kernel
    return _nm_int4_tc_kernel


def compile_offline(cfg: KernelConfig, pattern: SparsityPattern, bf16: bool = False, split: bool = False,
                    arch: int = 90):
    """Compile one kernel variant for NVIDIA ``sm_<arch>`` without a GPU and return Triton's compiled
    kernel (``.asm`` holds ``ptx`` and ``cubin``).

    The inline PTX of both kernels only runs on a GPU (the interpreter runs its emulation), so CI
    assembles every variant through Triton's bundled ``ptxas`` this way; ``bench/kernel_sass.py`` reads
    the SASS of the result. Pointers are typed as the launcher passes them (activations fp16/bf16,
    packed words int32, partials fp32) and marked 16-byte aligned, like the large shapes the launcher
    specializes for. Needs ``TRITON_INTERPRET`` unset when this module was imported.
    """
    from triton.backends.compiler import GPUTarget

    cfg.validate(pattern)
    fn = _kernel_fn(cfg)
    if not hasattr(fn, "arg_names") or _interpreting():
        raise RuntimeError("compile_offline needs TRITON_INTERPRET unset when kernels.sparse_gemv is imported")
    meta = _kernel_meta(cfg, pattern, split, has_bias=False, bf16=bf16, asm=True, even=True)
    act = "*bf16" if bf16 else "*fp16"
    ptr_types = {"x_ptr": act, "x64_ptr": "*i64", "bias_ptr": act, "out_ptr": act, "part_ptr": "*fp32"}
    aligned_ints = {"N", "K", "KP", "G4", "stride_xb", "stride_x64", "stride_ob", "kk_per_split"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in meta:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in aligned_ints:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, sig, meta, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 128),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def launch(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None, cfg: KernelConfig, _return_kernel: bool = False):
    """Run the kernel once with ``cfg`` through Triton's normal launcher (validated by the caller).
    x2: [B, K] fp16/bf16 with unit inner stride (8-byte aligned rows for the GEMV kernel). Returns [B, N]
    (and the compiled kernel when asked)."""
    batch = x2.shape[0]
    plan = _Plan.of(p, cfg)
    out = torch.empty(batch, p.out_features, device=x2.device, dtype=x2.dtype)
    part, cnt = _SCRATCH.get(x2.device, plan.n_split * batch * p.out_features if plan.n_split > 1 else 1,
                             plan.grid0 * triton.cdiv(batch, cfg.block_b))
    args, meta = _kernel_args(x2, p, bias, out, part, cnt, cfg, plan)
    grid = (plan.grid0, plan.n_split, triton.cdiv(batch, cfg.block_b))
    fn = _kernel_fn(cfg)
    kernel = fn[grid](*args, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (out, kernel) if _return_kernel else out


def _launch_hooks_set() -> bool:
    """Whether a launch hook (a profiler such as proton) is registered: then the normal launcher runs,
    which calls it. Triton 3.4+ keeps the hooks in a ``HookChain`` that is never None, so an empty
    chain counts as none (testing ``is not None`` made the bound fast path dead code: the H200 host
    probe measured 80-134 us per eager call through the normal launcher instead). Runs on every
    bound call, so it reads the module attribute rather than importing."""
    hook = triton.knobs.runtime.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


class _Bound:
    """A layer's launcher for one (dtype, batch bucket, bias) after its first call: the compiled kernel per
    activation specialization, and the argument list with everything fixed filled in (ints, not
    tensors, so the raw launcher skips its pointer checks). ``__call__`` returns None whenever the fast
    path does not apply; the caller then takes the normal path."""

    def __init__(self, p: PackedNMInt4, x2: torch.Tensor, bias, cfg: KernelConfig, kernel, spec, bucket: int) -> None:
        self.ref = weakref.ref(p)
        self.cfg = cfg
        self.plan = _Plan.of(p, cfg)
        self.dev = x2.get_device()
        self.device = x2.device
        self.n_out = p.out_features
        self.gemv = not cfg.use_dot
        self.kernels = {spec: kernel}
        rows = max(bucket, x2.shape[0])
        self.part, self.cnt = _SCRATCH.get(x2.device, self.plan.n_split * rows * self.n_out if self.plan.n_split > 1 else 1,
                                           self.plan.grid0 * triton.cdiv(rows, cfg.block_b))
        self.max_rows = rows
        self.bias = bias  # keeps the tensor alive while its pointer is baked in
        dummy_out = torch.empty(1, self.n_out, dtype=x2.dtype, device=x2.device)
        args, meta = _kernel_args(x2[:1], p, bias, dummy_out, self.part, self.cnt, cfg, self.plan)
        names = _kernel_fn(cfg).arg_names
        args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args] + [meta[n] for n in names[len(args):]]  # all constexprs are passed explicitly
        self.args = args
        self.i_x, self.i_bias, self.i_out = 0, 6, 7
        self.i_b, self.i_stride, self.i_part_stride = 10, 14, 18
        self.has_bias = bias is not None
        self.keep = (p.qweight, p.qpos, p.scale_zero_words, p.group_ptr, p.group_shift)

    def __call__(self, x2: torch.Tensor, bias):
        if _launch_hooks_set() or x2.get_device() != self.dev or x2.stride(-1) != 1:
            return None
        if (bias is not None) != self.has_bias or (bias is not None and bias is not self.bias):
            return None
        batch = x2.shape[0]
        if batch > self.max_rows:
            return None
        xp = x2.data_ptr()
        stride = x2.stride(0)
        if self.gemv:
            if xp % 8 or stride % 4:
                return None
            stride //= 4
        kernel = self.kernels.get((xp % 16 == 0, stride % 16 == 0, stride == 1))
        if kernel is None:
            return None
        out = torch.empty(batch, self.n_out, dtype=x2.dtype, device=self.device)
        args = self.args.copy()
        args[self.i_x] = xp
        args[self.i_out] = out.data_ptr()
        args[self.i_b] = batch
        args[self.i_stride] = stride
        args[self.i_part_stride] = batch * self.n_out
        kernel.run(self.plan.grid0, self.plan.n_split, triton.cdiv(batch, self.cfg.block_b),
                   torch._C._cuda_getCurrentRawStream(self.dev), kernel.function, kernel.packed_metadata, None, None, None, *args)
        return out


def _spec_of(x2: torch.Tensor, gemv: bool) -> tuple:
    stride = x2.stride(0) // 4 if gemv else x2.stride(0)
    return (x2.data_ptr() % 16 == 0, stride % 16 == 0, stride == 1)


# (id(packed), dtype, bucket, has_bias) -> _Bound; entries drop when the packed weight is collected
_BOUND: dict[tuple, _Bound] = {}


def _bind(key: tuple, p: PackedNMInt4, x2: torch.Tensor, bias, cfg: KernelConfig, kernel) -> None:
    spec = _spec_of(x2, not cfg.use_dot)
    bound = _BOUND.get(key)
    if bound is not None and bound.ref() is p and bound.cfg == cfg:
        bound.kernels.setdefault(spec, kernel)
        return
    if torch.cuda.is_current_stream_capturing():
        return  # binding allocates scratch; the next eager call binds
    _BOUND[key] = _Bound(p, x2, bias, cfg, kernel, spec, key[2])
    weakref.finalize(p, _BOUND.pop, key, None)


class _TuneCache:
    """Chosen configs per key, persisted as JSON per device name (one file, rewritten atomically)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mem: dict[str, dict[str, KernelConfig]] = {}

    @staticmethod
    def path(device_name: str) -> Path:
        root = Path(os.environ.get("ADBATCH_CACHE", Path.home() / ".cache" / "adbatch"))
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name)
        return root / "kernels" / f"nm_int4_tune_{safe}_triton{triton.__version__}_k{KERNEL_VERSION}.json"

    def _load(self, device_name: str) -> dict[str, KernelConfig]:
        if device_name not in self._mem:
            table: dict[str, KernelConfig] = {}
            path = self.path(device_name)
            if path.is_file():
                try:
                    raw = json.loads(path.read_text())
                    table = {k: KernelConfig(**v["config"]) for k, v in raw.items()}
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("ignoring unreadable kernel tuning cache %s: %s", path, e)
            self._mem[device_name] = table
        return self._mem[device_name]

    def get(self, device_name: str, key: str) -> KernelConfig | None:
        with self._lock:
            return self._load(device_name).get(key)

    def put(self, device_name: str, key: str, cfg: KernelConfig, micros: float) -> None:
        with self._lock:
            table = self._load(device_name)
            table[key] = cfg
            path = self.path(device_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            raw = json.loads(path.read_text()) if path.is_file() else {}
            raw[key] = {"config": dataclasses.asdict(cfg), "us": round(micros, 3)}
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
            tmp.replace(path)


_CACHE = _TuneCache()


def _tune_l2_env() -> str:
    return os.environ.get("ADBATCH_NM_INT4_TUNE_L2", "warm")


def tune_l2() -> str:
    """``warm`` (default) or ``cold``: the L2 state the tuner times configs in (``ADBATCH_NM_INT4_TUNE_L2``)."""
    mode = _tune_l2_env()
    if mode not in ("cold", "warm"):
        raise ValueError(f"ADBATCH_NM_INT4_TUNE_L2 must be 'cold' or 'warm', got {mode!r}")
    return mode


def tune_key(p: PackedNMInt4, batch: int, dtype: torch.dtype) -> str:
    return (f"{p.pattern.value}|N{p.out_features}|K{p.in_features}|{str(dtype).removeprefix('torch.')}"
            f"|B{batch_bucket(batch)}|L2{tune_l2()}")


def time_graphed_ms(fn, l2: str) -> float:
    """Median ms of ``fn`` with the L2 in state ``l2``, both replayed from CUDA graphs so that no host
    launch cost is timed.

    ``warm`` (default): ``do_bench_cudagraph`` (back-to-back replays, L2 warm).
    ``cold``: :func:`_cold_graph_ms`, an L2 flush before every call. Round 6 on the H200 tuned cold with
    ``do_bench`` (flush, then an eager launch between two events) and picked worse configs than the
    warm tuner at most points (4096x14336 B = 2: 2:4 21.2 -> 37.8 us, dense 31.0 -> 57.9 us; 1:4 B = 1 on
    8192x28672 27.3 -> 35.0 us in graphs vs round 4, bench/results/kernels.md): the tuning launch runs
    through the slow Python path, whose host time exceeds the flush and so landed inside the timed
    window, varying by config. ncu showed the kernel durations of cold- and warm-picked configs within
    ~15 % of each other, so warm stays the default.
    """
    fn()  # compile / warm up outside the timing
    try:
        if l2 == "cold":
            return _cold_graph_ms(fn)
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median")
    except RuntimeError as e:
        log.debug("graph timing failed (%s); timing with events", e)
        return triton.testing.do_bench(fn, warmup=3, rep=8, return_mode="median")


def _cold_graph_ms(fn, calls: int = 8, replays: int = 7) -> float:
    """Median ms per call of ``fn`` after an L2 flush, without host time: a graph of ``calls`` x (flush
    256 MB, fn) minus a graph of the flushes alone, medians over ``replays`` replays each.
    (Not yet measured on the device: opt-in.)"""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    graphs = []
    with torch.cuda.stream(stream):
        for with_fn in (False, True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(calls):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    torch.cuda.synchronize()

    def median_ms(g) -> float:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    return max(median_ms(graphs[1]) - median_ms(graphs[0]), 1e-6) / calls


# When a list: autotune appends one dict per timed candidate (key, config, microseconds in the tuner's
# L2 state and, for the record, in the other one). Benchmarks set it to report what the tuner saw.
TUNE_LOG: list | None = None


def autotune(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> tuple[KernelConfig, float]:
    """Time every candidate on these inputs and return the fastest (config, microseconds)."""
    num_sms = _num_sms(x2.device)
    l2 = tune_l2()
    best: tuple[float, KernelConfig] | None = None
    for cfg in candidate_configs(p, x2.shape[0], num_sms):
        try:
            ms = time_graphed_ms(lambda: launch(x2, p, bias, cfg), l2)
            if TUNE_LOG is not None:
                other = "cold" if l2 == "warm" else "warm"
                TUNE_LOG.append(dict(key=tune_key(p, x2.shape[0], x2.dtype), config=dataclasses.asdict(cfg),
                                     **{f"{l2}_us": ms * 1e3, f"{other}_us": time_graphed_ms(lambda: launch(x2, p, bias, cfg), other) * 1e3}))
        except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:  # type: ignore[attr-defined]
            log.debug("config %s rejected: %s", cfg, e)
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        raise RuntimeError(f"no kernel config compiled for {tune_key(p, x2.shape[0], x2.dtype)}")
    return best[1], best[0] * 1e3


# (pattern, N, K, dtype, batch bucket, device, autotune flag) -> config
_FAST: dict[tuple, KernelConfig] = {}


def select_config(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> KernelConfig:
    """Cached tuned config, tuning on a miss (CUDA, ``ADBATCH_NM_INT4_AUTOTUNE`` != 0), else heuristic."""
    fast_key = (p.pattern, p.out_features, p.in_features, x2.dtype, batch_bucket(x2.shape[0]), x2.device,
                os.environ.get("ADBATCH_NM_INT4_AUTOTUNE", "1"), _tune_l2_env())
    cfg = _FAST.get(fast_key)
    if cfg is None:
        cfg = _select_config_slow(x2, p, bias)
        _FAST[fast_key] = cfg
    return cfg


def _select_config_slow(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> KernelConfig:
    batch = x2.shape[0]
    if not x2.is_cuda or os.environ.get("ADBATCH_NM_INT4_AUTOTUNE", "1") == "0":
        return heuristic_config(p, batch, _num_sms(x2.device))
    dev = _device_name(x2.device.index if x2.device.index is not None else torch.cuda.current_device())
    key = tune_key(p, batch, x2.dtype)
    cfg = _CACHE.get(dev, key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernel config for {key} not tuned yet: run once before CUDA-graph capture")
        cfg, micros = autotune(x2, p, bias)
        log.info("tuned %s on %s: %s (%.2f us)", key, dev, cfg, micros)
        _CACHE.put(dev, key, cfg, micros)
    return cfg


def nm_int4_linear_triton(
    x: torch.Tensor,
    p: PackedNMInt4,
    bias: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``x @ dequantize(p).T + bias`` with the Triton kernel.

    Args:
        x: fp16/bf16 [..., K] on CUDA (CPU tensors only under ``TRITON_INTERPRET=1``). Any number of
            rows works; batch sizes 1..64 are tuned, larger ones run the 64-row tile repeatedly.
        p: packed weight on x's device. bias: [N] or None.
        config: force a :class:`KernelConfig` (tests, benchmarks); default: tuned/cached.
    Returns: [..., N] in x's dtype.
    """
    k_in = p.in_features
    if config is None and x.dim() >= 1 and x.shape[-1] == k_in:
        # hot path: one dict lookup; the bound launcher re-checks what can change between calls
        x2 = x.reshape(-1, k_in)
        batch = x2.shape[0]
        if 0 < batch <= BATCH_BUCKETS[-1]:
            bound = _BOUND.get((id(p), x.dtype, _BUCKET_OF[batch], bias is not None))
            if bound is not None and bound.ref() is p:
                out = bound(x2, bias)
                if out is not None:
                    return out.view(*x.shape[:-1], p.out_features)
    _check_inputs(x, p, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k_in)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, p.out_features)
    if config is not None:
        config.validate(p.pattern)
        if not config.use_dot and not _gemv_ok(p):
            raise ValueError(f"the GEMV path needs in_features % 4 == 0, got {k_in}: use a tl.dot config")
    cfg = config if config is not None else select_config(x2, p, bias)
    if x2.stride(-1) != 1 or (not cfg.use_dot and (x2.stride(0) % 4 or x2.data_ptr() % 8)):
        # unit inner stride; for the GEMV kernel 8-byte aligned rows (it reads x as int64 words)
        x2 = x2.clone(memory_format=torch.contiguous_format)
    out, kernel = launch(x2, p, bias, cfg, _return_kernel=True)
    if config is None and x2.is_cuda and not _interpreting() and x2.shape[0] <= BATCH_BUCKETS[-1]:
        _bind((id(p), x.dtype, batch_bucket(x2.shape[0]), bias is not None), p, x2, bias, cfg, kernel)
    return out.reshape(*lead, p.out_features)
