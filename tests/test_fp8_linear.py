"""FP8 / 2:4 FP8 layer formats (kernels/fp8_linear.py) and the engine's per-bucket choice among formats.

The CPU checks the references, the round trips and the plan's choice logic (timings and errors faked where
a GPU would measure them); the CUDA tests check the Triton quantization kernel and the two tensor-core
products against the references. The Triton kernel is not run under TRITON_INTERPRET: the interpreter's
float32 -> e4m3 conversion rounds some values to the wrong binade (124.3 -> 64), so it would test the
interpreter, not the kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_linear import (FP8_DTYPE, FP8_MAX, Fp8Layout, fp8_linear, fp8_linear_reference, fp8_supported,
                                quantize_rows_fp8, quantize_rows_fp8_reference, quantize_weight_fp8, relative_error)

CUDA = torch.cuda.is_available()


def _nm24(w: torch.Tensor) -> torch.Tensor:
    """``w`` with the 2 largest |w| of every 4 consecutive columns kept (the compress stage's mask)."""
    from adbatch.compress.sparsity import nm_mask

    return w * nm_mask(w.abs(), 2)


def test_weight_round_trip_is_within_e4m3_precision_per_channel():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # channels over 4 decades
    w[5] = 0.0
    w8 = quantize_weight_fp8(w)
    assert w8.data.dtype == FP8_DTYPE and w8.scale.dtype == torch.float32 and w8.scale.shape == (48,)
    back = w8.data.float() * w8.scale[:, None]
    assert torch.equal(back[5], torch.zeros(64))  # an all-zero channel stays zero (finite scale)
    # each channel's amax maps to 448 exactly; e4m3 keeps 3 mantissa bits: relative error <= 2^-4 per value
    assert torch.allclose(w8.data.float().abs().amax(1)[w.abs().amax(1) > 0], torch.tensor(FP8_MAX))
    rel = ((back - w).abs() / w.abs().clamp(min=1e-30))[w.abs() > w.abs().amax(1, keepdim=True) / 64]
    assert float(rel.max()) <= 2 ** -4 + 1e-6
    assert w8.nbytes() == 48 * 64 + 48 * 4


def test_row_quantization_reference_scales_each_row_to_its_amax():
    torch.manual_seed(1)
    x = torch.randn(6, 40) * torch.tensor([1e-4, 1e-2, 1.0, 10.0, 300.0, 1.0])[:, None]
    x[5] = 0.0
    q, s = quantize_rows_fp8_reference(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1) and s.dtype == torch.float32
    assert torch.allclose(s[:5, 0], x[:5].abs().amax(1) / FP8_MAX)
    assert torch.equal(q[5].float(), torch.zeros(40)) and bool(torch.isfinite(s).all())
    assert relative_error(q.float() * s, x[:5].new_zeros(0).sum() + x) < 0.04
    q2, s2 = quantize_rows_fp8(x)  # CPU: the reference itself
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


@pytest.mark.parametrize("shape", [(8, 64, 48), (33, 128, 96)])
def test_fp8_linear_on_cpu_equals_its_reference_and_stays_near_the_float_product(shape):
    m, k, n = shape
    torch.manual_seed(2)
    x, w, b = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(n)
    w8 = quantize_weight_fp8(w, bias=b)
    y = fp8_linear(x, w8)
    ref = fp8_linear_reference(x, w8.data, w8.scale, b)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    assert relative_error(y, F.linear(x, w, b)) < 0.06  # the format's own error, Gaussian data


def test_sparse_layout_refuses_a_weight_that_is_not_2_to_4_and_needs_cuda_on_cpu():
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="more than 2 nonzeros"):
        quantize_weight_fp8(w, Fp8Layout.SPARSE_24)
    with pytest.raises(ValueError, match="K % 4"):
        quantize_weight_fp8(torch.zeros(4, 6), Fp8Layout.SPARSE_24)
    assert fp8_supported(torch.device("cpu"), Fp8Layout.DENSE) is None
    assert "CUDA" in fp8_supported(torch.device("cpu"), Fp8Layout.SPARSE_24)


def test_sparse_reference_equals_the_dense_reference_of_the_pruned_weight():
    torch.manual_seed(3)
    x, w = torch.randn(16, 64), _nm24(torch.randn(32, 64))
    w8 = quantize_weight_fp8(w)  # the uncompressed values a 2:4 copy holds
    assert int(((w8.data.float().reshape(32, 16, 4) != 0).sum(-1)).max()) <= 2
    assert relative_error(fp8_linear_reference(x, w8.data, w8.scale), x @ w.t()) < 0.06


# ------------------------------------------------------------------------------------------ the engine's plan
def _compressed_tiny(pattern: str = "2:4"):
    from adbatch.compress import CompressConfig, compress_
    from tests.test_decoding_engine import make_tiny_llama

    model = make_tiny_llama(vocab_size=64, heads=4, kv_heads=2)
    compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", uniform_pattern=pattern,
                                    group_policy="uniform", dense_dtype="float32"))
    return model


