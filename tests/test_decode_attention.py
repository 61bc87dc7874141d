"""Triton decode attention (shared prompt + ancestry-indexed suffix) vs its torch reference, and the
reference vs a plain softmax over explicitly built key lists, on CPU under the Triton interpreter."""

from __future__ import annotations

import os

# The interpreter is chosen when @triton.jit runs, i.e. when the kernel module is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import decode_attention as da  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or type(da._decode_attention_kernel).__name__ != "InterpretedFunction",
    reason="needs the Triton interpreter (TRITON_INTERPRET=1 before kernels.decode_attention is imported)",
)


def _inputs(Qb, B, kv, g, D, Lp, S, dtype, seed, spare_rows=3):
    gen = torch.Generator().manual_seed(seed)
    R, H = Qb * B, kv * g
    q = torch.randn(R, H, D, generator=gen).to(dtype)
    kp = torch.randn(Qb + 1, kv, Lp, D, generator=gen).to(dtype)
    vp = torch.randn(Qb + 1, kv, Lp, D, generator=gen).to(dtype)
    plen = torch.randint(1, Lp + 1, (Qb + 1,), generator=gen)
    plen[0] = Lp                                   # one unpadded prompt
    valid = torch.arange(Lp)[None] >= Lp - plen[:, None]
    p_bias = torch.where(valid, 0.0, float("-inf"))
    p_pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    ks = torch.randn(S, R + spare_rows, kv, D, generator=gen).to(dtype)
    vs = torch.randn(S, R + spare_rows, kv, D, generator=gen).to(dtype)
    anc = torch.randint(0, R + spare_rows, (R + spare_rows, S), generator=gen, dtype=torch.int32)
    return q, kp, vp, p_bias, p_pos, plen, ks, vs, anc


@interpreted
@pytest.mark.parametrize("Qb,B,kv,g,D,Lp,S,t,window", [
    (2, 10, 3, 3, 64, 32, 8, 5, 0),    # the default model's heads, 10 beams: one 30-row tile
    (3, 4, 2, 2, 16, 20, 6, 0, 0),     # first step (only the new token in the suffix), odd Lp
    (2, 8, 2, 4, 32, 40, 8, 7, 3),     # sliding window: most prompt keys and early suffix masked
    (1, 1, 1, 1, 16, 16, 4, 3, 0),     # greedy: one row per query
    (2, 25, 2, 4, 16, 16, 4, 2, 0),    # 100 (beam, head) pairs: two tiles per query and head
    (2, 4, 2, 2, 16, 80, 4, 1, 0),     # prompt longer than one key block
])
def test_kernel_matches_reference(Qb, B, kv, g, D, Lp, S, t, window):
    # fp16 only: the interpreter has no bfloat16 (numpy); bf16 is checked against this reference
    # on the GPU by bench/decode.py before it times anything
    dtype = torch.float16
    args = _inputs(Qb, B, kv, g, D, Lp, S, dtype, seed=Qb * 100 + Lp + t)
    out = da.decode_attention(*args, torch.tensor([t]), B, 0.125, window)
    ref = da.decode_attention_reference(*args, t, B, 0.125, window)
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@interpreted
def test_kernel_writes_only_its_rows_into_a_given_out():
    args = _inputs(2, 4, 2, 2, 16, 16, 4, torch.float16, seed=7)
    out = torch.full((8 + 2, 4, 16), 7.0, dtype=torch.float16)
    da.decode_attention(*args, torch.tensor([2]), 4, 0.25, 0, out=out[:8])
    assert (out[8:] == 7.0).all() and not (out[:8] == 7.0).all()


