"""Compression math: scores, exactly-N-of-4 masks, pattern allocation, group sizes, packing round trip."""

from __future__ import annotations

import math

import pytest
import torch

from adbatch.compress.calibration import LayerStats
from adbatch.compress.linear import LayerInput, analyze_layer, compress_layer
from adbatch.compress.quantization import (
    choose_group_sizes, dequantize_rows, quantize_fixed, quantize_rows, row_bits,
)
from adbatch.compress.recipe import CompressConfig, GroupPolicy, PATTERN_DENSITY, ScoreMethod
from adbatch.compress.sparsity import (
    LayerImportance, allocate_patterns, element_scores, interleaved_patterns, kept_positions, nm_mask, proxy_loss,
)
from kernels.nm_int4 import SparsityPattern, dequantize_nm_int4, unpack_nm_int4


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_score_formula_matches_definition():
    w = torch.tensor([[1.0, -2.0], [0.5, -0.25]])
    x = torch.tensor([3.0, 0.5])
    g = torch.tensor([[0.1, -0.2], [4.0, 1.0]])
    assert torch.equal(element_scores(w, None, None, ScoreMethod.MAGNITUDE), w.abs())
    wanda = element_scores(w, x, None, ScoreMethod.WANDA)
    assert torch.allclose(wanda, torch.tensor([[3.0, 1.0], [1.5, 0.125]]))
    paper = element_scores(w, x, g, ScoreMethod.PAPER)
    # |W|*||X|| + |W|*|dE/dW|
    assert torch.allclose(paper, torch.tensor([[3.0 + 0.1, 1.0 + 0.4], [1.5 + 2.0, 0.125 + 0.25]]))
    half = element_scores(w, x, g, ScoreMethod.PAPER, grad_weight=0.5)
    assert torch.allclose(half, torch.tensor([[3.05, 1.2], [2.5, 0.25]]))


def test_score_requires_statistics():
    w = torch.ones(2, 4)
    with pytest.raises(ValueError, match="act_norm"):
        element_scores(w, None, None, ScoreMethod.WANDA)
    with pytest.raises(ValueError, match="grad_abs"):
        element_scores(w, torch.ones(4), None, ScoreMethod.PAPER)
    with pytest.raises(ValueError, match="expected \\[4\\]"):
        element_scores(w, torch.ones(3), None, ScoreMethod.WANDA)


@pytest.mark.parametrize("rows,k", [(1, 4), (7, 32), (64, 576)])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_nm_mask_keeps_exactly_n_best_per_group(rows, k, n):
    s = torch.rand(rows, k, generator=_gen(rows + k + n))
    mask = nm_mask(s, n)
    assert mask.dtype == torch.bool and mask.shape == (rows, k)
    groups = mask.reshape(rows, k // 4, 4)
    assert torch.all(groups.sum(-1) == n)
    sg = s.reshape(rows, k // 4, 4)
    kept_min = torch.where(groups, sg, torch.inf).amin(-1)
    dropped_max = torch.where(groups, -torch.inf, sg).amax(-1)
    assert torch.all(kept_min >= dropped_max)  # every kept score beats every dropped one


def test_kept_positions_ascending_and_ties_stable():
    s = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 5.0, 5.0, 1.0]])
    pos = kept_positions(s, 2)
    assert pos.tolist() == [[0, 1, 1, 2]]  # ties -> lower column; kept positions ascending
    with pytest.raises(ValueError, match="multiple of m=4"):
        nm_mask(torch.ones(2, 6), 2)


def test_proxy_loss_definition():
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, False, True, False]])
    col = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # 1/2 * G * (2^2*2 + 4^2*4) with G = 3
    assert proxy_loss(w, mask, col, torch.tensor([3.0])) == pytest.approx(0.5 * 3 * (8 + 64))


def _imp(name, params, l24, l14):
    return LayerImportance(name, params, {SparsityPattern.DENSE: 0.0, SparsityPattern.TWO_FOUR: l24,
                                          SparsityPattern.ONE_FOUR: l14})


