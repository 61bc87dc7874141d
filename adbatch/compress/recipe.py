"""Configs, enums and the per-layer recipe of the compression stage (JSON round-trip, no pickle).

:class:`CompressConfig` holds the knobs (what to do); :class:`CompressionRecipe` records what was
done to every layer (pattern, group sizes, importance, score summary) and is written as
``recipe.json`` inside the compressed checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

from adbatch.config import ConfigBase, ConfigError
from kernels.nm_int4 import GROUP_SIZES, SparsityPattern

__all__ = [
    "CalibrationConfig", "CalibrationMode", "CompressConfig", "CompressionRecipe", "GroupPolicy", "LayerRecipe",
    "PatternPolicy", "ScoreMethod", "SparsityPattern", "PATTERN_DENSITY", "follow_training_qat",
]

#: fraction of the weights of a layer kept by each pattern
PATTERN_DENSITY: dict[SparsityPattern, float] = {
    SparsityPattern.DENSE: 1.0, SparsityPattern.TWO_FOUR: 0.5, SparsityPattern.ONE_FOUR: 0.25,
}


class ScoreMethod(str, enum.Enum):
    """Element importance used to choose the kept weights of every group of 4."""

    MAGNITUDE = "magnitude"  #: |W_ij|
    WANDA = "wanda"  #: |W_ij| * ||X_j||_2
    PAPER = "paper"  #: |W_ij| * ||X_j||_2 + |W_ij| * |dE/dW_ij|  (DESIGN.md section 1)


class PatternPolicy(str, enum.Enum):
    """How each layer's N:M pattern is chosen."""

    NONE = "none"  #: every layer dense (INT4 only)
    UNIFORM = "uniform"  #: every layer gets ``uniform_pattern``
    INTERLEAVED = "interleaved"  #: importance-blind mix hitting ``target_density`` (ablation baseline)
    LAYER_ADAPTIVE = "layer_adaptive"  #: importance-driven mix hitting ``target_density``


class GroupPolicy(str, enum.Enum):
    """How each output row's INT4 group size is chosen."""

    UNIFORM = "uniform"  #: every row uses ``reference_group_size``
    ADAPTIVE = "adaptive"  #: per-row sizes from ``group_sizes`` at the bits of ``reference_group_size``


class CalibrationMode(str, enum.Enum):
    """How the calibration pass walks the model (both give the same statistics)."""

    FULL = "full"  #: whole model on the compute device, one forward + backward per batch
    LAYERWISE = "layerwise"  #: weights stay where loaded; decoder blocks visit the device one at a time
    AUTO = "auto"  #: layerwise when the full path's estimated memory exceeds ``auto_memory_fraction``
    #: of the compute device's free memory (CPU: MemAvailable), else full


@dataclasses.dataclass
class CalibrationConfig(ConfigBase):
    """Which texts go through the model to collect the statistics, and how many."""

    path: Path | None = dataclasses.field(default=None, metadata={
        "help": "calibration texts: a .txt file (one text per line) or a Parquet with a 'text' column "
                "(or 'title'/'description'); None = sample the bundled examples/slogan_ads.parquet"})
    num_texts: int = dataclasses.field(default=128, metadata={"help": "texts sampled for calibration"})
    seq_len: int = dataclasses.field(default=256, metadata={"help": "tokens per calibration sequence"})
    batch_size: int = dataclasses.field(default=4, metadata={"help": "sequences per forward/backward"})
    use_gradients: bool = dataclasses.field(default=True, metadata={
        "help": "backpropagate the LM loss to collect |dE/dW| and output-gradient moments"})
    seed: int = dataclasses.field(default=0, metadata={"help": "sampling seed"})
    mode: CalibrationMode = dataclasses.field(default=CalibrationMode.AUTO, metadata={
        "help": "full | layerwise | auto (layerwise when the full pass would need more than "
                "auto_memory_fraction of the device's free memory); same statistics either way"})
    device: str | None = dataclasses.field(default=None, metadata={
        "help": "compute device of the calibration pass (e.g. cuda, cuda:1, cpu); None = where the "
                "model's parameters are. The model is returned where it was"})
    auto_memory_fraction: float = dataclasses.field(default=0.5, metadata={
        "help": "mode=auto: largest share of the device's free memory the full pass may need"})

    def validate(self) -> None:
        for name in ("num_texts", "seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"CalibrationConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ConfigError(f"CalibrationConfig.seq_len must be >= 2 (a sequence of 1 token has no next-token "
                              f"loss, so every gradient statistic would be 0), got {self.seq_len}")
        if not 0.0 < self.auto_memory_fraction <= 1.0:
            raise ConfigError(f"CalibrationConfig.auto_memory_fraction must be in (0, 1], got {self.auto_memory_fraction}")
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"CalibrationConfig.device: {self.device!r} is not a torch device ({exc})") from exc


