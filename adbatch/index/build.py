"""The ad index stage: corpus -> embeddings -> codes (hierarchical or residual k-means) -> token sequences -> trie.

``build_index(ads, out, IndexConfig(...))`` runs the whole stage in-process (no Ray);
``pipelines/index.py`` runs the embedding and clustering phases as Ray tasks and then calls the
same :func:`write_index`. Output directory (all files written atomically, ``manifest.json`` last so
its presence marks a finished index):

- ``ad_codes.parquet``: one row per indexed ad, in *row* order (row = position, the id the trie
  returns): ``ad_id`` (string or int64, as in the corpus), ``code`` list<int32> (cluster path +
  position in the leaf; ``cluster.method`` residual: the ``rq_levels`` codes, + the collision counter),
  ``token_ids`` list<int32> (the target sequence), ``text`` string (the rendered sequence).
- ``trie.safetensors``: the :class:`~adbatch.index.trie.Trie` over ``token_ids`` (terminal rows = rows).
- ``clusters.parquet``: one row per cluster: ``path``, ``size``, ``label`` (words), ``token`` (codes scheme).
- ``rejected.parquet``: corpus rows set aside, with a reason (see :mod:`adbatch.index.corpus`).
- ``embeddings.safetensors``: the vectors the ads were clustered by, normalised fp16, row order; the
  manifest's ``dense`` entry names the model that embeds queries into their space (the dense channel,
  :mod:`adbatch.index.dense`).
- ``embedder/`` (when the stage tuned its encoder on labelled queries, :mod:`adbatch.index.embedder_tuning`):
  that sentence-transformers folder, which embedded the ads and embeds the queries; the manifest's
  ``embedder_tuning`` holds its record.
- ``manifest.json``: input hash, config, counts, timings, code version, plus ``scheme``,
  ``tokenizer``, ``base_vocab_size``, ``special_tokens`` (codes), ``eos_token_id`` (text),
  ``id_render_version`` (:data:`adbatch.index.ids.ID_RENDER_VERSION`), ``index_hash``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from adbatch.artifacts import (
    MANIFEST_NAME, StageTimer, build_manifest, read_manifest, sha256_file, sha256_json, verify_outputs,
    write_json_atomic, write_parquet_atomic,
)
from adbatch.index.clustering import (
    ClusterConfig, ClusterMethod, Hierarchy, build_codes, require_updatable, update_hierarchy,
)
from adbatch.config import ConfigBase, ConfigError
from adbatch.index.corpus import Corpus, CorpusConfig, read_corpus
from adbatch.index.dense import (EMBEDDINGS_FILE, INDEX_EMBEDDER, INDEX_EMBEDDER_DIR, DenseChannelError,
                                 check_query_embedder, dense_record, write_embeddings)
from adbatch.index.embedder_tuning import tune_embedder
from adbatch.index.embeddings import EmbeddingConfig, default_embedding_model_dir, embed_texts
from adbatch.models import tokenizer_fingerprint
from adbatch.index.ids import ID_RENDER_VERSION, IdScheme, RenderConfig, RenderedIds, render_ids
from adbatch.index.trie import Trie

log = logging.getLogger(__name__)

AD_CODES_FILE = "ad_codes.parquet"
TRIE_FILE = "trie.safetensors"
CLUSTERS_FILE = "clusters.parquet"
REJECTED_FILE = "rejected.parquet"
INDEX_FILES = (AD_CODES_FILE, TRIE_FILE, CLUSTERS_FILE, REJECTED_FILE, EMBEDDINGS_FILE)
STAGING_DIR = ".staging"  # write_index writes here first, then moves the files into place
TUNING_DIR = ".embedder-tuning"  # the tuned encoder while the index is built (write_index copies it in)


@dataclasses.dataclass
class IndexConfig(ConfigBase):
    """Everything that decides the index's content (stored in its manifest)."""

    columns: CorpusConfig = dataclasses.field(default_factory=CorpusConfig)
    embedding: EmbeddingConfig = dataclasses.field(default_factory=EmbeddingConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    render: RenderConfig = dataclasses.field(default_factory=RenderConfig)
    tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "HF model/tokenizer folder whose vocabulary the sequences "
                                        "use (default: the default model, SmolLM2-135M-Instruct)"})

    def validate(self) -> None:
        if self.tokenizer is not None and not str(self.tokenizer).strip():
            raise ConfigError("IndexConfig.tokenizer: empty string; leave unset for the default")
        # text labels name clusters of ads; a residual level's centroid is a direction shared by ads of
        # every level-0 cell, so residual codes are rendered as code tokens only
        if self.cluster.method is ClusterMethod.RESIDUAL and self.render.scheme is not IdScheme.CODES:
            raise ConfigError(f"IndexConfig: cluster.method 'residual' needs render.scheme 'codes' "
                              f"(got {self.render.scheme.value!r})")


