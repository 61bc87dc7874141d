"""The nightly refresh: index -> train -> compress -> generate -> eval, skipping unchanged stages.

Run it with ``python jobs/nightly_refresh.py --config examples/refresh.toml`` (in-process Ray), under
``ray job submit -- python jobs/nightly_refresh.py --config ...`` (joins the cluster through
``RAY_ADDRESS``), or as ``adbatch refresh --config ...``.

Every stage writes into ``<work>/<stage>`` and, when it succeeds, a stamp ``<work>/_refresh/<stage>.json``
holding the hash of its config, the hashes of its inputs (the upstream stages' manifests, the ad
corpus, the request files, the base model) and the hash of its own output manifest. On the next run
a stage is skipped when all three still match: its inputs and config are unchanged since its last
successful output, and that output is still there untouched. A changed stage changes its manifest,
so everything downstream of it runs again.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script (``python jobs/nightly_refresh.py`` / ray job submit)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adbatch.artifacts import (ArtifactKind, claim_output, sha256_file, sha256_json, sha256_paths, verify_outputs,
                               write_json_atomic)
from adbatch.index.clustering import require_updatable
from adbatch.config import ConfigBase, ConfigError
from adbatch.compress import CalibrationConfig, CompressConfig
from adbatch.decoding import CreativeConfig, TargetSearchConfig
from adbatch.index.build import IndexConfig
from adbatch.training import TrainConfig
from adbatch.training.creatives import CreativeTuneConfig, CreativeTuneShape
from adbatch.training.warm_start import WarmStartConfig
from pipelines.evaluate import EvalJobConfig
from pipelines.generate import Executor
from adbatch.serving.requests import GenerateTask, RequestValidationConfig, list_request_files

log = logging.getLogger("adbatch.refresh")

REPO = Path(__file__).resolve().parent.parent
STAMP_DIR = "_refresh"


class Stage(str, enum.Enum):
    INDEX = "index"
    TRAIN = "train"
    TRAIN_CREATIVES = "train_creatives"
    COMPRESS = "compress"
    COMPRESS_CREATIVES = "compress_creatives"
    GENERATE_TARGETS = "generate_targets"
    GENERATE_CREATIVES = "generate_creatives"
    EVAL = "eval"


class GenerateWith(str, enum.Enum):
    """Which model the generate stage serves."""

    COMPRESSED = "compressed"  #: the compressed checkpoint (falls back to dense when compress is off)
    DENSE = "dense"  #: the trained (or base) dense model


class CreativesModel(str, enum.Enum):
    """Which model writes creatives. Training a small model on the ad index overwrites its
    instruction following (measured on the example: the trained SmolLM2-135M starts every headline
    with cluster labels such as "care therapy > ..."), so without the creative fine-tune creatives
    default to the base model (few-shot prompt)."""

    BASE = "base"  #: the base model the refresh started from (dense)
    SERVED = "served"  #: the same model as targets (trained, compressed if `use = compressed`)
    #: the creative fine-tune's model (``train.creatives``): the separate creative model (dense unless
    #: ``generate.creatives_use = compressed``), or with
    #: ``shape = shared`` the served model (compressed if ``use = compressed``)
    TUNED = "tuned"


@dataclasses.dataclass
class IndexStage(ConfigBase):
    ads: Path = dataclasses.field(default=Path("examples/slogan_ads.parquet"),
                                  metadata={"help": "ad corpus Parquet"})
    config: IndexConfig = dataclasses.field(default_factory=IndexConfig)
    stable_ids: bool = dataclasses.field(default=True, metadata={
        "help": "ads already in the last run's index keep their codes; new ads join the nearest clusters"})

    def validate(self) -> None:
        if self.stable_ids:  # refused here, before any stage runs, not on the index stage's first night
            require_updatable(self.config.cluster)


@dataclasses.dataclass
class TrainStage(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "train the index into the model"})
    queries: Path | None = dataclasses.field(
        default=None, metadata={"help": "labelled (query, ad_id) Parquet; None = indexing examples only"})
    config: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    num_workers: int = dataclasses.field(default=1, metadata={"help": "Ray Train workers"})
    creatives: CreativeTuneConfig = dataclasses.field(default_factory=CreativeTuneConfig, metadata={
        "help": "creative fine-tune on the corpus's own headlines (stage train_creatives for shape separate; "
                "mixed into this stage's training for shape shared)"})
    creatives_hold_out_requested: bool = dataclasses.field(default=True, metadata={
        "help": "never train on the ads generate.creatives_requests asks headlines for"})

    def validate(self) -> None:
        # checked when the file is read, not when the stage's job is built after the earlier stages ran
        if self.creatives.enabled and self.creatives.shape is CreativeTuneShape.SHARED and not self.enabled:
            raise ConfigError("train.creatives.shape = shared mixes the headline pairs into the targeting training: "
                              "it needs train.enabled (or shape = separate)")
        if self.num_workers < 1:
            raise ConfigError(f"TrainStage.num_workers must be >= 1, got {self.num_workers}")


@dataclasses.dataclass
class CompressStage(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "compress the model"})
    calib: Path | None = dataclasses.field(default=None, metadata={
        "help": "calibration texts; None = this refresh's ads and (labelled, else pseudo) queries as the "
                "served model reads them (targeting prompt + the ad's target)"})
    compress: CompressConfig = dataclasses.field(default_factory=CompressConfig)
    calibration: CalibrationConfig = dataclasses.field(default_factory=CalibrationConfig)
    eval_texts: int = dataclasses.field(default=16, metadata={"help": "held-out texts for perplexity"})
    eval_seq_len: int = dataclasses.field(default=128, metadata={"help": "tokens per perplexity block"})

    def validate(self) -> None:
        if self.eval_texts < 1:
            raise ConfigError(f"CompressStage.eval_texts must be >= 1, got {self.eval_texts}")
        if self.eval_seq_len < 2:
            raise ConfigError(f"CompressStage.eval_seq_len must be >= 2, got {self.eval_seq_len}")


@dataclasses.dataclass
class GenerateStage(ConfigBase):
    targets_requests: Path | None = dataclasses.field(
        default=Path("examples/requests_targets.parquet"), metadata={"help": "targets requests (None = skip)"})
    creatives_requests: Path | None = dataclasses.field(
        default=Path("examples/requests_creatives.parquet"), metadata={"help": "creatives requests (None = skip)"})
    # compressed by default: trained with the train defaults (QAT in the last 20 % of the steps), the INT4
    # checkpoint is the model training ended with and tests best: recall@10 0.602 vs 0.547 for its fp32
    # weights (0.579 for a run without QAT; H200, 5k-title check, bench/RESULTS.md). Speed: the engine times
    # packed against dense per layer shape and bucket and on the default model runs dense matmuls over the
    # dequantized INT4 weights (packed is slower there); on a CPU the checkpoint is dequantized at load
    use: GenerateWith = dataclasses.field(default=GenerateWith.COMPRESSED, metadata={
        "help": "dense | compressed: which model serves targets (compressed pays off where the packed "
                "kernels beat dense matmuls: large models, small batches)"})
    targets: TargetSearchConfig = dataclasses.field(default_factory=TargetSearchConfig)
    creatives: CreativeConfig = dataclasses.field(default_factory=CreativeConfig)
    creatives_model: CreativesModel = dataclasses.field(
        default=CreativesModel.BASE, metadata={"help": "base | served | tuned: which model writes creatives"})
    # dense by default: on the default model the engine runs dense matmuls at the creative buckets either way
    # (packed loses at its shapes), so the INT4 copy buys no speed and costs 1.3 % ROUGE-L (29.88 vs 30.28,
    # 994 slogan test rows, H200, bench/RESULTS.md); compressed is for models where the packed kernels win
    creatives_use: GenerateWith = dataclasses.field(default=GenerateWith.DENSE, metadata={
        "help": "dense | compressed: how the separate creative model (creatives_model = tuned) is served; "
                "compressed fine-tunes it with QAT from step 0 and compresses it (stage compress_creatives) "
                "with the compress stage's settings"})
    validation: RequestValidationConfig = dataclasses.field(default_factory=RequestValidationConfig)
    concurrency: int = dataclasses.field(default=1, metadata={"help": "generation actors"})
    batch_size: int | None = dataclasses.field(
        default=None, metadata={"help": "requests per model call (default by device, see adbatch generate)"})
    partition_size: int = dataclasses.field(default=64, metadata={"help": "requests per output partition"})
    executor: Executor = dataclasses.field(default=Executor.RAY, metadata={"help": "ray | local"})

    def validate(self) -> None:
        for name in ("concurrency", "batch_size", "partition_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"GenerateStage.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class EvalStage(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "write the evaluation report"})
    config: EvalJobConfig = dataclasses.field(default_factory=EvalJobConfig)


@dataclasses.dataclass
class RefreshConfig(ConfigBase):
    """``adbatch refresh`` / ``jobs/nightly_refresh.py``: the whole nightly run."""

    work: Path = dataclasses.field(default=Path("runs/refresh"), metadata={"help": "root of every stage's output"})
    model: str | None = dataclasses.field(default=None, metadata={"help": "base model; None = the default"})
    num_cpus: int | None = dataclasses.field(default=None, metadata={"help": "CPUs of a local Ray"})
    force: list[str] = dataclasses.field(default_factory=list, metadata={"help": "stages to run even if unchanged"})
    index: IndexStage = dataclasses.field(default_factory=IndexStage)
    train: TrainStage = dataclasses.field(default_factory=TrainStage)
    compress: CompressStage = dataclasses.field(default_factory=CompressStage)
    generate: GenerateStage = dataclasses.field(default_factory=GenerateStage)
    eval: EvalStage = dataclasses.field(default_factory=EvalStage)

    def validate(self) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"RefreshConfig.num_cpus must be >= 1, got {self.num_cpus}")
        if self.generate.creatives_model is CreativesModel.TUNED and not self.train.creatives.enabled:
            raise ConfigError("generate.creatives_model = tuned needs train.creatives.enabled (the creative fine-tune)")
        if self.generate.creatives_use is GenerateWith.COMPRESSED:
            separate = self.train.creatives.shape is not CreativeTuneShape.SHARED
            if not (self.generate.creatives_model is CreativesModel.TUNED and separate and self.compress.enabled):
                raise ConfigError("generate.creatives_use = compressed serves the separate creative model compressed: "
                                  "it needs generate.creatives_model = tuned, train.creatives.shape = separate and "
                                  "compress.enabled (the served and shared models follow generate.use)")
        known = {s.value for s in Stage} | {"all"}
        bad = [s for s in self.force if s not in known]
        if bad:
            raise ConfigError(f"RefreshConfig.force: unknown stage(s) {bad}; known: {sorted(known)}")


def _abs(path: Path | str | None) -> Path | None:
    """Relative paths in the config are relative to the repository (where examples/ lives)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_absolute():
        return p
    return p if p.exists() or not (REPO / p).exists() else REPO / p


