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
- :attr:`Fp8Layout.SPARSE_24`: the same values with at most 2 nonzeros in every 4 consecutive columns,
  ``data`` the cuSPARSELt-compressed 1-D buffer of ``torch._cslt_compress`` (values + 2-bit metadata,
  10/16 of the dense FP8 bytes); the product is ``torch._cslt_sparse_mm`` with the weight scales as its
  per-output-row ``alpha`` vector, then the activation row scales (sm_90; torch's cuSPARSELt build).

Activations: :func:`quantize_rows_fp8` -- one Triton program per row (amax, scale, cast: one read of
``x``, one 1-byte write) on CUDA; :func:`quantize_rows_fp8_reference` in torch everywhere (the tests'
reference; CPU). Every product has a float32 reference, :func:`fp8_linear_reference`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Layout", "Fp8Weight", "quantize_weight_fp8", "quantize_rows_fp8",
           "quantize_rows_fp8_reference", "fp8_linear", "fp8_linear_reference", "fp8_supported",
           "relative_error"]

FP8_DTYPE = torch.float8_e4m3fn
#: largest finite e4m3fn value: scales map each row's / channel's amax onto it
FP8_MAX = 448.0
#: floor of a row's amax (an all-zero row gets a finite scale and quantizes to zeros)
AMAX_FLOOR = 1e-12


class Fp8Layout(str, enum.Enum):
    """Memory layout of an :class:`Fp8Weight` (see the module docstring)."""

    DENSE = "fp8"
    SPARSE_24 = "fp8_2:4"


@dataclass
class Fp8Weight:
    """An FP8 weight with per-output-channel scales.

    ``data``: float8_e4m3fn ``[N, K]`` (:attr:`Fp8Layout.DENSE`) or the cuSPARSELt-compressed buffer
    (:attr:`Fp8Layout.SPARSE_24`); ``scale``: float32 ``[N]``; ``bias``: ``[N]`` in the activations'
    dtype or None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    layout: Fp8Layout
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size() + self.scale.numel() * 4
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def fp8_supported(device: torch.device, layout: Fp8Layout) -> str | None:
    """None where ``layout`` can run on ``device``, else why not (one line). On the CPU the dense layout
    runs torch's own ``_scaled_mm`` (no speed: for tests and accuracy measurements of the format)."""
    if device.type == "cpu" and layout is Fp8Layout.DENSE:
        return None
    if device.type != "cuda":
        return f"{layout.value} products need CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if layout is Fp8Layout.DENSE and (major, minor) < (8, 9):
        return f"FP8 needs sm_89+, this GPU is sm_{major}{minor}"
    if layout is Fp8Layout.SPARSE_24:
        if major != 9:
            return f"2:4 FP8 through cuSPARSELt is built for sm_90, this GPU is sm_{major}{minor}"
        if not torch.backends.cusparselt.is_available():
            return "this torch has no cuSPARSELt"
    return None


def _channel_scale(w: torch.Tensor) -> torch.Tensor:
    return (w.float().abs().amax(dim=1).clamp(min=AMAX_FLOOR) / FP8_MAX).contiguous()


def quantize_weight_fp8(w: torch.Tensor, layout: Fp8Layout = Fp8Layout.DENSE,
                        bias: torch.Tensor | None = None) -> Fp8Weight:
    """``w`` float ``[N, K]`` -> :class:`Fp8Weight` (per-output-channel amax scaling).

    :attr:`Fp8Layout.SPARSE_24` needs ``w`` already 2:4 along K (at most 2 nonzeros in every 4
    consecutive columns; checked) and CUDA (the compression is cuSPARSELt's)."""
    if w.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    scale = _channel_scale(w)
    data = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if layout is Fp8Layout.SPARSE_24:
        if k % 4:
            raise ValueError(f"2:4 FP8 needs K % 4 == 0, got K = {k}")
        nnz = (w.reshape(n, k // 4, 4) != 0).sum(-1)
        if int(nnz.max()) > 2:
            raise ValueError("2:4 FP8: the weight has more than 2 nonzeros in some group of 4 columns")
        data = torch._cslt_compress(data)
    return Fp8Weight(data=data, scale=scale, layout=layout, out_features=int(n), in_features=int(k), bias=bias)


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


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``x @ W.T + bias`` with ``x`` quantized per row to FP8 (CUDA; see :func:`fp8_supported`).

    ``x``: bf16 / fp16 ``[..., K]``; returns ``[..., N]`` in ``x``'s dtype (float32 accumulation)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_rows_fp8(x2)
    if w.layout is Fp8Layout.DENSE:
        y = torch._scaled_mm(xq, w.data.t(), scale_a=sx, scale_b=w.scale[None, :], bias=w.bias,
                             out_dtype=x.dtype)
    else:
        # cuSPARSELt: the compressed weight is the sparse left operand (W [N, K] @ xq.T [K, M]); alpha
        # scales its output rows (= the weight's channels); transpose_result writes [M, N] row-major
        y = torch._cslt_sparse_mm(w.data, xq.t(), alpha=w.scale, out_dtype=x.dtype, transpose_result=True)
        y = y * sx.to(y.dtype)
        if w.bias is not None:
            y = y + w.bias
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
