"""The nightly refresh: index -> train -> compress -> generate -> eval, skipping unchanged stages.

Run it with ``python jobs/nightly_refresh.py --config examples/refresh.toml`` (in-process Ray), under
``ray job submit -- python jobs/nightly_refresh.py --config ...`` (joins the cluster through
``RAY_ADDRESS``), or as ``adbatch refresh --config ...``.

Each stage is a module of ``pipelines/`` exposing a :class:`pipelines.stage.StageContract`: its job
config, ``inputs(config)`` (what invalidates its output: files by content, format / prompt / id
versions), its output manifest and ``run``. A stage's section here holds ``enabled`` (where a stage can
be off), its job config under ``config`` and the refresh's own choices for it (which model serves,
stable ids, warm start); the refresh fills in the job config's ``wired`` fields (the output folder and
the paths of upstream outputs, e.g. the compress job's ``model`` is the train stage's folder) and
refuses a section that sets them. Adding a stage: a module with its contract, and its line below.

Every stage writes into ``<work>/<stage>`` and, when it succeeds, a stamp ``<work>/_refresh/<stage>.json``
holding the hash of its job config, its ``inputs`` and the hash of its own output manifest. On the next
run a stage is skipped when all three still match: its inputs and config are unchanged since its last
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

import pipelines.compress as compress_stage
import pipelines.evaluate as eval_stage
import pipelines.generate as generate_stage
import pipelines.index as index_stage
import pipelines.train as train_stage
from adbatch.artifacts import ArtifactKind, claim_output, sha256_file, sha256_json, verify_outputs, write_json_atomic
from adbatch.config import ConfigBase, ConfigError
from adbatch.index.clustering import require_updatable
from adbatch.serving.requests import GenerateTask
from adbatch.training.creatives import CreativeTuneConfig, CreativeTuneShape
from adbatch.training.warm_start import WarmStartConfig
from pipelines.compress import CompressJobConfig
from pipelines.evaluate import EvalJobConfig
from pipelines.generate import GenerateJobConfig
from pipelines.index import IndexJobConfig
from pipelines.stage import StageContract
from pipelines.train import TrainJobConfig

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
    config: IndexJobConfig = dataclasses.field(
        default_factory=lambda: IndexJobConfig(ads=Path("examples/slogan_ads.parquet")), metadata={
            "help": "the index job (its out, previous, num_cpus and progress are the refresh's)"})
    stable_ids: bool = dataclasses.field(default=True, metadata={
        "help": "ads already in the last run's index keep their codes; new ads join the nearest clusters"})

    def validate(self) -> None:
        index_stage.STAGE.check_unwired(self.config, "index.config")
        if self.stable_ids:  # refused here, before any stage runs, not on the index stage's first night
            require_updatable(self.config.index.cluster)


@dataclasses.dataclass
class TrainStage(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "train the index into the model"})
    config: TrainJobConfig = dataclasses.field(default_factory=TrainJobConfig, metadata={
        "help": "the train job (its index, out, init_model, ads, creatives and creative_pairs are the refresh's)"})
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    creatives: CreativeTuneConfig = dataclasses.field(default_factory=CreativeTuneConfig, metadata={
        "help": "creative fine-tune on the corpus's own headlines (stage train_creatives for shape separate; "
                "mixed into this stage's training for shape shared)"})
    creatives_hold_out_requested: bool = dataclasses.field(default=True, metadata={
        "help": "never train on the ads generate.creatives_requests asks headlines for"})

    def validate(self) -> None:
        train_stage.STAGE.check_unwired(self.config, "train.config")
        # checked when the file is read, not when the stage's job is built after the earlier stages ran
        if self.creatives.enabled and self.creatives.shape is CreativeTuneShape.SHARED and not self.enabled:
            raise ConfigError("train.creatives.shape = shared mixes the headline pairs into the targeting training: "
                              "it needs train.enabled (or shape = separate)")


@dataclasses.dataclass
class CompressStage(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "compress the model"})
    # calib None: this refresh's ads and (labelled, else pseudo) queries as the served model reads them
    config: CompressJobConfig = dataclasses.field(
        default_factory=lambda: CompressJobConfig(eval_texts=16, eval_seq_len=128), metadata={
            "help": "the compress job (its model, out, index, ads and queries are the refresh's)"})

    def validate(self) -> None:
        compress_stage.STAGE.check_unwired(self.config, "compress.config")


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
    creatives_model: CreativesModel = dataclasses.field(
        default=CreativesModel.BASE, metadata={"help": "base | served | tuned: which model writes creatives"})
    # dense by default: on the default model the engine runs dense matmuls at the creative buckets either way
    # (packed loses at its shapes), so the INT4 copy buys no speed and costs 1.3 % ROUGE-L (29.88 vs 30.28,
    # 994 slogan test rows, H200, bench/RESULTS.md); compressed is for models where the packed kernels win
    creatives_use: GenerateWith = dataclasses.field(default=GenerateWith.DENSE, metadata={
        "help": "dense | compressed: how the separate creative model (creatives_model = tuned) is served; "
                "compressed fine-tunes it with QAT from step 0 and compresses it (stage compress_creatives) "
                "with the compress stage's settings"})
    config: GenerateJobConfig = dataclasses.field(
        default_factory=lambda: GenerateJobConfig(partition_size=64), metadata={
            "help": "both tasks' generate job (task, requests, index, model, compressed and out are the refresh's)"})

    def validate(self) -> None:
        generate_stage.STAGE.check_unwired(self.config, "generate.config")


@dataclasses.dataclass
class EvalStage(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "write the evaluation report"})
    config: EvalJobConfig = dataclasses.field(default_factory=EvalJobConfig, metadata={
        "help": "the eval job (its out is the refresh's; models left unset are the refresh's)"})

    def validate(self) -> None:
        eval_stage.STAGE.check_unwired(self.config, "eval.config")


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

    def run(self, stage: Stage, contract: StageContract, job: ConfigBase,
            run: Callable[[], dict[str, Any]] | None = None, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run ``job`` (``run``, default ``contract.run(job)``) unless the stamp says the same config and
        inputs (``contract.inputs(job)`` unless given) produced the output manifest that is there now."""
        config_hash = sha256_json(_portable(job.to_dict()))
        inputs = contract.inputs(job) if inputs is None else inputs
        output = contract.manifest_file(job)
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
        result = run() if run is not None else contract.run(job)
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


