"""Compression stage: calibrated adaptive-group INT4 + layer-adaptive N:M sparsity (DESIGN.md section 1).

Modules: :mod:`.recipe` (configs, enums, recipe JSON), :mod:`.calibration` (statistics via hooks),
:mod:`.sparsity` (scores, masks, layer importance, pattern allocation), :mod:`.quantization`
(asymmetric INT4, adaptive group sizes), :mod:`.linear` (``CompressedLinear``, ``compress_``),
:mod:`.checkpoint` (``save_compressed`` / ``load_compressed``), :mod:`.report` (perplexity, ablations,
plots). The packed byte layout itself is defined in ``kernels/nm_int4.py``.
"""

from adbatch.compress.calibration import CalibrationStats, LayerStats, calibrate
from adbatch.compress.checkpoint import CheckpointError, load_compressed, save_compressed
from adbatch.compress.linear import CompressedLinear, compress_
from adbatch.compress.recipe import (
    CalibrationConfig, CompressConfig, CompressionRecipe, GroupPolicy, LayerRecipe, PatternPolicy, ScoreMethod,
)
from kernels.nm_int4 import FORMAT_VERSION  # the packed layout's version: what a checkpoint on disk must match

__all__ = [
    "FORMAT_VERSION", "CalibrationConfig", "CalibrationStats", "CheckpointError", "CompressConfig", "CompressedLinear",
    "CompressionRecipe", "GroupPolicy", "LayerRecipe", "LayerStats", "PatternPolicy", "ScoreMethod",
    "calibrate", "compress_", "load_compressed", "save_compressed",
]