@dataclasses.dataclass
class AdIndex:
    """A finished index loaded from disk (see the module docstring for the files)."""

    directory: Path
    trie: Trie
    ad_codes: pa.Table
    manifest: dict[str, Any]

    @functools.cached_property
    def ad_ids(self) -> list:
        """Index row -> ad id. Converted from ``ad_codes`` once per loaded index: callers map every
        ranked row through it (on the full catalogue a fresh conversion per lookup cost ~1 ms, which
        made ``[index.ad_ids[r] for r in row]`` the slowest part of a ranking harness)."""
        return self.ad_codes.column("ad_id").to_pylist()

    @property
    def scheme(self) -> IdScheme:
        return IdScheme(self.manifest["scheme"])

    @property
    def index_hash(self) -> str:
        return self.manifest["index_hash"]

    @property
    def base_vocab_size(self) -> int:
        return int(self.manifest["base_vocab_size"])

    @property
    def special_tokens(self) -> list[str]:
        return list(self.manifest.get("special_tokens", []))

    @property
    def eos_token_id(self) -> int | None:
        return self.manifest.get("eos_token_id")

    @property
    def num_ads(self) -> int:
        return self.ad_codes.num_rows

    def sequences(self) -> list[list[int]]:
        return self.ad_codes.column("token_ids").to_pylist()

    def texts(self) -> list[str]:
        return self.ad_codes.column("text").to_pylist()


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None) -> tuple[Any, str]:
    """(tokenizer, the folder it came from); ``None`` -> the default model's tokenizer.

    Cached per name: callers only read the tokenizer (never add tokens to the returned object).
    """
    from transformers import AutoTokenizer

    from adbatch.models import refuse_custom_code, resolve_model

    folder = resolve_model(name)
    refuse_custom_code(folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False), str(folder)


@dataclasses.dataclass
class IndexEmbedding:
    """The ads' vectors an index clusters (``embeddings`` ``float32 [N, D]``, corpus row order) and the encoder
    folder the index keeps as its own (``embedder_dir``: a tuned encoder, or the earlier index's on an incremental
    build; None = the configured encoder, or the corpus's own vectors), with the tuning's ``record``."""

    embeddings: np.ndarray
    embedder_dir: Path | None = None
    record: dict[str, Any] | None = None


def embed_for_index(corpus: Corpus, config: IndexConfig, out: str | Path, *,
                    labelled: Any = (), valid: Any = (), start: "StableStart | None" = None,
                    embed: Any = None, progress: bool = True) -> IndexEmbedding:
    """The vectors the index clusters: the corpus's own; on an incremental build (``start``) the earlier index's
    encoder (never re-tuned: the kept codes stay in their space); else the configured encoder, tuned first on
    ``labelled`` (query, ad_id) pairs when ``config.embedding.tune`` allows (gated on ``valid`` pairs;
    :func:`adbatch.index.embedder_tuning.tune_embedder`). ``embed(folder) -> float32 [N, D]`` embeds every ad
    with an encoder folder (default: in this process)."""
    if corpus.embeddings is not None:
        if labelled and config.embedding.tune.enabled:
            log.info("index: the corpus brings its own vectors: the encoder is not tuned (no encoder made them)")
        return IndexEmbedding(corpus.embeddings)
    texts = corpus.embedding_inputs()
    if embed is None:
        def embed(folder: Path) -> np.ndarray:
            return embed_texts(texts, config.embedding.replace(model=str(folder)), progress=progress)
    base = Path(config.embedding.model) if config.embedding.model else default_embedding_model_dir()
    if start is not None:
        return IndexEmbedding(embed(start.embedder or base), start.embedder,
                              {"reused_from_index": start.from_index} if start.embedder else None)
    import torch

    tuned = tune_embedder(texts, corpus.table.column("ad_id").to_pylist(), list(labelled), list(valid),
                          config.embedding.tune, base, Path(out) / TUNING_DIR, embed,
                          device="cuda" if torch.cuda.is_available() else "cpu",
                          max_seq_length=config.embedding.max_seq_length, progress=progress)
    return IndexEmbedding(tuned.embeddings, tuned.folder, tuned.record)


