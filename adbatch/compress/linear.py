"""The module swap: ``compress_(model, config, stats)`` replaces ``nn.Linear`` by :class:`CompressedLinear`.

Work per layer is two pure functions of (weight, statistics, config) -- :func:`analyze_layer`
(scores -> proxy loss of 2:4 and 1:4, i.e. the layer importance) and :func:`compress_layer`
(mask -> INT4 with chosen group sizes -> packed) -- mapped over layers by a :class:`LayerExecutor`.
The library runs them in a loop (:class:`SequentialExecutor`); ``pipelines/compress.py`` runs the
same functions as Ray tasks, which is why they take plain tensors and return plain results. The math
runs on whatever device the inputs are on: ``SequentialExecutor(device="cuda")`` moves one layer at
a time there and its results back to CPU (same bytes layout; floating-point reductions may round
differently on the GPU, so the CPU path is the reference the Ray path is tested against).

Tied embeddings / lm_head: left dense (see docs/compress.md). The lm_head is tied to the input
embedding table in SmolLM2, so compressing it would either alter the embeddings or untie (store)
them twice; it is also the most quantization-sensitive matrix of small LMs, and the N:M kernel
targets the transformer-block GEMVs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from adbatch.compress.calibration import CalibrationStats, LayerStats, compressible_linears
from adbatch.compress.quantization import quantize_rows
from adbatch.compress.recipe import (
    CompressConfig, CompressionRecipe, LayerRecipe, PatternPolicy, ScoreMethod,
)
from adbatch.compress.sparsity import (
    LayerImportance, allocate_patterns, element_scores, interleaved_patterns, kept_positions, nm_mask,
    proxy_loss,
)
from kernels.nm_int4 import PackedNMInt4, SparsityPattern, pack_nm_int4, dequantize_nm_int4
from kernels.packed_linear import nm_int4_linear

log = logging.getLogger(__name__)

__all__ = ["CompressedLinear", "LayerInput", "LayerAnalysis", "LayerResult", "LayerExecutor",
           "SequentialExecutor", "analyze_layer", "compress_layer", "compress_", "densify_",
           "plan_patterns"]

M = 4


class CompressedLinear(nn.Module):
    """A linear layer holding a :class:`PackedNMInt4` weight (buffers, so ``.to(device)`` moves it).

    ``forward(x [..., K]) -> [..., N]`` calls :func:`kernels.packed_linear.nm_int4_linear`: Triton on CUDA,
    the pure-torch reference (unpack, dequantize, matmul) elsewhere.
    """

    PACKED_KEYS = ("qweight", "qpos", "scale_zero", "group_ptr", "group_shift")

    def __init__(self, packed: PackedNMInt4, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        for key, t in packed.state_dict().items():
            self.register_buffer(key, t)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.pattern = packed.pattern
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.kept = packed.kept

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the packed buffers, but a dtype cast (``model.float()``,
        ``model.to(torch.bfloat16)``) must not touch them: the format fixes fp16 ``scale_zero`` (and
        a round trip through bf16 would silently lose scale bits). The bias follows the cast."""
        before = {k: self._buffers[k] for k in self.PACKED_KEYS}
        super()._apply(fn, recurse)
        for k, old in before.items():
            new = self._buffers[k]
            if new is not None and new.dtype != old.dtype:
                self._buffers[k] = old.to(new.device)
        return self

    @property
    def packed(self) -> PackedNMInt4:
        """The packed weight over this module's buffers. One object is kept while the buffers are the
        same tensors: the CUDA kernel binds its launcher to the packed object (``id`` + weakref), so a
        fresh object per forward would re-bind on every call (host time per token); ``.to()`` /
        ``load_state_dict`` replace the buffers, which rebuilds it."""
        bufs = (self.qweight, self.qpos, self.scale_zero, self.group_ptr, self.group_shift)
        cached = self.__dict__.get("_packed_cache")
        if cached is not None and all(a is b for a, b in zip(cached[0], bufs)):
            return cached[1]
        packed = PackedNMInt4(
            qweight=self.qweight, qpos=self.qpos, scale_zero=self.scale_zero, group_ptr=self.group_ptr,
            group_shift=self.group_shift, pattern=self.pattern, in_features=self.in_features,
            out_features=self.out_features, kept=self.kept,
        )
        self.__dict__["_packed_cache"] = (bufs, packed)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nm_int4_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.pattern.value}"


