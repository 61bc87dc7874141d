"""Triton SparseGemv vs the torch reference, on CPU tensors under the Triton interpreter."""

from __future__ import annotations

import os

# The interpreter is chosen when @triton.jit runs, i.e. when kernels.sparse_gemv is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.nm_int4 import SparsityPattern, nm_int4_linear_reference, random_packed  # noqa: E402
from kernels import sparse_gemv as sg  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or type(sg._nm_int4_gemv_kernel).__name__ != "InterpretedFunction",
    reason="needs the Triton interpreter (TRITON_INTERPRET=1 before kernels.sparse_gemv is imported)",
)

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # rel. Frobenius error; output rounding dominates


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def _check(p, batch: int, dtype, cfg, seed: int, bias: bool = True, lead: tuple[int, ...] = ()) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, batch, p.in_features, generator=g) + 0.1).to(dtype)  # never zero
    b = torch.randn(p.out_features, generator=g).to(dtype) if bias else None
    ref = nm_int4_linear_reference(x.double(), p, None if b is None else b.double())
    y = sg.nm_int4_linear_triton(x, p, b, config=cfg)
    assert y.shape == (*lead, batch, p.out_features) and y.dtype == dtype
    err = _rel_err(y, ref)
    assert err < TOL[dtype], f"{p.pattern.value} B={batch} {dtype} {cfg}: rel err {err:.2e}"


# N, K chosen so N is not a multiple of BLOCK_N and Kk not a multiple of BLOCK_KK / 128 alignment
SHAPES = [(40, 264), (19, 520)]


