"""Packed N:M INT4 format: exact round trip, dequantization semantics, safetensors, sizes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.nm_int4 import (
    KK_ALIGN,
    PackedNMInt4,
    SparsityPattern,
    concat_packed,
    dequantize_nm_int4,
    kept_per_row,
    nm_int4_linear_reference,
    pack_nm_int4,
    random_packed,
    unpack_nm_int4,
)
from kernels.nm_int4 import _unpack_bits
from kernels.packed_linear import nm_int4_linear

PATTERNS = list(SparsityPattern)
SHAPES = [(8, 64), (13, 200), (32, 1024), (5, 516)]  # N x K; Kk not a multiple of the 128 alignment too


def _raw(n_out: int, k_in: int, pattern: SparsityPattern, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = random_packed(n_out, k_in, pattern, generator=g)
    return p, unpack_nm_int4(p)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_round_trip_exact(pattern, shape):
    n_out, k_in = shape
    g = torch.Generator().manual_seed(1)
    kk = kept_per_row(pattern, k_in)
    q = torch.randint(0, 16, (n_out, kk), generator=g, dtype=torch.uint8)
    pos = None
    if pattern.is_sparse:
        keys = torch.rand(n_out, k_in // 4, 4, generator=g)
        pos = keys.argsort(-1)[..., : pattern.n].sort(-1).values.reshape(n_out, kk).to(torch.uint8)
    gs = torch.tensor([32, 64, 128, 256], dtype=torch.int32)[torch.randint(0, 4, (n_out,), generator=g)]
    gcount = int(((kk + gs - 1) // gs).sum())
    scale = torch.rand(gcount, generator=g).half() + 0.01
    zero = (torch.rand(gcount, generator=g) * 15).half()
    p = pack_nm_int4(q, pos, scale, zero, gs, pattern, k_in)
    q2, pos2, s2, z2, gs2 = unpack_nm_int4(p)
    assert torch.equal(q2, q)
    assert (pos2 is None) == (pos is None)
    if pos is not None:
        assert torch.equal(pos2, pos)
    assert torch.equal(s2, scale) and torch.equal(z2, zero) and torch.equal(gs2, gs)
    # layout: Kk padded to the kernel alignment; padding holds q = 0
    assert p.qweight.shape == (-(-kk // KK_ALIGN) * KK_ALIGN // 8, n_out)
    # format v2: value 2t + h of a word in bits 16h + 4t (pair-interleaved nibbles)
    first_word = p.qweight[0, 0].item() & 0xFFFFFFFF
    for j in range(min(8, kk)):
        t, h = divmod(j, 2)
        assert (first_word >> (16 * h + 4 * t)) & 0xF == q[0, j].item()
    if pos is not None and kk >= 16:
        # value 8h + 2t + e of a position word in bits 16h + 8e + 2t (byte-spread)
        pw = p.qpos[0, 0].item() & 0xFFFFFFFF
        for j in range(16):
            h, rem = divmod(j, 8)
            t, e = divmod(rem, 2)
            assert (pw >> (16 * h + 8 * e + 2 * t)) & 3 == pos[0, j].item()


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_scatters_kept_values(pattern, shape):
    n_out, k_in = shape
    p, (q, pos, scale, zero, gs) = _raw(n_out, k_in, pattern, seed=2)
    w = dequantize_nm_int4(p)
    assert w.shape == (n_out, k_in) and w.dtype == torch.float32
    expect = torch.zeros(n_out, k_in)
    kk = q.shape[1]
    g0 = 0
    for r in range(n_out):  # slow scalar-ish construction on purpose: an independent oracle
        for k in range(kk):
            grp = g0 + k // int(gs[r])
            col = k if pos is None else 4 * (k // pattern.n) + int(pos[r, k])
            expect[r, col] = (float(q[r, k]) - float(zero[grp])) * float(scale[grp])
        g0 += -(-kk // int(gs[r]))
    assert torch.equal(w, expect)
    nonzero_per_group = (w.reshape(n_out, -1, 4) != 0).sum(-1)
    assert int(nonzero_per_group.max()) <= pattern.n


@pytest.mark.parametrize("pattern", PATTERNS)
def test_reference_linear_matches_dense(pattern):
    p, _ = _raw(24, 96, pattern, seed=3)
    x = torch.randn(3, 5, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(24)
    y = nm_int4_linear_reference(x, p, bias)
    w = dequantize_nm_int4(p, torch.float64)
    expect = x @ w.t() + bias.double()
    assert y.shape == (3, 5, 24)
    assert torch.allclose(y, expect, rtol=1e-5, atol=1e-5)
    # CPU tensors dispatch to the reference
    assert torch.equal(nm_int4_linear(x.float(), p, bias), nm_int4_linear_reference(x.float(), p, bias))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_safetensors_round_trip(pattern, tmp_path):
    p, _ = _raw(16, 260, pattern, seed=5)
    path = tmp_path / "w.safetensors"
    save_file(p.state_dict(), str(path), metadata={k: str(v) for k, v in p.metadata().items()})
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    p2 = PackedNMInt4.from_state_dict(load_file(str(path)), meta)
    for k, v in p.state_dict().items():
        assert torch.equal(v, p2.state_dict()[k]), k
    assert p2.pattern == pattern and p2.in_features == 260 and p2.nbytes() == p.nbytes()
    assert torch.equal(dequantize_nm_int4(p2), dequantize_nm_int4(p))


@pytest.mark.parametrize("pattern,max_ratio", [(SparsityPattern.TWO_FOUR, 0.30), (SparsityPattern.ONE_FOUR, 0.30)])
def test_sizes_vs_dense_and_csr(pattern, max_ratio):
    n_out, k_in = 512, 2048
    p = random_packed(n_out, k_in, pattern, group_sizes=(128,), generator=torch.Generator().manual_seed(6))
    nnz = n_out * kept_per_row(pattern, k_in)
    csr = nnz * (4 + 2) + (n_out + 1) * 4  # int32 column + fp16 value, int32 row pointer
    dense_fp16 = n_out * k_in * 2
    assert p.nbytes() <= max_ratio * csr
    bits_per_weight = 8 * p.nbytes() / (n_out * k_in)
    expect_bits = {SparsityPattern.TWO_FOUR: 3.0 + 16 / 128, SparsityPattern.ONE_FOUR: 1.5 + 8 / 128}[pattern]
    assert 0 <= bits_per_weight - expect_bits < 0.04  # group_ptr + group_shift: 64 bits a row
    assert p.nbytes() < dense_fp16 / 4.5


def test_dense_int4_size():
    p = random_packed(256, 1024, SparsityPattern.DENSE, group_sizes=(128,))
    assert 0 <= 8 * p.nbytes() / (256 * 1024) - (4 + 32 / 128) < 0.07


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group=48), "group_size"),
        (dict(q_max=16), "q: expected uint8"),
        (dict(pos_desc=True), "ascending"),
        (dict(k_in=66), "multiple of 4"),
    ],
)
def test_pack_rejects_bad_input(kwargs, match):
    pattern = SparsityPattern.TWO_FOUR
    n_out, k_in = 4, kwargs.get("k_in", 64)
    kk = k_in // 2
    q = torch.zeros(n_out, kk, dtype=torch.uint8)
    if "q_max" in kwargs:
        q[0, 0] = kwargs["q_max"]
    pos = torch.tensor([0, 1], dtype=torch.uint8).repeat(n_out, kk // 2)
    if kwargs.get("pos_desc"):
        pos[0, :2] = torch.tensor([3, 1])
    gs = torch.full((n_out,), kwargs.get("group", 32), dtype=torch.int32)
    g = n_out * -(-kk // 32)
    with pytest.raises(ValueError, match=match):
        pack_nm_int4(q, pos, torch.ones(g).half(), torch.zeros(g).half(), gs, pattern, k_in)


def test_validate_rejects_wrong_shapes():
    p = random_packed(8, 64, SparsityPattern.TWO_FOUR)
    with pytest.raises(ValueError, match="qweight"):
        PackedNMInt4(**{**p.__dict__, "qweight": p.qweight[:, :4]})
    with pytest.raises(ValueError, match="kept"):
        PackedNMInt4(**{**p.__dict__, "kept": 16})


def test_validate_rejects_inconsistent_group_index():
    """The kernels index scale_zero through group_ptr / group_shift without bounds checks: damaged or
    crafted index tensors must be refused when the packed object is built (e.g. at checkpoint load)."""
    p = random_packed(8, 256, SparsityPattern.TWO_FOUR, group_sizes=(32, 64))
    PackedNMInt4(**p.__dict__)  # the consistent original passes
    shift = p.group_shift.clone()
    shift[3] = 9  # group size 512: not a supported size
    with pytest.raises(ValueError, match="group_shift"):
        PackedNMInt4(**{**p.__dict__, "group_shift": shift})
    shift = p.group_shift.clone()
    shift[2] = 5 if int(shift[2]) == 6 else 6  # a valid size that does not match the row's group count
    with pytest.raises(ValueError, match="group_ptr steps"):
        PackedNMInt4(**{**p.__dict__, "group_shift": shift})
    gptr = p.group_ptr.clone()
    gptr[-1] += 1  # points one group past scale_zero
    with pytest.raises(ValueError, match="group_ptr\\[-1\\]"):
        PackedNMInt4(**{**p.__dict__, "group_ptr": gptr})
    gptr = p.group_ptr.clone()
    gptr[0] = 1  # row 0 would start one group late
    with pytest.raises(ValueError, match="group_ptr\\[0\\] == 0"):
        PackedNMInt4(**{**p.__dict__, "group_ptr": gptr})


@pytest.mark.parametrize("pattern", PATTERNS)
def test_concat_packed_stacks_rows_exactly(pattern):
    """q/k/v (or gate/up) stacked along out_features: the stacked weight dequantizes to the members' rows in
    order (groups re-indexed), its product is the members' products side by side, and it validates."""
    g = torch.Generator().manual_seed(7)
    parts = [random_packed(n, 200, pattern, generator=g) for n in (24, 8, 13)]  # Kk not 32-aligned at 1:4
    stacked = concat_packed(parts)
    assert stacked.out_features == 45 and stacked.num_groups == sum(q.num_groups for q in parts)
    stacked.validate()
    assert torch.equal(dequantize_nm_int4(stacked), torch.cat([dequantize_nm_int4(q) for q in parts], 0))
    x = torch.randn(3, 200, dtype=torch.float64, generator=g)
    assert torch.equal(nm_int4_linear_reference(x, stacked),
                       torch.cat([nm_int4_linear_reference(x, q) for q in parts], -1))
    assert concat_packed(parts[:1]) is parts[0]
    other = random_packed(8, 200, SparsityPattern.TWO_FOUR if pattern is not SparsityPattern.TWO_FOUR
                          else SparsityPattern.ONE_FOUR, generator=g)
    with pytest.raises(ValueError, match="one pattern"):
        concat_packed([parts[0], other])
    with pytest.raises(ValueError, match="at least one"):
        concat_packed([])
