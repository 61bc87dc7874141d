"""Warm start of the nightly training from the previous run's model.

A nightly index usually changes only partly (new ads, removed ads), so the model trained last night
already knows most of it. Measured on the H200 (bench/results/train.md, round 5: 5,000 Home Depot
titles, 10 % replaced for "night 2", `text` ids re-clustered): warm-started with a 3-epoch schedule,
the model passed the validation recall@10 that the 6-epoch cold run peaked at (0.562) after 679
steps, about half of the cold run's 1,364 steps to its peak, and tested 0.598 vs 0.576 cold. So a
warm run gets ``epochs_fraction`` (default 0.5) of the configured epochs.

:func:`plan_warm_start` decides from what is on disk; the nightly job applies the plan.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from adbatch.config import ConfigBase, ConfigError
from adbatch.training.checkpoint import read_training_record

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmStartConfig(ConfigBase):
    """When and how a training run starts from the previous run's model."""

    enabled: bool = dataclasses.field(default=True, metadata={
        "help": "start from the previous run's trained model when the index changed only partly"})
    min_overlap: float = dataclasses.field(default=0.5, metadata={
        "help": "share of today's ads the previous model was trained on, at least (else a cold start)"})
    epochs_fraction: float = dataclasses.field(default=0.5, metadata={
        "help": "a warm run trains this share of train.epochs (measured: half reached the cold peak)"})

    def validate(self) -> None:
        if not 0.0 < self.min_overlap <= 1.0:
            raise ConfigError(f"WarmStartConfig.min_overlap must be in (0, 1], got {self.min_overlap}")
        if not 0.0 < self.epochs_fraction <= 1.0:
            raise ConfigError(f"WarmStartConfig.epochs_fraction must be in (0, 1], got {self.epochs_fraction}")


@dataclasses.dataclass(frozen=True)
class IndexSnapshot:
    """What a warm-start decision needs of an index: its hash, scheme, ad ids and (``codes``) tokens."""

    index_hash: str
    ad_ids: frozenset
    scheme: str = "text"
    special_tokens: tuple = ()

    @staticmethod
    def read(index_dir: str | Path) -> "IndexSnapshot":
        """The snapshot of a finished index folder: its manifest and the ``ad_id`` column only (the
        decision needs neither the targets nor the trie)."""
        import pyarrow.parquet as pq

        from adbatch.artifacts import read_manifest, verify_outputs
        from adbatch.index.build import AD_CODES_FILE

        manifest = read_manifest(index_dir)
        if manifest.get("stage") != "index":
            raise ValueError(f"{index_dir}: manifest is for stage {manifest.get('stage')!r}, not index")
        # an index whose files do not match its manifest (e.g. one left by a build stopped mid-write
        # before writes were staged) must not pass for the index the manifest describes
        verify_outputs(index_dir, manifest, (AD_CODES_FILE,))
        ids = pq.read_table(Path(index_dir) / AD_CODES_FILE, columns=["ad_id"]).column("ad_id").to_pylist()
        return IndexSnapshot(manifest["index_hash"], frozenset(ids), str(manifest["scheme"]),
                             tuple(manifest.get("special_tokens", [])))

    @staticmethod
    def of(index_dir: str | Path) -> "IndexSnapshot | None":
        """:meth:`read`, or None when there is no readable index there (first run, or a folder left
        half-written by a crash: then no warm start is attempted)."""
        try:
            return IndexSnapshot.read(index_dir)
        except (FileNotFoundError, ValueError, KeyError, OSError, json.JSONDecodeError) as e:
            log.debug("no index snapshot of %s: %s", index_dir, e)
            return None


@dataclasses.dataclass(frozen=True)
class WarmStartPlan:
    """``init_model`` None = cold start from the base model; ``epochs`` the run's epochs either way."""

    init_model: str | None
    epochs: float
    reason: str
    overlap: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_warm_start(previous_model: str | Path | None, previous_index: IndexSnapshot | None,
                    today: IndexSnapshot, epochs: float, config: WarmStartConfig,
                    same_base_model: bool = True) -> WarmStartPlan:
    """Warm or cold, from the previous run's model folder and the index it was trained on.

    ``previous_index`` must be the snapshot of the index ``previous_model`` was trained on (its record's
    ``trained_on_index`` is checked against it, so a newer index left by a crashed run is not mistaken
    for it). ``today``: today's index (a ``codes`` model warm-starts only when its code tokens keep their
    ids, i.e. today's list starts with them: stable ids). ``same_base_model``: the caller's knowledge that
    the previous run started from the same base model (a different base = cold).
    """
    from adbatch.serving.prompts import TARGETING_PROMPT_VERSION

    def cold(reason: str, overlap: float | None = None) -> WarmStartPlan:
        return WarmStartPlan(None, epochs, reason, overlap)

    if not config.enabled:
        return cold("warm start disabled")
    if previous_model is None or not Path(previous_model).is_dir():
        return cold("no previous model")
    record = read_training_record(previous_model)
    if record is None:
        return cold(f"{previous_model} has no training record")
    if not same_base_model:
        return cold("the previous run is not known to have started from this base model")
    if record.get("targeting_prompt_version") != TARGETING_PROMPT_VERSION:
        return cold(f"the previous model was trained with prompt version {record.get('targeting_prompt_version')}, "
                    f"this code renders {TARGETING_PROMPT_VERSION}")
    if record.get("scheme") != today.scheme:
        return cold(f"the previous model learned {record.get('scheme')} ids, today's index has {today.scheme}")
    if previous_index is None or previous_index.index_hash != record.get("trained_on_index"):
        return cold("the index the previous model learned is not on disk to compare with")
    prev_tokens = previous_index.special_tokens
    if today.scheme == "codes" and today.special_tokens[:len(prev_tokens)] != prev_tokens:
        return cold("the earlier code tokens are not kept at their ids (a full rebuild): a codes model "
                    "cannot be remapped")
    overlap = len(today.ad_ids & previous_index.ad_ids) / max(1, len(today.ad_ids))
    if overlap < config.min_overlap:
        return cold(f"only {overlap:.1%} of today's ads were in the previous index (< {config.min_overlap:.0%})", overlap)
    # absolute: Ray Train workers do not run in the driver's working directory
    return WarmStartPlan(str(Path(previous_model).resolve()), epochs * config.epochs_fraction,
                         f"{overlap:.1%} of today's ads were in the previous index", overlap)
