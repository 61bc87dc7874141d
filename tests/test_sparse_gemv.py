"""Triton SparseGemv vs the torch reference, on CPU tensors under the Triton interpreter.

``ADBATCH_KERNEL_TEST_DEVICE=cuda`` (with ``TRITON_INTERPRET`` unset) runs the same kernel checks on a GPU,
through the real inline PTX instead of its emulation; the tests of the interpreter itself and of the
CPU-side dispatch are skipped there.
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("ADBATCH_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # The interpreter is chosen when @triton.jit runs, i.e. when the kernel modules are first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.nm_int4 import SparsityPattern, nm_int4_linear_reference, random_packed  # noqa: E402
from kernels import gemv_int4 as gemv  # noqa: E402
from kernels import int4_common as common  # noqa: E402
from kernels import int4_launch as launcher  # noqa: E402
from kernels import int4_tuner as tuner  # noqa: E402
from kernels import tc_int4 as tc  # noqa: E402

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and type(gemv._nm_int4_gemv_kernel).__name__ == "InterpretedFunction"
if DEVICE == "cpu":
    pytestmark = pytest.mark.skipif(not _INTERPRETED, reason="needs the Triton interpreter (TRITON_INTERPRET=1 "
                                    "before kernels.int4_launch is imported)")
else:
    pytestmark = pytest.mark.skipif(_INTERPRETED or not torch.cuda.is_available(),
                                    reason="ADBATCH_KERNEL_TEST_DEVICE=cuda needs a GPU and TRITON_INTERPRET unset")
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="a check of the emulation or of the CPU-side dispatch")

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # rel. Frobenius error; output rounding dominates


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def _check(p, batch: int, dtype, cfg, seed: int, bias: bool = True, lead: tuple[int, ...] = ()) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, batch, p.in_features, generator=g) + 0.1).to(dtype)  # never zero
    b = torch.randn(p.out_features, generator=g).to(dtype) if bias else None
    ref = nm_int4_linear_reference(x.double(), p, None if b is None else b.double())
    y = launcher.nm_int4_linear_triton(x.to(DEVICE), p.to(DEVICE), None if b is None else b.to(DEVICE), config=cfg).cpu()
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
        tuner.KernelConfig(block_b, 64, 64, 1, False),
        tuner.KernelConfig(block_b, 16, 128, 2, False),  # split-K: partial tiles + last-arriving reduction
        tuner.KernelConfig(max(1, block_b // 2), 32, 32, 3, False),  # 3 splits; B=3/6: two batch tiles
    ):
        _check(p, batch, dtype, cfg, seed=batch)


@pytest.mark.parametrize("pattern", [SparsityPattern.TWO_FOUR, SparsityPattern.ONE_FOUR])
def test_stacked_weight_runs_as_its_members(pattern):
    """The engine stacks q/k/v into one packed weight (kernels.nm_int4.concat_packed): one launch over it
    equals the members' launches side by side (the format is row-local)."""
    from kernels.nm_int4 import concat_packed

    g = torch.Generator().manual_seed(5)
    parts = [random_packed(n, 264, pattern, generator=g) for n in (32, 16, 16)]
    x = (torch.randn(3, 264, generator=g) + 0.1).to(torch.float16).to(DEVICE)
    cfg = tuner.KernelConfig(4, 16, 64, 2, False)
    got = launcher.nm_int4_linear_triton(x, concat_packed(parts).to(DEVICE), config=cfg)
    want = torch.cat([launcher.nm_int4_linear_triton(x, q.to(DEVICE), config=cfg) for q in parts], -1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("pattern", list(SparsityPattern))
def test_gemv_even_path(pattern):
    """Shapes with N % BLOCK_N == 0 and no padding take the mask-free (EVEN) loads and the clamped
    prefetch of the last step; split-K boundaries included."""
    p = random_packed(64, 512, pattern, generator=torch.Generator().manual_seed(31))
    assert p.kept == p.padded_kept and p.padded_kept % 64 == 0
    for cfg in (tuner.KernelConfig(2, 64, 64, 1, False), tuner.KernelConfig(4, 32, 32, 2, False),
                tuner.KernelConfig(1, 64, 64, 4, False)):
        _, meta = launcher._kernel_args(torch.zeros(2, 512, dtype=torch.float16), p, None, torch.zeros(2, 64), None, None,
                                        cfg, launcher._Plan.of(p, cfg))
        assert meta["EVEN"]
        _check(p, 3, torch.float16, cfg, seed=32)


@pytest.mark.parametrize("pattern", list(SparsityPattern))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [8, 17, 64])
def test_dot_path(pattern, dtype, batch):
    """The tensor-core kernel (PTX dequant + prmt densify, emulated): N = 19 and Kp not multiples of the
    blocks (a partial row block and unit), one / two batch tiles, a partial last K step, split-K with bias."""
    p = random_packed(*SHAPES[1], pattern, generator=torch.Generator().manual_seed(12))
    block_b = 64 if batch == 64 else 16
    for cfg in (
        tuner.KernelConfig(block_b, 16, 32, 1, True),  # one 32-value sub-block per step
        # several sub-blocks per step, 3 splits
        tuner.KernelConfig(block_b, 32, 64 if batch == 17 else 128, 3, True),
    ):
        _check(p, batch, dtype, cfg, seed=batch, bias=cfg.split_k > 1)


