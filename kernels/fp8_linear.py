"""FP8 (e4m3) linear layers for large row counts: dense on the FP8 tensor cores, or 2:4 on the sparse ones.

Why: at beam-search row counts (hundreds to thousands of rows per step) a decode step is compute-bound,
so a weight-only format (INT4, the packed kernels) cannot beat bf16 there; a *compute* format can. FP8
doubles the tensor cores' rate over bf16 on Hopper, and 2:4 FP8 doubles it again on the sparse tensor
cores. Both quantize the activations too, which changes numerics: the decoding engine uses them only
per row bucket where they are faster *and* pass an accuracy check against the layer's bf16 copy.

Formats (both: weights per output channel, activations per row, dynamically):

- :attr:`Fp8Layout.DENSE`: ``data`` float8_e4m3fn ``[N, K]`` row-major, ``scale`` float32 ``[N]`` with
  ``W ~= data * scale[:, None]``; the product is ``torch._scaled_mm`` (cuBLASLt FP8, row-wise scales,
  bf16 / fp16 out; sm_89+).
- :attr:`Fp8Layout.SPARSE_24`: the same values with at most 2 nonzeros in every 4 consecutive columns, in
  torchao's 2:4 FP8 layout (``Float8DynamicActivationFloat8WeightConfig(PerRow, "sparse_2d_data_2d_metadata")``
  packs it: ``data`` the kept values, ``meta`` its metadata, ``scale`` per channel) for its CUTLASS sm_90a kernel
  ``torchao.ops.rowwise_scaled_linear_sparse_cutlass_f8f8``, which takes the activations already quantized per
  row: they are quantized by :func:`quantize_rows_fp8`, as for the dense layout, not by torchao's linear
  (whose quantization kernel took 5.4 us per call on average in an 8B search at 16 queries, 10 % of its GPU
  time; H100, ``bench/decode.py --trace``). torchao is an optional GPU dependency, imported only here. Why not torch's own cuSPARSELt
  (``torch._cslt_sparse_mm`` takes FP8): on the H100 with torch 2.11 it refused the per-channel ``alpha``
  vector ("operation not supported"), and scaling its output afterwards is two more passes over ``[M, N]``.

Activations (both layouts): :func:`quantize_rows_fp8` -- one Triton program per row (amax, scale,
cast: one read of ``x``, one 1-byte write) on CUDA; :func:`quantize_rows_fp8_reference` in torch everywhere
(the tests' reference). On the CPU :func:`fp8_linear` computes the float32 reference of the same quantized
values (no speed there: tests and accuracy measurements of the format). Every product has that float32
reference, :func:`fp8_linear_reference`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kernels.fp8_common import AMAX_FLOOR, FP8_DTYPE, FP8_MAX  # the format's constants (re-exported here)

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Layout", "Fp8Weight", "quantize_weight_fp8", "quantize_rows_fp8",
           "quantize_rows_fp8_reference", "fp8_linear", "fp8_linear_reference", "fp8_supported",
           "relative_error"]


class Fp8Layout(str, enum.Enum):
    """Memory layout of an :class:`Fp8Weight` (see the module docstring)."""

    DENSE = "fp8"
    SPARSE_24 = "fp8_2:4"


@dataclass
class Fp8Weight:
    """An FP8 weight with per-output-channel scales.

    :attr:`Fp8Layout.DENSE`: ``data`` float8_e4m3fn ``[N, K]``, ``scale`` float32 ``[N]``, ``bias`` ``[N]`` in the
    activations' dtype or None. :attr:`Fp8Layout.SPARSE_24`: ``data`` the kept values float8_e4m3fn ``[N, K / 2]``
    and ``meta`` the metadata, both in torchao's CUTLASS layout, ``scale`` float32 ``[N]``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    layout: Fp8Layout
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None
    meta: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.bias, self.meta)
                   if isinstance(t, torch.Tensor))


def fp8_supported(device: torch.device, layout: Fp8Layout) -> str | None:
    """None where ``layout`` can run on ``device``, else why not (one line). On the CPU the dense layout
    runs its float32 reference (no speed: for tests and accuracy measurements of the format)."""
    if device.type == "cpu" and layout is Fp8Layout.DENSE:
        return None
    if device.type != "cuda":
        return f"{layout.value} products need CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if layout is Fp8Layout.DENSE and (major, minor) < (8, 9):
        return f"FP8 needs sm_89+, this GPU is sm_{major}{minor}"
    if layout is Fp8Layout.SPARSE_24:
        if major != 9:
            return f"torchao's 2:4 FP8 kernel is built for sm_90a, this GPU is sm_{major}{minor}"
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (the optional GPU dependency of 2:4 FP8: pip install torchao)"
    return None


