"""Packed N:M-sparse INT4 weights ("2bit-CSR" + adaptive group quantization) and their torch reference.

A linear layer ``y = x @ W.T`` has ``W`` of shape ``[N, K]`` (N = out_features, K = in_features; this
module and the kernels always use the *N x K = out x in* convention). In every group of m = 4
consecutive input columns of a row, ``n`` values are kept (:class:`SparsityPattern`). A row keeps
``Kk = n * K / 4`` values (``Kk = K`` for DENSE) in ascending column order; kept index ``kk`` lives in
column group ``kk // n`` and ``pos[kk]`` in [0, 3] is its position inside that group of 4, so its
column is ``4 * (kk // n) + pos[kk]``. Each kept value is asymmetric INT4, ``w = (q - zero) * scale``,
with one fp16 ``(scale, zero)`` pair per *quantization group* of kept values. Row ``r`` has its own
group size ``group_size[r]`` in {32, 64, 128, 256} (adaptive groups: sensitive rows get smaller
groups); its ``ceil(Kk / group_size[r])`` groups are stored consecutively, rows in order.

Byte layout of :class:`PackedNMInt4` (format version 2; what the Triton kernels read directly):

- ``qweight`` int32 ``[Kp / 8, N]``: word ``(i, r)`` holds kept values ``8i .. 8i+7`` of row ``r``,
  *pair-interleaved*: value ``8i + 2t + h`` (t = 0..3, h = 0/1) sits in bits ``16h + 4t .. 16h + 4t + 3``.
  So one ``lop3`` on ``word >> 4t`` (masks ``0x000F000F``) yields the two values ``(2t, 2t+1)`` of a kept
  pair in the two 16-bit halves, i.e. directly an fp16x2 / bf16x2 operand for packed math. The *row
  index is the fast axis*, so a warp reading one word-row for consecutive output rows reads consecutive
  int32 words (coalesced, 16-byte vector loads for 4 neighbouring rows).
- ``qpos`` int32 ``[Kp / 16, N]`` (``[0, N]`` for DENSE): word ``(i, r)`` holds the 2-bit positions of kept
  values ``16i .. 16i+15`` of row ``r``, *byte-spread*: value ``16i + 8h + 2t + e`` (h, e = 0/1, t = 0..3)
  sits in bits ``16h + 8e + 2t .. +1``. ``(word >> 2t) & 0x03030303`` then holds the positions of pair t
  of both value words in its 4 bytes, and one multiply-add (``* 0x22 + 0x10101010``) turns them into the
  ``prmt`` byte selectors that pick the activations (see ``kernels/gemv_int4.py``). Same coalescing as
  ``qweight``.
- ``scale_zero`` fp16 ``[G, 2]``: ``(scale, zero)`` of every group, rows in order, groups of a row
  consecutive; interleaved so the kernel fetches both with one 4-byte load.
- ``group_ptr`` int32 ``[N + 1]``: row ``r``'s groups are ``scale_zero[group_ptr[r]:group_ptr[r+1]]``
  (CSR over groups; ``G = group_ptr[-1]``).
- ``group_shift`` int32 ``[N]``: ``group_size[r] == 1 << group_shift[r]`` (a shift, not a division,
  inside the kernel).

``Kp`` is ``Kk`` rounded up to :data:`KK_ALIGN` (32) kept values: the kernels mask whole 16-value
blocks past ``Kp``, and the alignment keeps every 32-value sub-block inside one quantization group.
Padding slots hold ``q = 0``, ``pos = 0`` and map to columns ``>= K``; the kernels mask activations
there to 0, so padding contributes exact zeros. Padding is never returned by :func:`unpack_nm_int4` or
:func:`dequantize_nm_int4`. The kernels read a sub-block of 32 kept values with one ``(scale, zero)``,
which is why group sizes are at least 32 and powers of 2.

Version history: 1 had plain nibble order (value ``8i + j`` in bits ``4j``), plain position order
(value ``16i + j`` in bits ``2j``) and ``KK_ALIGN = 128`` (+24 % bits on 576-wide layers); version 2
is the layout above. Checkpoints carry the version; loaders reject other versions.

Sizes per weight of the dense matrix (group size g): DENSE 4 + 32/g bits; 2:4 (4 + 2)/2 + 16/g bits
(about 3.1 at g = 128); 1:4 (4 + 2)/4 + 8/g bits. Plain CSR with int32 columns and fp16 values costs
48 bits per kept value.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import torch

FORMAT_NAME = "adbatch.nm_int4"
FORMAT_VERSION = 2
GROUP_SIZES = (32, 64, 128, 256)
KK_ALIGN = 32  # kept values: one scale sub-block; a multiple of 8 (nibbles) and 16 (positions)
M = 4


class SparsityPattern(str, enum.Enum):
    """n kept values in every group of m = 4 consecutive input columns of a row."""

    DENSE = "4:4"
    TWO_FOUR = "2:4"
    ONE_FOUR = "1:4"

    @property
    def n(self) -> int:
        return int(self.value.split(":")[0])

    @property
    def is_sparse(self) -> bool:
        return self is not SparsityPattern.DENSE


def kept_per_row(pattern: SparsityPattern, in_features: int) -> int:
    """Number of kept values per row ``Kk`` for ``in_features`` input columns."""
    pattern = SparsityPattern(pattern)
    if pattern.is_sparse and in_features % M != 0:
        raise ValueError(f"in_features={in_features} must be a multiple of {M} for pattern {pattern.value}")
    return in_features * pattern.n // M


def padded_kept(kk: int) -> int:
    return -(-kk // KK_ALIGN) * KK_ALIGN


@dataclasses.dataclass
class PackedNMInt4:
    """Packed N:M INT4 weight of a linear layer; see the module docstring for the byte layout.

    Fields: ``qweight`` int32 [Kp/8, N], ``qpos`` int32 [Kp/16, N] ([0, N] for DENSE), ``scale_zero``
    fp16 [G, 2], ``group_ptr`` int32 [N+1], ``group_shift`` int32 [N]; ``pattern``, ``in_features``
    (K), ``out_features`` (N), ``kept`` (Kk, kept values per row before padding).
    """

    qweight: torch.Tensor
    qpos: torch.Tensor
    scale_zero: torch.Tensor
    group_ptr: torch.Tensor
    group_shift: torch.Tensor
    pattern: SparsityPattern
    in_features: int
    out_features: int
    kept: int

    def __post_init__(self) -> None:
        self.pattern = SparsityPattern(self.pattern)
        self.validate()

    # ---- contracts -------------------------------------------------------------------------
    def validate(self) -> None:
        """Check shapes/dtypes against the layout; raises ValueError naming the field."""
        n_out, k_in = int(self.out_features), int(self.in_features)
        if n_out <= 0 or k_in <= 0:
            raise ValueError(f"out_features={n_out} and in_features={k_in} must be positive")
        kk = kept_per_row(self.pattern, k_in)
        if self.kept != kk:
            raise ValueError(f"kept={self.kept} but pattern {self.pattern.value} with K={k_in} keeps {kk}")
        kp = padded_kept(kk)
        expect = {
            "qweight": ((kp // 8, n_out), torch.int32),
            "qpos": ((kp // 16 if self.pattern.is_sparse else 0, n_out), torch.int32),
            "group_ptr": ((n_out + 1,), torch.int32),
            "group_shift": ((n_out,), torch.int32),
        }
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        sz = self.scale_zero
        if sz.dtype != torch.float16 or sz.dim() != 2 or sz.shape[1] != 2:
            raise ValueError(f"scale_zero: expected float16 [G, 2], got {sz.dtype} {tuple(sz.shape)}")
        devices = {t.device for t in self.tensors().values()}
        if len(devices) != 1:
            raise ValueError(f"all packed tensors must be on one device, got {devices}")
        # the kernels index scale_zero with group_ptr[r] + (kk >> group_shift[r]) unchecked: a damaged or
        # crafted file must fail here, not read out of bounds on the GPU (one host sync per object).
        # Skipped while torch.compile traces (a layer's packed view built inside the traced forward): the
        # tensors there have no values yet, and they are a module's buffers, checked when it was built.
        if torch.compiler.is_compiling():
            return
        shift = self.group_shift.to(torch.int64)
        gptr = self.group_ptr.to(torch.int64)
        shift_ok = (shift >= 5) & (shift <= 8)  # group sizes 32..256
        per_row = -(-kk // (torch.ones_like(shift) << shift.clamp(5, 8)))
        ok = torch.stack([shift_ok.all(), gptr[0] == 0, gptr[-1] == sz.shape[0], (gptr.diff() == per_row).all()])
        bad = [name for name, good in zip(("group_shift values in 5..8 (group sizes 32..256)", "group_ptr[0] == 0",
                                           f"group_ptr[-1] == G = {sz.shape[0]}",
                                           "group_ptr steps == ceil(kept / group size) per row"), ok.tolist()) if not good]
        if bad:
            raise ValueError(f"packed weight's group index is inconsistent: expected {'; '.join(bad)}")

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def padded_kept(self) -> int:
        return padded_kept(self.kept)

    @functools.cached_property
    def scale_zero_words(self) -> torch.Tensor:
        """``scale_zero`` viewed as int32 [G] (low half scale, high half zero): what the kernels read."""
        return self.scale_zero.view(torch.int32).reshape(-1)

    @property
    def num_groups(self) -> int:
        return int(self.scale_zero.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "qweight": self.qweight,
            "qpos": self.qpos,
            "scale_zero": self.scale_zero,
            "group_ptr": self.group_ptr,
            "group_shift": self.group_shift,
        }

    def nbytes(self) -> int:
        """Bytes of all packed tensors (what a kernel must read, padding included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> "PackedNMInt4":
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    # ---- safetensors -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Contiguous tensors keyed by field name (prefix them yourself when saving a model)."""
        return {k: v.contiguous() for k, v in self.tensors().items()}

    def metadata(self) -> dict[str, str | int]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "pattern": self.pattern.value,
            "in_features": int(self.in_features),
            "out_features": int(self.out_features),
            "kept": int(self.kept),
        }

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str | int]) -> "PackedNMInt4":
        """Inverse of :meth:`state_dict` + :meth:`metadata` (metadata values may be strings, as
        safetensors stores them)."""
        if str(metadata.get("format")) != FORMAT_NAME:
            raise ValueError(f"metadata format={metadata.get('format')!r}, expected {FORMAT_NAME!r}")
        if int(metadata.get("format_version", -1)) != FORMAT_VERSION:
            raise ValueError(f"metadata format_version={metadata.get('format_version')!r}, expected {FORMAT_VERSION}")
        missing = [k for k in ("qweight", "qpos", "scale_zero", "group_ptr", "group_shift") if k not in tensors]
        if missing:
            raise ValueError(f"packed tensors missing: {missing}")
        return cls(
            qweight=tensors["qweight"],
            qpos=tensors["qpos"],
            scale_zero=tensors["scale_zero"],
            group_ptr=tensors["group_ptr"],
            group_shift=tensors["group_shift"],
            pattern=SparsityPattern(str(metadata["pattern"])),
            in_features=int(metadata["in_features"]),
            out_features=int(metadata["out_features"]),
            kept=int(metadata["kept"]),
        )