def query_embedder_of(corpus: Corpus, config: IndexConfig, own_embedder: bool = False) -> str | None:
    """Who embeds queries into the space of the ads' vectors: the index's own (tuned) encoder when it keeps one,
    else the index stage's embedder when it embedded the ads, else the configured ``embedding.query_embedder``
    (None: no dense channel)."""
    if own_embedder:
        return INDEX_EMBEDDER
    if corpus.embeddings is None:
        return config.embedding.model or "default"
    return config.embedding.query_embedder


def check_query_embedder_of(corpus: Corpus, config: IndexConfig) -> None:
    """For a corpus that brings its own vectors, the ``embedding.query_embedder`` the index will name, loaded once
    with the dense channel's refusals and probed against the vectors' width
    (:func:`adbatch.index.dense.probe_query_embedder`): an index never records a dense channel that cannot work
    (an empty folder, another dimension, a module that does not load). :data:`INDEX_EMBEDDER` is refused: an index
    built from the corpus's vectors tunes no encoder, so it keeps none of its own. Nothing to check otherwise (the
    stage's own encoder embeds the ads and the queries)."""
    from adbatch.index.dense import probe_query_embedder

    name = config.embedding.query_embedder
    if corpus.embeddings is None or not name:
        return
    if name == INDEX_EMBEDDER:
        raise DenseChannelError(f"EmbeddingConfig.query_embedder {INDEX_EMBEDDER!r} names the index's own tuned "
                                "encoder, and an index built from the corpus's embeddings keeps none: name the "
                                "sentence-transformers folder that made them, or 'default'")
    probe_query_embedder(name, int(corpus.embeddings.shape[1]))


