"""@triton.jit helpers shared by the GEMV (:mod:`kernels.gemv_int4`) and tensor-core (:mod:`kernels.tc_int4`)
SparseGemv kernels: fp16/bf16 bit conversions, the per-row quantization-group index, the bit-exact
emulation of the packed-half / byte-permute instructions both kernels' inline PTX uses, and the output
write with the split-K reduction.

``ASM`` (a constexpr of both kernels) is fixed at trace time: True when compiling for the GPU (inline
PTX), False under ``TRITON_INTERPRET=1``, which cannot run PTX and runs an emulation with the same
integer operations (masks, shifts, byte permutes) and fp16/bf16 rounding after every packed operation.

Split-K (``SPLIT``, :func:`_finish`): each of the ``n_split`` programs of an output tile writes its fp32
partial tile to a scratch buffer, then increments the tile's counter; the program that sees the count
reach ``n_split - 1`` sums the partials in a fixed order, adds the bias, writes the output in x's dtype
and resets the counter. One launch, no zero-fill, no cast kernel, deterministic; the counters reset
themselves, so CUDA-graph replays work. Scratch and counters are shared per device (see
:mod:`kernels.int4_launch`), so launches that share them must not run concurrently on different streams.
"""

from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _emu_fma2(a, b, c, IS_BF16: tl.constexpr):
    lo = _f32_to_half(_half_to_f32(a, IS_BF16) * _half_to_f32(b, IS_BF16) + _half_to_f32(c, IS_BF16), IS_BF16)
    hi = _f32_to_half(_half_to_f32(a >> 16, IS_BF16) * _half_to_f32(b >> 16, IS_BF16) + _half_to_f32(c >> 16, IS_BF16), IS_BF16)
    return lo | (hi << 16)


@triton.jit
def _emu_nibble_pair(w, t: tl.constexpr, IS_BF16: tl.constexpr):
    """The shift + lop3 of pair t (see gemv_int4._dq_asm): nibbles (t, t + 4) of w as 16 + q in both halves."""
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
def _prmt_emul(lo, hi, sel):
    """``prmt.b32 d, lo, hi, sel`` (default mode, selector nibbles 0..7) in plain integer ops."""
    full = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    d = ((full >> (8 * (sel & 7)).to(tl.int64)) & 0xFF).to(tl.int32)
    d = d | (((full >> (8 * ((sel >> 4) & 7)).to(tl.int64)) & 0xFF).to(tl.int32) << 8)
    d = d | (((full >> (8 * ((sel >> 8) & 7)).to(tl.int64)) & 0xFF).to(tl.int32) << 16)
    d = d | (((full >> (8 * ((sel >> 12) & 7)).to(tl.int64)) & 0xFF).to(tl.int32) << 24)
    return d
