"""The training loop: teach a causal LM the ad index (DSI), optionally with progressive N:M sparsity.

A plain torch loop, so the same function runs in a notebook, in one process on a GPU, and inside
Ray Train workers (``pipelines/train.py`` passes ``rank``/``world_size`` and torch.distributed is
already initialised there):

- AdamW (decoupled weight decay, no decay on norms/biases/embeddings), linear warmup then cosine
  decay to ``min_lr_ratio`` of the peak learning rate, gradient clipping, gradient accumulation;
- micro-batches bounded by a token budget (``batch_tokens`` = padded batch × length), grouped by
  length so padding stays small;
- bf16 autocast on CUDA (weights and optimizer state stay fp32), fp32 on CPU;
- the LM head is applied only at target positions (the loss is on target tokens only), which
  avoids materialising ``[B, L, vocab]`` logits for prompt tokens — most of a batch;
- optional model selection on a validation metric (``eval_every`` epochs, a caller-supplied
  ``evaluate(model) -> float``, higher is better): the best weights seen are restored at the end
  (a DSI model over-fits its train pairs long before the loss stops falling, so the last step is
  rarely the best one), with optional early stopping after ``early_stop_patience`` evaluations
  without improvement. With progressive sparsity only evaluations after the masks froze compete,
  so the restored weights are exactly N:M; with QAT only those after it started;
- optional quantization-aware final phase (``qat``, :mod:`adbatch.training.quant_aware`): the
  prunable linears compute with their INT4 weights (straight-through gradient) from
  ``qat.start_fraction`` of the steps on;
- optional distillation (``distill``, :mod:`adbatch.training.distill`) from a frozen copy of the
  starting model, for sparsifying a model already trained on the index.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from adbatch.config import ConfigBase, ConfigError
from adbatch.training.data import ExampleKind, TrainingExamples, collate, repeat_kinds, token_budget_batches
from adbatch.training.distill import DistillConfig, distill_loss
from adbatch.training.pseudo_queries import PseudoQueryConfig
from adbatch.training.rehearsal import CreativeRehearsalConfig
from adbatch.training.quant_aware import QuantAwareConfig, QuantAwareTraining
from adbatch.training.sparsity import ProgressiveSparsity, SparsityScheduleConfig, unwrap_ddp

log = logging.getLogger(__name__)

#: dense bf16 peak of one H200 (NVIDIA spec sheet, no sparsity), the MFU denominator on CUDA
H200_BF16_PEAK_FLOPS = 989e12

#: what ``valid_metric`` may name: the metrics :func:`adbatch.targeting_eval.validation_metric` reports
#: (``evaluate_targeting`` at its default ks 1 and 10)
VALID_METRICS = tuple(f"{m}@{k}" for m in ("recall", "success", "mrr", "ndcg") for k in (1, 10))


@dataclass
class TrainConfig(ConfigBase):
    """Knobs of one training run (stored in the checkpoint's adbatch_training.json)."""

    # epochs / lr / batch_tokens / retrieval_repeat: the best measured GPU recipe on Home Depot with 24
    # pseudo-queries per ad (bench/results/train.md rounds 3-4: lr 5e-4 beat 1e-3; validation recall@10 0.596
    # at 6 epochs vs 0.580 at 8, test 0.575 vs 0.590 - inside the noise of 298 queries, so the cheaper one)
    epochs: float = field(default=6.0, metadata={"help": "passes over the examples (fractions allowed)"})
    lr: float = field(default=5e-4, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.05, metadata={"help": "final LR as a share of the peak (cosine)"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "share of steps of linear warmup"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW decoupled weight decay (matrices only)"})
    batch_tokens: int = field(default=32768, metadata={"help": "padded tokens per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (0 = off)"})
    indexing: bool = field(default=True, metadata={"help": "train ad text -> target (every ad)"})
    retrieval: bool = field(default=True, metadata={"help": "train labelled query -> target of a relevant ad"})
    indexing_repeat: int = field(default=1, metadata={"help": "copies of each indexing example per epoch"})
    retrieval_repeat: int = field(default=4, metadata={
        "help": "copies of each labelled-query example per epoch (real queries are ~4% of the examples "
                "next to 24 pseudo-queries per ad; test queries look like them, not like title spans)"})
    append_eos: bool = field(default=False, metadata={"help": "append EOS to every target"})
    max_query_tokens: int = field(default=48, metadata={"help": "query truncation inside the prompt"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast on CUDA"})
    max_steps: int | None = field(default=None, metadata={"help": "cap on optimizer steps (None = from epochs)"})
    time_budget_s: float | None = field(default=None, metadata={"help": "stop after this many seconds (the schedule is not shortened)"})
    seed: int = field(default=0, metadata={"help": "seed of shuffling and init noise"})
    log_every: int = field(default=50, metadata={"help": "log every this many steps"})
    sparsity: SparsityScheduleConfig = field(default_factory=SparsityScheduleConfig,
                                             metadata={"help": "progressive N:M sparsity"})
    pseudo_queries: PseudoQueryConfig = field(default_factory=PseudoQueryConfig,
                                              metadata={"help": "span pseudo-queries of every ad"})
    qat: QuantAwareConfig = field(default_factory=QuantAwareConfig,
                                  metadata={"help": "quantization-aware final phase (INT4 fake-quant, STE)"})
    distill: DistillConfig = field(default_factory=DistillConfig,
                                   metadata={"help": "distil from a frozen copy of the starting model"})
    creative_rehearsal: CreativeRehearsalConfig = field(default_factory=CreativeRehearsalConfig, metadata={
        "help": "mix creative examples (the starting model's own headlines) into training"})
    eval_every: float = field(default=0.0, metadata={
        "help": "epochs between validation evaluations (0 = none; needs an evaluate callback)"})
    valid_metric: str = field(default="recall@10", metadata={
        "help": "validation metric of generative targeting used for model selection"})
    valid_max_queries: int | None = field(default=256, metadata={
        "help": "validation queries per evaluation (sorted, first N; None = all)"})
    early_stop_patience: int = field(default=0, metadata={
        "help": "stop after this many evaluations without improvement (0 = never)"})

    def validate(self) -> None:
        positive = {"epochs": self.epochs, "lr": self.lr, "batch_tokens": self.batch_tokens,
                    "grad_accum": self.grad_accum, "indexing_repeat": self.indexing_repeat,
                    "retrieval_repeat": self.retrieval_repeat,
                    "log_every": self.log_every, "max_query_tokens": self.max_query_tokens}
        for name, value in positive.items():
            if not value > 0 or not math.isfinite(value):  # NaN compares False both ways
                raise ConfigError(f"TrainConfig.{name} must be finite and > 0, got {value}")
        for name in ("weight_decay", "max_grad_norm"):  # max_grad_norm 0 = no clipping
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise ConfigError(f"TrainConfig.{name} must be finite and >= 0, got {value}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ConfigError(f"TrainConfig.time_budget_s must be > 0 or None, got {self.time_budget_s}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ConfigError(f"TrainConfig.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.eval_every < 0 or self.early_stop_patience < 0:
            raise ConfigError("TrainConfig.eval_every and early_stop_patience must be >= 0")
        # checked here, not at the first evaluation (after a whole eval_every of training)
        if self.valid_metric not in VALID_METRICS:
            raise ConfigError(f"TrainConfig.valid_metric must be one of {list(VALID_METRICS)}, got {self.valid_metric!r}")
        if self.valid_max_queries is not None and self.valid_max_queries < 1:
            raise ConfigError(f"TrainConfig.valid_max_queries must be >= 1 or None, got {self.valid_max_queries}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"TrainConfig.max_steps must be >= 1 or None, got {self.max_steps}")
        if not (self.indexing or self.retrieval):
            raise ConfigError("TrainConfig: at least one of indexing / retrieval must be on")
        if self.qat.enabled and self.sparsity.enabled and self.qat.start_fraction < self.sparsity.end_fraction:
            # QAT quantizes the kept values of the *final* masks: they must be frozen first
            raise ConfigError(f"TrainConfig: qat.start_fraction ({self.qat.start_fraction}) must be >= "
                              f"sparsity.end_fraction ({self.sparsity.end_fraction})")


def lr_lambda(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at ``step``: linear warmup over ``warmup`` steps, then cosine."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def target_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  labels: torch.Tensor, target_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits ``[n, V]`` at the ``n`` target positions and their targets (int64 ``[n]``).

    ``input_ids``/``attention_mask``/``labels``: int64 ``[B, L]`` (labels -100 where no loss).
    ``target_index``: int64 ``[n]`` flat positions into ``[B, L-1]`` whose next token is a target
    (:attr:`adbatch.training.data.Batch.target_index`, computed on the host: no device sync here);
    derived from ``labels`` when None. Uses the decoder body + LM head at target positions only when
    the model exposes them (``get_decoder()`` / ``get_output_embeddings()``), else a plain forward
    (DDP must see the forward through its own wrapper so gradients are all-reduced).
    """
    core = unwrap_ddp(model)
    shift_labels = labels[:, 1:]
    if target_index is None:
        target_index = (shift_labels != -100).reshape(-1).nonzero().squeeze(1)
    targets = shift_labels.reshape(-1).index_select(0, target_index)
    decoder = core.get_decoder() if hasattr(core, "get_decoder") else None
    head = core.get_output_embeddings() if hasattr(core, "get_output_embeddings") else None
    if decoder is None or head is None or model is not core:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, L, V]
        return logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, target_index).float(), targets
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # [B, L, H]
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, target_index)  # [n, H]
    return head(h).float(), targets


def count_params(model: nn.Module) -> tuple[int, int]:
    """(non-embedding parameters, embedding rows × width) — the MFU model's two terms."""
    core = unwrap_ddp(model)
    emb = core.get_input_embeddings().weight.numel() if hasattr(core, "get_input_embeddings") else 0
    total = sum(p.numel() for p in core.parameters())
    return total - emb, emb


@dataclass
class TrainStats:
    steps: int = 0
    micro_batches: int = 0
    tokens: int = 0
    target_tokens: int = 0
    seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)
    density: list[tuple[int, float]] = field(default_factory=list)
    stopped_early: bool = False
    sparsity: dict[str, Any] = field(default_factory=dict)
    micro_batches_per_epoch: int = 0
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, epoch, metric)
    best: dict[str, Any] = field(default_factory=dict)
    eval_seconds: float = 0.0  # validation time, excluded from ``seconds`` (and so from tokens/s)
    qat: dict[str, Any] | None = None  # QuantAwareTraining.summary() when QAT ran

    def summary(self, model: nn.Module, device: torch.device) -> dict[str, Any]:
        nonemb, emb = count_params(model)
        tok_s = self.tokens / self.seconds if self.seconds > 0 else 0.0
        flops = 6.0 * nonemb * self.tokens + 6.0 * emb * self.target_tokens
        out = {"steps": self.steps, "micro_batches": self.micro_batches, "tokens": self.tokens,
               "target_tokens": self.target_tokens, "seconds": round(self.seconds, 3),
               "tokens_per_s": round(tok_s, 1), "stopped_early": self.stopped_early,
               "epochs_done": round(self.micro_batches / max(1, self.micro_batches_per_epoch), 4),
               "seconds_per_epoch": round(self.seconds * self.micro_batches_per_epoch / max(1, self.micro_batches), 3),
               "first_loss": self.losses[0][1] if self.losses else None,
               "final_loss": self.losses[-1][1] if self.losses else None}
        if device.type == "cuda" and self.seconds > 0:
            out["mfu"] = round(flops / self.seconds / H200_BF16_PEAK_FLOPS, 4)
        if self.sparsity:
            out["sparsity_density"] = self.sparsity.get("density")
        if self.evals:
            out["evals"] = self.evals
            out["best"] = self.best
            out["eval_seconds"] = round(self.eval_seconds, 3)
        return out


class BestWeights:
    """Model selection on a validation metric: keeps a CPU copy of the best weights seen."""

    def __init__(self, evaluate: Callable[[nn.Module], float], patience: int) -> None:
        self.evaluate, self.patience = evaluate, patience
        self.metric = -math.inf
        self.step: int | None = None
        self.state: dict[str, torch.Tensor] | None = None
        self.since_best = 0

    def __call__(self, model: nn.Module, step: int, eligible: bool, autocast: bool, device: torch.device) -> float:
        core = unwrap_ddp(model)
        core.eval()
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            metric = float(self.evaluate(core))
        core.train()
        if eligible:
            if metric > self.metric:
                self.metric, self.step, self.since_best = metric, step, 0
                self.state = {k: v.detach().to("cpu", copy=True) for k, v in core.state_dict().items()}
            else:
                self.since_best += 1
        return metric

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.since_best >= self.patience

    def restore(self, model: nn.Module) -> None:
        core = unwrap_ddp(model)
        if self.state is not None:
            core.load_state_dict(self.state)


def train_loop(
    model: nn.Module,
    examples: TrainingExamples,
    config: TrainConfig,
    *,
    pad_id: int,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    on_step: Callable[[int, float], None] | None = None,
    evaluate: Callable[[nn.Module], float] | None = None,
    progress: bool = True,
    teacher: nn.Module | None = None,
) -> tuple[TrainStats, ProgressiveSparsity | None]:
    """Train ``model`` in place on ``examples`` (prompt tokens masked out of the loss).

    ``teacher``: a frozen model (same vocabulary, on ``device``) whose target-position distributions
    the loss also matches, as ``config.distill`` says (:mod:`adbatch.training.distill`); required when
    ``config.distill.enabled``.

    ``evaluate(model) -> float`` (higher is better; run under ``no_grad`` in eval mode, bf16
    autocast on CUDA) is called every ``config.eval_every`` epochs and after the last step when
    ``eval_every > 0``; the best eligible weights are restored before returning. Under DDP every
    rank evaluates (the callback must be deterministic so all ranks agree).

    Under torch.distributed (``world_size > 1``) pass the DDP-wrapped model; each rank takes every
    ``world_size``-th micro-batch of the same seeded order. Returns the stats and, when enabled,
    the sparsity driver (its masks are final and applied to the weights).
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(config.seed)
    examples = repeat_kinds(examples, {ExampleKind.INDEXING: config.indexing_repeat,
                                       ExampleKind.RETRIEVAL: config.retrieval_repeat,
                                       ExampleKind.CREATIVE: config.creative_rehearsal.repeat})
    lengths = examples.lengths
    per_epoch = len(token_budget_batches(lengths, config.batch_tokens, gen, shuffle=False)) // world_size
    if per_epoch == 0:
        raise ValueError(f"{len(examples)} examples give no micro-batch per rank for world_size={world_size}")
    total_micro = max(1, round(per_epoch * config.epochs))
    total_steps = math.ceil(total_micro / config.grad_accum)
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
        total_micro = min(total_micro, total_steps * config.grad_accum)
    warmup = round(config.warmup_fraction * total_steps)

    model.train()
    opt = make_optimizer(model, config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total_steps, warmup, config.min_lr_ratio))
    sparsity = ProgressiveSparsity(model, config.sparsity, total_steps) if config.sparsity.enabled else None
    qat = None
    if config.qat.enabled:  # never before the masks froze (tiny runs can round the two starts together)
        qat = QuantAwareTraining(model, config.qat, total_steps, config.sparsity.skip_modules,
                                 not_before=sparsity.end if sparsity is not None else 0)
    autocast = device.type == "cuda" and config.bf16
    if config.distill.enabled != (teacher is not None):
        raise ValueError("TrainConfig.distill is enabled but no teacher model was given" if teacher is None
                         else "a teacher model was given but TrainConfig.distill is not enabled")
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    stats = TrainStats(micro_batches_per_epoch=per_epoch)
    selector = BestWeights(evaluate, config.early_stop_patience) if evaluate is not None and config.eval_every > 0 else None
    eval_steps = max(1, round(config.eval_every * per_epoch / config.grad_accum)) if selector is not None else 0

    def micro_batches():
        while True:
            batches = token_budget_batches(lengths, config.batch_tokens, gen, shuffle=True)
            usable = len(batches) // world_size * world_size
            yield from batches[rank:usable:world_size]

    batch_iter = micro_batches()
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, desc="train", unit="step")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss_acc = torch.zeros((), device=device)
    for step in range(total_steps):
        if qat is not None:
            qat.maybe_attach(step, sparsity.masks if sparsity is not None else None)
        want_stats = sparsity is not None and sparsity.wants_stats(step)
        if want_stats:
            sparsity.start_stats()
        loss_acc.zero_()
        for _ in range(config.grad_accum):
            idx = next(batch_iter)
            batch = collate(examples, idx, pad_id).to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                logits, targets = target_logits(model, batch.input_ids, batch.attention_mask, batch.labels,
                                                batch.target_index)
                if teacher is not None:
                    with torch.no_grad():
                        t_logits, _ = target_logits(teacher, batch.input_ids, batch.attention_mask, batch.labels,
                                                    batch.target_index)
                    loss = distill_loss(logits, t_logits, targets, config.distill)
                else:
                    loss = nn.functional.cross_entropy(logits, targets)
                n_tgt = int(targets.numel())
            (loss / config.grad_accum).backward()
            loss_acc += loss.detach() / config.grad_accum
            stats.micro_batches += 1
            stats.tokens += batch.num_tokens
            stats.target_tokens += n_tgt
        if sparsity is not None:
            sparsity.before_optimizer_step(step)
        if config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if sparsity is not None:
            sparsity.after_optimizer_step()
        stats.steps = step + 1
        if step % config.log_every == 0 or step == total_steps - 1:
            value = float(loss_acc)  # one sync per logged step only
            stats.losses.append((step, value))
            if sparsity is not None:
                stats.density.append((step, sparsity.density()))
            if on_step is not None:
                on_step(step, value)
            log.debug("step %d loss %.4f lr %.2e", step, value, sched.get_last_lr()[0])
            if bar is not None:
                bar.set_postfix(loss=f"{value:.3f}")
        if bar is not None:
            bar.update(1)
        last = step == total_steps - 1
        if selector is not None and ((step + 1) % eval_steps == 0 or last):
            # only weights trained under the final masks / the INT4 grid compete (both when on)
            eligible = (sparsity is None or sparsity.frozen) and (qat is None or qat.active)
            t_eval = time.perf_counter()
            metric = selector(model, step, eligible, autocast, device)
            stats.eval_seconds += time.perf_counter() - t_eval
            stats.evals.append((step, round(stats.micro_batches / per_epoch, 3), metric))
            log.info("step %d (epoch %.2f): validation %.4f%s", step, stats.micro_batches / per_epoch, metric,
                     "" if eligible else " (masks not frozen / QAT not started: not eligible)")
            if selector.should_stop and not last:
                stats.stopped_early = True
                log.info("early stop: %d evaluations without improvement", selector.patience)
                break
        if config.time_budget_s is not None and time.perf_counter() - t0 > config.time_budget_s:  # wall, evals included
            stats.stopped_early = step + 1 < total_steps
            if stats.stopped_early:
                log.warning("time budget %.0f s reached after %d of %d steps", config.time_budget_s, step + 1, total_steps)
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds = time.perf_counter() - t0 - stats.eval_seconds
    if bar is not None:
        bar.close()
    if selector is not None and selector.state is not None:
        if selector.step != stats.steps - 1:
            log.info("restoring the weights of step %d (validation %.4f)", selector.step, selector.metric)
            selector.restore(model)
        stats.best = {"step": selector.step, "metric": selector.metric}
    if sparsity is not None:
        if not sparsity.frozen:  # a time budget / max_steps cut the schedule short: still leave exact masks
            log.warning("progressive sparsity did not reach its final masks (stopped at step %d)", stats.steps)
            sparsity.finish_early()
        stats.sparsity = sparsity.summary()
    if qat is not None:  # plain forwards again: the caller saves / compresses the fp32 weights
        qat.detach()
        stats.qat = qat.summary()
        if stats.qat is None:
            log.warning("QAT never started (stopped at step %d, QAT start %d)", stats.steps, qat.start)
    model.eval()
    return stats, sparsity
