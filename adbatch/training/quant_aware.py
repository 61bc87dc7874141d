"""Quantization-aware final phase of training (QAT): the prunable linears see their INT4 weights.

The compression stage quantizes every transformer-block linear to asymmetric INT4 after training
(:mod:`adbatch.compress.quantization`). Applied post-training, round-to-nearest costs the default
model ~30% perplexity; a model that spent its last steps computing with those INT4 values learns
weights whose rounding costs little. From ``start_fraction`` of the optimizer steps on, every
prunable linear (:func:`adbatch.training.sparsity.prunable_linears`: lm_head and tied embeddings
excluded, as in compression) computes ``x @ fq(W)^T + b`` where ``fq(W)`` is exactly what the
compression stage stores for ``W`` with a uniform group size ``g``:

- the kept values of each row (the frozen N:M mask when progressive sparsity is on, else all of
  them) in ascending column order, cut into groups of ``g`` consecutive kept values (last one
  partial), each quantized by :func:`adbatch.compress.quantization.quantize_fixed` (asymmetric
  INT4, fp16 scale/zero, range widened to include 0) and dequantized;
- masked positions are 0.

The gradient is the straight-through estimator: ``W_eff = W + (fq(W) - W).detach()`` (times the mask
with sparsity, so pruned positions get no gradient), so the fp32 weights keep accumulating small
updates that eventually flip a rounding. The swap is an instance-level ``forward`` on each
``nn.Linear`` (the parameters, their names, DDP's hooks and ``save_pretrained`` are untouched);
:meth:`QuantAwareTraining.detach` removes it, so the saved model holds plain fp32 weights and the
compression stage's INT4 of them is exactly the forward of the last training step. Training records
``qat`` (group size, start step, steps) and the compression stage then uses uniform groups of ``g``
instead of its adaptive choice (docs/compress.md).

``fq(W)`` is cached per layer and recomputed after :meth:`QuantAwareTraining.weights_updated` (the
trainer calls it after every optimizer step) or when the weight's autograd version counter moved
(an in-place edit such as restoring saved weights), so gradient-accumulation micro-batches and the
many forwards of a validation beam search quantize each layer once per optimizer step. The explicit
call is needed: the fused AdamW kernel (the trainer's optimizer on CUDA) writes the parameters
without bumping their version counter, so a version check alone froze the forward at the weights of
QAT's first step while the fp32 weights drifted unseen (H200, 2026-12-02: a dense QAT run ended at
recall@10 0.028 against 0.579 without QAT). The cache costs one fp32 copy of the prunable weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)

__all__ = ["QuantAwareConfig", "QuantAwareTraining", "fake_quantize", "kept_columns"]


@dataclass
class QuantAwareConfig(ConfigBase):
    """Quantization-aware final phase (see the module docstring)."""

    # on by default: measured on the H200 (bench/RESULTS.md "QAT and the INT4 clip search"): the train defaults
    # on the 5,000-title Home Depot index, then the compress defaults, test recall@10: without QAT dense 0.579,
    # INT4 0.533 (clip search) / 0.513 (min/max); with QAT the INT4 model 0.602 (its fp32 weights 0.547)
    enabled: bool = field(default=True, metadata={
        "help": "fake-quantize the prunable linears (INT4) for the last (1 - start_fraction) of the steps, so "
                "the compress stage's INT4 copy is the model training ended with"})
    start_fraction: float = field(default=0.8, metadata={
        "help": "share of steps before QAT starts (>= sparsity.end_fraction when sparsity is on)"})
    group_size: int = field(default=128, metadata={
        "help": "kept values per INT4 group (the compression stage then uses this uniform size)"})

    def validate(self) -> None:
        from kernels.nm_int4 import GROUP_SIZES

        if not 0.0 <= self.start_fraction < 1.0:
            raise ConfigError(f"QuantAwareConfig.start_fraction must be in [0, 1), got {self.start_fraction}")
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"QuantAwareConfig.group_size must be one of {GROUP_SIZES}, got {self.group_size}")


def kept_columns(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[N, Kk]``: the kept columns of every row of ``mask`` (bool ``[N, K]``), ascending.

    Every row must keep the same number of values (true of an N:M mask).
    """
    rows = mask.shape[0]
    counts = mask.sum(1)
    if rows and not bool((counts == counts[0]).all()):
        raise ValueError("mask rows keep different numbers of values: not an N:M mask")
    # nonzero() is row-major, so each row's columns come out ascending, like kept_positions's order
    return mask.nonzero()[:, 1].reshape(rows, -1)