def _creative_pairs(config: RefreshConfig, ads: Path, req_files: dict[GenerateTask, list[Path]],
                    work: Path) -> tuple[Path, str]:
    """The creative fine-tune's (fields -> headline) pairs from the ad corpus, written to
    ``<work>/creative_pairs.parquet``: never the ads the creatives requests ask for
    (``train.creatives_hold_out_requested``) nor a row of the creatives evaluation file (by description
    or headline). Returns the file and the pairs' content hash."""
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


def _eval_paths_absolute(job: EvalJobConfig) -> EvalJobConfig:
    """The eval job's user-given data files and folders, made absolute the way :func:`_abs` does."""
    t, c = job.targeting, job.creatives
    return job.replace(
        model=job.model, compressed=_abs(job.compressed),
        targeting=t.replace(home_depot=t.home_depot.replace(csv_path=_abs(t.home_depot.csv_path)),
                            compressed=_abs(t.compressed), index=_abs(t.index), extra_index=_abs(t.extra_index)),
        creatives=c.replace(csv=_abs(c.csv), compressed=_abs(c.compressed)))


def _compress_job(config: RefreshConfig, model_dir: str | None) -> CompressJobConfig:
    """The compress stage's job for the model at ``model_dir``. Without a calibration file it calibrates on what the
    served model reads -- this refresh's ads (the texts its index was built from) and its labelled queries (else
    span pseudo-queries) rendered as the targeting prompt + the ad's target."""
    work = Path(config.work)
    calib = _abs(config.compress.config.calib)
    served = calib is None
    return config.compress.config.replace(
        model=model_dir, calib=calib, out=work / "compressed", index=work / "index" if served else None,
        ads=_abs(config.index.config.ads) if served else None,
        queries=_abs(config.train.config.queries) if served else None, num_cpus=config.num_cpus)