def _portable(value: Any) -> Any:
    """A job config as a stamp hashes it: paths inside the repository relative to it, so the same
    config started from another working directory (where ``_abs`` makes them absolute) matches."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(REPO):
        return str(Path(value).relative_to(REPO))
    return value


class _Runner:
    """Runs stages in order, each only when its stamp does not match."""

    def __init__(self, config: RefreshConfig) -> None:
        self.config = config
        self.work = Path(config.work)
        self.summary: dict[str, Any] = {"stages": {}, "work": str(self.work)}

    def stamp_file(self, stage: Stage) -> Path:
        return self.work / STAMP_DIR / f"{stage.value}.json"

    def run(self, stage: Stage, job_config: ConfigBase, inputs: dict[str, str], output: Path,
            fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run ``fn`` unless the stamp says the same config + inputs produced ``output``."""
        config_hash = sha256_json(_portable(job_config.to_dict()))
        stamp = _read(self.stamp_file(stage))
        forced = stage.value in self.config.force or "all" in self.config.force
        current_out = sha256_file(output) if output.is_file() and _outputs_intact(output) else None
        if (not forced and stamp and stamp.get("config_hash") == config_hash
                and stamp.get("inputs") == inputs and current_out == stamp.get("output_hash")):
            log.info("stage %s: unchanged since %s, skipped", stage.value,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stamp["finished_unix"])))
            self.summary["stages"][stage.value] = {"status": "skipped", "seconds": 0.0,
                                                   "output": str(output.parent)}
            return stamp.get("result", {})
        log.info("stage %s: running (%s)", stage.value,
                 "forced" if forced else "no stamp" if not stamp else "inputs or config changed")
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        if not output.is_file():
            raise RuntimeError(f"stage {stage.value} finished without writing {output}")
        write_json_atomic(self.stamp_file(stage), {
            "stage": stage.value, "config_hash": config_hash, "inputs": inputs,
            "output_hash": sha256_file(output), "finished_unix": time.time(),
            "seconds": round(seconds, 3), "result": result})
        self.summary["stages"][stage.value] = {"status": "ran", "seconds": round(seconds, 3),
                                               "output": str(output.parent)}
        return result


