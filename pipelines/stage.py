"""The stage contract: what a stage module of ``pipelines/`` exposes so the refresh can compose it.

Each stage module (``pipelines/index.py``, ``train.py``, ``compress.py``, ``generate.py``,
``evaluate.py``) defines its job config (a validated :class:`adbatch.config.ConfigBase`), its
``run_<stage>(config) -> summary`` and one :class:`StageContract` naming them, together with
``inputs(config)``: what invalidates the stage's output beyond its config -- the files it reads by
content, and the format / prompt / id-rendering versions its output depends on. The refresh
(``jobs/nightly_refresh.py``) knows none of these: it builds each stage's job config, fills in the
paths it wires from upstream stages (the contract's ``wired`` fields), and skips a stage whose config
hash, ``inputs`` and output manifest are unchanged since its last successful run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from adbatch.artifacts import MANIFEST_NAME, ArtifactKind, sha256_file
from adbatch.config import ConfigBase, ConfigError

__all__ = ["StageContract", "model_hash", "model_input_hash", "folder_hash", "file_hash"]


@dataclasses.dataclass(frozen=True)
class StageContract:
    """What the refresh needs of a stage.

    ``config``: its job config class. ``kind``: the :class:`ArtifactKind` of its output folder
    (``config.out``). ``manifest``: the file in that folder whose hash stands for the whole output
    (its ``outputs`` table lists the other files by hash). ``inputs(config) -> {name: hash or version}``.
    ``run(config) -> summary``. ``wired``: the job config's fields the refresh fills in from upstream
    stages and its own settings; a refresh config that sets one of them is refused (it would be
    overwritten silently).
    """

    name: str
    config: type[ConfigBase]
    kind: ArtifactKind
    inputs: Callable[[Any], dict[str, Any]]
    run: Callable[[Any], dict[str, Any]]
    wired: tuple[str, ...]
    manifest: str = MANIFEST_NAME

    def manifest_file(self, config: ConfigBase) -> Path:
        return Path(getattr(config, "out")) / self.manifest

    def check_unwired(self, config: ConfigBase, where: str) -> None:
        """Refuse a job config read from the refresh's file (before wiring) that sets a wired field."""
        for f in dataclasses.fields(config):
            if f.name not in self.wired:
                continue
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
                       else f.default)
            if getattr(config, f.name) != default:
                raise ConfigError(f"{where}.{f.name}: set by the refresh (wired from its other stages and "
                                  "settings); remove it from the refresh config")


def model_hash(model: str | None) -> str:
    """Content hash of a model the refresh did not produce (None = the default model): its weight and
    config files (:meth:`adbatch.serving.generators.ModelSpec.identity`)."""
    from adbatch.serving.generators import ModelSpec

    return ModelSpec(model=model).identity()["sha256"]


def model_input_hash(model: str | Path | None) -> str:
    """What identifies a model a stage reads: a trained model folder by its training record (rewritten by
    every training run), a compressed checkpoint by its manifest, anything else by :func:`model_hash`."""
    if model is not None and Path(model).is_dir():
        from adbatch.training.checkpoint import TRAINING_RECORD

        for name in (TRAINING_RECORD, MANIFEST_NAME):
            if (Path(model) / name).is_file():
                return sha256_file(Path(model) / name)
    return model_hash(None if model is None else str(model))


def folder_hash(path: str | Path | None) -> str | None:
    """An index or checkpoint folder by its manifest ("absent" without one; None when not configured)."""
    if path is None:
        return None
    manifest = Path(path) / MANIFEST_NAME
    return sha256_file(manifest) if manifest.is_file() else "absent"


def file_hash(path: str | Path | None) -> str | None:
    """A file by content ("absent" when missing; None when not configured)."""
    if path is None:
        return None
    return sha256_file(path) if Path(path).is_file() else "absent"
