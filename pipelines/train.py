"""The train job: the library training loop inside Ray Train's ``TorchTrainer``.

``adbatch train --index DIR --out MODEL_DIR [--queries PAIRS.parquet] [--ads CORPUS.parquet]
[--init-model M] [--num-workers N --use-gpu true] [--train.epochs ...]``.

Every worker runs :func:`adbatch.training.train_on_index` with its rank and world size (Ray Train has
initialised torch.distributed; with several workers the model is DDP-wrapped and each rank takes its
share of the micro-batches); rank 0 writes the model folder (HF safetensors +
``adbatch_training.json`` with the index hash). The same code runs on one CPU worker (tests, the
CPU refresh under ``train.time_budget_s``), one GPU, or many. Inputs:

- ``index``: an index folder (``adbatch index``); its ``ad_codes.token_ids`` are the targets.
- ``ads``: the corpus the index was built from (``ad_id`` + ``text`` via :mod:`adbatch.index.corpus`),
  giving each ad's title for the indexing examples; optional for the ``text`` scheme (the index's
  own ``text`` column is used) and required for ``codes``.
- ``queries``: Parquet with ``query`` (string) and ``ad_id`` columns, the labelled *train-split*
  pairs for retrieval examples (none = indexing only), and, with ``train.pseudo_queries.source`` generated
  or mix, the pairs the query generator is tuned on (``query_gen``; the generated queries are cached in the
  model folder, ``generated_queries.parquet``, keyed by the content hash of their inputs).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from adbatch.artifacts import ArtifactKind
from adbatch.config import ConfigBase, ConfigError
from adbatch.training.checkpoint import TRAINING_RECORD
from adbatch.training.creatives import CreativeTuneConfig, CreativeTuneShape
from adbatch.training.query_generation import QueryGenConfig
from adbatch.training.trainer import TrainConfig
from pipelines.stage import StageContract

log = logging.getLogger(__name__)

__all__ = ["TrainJobConfig", "run_train", "preflight", "check_pairs_in_index", "run_train_warm", "train_inputs", "STAGE", "CreativeTrainJobConfig",
           "run_train_creatives", "train_creatives_inputs", "CREATIVES_STAGE", "read_labelled_queries",
           "read_validation_qrels", "read_ad_texts", "read_creative_pairs"]


@dataclasses.dataclass
class TrainJobConfig(ConfigBase):
    index: Path = dataclasses.field(default=Path("index"), metadata={"help": "index folder (adbatch index)"})
    out: Path = dataclasses.field(default=Path("model"), metadata={"help": "output model folder"})
    init_model: str | None = dataclasses.field(default=None, metadata={
        "help": "HF folder / GGUF / None = the default model; a folder trained on an earlier index = warm start"})
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    ads: Path | None = dataclasses.field(default=None, metadata={
        "help": "corpus Parquet (ad_id, text) for the ads' titles; required for the codes scheme"})
    queries: Path | None = dataclasses.field(default=None, metadata={
        "help": "Parquet of labelled train-split pairs (query, ad_id); None = indexing examples only"})
    valid_queries: Path | None = dataclasses.field(default=None, metadata={
        "help": "Parquet of validation pairs (query, ad_id[, grade]) for model selection (train.eval_every)"})
    creatives: CreativeTuneConfig = dataclasses.field(default_factory=CreativeTuneConfig, metadata={
        "help": "the shared creative shape: headline pairs mixed into this training (shape = shared)"})
    creative_pairs: Path | None = dataclasses.field(default=None, metadata={
        "help": "headline pairs (write_headline_pairs) for creatives.enabled; None = read them from ads"})
    query_gen: QueryGenConfig = dataclasses.field(default_factory=QueryGenConfig, metadata={
        "help": "the query generator, used when train.pseudo_queries.source is generated or mix (tuned on "
                "queries, the train split)"})
    num_workers: int = dataclasses.field(default=1, metadata={"help": "Ray Train workers"})
    use_gpu: bool | None = dataclasses.field(default=None, metadata={
        "help": "one GPU per worker; unset: yes when the Ray cluster has a GPU for every worker"})
    num_cpus: int | None = dataclasses.field(default=None, metadata={"help": "local Ray CPUs (None = all)"})

    def validate(self) -> None:
        if self.creatives.enabled and self.creatives.shape is not CreativeTuneShape.SHARED:
            raise ConfigError("TrainJobConfig.creatives: the train job mixes headline pairs in (shape = shared); "
                              "a separate creative model is trained by run_train_creatives (adbatch refresh does)")
        if self.creatives.enabled and self.creative_pairs is None and self.ads is None:
            raise ConfigError("TrainJobConfig.creatives.enabled needs the headline pairs: ads (the corpus) or creative_pairs")
        if self.num_workers < 1:
            raise ConfigError(f"TrainJobConfig.num_workers must be >= 1, got {self.num_workers}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"TrainJobConfig.num_cpus must be >= 1, got {self.num_cpus}")
        # model selection needs both; either alone would be silently ignored
        if self.valid_queries is not None and self.train.eval_every <= 0:
            raise ConfigError("TrainJobConfig.valid_queries is set but train.eval_every is 0 (no validation): "
                              "set train.eval_every (epochs between evaluations) or drop valid_queries")
        if self.valid_queries is None and self.train.eval_every > 0:
            raise ConfigError(f"TrainJobConfig: train.eval_every = {self.train.eval_every} needs valid_queries "
                              "(the validation pairs it evaluates)")


def _read_pairs(path: str | Path) -> tuple[Any, list[tuple[str, Any]]]:
    """The Parquet table and its (query, ad_id) pairs (``query`` and ``ad_id`` columns, nulls rejected)."""
    from adbatch.index.corpus import read_parquet_table

    table = read_parquet_table(Path(path), error=ConfigError)  # corrupt pages: an error naming the file
    missing = [c for c in ("query", "ad_id") if c not in table.column_names]
    if missing:
        raise ConfigError(f"{path}: labelled queries need column(s) {missing}; found {table.column_names}")
    queries, ads = table.column("query").to_pylist(), table.column("ad_id").to_pylist()
    bad = next((i for i, (q, a) in enumerate(zip(queries, ads)) if q is None or a is None or not str(q).strip()), None)
    if bad is not None:
        raise ConfigError(f"{path}: row {bad} has an empty query or a null ad_id")
    return table, list(zip(queries, ads))


def read_labelled_queries(path: str | Path) -> list[tuple[str, Any]]:
    """(query, ad_id) pairs from a Parquet with ``query`` and ``ad_id`` columns (nulls rejected)."""
    return _read_pairs(path)[1]


def read_ad_texts(path: str | Path, columns: dict[str, Any] | None = None) -> dict[Any, str]:
    """ad_id -> text of the valid rows of a corpus (the corpus contract of :mod:`adbatch.index.corpus`).

    ``columns``: the index's column mapping (``manifest['config']['columns']``), so the titles are
    read exactly as the index read them; None = the corpus defaults.
    """
    from adbatch.index.corpus import CorpusConfig, read_corpus

    corpus = read_corpus(path, CorpusConfig.from_dict(columns) if columns else None)
    table = corpus.table
    return dict(zip(table.column("ad_id").to_pylist(), table.column("text").to_pylist()))


def read_creative_pairs(pairs: str | Path | None, ads: str | Path | None, config: CreativeTuneConfig) -> Any:
    """Headline pairs for a creative fine-tune: a pairs file (``write_headline_pairs``) when given, else the
    corpus ``ads`` read with ``config.pairs`` (:func:`adbatch.training.creatives.read_headline_pairs`)."""
    from adbatch.training.creatives import load_headline_pairs, read_headline_pairs

    return load_headline_pairs(pairs) if pairs is not None else read_headline_pairs(ads, config.pairs)


def read_validation_qrels(path: str | Path) -> dict[str, dict[Any, float]]:
    """query -> {ad_id: grade} from a Parquet of validation pairs; without a ``grade`` column every
    listed pair counts as relevant (grade 3, the top of the Home Depot scale)."""
    table, pairs = _read_pairs(path)
    if not pairs:
        raise ConfigError(f"{path}: no validation pairs (model selection would be silently off)")
    grades = table.column("grade").to_pylist() if "grade" in table.column_names else [3.0] * len(pairs)
    qrels: dict[str, dict[Any, float]] = {}
    for (q, a), g in zip(pairs, grades):
        qrels.setdefault(str(q), {})[a] = float(g if g is not None else 3.0)
    return qrels


def _worker(loop_config: dict[str, Any]) -> None:
    """Ray Train worker body: load inputs, train on this rank's share, report the summary."""
    import ray.train
    import ray.train.torch

    from adbatch.index.build import load_index
    from adbatch.training import train_on_index

    job: TrainJobConfig = loop_config["job"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    index = load_index(job.index)
    columns = (index.manifest.get("config") or {}).get("columns")
    ad_texts = read_ad_texts(job.ads, columns) if job.ads is not None else None
    labelled = read_labelled_queries(job.queries) if job.queries is not None else []
    valid = read_validation_qrels(job.valid_queries) if job.valid_queries is not None else None
    pairs = read_creative_pairs(job.creative_pairs, job.ads, job.creatives) if job.creatives.enabled else None
    _, _, summary = train_on_index(index, job.out, job.train, ad_texts=ad_texts, labelled=labelled,
                                   valid_qrels=valid, init_model=job.init_model, device=str(device), rank=rank,
                                   world_size=world, progress=rank == 0, creative_pairs=pairs,
                                   creative_config=job.creatives if pairs is not None else None,
                                   query_gen=job.query_gen)
    ray.train.report(summary.flat())


def check_pairs_in_index(index_dir: str | Path, path: str | Path, ad_ids: list, what: str) -> None:
    """The ad ids of a pairs file (``ad_ids``, as read) against the ads of the index at ``index_dir``.

    None of them an ad of the index is refused (int ids never equal str ids: a wrong file or id column): for
    ``queries`` training would fail in every worker, for ``valid_queries`` every validation score would be 0,
    model selection would pick at random and the fusion would silently not be fitted. Some of them missing is
    allowed, with a warning naming how many: the index may hold a subset of the catalogue the queries were
    labelled on (the smoke runs do), and a validation query whose ad is missing lowers every checkpoint's score
    alike (the fusion fit skips it)."""
    import pyarrow.parquet as pq

    from adbatch.index.build import AD_CODES_FILE

    index_ids = pq.read_table(Path(index_dir) / AD_CODES_FILE, columns=["ad_id"]).column("ad_id").to_pylist()
    distinct = list(dict.fromkeys(ad_ids))
    if not distinct or not index_ids:
        return
    known = set(index_ids)
    missing = [a for a in distinct if a not in known]
    if len(missing) == len(distinct):
        kinds = sorted({type(a).__name__ for a in distinct})
        theirs = sorted({type(a).__name__ for a in index_ids})
        why = (f"its ad ids are {'/'.join(kinds)}, the index's {'/'.join(theirs)}, and the two never match"
               if set(kinds) != set(theirs) else "check that it was labelled on this index's catalogue")
        consequence = ("every validation score would be 0 and the fusion would not be fitted"
                       if what == "valid_queries" else "no training pair would name an ad")
        raise ConfigError(f"TrainJobConfig.{what}: none of the {len(distinct)} ad ids of {path} is an ad of index "
                          f"{index_dir} (e.g. {distinct[0]!r}; the index has e.g. {index_ids[0]!r}): {why}; "
                          f"{consequence}")
    if missing:
        log.warning("TrainJobConfig.%s: %d of %d ad ids of %s are not in index %s (e.g. %r): their pairs name no ad "
                    "of it (a subset catalogue?)%s", what, len(missing), len(distinct), path, index_dir, missing[0],
                    "; those validation queries score 0 for every checkpoint" if what == "valid_queries" else "")


def preflight(config: TrainJobConfig) -> None:
    """Every outside input of a train run, checked in the driver before Ray starts (the workers read them again),
    each failing with its own line (a user error, exit status 2):

    1. the index folder exists; 2. the input files given exist; 3. the starting model folder (safetensors, no
    custom code: the workers load it); 4. the labelled and validation pairs (schema, rows) and that they share
    no query; 5. the index is an index folder; 6. the pairs' ad ids against the index's
    (:func:`check_pairs_in_index`)."""
    if not Path(config.index).is_dir():
        raise FileNotFoundError(f"index folder not found: {config.index}")
    for name in ("ads", "queries", "valid_queries", "creative_pairs"):
        path = getattr(config, name)
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"TrainJobConfig.{name}: {path} not found")
    from adbatch.artifacts import ArtifactKind, artifact_kind
    from adbatch.models import check_model_folder, resolve_model

    check_model_folder(resolve_model(config.init_model))  # safetensors, no custom code: the workers load it
    # the labelled pairs are small: read (and checked) here, before Ray, though the workers read them again
    train_queries = read_labelled_queries(config.queries) if config.queries is not None else None
    valid_qrels = read_validation_qrels(config.valid_queries) if config.valid_queries is not None else None
    if train_queries is not None and valid_qrels is not None:
        shared = {str(q) for q, _ in train_queries} & set(valid_qrels)
        if shared:  # model selection on queries the model trained on measures memory, not retrieval
            raise ConfigError(f"{len(shared)} validation queries are also training queries (e.g. "
                             f"{sorted(shared)[0]!r}): split the labelled queries by query string")
    if artifact_kind(config.index) != ArtifactKind.INDEX.value:
        raise ConfigError(f"TrainJobConfig.index: {config.index} is not an index folder (adbatch index writes one)")
    if train_queries:
        check_pairs_in_index(config.index, config.queries, [a for _, a in train_queries], "queries")
    if valid_qrels:
        check_pairs_in_index(config.index, config.valid_queries,
                             [a for grades in valid_qrels.values() for a in grades], "valid_queries")