def quantize_weight_fp8(w: torch.Tensor, layout: Fp8Layout = Fp8Layout.DENSE,
                        bias: torch.Tensor | None = None) -> Fp8Weight:
    """``w`` float ``[N, K]`` -> :class:`Fp8Weight` (per-output-channel amax scaling).

    Per-channel scaling of a weight is the per-row scaling of activations applied to its rows
    (:func:`quantize_rows_fp8_reference`). :attr:`Fp8Layout.SPARSE_24` needs ``w`` already 2:4 along K (at most
    2 nonzeros in every 4 consecutive columns; checked), bf16 on an sm_90 GPU with torchao (its layout)."""
    if w.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    if layout is Fp8Layout.SPARSE_24:
        if k % 4:
            raise ValueError(f"2:4 FP8 needs K % 4 == 0, got K = {k}")
        nnz = (w.reshape(n, k // 4, 4) != 0).sum(-1)
        if int(nnz.max()) > 2:
            raise ValueError("2:4 FP8: the weight has more than 2 nonzeros in some group of 4 columns")
        data, meta, scale = _torchao_sparse_fp8(w)
        return Fp8Weight(data=data, scale=scale, layout=layout, out_features=int(n), in_features=int(k), bias=bias,
                         meta=meta)
    data, scale = quantize_rows_fp8_reference(w)
    return Fp8Weight(data=data, scale=scale[:, 0].contiguous(), layout=layout, out_features=int(n),
                     in_features=int(k), bias=bias)


def _torchao_sparse_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` (bf16, CUDA, 2:4) packed by torchao into its 2:4 FP8 layout: (kept values, metadata, per-channel
    scales float32 ``[N]``), the operands of its CUTLASS kernel."""
    from torchao import quantization as aoq  # optional GPU dependency: imported only here

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    cfg = aoq.Float8DynamicActivationFloat8WeightConfig(granularity=aoq.PerRow(),
                                                        packing_format="sparse_2d_data_2d_metadata",
                                                        set_inductor_config=False)
    aoq.quantize_(lin, cfg)
    q = lin.weight
    if not all(hasattr(q, a) for a in ("qdata", "sparse_metadata", "scale")):
        raise RuntimeError(f"torchao left the 2:4 FP8 weight as {type(q).__name__}, not its 2:4 FP8 layout")
    return q.qdata, q.sparse_metadata, q.scale.reshape(-1).float().contiguous()


def quantize_rows_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` float ``[M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 scales ``[M, 1]``), ``x ~= q * s``."""
    s = x.float().abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`quantize_rows_fp8_reference`: the Triton kernel for CUDA tensors, the reference elsewhere."""
    if not x.is_cuda:
        return quantize_rows_fp8_reference(x)
    from kernels.fp8_quant import quantize_rows_fp8_triton  # lazy: Triton only where it runs

    return quantize_rows_fp8_triton(x)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, fast_accum: bool = True,
               x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``x`` quantized per row to FP8 (CUDA; see :func:`fp8_supported`).

    ``x``: bf16 / fp16 ``[..., K]``; returns ``[..., N]`` in ``x``'s dtype. ``fast_accum``: cuBLASLt's fast FP8
    accumulation (the tensor cores' partial sums are not periodically promoted to float32), as torchao's FP8 forward
    asks for. On by default: at the 8B shapes it ran at 0.97-1.39x the promoted accumulation's speed, faster at 19
    of 20 points (q/k/v at 16 rows 1.42x vs 1.02x cuBLAS bf16), with the same relative error to the float32 product,
    0.037-0.038 up to K = 14,336 (H100, 2026-12-06; bench/fp8_layers.py's ``fp8`` and ``fp8_full_acc`` columns).
    ``x_fp8``: ``x``'s rows already quantized, ``(q [M, K], s [M, 1])`` as :func:`quantize_rows_fp8` makes them
    (e.g. by :func:`kernels.fused_ops.add_rms_norm_fp8` in the norm that wrote ``x``): used instead of quantizing."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.layout is Fp8Layout.DENSE and not x.is_cuda:
        y = fp8_linear_reference(x2, w.data, w.scale, w.bias).to(x.dtype)
    elif w.layout is Fp8Layout.SPARSE_24:
        from torchao.ops import rowwise_scaled_linear_sparse_cutlass_f8f8  # optional GPU dependency

        xq, sx = quantize_rows_fp8(x2) if x_fp8 is None else x_fp8
        y = rowwise_scaled_linear_sparse_cutlass_f8f8(xq, sx[:, 0], w.data, w.meta, w.scale, w.bias, x.dtype)
    else:
        xq, sx = quantize_rows_fp8(x2) if x_fp8 is None else x_fp8
        y = torch._scaled_mm(xq, w.data.t(), scale_a=sx, scale_b=w.scale[None, :], bias=w.bias,
                             out_dtype=x.dtype, use_fast_accum=fast_accum)
    return y.reshape(*lead, w.out_features)


def fp8_linear_reference(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 product of what :func:`fp8_linear` computes: ``x`` quantized per row, ``data``
    float8_e4m3fn ``[N, K]`` (uncompressed, 2:4 or dense) times ``scale [N]``. Returns float32 ``[..., N]``."""
    lead = x.shape[:-1]
    xq, sx = quantize_rows_fp8_reference(x.reshape(-1, x.shape[-1]))
    y = (xq.float() * sx) @ (data.float() * scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*lead, data.shape[0])


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``||y - ref|| / ||ref||`` in float32 (Frobenius)."""
    ref = ref.float()
    return float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))