def _train_warm_or_cold(job: Any, warm: WarmStartConfig, previous_index: Any, same_base_model: bool) -> dict[str, Any]:
    """Run the train stage from last night's model in ``job.out`` when :func:`plan_warm_start` allows
    (the model folder is replaced atomically at the end, so a crash keeps last night's model)."""
    from adbatch.training.checkpoint import recover_interrupted_save
    from adbatch.training.warm_start import IndexSnapshot, plan_warm_start
    from pipelines.train import run_train

    recover_interrupted_save(job.out)  # last night's model back in place if a save was cut short
    plan = plan_warm_start(job.out, previous_index, IndexSnapshot.read(job.index), job.train.epochs, warm,
                           same_base_model=same_base_model)
    log.info("train: %s start (%s), %g epochs", "warm" if plan.init_model else "cold", plan.reason, plan.epochs)
    if plan.init_model is not None:
        job = job.replace(init_model=plan.init_model, train=job.train.replace(epochs=plan.epochs))
    return {**run_train(job), "warm_start": plan.to_dict()}


def _creative_pairs(config: RefreshConfig, ads: Path, req_files: dict[GenerateTask, list[Path]],
                    work: Path) -> tuple[Path, str]:
    """The creative fine-tune's (fields -> headline) pairs from the ad corpus, written to
    ``<work>/creative_pairs.parquet``: never the ads the creatives requests ask for
    (``train.creatives_hold_out_requested``) nor a row of the creatives evaluation file (by description
    or headline). Returns the file and the pairs' content hash (the fine-tune's input key)."""
    import pyarrow.parquet as pq

    from adbatch.training.creatives import read_headline_pairs, write_headline_pairs

    held_ids: list[Any] = []
    if config.train.creatives_hold_out_requested:
        for f in req_files.get(GenerateTask.CREATIVES, []):
            held_ids += pq.read_table(f, columns=["ad_id"]).column("ad_id").to_pylist()
    held_texts: list[str] = []
    test_csv = _abs(config.eval.config.creatives.csv)
    if test_csv is not None and Path(test_csv).is_file():
        from adbatch.eval.datasets import load_slogan_test

        test = load_slogan_test(test_csv)
        held_texts = test.column("description").to_pylist() + test.column("reference").to_pylist()
    pairs = read_headline_pairs(ads, config.train.creatives.pairs, exclude_ad_ids=held_ids, exclude_texts=held_texts)
    if not len(pairs):
        raise ConfigError(f"train.creatives: no headline pairs in {ads} ({pairs.stats}): check train.creatives.pairs.headline")
    path = write_headline_pairs(pairs, work / "creative_pairs.parquet")
    return path, pairs.content_hash()