def write_index(out: str | Path, corpus: Corpus, hierarchy: Hierarchy, config: IndexConfig,
                timer: StageTimer, embeddings: np.ndarray, extra: dict[str, Any] | None = None,
                tokenizer: Any = None, tokenizer_name: str | None = None,
                stable: "StableStart | None" = None, embedder_dir: Path | None = None,
                embedder_record: dict[str, Any] | None = None) -> dict[str, Any]:
    """Render sequences, build the trie and write every output file; return the manifest.
    ``embeddings``: ``float [N, D]`` the vectors the ads were clustered by (corpus row order), kept as
    the dense channel. ``stable``: what an incremental build keeps from an earlier index (labels, code tokens).
    ``embedder_dir``: an encoder folder the index keeps as its own (copied in; :class:`IndexEmbedding`), with
    ``embedder_record`` (the manifest's ``embedder_tuning``)."""
    if embeddings.shape[0] != corpus.num_ads:
        raise ValueError(f"{embeddings.shape[0]} embeddings for {corpus.num_ads} ads")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    finish_interrupted_write(out)
    staging = out / STAGING_DIR
    with timer.phase("render"):
        if tokenizer is None:
            tokenizer, tokenizer_name = load_tokenizer(config.tokenizer)
        texts = corpus.table.column("text").to_pylist()
        rendered = render_ids(hierarchy, texts, tokenizer, config.render,
                              label_texts=corpus.embedding_inputs(),
                              fixed_labels=stable.labels if stable else None,
                              keep_tokens=stable.special_tokens if stable else None)
    with timer.phase("trie"):
        trie = Trie.from_flat(rendered.token_flat, rendered.token_len)
    # made only now: a render that fails (a tokenizer the scheme cannot use) leaves no half-made staging folder
    staging.mkdir()
    with timer.phase("write"):
        ad_codes = _ad_codes_table(corpus, hierarchy, rendered)
        write_parquet_atomic(ad_codes, staging / AD_CODES_FILE)
        trie.save(staging / TRIE_FILE)
        write_parquet_atomic(rendered.clusters, staging / CLUSTERS_FILE)
        write_parquet_atomic(corpus.rejected, staging / REJECTED_FILE)
        write_embeddings(staging / EMBEDDINGS_FILE, embeddings)
        if embedder_dir is not None:
            shutil.copytree(embedder_dir, staging / INDEX_EMBEDDER_DIR)
        outputs = {name: sha256_file(staging / name) for name in INDEX_FILES}
    tok_fp = tokenizer_fingerprint(tokenizer)
    index_hash = sha256_json({"ad_codes": outputs[AD_CODES_FILE], "trie": outputs[TRIE_FILE],
                              "scheme": rendered.scheme.value, "tokenizer": tok_fp,
                              "special_tokens": rendered.special_tokens})
    distinct = int((np.diff(trie.terminal_ptr.numpy()) > 0).sum())
    counts = {
        "input_rows": corpus.num_input_rows,
        "ads_indexed": corpus.num_ads,
        "rejected": corpus.rejected.num_rows,
        **{f"rejected_{k}": v for k, v in corpus.rejected_counts().items()},
        "clusters": rendered.clusters.num_rows,
        "splits": hierarchy.num_splits,
        "fallback_splits": hierarchy.fallback_splits,
        "leaves": hierarchy.num_leaves,
        "code_collisions": hierarchy.collisions,
        "max_code_length": hierarchy.max_depth,
        "distinct_sequences": distinct,
        "trie_nodes": trie.num_nodes,
        "trie_bytes": trie.nbytes(),
        "trie_max_depth": trie.max_depth,
        "tokens_total": int(rendered.token_len.sum()),
    }
    manifest = build_manifest(
        stage="index", config=config, inputs={"ads": corpus.input_hash},
        outputs=outputs, counts=counts, timings=timer.seconds,
        extra={
            "scheme": rendered.scheme.value,
            "tokenizer": tokenizer_name,
            "tokenizer_fingerprint": tok_fp,
            "base_vocab_size": rendered.base_vocab_size,
            "special_tokens": rendered.special_tokens,
            "eos_token_id": rendered.eos_token_id,
            "id_render_version": ID_RENDER_VERSION,
            "trie_file": TRIE_FILE,
            "index_hash": index_hash,
            "input_files": [str(p) for p in corpus.paths],
            "dense": dense_record(embeddings, "corpus" if corpus.embeddings is not None else "computed",
                                  query_embedder_of(corpus, config, embedder_dir is not None), index_dir=staging),
            "embedder_tuning": embedder_record,
            **(extra or {}),
        },
    )
    write_json_atomic(staging / MANIFEST_NAME, manifest)  # the staged set is complete from here on
    finish_interrupted_write(out)
    shutil.rmtree(out / TUNING_DIR, ignore_errors=True)
    log.info("index: %d ads (%d rejected), %d clusters, trie %d nodes (%.1f B/ad) -> %s",
             corpus.num_ads, corpus.rejected.num_rows, rendered.clusters.num_rows, trie.num_nodes,
             trie.nbytes() / max(corpus.num_ads, 1), out)
    return manifest


def finish_interrupted_write(index_dir: str | Path) -> None:
    """Complete or discard a :func:`write_index` that stopped part-way, so ``index_dir`` holds one whole index.

    The files are written to ``index_dir/.staging`` and its manifest last; only then are they moved
    into place, the manifest last again. A staged manifest therefore means a complete set: move what
    is left (roll forward). Without it the earlier index in ``index_dir`` was never touched: drop the
    staging folder. A nightly build that writes over the index it keeps ids from thus never leaves
    new files beside the old manifest (which would make the next run's earlier index unreadable and
    cost every ad its id)."""
    index_dir = Path(index_dir)
    staging = index_dir / STAGING_DIR
    if not staging.is_dir():
        return
    if (staging / MANIFEST_NAME).is_file():
        for name in INDEX_FILES:
            if (staging / name).exists():
                os.replace(staging / name, index_dir / name)
        # the index's own encoder folder: replaced whole; dropped when the staged index names none (read from
        # the staged manifest, so a roll-forward that already moved it does not delete it)
        own = index_dir / INDEX_EMBEDDER_DIR
        if (staging / INDEX_EMBEDDER_DIR).is_dir():
            shutil.rmtree(own, ignore_errors=True)
            os.replace(staging / INDEX_EMBEDDER_DIR, own)
        elif own.exists() and not _names_own_embedder(read_manifest(staging)):
            shutil.rmtree(own, ignore_errors=True)
        os.replace(staging / MANIFEST_NAME, index_dir / MANIFEST_NAME)
    else:
        log.warning("index: dropping the incomplete write left in %s", staging)
    shutil.rmtree(staging, ignore_errors=True)


