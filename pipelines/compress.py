"""The compression job: calibrate once, then mask + quantize + pack every layer as parallel Ray tasks.

``adbatch compress [--model M] [--index DIR [--queries PAIRS.parquet] | --calib PATH] --out DIR
[--ablations true]``. Calibration texts: ``--index`` = what the served model reads (the index's ad
texts, and queries rendered as the targeting prompt + the ad's target:
:func:`adbatch.compress.calibration.served_calibration_texts`); ``--calib`` = a file of texts; neither
= a sample of the bundled examples/slogan_ads.parquet. Each layer's weight and
statistics are ``ray.put`` once and shared by the two per-layer passes (importance, then
quantize+pack); the tasks run the same library functions as the sequential path, so the result is
bit-identical (tests/test_compress_ray.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Collection

from adbatch.artifacts import ArtifactKind
from adbatch.config import ConfigBase, ConfigError
from adbatch.compress.recipe import CalibrationConfig, CompressConfig
from pipelines.stage import StageContract

log = logging.getLogger(__name__)

__all__ = ["CompressJobConfig", "CompressPreflight", "preflight", "RayLayerExecutor", "run_compress", "compress_inputs",
           "STAGE"]


@dataclasses.dataclass
class CompressJobConfig(ConfigBase):
    model: str | None = dataclasses.field(default=None, metadata={
        "help": "local HF folder or GGUF file; None = the default SmolLM2-135M-Instruct"})
    calib: Path | None = dataclasses.field(default=None, metadata={
        "help": "calibration texts (.txt lines or Parquet); None and no --index = sample examples/slogan_ads.parquet"})
    index: Path | None = dataclasses.field(default=None, metadata={
        "help": "calibrate on what the model serving this index reads: its ads' texts and queries as "
                "targeting prompt + the ad's target (not with --calib)"})
    queries: Path | None = dataclasses.field(default=None, metadata={
        "help": "with --index: labelled (query, ad_id) Parquet for the query prompts; None = span "
                "pseudo-queries of the ads' titles"})
    ads: Path | None = dataclasses.field(default=None, metadata={
        "help": "with --index: the ad corpus it was built from; None = the files its manifest lists"})
    out: Path = dataclasses.field(default=Path("compressed"), metadata={"help": "output directory"})
    ablations: bool = dataclasses.field(default=False, metadata={
        "help": "also run the ablation variants (report.md table + PNGs)"})
    compress: CompressConfig = dataclasses.field(default_factory=CompressConfig)
    calibration: CalibrationConfig = dataclasses.field(default_factory=CalibrationConfig)
    eval_texts: int = dataclasses.field(default=128, metadata={
        "help": "held-out ad descriptions (never used for calibration) for perplexity"})
    eval_seq_len: int = dataclasses.field(default=256, metadata={"help": "tokens per perplexity block"})
    num_cpus: int | None = dataclasses.field(default=None, metadata={"help": "local Ray CPUs (None = all)"})
    use_ray: bool = dataclasses.field(default=True, metadata={
        "help": "run per-layer work as Ray tasks (false = the in-process loop; same result)"})
    layer_device: str | None = dataclasses.field(default=None, metadata={
        "help": "with use_ray=false: device of the per-layer math (e.g. cuda; one layer there at a "
                "time); None = CPU, the reference path"})
    keep_training_masks: bool = dataclasses.field(default=True, metadata={
        "help": "keep the N:M masks a training run saved beside the model (nm_masks.safetensors)"})

    def validate(self) -> None:
        if self.eval_texts < 1:
            raise ConfigError(f"CompressJobConfig.eval_texts must be >= 1, got {self.eval_texts}")
        if self.eval_seq_len < 2:
            raise ConfigError(f"CompressJobConfig.eval_seq_len must be >= 2, got {self.eval_seq_len}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"CompressJobConfig.num_cpus must be >= 1, got {self.num_cpus}")
        if self.calib is not None and self.index is not None:
            raise ConfigError("CompressJobConfig: calib and index both set; calibrate on one source "
                              "(index: what the served model reads; calib: a file of texts)")
        if self.index is None and (self.queries is not None or self.ads is not None):
            raise ConfigError("CompressJobConfig: queries / ads choose the index's calibration texts: set index too")
        if self.layer_device is not None and self.use_ray:
            raise ConfigError("CompressJobConfig.layer_device needs use_ray=false (Ray tasks run on CPU workers)")


def _run_layer(fn: Callable[[Any, Any], Any], item: Any, arg: Any) -> Any:
    return fn(item, arg)


class RayLayerExecutor:
    """:class:`adbatch.compress.linear.LayerExecutor` on Ray: one task per layer and pass."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._task = ray.remote(num_cpus=1)(_run_layer)

    def put(self, items):
        return [self._ray.put(x) for x in items]

    def map(self, fn, handles, args, desc: str = "layers"):
        from tqdm.auto import tqdm

        ray = self._ray
        refs = [self._task.remote(fn, h, a) for h, a in zip(handles, args)]
        pending = list(refs)
        with tqdm(total=len(refs), desc=desc, unit="layer", leave=False) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=min(len(pending), 8), timeout=1.0)
                bar.update(len(done))
        return ray.get(refs)