@torch.no_grad()
def fake_quantize(weight: torch.Tensor, group_size: int, cols: torch.Tensor | None = None) -> torch.Tensor:
    """The INT4 values the compression stage stores for ``weight``, dequantized.

    Args: weight float ``[N, K]``; group_size: kept values per group; cols int64 ``[N, Kk]`` kept
    columns (:func:`kept_columns`; None = all ``K``). Returns float32 ``[N, K]``: the dequantized
    kept values in place, 0 elsewhere.
    """
    from adbatch.compress.quantization import quantize_fixed

    w = weight.detach().float()
    if cols is None:
        return quantize_fixed(w, group_size)[3]
    deq = quantize_fixed(w.gather(1, cols), group_size)[3]
    return torch.zeros_like(w).scatter_(1, cols, deq)


class _LayerQAT:
    """Per-layer state: kept columns, mask, and the cached ``fq(W)`` with the weight version it is of."""

    def __init__(self, mod: nn.Linear, group_size: int, mask: torch.Tensor | None) -> None:
        self.mod, self.group_size = mod, group_size
        w = mod.weight
        self.mask = None if mask is None else mask.to(device=w.device, dtype=w.dtype)
        self.cols = None if mask is None else kept_columns(mask.to(w.device, torch.bool))
        self._version = -1
        self._fq: torch.Tensor | None = None

    def effective_weight(self) -> torch.Tensor:
        w = self.mod.weight
        if self._fq is None or self._version != w._version or self._fq.device != w.device:  # see module doc
            self._fq = fake_quantize(w, self.group_size, self.cols).to(w.dtype)
            self._version = w._version
        if not (torch.is_grad_enabled() and w.requires_grad):
            return self._fq
        live = w if self.mask is None else w * self.mask  # pruned positions: value 0, gradient 0
        return live + (self._fq - live).detach()  # straight-through: value fq(W), gradient identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.mod.bias)


class QuantAwareTraining:
    """Drives QAT for one model: :meth:`attach` at the start step, :meth:`detach` at the end.

    ``model`` may be DDP-wrapped; ``skip``: linear names containing one of these stay full
    precision (the sparsity config's ``skip_modules``, so both phases touch the same layers).
    """

    def __init__(self, model: nn.Module, config: QuantAwareConfig, total_steps: int,
                 skip: tuple[str, ...] = ("lm_head",), not_before: int = 0) -> None:
        from adbatch.training.sparsity import prunable_linears, unwrap_ddp

        self.config = config
        self.layers = prunable_linears(unwrap_ddp(model), skip)
        if not self.layers:
            raise ValueError("QAT: the model has no prunable nn.Linear (in_features % 4 == 0)")
        self.total_steps = max(1, total_steps)
        self.start = max(math.floor(config.start_fraction * self.total_steps), not_before)
        self.not_before = not_before
        self._state: dict[str, _LayerQAT] = {}
        self.started_at: int | None = None
        self.steps = 0

    @property
    def active(self) -> bool:
        return bool(self._state)

    def maybe_attach(self, step: int, masks: dict[str, torch.Tensor] | None = None,
                     budget_share: float | None = None) -> bool:
        """Attach at the start step (call at the top of every optimizer step). True once active.

        ``budget_share``: the share of a wall-clock budget already spent (None = no budget). A run that
        its time budget will stop before ``start`` attaches once ``start_fraction`` of the budget is
        spent instead, so QAT still covers the end of the run (never before ``not_before``).
        """
        by_time = budget_share is not None and budget_share >= self.config.start_fraction and step >= self.not_before
        if not self.active and (step >= self.start or by_time) and self.started_at is None:
            self.attach(masks)
            self.started_at = step
        if self.active:
            self.steps += 1
        return self.active

    def attach(self, masks: dict[str, torch.Tensor] | None = None) -> None:
        """Swap every layer's forward for the fake-quantized one. ``masks``: layer name -> bool
        ``[N, K]`` N:M mask (final, frozen) for the pruned layers; others quantize all values."""
        masks = masks or {}
        for name, mod in self.layers.items():
            st = _LayerQAT(mod, self.config.group_size, masks.get(name))
            self._state[name] = st
            mod.forward = st.forward  # instance attribute: the class, hooks and parameters untouched
        log.info("QAT: %d linears now compute with INT4 g%d weights (%d with N:M masks)",
                 len(self._state), self.config.group_size, sum(1 for n in self._state if n in masks))

    def weights_updated(self) -> None:
        """The optimizer wrote the weights: every layer re-quantizes at its next forward."""
        for st in self._state.values():
            st._fq = None

    def detach(self) -> None:
        """Restore the plain forwards (the weights themselves were never changed)."""
        for mod in self.layers.values():
            mod.__dict__.pop("forward", None)
        self._state = {}

    def summary(self) -> dict[str, Any] | None:
        """The training record's ``qat`` entry; None when QAT never started (stopped before it)."""
        if self.started_at is None:
            return None
        return {"group_size": self.config.group_size, "start_step": self.started_at, "steps": self.steps,
                "layers": len(self.layers)}
