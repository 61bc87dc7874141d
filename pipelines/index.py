"""Ray composition of the index stage: embedding on an actor pool, hierarchical k-means as a
fan-out of Ray tasks, then the library's :func:`adbatch.index.build.write_index`.

Clustering: each cluster larger than the leaf size is one task running
:func:`adbatch.index.clustering.split_node` on exactly its own rows' embeddings. A task returns
``1 + k`` objects: the small child row lists (fetched by the driver, which decides what to split
next) and one embedding block per child, which stays in the object store and is handed by
reference to that child's task; the full matrix is put once, for the root task only.
Results equal the sequential :func:`adbatch.index.clustering.build_hierarchy` (same per-node seeds).
Residual codes (``cluster.method residual``: ``rq_levels`` k-means runs over all rows, each needing the
previous level's residuals) have no such fan-out: the driver runs :func:`adbatch.index.clustering.build_codes`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from adbatch.artifacts import ArtifactKind, StageTimer, claim_output, sha256_paths
from adbatch.index.clustering import Child, ClusterConfig, ClusterMethod, Hierarchy, HierarchyBuilder, build_codes, split_node
from adbatch.config import ConfigBase, ConfigError
from adbatch.index.corpus import Corpus, CorpusSchemaError, read_corpus
from adbatch.index.embeddings import EmbeddingConfig, embed_texts, load_embedder
from adbatch.index.build import (IndexConfig, check_query_embedder_of, cluster_stable, embed_for_index, load_tokenizer,
                                 stable_start, write_index)
from adbatch.index.ids import check_tokenizer
from pipelines.ray_runtime import init_ray
from pipelines.stage import StageContract

log = logging.getLogger(__name__)


@dataclasses.dataclass
class IndexJobConfig(ConfigBase):
    """``adbatch index``: where the corpus is, where the index goes, and how to build it.

    ``out`` is checked when the job runs, not here: the refresh fills it in (:data:`STAGE`'s ``wired``)."""

    ads: Path | None = dataclasses.field(
        default=None, metadata={"help": "ad corpus: a Parquet file, a folder of parts, or a glob"})
    out: str = dataclasses.field(default="", metadata={"help": "output directory of the index"})
    index: IndexConfig = dataclasses.field(default_factory=IndexConfig)
    num_cpus: int | None = dataclasses.field(
        default=None, metadata={"help": "CPUs for a local Ray (ignored when joining RAY_ADDRESS)"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress bars"})
    previous: str | None = dataclasses.field(default=None, metadata={
        "help": "an earlier index of the same config (may be `out`): its ads keep their codes (stable ids)"})
    queries: Path | None = dataclasses.field(default=None, metadata={
        "help": "labelled train-split queries (Parquet: query, ad_id): the encoder is tuned on them before it "
                "embeds the ads (index.embedding.tune); the refresh passes the train stage's"})
    valid_queries: Path | None = dataclasses.field(default=None, metadata={
        "help": "validation queries (Parquet: query, ad_id[, grade]): the tuned encoder is kept only if it "
                "beats the base on them"})

    def validate(self) -> None:
        if self.ads is None:
            raise ConfigError("IndexJobConfig.ads: required (the corpus Parquet path or glob)")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError("IndexJobConfig.num_cpus: must be >= 1")


def _remote_split():
    import ray

    @ray.remote(num_cpus=1)
    def split_task(emb: np.ndarray, rows: np.ndarray, path: tuple[int, ...], cfg: ClusterConfig,
                   width: int) -> list:
        children, child_embs, fallback = split_node(emb, rows, tuple(path), cfg)
        meta = {"children": [(c.path, c.rows) for c in children], "fallback": fallback}
        empty = np.zeros((0, emb.shape[1]), dtype=np.float32)
        return [meta] + child_embs + [empty] * (width - len(child_embs))

    return split_task


def cluster_on_ray(emb: np.ndarray, config: ClusterConfig, progress: bool = True) -> Hierarchy:
    """Hierarchical k-means with one Ray task per split; equal to ``build_hierarchy``.

    Args:
        emb: ``float32 [N, D]``.
    """
    import ray
    from tqdm.auto import tqdm

    emb = np.ascontiguousarray(emb, dtype=np.float32)
    n = emb.shape[0]
    builder = HierarchyBuilder(n, config)
    split_task = _remote_split()
    pending: dict[Any, list] = {}  # meta ref -> child embedding refs

    def submit(emb_ref: Any, child: Child) -> None:
        width = min(config.branching, child.rows.shape[0])
        refs = split_task.options(num_returns=1 + width).remote(
            emb_ref, child.rows, child.path, config, width)
        pending[refs[0]] = refs[1:]

    with tqdm(total=n, desc="cluster", unit="ad", disable=not progress) as bar:
        root = Child((), np.arange(n, dtype=np.int64))
        if builder.is_leaf(n):
            builder.add_leaf(root)
            bar.update(n)
        else:
            submit(ray.put(emb), root)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            child_refs = pending.pop(done[0])
            meta = ray.get(done[0])
            builder.add_split(meta["fallback"])
            for j, (path, rows) in enumerate(meta["children"]):
                child = Child(tuple(path), rows)
                if builder.is_leaf(rows.shape[0]):
                    builder.add_leaf(child)
                    bar.update(int(rows.shape[0]))
                else:
                    submit(child_refs[j], child)
    return builder.finish()


def _embed_actor():
    import ray

    @ray.remote(num_cpus=1)
    class EmbedActor:
        """Loads the sentence encoder once; embeds one shard of texts per call."""

        def __init__(self, cfg: EmbeddingConfig) -> None:
            self.cfg = cfg
            self.model = load_embedder(self.cfg)

        def embed(self, texts: list[str]) -> np.ndarray:
            return embed_texts(texts, self.cfg, model=self.model)

    return EmbedActor


def embed_on_ray(texts: list[str], config: EmbeddingConfig, num_actors: int,
                 progress: bool = True) -> np.ndarray:
    """MiniLM embeddings of ``texts`` over shards of ``config.shard_size`` on an actor pool.

    Returns:
        ``float32 [len(texts), D]`` in input order.
    """
    from ray.util import ActorPool
    from tqdm.auto import tqdm

    shards = [texts[i:i + config.shard_size] for i in range(0, len(texts), config.shard_size)]
    actor_cls = _embed_actor()
    actors = [actor_cls.remote(config) for _ in range(max(1, min(num_actors, len(shards))))]
    pool = ActorPool(actors)
    out: list[np.ndarray] = []
    with tqdm(total=len(texts), desc="embed", unit="ad", disable=not progress) as bar:
        for block in pool.map(lambda a, shard: a.embed.remote(shard), shards):
            out.append(block)
            bar.update(block.shape[0])
    return np.concatenate(out, axis=0)


def read_tuning_queries(config: IndexJobConfig) -> tuple[list, list]:
    """The labelled train pairs and the relevant validation pairs of ``config`` (empty when not given), read and
    checked as the train stage reads them; what a driver checks before Ray starts."""
    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT
    from pipelines.train import read_labelled_queries, read_validation_qrels

    labelled = read_labelled_queries(config.queries) if config.queries is not None else []
    valid = ([(q, a) for q, grades in read_validation_qrels(config.valid_queries).items()
              for a, g in grades.items() if g >= HOME_DEPOT_RELEVANT] if config.valid_queries is not None else [])
    return labelled, valid


def read_checked_corpus(config: IndexJobConfig) -> Corpus:
    """The corpus of ``config.ads``, read and validated (:func:`adbatch.index.corpus.read_corpus`); a
    corpus without one valid ad is a :class:`CorpusSchemaError`. What a driver checks before Ray starts."""
    corpus = read_corpus(config.ads, config.index.columns)
    if corpus.num_ads == 0:
        raise CorpusSchemaError(f"{config.ads}: no valid ads ({corpus.rejected.num_rows} rows rejected: "
                                f"{corpus.rejected_counts()})")
    return corpus


@dataclasses.dataclass
class IndexPreflight:
    """What :func:`preflight` read and checked: the corpus, the tokenizer the ids render with (and its folder), and
    the labelled train / validation pairs the encoder is tuned on."""

    corpus: Corpus
    tokenizer: Any
    tokenizer_name: str
    labelled: list
    valid: list


def preflight(config: IndexJobConfig) -> IndexPreflight:
    """Every outside input of an index run, checked in the driver before its ``--out`` is claimed and before Ray
    starts, each failing with its own line (a user error, exit status 2):

    1. ``out`` is given; 2. the corpus: readable, with at least one valid ad (:func:`read_checked_corpus`);
    3. the tokenizer the scheme renders with (the sequences are rendered in this driver after the clustering);
    4. for a corpus with its own vectors, the query embedder the index will name: loaded once with the dense
    channel's refusals, its width checked against the vectors (:func:`adbatch.index.build.check_query_embedder_of`);
    5. the labelled queries the encoder is tuned on (:func:`read_tuning_queries`)."""
    if not config.out:
        raise ConfigError("IndexJobConfig.out: required (the output directory)")
    corpus = read_checked_corpus(config)
    # load_tokenizer is cached: render reuses this load
    tokenizer, tokenizer_name = load_tokenizer(config.index.tokenizer)
    check_tokenizer(tokenizer, config.index.render, tokenizer_name)
    check_query_embedder_of(corpus, config.index)
    labelled, valid = read_tuning_queries(config)
    return IndexPreflight(corpus, tokenizer, tokenizer_name, labelled, valid)


def run_index(config: IndexJobConfig) -> dict[str, Any]:
    """Build the index of ``config.ads`` into ``config.out`` on Ray; return a summary.

    Its inputs are checked (:func:`preflight`) and the output folder claimed before Ray starts, so a bad
    corpus or a misused ``--out`` fails in a second, not after Ray's start-up."""
    import ray

    cfg = config.index
    timer = StageTimer()
    with timer.phase("read"):
        found = preflight(config)
    corpus, tokenizer, tokenizer_name = found.corpus, found.tokenizer, found.tokenizer_name
    labelled, valid = found.labelled, found.valid
    with claim_output(config.out, ArtifactKind.INDEX):
        start = stable_start(config.previous, corpus, cfg) if config.previous else None
        init_ray(config.num_cpus)
        num_workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        texts = corpus.embedding_inputs()
        with timer.phase("embed"):  # the encoder's tuning (when queries are given) runs here in the driver
            embedded = embed_for_index(
                corpus, cfg, config.out, labelled=labelled, valid=valid, start=start, progress=config.progress,
                embed=lambda folder: embed_on_ray(texts, cfg.embedding.replace(model=str(folder)), num_workers,
                                                  progress=config.progress))
        emb = embedded.embeddings
        extra: dict[str, Any] = {"runner": "ray", "ray_cpus": num_workers}
        with timer.phase("cluster"):
            if start is not None:  # placing new ads under kept clusters is cheap: the driver does it
                hierarchy, extra["stable_ids"] = cluster_stable(emb, start, cfg)
            elif cfg.cluster.method is ClusterMethod.HIERARCHICAL:
                hierarchy = cluster_on_ray(emb, cfg.cluster, progress=config.progress)
            else:
                hierarchy = build_codes(emb, cfg.cluster)
        manifest = write_index(Path(config.out), corpus, hierarchy, cfg, timer, emb, extra=extra, stable=start,
                               tokenizer=tokenizer, tokenizer_name=tokenizer_name,
                               embedder_dir=embedded.embedder_dir, embedder_record=embedded.record)
    return {
        "out": str(config.out),
        "index_hash": manifest["index_hash"],
        "scheme": manifest["scheme"],
        "counts": manifest["counts"],
        "timings_s": manifest["timings_s"],
    }


def index_inputs(config: IndexJobConfig) -> dict[str, str]:
    """What invalidates an index beyond its config: the corpus files by content, and the version of the
    id rendering (a new rendering rebuilds the index, and so everything trained on it)."""
    from adbatch.index.dense import EMBEDDINGS_VERSION
    from adbatch.index.ids import ID_RENDER_VERSION
    from adbatch.serving.requests import list_request_files

    from pipelines.stage import file_hash

    return {"ads": sha256_paths(list_request_files(config.ads)), "id_render_version": str(ID_RENDER_VERSION),
            "embeddings_version": str(EMBEDDINGS_VERSION), "queries": file_hash(config.queries),
            "valid_queries": file_hash(config.valid_queries)}


#: ``run`` looks ``run_index`` up when called, so the refresh runs whatever this module's verb is then
STAGE = StageContract("index", IndexJobConfig, ArtifactKind.INDEX, inputs=index_inputs,
                      run=lambda config: run_index(config), wired=("out", "num_cpus", "progress", "previous", "queries", "valid_queries"))