@dataclasses.dataclass
class CompressConfig(ConfigBase):
    """The compression knobs. Defaults = the measured best recipe: adaptive-group INT4 with a per-group
    clip search (uniform min/max groups of the training grid after QAT), no post-training sparsity (N:M
    comes from the masks a sparse training run saved, which are kept).

    Why not the paper's layer-adaptive 2:4/1:4 by default: on a model trained on the ad index (the
    ``adbatch train`` defaults, 5,000 Home Depot titles, H200, 2026-12-01) one-shot N:M destroys
    targeting: test recall@10 dense 0.579, INT4 only 0.513, layer-adaptive at density 0.75 0.292,
    uniform 2:4 0.068, layer-adaptive 2:4/1:4 at density 0.5 0.050 (bench/RESULTS.md "A trained model
    end to end"). ``pattern_policy=layer_adaptive`` still runs the paper's allocation.
    """

    score: ScoreMethod = dataclasses.field(default=ScoreMethod.PAPER, metadata={
        "help": "element score for N:M selection"})
    grad_weight: float = dataclasses.field(default=1.0, metadata={
        "help": "weight of the |W|*|dE/dW| term in the paper score (1.0 = the paper's formula)"})
    pattern_policy: PatternPolicy = dataclasses.field(default=PatternPolicy.NONE, metadata={
        "help": "how layers without a training mask get their N:M pattern: none (dense INT4, the measured "
                "best on a trained model) | uniform | interleaved | layer_adaptive (the paper's mix at "
                "target_density)"})
    uniform_pattern: SparsityPattern = dataclasses.field(default=SparsityPattern.TWO_FOUR, metadata={
        "help": "pattern of every layer when pattern_policy=uniform"})
    target_density: float = dataclasses.field(default=0.5, metadata={
        "help": "average fraction of weights kept (parameter-weighted) for the mixed policies"})
    allowed_patterns: tuple[SparsityPattern, ...] = dataclasses.field(
        default=(SparsityPattern.ONE_FOUR, SparsityPattern.TWO_FOUR, SparsityPattern.DENSE),
        metadata={"help": "patterns the mixed policies may assign"})
    group_policy: GroupPolicy = dataclasses.field(default=GroupPolicy.ADAPTIVE, metadata={
        "help": "INT4 group-size policy"})
    group_sizes: tuple[int, ...] = dataclasses.field(default=GROUP_SIZES, metadata={
        "help": "candidate group sizes (kept values per group)"})
    reference_group_size: int = dataclasses.field(default=128, metadata={
        "help": "uniform group size; the adaptive policy spends at most this size's bits per layer"})
    clip_search: bool = dataclasses.field(default=True, metadata={
        "help": "per INT4 group, search the range (0.5-1.0 x min/max) with the least sensitivity-weighted "
                "error instead of plain min/max (off when following a QAT model's grid)"})
    follow_training_qat: bool = dataclasses.field(default=True, metadata={
        "help": "when the model was trained with QAT at group size g (its training record says so) and "
                "group_policy/reference_group_size are left at their defaults, quantize with uniform "
                "groups of g, the grid training saw (false = always use group_policy as given)"})
    skip_modules: tuple[str, ...] = dataclasses.field(default=("lm_head",), metadata={
        "help": "linear modules (name suffixes) left dense in their original dtype"})
    dense_dtype: str = dataclasses.field(default="float16", metadata={
        "help": "dtype of the uncompressed tensors (embeddings, norms, lm_head) in the checkpoint"})
    shard_max_bytes: int = dataclasses.field(default=512 << 20, metadata={
        "help": "largest safetensors shard of packed layers"})

    def validate(self) -> None:
        if not 0.25 <= self.target_density <= 1.0:
            raise ConfigError(f"CompressConfig.target_density must be in [0.25, 1], got {self.target_density}")
        bad = [g for g in self.group_sizes if g not in GROUP_SIZES]
        if bad or not self.group_sizes:
            raise ConfigError(f"CompressConfig.group_sizes must be a non-empty subset of {GROUP_SIZES}, got {self.group_sizes}")
        if self.reference_group_size not in GROUP_SIZES:
            raise ConfigError(f"CompressConfig.reference_group_size must be in {GROUP_SIZES}, got {self.reference_group_size}")
        if not self.allowed_patterns:
            raise ConfigError("CompressConfig.allowed_patterns must not be empty")
        self.allowed_patterns = tuple(SparsityPattern(p) for p in self.allowed_patterns)
        self.group_sizes = tuple(sorted(int(g) for g in self.group_sizes))
        if self.group_policy is GroupPolicy.ADAPTIVE and max(self.group_sizes) < self.reference_group_size:
            raise ConfigError(f"CompressConfig.group_sizes={self.group_sizes}: the adaptive policy spends at most "
                              f"the bits of g{self.reference_group_size}, which no candidate size fits; include a "
                              f"size >= reference_group_size or lower reference_group_size")
        lowest = min(PATTERN_DENSITY[p] for p in self.allowed_patterns)
        if self.pattern_policy in (PatternPolicy.INTERLEAVED, PatternPolicy.LAYER_ADAPTIVE) and self.target_density < lowest:
            raise ConfigError(f"CompressConfig.target_density={self.target_density} is below the sparsest allowed pattern ({lowest})")
        if self.dense_dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(f"CompressConfig.dense_dtype must be float16, bfloat16 or float32, got {self.dense_dtype!r}")
        if self.grad_weight < 0:
            raise ConfigError(f"CompressConfig.grad_weight must be >= 0, got {self.grad_weight}")
        if self.shard_max_bytes <= 0:
            raise ConfigError("CompressConfig.shard_max_bytes must be > 0")

    @property
    def needs_activation_stats(self) -> bool:
        sparse = self.pattern_policy is not PatternPolicy.NONE
        return (sparse and self.score is not ScoreMethod.MAGNITUDE) or self.group_policy is GroupPolicy.ADAPTIVE \
            or self.pattern_policy is PatternPolicy.LAYER_ADAPTIVE

    @property
    def needs_gradients(self) -> bool:
        sparse = self.pattern_policy is not PatternPolicy.NONE
        return sparse and self.score is ScoreMethod.PAPER and self.grad_weight > 0