@dataclass
class LayerInput:
    """What one layer's work needs: the weight [N, K] float32 (CPU), optional bias [N], statistics."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    stats: LayerStats | None
    #: a fixed N:M mask bool [N, K] (e.g. learned by progressive sparsity in training): kept as is
    mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "LayerInput":
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return LayerInput(name=self.name, weight=self.weight.to(device), bias=mv(self.bias),
                          stats=None if self.stats is None else self.stats.to(device), mask=mv(self.mask))


@dataclass
class LayerAnalysis:
    importance: LayerImportance
    score_summary: dict[str, float]


@dataclass
class LayerResult:
    name: str
    packed: PackedNMInt4
    bias: torch.Tensor | None
    recipe: LayerRecipe

    def to(self, device: torch.device | str) -> "LayerResult":
        return LayerResult(name=self.name, packed=self.packed.to(device),
                           bias=None if self.bias is None else self.bias.to(device), recipe=self.recipe)


class LayerExecutor(Protocol):
    """Maps a per-layer function over layers. ``put`` stores the inputs once (e.g. in Ray's object
    store); ``map(fn, handles, args)`` returns ``[fn(item_i, args_i)]`` in order."""

    def put(self, items: Sequence[LayerInput]) -> list[Any]: ...

    def map(self, fn: Callable[[LayerInput, Any], Any], handles: list[Any], args: list[Any], desc: str) -> list[Any]: ...


class SequentialExecutor:
    """The in-process loop (with a progress bar).

    ``device``: where the per-layer math runs. None = where the inputs are (CPU). Otherwise each
    layer's inputs are copied there just before its work and its :class:`LayerResult` copied back
    to CPU, so the device holds one layer at a time.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)

    def put(self, items: Sequence[LayerInput]) -> list[Any]:
        return list(items)

    def map(self, fn, handles, args, desc: str = "layers"):
        out = []
        for h, a in tqdm(list(zip(handles, args)), desc=desc, unit="layer", leave=False):
            if self.device is None:
                out.append(fn(h, a))
                continue
            res = fn(h.to(self.device), a)
            out.append(res.to("cpu") if isinstance(res, LayerResult) else res)
        return out


def _scores(item: LayerInput, config: CompressConfig) -> torch.Tensor:
    st = item.stats
    method = config.score
    if st is None and method is not ScoreMethod.MAGNITUDE:
        raise ValueError(f"layer {item.name}: score {method.value!r} needs calibration statistics")
    act_norm = st.act_norm if st is not None else None
    grad_abs = st.grad_abs if st is not None else None
    if method is ScoreMethod.PAPER and grad_abs is None:
        raise ValueError(f"layer {item.name}: the paper score needs gradients (calibration.use_gradients=true)")
    return element_scores(item.weight, act_norm, grad_abs, method, config.grad_weight)