@dataclasses.dataclass
class CompressPreflight:
    """What :func:`preflight` read and checked: the calibration config of the run (``calib`` folded into its
    ``path``), the model's local folder and training record (None: none, or the model is ``upstream``), the
    calibration texts when they do not need the model's tokenizer (a file or the bundled example; None with
    ``index``: rendered after the model is loaded) and the labelled queries (with ``index``)."""

    calibration: CalibrationConfig
    model_dir: Path | None = None
    record: dict[str, Any] | None = None
    texts: list[str] | None = None
    queries: list = dataclasses.field(default_factory=list)


#: the fields :func:`preflight` can be told an earlier stage of the same run writes (``upstream``)
UPSTREAM_FIELDS = ("model", "index")


def preflight(config: CompressJobConfig, upstream: Collection[str] = ()) -> CompressPreflight:
    """Every outside input of a compress run, checked in the driver before its ``--out`` is claimed and before Ray
    starts, each failing with its own line (a user error, exit status 2):

    1. the job config validates (:meth:`CompressJobConfig.validate`); 2. ``out`` is not another stage's folder
    (:func:`adbatch.artifacts.check_output_owner`; claimed again under its lock when the run starts); 3. the model:
    a HF folder with ``config.json``, a GGUF file or the default (:func:`adbatch.models.classify_model_arg`), its
    folder loadable without pickle or custom code (:func:`adbatch.models.check_model_folder`) and its training
    record, when it has one, a JSON object; without ``index``: 4. the calibration texts, ``calib`` or the bundled
    example (:func:`adbatch.compress.calibration.load_calibration_texts`: the file is there, ``.txt``/``.md`` or a
    Parquet with ``text`` or ``title`` + ``description``, not empty); with ``index``: 5. the index folder is there,
    is an index, and its files match its manifest; 6. the ad corpus its texts are read from (``ads``, else the
    files its manifest lists) is there, with the index's columns; 7. the labelled queries (``query``, ``ad_id``, no
    empty row); always: 8. the bundled example holds ``calibration.num_texts`` + ``eval_texts`` ads (the held-out
    perplexity texts come from it).

    ``upstream``: the fields (of :data:`UPSTREAM_FIELDS`) whose folders an earlier stage of the same run writes
    (the refresh's train and index stages): not there yet, so their checks -- ``model``: 3; ``index``: 5 and 6,
    whose corpus the index stage's own pre-flight reads -- wait for this stage's pre-flight when it runs."""
    from adbatch.artifacts import ArtifactKind, artifact_kind, check_output_owner
    from adbatch.compress.calibration import check_example_split, load_calibration_texts

    unknown = set(upstream) - set(UPSTREAM_FIELDS)
    if unknown:
        raise ValueError(f"compress preflight: upstream names {sorted(unknown)}; known: {list(UPSTREAM_FIELDS)}")
    config.validate()
    check_output_owner(config.out, ArtifactKind.COMPRESS)
    calib_cfg = config.calibration if config.calib is None else config.calibration.replace(path=config.calib)
    found = CompressPreflight(calib_cfg)
    if "model" not in upstream:
        from adbatch.models import check_model_folder, resolve_model
        from adbatch.training.checkpoint import read_training_record

        found.model_dir = check_model_folder(resolve_model(config.model))  # resolve_model classifies the argument
        found.record = read_training_record(found.model_dir)
    if config.index is None:
        found.texts = load_calibration_texts(calib_cfg)
    else:
        if "index" not in upstream:
            from adbatch.compress.calibration import served_corpus_sources
            from adbatch.index.build import load_index
            from adbatch.index.corpus import check_corpus_schema

            if not Path(config.index).is_dir():
                raise FileNotFoundError(f"CompressJobConfig.index: index folder not found: {config.index}")
            if artifact_kind(config.index) != ArtifactKind.INDEX.value:
                raise ConfigError(f"CompressJobConfig.index: {config.index} is not an index folder (adbatch index "
                                  "writes one)")
            index = load_index(config.index)  # every file it lists, by its manifest's sha256
            sources, columns = served_corpus_sources(config.index, index.manifest, config.ads)
            for src in sources:
                check_corpus_schema(src, columns)
        if config.queries is not None:
            from pipelines.train import read_labelled_queries

            if not Path(config.queries).is_file():
                raise FileNotFoundError(f"CompressJobConfig.queries: {config.queries} not found")
            found.queries = read_labelled_queries(config.queries)
    check_example_split(calib_cfg.num_texts, config.eval_texts)
    return found