def run_train(config: TrainJobConfig) -> dict[str, Any]:
    """Train ``config.index`` into a model with Ray Train; returns rank 0's summary + the folder."""
    from adbatch.artifacts import ArtifactKind, claim_output

    preflight(config)
    # the model folder is replaced by a rename at the end (adbatch.training.checkpoint.save_trained), so
    # it is marked as the train stage's after that, not before
    with claim_output(config.out, ArtifactKind.TRAIN, mark=False):
        from adbatch.training.checkpoint import recover_interrupted_save

        recover_interrupted_save(config.out)  # an earlier save cut short between its renames
        return _train_into(config)


def _train_into(config: TrainJobConfig) -> dict[str, Any]:
    """The part of :func:`run_train` that starts Ray and writes: under the folder's claim."""
    from adbatch.artifacts import ArtifactKind, mark_output

    t0 = time.perf_counter()
    # Ray Train workers do not run in the driver's working directory: every local path is made
    # absolute here, the starting model too (None / "default" name the bundled model, not a path)
    init_model = config.init_model
    from adbatch.models import DEFAULT_MODEL

    if init_model not in (None, DEFAULT_MODEL) and Path(init_model).exists():
        init_model = str(Path(init_model).resolve())
    job = config.replace(index=Path(config.index).resolve(), out=Path(config.out).resolve(), init_model=init_model,
                         ads=Path(config.ads).resolve() if config.ads else None,
                         queries=Path(config.queries).resolve() if config.queries else None,
                         valid_queries=Path(config.valid_queries).resolve() if config.valid_queries else None,
                         creative_pairs=Path(config.creative_pairs).resolve() if config.creative_pairs else None)
    # Ray Train's run storage is temporary (the model folder is written by rank 0)
    _fit(_worker, job, config.num_workers, config.use_gpu, config.num_cpus, "adbatch-train")
    # rank 0's record in the model folder is the source of truth (Ray's reported metrics are a
    # convenience whose retention differs across Ray Train versions)
    from adbatch.training.checkpoint import read_training_record

    record = read_training_record(job.out)
    if record is None:
        raise RuntimeError(f"training finished but {job.out} has no training record")
    mark_output(job.out, ArtifactKind.TRAIN)
    out = {f"train_{k}": v for k, v in record["train"].items() if v is not None}
    out.update({"scheme": record["scheme"], "index_hash": record["trained_on_index"],
                "examples_indexing": record["data"].get("indexing", 0),
                "examples_retrieval": record["data"].get("retrieval", 0),
                "labelled_not_in_index": record["data"].get("labelled_not_in_index", 0),
                "examples_pseudo_query": record["data"].get("pseudo_query", 0),
                "examples_generated": record["data"].get("generated_query", 0)})
    if record.get("query_gen"):  # cached | generated | no_labels (trained on spans instead)
        out["query_gen_status"] = record["query_gen"]["status"]
    if record.get("sparsity"):
        out["sparsity_density"] = record["sparsity"].get("density")
    out["model_dir"] = str(job.out)
    out["wall_seconds"] = round(time.perf_counter() - t0, 3)
    out["num_workers"] = config.num_workers
    out["world_size"] = record.get("world_size", 1)  # the torch.distributed world rank 0 trained in
    return out


