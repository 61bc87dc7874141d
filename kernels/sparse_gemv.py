"""Triton SparseGemv: ``y[B, N] = x[B, K] @ W.T`` with W in :class:`~kernels.nm_int4.PackedNMInt4`.

Two kernels, specialised by constexprs, read the packed format directly (no unpacked copy):

- ``NKEEP`` = n of the n:4 pattern (4 = dense INT4, 2 = 2:4, 1 = 1:4).
- ``USE_DOT`` = False: the *GEMV* path, batch tiles of <= 4 rows (:func:`_nm_int4_gemv_kernel`; the
  tuner also tries it for 5-8 rows as two tiles). Each kept value is dequantized once and multiplied
  with the activation it meets. Dequantization is the fp16 magic-number trick (one ``lop3`` turns two
  nibbles into the fp16 pair ``1024 + q``, a ``cvt`` each to fp32, one FFMA with the 1024 offset folded
  into the per-group constant). For n:4 the 4 activations of a column group arrive as one 8-byte load
  (shared by the tile rows a thread holds) and one ``prmt`` picks the pair (2:4) or value (1:4) at
  the stored positions, with byte selectors built for 4 positions at a time; pruned zeros are never
  materialised. The PTX runs through ``tl.inline_asm_elementwise`` on the GPU; under the interpreter
  the constexpr ``ASM`` selects a bit-exact integer emulation (same masks and selectors).
- ``USE_DOT`` = True: the *tensor-core* path for larger B (:func:`_nm_int4_dot_kernel`). The kept
  tile is dequantized, scattered into a dense ``[4 * BLOCK_KK / n, BLOCK_N]`` tile in registers
  (compare-and-select on the 2-bit positions) and fed to ``tl.dot`` with an x tile of ``BLOCK_B``
  (>= 16) rows.
- ``ATOMIC``: split-K over the kept dimension; partial sums are added into a zeroed fp32 buffer.

Grid: ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(B, BLOCK_B))``. Each program walks ``BLOCK_KK`` kept values
at a time; ``BLOCK_KK`` is a multiple of 32 and every row's group size is a power of two >= 32, so
each 32-value sub-block of a row has exactly one ``(scale, zero)`` pair (one gathered 4-byte load per
row and sub-block). Accumulation is fp32; activations are fp16 or bf16.

:func:`nm_int4_linear_triton` is the launcher: it picks a :class:`KernelConfig` per
(pattern, N, K, dtype, batch bucket, device) -- by timing a small candidate set once and caching the
winner as JSON under ``$ADBATCH_CACHE/kernels/`` (default ``~/.cache/adbatch``), or by a heuristic when
``ADBATCH_NM_INT4_AUTOTUNE=0`` or under the interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import threading
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.nm_int4 import PackedNMInt4, SparsityPattern

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GEMV_MAX_BATCH = 4  # largest batch tile of the GEMV (no tensor core) kernel
GEMV_TUNE_MAX_BATCH = 8  # largest bucket whose tuner also times GEMV configs (several batch tiles)
KERNEL_VERSION = 2  # part of the tuning-cache file name: configs tuned for older kernels are not reused


@triton.jit
def _dot_acc(acc, xt, w, DOT_F32: tl.constexpr):
    """acc [BB, BN] fp32 += xt [BB, BK] @ w [BK, BN] (w fp32, rounded to x's dtype for the tensor cores)."""
    if DOT_F32:
        return acc + tl.dot(xt.to(tl.float32), w.to(xt.dtype).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(xt, w.to(xt.dtype), acc)


@triton.jit
def _nibble_f32(words, shift):
    """fp32 value of the 4-bit field at ``shift`` of int32 ``words``: OR-ing the field into the mantissa
    of 2**23 and subtracting 2**23 is exact and avoids the slow integer-to-float conversion (I2F)."""
    bits = ((words >> shift) & 0xF) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _scale_zero(sz_ptr, gp0, gp_last, gsh, kk_first, n_mask):
    """(scale, zero*scale) fp32 for rows (last axis) at kept offsets ``kk_first`` (any shape broadcasting
    against the rows). sz_ptr is scale_zero viewed as int32: low half = scale, high half = zero."""
    gidx = tl.minimum(gp0 + (kk_first >> gsh), gp_last)  # clamp keeps the padding inside the row
    v = tl.load(sz_ptr + gidx, mask=n_mask, other=0)
    s = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    z = ((v >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, z * s


@triton.jit
def _store_out(out_ptr, bias_ptr, acc, offs_b, b_mask, offs_n, n_mask, stride_ob, pid_k, ATOMIC: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if ATOMIC:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    out_ptrs = out_ptr + offs_b[:, None] * stride_ob + offs_n[None, :]
    mask = b_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- GEMV helpers: each has an inline-PTX body (GPU) and a bit-exact emulation (interpreter) ----------
# ``ASM`` is a constexpr fixed at trace time: True when compiling for the GPU, False under
# TRITON_INTERPRET=1 (the interpreter cannot run PTX). Both bodies return identical values, and the
# emulation mirrors the PTX bit by bit (same masks, same byte selectors), so the interpreter tests
# exercise the selector arithmetic the GPU uses.


@triton.jit
def _dq_pair(sw, ASM: tl.constexpr):
    """fp32 ``(1024 + q_lo, 1024 + q_hi)`` of the nibbles at bits 0..3 and 16..19 of int32 ``sw``.

    OR-ing a nibble into the mantissa of fp16 1024.0 (0x6400) makes it the fp16 value ``1024 + q``
    exactly, so one ``lop3`` turns two nibbles into an fp16 pair; each half then costs one
    ``cvt.f32.f16``. The 1024 offset is folded into the per-group constant (``w = v*s + c``,
    ``c = -(1024 + zero) * scale``), so no subtraction is needed."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; .reg .b16 a, b; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; "
            "mov.b32 {a, b}, t; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; }",
            constraints="=r,=r,r",
            args=[sw],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        t = (sw & 0x000F000F) | 0x64006400
        lo = (t & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((t >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _half_to_f32(h, IS_BF16: tl.constexpr):
    """fp32 value of the 16-bit pattern in the low half of int32 ``h`` (interpreter path)."""
    if IS_BF16:
        return ((h & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


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
def _pick2(lo, hi, sel, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """Two activations (fp32) picked from the 4 fp16/bf16 values held in ``lo`` (x0 | x1 << 16) and
    ``hi`` (x2 | x3 << 16): half ``i`` of the result is x[p_i] when byte ``i`` of ``sel`` is
    ``0x22 * p_i + 0x10`` (the ``prmt`` byte selector of half p_i). One ``prmt`` per pair of kept
    values replaces the bit-test-and-select chains of a gather."""
    if ASM:
        if IS_BF16:
            asm: tl.constexpr = ("{ .reg .b32 t; .reg .b16 a, b; prmt.b32 t, $2, $3, $4; mov.b32 {a, b}, t; "
                                 "cvt.f32.bf16 $0, a; cvt.f32.bf16 $1, b; }")
        else:
            asm: tl.constexpr = ("{ .reg .b32 t; .reg .b16 a, b; prmt.b32 t, $2, $3, $4; mov.b32 {a, b}, t; "
                                 "cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; }")
        a, b = tl.inline_asm_elementwise(
            asm=asm, constraints="=r,=r,r,r,r", args=[lo, hi, sel], dtype=(tl.float32, tl.float32), is_pure=True, pack=1
        )
    else:
        d = _prmt_emul(lo, hi, sel)
        a = _half_to_f32(d, IS_BF16)
        b = _half_to_f32(d >> 16, IS_BF16)
    return a, b


@triton.jit
def _pick1(lo, hi, sel, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """One activation (fp32): x[p] with ``sel = 0x22 * p + 0x10`` (see :func:`_pick2`)."""
    if ASM:
        if IS_BF16:
            asm: tl.constexpr = "{ .reg .b32 t; .reg .b16 a, b; prmt.b32 t, $1, $2, $3; mov.b32 {a, b}, t; cvt.f32.bf16 $0, a; }"
        else:
            asm: tl.constexpr = "{ .reg .b32 t; .reg .b16 a, b; prmt.b32 t, $1, $2, $3; mov.b32 {a, b}, t; cvt.f32.f16 $0, a; }"
        a = tl.inline_asm_elementwise(asm=asm, constraints="=r,r,r,r", args=[lo, hi, sel], dtype=tl.float32, is_pure=True, pack=1)
    else:
        a = _half_to_f32(_prmt_emul(lo, hi, sel), IS_BF16)
    return a


@triton.jit
def _x_quad(x_row64, g, G4):
    """Column group ``g`` ([W, 1]) of one x row as two int32 words (x0|x1<<16, x2|x3<<16): one 8-byte
    load; zeros past the last group ``G4`` (padding slots)."""
    v = tl.load(x_row64 + g, mask=g < G4, other=0)
    return v.to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def _selectors4(pp):
    """int32 whose byte i is ``0x22 * p_i + 0x10`` for the 2-bit fields p_0..p_3 in bits 0..7 of ``pp``:
    the prmt selector nibbles (2 p_i, 2 p_i + 1) of half p_i. Two spread steps (each one shift and
    one and-or) move field i to byte i; bytes never carry (0x22 * 3 + 0x10 < 256)."""
    t = (pp | (pp << 12)) & 0x000F000F
    t = (t | (t << 6)) & 0x03030303
    return t * 0x22 + 0x10101010


@triton.jit
def _acc_pair(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g, G4, sel, wa, wb, BLOCK_B: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """2:4: add wa * x[p0] + wb * x[p1] of column group ``g`` to each batch row's accumulator; the low
    16 bits of ``sel`` are the prmt selector of (p0, p1) (see :func:`_selectors4`), shared by the batch
    rows."""
    lo, hi = _x_quad(y0, g, G4)
    xa, xb = _pick2(lo, hi, sel, IS_BF16, ASM)
    acc0 += xa * wa
    acc0 += xb * wb
    if BLOCK_B > 1:
        lo, hi = _x_quad(y1, g, G4)
        xa, xb = _pick2(lo, hi, sel, IS_BF16, ASM)
        acc1 += xa * wa
        acc1 += xb * wb
    if BLOCK_B > 2:
        lo, hi = _x_quad(y2, g, G4)
        xa, xb = _pick2(lo, hi, sel, IS_BF16, ASM)
        acc2 += xa * wa
        acc2 += xb * wb
        lo, hi = _x_quad(y3, g, G4)
        xa, xb = _pick2(lo, hi, sel, IS_BF16, ASM)
        acc3 += xa * wa
        acc3 += xb * wb
    return acc0, acc1, acc2, acc3


@triton.jit
def _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g, G4, sel, w, BLOCK_B: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """1:4: add w * x[p] of column group ``g`` to each batch row; the low byte of ``sel`` is the prmt
    selector ``0x22 * p + 0x10`` of half p."""
    lo, hi = _x_quad(y0, g, G4)
    acc0 += _pick1(lo, hi, sel, IS_BF16, ASM) * w
    if BLOCK_B > 1:
        lo, hi = _x_quad(y1, g, G4)
        acc1 += _pick1(lo, hi, sel, IS_BF16, ASM) * w
    if BLOCK_B > 2:
        lo, hi = _x_quad(y2, g, G4)
        acc2 += _pick1(lo, hi, sel, IS_BF16, ASM) * w
        lo, hi = _x_quad(y3, g, G4)
        acc3 += _pick1(lo, hi, sel, IS_BF16, ASM) * w
    return acc0, acc1, acc2, acc3


@triton.jit
def _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, col, K, w, BLOCK_B: tl.constexpr):
    ok = col < K
    acc0 += tl.load(x0 + col, mask=ok, other=0.0).to(tl.float32) * w
    if BLOCK_B > 1:
        acc1 += tl.load(x1 + col, mask=ok, other=0.0).to(tl.float32) * w
    if BLOCK_B > 2:
        acc2 += tl.load(x2 + col, mask=ok, other=0.0).to(tl.float32) * w
        acc3 += tl.load(x3 + col, mask=ok, other=0.0).to(tl.float32) * w
    return acc0, acc1, acc2, acc3


@triton.jit
def _acc_dense(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0, K, w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_B: tl.constexpr):
    """Dense: the 8 values of a word meet columns c0 .. c0 + 7 (shared by every row of the tile)."""
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0, K, w0, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 1, K, w1, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 2, K, w2, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 3, K, w3, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 4, K, w4, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 5, K, w5, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 6, K, w6, BLOCK_B)
    acc0, acc1, acc2, acc3 = _acc_dense1(acc0, acc1, acc2, acc3, x0, x1, x2, x3, c0 + 7, K, w7, BLOCK_B)
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["B"])
def _nm_int4_gemv_kernel(
    x_ptr,  # [B, K] fp16/bf16, stride (stride_xb, 1)
    x64_ptr,  # the same memory viewed as int64 [B, K/4] (sparse patterns; any pointer for DENSE)
    qw_ptr,  # int32 [KP/8, N]
    qp_ptr,  # int32 [KP/16, N] (unused when NKEEP == 4)
    sz_ptr,  # int32 [G] (= fp16 [G, 2] scale_zero)
    gptr_ptr,  # int32 [N+1]
    gshift_ptr,  # int32 [N]
    bias_ptr,  # [N] or dummy
    out_ptr,  # [B, N]: x dtype, or fp32 when ATOMIC
    B,
    N,
    K,
    KP,
    stride_xb,
    stride_ob,
    kk_per_split,
    NKEEP: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 1, 2 or 4 activation rows, one fp32 accumulator tile each
    BLOCK_N: tl.constexpr,
    BLOCK_KK: tl.constexpr,
    ATOMIC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_BF16: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (GPU) or its emulation (interpreter)
):
    """GEMV path. Every tensor in the loop has the 2-D shape of the loaded word tile
    ``[BLOCK_KK/8, BLOCK_N]`` (the 8 nibbles of a word are unrolled, position words are loaded once per
    value word), so unpacking needs no layout shuffles; products accumulate elementwise and the one
    cross-thread reduction happens after the loop.

    Per word (8 kept values) and thread: 4 ``lop3`` + 3 shifts + 8 ``cvt`` + 8 FFMA dequantize; for
    n:4 the activations of a column group arrive as one 8-byte load (shared by the thread's rows of
    the tile) and each pair (2:4) or value (1:4) picks its activations with one ``prmt``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2)
    W: tl.constexpr = BLOCK_KK // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    n_mask = offs_n < N
    gp0 = tl.load(gptr_ptr + offs_n, mask=n_mask, other=0)[None, :]
    gp_last = tl.load(gptr_ptr + offs_n + 1, mask=n_mask, other=1)[None, :] - 1
    gsh = tl.load(gshift_ptr + offs_n, mask=n_mask, other=5)[None, :]
    w_idx = tl.arange(0, W)[:, None]  # [W, 1]
    pos_base = 16 * (w_idx % 2)  # bit offset of this word's 8 positions inside its position word
    row0 = pid_b * BLOCK_B
    # rows past B re-read row B-1 (their results are masked at the store): no per-row load masks
    r1 = tl.minimum(row0 + 1, B - 1)
    r2 = tl.minimum(row0 + 2, B - 1)
    r3 = tl.minimum(row0 + 3, B - 1)
    x0 = x_ptr + row0 * stride_xb
    x1 = x_ptr + r1 * stride_xb
    x2 = x_ptr + r2 * stride_xb
    x3 = x_ptr + r3 * stride_xb
    s64 = stride_xb // 4  # int64 words per x row (stride_xb % 4 == 0 is checked by the launcher)
    y0 = x64_ptr + row0 * s64
    y1 = x64_ptr + r1 * s64
    y2 = x64_ptr + r2 * s64
    y3 = x64_ptr + r3 * s64
    G4 = K // 4
    acc0 = tl.zeros([W, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([W, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([W, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([W, BLOCK_N], dtype=tl.float32)
    tile_off = w_idx * N + offs_n[None, :]
    nm2 = n_mask[None, :]

    k_lo = pid_k * kk_per_split
    k_hi = tl.minimum(k_lo + kk_per_split, KP)
    for kk0 in range(k_lo, k_hi, BLOCK_KK):
        words = tl.load(qw_ptr + (kk0 // 8) * N + tile_off, mask=nm2, other=0)
        kk_w = kk0 + 8 * w_idx  # [W, 1] kept index of nibble 0 of each word
        # one (scale, zero) per row and 32-value sub-block, gathered as [1, BLOCK_N] rows and spread
        # over the 4 words of each sub-block by selects: a [W, BLOCK_N] gather here made Triton 3.6
        # pick a transposed layout for it and shuttle 8 tiles per step through shared memory
        s, zs = _scale_zero(sz_ptr, gp0, gp_last, gsh, kk0, nm2)
        for b in tl.static_range(1, BLOCK_KK // 32):
            s_b, zs_b = _scale_zero(sz_ptr, gp0, gp_last, gsh, kk0 + 32 * b, nm2)
            in_b = w_idx >= 4 * b
            s = tl.where(in_b, s_b, s)
            zs = tl.where(in_b, zs_b, zs)
        c = -(zs + 1024.0 * s)  # w = (1024 + q) * s + c
        # dequantize the 8 nibbles: _dq_pair of words >> 4t yields nibbles t and t + 4
        v0, v4 = _dq_pair(words, ASM)
        v1, v5 = _dq_pair(words >> 4, ASM)
        v2, v6 = _dq_pair(words >> 8, ASM)
        v3, v7 = _dq_pair(words >> 12, ASM)
        w0 = v0 * s + c
        w1 = v1 * s + c
        w2 = v2 * s + c
        w3 = v3 * s + c
        w4 = v4 * s + c
        w5 = v5 * s + c
        w6 = v6 * s + c
        w7 = v7 * s + c
        if NKEEP == 4:
            acc0, acc1, acc2, acc3 = _acc_dense(acc0, acc1, acc2, acc3, x0, x1, x2, x3, kk_w, K, w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_B)
        else:
            # row w of the tile reads position word w // 2 (a repeated, L1-served load keeps the layout)
            pw = tl.load(qp_ptr + (kk0 // 16) * N + (w_idx // 2) * N + offs_n[None, :], mask=nm2, other=0)
            pw = pw >> pos_base  # this word's 8 positions now sit in bits 0..15
            if NKEEP == 2:
                # kept values 2u, 2u+1 share column group kk_w/2 + u; their positions are bits 4u..4u+3.
                # Spread the 8 two-bit positions into bytes (4 per int32), then one multiply-add turns
                # every byte p into the prmt selector 0x22 * p + 0x10 of half p: bytes 2u, 2u+1 of
                # (sel_a, sel_b) are the selector of pair u.
                g = kk_w // 2
                sel_a = _selectors4(pw & 0xFF)
                sel_b = _selectors4((pw >> 8) & 0xFF)
                acc0, acc1, acc2, acc3 = _acc_pair(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g, G4, sel_a, w0, w1, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_pair(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 1, G4, sel_a >> 16, w2, w3, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_pair(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 2, G4, sel_b, w4, w5, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_pair(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 3, G4, sel_b >> 16, w6, w7, BLOCK_B, IS_BF16, ASM)
            else:
                # value j sits alone in column group kk_w + j; byte j of (sel_a, sel_b) is its selector
                # (prmt reads nibbles 0..3 of the selector; the upper two only shape the unused half)
                g = kk_w
                sel_a = _selectors4(pw & 0xFF)
                sel_b = _selectors4((pw >> 8) & 0xFF)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g, G4, sel_a, w0, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 1, G4, sel_a >> 8, w1, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 2, G4, sel_a >> 16, w2, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 3, G4, sel_a >> 24, w3, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 4, G4, sel_b, w4, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 5, G4, sel_b >> 8, w5, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 6, G4, sel_b >> 16, w6, BLOCK_B, IS_BF16, ASM)
                acc0, acc1, acc2, acc3 = _acc_one(acc0, acc1, acc2, acc3, y0, y1, y2, y3, g + 7, G4, sel_b >> 24, w7, BLOCK_B, IS_BF16, ASM)

    offs_b = row0 + tl.arange(0, BLOCK_B)
    r0 = tl.sum(acc0, axis=0)
    if BLOCK_B == 1:
        acc = r0[None, :]
    else:
        sel_b = tl.arange(0, BLOCK_B)[:, None]
        acc = tl.where(sel_b == 0, r0[None, :], tl.sum(acc1, axis=0)[None, :])
        if BLOCK_B > 2:
            acc = tl.where(sel_b == 2, tl.sum(acc2, axis=0)[None, :], acc)
            acc = tl.where(sel_b == 3, tl.sum(acc3, axis=0)[None, :], acc)
    _store_out(out_ptr, bias_ptr, acc, offs_b, offs_b < B, offs_n, n_mask, stride_ob, pid_k, ATOMIC, HAS_BIAS)


@triton.jit(do_not_specialize=["B"])
def _nm_int4_dot_kernel(
    x_ptr,  # [B, K] fp16/bf16, stride (stride_xb, 1)
    qw_ptr,  # int32 [KP/8, N]
    qp_ptr,  # int32 [KP/16, N] (unused when NKEEP == 4)
    sz_ptr,  # int32 [G] (= fp16 [G, 2] scale_zero)
    gptr_ptr,  # int32 [N+1]
    gshift_ptr,  # int32 [N]
    bias_ptr,  # [N] or dummy
    out_ptr,  # [B, N]: x dtype, or fp32 when ATOMIC
    B,
    N,
    K,
    KP,
    stride_xb,
    stride_ob,
    kk_per_split,
    NKEEP: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KK: tl.constexpr,
    ATOMIC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,  # interpreter only: numpy has no bf16 matmul
):
    """Tensor-core path: dequantize + densify a [4*BLOCK_KK/n, BLOCK_N] tile, tl.dot with x."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = offs_b < B
    gp0 = tl.load(gptr_ptr + offs_n, mask=n_mask, other=0)[None, :]
    gp_last = tl.load(gptr_ptr + offs_n + 1, mask=n_mask, other=1)[None, :] - 1
    gsh = tl.load(gshift_ptr + offs_n, mask=n_mask, other=5)[None, :]

    SB: tl.constexpr = BLOCK_KK // 32  # 32-value sub-blocks: one (scale, zero) per row each
    BLOCK_G: tl.constexpr = BLOCK_KK // NKEEP  # column groups of 4 covered by a tile
    nib_shift = tl.arange(0, 8) * 4
    pos_shift = tl.arange(0, 16) * 2
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)

    k_lo = pid_k * kk_per_split
    k_hi = tl.minimum(k_lo + kk_per_split, KP)
    for kk0 in range(k_lo, k_hi, BLOCK_KK):
        w_rows = kk0 // 8 + tl.arange(0, BLOCK_KK // 8)
        words = tl.load(qw_ptr + w_rows[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        q = _nibble_f32(words[:, None, :], nib_shift[None, :, None])
        q = tl.reshape(q, [SB, 32, BLOCK_N])
        s, zs = _scale_zero(sz_ptr, gp0, gp_last, gsh, (kk0 + tl.arange(0, SB) * 32)[:, None], n_mask[None, :])
        w = q * s[:, None, :] - zs[:, None, :]
        w = tl.reshape(w, [BLOCK_KK, BLOCK_N])
        if NKEEP == 4:
            offs_k = kk0 + tl.arange(0, BLOCK_KK)
            xt = tl.load(
                x_ptr + offs_b[:, None] * stride_xb + offs_k[None, :],
                mask=b_mask[:, None] & (offs_k < K)[None, :],
                other=0.0,
            )
            acc = _dot_acc(acc, xt, w, DOT_F32)
        else:
            p_rows = kk0 // 16 + tl.arange(0, BLOCK_KK // 16)
            pwords = tl.load(qp_ptr + p_rows[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
            pos = tl.reshape((pwords[:, None, :] >> pos_shift[None, :, None]) & 3, [BLOCK_KK, BLOCK_N])
            # scatter the kept tile into its dense [4 * BLOCK_G, BLOCK_N] tile (zeros where pruned)
            wg = tl.reshape(w, [BLOCK_G, NKEEP, BLOCK_N])
            pg = tl.reshape(pos, [BLOCK_G, NKEEP, BLOCK_N])
            slot = tl.arange(0, 4)
            if NKEEP == 1:
                d = tl.where(pg[:, :, None, :] == slot[None, None, :, None], wg[:, :, None, :], 0.0)
                dense = tl.reshape(d, [BLOCK_G * 4, BLOCK_N])
            else:
                # 2:4 keeps p0 < p1, so each dense slot takes w0, w1 or 0: two selects, no sum
                w0, w1 = tl.split(tl.permute(wg, [0, 2, 1]))
                p0, p1 = tl.split(tl.permute(pg, [0, 2, 1]))
                s3 = slot[None, :, None]
                dense = tl.where(p0[:, None, :] == s3, w0[:, None, :], tl.where(p1[:, None, :] == s3, w1[:, None, :], 0.0))
                dense = tl.reshape(dense, [BLOCK_G * 4, BLOCK_N])
            offs_k = (kk0 // NKEEP) * 4 + tl.arange(0, BLOCK_G * 4)
            xt = tl.load(
                x_ptr + offs_b[:, None] * stride_xb + offs_k[None, :],
                mask=b_mask[:, None] & (offs_k < K)[None, :],
                other=0.0,
            )
            acc = _dot_acc(acc, xt, dense, DOT_F32)
    _store_out(out_ptr, bias_ptr, acc, offs_b, b_mask, offs_n, n_mask, stride_ob, pid_k, ATOMIC, HAS_BIAS)


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
        if not self.use_dot and self.block_b > GEMV_MAX_BATCH:
            raise ValueError(f"the GEMV path takes block_b <= {GEMV_MAX_BATCH}: {self}")
        if self.use_dot and (self.block_b < 16 or 4 * self.block_kk // pattern.n < 16 or self.block_n < 16):
            raise ValueError(f"tl.dot needs block_b, block_n and the dense K tile >= 16: {self}")
        for name in ("block_b", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if self.split_k < 1:
            raise ValueError(f"split_k={self.split_k} must be >= 1")


def batch_bucket(batch: int) -> int:
    """Smallest bucket in BATCH_BUCKETS holding ``batch`` (64 for anything larger)."""
    for b in BATCH_BUCKETS:
        if batch <= b:
            return b
    return BATCH_BUCKETS[-1]


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
    steps = p.padded_kept // block_kk
    want = _pow2_floor(waves * num_sms / programs) if programs < waves * num_sms else 1
    return max(1, min(want, _pow2_floor(steps / 4), 32))


def heuristic_config(p: PackedNMInt4, batch: int, num_sms: int) -> KernelConfig:
    """A reasonable config without timing (interpreter, or autotuning disabled)."""
    bucket = batch_bucket(batch)
    use_dot = bucket > GEMV_MAX_BATCH
    block_b = max(16, bucket) if use_dot else bucket
    block_kk = max(32, 128 * p.pattern.n // 4) if use_dot else 32
    block_n = 64
    n_bblocks = triton.cdiv(batch, block_b)
    split = _split_for(p, block_n, block_kk, n_bblocks, num_sms)
    return KernelConfig(block_b, block_n, block_kk, split, use_dot)


def candidate_configs(p: PackedNMInt4, batch: int, num_sms: int) -> list[KernelConfig]:
    """The small set of configs the autotuner times for this (shape, batch bucket).

    Tiles are sized so each thread holds at most ~128 fp32 tile elements (no register spills); each
    tile shape is tried without split-K and with splits giving about 4 and 16 programs per SM.
    """
    bucket = batch_bucket(batch)
    out: list[KernelConfig] = []
    if bucket <= GEMV_TUNE_MAX_BATCH:
        # GEMV tiles with <= 72 registers/thread under Triton 3.6 (round 2 SASS); bucket 8 runs two
        # 4-row batch tiles, which re-read the weight tile from L2 but skip the densify of the dot path
        for block_n, block_kk, warps in ((64, 32, 4), (64, 64, 4), (128, 64, 8), (32, 128, 4)):
            cfg = KernelConfig(min(bucket, GEMV_MAX_BATCH), block_n, block_kk, 1, False, warps)
            out += _with_splits(p, batch, cfg, num_sms)
    kk128 = 128 * p.pattern.n // 4  # kept values whose dense tile is 128 columns wide
    # 32- and 64-row buckets also try 16-row tiles: each batch tile re-reads the weights from L2
    for block_b in sorted({max(16, bucket), 16}):
        for block_n, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
            if block_b * block_n > 64 * 64:
                continue
            cfg = KernelConfig(block_b, block_n, max(32, kk128), 1, True, warps)
            out += _with_splits(p, batch, cfg, num_sms)
    return list(dict.fromkeys(out))


def _with_splits(p: PackedNMInt4, batch: int, cfg: KernelConfig, num_sms: int) -> list[KernelConfig]:
    """No split, and splits giving about 4 and 16 programs per SM (ncu showed grids of ~4 programs
    per SM leave the SMs at ~22% occupancy with half the issue slots idle)."""
    n_b = triton.cdiv(batch, cfg.block_b)
    splits = {1, _split_for(p, cfg.block_n, cfg.block_kk, n_b, num_sms), _split_for(p, cfg.block_n, cfg.block_kk, n_b, num_sms, 16.0)}
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
    if p.padded_kept % 128 or p.out_features >= 2**31 // max(1, p.padded_kept // 8):
        raise ValueError(f"packed weight of shape {p.out_features}x{p.in_features} exceeds the int32 indexing of the kernel")


def _x_words(x2: torch.Tensor, p: PackedNMInt4) -> torch.Tensor:
    """x2 [B, K] viewed as int64 [B, K/4] (one column group per word) for the n:4 GEMV kernel; the
    dense kernel does not read it (x2 itself is passed)."""
    if not p.pattern.is_sparse:
        return x2
    if x2.stride(0) % 4 or x2.data_ptr() % 8:
        raise ValueError("x: rows must start on 8-byte boundaries (launch() copies misaligned inputs)")
    return x2.view(torch.int64)


def launch(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None, cfg: KernelConfig) -> torch.Tensor:
    """Run the kernel once with ``cfg`` (validated by the caller). x2: [B, K] fp16/bf16 with unit inner
    stride. Returns [B, N]."""
    batch = x2.shape[0]
    n_out = p.out_features
    steps = p.padded_kept // cfg.block_kk
    split = max(1, min(cfg.split_k, steps))
    kk_per_split = triton.cdiv(steps, split) * cfg.block_kk
    split = triton.cdiv(p.padded_kept, kk_per_split)
    atomic = split > 1
    if atomic:
        out = torch.zeros(batch, n_out, device=x2.device, dtype=torch.float32)
    else:
        out = torch.empty(batch, n_out, device=x2.device, dtype=x2.dtype)
    grid = (triton.cdiv(n_out, cfg.block_n), split, triton.cdiv(batch, cfg.block_b))
    args = (
        x2,
        p.qweight,
        p.qpos if p.pattern.is_sparse else p.qweight,
        p.scale_zero_words,
        p.group_ptr,
        p.group_shift,
        bias if bias is not None else out,
        out,
        batch,
        n_out,
        p.in_features,
        p.padded_kept,
        x2.stride(0),
        out.stride(0),
        kk_per_split,
    )
    meta = dict(
        NKEEP=p.pattern.n,
        BLOCK_B=cfg.block_b,
        BLOCK_N=cfg.block_n,
        BLOCK_KK=cfg.block_kk,
        ATOMIC=atomic,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.use_dot:
        _nm_int4_dot_kernel[grid](*args, DOT_F32=_interpreting() and x2.dtype == torch.bfloat16, **meta)
    else:
        _nm_int4_gemv_kernel[grid](
            args[0], _x_words(x2, p), *args[1:], IS_BF16=x2.dtype == torch.bfloat16, ASM=not _interpreting(), **meta
        )
    return out.to(x2.dtype) if atomic else out


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


def tune_key(p: PackedNMInt4, batch: int, dtype: torch.dtype) -> str:
    return f"{p.pattern.value}|N{p.out_features}|K{p.in_features}|{str(dtype).removeprefix('torch.')}|B{batch_bucket(batch)}"


def _time_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (host launch overhead, tens of us for a Triton
    launch, would otherwise swamp the differences between configs); plain events if capture fails."""
    fn()  # compile / warm up outside the capture
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")
    except RuntimeError as e:
        log.debug("graph timing failed (%s); timing with events", e)
        return triton.testing.do_bench(fn, warmup=3, rep=12, return_mode="median")


def autotune(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> tuple[KernelConfig, float]:
    """Time every candidate on these inputs and return the fastest (config, microseconds)."""
    num_sms = _num_sms(x2.device)
    best: tuple[float, KernelConfig] | None = None
    for cfg in candidate_configs(p, x2.shape[0], num_sms):
        try:
            ms = _time_ms(lambda: launch(x2, p, bias, cfg))
        except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:  # type: ignore[attr-defined]
            log.debug("config %s rejected: %s", cfg, e)
            continue
        if best is None or ms < best[0]:
            best = (ms, cfg)
    if best is None:
        raise RuntimeError(f"no kernel config compiled for {tune_key(p, x2.shape[0], x2.dtype)}")
    return best[1], best[0] * 1e3


# (pattern, N, K, dtype, batch bucket, device, autotune flag) -> config: one dict lookup per call, no
# env/JSON/string work after the first call for a shape (host time is most of a small GEMV)
_FAST: dict[tuple, KernelConfig] = {}


def select_config(x2: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> KernelConfig:
    """Cached tuned config, tuning on a miss (CUDA, ``ADBATCH_NM_INT4_AUTOTUNE`` != 0), else heuristic."""
    fast_key = (p.pattern, p.out_features, p.in_features, x2.dtype, batch_bucket(x2.shape[0]), x2.device,
                os.environ.get("ADBATCH_NM_INT4_AUTOTUNE", "1"))
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
    _check_inputs(x, p, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.in_features)
    if x2.stride(-1) != 1 or (p.pattern.is_sparse and (x2.stride(0) % 4 or x2.data_ptr() % 8)):
        # unit inner stride; for n:4, 8-byte aligned rows (the kernel reads column groups as int64)
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, p.out_features)
    if config is not None:
        config.validate(p.pattern)
    cfg = config if config is not None else select_config(x2, p, bias)
    return launch(x2, p, bias, cfg).reshape(*lead, p.out_features)