def run_compress(config: CompressJobConfig) -> dict[str, Any]:
    """Load, calibrate, compress (Ray), evaluate, save; returns a summary dict (printed by the CLI).

    Its inputs are checked (:func:`preflight`) and the output folder claimed before Ray starts."""
    from adbatch.artifacts import ArtifactKind, StageTimer, claim_output

    timer = StageTimer()
    t_start = time.perf_counter()
    out = Path(config.out)
    with timer.phase("calibrate"):  # the inputs, the calibration texts among them, are read here
        found = preflight(config)
    with claim_output(out, ArtifactKind.COMPRESS):
        return _compress_into(config, out, found, timer, t_start)


def _served_texts(config: CompressJobConfig, tok: Any, found: CompressPreflight) -> list[str]:
    """The ``--index`` calibration texts for the model's tokenizer ``tok``."""
    from adbatch.compress.calibration import served_calibration_texts

    return served_calibration_texts(config.index, tok, found.calibration, queries=found.queries, ads=config.ads)


def _compress_into(config: CompressJobConfig, out: Path, found: CompressPreflight, timer: Any,
                   t_start: float) -> dict[str, Any]:
    """The part of :func:`run_compress` that starts Ray and writes: under the folder's claim."""
    import torch

    from adbatch.artifacts import sha256_file
    from adbatch.compress.calibration import EXAMPLE_CORPUS, calibrate, example_corpus_split, token_blocks
    from adbatch.compress.checkpoint import save_compressed
    from adbatch.compress.linear import SequentialExecutor, compress_, densify_
    from adbatch.compress.report import EvalSets, evaluate, plot_layers, run_ablations, size_report, write_report
    from adbatch.models import load_causal_lm

    calib_cfg, texts, src, record = found.calibration, found.texts, found.model_dir, found.record
    if config.use_ray:
        from pipelines.ray_runtime import init_ray

        with timer.phase("ray_init"):
            init_ray(config.num_cpus)
        executor = RayLayerExecutor()
    else:
        executor = SequentialExecutor(config.layer_device)
    with timer.phase("load"):
        model, tok = load_causal_lm(config.model, dtype=torch.float32, device="cpu")
    from adbatch.compress.recipe import follow_training_qat
    from adbatch.training.checkpoint import model_binding

    # the one compress config of this run (calibration, ablations, the checkpoint): a model trained with QAT
    # is quantized on the grid it trained on (uniform groups of its size), unless the config asks otherwise
    # (rule: adbatch.compress.recipe.follow_training_qat)
    compress_cfg, qat_note = follow_training_qat(config.compress, record)
    if qat_note:
        log.info("%s", qat_note)
    with timer.phase("calibrate"):
        if texts is None:
            texts = _served_texts(config, tok, found)
        stats = calibrate(model, token_blocks(tok, texts, calib_cfg.seq_len), calib_cfg, compress_cfg.skip_modules)
    # held-out ads come from the other end of the same seeded permutation: disjoint from calibration
    _, held = example_corpus_split(calib_cfg.num_texts, config.eval_texts, calib_cfg.seed)
    sets = EvalSets.build(tok, held, config.eval_seq_len)
    with timer.phase("eval_dense"):
        dense_q = evaluate(model, sets)
    ablations = None
    if config.ablations:
        with timer.phase("ablations"):
            ablations = run_ablations(model, stats, sets, compress_cfg, executor)
    with timer.phase("compress"):
        masks = None
        if config.keep_training_masks:
            from adbatch.training.checkpoint import load_masks

            masks = load_masks(src) or None
            if masks:
                log.info("keeping %d N:M masks learned in training", len(masks))
        recipe = compress_(model, compress_cfg, stats, executor, masks=masks)
    with timer.phase("eval_compressed"):
        # a dequantized copy holds exactly the packed values (tests/test_compress_checkpoint.py checks
        # it against the CompressedLinear forward) and evaluates ~2x faster than unpacking per call
        evaluated = copy.deepcopy(model)
        densify_(evaluated)
        comp_q = evaluate(evaluated, sets)
        del evaluated
    quality = {**comp_q, **{f"dense_{k}": v for k, v in dense_q.items()}}
    sizes = size_report(recipe)
    inputs = {"model_config": sha256_file(src / "config.json")}
    if config.index is not None:
        from adbatch.artifacts import MANIFEST_NAME

        inputs["calibration_index"] = sha256_file(Path(config.index) / MANIFEST_NAME)
        if config.queries is not None:
            inputs["calibration_queries"] = sha256_file(config.queries)
    elif calib_cfg.path is None:
        inputs["calibration_corpus"] = sha256_file(EXAMPLE_CORPUS)
    else:
        inputs["calibration_corpus"] = sha256_file(calib_cfg.path)
    with timer.phase("save"):
        extra = {"job_config": config.to_dict(), "source_inputs": inputs, "quality": quality, "sizes": sizes}
        # a model trained on an index stays bound to it after compression (generation checks this), with its
        # tuned query embedder
        folders = {}
        if record is not None:
            extra.update(model_binding(record))
            if record.get("query_embedder"):  # only a folder inside the model's is copied in
                from adbatch.index.dense import tuned_embedder_dir

                folders[record["query_embedder"]["dir"]] = tuned_embedder_dir(src, record["query_embedder"])
        manifest = save_compressed(model, tok, recipe, out, extra_manifest=extra, folders=folders)
    with timer.phase("report"):
        plots = plot_layers(recipe, out)
        info = {"model": config.model or "default (SmolLM2-135M-Instruct)", "eval_tokens": sets.info()}
        report = write_report(out, recipe, quality, sizes, info, ablations, plots)
    total = time.perf_counter() - t_start
    result = {
        "out": str(out),
        "report": str(report),
        "quality": quality,
        "sizes": sizes,
        "summary": recipe.summary(),
        "calibration": recipe.calibration,
        "calibration_source": ("index" if config.index is not None else
                               "example" if calib_cfg.path is None else "file"),
        "group_policy": {"policy": compress_cfg.group_policy.value, "size": compress_cfg.reference_group_size,
                         "note": qat_note},
        "timings_s": {k: round(v, 2) for k, v in timer.seconds.items()} | {"total": round(total, 2)},
        "shards": sorted(manifest["shards"]),
    }
    if ablations is not None:
        result["ablations"] = ablations
    return result