@dataclasses.dataclass
class CreativeTrainJobConfig(ConfigBase):
    """The separate creative model: the base model fine-tuned on headline pairs only
    (:func:`adbatch.training.creatives.tune_creatives` inside Ray Train, like the train job)."""

    out: Path = dataclasses.field(default=Path("creative_model"), metadata={"help": "output model folder"})
    ads: Path | None = dataclasses.field(default=None, metadata={"help": "ad corpus with a headline column"})
    pairs: Path | None = dataclasses.field(default=None, metadata={
        "help": "headline pairs file (write_headline_pairs); None = read them from ads with creatives.pairs"})
    init_model: str | None = dataclasses.field(default=None, metadata={"help": "base model; None = the default"})
    creatives: CreativeTuneConfig = dataclasses.field(default_factory=lambda: CreativeTuneConfig(enabled=True))
    num_workers: int = dataclasses.field(default=1, metadata={"help": "Ray Train workers"})
    use_gpu: bool | None = dataclasses.field(default=None, metadata={
        "help": "one GPU per worker; unset: yes when the Ray cluster has a GPU for every worker"})
    num_cpus: int | None = dataclasses.field(default=None, metadata={"help": "local Ray CPUs (None = all)"})

    def validate(self) -> None:
        if (self.ads is None) == (self.pairs is None):
            raise ConfigError("CreativeTrainJobConfig: give exactly one of ads (a corpus) and pairs (a pairs file)")
        if self.num_workers < 1:
            raise ConfigError(f"CreativeTrainJobConfig.num_workers must be >= 1, got {self.num_workers}")