# ---- bit packing primitives -------------------------------------------------------------------
# Field slot -> value index inside one packed int32 word (see the module docstring):
# 4-bit: slot s (bits 4s) holds value 2 * (s % 4) + s // 4; 2-bit: slot f (bits 2f) holds value
# 8 * (f // 8) + 2 * (f % 4) + (f // 4) % 2.
_SLOT_TO_VALUE = {
    4: tuple(2 * (s % 4) + s // 4 for s in range(8)),
    2: tuple(8 * (f // 8) + 2 * (f % 4) + (f // 4) % 2 for f in range(16)),
}


def _pack_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, Kp] with values < 2**bits -> int32 [Kp * bits / 32, N]; inside word i, slot s (bits
    ``bits * s``) holds column ``per_word * i + _SLOT_TO_VALUE[bits][s]``."""
    per_word = 32 // bits
    n_rows, kp = v.shape
    v = v.to(torch.int64).reshape(n_rows, kp // per_word, per_word)
    v = v[..., list(_SLOT_TO_VALUE[bits])]  # slot order
    shifts = torch.arange(per_word, device=v.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=-1)  # fields are disjoint, so sum == bitwise or; < 2**32
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32).t().contiguous()


def _unpack_bits(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`: int32 [W, N] -> uint8 [N, W * 32 / bits]."""
    per_word = 32 // bits
    w = words.t().to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=w.device, dtype=torch.int64) * bits
    slots = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    v = torch.empty_like(slots)
    v[..., list(_SLOT_TO_VALUE[bits])] = slots
    return v.reshape(w.shape[0], -1).to(torch.uint8)


def _groups_per_row(kept: int, group_size: torch.Tensor) -> torch.Tensor:
    return (kept + group_size.to(torch.int64) - 1) // group_size.to(torch.int64)


def pack_nm_int4(
    q: torch.Tensor,
    pos: torch.Tensor | None,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: torch.Tensor,
    pattern: SparsityPattern | str,
    in_features: int,
) -> PackedNMInt4:
    """Pack quantized kept values into :class:`PackedNMInt4`.

    Args:
        q: uint8 [N, Kk], values in [0, 15]; kept values of each row in ascending column order.
        pos: uint8 [N, Kk] in [0, 3] (position of each kept value inside its group of 4), or None for
            DENSE (ignored there).
        scale, zero: fp16 [G]; G = sum over rows of ceil(Kk / group_size[r]), rows in order.
        group_size: int32 [N], each in {32, 64, 128, 256}.
        pattern: :class:`SparsityPattern`.
        in_features: K; Kk must equal n * K / 4.
    Returns: PackedNMInt4 on q's device.
    """
    pattern = SparsityPattern(pattern)
    if q.dim() != 2:
        raise ValueError(f"q: expected [N, Kk], got shape {tuple(q.shape)}")
    n_out, kk = q.shape
    expect_kk = kept_per_row(pattern, in_features)
    if kk != expect_kk:
        raise ValueError(f"q: {kk} kept values per row, but pattern {pattern.value} with in_features={in_features} keeps {expect_kk}")
    if q.dtype != torch.uint8 or (q.numel() and int(q.max()) > 15):
        raise ValueError("q: expected uint8 values in [0, 15]")
    device = q.device
    group_size = group_size.to(device=device, dtype=torch.int64).reshape(-1)
    if group_size.numel() != n_out:
        raise ValueError(f"group_size: expected [{n_out}], got {tuple(group_size.shape)}")
    bad = ~torch.isin(group_size, torch.tensor(GROUP_SIZES, device=device))
    if bool(bad.any()):
        raise ValueError(f"group_size: values must be in {GROUP_SIZES}, got {sorted(set(group_size[bad].tolist()))}")
    gcount = _groups_per_row(kk, group_size)
    g_total = int(gcount.sum())
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype != torch.float16 or t.numel() != g_total:
            raise ValueError(f"{name}: expected float16 [{g_total}], got {t.dtype} {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: contains non-finite values")
    kp = padded_kept(kk)
    qpad = torch.zeros(n_out, kp, dtype=torch.uint8, device=device)
    qpad[:, :kk] = q
    if pattern.is_sparse:
        if pos is None or tuple(pos.shape) != (n_out, kk) or pos.dtype != torch.uint8:
            raise ValueError(f"pos: expected uint8 [{n_out}, {kk}] for pattern {pattern.value}")
        if pos.numel() and int(pos.max()) > 3:
            raise ValueError("pos: values must be in [0, 3]")
        if pattern.n > 1 and kk:
            # kept values must be in strictly ascending column order inside each group of 4
            pg = pos.reshape(n_out, -1, pattern.n).to(torch.int16)
            if bool((pg[..., 1:] <= pg[..., :-1]).any()):
                raise ValueError("pos: positions inside a group of 4 must be strictly ascending (kept values in column order)")
        ppad = torch.zeros(n_out, kp, dtype=torch.uint8, device=device)
        ppad[:, :kk] = pos
        qpos = _pack_bits(ppad, 2)
    else:
        qpos = torch.zeros(0, n_out, dtype=torch.int32, device=device)
    group_ptr = torch.zeros(n_out + 1, dtype=torch.int64, device=device)
    group_ptr[1:] = torch.cumsum(gcount, 0)
    shift = torch.log2(group_size.to(torch.float64)).round().to(torch.int32)
    return PackedNMInt4(
        qweight=_pack_bits(qpad, 4),
        qpos=qpos,
        scale_zero=torch.stack([scale.reshape(-1), zero.reshape(-1)], dim=1).contiguous(),
        group_ptr=group_ptr.to(torch.int32),
        group_shift=shift,
        pattern=pattern,
        in_features=int(in_features),
        out_features=int(n_out),
        kept=int(kk),
    )


def concat_packed(parts: "list[PackedNMInt4] | tuple[PackedNMInt4, ...]") -> PackedNMInt4:
    """The packed weights ``parts`` stacked along out_features (``[sum N_i, K]``, rows of ``parts[0]``
    first): what one launch needs to compute a group of projections reading the same input (q/k/v,
    gate/up). Exact: the layout is row-local (each output row's words, positions and groups only), so
    stacking concatenates ``qweight`` / ``qpos`` along their row axis, ``scale_zero`` and
    ``group_shift`` in row order, and shifts each part's ``group_ptr`` by the groups before it. Needs
    one pattern and one in_features; builds new tensors (the parts stay valid)."""
    parts = list(parts)
    if not parts:
        raise ValueError("concat_packed needs at least one packed weight")
    first = parts[0]
    for q in parts[1:]:
        if q.pattern is not first.pattern or q.in_features != first.in_features or q.device != first.device:
            raise ValueError(f"concat_packed needs one pattern, in_features and device: {first.pattern.value} "
                             f"K={first.in_features} on {first.device} vs {q.pattern.value} K={q.in_features} on {q.device}")
    if len(parts) == 1:
        return first
    ptrs, groups = [], 0
    for q in parts:  # each part's row pointers shifted by the groups before it
        ptrs.append(q.group_ptr[:-1] + groups)
        groups += q.num_groups
    group_ptr = torch.cat([*ptrs, torch.tensor([groups], dtype=torch.int32, device=first.device)])
    return PackedNMInt4(
        qweight=torch.cat([q.qweight for q in parts], 1),
        qpos=torch.cat([q.qpos for q in parts], 1),
        scale_zero=torch.cat([q.scale_zero for q in parts], 0),
        group_ptr=group_ptr,
        group_shift=torch.cat([q.group_shift for q in parts], 0),
        pattern=first.pattern,
        in_features=first.in_features,
        out_features=sum(q.out_features for q in parts),
        kept=first.kept,
    )


def unpack_nm_int4(p: PackedNMInt4):
    """Exact inverse of :func:`pack_nm_int4`.

    Returns ``(q uint8 [N, Kk], pos uint8 [N, Kk] or None for DENSE, scale fp16 [G], zero fp16 [G],
    group_size int32 [N])``.
    """
    q = _unpack_bits(p.qweight, 4)[:, : p.kept].contiguous()
    pos = _unpack_bits(p.qpos, 2)[:, : p.kept].contiguous() if p.pattern.is_sparse else None
    return (
        q,
        pos,
        p.scale_zero[:, 0].contiguous(),
        p.scale_zero[:, 1].contiguous(),
        (torch.ones_like(p.group_shift) << p.group_shift).to(torch.int32),
    )


def kept_columns(p: PackedNMInt4, pos: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N, Kk]: the input column of every kept value."""
    kk = torch.arange(p.kept, device=p.device, dtype=torch.int64)
    if not p.pattern.is_sparse:
        return kk.unsqueeze(0).expand(p.out_features, -1)
    if pos is None:
        pos = _unpack_bits(p.qpos, 2)[:, : p.kept]
    return (kk // p.pattern.n) * M + pos.to(torch.int64)


def dequantize_kept(p: PackedNMInt4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, Kk] kept values ``(q - zero) * scale`` (computed in fp32, then cast to ``dtype``)."""
    q, _, scale, zero, _ = unpack_nm_int4(p)
    kk = torch.arange(p.kept, device=p.device, dtype=torch.int64)
    gidx = p.group_ptr[:-1].to(torch.int64).unsqueeze(1) + (kk.unsqueeze(0) >> p.group_shift.to(torch.int64).unsqueeze(1))
    s = scale.float()[gidx]
    z = zero.float()[gidx]
    return ((q.float() - z) * s).to(dtype)


def dequantize_nm_int4(p: PackedNMInt4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[N, K]`` weight: ``(q - zero) * scale`` scattered to the kept columns, exact zeros where
    pruned."""
    vals = dequantize_kept(p, torch.float32)
    if not p.pattern.is_sparse:
        return vals.to(dtype)
    w = torch.zeros(p.out_features, p.in_features, dtype=torch.float32, device=p.device)
    w.scatter_(1, kept_columns(p), vals)
    return w.to(dtype)


def nm_int4_linear_reference(x: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference ``x @ dequantize(p).T + bias`` in fp32, returned in x's dtype.

    Args: x [..., K] (any float dtype), bias [N] or None. Returns [..., N].
    """
    if x.shape[-1] != p.in_features:
        raise ValueError(f"x: last dim {x.shape[-1]} != in_features {p.in_features}")
    w = dequantize_nm_int4(p, torch.float32)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---- helpers for tests and benchmarks ----------------------------------------------------------
def random_packed(
    out_features: int,
    in_features: int,
    pattern: SparsityPattern | str,
    group_sizes: tuple[int, ...] = GROUP_SIZES,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> PackedNMInt4:
    """A random, never-zero packed weight (random q, positions, per-row group sizes, scales ~ 1/sqrt(K)),
    built on ``device`` (``generator``, if given, must live there too).

    Used by tests and benchmarks; not a quantizer (that lives in ``adbatch.compress``).
    """
    pattern = SparsityPattern(pattern)
    g, dev = generator, torch.device(device)
    n_out, kk = out_features, kept_per_row(pattern, in_features)
    q = torch.randint(0, 16, (n_out, kk), generator=g, dtype=torch.uint8, device=dev)
    pos = None
    if pattern.is_sparse:
        # n distinct ascending positions per group of 4: rank random keys, keep the n smallest, sort
        keys = torch.rand(n_out, in_features // M, M, generator=g, device=dev)
        pos = keys.argsort(dim=-1)[..., : pattern.n].sort(dim=-1).values.reshape(n_out, kk).to(torch.uint8)
        del keys
    choice = torch.tensor(group_sizes, dtype=torch.int32, device=dev)
    gs = choice[torch.randint(0, len(group_sizes), (n_out,), generator=g, device=dev)]
    gcount = int(_groups_per_row(kk, gs).sum())
    scale = (torch.rand(gcount, generator=g, device=dev) * 0.5 + 0.5) * (2.0 / math.sqrt(in_features))
    zero = torch.rand(gcount, generator=g, device=dev) * 4.0 + 5.5
    return pack_nm_int4(q, pos, scale.half(), zero.half(), gs, pattern, in_features)
