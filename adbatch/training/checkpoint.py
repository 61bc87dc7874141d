"""Trained-model folders: HF safetensors + ``adbatch_training.json`` binding the model to its index.

A model trained on an index has learned *that* index's target sequences (and, for the ``codes``
scheme, its special tokens), so decoding it against another index returns plausible-looking but
wrong ads. The folder therefore records ``trained_on_index`` (= ``AdIndex.index_hash``) and
:func:`check_index_compat` refuses any other index. With progressive sparsity the final N:M masks
are saved beside the weights (``nm_masks.safetensors``, uint8 per pruned linear) so the compression
stage can keep them exactly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

from adbatch.artifacts import code_version, write_json_atomic

log = logging.getLogger(__name__)

TRAINING_RECORD = "adbatch_training.json"
MASKS_FILE = "nm_masks.safetensors"


class IndexMismatchError(ValueError):
    """The model was trained on another index (or on none) than the one it is asked to decode."""


def save_trained(model: Any, tokenizer: Any, out_dir: str | Path, record: Mapping[str, Any],
                 masks: Mapping[str, torch.Tensor] | None = None, folders: Mapping[str, Path] | None = None) -> Path:
    """Write the model folder atomically: a sibling temp folder renamed over ``out_dir``.

    ``record`` must hold ``trained_on_index``; ``code_version`` is added. ``masks``: layer name ->
    bool ``[N, K]``. ``folders``: name -> a finished folder moved into the model folder under that name
    (the tuned query embedder).
    """
    if "trained_on_index" not in record:
        raise ValueError("training record needs 'trained_on_index'")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if masks:
        import torch
        from safetensors.torch import save_file

        save_file({k: v.to(torch.uint8).cpu().contiguous() for k, v in masks.items()}, str(tmp / MASKS_FILE))
    for name, folder in (folders or {}).items():
        shutil.move(str(folder), str(tmp / name))
    write_json_atomic(tmp / TRAINING_RECORD, {**record, "code_version": code_version()})
    if out_dir.exists():
        old = _previous_dir(out_dir)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def _previous_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.old")


def recover_interrupted_save(out_dir: str | Path) -> None:
    """Undo a :func:`save_trained` stopped between its two renames: the earlier model sits in
    ``.<name>.old`` and ``out_dir`` is missing -- move it back (a failed run keeps last night's
    model); with both present the swap had finished, so the leftover is removed."""
    out_dir = Path(out_dir)
    old = _previous_dir(out_dir)
    if not old.exists():
        return
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, out_dir)
        log.warning("restored %s from an interrupted save", out_dir)


def read_training_record(model_dir: str | Path) -> dict[str, Any] | None:
    """The folder's ``adbatch_training.json``, or None for a model never trained on an index. A record that is
    not a JSON object (truncated, hand-edited) is a :class:`adbatch.models.ModelFolderError` naming it."""
    from adbatch.models import ModelFolderError

    path = Path(model_dir) / TRAINING_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelFolderError(f"{path}: not valid JSON ({exc}); the model folder is damaged: retrain it or "
                               "restore the file") from None
    if not isinstance(record, dict):
        raise ModelFolderError(f"{path}: not a JSON object (a {type(record).__name__}); the model folder is "
                               "damaged: retrain it or restore the file")
    return record


def load_masks(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Saved N:M masks (layer name -> bool ``[N, K]``); empty when the model is dense."""
    path = Path(model_dir) / MASKS_FILE
    if not path.is_file():
        return {}
    from safetensors.torch import load_file

    return {k: v.bool() for k, v in load_file(str(path)).items()}


def model_binding(record: Mapping[str, Any]) -> dict[str, Any]:
    """What binds a trained model to its decoding setup: the index it learned and the targeting-prompt
    rendering it learned it with (records written before the version existed were trained on
    rendering 1), the fusion of its two channels fitted for it (None: not fitted) and its tuned query embedder
    (None: the index's serves). A compressed
    checkpoint's manifest carries these same keys."""
    return {"trained_on_index": record.get("trained_on_index"),
            "targeting_prompt_version": int(record.get("targeting_prompt_version", 1)),
            "fusion": record.get("fusion"), "query_embedder": record.get("query_embedder")}


def check_binding(record: Mapping[str, Any], index_hash: str, model: str) -> None:
    """Raise :class:`IndexMismatchError` unless ``record`` (a training record or a compressed
    manifest) was trained on ``index_hash`` with this code's targeting prompts. ``model`` names the
    model in the message."""
    from adbatch.serving.prompts import TARGETING_PROMPT_VERSION

    binding = model_binding(record)
    have = binding["trained_on_index"]
    if have != index_hash:
        raise IndexMismatchError(
            f"{model} was trained on index {str(have)[:12]}, not on {index_hash[:12]}: retrain (or warm-start) "
            "it on this index, or decode with the index it was trained on")
    if binding["targeting_prompt_version"] != TARGETING_PROMPT_VERSION:
        raise IndexMismatchError(
            f"{model} was trained on targeting prompts of version {binding['targeting_prompt_version']}, this "
            f"code renders version {TARGETING_PROMPT_VERSION}: retrain (or warm-start) it on index {index_hash[:12]}")


def check_index_compat(model_dir: str | Path, index: Any, *, allow_untrained: bool = False) -> dict[str, Any] | None:
    """Refuse to pair a trained model with an index other than the one it learned.

    ``index``: an ``AdIndex`` (its ``index_hash``) or the hash string itself. A folder without a
    training record is refused unless ``allow_untrained`` (zero-shot over a ``text`` index).
    Returns the training record (None for an allowed untrained model).
    """
    want = index if isinstance(index, str) else index.index_hash
    record = read_training_record(model_dir)
    if record is None:
        if allow_untrained:
            return None
        raise IndexMismatchError(f"{model_dir} has no {TRAINING_RECORD}: it was not trained on index {want[:12]}")
    check_binding(record, want, str(model_dir))
    return record
