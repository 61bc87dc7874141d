"""kernels.packed_linear: the layer call of a packed weight as a torch.library op (CPU: the reference)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from adbatch.compress.linear import CompressedLinear
from kernels import packed_linear as pl
from kernels.nm_int4 import SparsityPattern, nm_int4_linear_reference, random_packed


def _layer(pattern: SparsityPattern, seed: int, bias: bool = True) -> CompressedLinear:
    g = torch.Generator().manual_seed(seed)
    p = random_packed(24, 96, pattern, generator=g)
    return CompressedLinear(p, torch.randn(24, generator=g) if bias else None)


def _op_args(layer: CompressedLinear, x: torch.Tensor) -> tuple:
    p = layer.packed
    return (x, p.qweight, p.qpos, p.scale_zero, p.group_ptr, p.group_shift, layer.bias, p.pattern.value, p.in_features)


@pytest.mark.parametrize("pattern", list(SparsityPattern))
def test_op_equals_the_eager_call(pattern):
    layer = _layer(pattern, seed=1, bias=pattern is not SparsityPattern.ONE_FOUR)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(2))
    y = torch.ops.adbatch.nm_int4_linear(*_op_args(layer, x))
    assert y.shape == (2, 3, 24) and y.dtype == x.dtype
    assert torch.equal(y, pl.nm_int4_linear(x, layer.packed, layer.bias))
    assert torch.equal(y, nm_int4_linear_reference(x, layer.packed, layer.bias))


def test_torch_compile_traces_the_op_and_equals_eager():
    """One graph (no break) holding the op, for the real layer module; aot_eager runs it through
    AOTAutograd with dynamic batch sizes and matches eager exactly (same reference math on CPU)."""
    layer = _layer(SparsityPattern.TWO_FOUR, seed=3)

    def f(x):
        return torch.relu(layer(x)) * 2.0

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 96, generator=g)
    assert torch.equal(torch.compile(f, backend=record, fullgraph=True)(x), f(x))
    assert len(graphs) == 1 and "adbatch.nm_int4_linear" in str(graphs[0].graph)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for batch in (1, 5, 9):
        x = torch.randn(batch, 96, generator=g)
        assert torch.equal(compiled(x), f(x))
    torch._dynamo.reset()


def test_opcheck():
    layer = _layer(SparsityPattern.ONE_FOUR, seed=5)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(6))
    torch.library.opcheck(torch.ops.adbatch.nm_int4_linear.default, _op_args(layer, x))


def test_fake_rejects_wrong_in_features():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layer(SparsityPattern.DENSE, seed=7)
    good, bad = _op_args(layer, torch.empty(2, 5, 96)), _op_args(layer, torch.empty(5, 95))
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.adbatch.nm_int4_linear(*good)
        assert y.shape == (2, 5, 24) and y.dtype == torch.float32
        with pytest.raises(RuntimeError, match=r"expected \[\.\.\., 96\]"):
            torch.ops.adbatch.nm_int4_linear(*bad)


def test_op_keeps_one_packed_object_per_layer():
    """The op rebuilds the packed weight from its tensors; one object per set of tensors keeps the CUDA
    launcher's binding (id + weakref) across calls, and it goes with the layer's tensors."""
    layer = _layer(SparsityPattern.TWO_FOUR, seed=8)
    p = layer.packed
    tensors = (p.qweight, p.qpos, p.scale_zero, p.group_ptr, p.group_shift)
    a = pl._packed_of(*tensors, p.pattern.value, p.in_features)
    assert pl._packed_of(*tensors, p.pattern.value, p.in_features) is a
    assert a.qweight.data_ptr() == p.qweight.data_ptr() and a.qweight is not p.qweight
    fresh_sz = p.scale_zero.clone()  # another tensor in one slot: another object
    assert pl._packed_of(p.qweight, p.qpos, fresh_sz, p.group_ptr, p.group_shift, p.pattern.value, p.in_features) is not a
    b = pl._packed_of(*tensors, p.pattern.value, p.in_features)  # replaced the entry of qweight
    assert b is not a
    ref = weakref.ref(b)
    del layer, p, tensors, a, b, fresh_sz
    gc.collect()
    assert ref() is None  # the entry did not keep its layer's tensors (its key) alive