@dataclasses.dataclass
class LayerRecipe:
    """What was applied to one linear layer (one entry of ``recipe.json``)."""

    name: str
    out_features: int
    in_features: int
    pattern: SparsityPattern
    group_size_counts: dict[int, int]  #: group size -> number of rows using it
    bits_per_kept: float  #: INT4 value + scale/zero bits per kept value (positions excluded)
    packed_bytes: int
    importance: float | None  #: proxy loss increase per weight removed going 2:4 -> 1:4
    proxy_loss: dict[str, float]  #: pattern -> proxy loss increase of pruning this layer with it
    score_summary: dict[str, float]  #: magnitudes of the score terms (mean |W|*||X||, mean |W|*|G|)
    quant_error: float  #: sum of the sensitivity-weighted squared quantization error
    shard: str = ""
    packed_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pattern"] = self.pattern.value
        d["group_size_counts"] = {str(k): int(v) for k, v in self.group_size_counts.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerRecipe":
        d = dict(d)
        d["pattern"] = SparsityPattern(d["pattern"])
        d["group_size_counts"] = {int(k): int(v) for k, v in d["group_size_counts"].items()}
        return cls(**d)


@dataclasses.dataclass
class CompressionRecipe:
    """The config plus every layer's outcome; ``recipe.json`` in a compressed checkpoint."""

    config: CompressConfig
    layers: list[LayerRecipe]
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    tied_embeddings: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
            "calibration": self.calibration,
            "tied_embeddings": self.tied_embeddings,
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompressionRecipe":
        for key in ("config", "layers"):
            if key not in d:
                raise ValueError(f"recipe.json: missing field {key!r}")
        return cls(
            config=CompressConfig.from_dict(d["config"]),
            layers=[LayerRecipe.from_dict(x) for x in d["layers"]],
            calibration=dict(d.get("calibration", {})),
            tied_embeddings=bool(d.get("tied_embeddings", False)),
        )

    def layer(self, name: str) -> LayerRecipe:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer {name!r} in the recipe")

    def summary(self) -> dict[str, Any]:
        """Parameter-weighted density, bits per weight of the compressed linears, pattern counts."""
        params = sum(x.out_features * x.in_features for x in self.layers)
        if params == 0:
            return {"layers": 0}
        kept = sum(x.out_features * x.in_features * PATTERN_DENSITY[x.pattern] for x in self.layers)
        packed = sum(x.packed_bytes for x in self.layers)
        counts: dict[str, int] = {}
        for x in self.layers:
            counts[x.pattern.value] = counts.get(x.pattern.value, 0) + 1
        return {
            "layers": len(self.layers),
            "params": params,
            "density": kept / params,
            "packed_bytes": packed,
            "bits_per_weight": 8.0 * packed / params,
            "pattern_counts": counts,
        }


def follow_training_qat(config: CompressConfig, record: dict[str, Any] | None) -> tuple[CompressConfig, str | None]:
    """The config to compress a model with, given its training record (``adbatch_training.json``).

    A model trained with a quantization-aware final phase (record ``qat`` = ``{"group_size": g,
    "steps": s > 0, ...}``) learned weights that round well on the uniform g-group INT4 grid; the
    adaptive per-row choice would quantize them on another grid. Rule: the record's grid is used
    (``group_policy=uniform``, ``reference_group_size=g``, ``clip_search`` off) unless the user said otherwise, i.e.
    ``follow_training_qat`` is false or ``group_policy`` / ``reference_group_size`` differ from
    their defaults; an explicit config always wins. Returns ``(config to use, a log message or None
    when the record has no QAT)``.
    """
    qat = (record or {}).get("qat") or {}
    if not qat.get("steps"):
        return config, None
    g = int(qat["group_size"])
    default = CompressConfig()
    explicit = (config.group_policy is not default.group_policy
                or config.reference_group_size != default.reference_group_size)
    if not config.follow_training_qat or explicit:
        same = config.group_policy is GroupPolicy.UNIFORM and config.reference_group_size == g
        why = "follow_training_qat=false" if not config.follow_training_qat else "group policy set explicitly"
        return config, (f"model trained with QAT at INT4 group size {g}; {why}: keeping group_policy="
                        f"{config.group_policy.value}, reference_group_size={config.reference_group_size}"
                        + ("" if same else " (not the grid training saw)"))
    # the training forward saw plain min/max groups (adbatch.training.quant_aware.fake_quantize)
    return (config.replace(group_policy=GroupPolicy.UNIFORM, reference_group_size=g, clip_search=False),
            f"model trained with QAT at INT4 group size {g} ({qat['steps']} steps): quantizing with "
            f"uniform groups of {g}, plain min/max (the grid training saw) instead of {config.group_policy.value}"
            f"{' with clip search' if config.clip_search else ''}; set compress.follow_training_qat=false to keep it")
