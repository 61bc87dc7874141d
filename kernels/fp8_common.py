"""The FP8 (e4m3) format's constants, shared by the FP8 linear (:mod:`kernels.fp8_linear`: weights, the torch
references, the products) and the Triton activation quantizers (:mod:`kernels.fp8_quant`,
:mod:`kernels.fused_ops`). A module of its own so both sides import it and neither imports the other."""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "AMAX_FLOOR"]

FP8_DTYPE = torch.float8_e4m3fn
#: largest finite e4m3fn value: scales map each row's / channel's amax onto it
FP8_MAX = 448.0
#: floor of a row's amax (an all-zero row gets a finite scale and quantizes to zeros)
AMAX_FLOOR = 1e-12