def _creative_worker(loop_config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from adbatch.training.creatives import tune_creatives

    job: CreativeTrainJobConfig = loop_config["job"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    pairs = read_creative_pairs(job.pairs, job.ads, job.creatives)
    _, _, summary = tune_creatives(pairs, job.out, job.creatives, init_model=job.init_model,
                                   device=str(ray.train.torch.get_device()), rank=rank, world_size=world,
                                   progress=rank == 0)
    ray.train.report({f"train_{k}": v for k, v in summary["train"].items() if isinstance(v, (int, float, bool))})


def run_train_creatives(config: CreativeTrainJobConfig) -> dict[str, Any]:
    """Fine-tune the separate creative model into ``config.out`` (replaced atomically); returns its summary."""
    from adbatch.artifacts import ArtifactKind, claim_output, mark_output
    from adbatch.models import DEFAULT_MODEL
    from adbatch.training.checkpoint import read_training_record, recover_interrupted_save

    for name in ("ads", "pairs"):
        path = getattr(config, name)
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"CreativeTrainJobConfig.{name}: {path} not found")
    init_model = config.init_model
    if init_model not in (None, DEFAULT_MODEL) and Path(init_model).exists():
        init_model = str(Path(init_model).resolve())
    job = config.replace(out=Path(config.out).resolve(), init_model=init_model,
                         ads=Path(config.ads).resolve() if config.ads else None,
                         pairs=Path(config.pairs).resolve() if config.pairs else None)
    t0 = time.perf_counter()
    with claim_output(job.out, ArtifactKind.TRAIN, mark=False):
        recover_interrupted_save(job.out)
        _fit(_creative_worker, job, config.num_workers, config.use_gpu, config.num_cpus, "adbatch-creatives")
        record = read_training_record(job.out)
        if record is None:
            raise RuntimeError(f"creative fine-tune finished but {job.out} has no training record")
        mark_output(job.out, ArtifactKind.TRAIN)
    out = {f"train_{k}": v for k, v in record["train"].items() if isinstance(v, (int, float, bool, str))}
    out.update({"model_dir": str(job.out), "pairs": record["creative"]["pairs"]["pairs"],
                "wall_seconds": round(time.perf_counter() - t0, 3)})
    return out


def run_train_warm(job: TrainJobConfig, warm: Any, previous_index: Any, same_base_model: bool) -> dict[str, Any]:
    """:func:`run_train` from the model already in ``job.out`` (last night's) when
    :func:`adbatch.training.warm_start.plan_warm_start` allows, else from ``job.init_model``: the refresh's
    train stage. ``warm``: a :class:`WarmStartConfig`; ``previous_index``: the ``IndexSnapshot`` that model
    learned, read before the index stage replaced it (None: none). The model folder is replaced atomically
    at the end, so a crash keeps last night's model."""
    from adbatch.training.checkpoint import recover_interrupted_save
    from adbatch.training.warm_start import IndexSnapshot, plan_warm_start

    recover_interrupted_save(job.out)  # last night's model back in place if a save was cut short
    plan = plan_warm_start(job.out, previous_index, IndexSnapshot.read(job.index), job.train.epochs, warm,
                           same_base_model=same_base_model)
    log.info("train: %s start (%s), %g epochs", "warm" if plan.init_model else "cold", plan.reason, plan.epochs)
    if plan.init_model is not None:
        job = job.replace(init_model=plan.init_model, train=job.train.replace(epochs=plan.epochs))
    return {**run_train(job), "warm_start": plan.to_dict()}


def _pairs_hash(pairs: Path | None, ads: Path | None) -> dict[str, str]:
    """The headline pairs a fine-tune reads, by content: the pairs themselves when given as a file,
    else the corpus they are read from."""
    from pipelines.stage import file_hash

    if pairs is not None:
        from adbatch.training.creatives import load_headline_pairs

        return {"creative_pairs": load_headline_pairs(pairs).content_hash()}
    return {"creative_pairs_corpus": file_hash(ads)}


def train_inputs(config: TrainJobConfig) -> dict[str, Any]:
    """What invalidates a trained model beyond its config: the index (by its manifest), the starting model,
    the labelled / validation queries and the corpus by content, the targeting prompt's rendering version
    (a new rendering retrains) and, with the shared creative shape, the headline pairs and the tuned
    creative prompt's version."""
    from adbatch.serving.prompts import TARGETING_PROMPT_VERSION
    from pipelines.stage import file_hash, folder_hash, model_input_hash

    inputs = {"index": folder_hash(config.index), "init_model": model_input_hash(config.init_model),
              "targeting_prompt_version": str(TARGETING_PROMPT_VERSION)}
    for name in ("ads", "queries", "valid_queries"):
        if getattr(config, name) is not None:
            inputs[name] = file_hash(getattr(config, name))
    if config.creatives.enabled:
        from adbatch.serving.prompts import TUNED_CREATIVE_PROMPT_VERSION

        inputs.update(_pairs_hash(config.creative_pairs, config.ads))
        inputs["creative_prompt_version"] = str(TUNED_CREATIVE_PROMPT_VERSION)
    return inputs


def train_creatives_inputs(config: CreativeTrainJobConfig) -> dict[str, Any]:
    """What invalidates the separate creative model beyond its config: the headline pairs by content, the
    base model, and the tuned creative prompt's rendering version."""
    from adbatch.serving.prompts import TUNED_CREATIVE_PROMPT_VERSION
    from pipelines.stage import model_input_hash

    return {**_pairs_hash(config.pairs, config.ads), "init_model": model_input_hash(config.init_model),
            "creative_prompt_version": str(TUNED_CREATIVE_PROMPT_VERSION)}


def resolve_use_gpu(use_gpu: bool | None, num_workers: int) -> bool:
    """An explicit ``use_gpu``, else whether the running Ray cluster has a GPU for each of ``num_workers``
    (a refresh started on a GPU machine trains there without a flag; on a CPU machine it trains on CPU)."""
    if use_gpu is not None:
        return use_gpu
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) >= num_workers