def test_plan_takes_the_fastest_accurate_format_and_refuses_an_inaccurate_fp8_copy(monkeypatch):
    """Fake timings (a GPU measures them): FP8 fastest but over the error bound -> not served; the next
    fastest wins; FP8 fastest by less than FP8_MIN_SPEEDUP -> the dense copy; FP8 is a candidate at every bucket (8 rows included)
    but none with LinearFormats.INT4."""
    import kernels.int4_tuner as tuner
    from adbatch.decoding import LinearFormats
    import adbatch.decoding.linear_plan as plan_mod
    from adbatch.decoding.engine import DecodeEngine
    from adbatch.decoding.linear_plan import FP8_MIN_SPEEDUP, LinearChoice

    model = _compressed_tiny("4:4")
    engine = DecodeEngine(model, formats=LinearFormats.FP8)
    unit = engine.linears.units[0]
    assert len(unit.mods) == 3  # q/k/v
    fake_us = {LinearChoice.PACKED: 30.0, LinearChoice.DENSE: 20.0, LinearChoice.FP8: 10.0}
    err_scale = {"v": 1.0}

    def fake_timer(fn, l2):  # the format is read from the routing tuple the candidate runs with
        return fake_us[fake_timer.current] / 1e3

    monkeypatch.setattr(tuner, "time_graphed_ms", fake_timer)
    real_run = plan_mod.run_copy

    def run_copy(route, x, bias, x_fp8=None):
        fake_timer.current = route[0]
        y = real_run(route, x, bias, x_fp8)
        return y * err_scale["v"] if route[0] is LinearChoice.FP8 else y

    monkeypatch.setattr(plan_mod, "run_copy", run_copy)
    real_fwd = [m.forward for m in unit.mods]

    def packed_fwd(i):
        def fwd(x):
            fake_timer.current = LinearChoice.PACKED
            return real_fwd[i](x)
        return fwd

    for i, m in enumerate(unit.mods):
        monkeypatch.setattr(m, "forward", packed_fwd(i))

    def timed(eng, rows):
        key = unit.key + (rows,)
        eng.plan.choice.pop(key, None)
        eng.linears.copies.clear()
        # the fake timer reads the format of the last candidate run: run each once first
        real_timer = fake_timer
        monkeypatch.setattr(tuner, "time_graphed_ms", lambda fn, l2: (fn(), real_timer(fn, l2))[1])
        eng.linears.time_unit(unit, key, rows)
        return key

    key = timed(engine, 16)
    assert engine.plan.choice[key] is LinearChoice.FP8
    assert engine.plan.errors[key][LinearChoice.FP8] < 0.06
    assert set(engine.plan.timings[key]) == {LinearChoice.PACKED, LinearChoice.DENSE, LinearChoice.FP8}
    assert (id(unit.mods[0]), LinearChoice.FP8) in engine.linears.copies  # the winner's copy is kept

    err_scale["v"] = 1.5  # a broken copy: 50 % off
    key = timed(engine, 16)
    assert engine.plan.choice[key] is LinearChoice.DENSE and LinearChoice.FP8 not in engine.plan.timings[key]
    assert engine.plan.errors[key][LinearChoice.FP8] > 0.4

    err_scale["v"] = 1.0
    fake_us[LinearChoice.FP8] = 20.0 / FP8_MIN_SPEEDUP + 0.5  # fastest, but by less than the margin
    key = timed(engine, 16)
    assert engine.plan.choice[key] is LinearChoice.DENSE and LinearChoice.FP8 in engine.plan.timings[key]
    fake_us[LinearChoice.FP8] = 10.0
    small = timed(engine, 8)
    assert engine.plan.choice[small] is LinearChoice.FP8
    assert DecodeEngine(model).formats is LinearFormats.FP8  # the default (TargetSearchConfig's)
    int4 = DecodeEngine(model, formats=LinearFormats.INT4)
    key = timed(int4, 8)
    assert LinearChoice.FP8 not in int4.plan.timings[key]


def _two_steps(engine):
    from tests.test_decoding_engine import _two_steps as steps

    return steps(engine)


def test_fp8_routing_runs_qkv_and_gate_up_as_one_fp8_gemm_and_keeps_the_step_near_the_packed_path():
    """Every compressed unit served as FP8 (forced here; the plan's route on a GPU): q/k/v and gate/up run one
    FP8 GEMM each over one quantization of their input; the step's log-probs stay near the packed path's."""
    from adbatch.decoding.engine import DecodeEngine, LinearChoice

    model = _compressed_tiny("4:4")
    want = _two_steps(DecodeEngine(model))
    routed = DecodeEngine(model)
    routed.force_format(LinearChoice.FP8)
    routed.linears.route_bucket(4)
    n_layers = model.config.num_hidden_layers
    route = routed.linears.route
    assert {c for c, _ in route.values()} == {LinearChoice.FP8} and len(route) == 4 * n_layers
    attn = model.model.layers[0].self_attn
    assert route[id(attn.q_proj)][1].out_features == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    got = _two_steps(routed)
    assert relative_error(got.exp(), want.exp()) < 0.05
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    routed.force_format(None)  # back to the plan: on the CPU nothing is timed, the packed path runs
    torch.testing.assert_close(_two_steps(routed), want, atol=1e-4, rtol=1e-4)