@pytest.mark.parametrize("target", [0.25, 0.3, 0.375, 0.5, 0.7, 1.0])
def test_allocation_respects_density_budget(target):
    g = _gen(3)
    layers = [_imp(f"l{i}", int(p), float(a), float(a + b)) for i, (p, a, b) in
              enumerate(zip(torch.randint(100, 1000, (20,), generator=g), torch.rand(20, generator=g),
                            torch.rand(20, generator=g) * 5))]
    allowed = (SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR, SparsityPattern.DENSE)
    for fn in (allocate_patterns, interleaved_patterns):
        plan = fn(layers, target, allowed)
        total = sum(x.params for x in layers)
        dens = sum(x.params * PATTERN_DENSITY[plan[x.name]] for x in layers) / total
        assert dens <= target + 1e-9
        assert dens >= target - 0.5 * max(x.params for x in layers) / total - 1e-9  # budget nearly used


def test_allocation_prunes_least_important_first():
    layers = [_imp("cheap", 100, 1.0, 2.0), _imp("costly", 100, 1.0, 100.0)]
    plan = allocate_patterns(layers, 0.375, (SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR))
    assert plan == {"cheap": SparsityPattern.ONE_FOUR, "costly": SparsityPattern.TWO_FOUR}


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_quantize_fixed_error_bound_and_format(g):
    v = torch.randn(16, 300, generator=_gen(g))
    q, scale, zero, deq, err = quantize_fixed(v, g)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.dtype == torch.float16 and scale.shape == (16, math.ceil(300 / g))
    assert torch.all((zero >= 0) & (zero <= 15))
    # reconstruction from the stored (q, scale, zero) equals the returned dequant exactly
    gs = torch.full((16,), g, dtype=torch.int32)
    assert torch.equal(dequantize_rows(q, scale.reshape(-1), zero.reshape(-1), gs), deq)
    step = scale.float().repeat_interleave(g, dim=1)[:, :300]
    assert torch.all((deq - v).abs() <= 0.5 * step * 1.01 + 1e-6)
    assert torch.allclose(err, (deq - v).pow(2).sum(1).double())


@pytest.mark.parametrize("g", [32, 128])
def test_clip_search_never_worse_and_keeps_the_format(g):
    gen = _gen(100 + g)
    v = torch.randn(32, 300, generator=gen)  # Gaussian groups: the extremes set min/max, most values sit far inside
    sens = torch.rand(32, 300, generator=gen) + 0.1
    q0, s0, z0, d0, e0 = quantize_fixed(v, g, sens)
    q1, s1, z1, d1, e1 = quantize_fixed(v, g, sens, clip_search=True)
    assert torch.all(e1 <= e0 + 1e-9)  # ratio 1.0 (min/max) is a candidate of every group
    assert float(e1.sum()) < 0.97 * float(e0.sum())  # measured: 0.93 (g32) / 0.89 (g128) unweighted
    assert torch.all(s1 <= s0) and bool((s1 < s0).any())  # ranges only ever shrink
    assert q1.dtype == torch.uint8 and int(q1.max()) <= 15 and torch.all((z1 >= 0) & (z1 <= 15))
    gs = torch.full((32,), g, dtype=torch.int32)
    assert torch.equal(dequantize_rows(q1, s1.reshape(-1), z1.reshape(-1), gs), d1)
    assert torch.allclose(e1, ((d1 - v).pow(2) * sens).sum(1).double())
    # without outliers the search still picks per group and stays exact in the same format
    qr = quantize_rows(v, sens, GroupPolicy.ADAPTIVE, (32, 64, 128, 256), 128, clip_search=True)
    assert float(qr.error.sum()) <= float(quantize_rows(v, sens, GroupPolicy.ADAPTIVE, (32, 64, 128, 256), 128).error.sum())
    assert torch.equal(dequantize_rows(qr.q, qr.scale, qr.zero, qr.group_size), qr.dequant)