def _fit(worker: Any, job: ConfigBase, num_workers: int, use_gpu: bool | None, num_cpus: int | None,
         name: str) -> None:
    """Run ``worker({"job": job})`` on ``num_workers`` Ray Train workers; raise if it failed. The job config
    travels typed (pickled) inside Ray Train's loop-config dict."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipelines.ray_runtime import init_ray

    init_ray(num_cpus=num_cpus)
    use_gpu = resolve_use_gpu(use_gpu, num_workers)
    log.info("%s: %d Ray Train worker(s), %s", name, num_workers, "one GPU each" if use_gpu else "on CPU")
    storage = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    trainer = TorchTrainer(worker, train_loop_config={"job": job},
                           scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
                           run_config=RunConfig(name=name, storage_path=str(storage)))
    try:
        result = trainer.fit()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}") from result.error


#: ``run`` looks the verb up when called, so the refresh runs whatever this module's ``run_train`` is then
STAGE = StageContract("train", TrainJobConfig, ArtifactKind.TRAIN, inputs=train_inputs,
                      run=lambda config: run_train(config), manifest=TRAINING_RECORD,
                      wired=("index", "out", "init_model", "ads", "num_cpus", "creatives", "creative_pairs"))
CREATIVES_STAGE = StageContract("train_creatives", CreativeTrainJobConfig, ArtifactKind.TRAIN,
                                inputs=train_creatives_inputs, run=lambda config: run_train_creatives(config),
                                manifest=TRAINING_RECORD,
                                wired=("out", "ads", "pairs", "init_model", "creatives", "num_workers", "num_cpus"))
