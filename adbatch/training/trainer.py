"""The training loop: teach a causal LM the ad index (DSI), optionally with progressive N:M sparsity.

A plain torch loop, so the same function runs in a notebook, in one process on a GPU, and inside
Ray Train workers (``pipelines/train.py`` passes ``rank``/``world_size`` and torch.distributed is
already initialised there):

- AdamW (decoupled weight decay, no decay on norms/biases/embeddings), linear warmup then cosine
  decay to ``min_lr_ratio`` of the peak learning rate, gradient clipping, gradient accumulation;
- micro-batches of ``batch_tokens`` token slots: by default *packed* (``packing``: examples back
  to back in rows of ``pack_length`` tokens, positions restarting at 0 for every example and a
  block-diagonal causal mask, so no example attends to another and no slot is padding but a row's
  tail; every batch has the same shape), else length-grouped padded batches;
- ``torch.compile`` of each decoder layer on CUDA (``compile``; one compiled graph serves all
  layers); CPU stays eager;
- bf16 autocast on CUDA (weights and optimizer state stay fp32), fp32 on CPU;
- the LM head is applied only at target positions (the loss is on target tokens only), which
  avoids materialising ``[B, L, vocab]`` logits for prompt tokens — most of a batch — and there
  fused with the cross-entropy in chunks of ``ce_chunk_tokens`` target positions
  (:func:`adbatch.training.head_loss.linear_cross_entropy`: no ``[targets, vocab]`` fp32 logits kept for the backward);
- MFU the standard way (:meth:`TrainStats.summary`): ``6·N·tokens`` over the H200's dense bf16 peak;
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
  starting model, for sparsifying a model already trained on the index;
- optional rank-aware distillation from the dense teacher (``rank``, :mod:`adbatch.training.rank_loss`):
  from ``rank.start_fraction`` of the steps on, each step adds a listwise / margin loss over candidate
  groups (the teacher's top-k, the model's own beam outputs, the labelled ad).

Why one module of ~880 lines: the config, the loop, its statistics and the pieces of one step only the
loop uses (the packing probe, the batch loss, the regional compile, model selection) are read together
when the loop changes. The forward at target positions and the packed masks, which the rank loss uses
too, live in :mod:`adbatch.training.batch_forward` (re-exported here); the fused head loss, usable on its
own, in :mod:`adbatch.training.head_loss`.
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
from adbatch.models import eval_mode
from adbatch.training.batch_forward import (PackingUnsupported, fast_parts, model_inputs, packed_masks,
                                          target_hidden, target_logits)
from adbatch.training.data import (Batch, ExampleKind, TrainingExamples, collate, collate_packed,
                                   packed_batches, plan_examples, repeat_kinds, split_for_ranks, token_budget_batches)
from adbatch.training.distill import DistillConfig, distill_loss
from adbatch.training.head_loss import linear_cross_entropy
from adbatch.training.pseudo_queries import PseudoQueryConfig
from adbatch.training.query_tuning import QueryTuneConfig
from adbatch.training.rank_loss import RankLossConfig, RankLossMode
from adbatch.training.rehearsal import CreativeRehearsalConfig
from adbatch.training.quant_aware import QuantAwareConfig, QuantAwareTraining
from adbatch.training.sparsity import ProgressiveSparsity, SparsityScheduleConfig, unwrap_ddp

log = logging.getLogger(__name__)

#: dense bf16 peak of one H200 (NVIDIA spec sheet, no sparsity), the MFU denominator on CUDA
H200_BF16_PEAK_FLOPS = 989e12
#: what the summary names as that peak (``mfu_peak``)
MFU_PEAK_NAME = "H200 dense bf16"

#: what ``valid_metric`` may name: the metrics :func:`adbatch.eval.targeting.validation_metric` reports
#: (``evaluate_targeting`` at its default ks 1 and 10)
VALID_METRICS = tuple(f"{m}@{k}" for m in ("recall", "success", "mrr", "ndcg") for k in (1, 10))


@dataclass
class TrainConfig(ConfigBase):
    """Knobs of one training run (stored in the checkpoint's adbatch_training.json)."""

    # epochs / retrieval_repeat: the best measured GPU recipe on Home Depot with 24 pseudo-queries per ad
    # (bench/results/train.md rounds 3-4: validation recall@10 0.596 at 6 epochs vs 0.580 at 8, test 0.575 vs
    # 0.590 - inside the noise of 298 queries, so the cheaper one). batch_tokens / lr: 65,536 at lr 1e-3
    # trains the 6 epochs in 151.5 s vs 203.2 s at 32,768 / 5e-4 (H200, 5k check, 2026-12-04; 25.8 vs 19.3 %
    # MFU over the whole run) and tests the same within noise: served INT4 recall@10 0.577 vs 0.588, dense
    # 0.589 vs 0.545; 65,536 at lr 5e-4 (half the steps at the same rate) fell to 0.529 (bench/RESULTS.md)
    epochs: float = field(default=6.0, metadata={"help": "passes over the examples (fractions allowed)"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.05, metadata={"help": "final LR as a share of the peak (cosine)"})
    warmup_fraction: float = field(default=0.05, metadata={"help": "share of steps of linear warmup"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW decoupled weight decay (matrices only)"})
    batch_tokens: int = field(default=65536, metadata={
        "help": "token slots per micro-batch, padding included (packed: batch_tokens // pack_length rows)"})
    # packing / compile / ce_chunk_tokens change how a step is computed, not what it computes: an
    # epoch sees the same examples (which examples share a micro-batch differs), each example's loss
    # is its unpacked loss (tests/test_training_packing.py)
    packing: bool = field(default=True, metadata={
        "help": "pack examples into rows of pack_length tokens (positions restart per example, block-diagonal "
                "causal attention, no cross-example attention); off = length-grouped padded batches. A model "
                "whose attention cannot take the packed mask falls back to padded batches (logged, recorded)"})
    pack_length: int = field(default=256, metadata={
        "help": "tokens per packed row (a longer example widens every row to its length, rounded up to 8); "
                "attention costs O(pack_length) per token, so rows stay a few examples long"})
    compile: bool = field(default=True, metadata={
        "help": "torch.compile each decoder layer on CUDA (CPU always eager; not with progressive sparsity, whose "
                "hooks change the layers mid-run; with QAT re-compiled once at its start)"})
    ce_chunk_tokens: int = field(default=8192, metadata={
        "help": "target positions per chunk of the fused LM head + cross-entropy (peak fp32 logits "
                "ce_chunk_tokens x vocab; distillation and DDP use the plain head)"})
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
    time_budget_s: float | None = field(default=None, metadata={"help": "a ceiling on the loop's seconds: no step starts that "
                                                                     "would end past it, by the mean step so far (the "
                                                                     "schedule is not shortened)"})
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
    rank: RankLossConfig = field(default_factory=RankLossConfig, metadata={
        "help": "rank-aware distillation from the dense teacher in the last part of training"})
    creative_rehearsal: CreativeRehearsalConfig = field(default_factory=CreativeRehearsalConfig, metadata={
        "help": "mix creative examples (the starting model's own headlines) into training"})
    eval_every: float = field(default=0.0, metadata={
        "help": "epochs between validation evaluations (0 = none; needs an evaluate callback)"})
    query_tuning: QueryTuneConfig = field(default_factory=QueryTuneConfig, metadata={
        "help": "fine-tune the dense channel's query embedder on the labelled queries after training"})
    fusion_queries: int = field(default=256, metadata={
        "help": "validation queries (or, without labels, held-out pseudo-queries) the fusion of the generative "
                "and dense channels is fitted on after training (0 = none: generate falls back to RRF)"})
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
                    "log_every": self.log_every, "max_query_tokens": self.max_query_tokens,
                    "pack_length": self.pack_length, "ce_chunk_tokens": self.ce_chunk_tokens}
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
        if self.packing and self.batch_tokens < self.pack_length:
            raise ConfigError(f"TrainConfig.batch_tokens ({self.batch_tokens}) must be >= pack_length "
                              f"({self.pack_length}) when packing (a micro-batch holds whole rows)")
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


def check_packing(model: nn.Module, probe_len: int = 24) -> str | None:
    """Whether ``model`` computes a packed row exactly as its examples one by one; None = yes, else why not.

    Runs the decoder once on two short random examples packed into one row (plus a padding tail) and
    once on each alone, in fp32 without autocast, and compares the hidden states (a mask the model
    silently ignored or misread shows up here, whatever the transformers version). The examples are
    longer than a short sliding window, so a window the packed mask got wrong shows too.
    """
    core = unwrap_ddp(model)
    decoder = core.get_decoder() if hasattr(core, "get_decoder") else None
    if decoder is None:
        return "the model exposes no decoder body (get_decoder)"
    device = next(core.parameters()).device
    vocab = core.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    lens = (probe_len // 2 - 3, probe_len // 2 + 1)
    seqs = [torch.randint(0, min(vocab, 1000), (n,), generator=g) for n in lens]
    ids = torch.zeros(1, probe_len, dtype=torch.int64)
    ids[0, : sum(lens)] = torch.cat(seqs)
    pos = torch.cat([torch.arange(lens[0]), torch.arange(lens[1]), torch.arange(probe_len - sum(lens))])[None]
    seq = torch.cat([torch.zeros(lens[0]), torch.ones(lens[1]), torch.full((probe_len - sum(lens),), 2.0)])
    seq = seq.to(torch.int32)[None]
    try:
        with eval_mode(core), torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
            mask = packed_masks(core, seq.to(device))
            packed = decoder(input_ids=ids.to(device), attention_mask=mask, position_ids=pos.to(device),
                             use_cache=False).last_hidden_state[0]
            alone = torch.cat([decoder(input_ids=x[None].to(device), use_cache=False).last_hidden_state[0]
                               for x in seqs])
    except PackingUnsupported as exc:
        return str(exc)
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:  # a forward that refuses the mask
        return f"the packed forward failed: {type(exc).__name__}: {exc}"
    diff = float((packed[: sum(lens)] - alone).abs().max())
    scale = float(alone.abs().max())
    if not diff <= 1e-4 * max(1.0, scale):
        return f"packed hidden states differ from unpacked ones by {diff:.3g} (max |h| {scale:.3g})"
    return None


def batch_loss(model: nn.Module, batch: Batch, config: TrainConfig, teacher: nn.Module | None = None,
               compiled: bool = False) -> tuple[torch.Tensor, int]:
    """The micro-batch's loss (float32 scalar) and its number of target tokens.

    Plain model, no teacher, bias-free head: the fused chunked LM head + cross-entropy
    (:func:`linear_cross_entropy`, its softmax math compiled when ``compiled``); otherwise the head's
    logits and ``cross_entropy`` / :func:`adbatch.training.distill.distill_loss`.
    """
    core = unwrap_ddp(model)
    kw = model_inputs(core, batch)
    args = (kw["input_ids"], kw["attention_mask"], batch.labels, batch.target_index, kw.get("position_ids"))
    parts = fast_parts(model)
    n_tgt = int(batch.target_index.numel())
    if teacher is None and parts is not None and getattr(parts[1], "bias", None) is None:
        h, targets, head = target_hidden(model, *args)
        return linear_cross_entropy(h, head.weight, targets, config.ce_chunk_tokens, compiled=compiled), n_tgt
    logits, targets = target_logits(model, *args)
    if teacher is None:
        return nn.functional.cross_entropy(logits, targets), n_tgt
    with torch.no_grad():
        t_kw = model_inputs(unwrap_ddp(teacher), batch)
        t_logits, _ = target_logits(teacher, t_kw["input_ids"], t_kw["attention_mask"], batch.labels,
                                    batch.target_index, t_kw.get("position_ids"))
    return distill_loss(logits, t_logits, targets, config.distill), n_tgt


def count_params(model: nn.Module) -> tuple[int, int]:
    """(body parameters, LM-head parameters) — the MFU model's two terms.

    Body = every parameter but the input embedding table (a lookup, no matmul) and the LM head; it
    does ``2·N`` FLOPs forward per real token. The LM head (``V × H``, the same tensor as the input
    embeddings when they are tied) is counted as it is executed: only at target positions.
    """
    core = unwrap_ddp(model)
    total = sum(p.numel() for p in core.parameters())  # a tied weight is listed once
    emb = core.get_input_embeddings().weight if hasattr(core, "get_input_embeddings") else None
    out = core.get_output_embeddings() if hasattr(core, "get_output_embeddings") else None
    head = out.weight if out is not None else emb
    if emb is None or head is None:
        return total, 0
    body = total - emb.numel() - (0 if head is emb else head.numel())
    return body, head.numel()


@dataclass
class TrainStats:
    steps: int = 0
    micro_batches: int = 0
    tokens: int = 0  # real (non-pad) tokens
    padded_tokens: int = 0  # token slots computed, padding included
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
    rank: dict[str, Any] | None = None  # the rank phase (adbatch.training.rank_loss) when it ran
    packing: dict[str, Any] = field(default_factory=dict)  # enabled, row_tokens, rows, fallback reason
    compiled: bool = False
    examples: int = 0  # examples trained on (an example repeated in an epoch, or in several epochs, counts each time)
    world_size: int = 1
    # the counters summed over the ranks (seconds: the slowest rank's); None under a world size > 1 without
    # torch.distributed (ranks run apart, e.g. a test)
    all_ranks: dict[str, Any] | None = None

    def summary(self, model: nn.Module, device: torch.device) -> dict[str, Any]:
        """The run's numbers. MFU = model FLOPs / seconds / peak with model FLOPs
        ``6 · body · tokens + 6 · head · target_tokens`` (:func:`count_params`: the body's matmuls at
        every real token, the LM head's only at target positions where it runs; real tokens only, so
        padding is not credited; attention's ``L²`` terms are not counted, as in the usual 6·N·D) and
        peak = one H200's dense bf16 989 TFLOP/s (``mfu_peak_tflops``), reported on CUDA only.

        The counters and rates are this rank's; ``*_all_ranks`` (examples, tokens, target tokens,
        micro-batches and tokens/s over the slowest rank's seconds) are the whole job's."""
        body, head = count_params(model)
        tok_s = self.tokens / self.seconds if self.seconds > 0 else 0.0
        flops = 6.0 * body * self.tokens + 6.0 * head * self.target_tokens
        slots = max(self.padded_tokens, self.tokens)
        out = {"steps": self.steps, "micro_batches": self.micro_batches, "tokens": self.tokens,
               "padded_tokens": slots, "padded_share": round(1.0 - self.tokens / slots, 4) if slots else 0.0,
               "target_tokens": self.target_tokens, "seconds": round(self.seconds, 3),
               "tokens_per_s": round(tok_s, 1),
               "padded_tokens_per_s": round(slots / self.seconds, 1) if self.seconds > 0 else 0.0,
               "packing": self.packing, "compiled": self.compiled,
               "mfu_params": {"body": body, "lm_head": head}, "model_flops": flops,
               "stopped_early": self.stopped_early, "examples": self.examples, "world_size": self.world_size,
               "epochs_done": round(self.micro_batches / max(1, self.micro_batches_per_epoch), 4),
               "seconds_per_epoch": round(self.seconds * self.micro_batches_per_epoch / max(1, self.micro_batches), 3),
               "first_loss": self.losses[0][1] if self.losses else None,
               "final_loss": self.losses[-1][1] if self.losses else None}
        if device.type == "cuda" and self.seconds > 0:
            out["mfu"] = round(flops / self.seconds / H200_BF16_PEAK_FLOPS, 4)
            out["mfu_peak"] = MFU_PEAK_NAME
            out["mfu_peak_tflops"] = H200_BF16_PEAK_FLOPS / 1e12
        if self.all_ranks is not None:
            out.update({f"{k}_all_ranks": v for k, v in self.all_ranks.items()})
        if self.sparsity:
            out["sparsity_density"] = self.sparsity.get("density")
        if self.rank is not None:
            out["rank"] = self.rank
        if self.evals:
            out["evals"] = self.evals
            out["best"] = self.best
            out["eval_seconds"] = round(self.eval_seconds, 3)
        return out


class RegionalCompile:
    """``torch.compile`` of each decoder layer (the model's ``decoder.layers``; the whole decoder when
    it has none), switchable off and on.

    The layers share their code and dynamo lifts their parameters to graph inputs, so one compiled
    graph (forward + backward) serves all of them: compile time is one layer's, not the model's. The
    embedding, final norm, masks and the fused head + loss stay eager (the loss has a data-dependent
    number of target rows). ``off()`` restores the eager layers (evaluation decodes other shapes;
    the caller saves / decodes the model after training), ``on()`` the compiled ones. Uses
    ``nn.Module.compile``, which keeps the compiled callable in the module's ``_compiled_call_impl``.
    """

    def __init__(self, model: nn.Module, dynamic: bool | None, traces_qat: bool = False) -> None:
        self.dynamic, self.traces_qat = dynamic, traces_qat
        core = unwrap_ddp(model)
        decoder = core.get_decoder() if hasattr(core, "get_decoder") else core
        layers = getattr(decoder, "layers", None)
        self.modules: list[nn.Module] = list(layers) if isinstance(layers, nn.ModuleList) else [decoder]
        for m in self.modules:
            m.compile(dynamic=dynamic)
        self._compiled = [m._compiled_call_impl for m in self.modules]

    def off(self) -> None:
        for m in self.modules:
            m._compiled_call_impl = None

    def on(self) -> None:
        for m, c in zip(self.modules, self._compiled):
            m._compiled_call_impl = c


def pack_shape(lengths: torch.Tensor, config: TrainConfig) -> tuple[int, int]:
    """(rows, row_len) of every packed micro-batch: rows of ``pack_length`` tokens, widened to the
    longest example (rounded up to 8) when one is longer, and ``batch_tokens // row_len`` of them."""
    longest = int(lengths.max()) if lengths.numel() else 1
    row_len = max(config.pack_length, -(-longest // 8) * 8)
    if row_len > config.pack_length:
        log.warning("an example of %d tokens is longer than pack_length %d: packed rows of %d tokens",
                    longest, config.pack_length, row_len)
    return max(1, config.batch_tokens // row_len), row_len


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


class _RankPhase:
    """The rank phase of :func:`train_loop` (:mod:`adbatch.training.rank_loss`): when it starts, mining the beam
    negatives (then the candidate groups), and one rank micro-batch per optimizer step.

    Negatives are mined once at the phase's start by default: the phase is short (the last part of a run whose
    ids are already learned), the beams move little once the ids are known, and a mining is a beam search over
    every ranking query (seconds to a minute on the GPU for thousands of queries), which a refresh every few
    steps would repeat; ``refresh_every`` re-mines for longer phases. Loss values stay on the device (summed
    there; read at logged steps only). The listwise loss's learned student temperature
    (``rank.learn_student_temperature``) lives here with its own Adam: a scalar of the loss, not of the model, so
    it is never saved; :meth:`step` moves it."""

    def __init__(self, model: nn.Module, rq: Any, config: TrainConfig, total_steps: int, pad_id: int,
                 device: torch.device, autocast: bool) -> None:
        self.model, self.rq, self.cfg = model, rq, config.rank
        self.pad_id, self.device, self.autocast = pad_id, device, autocast
        self.start = min(total_steps - 1, round(self.cfg.start_fraction * total_steps))
        self.started: int | None = None
        self.groups: Any = None
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.order = torch.empty(0, dtype=torch.int64)
        self.cursor = 0
        self.mine_seconds, self.minings, self.steps, self.batch_slots = 0.0, 0, 0, 0
        self.total = torch.zeros((), device=device)
        self.last = torch.zeros((), device=device)
        self.group_stats: dict[str, Any] = {}
        self.losses: list[tuple[int, float]] = []  # (step, rank loss) at logged steps
        # the listwise loss's student temperature: log-parameterised, set from the first rank micro-batch, stepped
        # by its own Adam after the model's step; it belongs to the phase, never to the model (not saved)
        self.learn_tau = self.cfg.mode is RankLossMode.LISTWISE_KL and self.cfg.learn_student_temperature
        self.log_tau: torch.Tensor | None = None
        self.tau_opt: torch.optim.Optimizer | None = None
        self.tau_initial: float | None = None
        self.temperatures: list[tuple[int, float]] = []  # (step, student temperature) at logged steps

    @property
    def active(self) -> bool:
        return self.groups is not None

    def due(self, step: int, share: float | None) -> bool:
        """Whether to mine before ``step``: at the phase's start, then every ``refresh_every`` steps."""
        if self.started is None:
            return step >= self.start or (share is not None and share >= self.cfg.start_fraction)
        return self.cfg.refresh_every > 0 and (step - self.started) % self.cfg.refresh_every == 0

    def mine(self, step: int) -> None:
        from adbatch.training.rank_loss import build_groups, mine_beams

        t = time.perf_counter()
        # no autocast: the decoding engine runs in the model's own dtype (its KV cache is in that dtype, and
        # autocast's bf16 projections next to an fp32 cache fail in the attention kernel; H100, 2026-12-06)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, enabled=False):
            beams = mine_beams(unwrap_ddp(self.model), self.rq, self.cfg)  # eval mode inside, training restored
        self.groups = build_groups(self.rq, beams, self.cfg)
        self.group_stats = self.groups.stats
        self.order = torch.randperm(len(self.rq), generator=self.gen)
        self.cursor = 0
        if self.started is None:
            self.started = step
            log.info("rank phase from step %d: %d groups of %d slots (%.1f candidates, %.1f beam negatives each)",
                     step, len(self.rq), self.groups.rows.shape[1], self.group_stats["candidates_per_group"],
                     self.group_stats["beam_negatives_per_group"])
        self.minings += 1
        self.mine_seconds += time.perf_counter() - t

    def _picks(self) -> torch.Tensor:
        G = min(self.cfg.queries_per_step, len(self.rq))
        if self.cursor + G > len(self.order):  # a new shuffled pass over the groups
            self.order = torch.randperm(len(self.rq), generator=self.gen)
            self.cursor = 0
        picks = self.order[self.cursor:self.cursor + G]
        self.cursor += G
        return picks

    def loss(self) -> tuple[torch.Tensor, int]:
        """One rank micro-batch's loss (float32 scalar) and its real tokens."""
        from adbatch.training.rank_loss import group_loss, initial_student_temperature, rank_batch, sequence_logprobs

        picks = self._picks()
        batch, mask, teacher, pos, neg = rank_batch(self.groups, picks, self.pad_id)
        batch = batch.to(self.device)
        student = sequence_logprobs(self.model, batch, tuple(mask.shape), mask.to(self.device))  # [G, C]
        tau: torch.Tensor | float = 1.0
        if self.learn_tau:
            if self.log_tau is None:  # once: on the teacher's scale (one host sync)
                self.tau_initial = initial_student_temperature(student, teacher.to(self.device), mask.to(self.device))
                self.log_tau = torch.tensor(math.log(self.tau_initial), device=self.device, requires_grad=True)
                self.tau_opt = torch.optim.Adam([self.log_tau], lr=self.cfg.student_temperature_lr)
                log.info("rank phase: student temperature starts at %.3g", self.tau_initial)
            tau = self.log_tau.exp()
        loss = group_loss(student, mask, teacher, pos, neg, self.cfg, tau)
        self.last = loss.detach()
        self.total += self.last
        self.steps += 1
        self.batch_slots = batch.num_slots
        return loss, batch.num_tokens

    def step(self) -> None:
        """The student temperature's optimizer step (after the model's; its gradient came with the rank loss's
        backward). Not clipped with the model's gradients: one scalar under Adam moves at most ~lr per step."""
        if self.tau_opt is not None:
            self.tau_opt.step()
            self.tau_opt.zero_grad(set_to_none=True)

    def log(self, step: int) -> None:
        """Keep the last rank loss (and student temperature) at a logged step (a host sync, as the loop's own
        loss read there)."""
        self.losses.append((step, float(self.last)))
        if self.log_tau is not None:
            self.temperatures.append((step, round(math.exp(float(self.log_tau)), 5)))

    def summary(self) -> dict[str, Any]:
        out = {**self.rq.stats, **self.group_stats, "start_step": self.started, "planned_start": self.start,
               "steps": self.steps, "minings": self.minings, "mining_seconds": round(self.mine_seconds, 3),
               "mode": self.cfg.mode.value, "weight": self.cfg.weight}
        out["mean_loss"] = round(float(self.total) / self.steps, 5) if self.steps else None
        out["losses"] = self.losses
        if self.learn_tau:
            out["student_temperature"] = {"initial": self.tau_initial, "logged": self.temperatures,
                                          "final": math.exp(float(self.log_tau)) if self.log_tau is not None else None}
        return out


class _BudgetClock:
    """Seconds since the loop started, as every rank agrees on them (for ``time_budget_s``).

    One process reads its own clock every step. Under torch.distributed each rank's clock differs, and
    a rank that stopped on its own clock while the others ran on would leave them waiting in DDP's
    all-reduce forever (and QAT, which starts at a share of the budget, would start at different steps):
    rank 0's reading is broadcast every ``every`` steps (one collective and one host sync there, at the
    logged steps, which sync already) and the ranks use that reading until the next one, so they stop at
    the same step, at most ``every`` steps late."""

    def __init__(self, t0: float, world_size: int, device: torch.device, every: int) -> None:
        self.t0, self.world_size, self.device, self.every = t0, world_size, device, max(1, every)
        self.value = 0.0

    def elapsed(self, step: int) -> float:
        if self.world_size == 1:
            return time.perf_counter() - self.t0
        if step % self.every == 0:
            import torch.distributed as dist

            t = torch.tensor([time.perf_counter() - self.t0], dtype=torch.float64, device=self.device)
            if dist.is_available() and dist.is_initialized():
                dist.broadcast(t, src=0)
            self.value = float(t)
        return self.value

    def latest(self) -> float:
        """One process: now; several: the last agreed reading (no collective)."""
        return time.perf_counter() - self.t0 if self.world_size == 1 else self.value


def _all_ranks(stats: TrainStats, device: torch.device) -> dict[str, Any] | None:
    """The run's counters over all ranks: summed (seconds: the slowest rank's), one collective each for the
    counts and the time; this rank's own with one rank; None with several but no torch.distributed."""
    names = ("examples", "tokens", "target_tokens", "micro_batches")
    counts = [getattr(stats, n) for n in names]
    seconds = stats.seconds
    if stats.world_size > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        t = torch.tensor(counts, dtype=torch.int64, device=device)  # on the device: NCCL reduces CUDA tensors
        dist.all_reduce(t)
        s = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(s, op=dist.ReduceOp.MAX)
        counts, seconds = t.tolist(), float(s)
    out: dict[str, Any] = dict(zip(names, counts))
    out["tokens_per_s"] = round(out["tokens"] / seconds, 1) if seconds > 0 else 0.0
    return out


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
    rank_queries: Any = None,
) -> tuple[TrainStats, ProgressiveSparsity | None]:
    """Train ``model`` in place on ``examples`` (prompt tokens masked out of the loss).

    ``teacher``: a frozen model (same vocabulary, on ``device``) whose target-position distributions
    the loss also matches, as ``config.distill`` says (:mod:`adbatch.training.distill`); required when
    ``config.distill.enabled``.

    ``rank_queries``: the ranking queries and the dense teacher's view of them
    (:class:`adbatch.training.rank_loss.RankQueries`, :func:`~adbatch.training.rank_loss.rank_queries`);
    required when ``config.rank.enabled`` (one process only), which adds the rank phase's loss from
    ``config.rank.start_fraction`` of the steps (or of ``time_budget_s``, whichever comes first) on; its
    record is ``stats.rank``.

    ``evaluate(model) -> float`` (higher is better; run under ``no_grad`` in eval mode, bf16
    autocast on CUDA) is called every ``config.eval_every`` epochs and after the last step when
    ``eval_every > 0``; the best eligible weights are restored before returning. Under DDP every
    rank evaluates (the callback must be deterministic so all ranks agree).

    Under torch.distributed (``world_size > 1``) pass the DDP-wrapped model; each rank takes every
    ``world_size``-th micro-batch of the same seeded order, whose largest batches are cut so that their
    number divides by ``world_size`` (:func:`adbatch.training.data.split_for_ranks`): every example once
    per epoch across the ranks. The counters are summed over the ranks at the end (``all_ranks``).
    Returns the stats and, when enabled, the sparsity driver (its masks are final and applied to the weights).
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(config.seed)
    examples = repeat_kinds(examples, {ExampleKind.INDEXING: config.indexing_repeat,
                                       ExampleKind.RETRIEVAL: config.retrieval_repeat,
                                       ExampleKind.CREATIVE: config.creative_rehearsal.repeat})
    lengths = examples.lengths
    packing: dict[str, Any] = {"enabled": False}
    if config.packing:
        why_not = check_packing(model)
        if why_not is None:
            rows, row_len = pack_shape(lengths, config)
            packing = {"enabled": True, "rows": rows, "row_tokens": row_len}
        else:  # explicit: the model trains on padded batches, and the record says why
            log.warning("sequence packing is off for this model (%s): length-grouped padded batches", why_not)
            packing = {"enabled": False, "fallback": why_not}

    def epoch_batches(shuffle: bool) -> list[Any]:
        if packing["enabled"]:
            batches = packed_batches(lengths, packing["row_tokens"], packing["rows"], gen, shuffle=shuffle)
        else:
            batches = token_budget_batches(lengths, config.batch_tokens, gen, shuffle=shuffle)
        return split_for_ranks(batches, world_size) if world_size > 1 else batches

    def to_batch(plan: Any) -> Batch:
        if packing["enabled"]:
            return collate_packed(examples, plan, packing["rows"], packing["row_tokens"], pad_id)
        return collate(examples, plan, pad_id)

    per_epoch = len(epoch_batches(shuffle=False)) // world_size
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
    if config.rank.enabled != (rank_queries is not None):
        raise ValueError("TrainConfig.rank is enabled but no rank_queries were given" if rank_queries is None
                         else "rank_queries were given but TrainConfig.rank is not enabled")
    if rank_queries is not None and (world_size > 1 or fast_parts(model) is None):
        # the groups are mined and batched by one process; under DDP each rank would need its share of them
        # and the forward through DDP's wrapper (not done yet)
        raise ValueError("the rank loss runs in one process on a plain model (not under DDP)")
    ranking = _RankPhase(model, rank_queries, config, total_steps, pad_id, device, autocast) if rank_queries is not None else None
    stats = TrainStats(micro_batches_per_epoch=per_epoch, packing=packing, world_size=world_size)
    compiled = None
    if config.compile and device.type == "cuda":
        if sparsity is not None:
            log.info("torch.compile off: progressive sparsity's hooks and masks change the layers mid-run")
        else:  # packed batches all have one shape; padded ones vary (dynamic shapes then)
            compiled = RegionalCompile(model, dynamic=False if packing["enabled"] else None)
            stats.compiled = True
            log.info("torch.compile: %d decoder layers (%s shapes)%s", len(compiled.modules),
                     "static" if packing["enabled"] else "dynamic",
                     "; re-compiled with QAT's forward at its start" if qat is not None else "")
    compiled_ce = compiled is not None
    selector = BestWeights(evaluate, config.early_stop_patience) if evaluate is not None and config.eval_every > 0 else None
    eval_steps = max(1, round(config.eval_every * per_epoch / config.grad_accum)) if selector is not None else 0

    def micro_batches():
        while True:
            batches = epoch_batches(shuffle=True)
            usable = len(batches) // world_size * world_size  # short only with fewer examples than ranks
            for plan in batches[rank:usable:world_size]:
                stats.examples += plan_examples(plan)
                yield to_batch(plan)

    batch_iter = micro_batches()
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, desc="train", unit="step")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    clock = _BudgetClock(t0, world_size, device, config.log_every)
    loss_acc = torch.zeros((), device=device)
    for step in range(total_steps):
        elapsed = clock.elapsed(step) if config.time_budget_s is not None else 0.0
        if qat is not None:
            # with a time budget QAT also starts at start_fraction of the budget, so a run cut short by time
            # still ends on the INT4 grid (the masks must be final first; host clock only on one rank)
            share = (elapsed / config.time_budget_s
                     if config.time_budget_s is not None and (sparsity is None or sparsity.frozen) else None)
            qat.maybe_attach(step, sparsity.masks if sparsity is not None else None, share)
            if compiled is not None and qat.active and not compiled.traces_qat:
                # QAT switched the linears' class; the compiled layers traced the plain forward. A fresh
                # compile traces the fake-quantized one (fq(W) computed inside the graph): one more
                # compile of one layer, instead of an eager final phase at ~2-4x the step time
                compiled.off()
                compiled = RegionalCompile(model, dynamic=compiled.dynamic, traces_qat=True)
                log.info("torch.compile: decoder layers re-compiled at step %d with QAT's forward", step)
        want_stats = sparsity is not None and sparsity.wants_stats(step)
        if want_stats:
            sparsity.start_stats()
        if ranking is not None:
            share = elapsed / config.time_budget_s if config.time_budget_s is not None else None
            if ranking.due(step, share):  # mining decodes other shapes: eager layers meanwhile
                if compiled is not None:
                    compiled.off()
                ranking.mine(step)
                if compiled is not None:
                    compiled.on()
        loss_acc.zero_()
        for _ in range(config.grad_accum):
            batch = next(batch_iter).to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                loss, n_tgt = batch_loss(model, batch, config, teacher, compiled=compiled_ce)
            (loss / config.grad_accum).backward()
            loss_acc += loss.detach() / config.grad_accum
            stats.micro_batches += 1
            stats.tokens += batch.num_tokens
            stats.padded_tokens += batch.num_slots
            stats.target_tokens += n_tgt
        if ranking is not None and ranking.active:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                r_loss, r_tokens = ranking.loss()
            (config.rank.weight * r_loss).backward()  # next to the CE micro-batches' mean, weighted
            loss_acc += config.rank.weight * r_loss.detach()
            stats.tokens += r_tokens
            stats.padded_tokens += ranking.batch_slots
        if sparsity is not None:
            sparsity.before_optimizer_step(step)
        if config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if ranking is not None and ranking.active:
            ranking.step()
        if sparsity is not None:
            sparsity.after_optimizer_step()
        if qat is not None:
            qat.weights_updated()
        stats.steps = step + 1
        if step % config.log_every == 0 or step == total_steps - 1:
            value = float(loss_acc)  # one sync per logged step only
            stats.losses.append((step, value))
            if ranking is not None and ranking.active:
                ranking.log(step)
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
            if compiled is not None:  # decoding shapes would recompile the layers
                compiled.off()
            metric = selector(model, step, eligible, autocast, device)
            if compiled is not None:
                compiled.on()
            stats.eval_seconds += time.perf_counter() - t_eval
            stats.evals.append((step, round(stats.micro_batches / per_epoch, 3), metric))
            log.info("step %d (epoch %.2f): validation %.4f%s", step, stats.micro_batches / per_epoch, metric,
                     "" if eligible else " (masks not frozen / QAT not started: not eligible)")
            if selector.should_stop and not last:
                stats.stopped_early = True
                log.info("early stop: %d evaluations without improvement", selector.patience)
                break
        # the budget is a ceiling: no step starts that would end past it, by the mean step so far (wall, evals
        # included). Stopping only once past it overran by a whole step: 2-core CPU steps of 39 s ran the
        # example's 60 s budget to 78 s
        spent = clock.latest()
        if config.time_budget_s is not None and spent * (step + 2) / (step + 1) > config.time_budget_s:
            stats.stopped_early = step + 1 < total_steps
            if stats.stopped_early:
                log.warning("time budget %.0f s: stopping after %d of %d steps (%.0f s spent, the next would end past it)",
                            config.time_budget_s, step + 1, total_steps, spent)
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds = time.perf_counter() - t0 - stats.eval_seconds
    stats.all_ranks = _all_ranks(stats, device)
    if compiled is not None:  # the caller evaluates / saves / decodes an eager model
        compiled.off()
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
    if ranking is not None:
        stats.rank = ranking.summary()
    if qat is not None:  # plain forwards again: the caller saves / compresses the fp32 weights
        qat.detach()
        stats.qat = qat.summary()
        if stats.qat is None:
            log.warning("QAT never started (stopped at step %d, QAT start %d)", stats.steps, qat.start)
    model.eval()
    return stats, sparsity