def _names_own_embedder(manifest: dict[str, Any]) -> bool:
    return ((manifest.get("dense") or {}).get("query_embedder") or {}).get("name") == INDEX_EMBEDDER


def _ad_codes_table(corpus: Corpus, h: Hierarchy, r: RenderedIds) -> pa.Table:
    code_offs = np.concatenate([[0], np.cumsum(h.code_len, dtype=np.int64)]).astype(np.int64)
    tok_offs = r.offsets()
    return pa.table({
        "ad_id": corpus.table.column("ad_id"),
        "code": pa.LargeListArray.from_arrays(pa.array(code_offs), pa.array(h.code_flat, pa.int32())
                                              ).cast(pa.list_(pa.int32())),
        "token_ids": pa.LargeListArray.from_arrays(pa.array(tok_offs),
                                                   pa.array(r.token_flat, pa.int32())
                                                   ).cast(pa.list_(pa.int32())),
        "text": pa.array(r.texts, pa.string()),
    })


@dataclasses.dataclass
class StableStart:
    """What an incremental build keeps from an earlier index (see :func:`stable_start`)."""

    codes: list[list[int] | None]  # per corpus row: its previous code, None for a new ad
    labels: dict[tuple[int, ...], str]  # cluster path -> label (text scheme)
    special_tokens: list[str]  # the earlier code tokens (codes scheme), kept at their ids
    from_index: str  # the earlier index's hash
    embedder: Path | None = None  # the earlier index's own (tuned) encoder: today's ads are embedded by it


# config sections that must match for an earlier index's codes to be reused: the same embedding space,
# clustering knobs, rendering, ad columns and tokenizer
_STABLE_KEYS = ("columns", "embedding", "cluster", "render", "tokenizer")


def stable_start(previous: str | Path, corpus: Corpus, config: IndexConfig) -> StableStart | None:
    """The codes and labels of an earlier index of the same configuration for today's ads, or None
    (logged why) when there is no readable earlier index or it was built differently.

    Raises :class:`ConfigError` for a ``cluster.method`` without an incremental update (residual),
    whether or not an earlier index exists, so a nightly refresh refuses it on its first night."""
    require_updatable(config.cluster)
    try:
        finish_interrupted_write(previous)
        prev = load_index(previous)
        verify_outputs(previous, prev.manifest, (CLUSTERS_FILE,))  # the labels' source: load_index skips it
        clusters = pq.read_table(Path(previous) / CLUSTERS_FILE).to_pydict()
    except (FileNotFoundError, ValueError, KeyError, OSError) as e:
        log.info("index: no earlier index to keep codes from (%s): full build", e)
        return None
    want = config.to_dict()
    try:  # through the config class, so knobs added since (at their defaults) do not count as a change
        have = IndexConfig.from_dict(prev.manifest.get("config", {})).to_dict()
    except ConfigError as e:
        log.info("index: the earlier index at %s has a config this code cannot read (%s): full build", previous, e)
        return None
    differs = [k for k in _STABLE_KEYS if have.get(k) != want.get(k)]
    if differs:
        log.info("index: the earlier index at %s was built with other %s: full build", previous, differs)
        return None
    # the codes are the clustering's, kept across renderings; labels of another rendering version
    # (manifests before the version was recorded: 1) would mix two renderings in one index
    prev_render = int(prev.manifest.get("id_render_version", 1))
    if prev_render != ID_RENDER_VERSION:
        log.info("index: the earlier index at %s was rendered with id_render_version %d (this code: %d): "
                 "codes kept, labels rendered anew", previous, prev_render, ID_RENDER_VERSION)
    embedder = None
    if _names_own_embedder(prev.manifest):
        try:  # the kept codes live in that encoder's space: a damaged folder cannot place today's ads
            check_query_embedder(previous, prev.manifest)
        except DenseChannelError as e:
            log.info("index: the earlier index's encoder cannot be used (%s): full build", e)
            return None
        embedder = Path(previous) / INDEX_EMBEDDER_DIR
    code_of = dict(zip(prev.ad_ids, prev.ad_codes.column("code").to_pylist()))
    codes = [code_of.get(a) for a in corpus.table.column("ad_id").to_pylist()]
    # only clusters that still hold a kept ad keep their label: every other path of today's hierarchy
    # is a new cluster (with no ad in common, a fresh clustering reuses the old paths for other ads)
    live = {tuple(c[:d]) for c in codes if c for d in range(1, len(c))}
    labels = ({tuple(p): lab for p, lab in zip(clusters["path"], clusters["label"]) if tuple(p) in live}
              if prev_render == ID_RENDER_VERSION else {})
    return StableStart(codes, labels, prev.special_tokens, prev.index_hash, embedder)