def test_reference_is_softmax_over_prompt_and_ancestors():
    """Row r's keys: its query's real prompt keys, then ks[s, anc[r, s]] for s = 0..t."""
    Qb, B, kv, g, D, Lp, S, t = 2, 3, 1, 2, 8, 6, 5, 3
    q, kp, vp, p_bias, p_pos, plen, ks, vs, anc = _inputs(Qb, B, kv, g, D, Lp, S, torch.float32, seed=3)
    out = da.decode_attention_reference(q, kp, vp, p_bias, p_pos, plen, ks, vs, anc, t, B, 0.5)
    for r in range(Qb * B):
        qi = r // B
        keys = [kp[qi, 0, j] for j in range(Lp - int(plen[qi]), Lp)] + [ks[s, int(anc[r, s]), 0] for s in range(t + 1)]
        vals = [vp[qi, 0, j] for j in range(Lp - int(plen[qi]), Lp)] + [vs[s, int(anc[r, s]), 0] for s in range(t + 1)]
        K, V = torch.stack(keys), torch.stack(vals)
        for j in range(g):
            p = (K @ q[r, j] * 0.5).softmax(0)
            torch.testing.assert_close(out[r, j], p @ V, atol=1e-5, rtol=1e-5)


def test_rejects_bad_shapes():
    args = list(_inputs(2, 4, 2, 2, 16, 16, 4, torch.float16, seed=1))
    with pytest.raises(ValueError, match="multiple of beams"):
        da.decode_attention(*args, torch.tensor([0]), 3, 0.25)
    args[0] = torch.randn(8, 4, 12).half()
    with pytest.raises(ValueError, match="power of two"):
        da.decode_attention(*args, torch.tensor([0]), 4, 0.25)


@interpreted
def test_fp32_inputs_get_fp32_products():
    """fp32 inputs match the reference to fp32 precision. (On the GPU the kernel asks for IEEE fp32
    dots, not Triton's TF32 default; the interpreter computes in fp32 either way, so this checks the
    fp32 path's math, not the precision flag.)"""
    args = _inputs(2, 10, 3, 3, 64, 32, 8, torch.float32, seed=11)
    out = da.decode_attention(*args, torch.tensor([6]), 10, 0.125, 0)
    ref = da.decode_attention_reference(*args, 6, 10, 0.125, 0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_reference_over_a_subset_of_rows_equals_those_rows_of_the_whole():
    q, kp, vp, p_bias, p_pos, plen, ks, vs, anc = _inputs(3, 4, 2, 2, 16, 12, 6, torch.float32, seed=5)
    whole = da.decode_attention_reference(q, kp, vp, p_bias, p_pos, plen, ks, vs, anc, 4, 4, 0.25, window=3)
    rows = torch.tensor([0, 3, 5, 6, 11])
    part = da.decode_attention_reference(q[rows], kp, vp, p_bias, p_pos, plen, ks, vs, anc, 4, 4, 0.25,
                                         window=3, rows=rows)
    torch.testing.assert_close(part, whole[rows])


@pytest.mark.parametrize("Qb,B,kv,g,D,Lp,S,t,window", [
    (2, 10, 3, 3, 64, 32, 8, 5, 0),    # the default model's heads
    (3, 4, 2, 2, 16, 20, 6, 0, 0),     # first step
    (2, 8, 2, 4, 32, 40, 8, 7, 3),     # sliding window (always the per-row layout)
    (4, 8, 3, 3, 64, 48, 12, 9, 0),
])
@pytest.mark.parametrize("layout", ["chosen", "grid", "per_row"])
def test_cpu_row_attention_equals_the_reference(Qb, B, kv, g, D, Lp, S, t, window, layout):
    q, kp, vp, p_bias, p_pos, plen, ks, vs, anc = _inputs(Qb, B, kv, g, D, Lp, S, torch.float32, seed=7)
    gen = torch.Generator().manual_seed(t)
    for rows in (torch.arange(Qb * B), torch.randperm(Qb * B, generator=gen)[: Qb * B // 2].sort().values,
                 torch.tensor([Qb * B - 1])):
        idx = da.row_gather(anc, rows, t, B, Qb)
        if layout != "chosen":
            idx.grid = layout == "grid"
        prompt = (kp[:Qb], vp[:Qb], p_bias[:Qb], p_pos[:Qb], plen[:Qb])
        ref = da.decode_attention_reference(q[rows], *prompt, ks, vs, anc, t, B, 0.125, window, rows=rows)
        got = da.decode_attention_rows(q[rows], *prompt, ks, vs, idx, 0.125, window)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
