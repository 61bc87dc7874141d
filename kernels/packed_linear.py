"""The layer call of a packed weight, ``y = x @ dequantize(p).T + bias``: :func:`nm_int4_linear`.

CUDA tensors run the Triton kernels (:func:`kernels.int4_launch.nm_int4_linear_triton`, imported on the
first CUDA call: importing this module neither imports Triton nor fixes its interpreter choice), every
other device the fp32 torch reference (:func:`kernels.nm_int4.nm_int4_linear_reference`).

The same call is the ``torch.library`` custom op ``torch.ops.adbatch.nm_int4_linear`` (the packed
weight's five tensors, bias, pattern and K), with a fake implementation giving the output's shape and
dtype, so ``torch.compile`` traces a compressed layer as one opaque node instead of breaking the graph in
the launcher. Eager calls do not go through the op: its dispatch costs several microseconds per call
(measured in the commit that added it), which is more than the bound launcher's whole host path, and
eager callers (the decoding engine's captured CUDA graphs included) gain nothing from it.
:func:`nm_int4_linear` takes the op only while ``torch.compile`` traces.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kernels.nm_int4 import PackedNMInt4, SparsityPattern, kept_per_row, nm_int4_linear_reference

__all__ = ["nm_int4_linear"]


def _linear(x: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None) -> torch.Tensor:
    if x.is_cuda:
        from kernels.int4_launch import nm_int4_linear_triton  # lazy: Triton only where it runs

        return nm_int4_linear_triton(x, p, bias)
    return nm_int4_linear_reference(x, p, bias)


def nm_int4_linear(x: torch.Tensor, p: PackedNMInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(p).T + bias``: the Triton kernels for CUDA tensors, the reference elsewhere.

    Args: x fp16/bf16 [..., K] (the reference also takes fp32 on CPU), bias [N] or None.
    Returns [..., N] in x's dtype (fp32 accumulation).
    """
    if torch.compiler.is_compiling():
        return torch.ops.adbatch.nm_int4_linear(x, p.qweight, p.qpos, p.scale_zero, p.group_ptr, p.group_shift, bias,
                                                p.pattern.value, p.in_features)
    return _linear(x, p, bias)


# qweight -> (weak references to the other four tensors, the packed weight over aliases of all five).
# The op receives tensors, but the CUDA launcher binds per PackedNMInt4 object (id + weakref): one object
# per set of tensors keeps that binding across calls. The object holds detached aliases, not the tensors
# themselves, so the entry does not keep its key alive: it goes when the layer's qweight does.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _packed_of(qweight: torch.Tensor, qpos: torch.Tensor, scale_zero: torch.Tensor, group_ptr: torch.Tensor,
               group_shift: torch.Tensor, pattern: str, in_features: int) -> PackedNMInt4:
    rest = (qpos, scale_zero, group_ptr, group_shift)
    hit = _PACKED.get(qweight)
    if hit is not None and all(r() is t for r, t in zip(hit[0], rest)) and hit[1].pattern.value == pattern \
            and hit[1].in_features == in_features:
        return hit[1]
    pat = SparsityPattern(pattern)
    p = PackedNMInt4(qweight=qweight.detach(), qpos=qpos.detach(), scale_zero=scale_zero.detach(),
                     group_ptr=group_ptr.detach(), group_shift=group_shift.detach(), pattern=pat,
                     in_features=in_features, out_features=group_shift.shape[0], kept=kept_per_row(pat, in_features))
    _PACKED[qweight] = (tuple(weakref.ref(t) for t in rest), p)
    return p


@torch.library.custom_op("adbatch::nm_int4_linear", mutates_args=())
def _nm_int4_linear_op(x: torch.Tensor, qweight: torch.Tensor, qpos: torch.Tensor, scale_zero: torch.Tensor,
                       group_ptr: torch.Tensor, group_shift: torch.Tensor, bias: Optional[torch.Tensor], pattern: str,
                       in_features: int) -> torch.Tensor:
    """``torch.ops.adbatch.nm_int4_linear``: x [..., K], the five :class:`PackedNMInt4` tensors (N =
    ``group_shift.shape[0]``), bias [N] or None, ``pattern`` a :class:`SparsityPattern` value, K ->
    [..., N] in x's dtype."""
    return _linear(x, _packed_of(qweight, qpos, scale_zero, group_ptr, group_shift, pattern, in_features), bias)


@_nm_int4_linear_op.register_fake
def _nm_int4_linear_fake(x, qweight, qpos, scale_zero, group_ptr, group_shift, bias, pattern, in_features):
    torch._check(x.shape[-1] == in_features, lambda: f"x: expected [..., {in_features}], got {tuple(x.shape)}")
    return x.new_empty(*x.shape[:-1], group_shift.shape[0])
