"""Progressive N:M sparsity during training.

The masks are introduced gradually instead of one-shot after training, so the model recovers the
accuracy pruning costs while it is still learning the index:

- before ``start_fraction`` of the optimizer steps: dense;
- between ``start_fraction`` and ``end_fraction``: the number of kept weights per group of 4 steps
  down one level at a time (4 -> 3 -> 2 for a 2:4 layer; 4 -> 3 -> 2 -> 1 for a 1:4 layer, each
  level an equal share of the window);
- every ``rescore_every`` steps inside the window (and at every level change) masks are re-scored
  with the paper's criterion ``S = |W|·||X_j||_2 + |W|·|dL/dW|``
  (:func:`adbatch.compress.sparsity.element_scores`, method ``paper``): ``||X_j||`` from forward
  hooks over the step's micro-batches, ``|dL/dW|`` the accumulated gradient of the step;
  :func:`adbatch.compress.sparsity.nm_mask` keeps the top n of each group of 4 input columns;
- at ``end_fraction`` the final masks are frozen; masked weights are set to zero after every
  optimizer step until the end, so the saved model is exactly N:M and the compression stage can keep
  the masks (its INT4 then quantizes only kept values).

Pruning is hard: a pruned weight is zero, its score is zero, so it is not regrown — the density only
goes down, which is the schedule asked for. Which layers end at 1:4 (``one_four_fraction`` of them)
is decided once, when the schedule first goes below 2 kept values: the layers whose 1:4 mask would
drop the smallest share of their score mass (the least important ones, as in the paper's Fig. 1).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)

M = 4


@dataclass
class SparsityScheduleConfig(ConfigBase):
    """Progressive N:M schedule (see the module docstring)."""

    enabled: bool = field(default=False, metadata={"help": "introduce N:M masks during training"})
    final_n: int = field(default=2, metadata={"help": "kept values per group of 4 at the end (2 = 2:4)"})
    one_four_fraction: float = field(default=0.0, metadata={"help": "share of linear layers (least important) ending at 1:4"})
    start_fraction: float = field(default=0.3, metadata={"help": "share of steps before the first mask"})
    end_fraction: float = field(default=0.7, metadata={"help": "share of steps at which masks are final and frozen"})
    rescore_every: int = field(default=1, metadata={"help": "re-score masks every this many steps in the window"})
    skip_modules: tuple[str, ...] = field(default=("lm_head",), metadata={"help": "linear names containing one of these stay dense"})

    def validate(self) -> None:
        if self.final_n not in (1, 2, 3, 4):
            raise ConfigError(f"SparsityScheduleConfig.final_n must be 1..4, got {self.final_n}")
        if not 0.0 <= self.one_four_fraction <= 1.0:
            raise ConfigError(f"SparsityScheduleConfig.one_four_fraction must be in [0, 1], got {self.one_four_fraction}")
        if not 0.0 <= self.start_fraction < self.end_fraction <= 1.0:
            raise ConfigError("SparsityScheduleConfig: need 0 <= start_fraction < end_fraction <= 1, got "
                              f"{self.start_fraction}, {self.end_fraction}")
        if self.rescore_every < 1:
            raise ConfigError(f"SparsityScheduleConfig.rescore_every must be >= 1, got {self.rescore_every}")


def prunable_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` whose name contains none of ``skip``, whose in_features % 4 == 0 and whose
    weight is not the input embedding table (a tied head stays exact, as in compression)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and not any(s in name for s in skip) and mod.in_features % M == 0
            and mod.weight is not emb_w}


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


class ProgressiveSparsity:
    """Drives the schedule for one model. Call order per optimizer step ``s`` (0-based):

    ``wants_stats(s)`` -> (forward/backward of the step's micro-batches; hooks gather ``||X||`` when
    wanted) -> ``before_optimizer_step(s)`` (re-scores masks from weights, ``||X||``, grads) ->
    ``optimizer.step()`` -> ``after_optimizer_step()`` (zeroes masked weights).
    """

    def __init__(self, model: nn.Module, config: SparsityScheduleConfig, total_steps: int) -> None:
        self.config, self.total_steps = config, max(1, total_steps)
        self.layers = prunable_linears(unwrap_ddp(model), config.skip_modules)
        if not self.layers:
            raise ValueError("progressive sparsity: the model has no prunable nn.Linear (in_features % 4 == 0)")
        self.start = math.floor(config.start_fraction * self.total_steps)
        self.end = max(self.start + 1, math.floor(config.end_fraction * self.total_steps))
        self.final_n: dict[str, int] = {name: config.final_n for name in self.layers}
        self._one_four_decided = config.one_four_fraction == 0.0 or config.final_n <= 1
        self.masks: dict[str, torch.Tensor] = {}
        self.current_n: dict[str, int] = {name: M for name in self.layers}
        self._sq: dict[str, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self.frozen = False
        self.finished_early = False

    # ---- schedule --------------------------------------------------------------------------
    def n_at(self, step: int, final_n: int) -> int:
        """Kept values per group of 4 at optimizer step ``step`` for a layer ending at ``final_n``."""
        if step < self.start:
            return M
        if step >= self.end:
            return final_n
        levels = M - final_n
        p = (step - self.start + 1) / (self.end - self.start)
        return M - min(levels, max(1, math.ceil(p * levels)))

    def wants_stats(self, step: int) -> bool:
        if self.frozen or step < self.start:
            return False
        return self._changes(step) or (step - self.start) % self.config.rescore_every == 0 or step >= self.end - 1

    def _changes(self, step: int) -> bool:
        return any(self.n_at(step, self.final_n[n]) != self.current_n[n] for n in self.layers)

    # ---- statistics ------------------------------------------------------------------------
    def start_stats(self) -> None:
        """Register forward hooks accumulating ``sum x_j^2`` of every prunable layer's input."""
        self.stop_stats()
        self._sq = {name: torch.zeros(mod.in_features, device=mod.weight.device, dtype=torch.float32)
                    for name, mod in self.layers.items()}

        def hook(name: str):
            def fn(_mod: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                x = inputs[0].detach()
                self._sq[name] += x.reshape(-1, x.shape[-1]).float().pow(2).sum(0)
            return fn

        self._hooks = [mod.register_forward_pre_hook(hook(name)) for name, mod in self.layers.items()]

    def stop_stats(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- masks -----------------------------------------------------------------------------
    @torch.no_grad()
    def _scores(self, name: str) -> torch.Tensor:
        from adbatch.compress.sparsity import ScoreMethod, element_scores

        mod = self.layers[name]
        w = mod.weight.detach().float()
        act = self._sq[name].sqrt() if name in self._sq else None
        grad = mod.weight.grad.detach().float().abs() if mod.weight.grad is not None else None
        method = ScoreMethod.PAPER if (act is not None and grad is not None) else ScoreMethod.MAGNITUDE
        return element_scores(w, act, grad, method)

    @torch.no_grad()
    def _decide_one_four(self, scores: dict[str, torch.Tensor]) -> None:
        """Pick the least important ``one_four_fraction`` of layers for 1:4 (see module docstring)."""
        from adbatch.compress.sparsity import nm_mask

        share = {}
        for name, s in scores.items():
            total = float(s.sum()) or 1.0
            share[name] = float((s * ~nm_mask(s, 1, M)).sum()) / total  # score mass a 1:4 mask drops
        k = round(self.config.one_four_fraction * len(share))
        for name in sorted(share, key=share.get)[:k]:
            self.final_n[name] = 1
        self._one_four_decided = True
        log.info("progressive sparsity: %d of %d layers end at 1:4", k, len(share))

    @torch.no_grad()
    def before_optimizer_step(self, step: int) -> None:
        """Re-score the masks for ``step`` when scheduled (needs the step's grads and hook stats)."""
        self.stop_stats()
        if self.frozen or step < self.start or not self._sq:
            self._sq = {}
            return
        from adbatch.compress.sparsity import nm_mask

        scores = {name: self._scores(name) for name in self.layers}
        if not self._one_four_decided and self.n_at(step, self.config.final_n) <= 2:
            self._decide_one_four(scores)
        for name, mod in self.layers.items():
            n = self.n_at(step, self.final_n[name])
            self.current_n[name] = n
            if n >= M:
                self.masks.pop(name, None)
                continue
            mask = nm_mask(scores[name], n, M).to(mod.weight.device)
            self.masks[name] = mask
            if mod.weight.grad is not None:  # the optimizer must not move what the mask removes
                mod.weight.grad.mul_(mask)
        self._sq = {}
        if step >= self.end - 1:
            self.frozen = True
            log.info("progressive sparsity: masks frozen at step %d (density %.3f)", step, self.density())

    @torch.no_grad()
    def finish_early(self) -> None:
        """Jump to the final masks now: for a run stopped (time budget, ``max_steps``) before
        ``end_fraction``. Scores are the weights' magnitudes (no step's statistics are at hand), already
        pruned weights stay pruned, and the masks are frozen, so the saved model is still exactly the
        final N:M the compression stage packs -- one-shot for the last levels, without the recovery
        training the schedule would have given them (the summary records ``finished_early``)."""
        if self.frozen:
            return
        from adbatch.compress.sparsity import nm_mask

        scores = {name: mod.weight.detach().float().abs() for name, mod in self.layers.items()}
        if not self._one_four_decided:
            self._decide_one_four(scores)
        for name, mod in self.layers.items():
            n = self.final_n[name]
            self.current_n[name] = n
            if n >= M:
                self.masks.pop(name, None)
                continue
            if name in self.masks:  # |w| of a pruned weight is 0, but ties among zeros must not revive one
                scores[name] = scores[name] * self.masks[name] + self.masks[name].float() * 1e-30
            self.masks[name] = nm_mask(scores[name], n, M).to(mod.weight.device)
        self.after_optimizer_step()
        self.frozen = self.finished_early = True
        log.warning("progressive sparsity: the run stopped before the masks were final; finished them one-shot "
                    "by magnitude (density %.3f)", self.density())

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Zero every masked weight (AdamW's decoupled update may have moved it)."""
        for name, mask in self.masks.items():
            self.layers[name].weight.mul_(mask)

    def density(self) -> float:
        """Kept share of the prunable weights under the current masks."""
        kept = total = 0
        for name, mod in self.layers.items():
            numel = mod.weight.numel()
            total += numel
            kept += int(self.masks[name].sum()) if name in self.masks else numel
        return kept / max(total, 1)

    def summary(self) -> dict[str, Any]:
        return {"density": self.density(), "frozen": self.frozen, "finished_early": self.finished_early,
                "patterns": {name: f"{self.current_n[name]}:{M}" for name in self.layers}}
