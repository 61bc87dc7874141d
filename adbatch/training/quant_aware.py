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
updates that eventually flip a rounding. The swap changes each linear's class to a subclass whose
``forward`` computes with ``fq(W)`` (:class:`QuantAwareLinear`; the parameters, their names, DDP's
hooks and ``save_pretrained`` are untouched, and every layer has the same class, so one compiled
graph of a decoder layer still serves all of them); :meth:`QuantAwareTraining.detach` restores the
class, so the saved model holds plain fp32 weights and the compression stage's INT4 of them is
exactly the forward of the last training step. Training records ``qat`` (group size, start step,
steps) and the compression stage then uses uniform groups of ``g`` instead of its adaptive choice
(docs/compress.md).

Two ways to get ``fq(W)``, one per execution mode:

- inside a ``torch.compile`` graph (the trainer's compiled decoder layers) it is recomputed in the
  graph at every forward: inductor fuses the group min/max, rounding and dequantization into a few
  kernels over the weight, and a graph has no Python-side cache to consult. Before this, QAT turned
  the compiled layers off for the final phase (H200, 2026-12-02: QAT steps 158-360 ms eager vs
  ~82 ms compiled);
- eager, ``fq(W)`` is cached per layer and recomputed after :meth:`QuantAwareTraining.weights_updated`
  (the trainer calls it after every optimizer step) or when the weight's autograd version counter
  moved (an in-place edit such as restoring saved weights), so gradient-accumulation micro-batches
  and the many forwards of a validation beam search quantize each layer once per optimizer step.
  The explicit call is needed: the fused AdamW kernel (the trainer's optimizer on CUDA) writes the
  parameters without bumping their version counter, so a version check alone froze the forward at
  the weights of QAT's first step while the fp32 weights drifted unseen (H200, 2026-12-02: a dense
  QAT run ended at recall@10 0.028 against 0.579 without QAT). The cache costs one fp32 copy of the
  prunable weights.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)

__all__ = ["QuantAwareConfig", "QuantAwareLinear", "QuantAwareTraining", "fake_quantize", "kept_columns"]


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


class QuantAwareLinear(nn.Linear):
    """An ``nn.Linear`` computing with its INT4 fake-quantized weight (straight-through gradient).

    Not constructed: :meth:`QuantAwareTraining.attach` switches an existing linear's class to
    :func:`quant_aware_class` of its own class and sets the attributes below, :meth:`~QuantAwareTraining.detach`
    switches it back. Per-layer state (plain attributes, not buffers: the state dict is unchanged):
    ``qat_group_size`` int; ``qat_mask`` None or the frozen N:M mask in the weight's dtype ``[N, K]``;
    ``qat_cols`` None or its kept columns int64 ``[N, Kk]``; the eager cache ``qat_fq`` (``[N, K]``,
    the weight's dtype) and the weight version it is of.
    """

    qat_group_size: int
    qat_mask: torch.Tensor | None
    qat_cols: torch.Tensor | None
    qat_fq: torch.Tensor | None
    qat_version: int

    def effective_weight(self) -> torch.Tensor:
        w = self.weight
        if torch.compiler.is_compiling():  # in the graph: recomputed and fused at every forward (module doc)
            fq = fake_quantize(w, self.qat_group_size, self.qat_cols).to(w.dtype)
        else:
            if self.qat_fq is None or self.qat_version != w._version or self.qat_fq.device != w.device:
                self.qat_fq = fake_quantize(w, self.qat_group_size, self.qat_cols).to(w.dtype)
                self.qat_version = w._version
            fq = self.qat_fq
        if not (torch.is_grad_enabled() and w.requires_grad):
            return fq
        live = w if self.qat_mask is None else w * self.qat_mask  # pruned positions: value 0, gradient 0
        return live + (fq - live).detach()  # straight-through: value fq(W), gradient identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)


@functools.lru_cache(maxsize=None)
def quant_aware_class(cls: type[nn.Linear]) -> type[nn.Linear]:
    """The QAT class of a linear of class ``cls``: ``QuantAwareLinear`` itself for ``nn.Linear``, else
    one subclass of both per ``cls`` (a model's own linear subclass keeps its other methods)."""
    if cls is nn.Linear:
        return QuantAwareLinear
    return type(f"QuantAware{cls.__name__}", (QuantAwareLinear, cls), {})


_QAT_ATTRS = ("qat_group_size", "qat_mask", "qat_cols", "qat_fq", "qat_version")


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
        self._classes: dict[str, type[nn.Linear]] = {}  # layer name -> its class before attach
        self.started_at: int | None = None
        self.steps = 0

    @property
    def active(self) -> bool:
        return bool(self._classes)

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
        """Switch every layer to its :func:`quant_aware_class`. ``masks``: layer name -> bool
        ``[N, K]`` N:M mask (final, frozen) for the pruned layers; others quantize all values."""
        masks = masks or {}
        for name, mod in self.layers.items():
            w, mask = mod.weight, masks.get(name)
            self._classes[name] = type(mod)
            mod.__class__ = quant_aware_class(type(mod))
            mod.qat_group_size = self.config.group_size
            mod.qat_mask = None if mask is None else mask.to(device=w.device, dtype=w.dtype)
            mod.qat_cols = None if mask is None else kept_columns(mask.to(w.device, torch.bool))
            mod.qat_fq, mod.qat_version = None, -1
        log.info("QAT: %d linears now compute with INT4 g%d weights (%d with N:M masks)",
                 len(self._classes), self.config.group_size, sum(1 for n in self._classes if n in masks))

    def weights_updated(self) -> None:
        """The optimizer wrote the weights: every layer re-quantizes at its next forward."""
        for name in self._classes:
            self.layers[name].qat_fq = None

    def detach(self) -> None:
        """Restore the plain forwards (the weights themselves were never changed)."""
        for name, cls in self._classes.items():
            mod = self.layers[name]
            mod.__class__ = cls
            for attr in _QAT_ATTRS:
                mod.__dict__.pop(attr, None)
        self._classes = {}

    def summary(self) -> dict[str, Any] | None:
        """The training record's ``qat`` entry; None when QAT never started (stopped before it)."""
        if self.started_at is None:
            return None
        return {"group_size": self.config.group_size, "start_step": self.started_at, "steps": self.steps,
                "layers": len(self.layers)}