def test_group_size_choice_respects_budget_and_prefers_sensitive_rows():
    g = _gen(5)
    v = torch.randn(64, 512, generator=g)
    sens = torch.ones(64, 512)
    sens[:8] = 100.0  # eight very sensitive rows
    sizes = (32, 64, 128, 256)
    qr = quantize_rows(v, sens, GroupPolicy.ADAPTIVE, sizes, 128)
    budget = int(row_bits(512, torch.full((64,), 128)).sum())
    assert qr.bits <= budget
    assert qr.bits >= budget - 32 * 16 * 2  # not leaving a large part of the budget unused
    assert qr.group_size[:8].float().mean() < qr.group_size[8:].float().mean()
    uni = quantize_rows(v, sens, GroupPolicy.UNIFORM, sizes, 128)
    assert uni.bits == budget and torch.all(uni.group_size == 128)
    assert float(qr.error.sum()) < float(uni.error.sum())


@pytest.mark.parametrize("clip", [False, True])
def test_adaptive_rows_taken_from_the_pricing_passes_equal_a_fresh_pass_per_size(clip):
    # the adaptive path reuses the per-size passes it priced the choice with; a fresh quantize_fixed
    # of each chosen size's rows must give the same bits, values and errors
    from adbatch.compress.quantization import _quantize_with_sizes

    g = _gen(11)
    v = torch.randn(48, 300, generator=g)  # 300: a partial last group at every size
    sens = torch.rand(48, 300, generator=g) + 0.1
    qr = quantize_rows(v, sens, GroupPolicy.ADAPTIVE, (32, 64, 128, 256), 128, clip_search=clip)
    assert len(set(qr.group_size.tolist())) > 1  # more than one size chosen: the gather is exercised
    fresh = _quantize_with_sizes(v, sens, qr.group_size, clip)
    for name in ("q", "scale", "zero", "group_size", "dequant", "error"):
        assert torch.equal(getattr(qr, name), getattr(fresh, name)), name


def test_choose_group_sizes_exact_small_case():
    # two rows; row 0 gains a lot from g32, row 1 nothing; budget allows one row at g32
    sizes = (32, 256)
    err = torch.tensor([[1.0, 5.0], [100.0, 5.0]], dtype=torch.float64)  # size-major: [S=2, N=2]
    kept = 256
    budget = float(row_bits(kept, torch.tensor([32])) + row_bits(kept, torch.tensor([256])))
    chosen = choose_group_sizes(err, sizes, kept, budget)
    assert chosen.tolist() == [32, 256]