@pytest.mark.parametrize("pattern", list(SparsityPattern))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 6])
def test_gemv_path(pattern, dtype, batch):
    p = random_packed(*SHAPES[0], pattern, generator=torch.Generator().manual_seed(11))
    block_b = {1: 1, 3: 4, 6: 8}[batch]
    for cfg in (
        sg.KernelConfig(block_b, 64, 64, 1, False),
        sg.KernelConfig(block_b, 16, 128, 2, False),  # split-K: partial tiles + last-arriving reduction
        sg.KernelConfig(max(1, block_b // 2), 32, 32, 3, False),  # 3 splits; B=3/6: two batch tiles
    ):
        _check(p, batch, dtype, cfg, seed=batch)


@pytest.mark.parametrize("pattern", list(SparsityPattern))
def test_gemv_even_path(pattern):
    """Shapes with N % BLOCK_N == 0 and no padding take the mask-free (EVEN) loads and the clamped
    prefetch of the last step; split-K boundaries included."""
    p = random_packed(64, 512, pattern, generator=torch.Generator().manual_seed(31))
    assert p.kept == p.padded_kept and p.padded_kept % 64 == 0
    for cfg in (sg.KernelConfig(2, 64, 64, 1, False), sg.KernelConfig(4, 32, 32, 2, False), sg.KernelConfig(1, 64, 64, 4, False)):
        _, meta = sg._kernel_args(torch.zeros(2, 512, dtype=torch.float16), p, None, torch.zeros(2, 64), None, None, cfg,
                                  sg._Plan.of(p, cfg))
        assert meta["EVEN"]
        _check(p, 3, torch.float16, cfg, seed=32)


@pytest.mark.parametrize("pattern", list(SparsityPattern))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [8, 17, 64])
def test_dot_path(pattern, dtype, batch):
    """The tensor-core kernel (PTX dequant + prmt densify, emulated): N = 19 and Kp not multiples of the
    blocks, one / two batch tiles, a partial last K step, split-K with bias."""
    p = random_packed(*SHAPES[1], pattern, generator=torch.Generator().manual_seed(12))
    block_b = 64 if batch == 64 else 16
    for cfg in (
        sg.KernelConfig(block_b, 16, 32, 1, True),  # one 32-value sub-block per step
        sg.KernelConfig(block_b, 32, 64 if batch == 17 else 128, 3, True),  # several sub-blocks per step, 3 splits
    ):
        _check(p, batch, dtype, cfg, seed=batch, bias=cfg.split_k > 1)


@pytest.mark.parametrize("pattern", list(SparsityPattern))
@pytest.mark.parametrize("bf16", [False, True])
def test_tc_unit_densify(pattern, bf16):
    """_tc_unit_dense / _tc_unit_pairs + _pairs_to_half (the emulation of the tensor-core kernel's PTX
    blocks) against dequantize_nm_int4 on 64 rows of 2 units each: pruned columns exactly zero, kept
    ones within the fp16 rounding of (16 + zero) * scale and of the value itself."""
    import triton
    import triton.language as tl

    from kernels.nm_int4 import dequantize_nm_int4, kept_columns

    @triton.jit
    def _k(qw_ptr, qp_ptr, sz_ptr, out_ptr, N, NKEEP: tl.constexpr, LOG: tl.constexpr, IS_BF16: tl.constexpr):
        r = tl.arange(0, 64)[:, None]
        u = tl.arange(0, 2)[None, :]
        w0 = tl.load(qw_ptr + (2 * u) * N + r)
        w1 = tl.load(qw_ptr + (2 * u + 1) * N + r)
        pw = tl.load(qp_ptr + u * N + r) if NKEEP < 4 else w0
        v = tl.load(sz_ptr + r)  # one group of 32 values per row
        s = sg._half_to_f32(v, False)
        z = sg._half_to_f32(v >> 16, False)
        zh = sg._f32_to_half(-(z + 16.0) * s, False)
        s2 = (v & 0xFFFF) | (v << 16)
        nzs2 = zh | (zh << 16)
        if NKEEP == 4:
            dense = tl.reshape(sg._join_tree(sg._tc_unit_dense(w0, w1, s2, nzs2, IS_BF16, False), LOG), [64, 32])
        else:
            words = sg._tc_unit_pairs(w0, w1, pw, s2, nzs2, NKEEP, IS_BF16, False)
            dense = sg._pairs_to_half(tl.reshape(sg._join_tree(words, LOG - 1), [64, 64 // NKEEP]), IS_BF16, False)
        tl.store(out_ptr + r * (128 // NKEEP) + tl.arange(0, 128 // NKEEP)[None, :], dense.to(tl.float32))

    n = pattern.n
    p = random_packed(64, 128 // n, pattern, group_sizes=(32,), generator=torch.Generator().manual_seed(41))
    out = torch.empty(64, 128 // n)
    qp = p.qpos if pattern.is_sparse else p.qweight
    _k[(1,)](p.qweight, qp, p.scale_zero_words, out, 64, NKEEP=n, LOG={4: 4, 2: 5, 1: 6}[n], IS_BF16=bf16)
    ref = dequantize_nm_int4(p)
    scale = p.scale_zero[:, 0].float()[:, None]
    kept = torch.zeros_like(ref, dtype=torch.bool).scatter_(1, kept_columns(p), True)
    assert (out[~kept] == 0).all()  # pruned columns: exact zeros
    assert ((out - ref).abs() <= 0.02 * scale + (8e-3 if bf16 else 1e-3) * ref.abs()).all()


@pytest.mark.parametrize("batch", [1, 6, 64])
def test_dispatcher_heuristic(batch, monkeypatch):
    """Default dispatch (no forced config) on CPU: heuristic config, leading dims kept."""
    p = random_packed(24, 128, SparsityPattern.TWO_FOUR, generator=torch.Generator().manual_seed(13))
    cfg = sg.select_config(torch.zeros(batch, 128, dtype=torch.float16), p, None)
    assert cfg == sg.heuristic_config(p, batch, 4)
    assert cfg.use_dot == (batch > sg.GEMV_MAX_BATCH)
    if batch == 6:  # [2, 3, K]: leading dims flatten to 6 rows
        _check(p, 3, torch.float16, None, seed=14, lead=(2,))
    else:
        _check(p, batch, torch.float16, None, seed=14)


def test_batch_larger_than_largest_bucket():
    p = random_packed(16, 64, SparsityPattern.ONE_FOUR, generator=torch.Generator().manual_seed(15))
    _check(p, 70, torch.float16, sg.KernelConfig(64, 16, 128, 1, True), seed=16, bias=False)


def test_buckets_and_candidates_valid():
    assert [sg.batch_bucket(b) for b in (1, 2, 3, 5, 9, 16, 33, 64, 200)] == [1, 2, 4, 8, 16, 16, 64, 64, 64]
    for pattern in SparsityPattern:
        p = random_packed(4096 // 64, 512, pattern)
        for batch in (1, 2, 4, 8, 16, 32, 64):
            cands = sg.candidate_configs(p, batch, 132)
            assert cands and len(cands) == len(set(cands))
            for c in cands:
                c.validate(pattern)
                assert c.block_b >= min(batch, c.block_b)
            assert (batch < 8 or any(c.use_dot for c in cands)) and (batch > 16 or any(not c.use_dot for c in cands))


def test_tune_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("ADBATCH_CACHE", str(tmp_path))
    cache = sg._TuneCache()
    cfg = sg.KernelConfig(16, 64, 64, 4, True, 8, 3)
    cache.put("NVIDIA H200", "2:4|N4096|K4096|float16|B16", cfg, 12.5)
    fresh = sg._TuneCache()
    assert fresh.get("NVIDIA H200", "2:4|N4096|K4096|float16|B16") == cfg
    assert fresh.get("NVIDIA H200", "2:4|N4096|K4096|float16|B32") is None
    assert sg._TuneCache.path("NVIDIA H200").parent == tmp_path / "kernels"


def test_tune_key_buckets(monkeypatch):
    p = random_packed(8, 64, SparsityPattern.DENSE)
    monkeypatch.delenv("ADBATCH_NM_INT4_TUNE_L2", raising=False)
    assert sg.tune_key(p, 3, torch.bfloat16) == "4:4|N8|K64|bfloat16|B4|L2warm"
    assert sg.tune_key(p, 3, torch.bfloat16) == sg.tune_key(p, 4, torch.bfloat16)
    # configs tuned with a cold L2 (flush before every call) are kept apart from warm ones
    monkeypatch.setenv("ADBATCH_NM_INT4_TUNE_L2", "cold")
    assert sg.tune_key(p, 3, torch.bfloat16).endswith("|B4|L2cold")
    monkeypatch.setenv("ADBATCH_NM_INT4_TUNE_L2", "hot")
    with pytest.raises(ValueError, match="cold' or 'warm"):
        sg.tune_key(p, 3, torch.bfloat16)


def test_rejects_unsupported():
    p = random_packed(8, 64, SparsityPattern.TWO_FOUR)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        sg.nm_int4_linear_triton(torch.randn(2, 64), p)
    with pytest.raises(ValueError, match="in_features"):
        sg.nm_int4_linear_triton(torch.randn(2, 60).half(), p)
    with pytest.raises(ValueError, match="bias"):
        sg.nm_int4_linear_triton(torch.randn(2, 64).half(), p, torch.randn(9).half())
    with pytest.raises(ValueError, match="block_b in"):
        sg.nm_int4_linear_triton(torch.randn(2, 64).half(), p, config=sg.KernelConfig(3, 16, 64, 1, False))
    with pytest.raises(ValueError, match="power of two"):
        sg.nm_int4_linear_triton(torch.randn(2, 64).half(), p, config=sg.KernelConfig(16, 24, 64, 1, True))
    dense_odd = random_packed(8, 66, SparsityPattern.DENSE)  # K % 4 != 0: only the tl.dot kernel
    with pytest.raises(ValueError, match="in_features % 4"):
        sg.nm_int4_linear_triton(torch.randn(2, 66).half(), dense_odd, config=sg.KernelConfig(1, 16, 64, 1, False))
    with pytest.raises(ValueError, match="tl.dot"):
        sg.nm_int4_linear_triton(torch.randn(2, 64).half(), p, config=sg.KernelConfig(4, 16, 64, 1, True))


def test_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = random_packed(8, 64, SparsityPattern.DENSE)
    with pytest.raises(ValueError, match="CUDA"):
        sg.nm_int4_linear_triton(torch.randn(2, 64).half(), p)


@pytest.mark.parametrize("pattern", [SparsityPattern.TWO_FOUR, SparsityPattern.ONE_FOUR])
def test_gemv_two_batch_tiles_and_misaligned_rows(pattern):
    """Bucket 8 on the GEMV kernel (two 4-row tiles, the tuner's extra candidate), with x rows that
    are not 8-byte aligned (a column slice): the launcher copies them for the int64 group loads."""
    p = random_packed(24, 136, pattern, generator=torch.Generator().manual_seed(21))
    g = torch.Generator().manual_seed(22)
    wide = (torch.randn(7, 137, generator=g) + 0.1).half()
    x = wide[:, 1:]  # stride 137, data offset 2 bytes
    assert x.stride(0) % 4 and x.data_ptr() % 8
    ref = nm_int4_linear_reference(x.double(), p)
    y = sg.nm_int4_linear_triton(x, p, config=sg.KernelConfig(4, 16, 32, 1, False))
    assert _rel_err(y, ref) < TOL[torch.float16]


def test_selector_and_prmt_emulation():
    """The prmt selectors the GEMV kernel builds from a position word (format v2 byte-spread layout) pick
    x[p0] into the low and x[p1] into the high half of every kept pair (2:4), checked on 512 random
    position words (every one of the 16 (p0, p1) codes in every pair slot), through the same emulation
    the interpreter runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(pw_ptr, lo_ptr, hi_ptr, out_ptr):
        i = tl.arange(0, 512)
        pw = tl.load(pw_ptr + i)
        sel = sg._selectors16(pw, False)
        lo = tl.load(lo_ptr + i * 0)
        hi = tl.load(hi_ptr + i * 0)
        for u in tl.static_range(8):
            tl.store(out_ptr + i * 8 + u, sg._prmt_emul(lo, hi, sel[u]))

    xs = torch.tensor([1.5, -2.25, 3.0, 0.125], dtype=torch.float16)
    words = xs.view(torch.int32)
    pw = torch.randint(-(2**31), 2**31 - 1, (512,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    pw = pw.to(torch.int32)
    out = torch.empty(512 * 8, dtype=torch.int32)
    _k[(1,)](pw, words[:1].clone(), words[1:].clone(), out)
    got = out.view(torch.float16).reshape(512, 8, 2).float()
    u = pw.to(torch.int64) & 0xFFFFFFFF
    for pair in range(8):
        h, t = divmod(pair, 4)
        for e in range(2):
            pos = (u >> (16 * h + 8 * e + 2 * t)) & 3
            assert torch.equal(got[:, pair, e], xs.float()[pos])


def test_launch_hook_detection_keeps_bound_fast_path():
    """An empty hook chain (triton's default) must not disable the bound launcher; a registered hook must."""
    from triton import knobs

    hooks = knobs.runtime.launch_enter_hook
    assert sg._launch_hooks_set() is False

    def hook(*_):
        return None

    if hasattr(hooks, "add"):
        hooks.add(hook)
        try:
            assert sg._launch_hooks_set() is True
        finally:
            hooks.remove(hook)
    else:  # triton versions that keep a plain callable or None
        knobs.runtime.launch_enter_hook = hook
        try:
            assert sg._launch_hooks_set() is True
        finally:
            knobs.runtime.launch_enter_hook = hooks
    assert sg._launch_hooks_set() is False
