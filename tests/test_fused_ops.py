"""The decoder's fused row-wise Triton kernels (kernels/fused_ops.py) against the torch ops they
replace, on CPU under the Triton interpreter (fp16 and fp32: the interpreter has no bfloat16)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen when @triton.jit runs (first import)

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import fused_ops as fo  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or type(fo._row_lse_kernel).__name__ != "InterpretedFunction",
    reason="needs the Triton interpreter (TRITON_INTERPRET=1 before kernels.fused_ops is imported)",
)
DTYPES = [torch.float16, torch.float32]


def _tol(dtype):
    return dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_add", [False, True])
def test_add_rms_norm_matches_reference(dtype, unit_offset, with_add):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, 3, 72, generator=gen).to(dtype)       # width not a power of two
    a = torch.randn(5, 3, 72, generator=gen).to(dtype) if with_add else None
    w = (torch.rand(72, generator=gen) + 0.5).to(dtype)
    ref_h, ref_x = fo.add_rms_norm_reference(h.clone(), a, w, 1e-5, unit_offset)
    h_in = h.clone()
    out_h, out_x = fo.add_rms_norm(h_in, a, w, 1e-5, unit_offset)
    assert out_h.data_ptr() == h_in.data_ptr()                 # the sum lands in the residual buffer
    torch.testing.assert_close(out_h, ref_h, atol=0, rtol=0)   # one rounded add: exact
    torch.testing.assert_close(out_x.float(), ref_x.float(), **_tol(dtype))
    assert out_x.shape == h.shape and out_x.dtype == dtype


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_fp8_is_the_norm_then_the_row_quantization_kernel(dtype, unit_offset):
    """The fused norm + FP8 rows give the plain norm's sum and rows and, bit for bit, what the separate row
    quantization kernel (kernels.fp8_quant) makes of those rows -- both under the interpreter, whose e4m3
    rounding is its own (the CUDA test checks the quantization against the torch reference)."""
    from kernels.fp8_linear import FP8_DTYPE, quantize_rows_fp8_reference
    from kernels.fp8_quant import quantize_rows_fp8_triton

    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(6, 2, 72, generator=gen) * 4).to(dtype)
    a = torch.randn(6, 2, 72, generator=gen).to(dtype)
    w = (torch.rand(72, generator=gen) + 0.5).to(dtype)
    want_h, want_x = fo.add_rms_norm(h.clone(), a, w, 1e-5, unit_offset)
    got_h, got_x, (q, s) = fo.add_rms_norm_fp8(h.clone(), a, w, 1e-5, unit_offset)
    torch.testing.assert_close(got_h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(got_x, want_x, atol=0, rtol=0)
    want_q, want_s = quantize_rows_fp8_triton(want_x.reshape(-1, 72))
    assert q.dtype == FP8_DTYPE and q.shape == (12, 72) and s.shape == (12, 1)
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
    torch.testing.assert_close(s, quantize_rows_fp8_reference(want_x.reshape(-1, 72))[1], atol=0, rtol=1e-6)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@interpreted
def test_add_rms_norm_reads_strided_rows():
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(6, 2 * 40, generator=gen)
    a = big[:, 40:]                                             # a split view: row stride 80
    h = torch.randn(6, 40, generator=gen)
    w = torch.rand(40, generator=gen)
    ref_h, ref_x = fo.add_rms_norm_reference(h.clone(), a, w, 1e-6, False)
    out_h, out_x = fo.add_rms_norm(h, a, w, 1e-6, False)
    torch.testing.assert_close(out_x, ref_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_h, ref_h)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_act_on_fused_halves(dtype, act):
    gen = torch.Generator().manual_seed(5)
    gu = (3 * torch.randn(7, 1, 2 * 1100, generator=gen)).to(dtype)   # > one 1024 block per row
    gate, up = gu.split(1100, dim=-1)
    out = fo.gated_act(gate, up, act)
    ref = fo.gated_act_reference(gate, up, act)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_logsumexp(dtype):
    gen = torch.Generator().manual_seed(6)
    x = (4 * torch.randn(5, 5000, generator=gen)).to(dtype)
    x[1, :4999] = float("-inf")                                  # one finite entry
    torch.testing.assert_close(fo.row_logsumexp(x), fo.row_logsumexp_reference(x), atol=1e-5, rtol=1e-5)


def _rotary_inputs(N, T, H, KV, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, T, (H + 2 * KV) * D, generator=gen).to(dtype)  # one fused projection output
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    ang = torch.rand(N, T, D // 2, generator=gen) * 6.0
    emb = torch.cat([ang, ang], -1)
    return q, k, v, emb.cos().to(dtype), emb.sin().to(dtype)


def _heads(x, N, T, n):  # [N, T, n*D] -> [N, n, T, D]
    return x.reshape(N, T, n, -1).transpose(1, 2)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_prompt_layout(dtype):
    N, T, H, KV, D, P = 3, 5, 9, 3, 16, 8    # the default model's 9 / 3 heads (not powers of two)
    q, k, v, cos, sin = _rotary_inputs(N, T, H, KV, D, dtype, 7)
    kp = torch.zeros(N + 1, KV, P, D, dtype=dtype)
    vp = torch.zeros_like(kp)
    qo = fo.rotary_store(q, k, v, cos, sin, kp[:N], vp[:N])
    ref_q = fo.apply_rotary_reference(_heads(q, N, T, H), cos, sin)
    ref_k = fo.apply_rotary_reference(_heads(k, N, T, KV), cos, sin)
    torch.testing.assert_close(qo.transpose(1, 2).float(), ref_q.float(), **_tol(dtype))
    torch.testing.assert_close(kp[:N, :, :T].float(), ref_k.float(), **_tol(dtype))
    torch.testing.assert_close(vp[:N, :, :T], _heads(v, N, T, KV), atol=0, rtol=0)
    assert kp[:, :, T:].abs().sum() == 0 and kp[N].abs().sum() == 0   # nothing written elsewhere


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_step_layout_at_device_position(dtype):
    N, H, KV, D, S, t = 6, 4, 2, 32, 5, 3
    q, k, v, cos, sin = _rotary_inputs(N, 1, H, KV, D, dtype, 8)
    ks = torch.zeros(S, N + 2, KV, D, dtype=dtype)
    vs = torch.zeros_like(ks)
    qo = fo.rotary_store(q, k, v, cos, sin, ks[:, :N].permute(1, 2, 0, 3), vs[:, :N].permute(1, 2, 0, 3),
                         t0=torch.tensor([t]))
    ref_k = fo.apply_rotary_reference(_heads(k, N, 1, KV), cos, sin)[:, :, 0]
    torch.testing.assert_close(qo[:, 0].float(), fo.apply_rotary_reference(_heads(q, N, 1, H), cos, sin)[:, :, 0].float(),
                               **_tol(dtype))
    torch.testing.assert_close(ks[t, :N].float(), ref_k.float(), **_tol(dtype))
    torch.testing.assert_close(vs[t, :N], v.reshape(N, KV, D), atol=0, rtol=0)
    others = torch.ones(S, dtype=torch.bool)
    others[t] = False
    assert ks[others].abs().sum() == 0 and ks[t, N:].abs().sum() == 0