def _check_inputs(config: RefreshConfig) -> dict[GenerateTask, list[Path]]:
    """Every input from outside the refresh, checked before Ray starts and before the first stage runs (a
    bad one found by the last stage wasted the hours of the first ones): the corpus's content, the request
    files' schema and data pages, the base model folder, the labelled queries, and the pre-flights of the
    index, compress and eval stages on the jobs the night will run. Inputs one stage makes for the next are
    checked by that stage (its pre-flight runs again when it starts). Returns the request files by task."""
    from adbatch.models import check_model_folder, resolve_model
    from adbatch.serving.requests import check_request_data

    ads = _abs(config.index.config.ads)
    if not ads.exists():
        raise FileNotFoundError(f"RefreshConfig.index.config.ads: {config.index.config.ads} not found")
    tjob = config.train.config if config.train.enabled else None
    # the index stage's own pre-flight, on the job the refresh will run (its labelled queries are the train stage's)
    index_stage.preflight(config.index.config.replace(
        ads=ads, out=str(Path(config.work) / "index"), queries=_abs(tjob.queries) if tjob else None,
        valid_queries=_abs(tjob.valid_queries) if tjob else None))
    gen = config.generate
    req_files = {}
    for task, path in ((GenerateTask.TARGETS, gen.targets_requests), (GenerateTask.CREATIVES, gen.creatives_requests)):
        if path is not None:
            req_files[task] = check_request_data(_abs(path), task)
    check_model_folder(resolve_model(config.model))
    if config.train.enabled:
        tjob = config.train.config
        if tjob.queries is not None:
            train_stage.read_labelled_queries(_abs(tjob.queries))
        if tjob.valid_queries is not None:
            train_stage.read_validation_qrels(_abs(tjob.valid_queries))
    if config.compress.enabled:
        # the index (and a model trained tonight) are written by earlier stages of this night: checked when it runs
        trained = config.train.enabled
        compress_stage.preflight(_compress_job(config, str(Path(config.work) / "model") if trained else config.model),
                                 upstream=("index", "model") if trained else ("index",))
    if config.eval.enabled:  # reads nothing an earlier stage writes: the models are not checked (its rows say why)
        eval_stage.preflight(_eval_paths_absolute(config.eval.config).replace(out=Path(config.work) / "eval"))
    return req_files


def run_refresh(config: RefreshConfig) -> dict[str, Any]:
    """The whole refresh; returns per-stage status/timings and where the outputs and report are."""
    from pipelines.ray_runtime import init_ray

    t_start = time.perf_counter()
    req_files = _check_inputs(config)
    # the work folder is the refresh's; each stage claims its own sub-folder in turn
    with claim_output(config.work, ArtifactKind.REFRESH):
        init_ray(config.num_cpus)
        return _refresh_into(config, req_files, t_start)