def test_fp8_units_take_their_rows_quantized_by_the_norm_that_wrote_them(monkeypatch):
    """Where q/k/v and gate/up run as one FP8 copy, the norm before them also quantizes its rows and the copy
    takes them (no second quantization of the same rows); o_proj and down (inputs from attention / the
    activation) quantize their own."""
    import adbatch.decoding.linear_plan as plan_mod
    from adbatch.decoding.engine import DecodeEngine
    from adbatch.decoding.linear_plan import LinearChoice

    model = _compressed_tiny("4:4")
    routed = DecodeEngine(model)
    routed.force_format(LinearChoice.FP8)
    routed.linears.route_bucket(4)  # (a GPU plans at each pass's bucket; the CPU serves the route it is given)
    given = []
    real = plan_mod.fp8_linear

    def spy(x, w, fast_accum=True, x_fp8=None):
        given.append((w.out_features, x_fp8 is not None))
        if x_fp8 is not None:  # what the norm handed over is x's own quantization
            q, s = quantize_rows_fp8_reference(x.reshape(-1, x.shape[-1]))
            assert torch.equal(x_fp8[0].float(), q.float()) and torch.equal(x_fp8[1], s)
        return real(x, w, fast_accum, x_fp8)

    monkeypatch.setattr(plan_mod, "fp8_linear", spy)
    _two_steps(routed)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = attn.q_proj.out_features + 2 * attn.k_proj.out_features
    handed = {n for n, pre in given if pre}
    assert handed == {qkv, 2 * mlp.gate_proj.out_features}
    assert all(not pre for n, pre in given if n in (attn.o_proj.out_features, mlp.down_proj.out_features)
               and n not in handed)
    assert sum(pre for _, pre in given) == sum(not pre for _, pre in given)  # 2 of the 4 units per layer


def test_forced_sparse_fp8_is_refused_where_the_device_cannot_build_it():
    from adbatch.decoding.engine import DecodeEngine, LinearChoice

    routed = DecodeEngine(_compressed_tiny("2:4"))
    routed.force_format(LinearChoice.SPARSE_FP8)
    with pytest.raises(RuntimeError, match="sparse_fp8 copy"):
        routed.linears.route_bucket(4)


# ------------------------------------------------------------------------------------------ CUDA
@pytest.mark.skipif(not CUDA, reason="the Triton kernel and the FP8 tensor-core products need a GPU")
@pytest.mark.parametrize("shape", [(1, 64), (37, 4096), (130, 28672), (8, 100)])
def test_triton_row_quantization_equals_the_reference(shape):
    torch.manual_seed(4)
    x = (torch.randn(*shape, device="cuda") * 3).to(torch.bfloat16)
    if shape[0] > 2:
        x[2] = 0
    q, s = quantize_rows_fp8(x)
    qr, sr = quantize_rows_fp8_reference(x)
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    assert float((q.float() - qr.float()).abs().max()) == 0.0


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a GPU")
@pytest.mark.parametrize("shape", [(8, 4096), (130, 576), (3, 100)])
def test_norm_with_fp8_rows_equals_the_reference_quantization_of_its_rows(shape):
    from kernels import fused_ops as fo

    torch.manual_seed(6)
    h = (torch.randn(*shape, device="cuda") * 3).to(torch.bfloat16)
    a = torch.randn(*shape, device="cuda").to(torch.bfloat16)
    w = (torch.rand(shape[1], device="cuda") + 0.5).to(torch.bfloat16)
    want_h, want_x = fo.add_rms_norm(h.clone(), a, w, 1e-5, False)
    got_h, got_x, (q, s) = fo.add_rms_norm_fp8(h.clone(), a, w, 1e-5, False)
    assert torch.equal(got_h, want_h) and torch.equal(got_x, want_x)
    qr, sr = quantize_rows_fp8_reference(want_x)
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    assert float((q.float() - qr.float()).abs().max()) == 0.0


@pytest.mark.skipif(not CUDA or fp8_supported(torch.device("cuda"), Fp8Layout.DENSE) is not None,
                    reason="FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("layout", [Fp8Layout.DENSE, Fp8Layout.SPARSE_24])
def test_fp8_products_on_cuda_equal_the_reference(layout):
    why = fp8_supported(torch.device("cuda"), layout)
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(5)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda") * 0.02
    if layout is Fp8Layout.SPARSE_24:
        w = _nm24(w)
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    dense8 = quantize_weight_fp8(w, Fp8Layout.DENSE, b)
    ref = fp8_linear_reference(x, dense8.data, dense8.scale, b)
    y = fp8_linear(x, quantize_weight_fp8(w, layout, b))
    assert y.dtype == torch.bfloat16 and y.shape == (256, 512)
    assert relative_error(y, ref) < 1e-2  # bf16 output rounding only
    assert relative_error(y, F.linear(x.float(), w, b.float())) < 0.06