@pytest.mark.parametrize("pattern", list(SparsityPattern))
@pytest.mark.parametrize("policy", list(GroupPolicy))
@pytest.mark.parametrize("shape", [(8, 64), (48, 576)])
def test_compress_layer_pack_round_trip(pattern, policy, shape):
    n, k = shape
    g = _gen(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    stats = LayerStats(act_sq=torch.rand(k, generator=g) * 10 + 0.1, num_tokens=10,
                       grad_sq=torch.rand(n, k, generator=g), out_grad_sq=torch.rand(n, generator=g) + 0.1)
    cfg = CompressConfig(group_policy=policy)
    item = LayerInput("layer", w, None, stats)
    res = compress_layer(item, (pattern, cfg))
    p = res.packed
    q, pos, scale, zero, gsz = unpack_nm_int4(p)
    dense = dequantize_nm_int4(p)
    if pattern.is_sparse:
        scores = element_scores(w, stats.act_norm, stats.grad_abs, ScoreMethod.PAPER)
        mask = nm_mask(scores, pattern.n)
        assert torch.equal(dense != 0, mask & (dense != 0))  # zeros exactly where pruned
        kk = torch.arange(q.shape[1])
        cols = (kk // pattern.n) * 4 + pos.long()
        assert torch.equal(torch.zeros(n, k, dtype=torch.bool).scatter_(1, cols, True), mask)
        values = w.gather(1, cols)
    else:
        cols = torch.arange(k).expand(n, -1)
        values = w
    # bit-exact: unpacked kept values reproduce our quantizer's output
    sens = stats.col_moment[cols] * stats.row_moment.unsqueeze(1)
    qr = quantize_rows(values, sens, policy, cfg.group_sizes, cfg.reference_group_size, cfg.clip_search)
    assert torch.equal(q, qr.q) and torch.equal(scale, qr.scale) and torch.equal(zero, qr.zero)
    assert torch.equal(gsz, qr.group_size)
    assert torch.equal(dense.gather(1, cols), qr.dequant)
    assert res.recipe.pattern is pattern and sum(res.recipe.group_size_counts.values()) == n
    # quantization is close to the kept weights (the clip search may clip a group's extremes by up to half)
    assert float((qr.dequant - values).abs().max()) < 0.5 * float(values.abs().max()) + 1e-6
    assert float((qr.dequant - values).pow(2).mean()) < 0.01 * float(values.pow(2).mean())


def test_analyze_layer_importance_is_loss_per_removed_weight():
    g = _gen(9)
    w = torch.randn(16, 64, generator=g)
    stats = LayerStats(act_sq=torch.rand(64, generator=g) + 1, num_tokens=4,
                       grad_sq=torch.rand(16, 64, generator=g), out_grad_sq=torch.rand(16, generator=g))
    a = analyze_layer(LayerInput("x", w, None, stats), CompressConfig())
    l24, l14 = a.importance.proxy_loss[SparsityPattern.TWO_FOUR], a.importance.proxy_loss[SparsityPattern.ONE_FOUR]
    assert 0 < l24 < l14
    assert a.importance.importance == pytest.approx((l14 - l24) / (16 * 64 * 0.25))


@pytest.mark.parametrize("shape", [(1536, 512), (40000, 64)])
def test_layer_work_does_not_depend_on_thread_count(shape):
    """Ray workers run torch with 1 thread, the driver with many; the docs promise Ray == sequential
    bit for bit, recipe.json included (score summary, proxy losses = importance, quant error)."""
    n, k = shape
    g = _gen(11)
    st = LayerStats(act_sq=torch.rand(k, generator=g) * 10, num_tokens=100,
                    grad_sq=torch.rand(n, k, generator=g) * 1e-3, out_grad_sq=torch.rand(n, generator=g))
    item = LayerInput("l", torch.randn(n, k, generator=g), None, st)
    cfg = CompressConfig()
    threads = torch.get_num_threads()
    outs = []
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            a = analyze_layer(item, cfg)
            r = compress_layer(item, (SparsityPattern.TWO_FOUR, cfg))
            outs.append((a.score_summary, dict(a.importance.proxy_loss), r.recipe.quant_error))
    finally:
        torch.set_num_threads(threads)
    assert outs[0] == outs[1]


def test_adaptive_group_sizes_must_fit_the_reference_budget():
    """All candidate sizes below reference_group_size: every row would exceed g128's bits (the budget
    the docs promise); refuse the config instead of silently spending more."""
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match="group_sizes"):
        CompressConfig(group_sizes=(32,), reference_group_size=128)
    CompressConfig(group_sizes=(32,), reference_group_size=32)  # consistent
    CompressConfig(group_sizes=(32,), reference_group_size=128, group_policy="uniform")  # sizes unused


def test_calibration_seq_len_needs_a_next_token():
    """seq_len=1 has no next-token loss: gradients, output moments and importance all come out 0."""
    from adbatch.compress.recipe import CalibrationConfig
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match="seq_len"):
        CalibrationConfig(seq_len=1)
    CalibrationConfig(seq_len=2)


def test_non_finite_weights_name_the_layer():
    w = torch.randn(8, 16)
    w[3, 5] = float("nan")
    with pytest.raises(ValueError, match="layer blocks.0.up: weight has 1 NaN/Inf"):
        compress_layer(LayerInput("blocks.0.up", w, None, None), (SparsityPattern.TWO_FOUR, CompressConfig()))