def _refresh_into(config: RefreshConfig, req_files: dict[GenerateTask, list[Path]], t_start: float) -> dict[str, Any]:
    """The part of :func:`run_refresh` that runs the stages: under the work folder's claim. Each stage's
    job is its section's job config with the wired paths filled in (``StageContract.wired``)."""
    from adbatch.training.warm_start import IndexSnapshot

    runner = _Runner(config)
    work = runner.work
    gen = config.generate

    # --- index
    ads = _abs(config.index.config.ads)
    index_dir = work / "index"
    # the index last night's model learned, read before the index stage replaces it (warm start)
    previous_index = IndexSnapshot.of(index_dir) if config.train.enabled else None
    # the train stage's labelled queries also tune the index's encoder (ids from a query-aligned space)
    tjob = config.train.config if config.train.enabled else None
    index_job = config.index.config.replace(ads=ads, out=str(index_dir), num_cpus=config.num_cpus, progress=False,
                                            previous=str(index_dir) if config.index.stable_ids else None,
                                            queries=_abs(tjob.queries) if tjob else None,
                                            valid_queries=_abs(tjob.valid_queries) if tjob else None)
    runner.run(Stage.INDEX, index_stage.STAGE, index_job)

    # --- headline pairs of the creative fine-tune (both shapes): chosen here, once, as a file the stages read
    tune = config.train.creatives
    pairs_file = None
    if tune.enabled:
        pairs_file, _ = _creative_pairs(config, ads, req_files, work)
    shared = tune.enabled and tune.shape is CreativeTuneShape.SHARED

    # --- train
    model_dir: str | None = config.model
    if config.train.enabled:
        tjob = config.train.config
        train_job = tjob.replace(index=index_dir, out=work / "model", init_model=config.model, ads=ads,
                                 queries=_abs(tjob.queries), valid_queries=_abs(tjob.valid_queries),
                                 num_cpus=config.num_cpus, creatives=tune if shared else CreativeTuneConfig(),
                                 creative_pairs=pairs_file if shared else None)
        # the stamp hashes the configured job; a warm start (decided only when the stage runs) changes
        # the starting model and epochs, not whether the stage is up to date
        inputs = train_stage.STAGE.inputs(train_job)
        previous = (_read(runner.stamp_file(Stage.TRAIN)) or {}).get("inputs") or {}
        runner.run(Stage.TRAIN, train_stage.STAGE, train_job, inputs=inputs,
                   run=lambda: train_stage.run_train_warm(train_job, config.train.warm_start, previous_index,
                                                          previous.get("init_model") == inputs["init_model"]))
        model_dir = str(train_job.out)

    # --- train_creatives: the separate creative model (base model + headline pairs)
    creative_dir: Path | None = None
    if tune.enabled and not shared:
        ctune = tune
        if gen.creatives_use is GenerateWith.COMPRESSED and not tune.train.qat.enabled:
            # served compressed: QAT over the fine-tune (its own start, 0 by default) is what keeps the INT4 copy
            # within 5 % of dense (RESULTS.md: -1.3 % with it, -7.5 % with QAT on the last 20 % only)
            ctune = tune.replace(train=tune.train.replace(qat=tune.train.qat.replace(enabled=True)))
        creative_dir = work / "creative_model"
        cjob = train_stage.CreativeTrainJobConfig(out=creative_dir, pairs=pairs_file, init_model=config.model,
                                                  creatives=ctune, num_workers=1, num_cpus=config.num_cpus)
        runner.run(Stage.TRAIN_CREATIVES, train_stage.CREATIVES_STAGE, cjob)

    # --- compress
    compressed_dir: Path | None = None
    creative_compressed: Path | None = None
    if config.compress.enabled:
        comp_job = _compress_job(config, model_dir)
        compressed_dir = Path(comp_job.out)
        runner.run(Stage.COMPRESS, compress_stage.STAGE, comp_job)
        # the separate creative model, compressed with the same settings (a QAT-trained model is quantized on
        # the grid its record names); calibration on the compress stage's default texts
        if creative_dir is not None and gen.creatives_use is GenerateWith.COMPRESSED:
            creative_compressed = work / "creative_compressed"
            ccomp_job = comp_job.replace(model=str(creative_dir), out=creative_compressed, index=None, ads=None,
                                         queries=None)
            runner.run(Stage.COMPRESS_CREATIVES, compress_stage.STAGE, ccomp_job)
    use_compressed = compressed_dir is not None and gen.use is GenerateWith.COMPRESSED

    # --- generate
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
        job = gen.config.replace(
            task=task, requests=_abs(path), index=index_dir, out=out,
            model=(config.model if from_base
                   else (None if creative_compressed else str(creative_dir)) if from_creative
                   else (None if use_compressed else model_dir)),
            compressed=(creative_compressed if from_creative
                        else compressed_dir if (use_compressed and not from_base) else None),
            num_cpus=config.num_cpus, overwrite=True, progress=False)
        gen_results[task.value] = runner.run(stage, generate_stage.STAGE, job)
        outputs[task.value] = str(out / task.value)

    # --- eval
    report = None
    if config.eval.enabled:
        eval_dir = work / "eval"
        base = _eval_paths_absolute(config.eval.config)
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
        runner.run(Stage.EVAL, eval_stage.STAGE, eval_job)
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
        answers = pq.read_table(outputs["targets"], columns=["request_id", "rank", "ad_id", "channel"]).to_pylist()
        ranked: dict[str, list[str]] = {}
        channel_of: dict[tuple[str, str], str] = {}
        for a in sorted(answers, key=lambda a: (a["request_id"], a["rank"])):
            ranked.setdefault(a["request_id"], []).append(a["ad_id"])
            channel_of[a["request_id"], a["ad_id"]] = a["channel"]
        query_of = {}
        if req_file and Path(req_file).is_file():
            req = pq.read_table(req_file, columns=["request_id", "query"])
            query_of = dict(zip(req.column("request_id").to_pylist(), req.column("query").to_pylist()))
        lines.append("targets (query -> top 3 ads; [the channel that proposed each: generative, dense or both]):")
        for rid in sorted(ranked)[:queries]:
            lines.append(f"  {query_of.get(rid, rid)!r}")
            lines += [f"    {i}. {ad}: {titles.get(ad, '?')} [{channel_of[rid, ad]}]" for i, ad in enumerate(ranked[rid][:3], 1)]
        tops = [r[0] for r in ranked.values() if r]
        if tops:
            common = max(set(tops), key=tops.count)
            lines.append(f"  {len(set(tops))} distinct top-1 ads over {len(tops)} queries; the most common, {common}, "
                         f"tops {tops.count(common)}")
    if "creatives" in outputs:
        from adbatch.serving.prompts import creative_prompt_text
        from adbatch.eval.report import empty_share, prompt_copy_share, prompt_echo_share

        req_file = ((_read(work / "generate" / "creatives" / "manifest.json") or {}).get("config") or {}).get("requests")
        made = [r for r in pq.read_table(outputs["creatives"]).to_pylist() if r["variant"] == 0]
        ad_of = {}
        if req_file and Path(req_file).is_file():
            ad_of = {r["ad_id"]: r for r in pq.read_table(req_file).to_pylist()}
        lines.append("creatives (ad -> headline; in brackets the ad's own title; FLAGGED: the checks it failed):")
        lines += [f"  {(ad_of.get(r['ad_id']) or {}).get('advertiser') or r['ad_id']} -> {r['headline']!r} "
                  f"[{titles.get(r['ad_id'], '?')}]" + (f" FLAGGED: {', '.join(r['flags'])}" if r.get("flags") else "")
                  for r in made[:ads]]
        flagged = sum(bool(r.get("flags")) for r in made)
        lines.append(f"  {flagged} of {len(made)} headlines flagged by the checks (invented entity, changed name, echo, "
                     "copy, length, repetition, unfinished, off topic; the flags column)")
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
    fusion = (record or {}).get("fusion")
    if fusion:
        m = fusion.get("fit_metrics") or {}
        how = (f"cosine + {fusion['weight_generative']:g} x generative log-prob ({fusion.get('generative_norm', 'sum')})"
               if fusion["method"] == "interpolation" else "reciprocal-rank fusion")
        lines.append(f"targets fused as {how}, fitted on {fusion['queries']} {fusion['fitted_on'].replace('_', '-')}: "
                     f"recall@10 there dense {m.get('dense_recall@10')}, generative {m.get('generative_recall@10')}, "
                     f"hybrid {m.get('hybrid_recall@10')}")
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