def pattern_of_mask(name: str, mask: torch.Tensor) -> SparsityPattern:
    """The N:M pattern of a fixed mask bool ``[N, K]``; every group of 4 must keep the same n."""
    n_out, k_in = mask.shape
    if k_in % M:
        raise ValueError(f"mask of {name}: in_features {k_in} is not a multiple of {M}")
    kept = mask.reshape(n_out, k_in // M, M).sum(-1)
    n = int(kept.flatten()[0])
    if not bool((kept == n).all()):
        raise ValueError(f"mask of {name} is not N:{M}: groups keep {sorted(set(kept.unique().tolist()))} values")
    for pattern in SparsityPattern:
        if pattern.n == n:
            return pattern
    raise ValueError(f"mask of {name} keeps {n} of every {M}: no packed format for that pattern")


def _row_sums_total(t: torch.Tensor) -> float:
    """Sum of a [N, K] tensor that does not depend on torch's thread count: per-row float64 sums
    (one thread per row) added exactly. A whole-tensor ``.sum()`` / ``.mean()`` splits differently
    with 1 thread (a Ray worker) than with many (the driver), changing the last bits."""
    return math.fsum(t.sum(dim=1, dtype=torch.float64).tolist())


def _sparsifiable(item: LayerInput) -> bool:
    return item.weight.shape[1] % M == 0


def analyze_layer(item: LayerInput, config: CompressConfig) -> LayerAnalysis:
    """Proxy loss of pruning the layer with 2:4 and 1:4 (its importance) and a score summary."""
    n_out, k_in = item.weight.shape
    st = item.stats
    losses = {SparsityPattern.DENSE: 0.0}
    summary: dict[str, float] = {}
    if _sparsifiable(item):
        scores = _scores(item, config)
        col = st.col_moment if st is not None else torch.ones(k_in, device=item.weight.device)
        row = st.row_moment if st is not None else None
        for pattern in (SparsityPattern.TWO_FOUR, SparsityPattern.ONE_FOUR):
            losses[pattern] = proxy_loss(item.weight, nm_mask(scores, pattern.n), col, row)
    if st is not None:
        w = item.weight.float().abs()
        summary["mean_w_xnorm"] = _row_sums_total(w * st.act_norm.unsqueeze(0)) / w.numel()
        if st.grad_sq is not None:
            summary["mean_w_grad"] = _row_sums_total(w * st.grad_abs) / w.numel()
    imp = LayerImportance(name=item.name, params=n_out * k_in, proxy_loss=losses, sparsifiable=_sparsifiable(item))
    return LayerAnalysis(importance=imp, score_summary=summary)


def compress_layer(item: LayerInput, plan: tuple[SparsityPattern, CompressConfig]) -> LayerResult:
    """Mask (for a sparse pattern), quantize the kept values and pack one layer."""
    pattern, config = plan
    weight = item.weight.float()
    n_out, k_in = weight.shape
    if not torch.isfinite(weight).all():  # say which layer, not just that a packed scale went non-finite
        raise ValueError(f"layer {item.name}: weight has {int((~torch.isfinite(weight)).sum())} NaN/Inf values")
    st = item.stats
    if pattern.is_sparse:
        # a fixed mask has exactly n ones per group, so ranking it selects exactly its positions
        scores = item.mask.float() if item.mask is not None else _scores(item, config)
        pos = kept_positions(scores, pattern.n)  # uint8 [N, Kk]
        kk = torch.arange(pos.shape[1], device=pos.device)
        cols = (kk // pattern.n).unsqueeze(0) * M + pos.to(torch.int64)  # [N, Kk]
        values = weight.gather(1, cols)
    else:
        pos = None
        cols = torch.arange(k_in, device=weight.device).unsqueeze(0).expand(n_out, -1)
        values = weight
    sens = None
    if st is not None:
        sens = st.col_moment[cols]
        if st.row_moment is not None:
            sens = sens * st.row_moment.unsqueeze(1)
    qr = quantize_rows(values, sens, config.group_policy, config.group_sizes, config.reference_group_size,
                       config.clip_search)
    packed = pack_nm_int4(qr.q, pos, qr.scale, qr.zero, qr.group_size, pattern, k_in)
    counts = {int(g): int(c) for g, c in zip(*torch.unique(qr.group_size, return_counts=True))}
    recipe = LayerRecipe(
        name=item.name, out_features=n_out, in_features=k_in, pattern=pattern,
        group_size_counts=counts, bits_per_kept=qr.bits / max(qr.q.numel(), 1),
        packed_bytes=packed.nbytes(), importance=None, proxy_loss={}, score_summary={},
        quant_error=math.fsum(qr.error.tolist()), packed_metadata=dict(packed.metadata()),
    )
    return LayerResult(name=item.name, packed=packed, bias=item.bias, recipe=recipe)


def plan_patterns(analyses: list[LayerAnalysis], config: CompressConfig,
                  fixed: dict[str, SparsityPattern] | None = None) -> dict[str, SparsityPattern]:
    """Pattern per layer under ``config.pattern_policy``; layers in ``fixed`` keep their pattern
    (and, for the mixed policies, count against ``target_density`` at it)."""
    fixed = fixed or {}
    imps = [a.importance for a in analyses]
    policy = config.pattern_policy
    if policy is PatternPolicy.NONE:
        plan = {x.name: SparsityPattern.DENSE for x in imps}
    elif policy is PatternPolicy.UNIFORM:
        plan = {x.name: (config.uniform_pattern if x.sparsifiable else SparsityPattern.DENSE) for x in imps}
    elif policy is PatternPolicy.INTERLEAVED:
        plan = interleaved_patterns(imps, config.target_density, config.allowed_patterns, fixed)
    else:
        plan = allocate_patterns(imps, config.target_density, config.allowed_patterns, fixed)
    plan.update(fixed)
    return plan


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _needs_analysis(config: CompressConfig) -> bool:
    return config.pattern_policy in (PatternPolicy.LAYER_ADAPTIVE, PatternPolicy.INTERLEAVED)


def compress_(model: nn.Module, config: CompressConfig, stats: CalibrationStats | None = None,
              executor: LayerExecutor | None = None,
              masks: dict[str, torch.Tensor] | None = None) -> CompressionRecipe:
    """Compress every compressible ``nn.Linear`` of ``model`` in place (-> :class:`CompressedLinear`).

    Args:
        model: a causal LM; its linears are read on CPU in float32.
        config: :class:`CompressConfig`.
        stats: calibration statistics (required unless the config needs none: magnitude score or
            dense patterns, uniform groups).
        executor: where per-layer work runs (default: in-process loop).
        masks: fixed N:M masks bool ``[N, K]`` by layer name (the training stage's
            ``nm_masks.safetensors``): those layers keep their mask and its pattern; the pattern
            policy decides only the others.
    Returns: the :class:`CompressionRecipe` (per layer: pattern, group sizes, importance, bytes).
    """
    executor = executor or SequentialExecutor()
    linears = compressible_linears(model, config.skip_modules)
    if not linears:
        raise ValueError("model has no compressible nn.Linear layers")
    if stats is None and (config.needs_activation_stats or config.needs_gradients):
        raise ValueError("this CompressConfig needs calibration statistics (score/policy use them); pass stats=")
    if stats is not None:
        missing = [n for n in linears if n not in stats.layers]
        if missing:
            raise ValueError(f"calibration statistics missing for layers {missing[:5]} (+{max(len(missing) - 5, 0)})")
    items = [
        LayerInput(
            name=name, weight=m.weight.detach().to("cpu", torch.float32),
            bias=None if m.bias is None else m.bias.detach().to("cpu"),
            stats=None if stats is None else stats.layers[name],
            mask=None if masks is None or name not in masks else masks[name].to("cpu", torch.bool),
        )
        for name, m in linears.items()
    ]
    fixed: dict[str, SparsityPattern] = {}
    for item in items:
        if item.mask is not None:
            if tuple(item.mask.shape) != tuple(item.weight.shape):
                raise ValueError(f"mask of {item.name} has shape {tuple(item.mask.shape)}, "
                                 f"weight has {tuple(item.weight.shape)}")
            fixed[item.name] = pattern_of_mask(item.name, item.mask)
    unknown = sorted(set(masks or {}) - set(linears))
    if unknown:
        raise ValueError(f"masks given for layers the model does not compress: {unknown[:5]}")
    handles = executor.put(items)
    analyses: list[LayerAnalysis] | None = None
    if stats is not None or _needs_analysis(config):
        analyses = executor.map(analyze_layer, handles, [config] * len(items), "importance")
        plan = plan_patterns(analyses, config, fixed)
    else:
        plan = plan_patterns(
            [LayerAnalysis(LayerImportance(x.name, x.weight.numel(), {}, _sparsifiable(x)), {}) for x in items],
            config, fixed)
    results: list[LayerResult] = executor.map(
        compress_layer, handles, [(plan[x.name], config) for x in items], "quantize+pack")
    layers = []
    for i, res in enumerate(results):
        rec = res.recipe
        if analyses is not None:
            a = analyses[i]
            rec.importance = a.importance.importance
            rec.proxy_loss = {p.value: float(v) for p, v in a.importance.proxy_loss.items()}
            rec.score_summary = a.score_summary
        device = linears[res.name].weight.device
        _set_module(model, res.name, CompressedLinear(res.packed, res.bias).to(device))
        layers.append(rec)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    recipe = CompressionRecipe(config=config, layers=layers,
                               calibration={} if stats is None else dict(stats.info), tied_embeddings=tied)
    log.info("compressed %d layers: %s", len(layers), recipe.summary())
    return recipe


def densify_(model: nn.Module) -> int:
    """Replace every :class:`CompressedLinear` by an ``nn.Linear`` holding its dequantized weight
    (same values, faster repeated CPU evaluation). Returns the number of layers replaced."""
    names = [n for n, m in model.named_modules() if isinstance(m, CompressedLinear)]
    for name in names:
        cl = model.get_submodule(name)
        w = dequantize_nm_int4(cl.packed, torch.float32)
        lin = nn.Linear(cl.in_features, cl.out_features, bias=cl.bias is not None, device=w.device)
        with torch.no_grad():
            lin.weight.copy_(w)
            if cl.bias is not None:
                lin.bias.copy_(cl.bias)
        _set_module(model, name, lin)
    return len(names)