def _outputs_intact(output: Path) -> bool:
    """Whether every file a stage's manifest lists under ``outputs`` (path relative to the manifest ->
    sha256) is still there unchanged: an intact manifest beside a deleted or damaged shard, partition
    or index file must re-run the stage, not be skipped into a failure downstream."""
    manifest = _read(output) or {}
    if not isinstance(manifest.get("outputs"), dict):
        return True
    try:
        verify_outputs(output.parent, manifest)
    except (FileNotFoundError, ValueError) as exc:
        log.warning("stage output missing or changed since its manifest was written: %s", exc)
        return False
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _model_hash(model: str | None) -> str:
    from adbatch.serving.generators import ModelSpec

    return ModelSpec(model=model).identity()["sha256"]


def _folder_hash(path: Path | str | None, kind: str) -> str | None:
    """Content hash of a configured model / checkpoint / index folder (None when not configured)."""
    if path is None:
        return None
    if kind == "model":
        try:
            return _model_hash(str(path))
        except (OSError, ValueError) as e:  # not resolvable here: the eval stage will say why
            return f"unresolved: {e}"
    manifest = _abs(path) / "manifest.json"
    return sha256_file(manifest) if manifest.is_file() else "absent"


def _eval_inputs(job: Any) -> dict[str, Any]:
    """What the eval stage reads beyond its (stamped) config: the evaluation data files and every model,
    checkpoint and index the user's eval config names (``job`` = ``eval.config`` before the refresh
    fills in its own models, which the stage's other inputs already identify). Their paths are in the
    config, their contents are not: a re-trained override model or an updated test file re-runs the stage."""
    t, c = job.targeting, job.creatives
    data = {}
    for name, path in (("home_depot_csv", t.home_depot.csv_path), ("slogans_csv", c.csv)):
        f = _abs(path)
        data[name] = sha256_file(f) if f.is_file() else "absent"
    folders = {"model": _folder_hash(job.model, "model"), "compressed": _folder_hash(job.compressed, "dir"),
               "targeting.model": _folder_hash(t.model, "model"), "targeting.compressed": _folder_hash(t.compressed, "dir"),
               "targeting.index": _folder_hash(t.index, "dir"), "targeting.extra_index": _folder_hash(t.extra_index, "dir"),
               "targeting.extra_model": _folder_hash(t.extra_model, "model"),
               "creatives.model": _folder_hash(c.model, "model"), "creatives.compressed": _folder_hash(c.compressed, "dir")}
    return {"data": data, "folders": {k: v for k, v in folders.items() if v is not None}}