def cluster_stable(emb: np.ndarray, start: StableStart, config: IndexConfig) -> tuple[Hierarchy, dict[str, Any]]:
    """:func:`adbatch.index.clustering.update_hierarchy` from ``start``; returns the hierarchy and the
    manifest's ``stable_ids`` record."""
    hierarchy, stats = update_hierarchy(emb, start.codes, config.cluster)
    log.info("index: kept the codes of %d ads from index %s, placed %d new, re-split %d in %d full leaves",
             stats.kept, start.from_index[:12], stats.new, stats.resplit, stats.resplit_leaves)
    return hierarchy, {"from_index": start.from_index, **stats.to_dict()}


def build_index(ads: str | Path, out: str | Path, config: IndexConfig | None = None,
                progress: bool = True, previous: str | Path | None = None,
                queries: Any = (), valid_queries: Any = ()) -> dict[str, Any]:
    """Build the index of the corpus at ``ads`` into ``out`` sequentially (no Ray).

    ``previous``: an earlier index of the same configuration (may be ``out`` itself): ads it holds
    keep their codes and clusters their labels (:func:`stable_start`); a full build without it.
    ``queries`` / ``valid_queries``: labelled (query, ad_id) pairs of the train / validation splits: the
    encoder is tuned on them before it embeds the ads (``config.embedding.tune``; :func:`embed_for_index`).
    Returns the manifest written to ``out/manifest.json``.
    """
    cfg = config or IndexConfig()
    timer = StageTimer()
    with timer.phase("read"):
        corpus = read_corpus(ads, cfg.columns)
    if corpus.num_ads == 0:
        raise ValueError(f"{ads}: no valid ads ({corpus.rejected.num_rows} rows rejected: "
                         f"{corpus.rejected_counts()})")
    check_query_embedder_of(corpus, cfg)
    start = stable_start(previous, corpus, cfg) if previous is not None else None
    with timer.phase("embed"):
        embedded = embed_for_index(corpus, cfg, out, labelled=queries, valid=valid_queries, start=start,
                                   progress=progress)
    emb = embedded.embeddings
    extra: dict[str, Any] = {"runner": "sequential"}
    with timer.phase("cluster"):
        if start is not None:
            hierarchy, extra["stable_ids"] = cluster_stable(emb, start, cfg)
        else:
            hierarchy = _codes_with_progress(emb, cfg.cluster, progress)
    return write_index(out, corpus, hierarchy, cfg, timer, emb, extra=extra, stable=start,
                       embedder_dir=embedded.embedder_dir, embedder_record=embedded.record)


def _codes_with_progress(emb: np.ndarray, config: ClusterConfig, progress: bool) -> Hierarchy:
    from tqdm.auto import tqdm

    with tqdm(total=emb.shape[0], desc="cluster", unit="ad", disable=not progress) as bar:
        return build_codes(emb, config, on_progress=bar.update)


def load_index(directory: str | Path, mmap: bool = True, verify: bool = True) -> AdIndex:
    """Open a finished index. ``verify`` checks the files' sha256 against the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.get("stage") != "index":
        raise ValueError(f"{directory}: manifest is for stage {manifest.get('stage')!r}, not index")
    trie_file = directory / manifest.get("trie_file", TRIE_FILE)
    if verify:
        verify_outputs(directory, manifest, (AD_CODES_FILE, manifest.get("trie_file", TRIE_FILE)))
    trie = Trie.load(trie_file, mmap=mmap)
    ad_codes = pq.read_table(directory / AD_CODES_FILE)
    if ad_codes.num_rows != int(manifest["counts"]["ads_indexed"]):
        raise ValueError(f"{directory}: {ad_codes.num_rows} ad rows but the manifest says "
                         f"{manifest['counts']['ads_indexed']}")
    if trie.num_rows != ad_codes.num_rows:
        raise ValueError(f"{directory}: trie lists {trie.num_rows} rows, ad_codes has "
                         f"{ad_codes.num_rows}")
    return AdIndex(directory=directory, trie=trie, ad_codes=ad_codes, manifest=manifest)