def compress_inputs(config: CompressJobConfig) -> dict[str, Any]:
    """What invalidates a compressed checkpoint beyond its config: the model, the calibration source by
    content (the file; or the index, whose manifest hashes its ads, and the queries; or the bundled
    example corpus) and the packed byte layout's version (a checkpoint of an older layout is rebuilt
    rather than skipped and then refused by the loader)."""
    from adbatch.compress import FORMAT_VERSION
    from pipelines.stage import file_hash, folder_hash, model_input_hash

    inputs = {"model": model_input_hash(config.model), "packed_format_version": str(FORMAT_VERSION)}
    if config.calib is not None:
        inputs["calib"] = file_hash(config.calib)
    elif config.index is not None:
        inputs["calibration_index"] = folder_hash(config.index)
        for name in ("queries", "ads"):
            if getattr(config, name) is not None:
                inputs[f"calibration_{name}"] = file_hash(getattr(config, name))
    return inputs


#: ``run`` looks the verb up when called, so the refresh runs whatever this module's ``run_compress`` is then
STAGE = StageContract("compress", CompressJobConfig, ArtifactKind.COMPRESS, inputs=compress_inputs,
                      run=lambda config: run_compress(config),
                      wired=("model", "out", "index", "ads", "queries", "num_cpus"))