@interpreter_only
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
        s = common._half_to_f32(v, False)
        z = common._half_to_f32(v >> 16, False)
        zh = common._f32_to_half(-(z + 16.0) * s, False)
        s2 = (v & 0xFFFF) | (v << 16)
        nzs2 = zh | (zh << 16)
        if NKEEP == 4:
            dense = tl.reshape(tc._join_tree(tc._tc_unit_dense(w0, w1, s2, nzs2, IS_BF16, False), LOG), [64, 32])
        else:
            words = tc._tc_unit_pairs(w0, w1, pw, s2, nzs2, NKEEP, IS_BF16, False)
            dense = tc._pairs_to_half(tl.reshape(tc._join_tree(words, LOG - 1), [64, 64 // NKEEP]), IS_BF16, False)
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


@interpreter_only
@pytest.mark.parametrize("batch", [1, 6, 64])
def test_dispatcher_heuristic(batch, monkeypatch):
    """Default dispatch (no forced config) on CPU: heuristic config, leading dims kept."""
    p = random_packed(24, 128, SparsityPattern.TWO_FOUR, generator=torch.Generator().manual_seed(13))
    cfg = launcher.TUNER.select(torch.zeros(batch, 128, dtype=torch.float16), p, None)
    assert cfg == tuner.heuristic_config(p, batch, 4)
    assert cfg.use_dot == (batch > tuner.GEMV_MAX_BATCH)
    if batch == 6:  # [2, 3, K]: leading dims flatten to 6 rows
        _check(p, 3, torch.float16, None, seed=14, lead=(2,))
    else:
        _check(p, batch, torch.float16, None, seed=14)


def test_batch_larger_than_largest_bucket():
    p = random_packed(16, 64, SparsityPattern.ONE_FOUR, generator=torch.Generator().manual_seed(15))
    _check(p, 70, torch.float16, tuner.KernelConfig(64, 16, 128, 1, True), seed=16, bias=False)


def test_buckets_and_candidates_valid():
    assert [tuner.batch_bucket(b) for b in (1, 2, 3, 5, 9, 16, 33, 64, 200)] == [1, 2, 4, 8, 16, 16, 64, 64, 64]
    for pattern in SparsityPattern:
        p = random_packed(4096 // 64, 512, pattern)
        for batch in (1, 2, 4, 8, 16, 32, 64):
            cands = tuner.candidate_configs(p, batch, 132)
            assert cands and len(cands) == len(set(cands))
            for c in cands:
                c.validate(pattern)
                assert c.block_b >= min(batch, c.block_b)
            assert (batch < 8 or any(c.use_dot for c in cands)) and (batch > 16 or any(not c.use_dot for c in cands))


def test_tune_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("ADBATCH_CACHE", str(tmp_path))
    cache = tuner.TuneCache()
    cfg = tuner.KernelConfig(16, 64, 64, 4, True, 8, 3)
    cache.put("NVIDIA H200", "2:4|N4096|K4096|float16|B16", cfg, 12.5)
    fresh = tuner.TuneCache()
    assert fresh.get("NVIDIA H200", "2:4|N4096|K4096|float16|B16") == cfg
    assert fresh.get("NVIDIA H200", "2:4|N4096|K4096|float16|B32") is None
    assert tuner.TuneCache.path("NVIDIA H200").parent == tmp_path / "kernels"


def test_tuner_lookup_and_tune_log(tmp_path, monkeypatch):
    """The tuner object owns the cache: lookup reads what the cache holds for the layer's key on a CUDA
    device (never timing), a CPU device has no tuned configs, select on CPU is the heuristic, and the
    tune log is empty until started (it fills only while candidates are timed, on a GPU)."""
    monkeypatch.setenv("ADBATCH_CACHE", str(tmp_path))
    monkeypatch.delenv("ADBATCH_NM_INT4_TUNE_L2", raising=False)
    monkeypatch.setattr(tuner, "cuda_device_name", lambda device: "NVIDIA H200")
    p = random_packed(24, 128, SparsityPattern.TWO_FOUR, generator=torch.Generator().manual_seed(17))
    cfg = tuner.KernelConfig(4, 64, 64, 2, False)
    tuner.TuneCache().put("NVIDIA H200", tuner.tune_key(p, 3, torch.float16), cfg, 7.0)

    def no_launch(*args):
        raise AssertionError("lookup / select on CPU must not launch")

    t = tuner.KernelTuner(run=no_launch)
    cuda = torch.device("cuda", 0)
    assert t.lookup(p, 3, torch.float16, cuda) == cfg  # bucket 4
    assert t.lookup(p, 4, torch.float16, cuda) == cfg
    assert t.lookup(p, 8, torch.float16, cuda) is None
    assert t.lookup(p, 3, torch.bfloat16, cuda) is None
    assert t.lookup(p, 3, torch.float16, torch.device("cpu")) is None
    assert t.select(torch.zeros(3, 128, dtype=torch.float16), p, None) == tuner.heuristic_config(p, 3, 4)
    assert t.tune_log() == []
    t.start_tune_log()
    assert t.tune_log() == []


def test_autotune_rejects_configs_with_wrong_output(monkeypatch):
    """The tuner keeps the fastest config whose output matches the fp32 reference: a faster config that
    computes a wrong answer (or NaN) is rejected with a warning, never picked. Timing is faked so the
    selection logic runs on CPU; the launches return the reference or a corrupted copy of it."""
    p = random_packed(48, 256, SparsityPattern.TWO_FOUR, generator=torch.Generator().manual_seed(21))
    x2 = torch.randn(16, 256, generator=torch.Generator().manual_seed(22)).half()
    ref = nm_int4_linear_reference(x2, p)
    cands = tuner.candidate_configs(p, 16, 4)
    assert any(c.use_dot for c in cands) and any(not c.use_dot for c in cands)
    wrong, nan, good = cands[0], cands[1], cands[2]
    speed = {wrong: 1.0, nan: 2.0, good: 3.0}
    last = []

    def fake_run(x, packed, bias, cfg):
        last.append(cfg)
        if cfg == wrong:
            return ref.flip(1)  # right values, wrong columns: what a layout bug gives
        if cfg == nan:
            return torch.full_like(ref, float("nan"))
        return ref

    monkeypatch.setattr(tuner, "time_graphed_ms", lambda fn, l2: (fn(), speed.get(last[-1], 10.0))[1])
    cfg, micros = tuner.KernelTuner(run=fake_run).autotune(x2, p, None)
    assert cfg == good and micros == pytest.approx(3e3)
    assert tuner.output_error(ref.flip(1), ref.float()) > tuner.TUNE_MAX_REL_ERROR
    assert tuner.output_error(ref, ref.float()) == 0.0


def test_launcher_slots_follow_kernel_signatures():
    """The positions the bound fast path rewrites per call are the kernels' own argument names, the
    runtime arguments come first and every constexpr after them, and _kernel_args puts each value in
    its named slot (the fast path itself runs on CUDA only)."""
    for fn, sig, x_name, stride_name in ((gemv._nm_int4_gemv_kernel, launcher._GEMV_SIG, "x64_ptr", "stride_x64"),
                                         (tc._nm_int4_tc_kernel, launcher._TC_SIG, "x_ptr", "stride_xb")):
        names = tuple(fn.arg_names)
        assert sig.names == names
        assert [names[i] for i in (sig.i_x, sig.i_out, sig.i_b, sig.i_stride, sig.i_part_stride)] == [
            x_name, "out_ptr", "B", stride_name, "part_stride"]
    p = random_packed(40, 264, SparsityPattern.TWO_FOUR, generator=torch.Generator().manual_seed(18))
    x2 = torch.zeros(3, 264, dtype=torch.float16)
    out = torch.empty(3, 40, dtype=torch.float16)
    part, cnt = torch.empty(1), torch.zeros(1, dtype=torch.int32)
    for cfg in (tuner.KernelConfig(4, 64, 64, 2, False), tuner.KernelConfig(16, 32, 64, 2, True)):
        sig = launcher._signature(cfg)
        assert sig is (launcher._TC_SIG if cfg.use_dot else launcher._GEMV_SIG)
        args, meta = launcher._kernel_args(x2, p, None, out, part, cnt, cfg, launcher._Plan.of(p, cfg))
        assert len(args) == sig.runtime and set(meta) == set(sig.names[sig.runtime:])
        assert args[sig.i_x].data_ptr() == x2.data_ptr() and args[sig.i_out] is out
        assert args[sig.i_b] == 3 and args[sig.i_part_stride] == 3 * 40
        assert args[sig.i_stride] == (264 if cfg.use_dot else 264 // 4)
        named = dict(zip(sig.names, args))
        assert named["qw_ptr"] is p.qweight and named["qp_ptr"] is p.qpos and named["bias_ptr"] is out
        assert named["KP"] == p.padded_kept and named["N"] == 40


def test_tune_key_buckets(monkeypatch):
    p = random_packed(8, 64, SparsityPattern.DENSE)
    monkeypatch.delenv("ADBATCH_NM_INT4_TUNE_L2", raising=False)
    assert tuner.tune_key(p, 3, torch.bfloat16) == "4:4|N8|K64|bfloat16|B4|L2warm"
    assert tuner.tune_key(p, 3, torch.bfloat16) == tuner.tune_key(p, 4, torch.bfloat16)
    # configs tuned with a cold L2 (flush before every call) are kept apart from warm ones
    monkeypatch.setenv("ADBATCH_NM_INT4_TUNE_L2", "cold")
    assert tuner.tune_key(p, 3, torch.bfloat16).endswith("|B4|L2cold")
    monkeypatch.setenv("ADBATCH_NM_INT4_TUNE_L2", "hot")
    with pytest.raises(ValueError, match="cold' or 'warm"):
        tuner.tune_key(p, 3, torch.bfloat16)


@interpreter_only
def test_rejects_unsupported():
    p = random_packed(8, 64, SparsityPattern.TWO_FOUR)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        launcher.nm_int4_linear_triton(torch.randn(2, 64), p)
    with pytest.raises(ValueError, match="in_features"):
        launcher.nm_int4_linear_triton(torch.randn(2, 60).half(), p)
    with pytest.raises(ValueError, match="bias"):
        launcher.nm_int4_linear_triton(torch.randn(2, 64).half(), p, torch.randn(9).half())
    with pytest.raises(ValueError, match="block_b in"):
        launcher.nm_int4_linear_triton(torch.randn(2, 64).half(), p, config=tuner.KernelConfig(3, 16, 64, 1, False))
    with pytest.raises(ValueError, match="power of two"):
        launcher.nm_int4_linear_triton(torch.randn(2, 64).half(), p, config=tuner.KernelConfig(16, 24, 64, 1, True))
    dense_odd = random_packed(8, 66, SparsityPattern.DENSE)  # K % 4 != 0: only the tl.dot kernel
    with pytest.raises(ValueError, match="in_features % 4"):
        launcher.nm_int4_linear_triton(torch.randn(2, 66).half(), dense_odd, config=tuner.KernelConfig(1, 16, 64, 1, False))
    with pytest.raises(ValueError, match="tl.dot"):
        launcher.nm_int4_linear_triton(torch.randn(2, 64).half(), p, config=tuner.KernelConfig(4, 16, 64, 1, True))


def test_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = random_packed(8, 64, SparsityPattern.DENSE)
    with pytest.raises(ValueError, match="CUDA"):
        launcher.nm_int4_linear_triton(torch.randn(2, 64).half(), p)


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
    if DEVICE != "cpu":
        x = wide.to(DEVICE)[:, 1:]
    y = launcher.nm_int4_linear_triton(x, p.to(DEVICE), config=tuner.KernelConfig(4, 16, 32, 1, False)).cpu()
    assert _rel_err(y, ref) < TOL[torch.float16]


@interpreter_only
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
        sel = gemv._selectors16(pw, False)
        lo = tl.load(lo_ptr + i * 0)
        hi = tl.load(hi_ptr + i * 0)
        for u in tl.static_range(8):
            tl.store(out_ptr + i * 8 + u, common._prmt_emul(lo, hi, sel[u]))

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
    assert launcher._launch_hooks_set() is False

    def hook(*_):
        return None

    if hasattr(hooks, "add"):
        hooks.add(hook)
        try:
            assert launcher._launch_hooks_set() is True
        finally:
            hooks.remove(hook)
    else:  # triton versions that keep a plain callable or None
        knobs.runtime.launch_enter_hook = hook
        try:
            assert launcher._launch_hooks_set() is True
        finally:
            knobs.runtime.launch_enter_hook = hooks
    assert launcher._launch_hooks_set() is False