def run_refresh(config: RefreshConfig) -> dict[str, Any]:
    """The whole refresh; returns per-stage status/timings and where the outputs and report are."""
    from pipelines.ray_runtime import init_ray

    t_start = time.perf_counter()
    # fail on unusable inputs before Ray starts and before any stage spends time
    ads = _abs(config.index.ads)
    if not ads.exists():
        raise FileNotFoundError(f"RefreshConfig.index.ads: {config.index.ads} not found")
    gen = config.generate
    req_files = {}
    for task, path in ((GenerateTask.TARGETS, gen.targets_requests), (GenerateTask.CREATIVES, gen.creatives_requests)):
        if path is not None:
            from adbatch.serving.requests import check_request_schema

            req_files[task] = check_request_schema(_abs(path), task)
    # the work folder is the refresh's; each stage claims its own sub-folder in turn
    with claim_output(config.work, ArtifactKind.REFRESH):
        init_ray(config.num_cpus)
        return _refresh_into(config, req_files, t_start)


def _refresh_into(config: RefreshConfig, req_files: dict[GenerateTask, list[Path]], t_start: float) -> dict[str, Any]:
    """The part of :func:`run_refresh` that runs the stages: under the work folder's claim."""
    runner = _Runner(config)
    work = runner.work
    gen = config.generate

    # --- index
    from pipelines.index import IndexJobConfig, run_index

    ads = _abs(config.index.ads)
    index_dir = work / "index"
    # the index last night's model learned, read before the index stage replaces it (warm start)
    from adbatch.training.warm_start import IndexSnapshot

    previous_index = IndexSnapshot.of(index_dir) if config.train.enabled else None
    index_job = IndexJobConfig(ads=str(ads), out=str(index_dir), index=config.index.config,
                               num_cpus=config.num_cpus, progress=False,
                               previous=str(index_dir) if config.index.stable_ids else None)
    from adbatch.index.ids import ID_RENDER_VERSION

    # a new id rendering rebuilds the index (and so everything trained on it) even when nothing else changed
    runner.run(Stage.INDEX, index_job, {"ads": sha256_paths(list_request_files(ads)),
                                        "id_render_version": str(ID_RENDER_VERSION)},
               index_dir / "manifest.json", lambda: run_index(index_job))
    index_in = sha256_file(index_dir / "manifest.json")

    # --- headline pairs of the creative fine-tune (both shapes): chosen here, once, as a file the stages read
    tune = config.train.creatives
    pairs_file, pairs_hash = None, None
    if tune.enabled:
        pairs_file, pairs_hash = _creative_pairs(config, ads, req_files, work)
    shared = tune.enabled and tune.shape is CreativeTuneShape.SHARED

    # --- train
    base_hash = _model_hash(config.model)
    model_dir: str | None = config.model
    model_in = base_hash
    if config.train.enabled:
        from pipelines.train import TrainJobConfig

        model_out = work / "model"
        train_job = TrainJobConfig(index=index_dir, out=model_out, init_model=config.model,
                                   train=config.train.config, ads=ads,
                                   queries=_abs(config.train.queries), num_workers=config.train.num_workers,
                                   num_cpus=config.num_cpus,
                                   creatives=tune if shared else CreativeTuneConfig(),
                                   creative_pairs=pairs_file if shared else None)
        from adbatch.serving.prompts import TARGETING_PROMPT_VERSION

        # a new prompt rendering invalidates the trained model even when nothing else changed
        inputs = {"index": index_in, "base_model": base_hash, "targeting_prompt_version": str(TARGETING_PROMPT_VERSION)}
        if shared:  # the headline pairs by content, and the tuned creative prompt's rendering
            from adbatch.serving.prompts import TUNED_CREATIVE_PROMPT_VERSION

            inputs.update({"creative_pairs": pairs_hash, "creative_prompt_version": str(TUNED_CREATIVE_PROMPT_VERSION)})
        if train_job.queries:
            inputs["queries"] = sha256_file(train_job.queries)
        # the stamp hashes the configured job; a warm start (decided only when the stage runs) changes
        # the starting model and epochs, not whether the stage is up to date
        previous_stamp = _read(runner.stamp_file(Stage.TRAIN)) or {}
        runner.run(Stage.TRAIN, train_job, inputs, model_out / "adbatch_training.json",
                   lambda: _train_warm_or_cold(train_job, config.train.warm_start, previous_index,
                                               (previous_stamp.get("inputs") or {}).get("base_model") == base_hash))
        model_dir = str(model_out)
        model_in = sha256_file(model_out / "adbatch_training.json")

    # --- train_creatives: the separate creative model (base model + headline pairs), retrained only when
    # the pairs, the base model, its config or the tuned prompt's rendering change
    creative_dir: Path | None = None
    creative_in: str | None = None
    if tune.enabled and not shared:
        from adbatch.serving.prompts import TUNED_CREATIVE_PROMPT_VERSION
        from pipelines.train import CreativeTrainJobConfig, run_train_creatives

        creative_dir = work / "creative_model"
        ctune = tune
        if gen.creatives_use is GenerateWith.COMPRESSED and not tune.train.qat.enabled:
            # served compressed: QAT over the fine-tune (its own start, 0 by default) is what keeps the INT4 copy
            # within 5 % of dense (RESULTS.md: -1.3 % with it, -7.5 % with QAT on the last 20 % only)
            ctune = tune.replace(train=tune.train.replace(qat=tune.train.qat.replace(enabled=True)))
        cjob = CreativeTrainJobConfig(out=creative_dir, pairs=pairs_file, init_model=config.model, creatives=ctune,
                                      num_workers=1, num_cpus=config.num_cpus)
        inputs = {"creative_pairs": pairs_hash, "base_model": base_hash,
                  "creative_prompt_version": str(TUNED_CREATIVE_PROMPT_VERSION)}
        runner.run(Stage.TRAIN_CREATIVES, cjob, inputs, creative_dir / "adbatch_training.json",
                   lambda: run_train_creatives(cjob))
        creative_in = sha256_file(creative_dir / "adbatch_training.json")

    # --- compress
    compressed_dir: Path | None = None
    creative_compressed: Path | None = None
    if config.compress.enabled:
        from pipelines.compress import CompressJobConfig, run_compress

        compressed_dir = work / "compressed"
        calib = _abs(config.compress.calib)
        # without a calibration file: calibrate on what the served model reads -- this refresh's ads (the
        # texts its index was built from) and its labelled queries (else span pseudo-queries) rendered as
        # the targeting prompt + the ad's target
        served = calib is None
        comp_job = CompressJobConfig(model=model_dir, calib=calib, out=compressed_dir,
                                     index=index_dir if served else None, ads=ads if served else None,
                                     queries=_abs(config.train.queries) if served else None,
                                     compress=config.compress.compress,
                                     calibration=config.compress.calibration,
                                     eval_texts=config.compress.eval_texts,
                                     eval_seq_len=config.compress.eval_seq_len, num_cpus=config.num_cpus)
        # the packed byte layout's version is an input: a checkpoint of an older layout is rebuilt
        # rather than skipped and then refused by the loader
        from kernels.nm_int4 import FORMAT_VERSION

        inputs = {"model": model_in, "packed_format_version": str(FORMAT_VERSION)}
        if comp_job.calib:
            inputs["calib"] = sha256_file(comp_job.calib)
        else:  # the calibration source by content: the index (its manifest hashes the ads) and the queries
            inputs["calibration_index"] = index_in
            if comp_job.queries:
                inputs["calibration_queries"] = sha256_file(comp_job.queries)
        runner.run(Stage.COMPRESS, comp_job, inputs, compressed_dir / "manifest.json",
                   lambda: run_compress(comp_job))
        # the separate creative model, compressed with the same settings (a QAT-trained model is quantized on
        # the grid its record names); calibration on the compress stage's default texts
        if creative_dir is not None and gen.creatives_use is GenerateWith.COMPRESSED:
            creative_compressed = work / "creative_compressed"
            ccomp_job = comp_job.replace(model=str(creative_dir), out=creative_compressed, calib=calib,
                                         index=None, ads=None, queries=None)
            inputs = {"model": creative_in, "packed_format_version": str(FORMAT_VERSION)}
            if calib:
                inputs["calib"] = sha256_file(calib)
            runner.run(Stage.COMPRESS_CREATIVES, ccomp_job, inputs, creative_compressed / "manifest.json",
                       lambda: run_compress(ccomp_job))
            creative_in = sha256_file(creative_compressed / "manifest.json")
    use_compressed = compressed_dir is not None and gen.use is GenerateWith.COMPRESSED
    serve_in = sha256_file(compressed_dir / "manifest.json") if use_compressed else model_in

    # --- generate
    from pipelines.generate import GenerateJobConfig, run_generate

    outputs: dict[str, str] = {}
    gen_results: dict[str, Any] = {}
    # the creatives are written by a model that learned the tuned creative prompt
    tuned_prompt = tune.enabled and (gen.creatives_model is CreativesModel.TUNED
                                     or (gen.creatives_model is CreativesModel.SERVED and shared))
    for task, stage, path in ((GenerateTask.TARGETS, Stage.GENERATE_TARGETS, gen.targets_requests),
                              (GenerateTask.CREATIVES, Stage.GENERATE_CREATIVES, gen.creatives_requests)):
        if path is None:
            continue
        out = work / "generate" / task.value
        creatives = task is GenerateTask.CREATIVES
        from_base = creatives and gen.creatives_model is CreativesModel.BASE
        from_creative = creatives and gen.creatives_model is CreativesModel.TUNED and creative_dir is not None
        job = GenerateJobConfig(
            task=task, requests=_abs(path), index=index_dir, out=out,
            model=(config.model if from_base
                   else (None if creative_compressed else str(creative_dir)) if from_creative
                   else (None if use_compressed else model_dir)),
            compressed=(creative_compressed if from_creative
                        else compressed_dir if (use_compressed and not from_base) else None),
            targets=gen.targets, creatives=gen.creatives, validation=gen.validation,
            concurrency=gen.concurrency, batch_size=gen.batch_size, partition_size=gen.partition_size,
            executor=gen.executor, num_cpus=config.num_cpus, overwrite=True, progress=False)
        inputs = {"requests": sha256_paths(req_files[task]),
                  "model": base_hash if from_base else creative_in if from_creative else serve_in, "index": index_in}
        if task is GenerateTask.CREATIVES:  # a new creative prompt rendering rewrites the headlines
            from adbatch.serving.prompts import CREATIVE_PROMPT_VERSION, TUNED_CREATIVE_PROMPT_VERSION

            inputs["creative_prompt_version"] = (f"tuned{TUNED_CREATIVE_PROMPT_VERSION}" if tuned_prompt
                                                 else str(CREATIVE_PROMPT_VERSION))
        gen_results[task.value] = runner.run(stage, job, inputs, out / "manifest.json",
                                             lambda job=job: run_generate(job))
        outputs[task.value] = str(out / task.value)

    # --- eval
    report = None
    if config.eval.enabled:
        from pipelines.evaluate import run_eval

        eval_dir = work / "eval"
        base = config.eval.config
        # targeting on Home Depot needs a model that has not learned another index: the base model;
        # creatives compare the served model dense (trained) vs compressed
        eval_job = base.replace(
            out=eval_dir, model=base.model or config.model, compressed=base.compressed or compressed_dir,
            creatives=base.creatives.replace(model=base.creatives.model or model_dir))
        if creative_dir is not None and gen.creatives_model is CreativesModel.TUNED:
            # creatives: the separate creative model, dense vs its own compressed copy when it is served so (the
            # compress stage's checkpoint is the targeting model's)
            eval_job = eval_job.replace(
                compressed=None, targeting=base.targeting.replace(compressed=base.targeting.compressed or base.compressed
                                                                  or compressed_dir),
                creatives=base.creatives.replace(model=base.creatives.model or str(creative_dir),
                                                 compressed=base.creatives.compressed or creative_compressed))
        inputs = {"model": base_hash, "served_model": model_in, "read": _eval_inputs(base)}
        if creative_in is not None:
            inputs["creative_model"] = creative_in
        if compressed_dir is not None:
            inputs["compressed"] = sha256_file(compressed_dir / "manifest.json")
        runner.run(Stage.EVAL, eval_job, inputs, eval_dir / "manifest.json", lambda: run_eval(eval_job))
        report = str(eval_dir / "report.md")

    summary = runner.summary
    summary.update({
        "index": str(index_dir), "model": model_dir, "compressed": str(compressed_dir) if compressed_dir else None,
        "creative_model": str(creative_dir) if creative_dir else None,
        "creative_compressed": str(creative_compressed) if creative_compressed else None,
        "creatives_prompt": "tuned" if tuned_prompt else "few_shot",
        "outputs": outputs, "report": report,
        "generate": {k: {"counts": v.get("counts"), "throughput": v.get("throughput")}
                     for k, v in gen_results.items()},
        "wall_seconds": round(time.perf_counter() - t_start, 3),
    })
    write_json_atomic(work / "refresh_summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Entry point for ``python jobs/nightly_refresh.py`` / ``ray job submit``; returns the summary."""
    from jobs.config_cli import parse_job_config

    return run_refresh(parse_job_config(RefreshConfig, argv, "refresh", __doc__.splitlines()[0]))


def _sample_lines(result: dict[str, Any], queries: int = 3, ads: int = 3) -> list[str]:
    """A few outputs a person can judge (query -> top 3 ads with their titles; ad -> headline) and one
    line of what this run's budget reached, read back from the files the stages wrote."""
    import pyarrow.parquet as pq

    lines: list[str] = []
    work = Path(result["work"])
    index_manifest = _read(work / "index" / "manifest.json") or {}
    titles: dict[str, str] = {}
    files = index_manifest.get("input_files") or []
    if len(files) == 1 and Path(files[0]).is_file():
        cols = (index_manifest.get("config") or {}).get("columns") or {}
        id_col, title_col = cols.get("ad_id") or "ad_id", cols.get("title") or "title"
        corpus = pq.read_table(files[0], columns=[id_col, title_col])
        titles = dict(zip(map(str, corpus.column(id_col).to_pylist()), corpus.column(title_col).to_pylist()))
    outputs = result.get("outputs") or {}
    tops: list[str] = []
    common = None
    if "targets" in outputs:
        req_file = ((_read(work / "generate" / "targets" / "manifest.json") or {}).get("config") or {}).get("requests")
        answers = pq.read_table(outputs["targets"], columns=["request_id", "rank", "ad_id"]).to_pylist()
        ranked: dict[str, list[str]] = {}
        for a in sorted(answers, key=lambda a: (a["request_id"], a["rank"])):
            ranked.setdefault(a["request_id"], []).append(a["ad_id"])
        query_of = {}
        if req_file and Path(req_file).is_file():
            req = pq.read_table(req_file, columns=["request_id", "query"])
            query_of = dict(zip(req.column("request_id").to_pylist(), req.column("query").to_pylist()))
        lines.append("targets (query -> top 3 ads):")
        for rid in sorted(ranked)[:queries]:
            lines.append(f"  {query_of.get(rid, rid)!r}")
            lines += [f"    {i}. {ad}: {titles.get(ad, '?')}" for i, ad in enumerate(ranked[rid][:3], 1)]
        tops = [r[0] for r in ranked.values() if r]
        if tops:
            common = max(set(tops), key=tops.count)
            lines.append(f"  {len(set(tops))} distinct top-1 ads over {len(tops)} queries; the most common, {common}, "
                         f"tops {tops.count(common)}")
    if "creatives" in outputs:
        from adbatch.serving.prompts import creative_prompt_text
        from adbatch.eval.report import empty_share, prompt_copy_share, prompt_echo_share

        req_file = ((_read(work / "generate" / "creatives" / "manifest.json") or {}).get("config") or {}).get("requests")
        made = [r for r in pq.read_table(outputs["creatives"], columns=["ad_id", "variant", "headline"]).to_pylist()
                if r["variant"] == 0]
        ad_of = {}
        if req_file and Path(req_file).is_file():
            ad_of = {r["ad_id"]: r for r in pq.read_table(req_file).to_pylist()}
        lines.append("creatives (ad -> headline; in brackets the ad's own title):")
        lines += [f"  {(ad_of.get(r['ad_id']) or {}).get('advertiser') or r['ad_id']} -> {r['headline']!r} "
                  f"[{titles.get(r['ad_id'], '?')}]" for r in made[:ads]]
        known = [r for r in made if r["ad_id"] in ad_of]
        if known:
            heads = [r["headline"] for r in known]
            style = result.get("creatives_prompt") or "few_shot"
            prompts = [creative_prompt_text(ad_of[r["ad_id"]], style=style) for r in known]
            share = prompt_copy_share(heads, prompts)
            lines.append(f"  {len(heads)} headlines: {prompt_echo_share(heads, prompts):.0%} echo the prompt (a field "
                         f"label, or half of its words), {share:.0%} take half of their own words from it, "
                         f"{empty_share(heads):.0%} empty")
    record = _read(Path(result["model"]) / "adbatch_training.json") if result.get("model") else None
    train = (record or {}).get("train") or {}
    if train:
        line = (f"this budget reached: {train.get('steps')} optimizer steps ({train.get('epochs_done', 0):.2%} of "
                f"an epoch at {train.get('tokens_per_s', 0):.0f} tokens/s"
                f"{', stopped by the time/step budget' if train.get('stopped_early') else ''})")
        if tops and tops.count(common) * 3 > len(tops):
            line += f"; too little for the model to tell the queries apart ({common} tops {tops.count(common)} of {len(tops)})"
        lines.append(line)
    creative = _read(Path(result["creative_model"]) / "adbatch_training.json") if result.get("creative_model") else None
    if creative:
        ct, pairs = creative.get("train") or {}, (creative.get("creative") or {}).get("pairs") or {}
        lines.append(f"creative fine-tune: {ct.get('steps')} optimizer steps on {pairs.get('pairs')} headline pairs "
                     f"({ct.get('epochs_done', 0):.1%} of an epoch, {ct.get('seconds', 0):.0f} s; the requested ads held out)")
    return lines


def _show(result: dict[str, Any]) -> None:
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
    try:
        samples = _sample_lines(result)
    except (OSError, ValueError, KeyError) as e:  # a sample print must not fail a finished refresh
        samples = [f"(no samples: {type(e).__name__}: {e})"]
    print("\n" + "\n".join(samples))
    print(f"\noutputs: {json.dumps(result['outputs'])}\nreport: {result['report']}\n"
          f"summary: {Path(result['work']) / 'refresh_summary.json'}")


if __name__ == "__main__":
    from jobs.config_cli import run_entrypoint

    sys.exit(run_entrypoint(main, "nightly_refresh", show=_show))
