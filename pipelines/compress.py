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
from typing import Any, Callable

from adbatch.artifacts import ArtifactKind
from adbatch.config import ConfigBase, ConfigError
from adbatch.compress.recipe import CalibrationConfig, CompressConfig
from pipelines.stage import StageContract

log = logging.getLogger(__name__)

__all__ = ["CompressJobConfig", "RayLayerExecutor", "run_compress", "compress_inputs", "STAGE"]


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


def run_compress(config: CompressJobConfig) -> dict[str, Any]:
    """Load, calibrate, compress (Ray), evaluate, save; returns a summary dict (printed by the CLI)."""
    from adbatch.artifacts import ArtifactKind, StageTimer, claim_output
    from adbatch.compress.calibration import load_calibration_texts
    from adbatch.models import check_model_folder, classify_model_arg, resolve_model

    timer = StageTimer()
    t_start = time.perf_counter()
    out = Path(config.out)
    calib_cfg = config.calibration
    if config.calib is not None:
        calib_cfg = calib_cfg.replace(path=config.calib)
    # inputs checked before Ray starts and before the folder is claimed: the model argument names a
    # model folder that can load (safetensors, no custom code), the calibration file reads
    classify_model_arg(config.model)
    check_model_folder(resolve_model(config.model))
    with timer.phase("calibrate"):
        if config.index is None:
            texts = load_calibration_texts(calib_cfg)
        else:  # needs the model's tokenizer: rendered after loading it, the inputs read here
            from adbatch.index.build import load_index

            load_index(config.index)
            texts = None
            if config.queries is not None:
                from pipelines.train import read_labelled_queries

                read_labelled_queries(config.queries)
    with claim_output(out, ArtifactKind.COMPRESS):
        return _compress_into(config, out, calib_cfg, texts, timer, t_start)


def _served_texts(config: CompressJobConfig, tok: Any, calib_cfg: CalibrationConfig) -> list[str]:
    """The ``--index`` calibration texts for the model's tokenizer ``tok``."""
    from adbatch.compress.calibration import served_calibration_texts

    pairs = []
    if config.queries is not None:
        from pipelines.train import read_labelled_queries

        pairs = read_labelled_queries(config.queries)
    return served_calibration_texts(config.index, tok, calib_cfg, queries=pairs, ads=config.ads)


def _compress_into(config: CompressJobConfig, out: Path, calib_cfg: CalibrationConfig, texts: list[str] | None,
                   timer: Any, t_start: float) -> dict[str, Any]:
    """The part of :func:`run_compress` that starts Ray and writes: under the folder's claim."""
    import torch

    from adbatch.artifacts import sha256_file
    from adbatch.compress.calibration import EXAMPLE_CORPUS, calibrate, example_corpus_split, token_blocks
    from adbatch.compress.checkpoint import save_compressed
    from adbatch.compress.linear import SequentialExecutor, compress_, densify_
    from adbatch.compress.report import EvalSets, evaluate, plot_layers, run_ablations, size_report, write_report
    from adbatch.models import load_causal_lm, resolve_model

    if config.use_ray:
        from pipelines.ray_runtime import init_ray

        with timer.phase("ray_init"):
            init_ray(config.num_cpus)
        executor = RayLayerExecutor()
    else:
        executor = SequentialExecutor(config.layer_device)
    with timer.phase("load"):
        model, tok = load_causal_lm(config.model, dtype=torch.float32, device="cpu")
    src = resolve_model(config.model)
    from adbatch.compress.recipe import follow_training_qat
    from adbatch.training.checkpoint import model_binding, read_training_record

    record = read_training_record(src)
    # the one compress config of this run (calibration, ablations, the checkpoint): a model trained with QAT
    # is quantized on the grid it trained on (uniform groups of its size), unless the config asks otherwise
    # (rule: adbatch.compress.recipe.follow_training_qat)
    compress_cfg, qat_note = follow_training_qat(config.compress, record)
    if qat_note:
        log.info("%s", qat_note)
    with timer.phase("calibrate"):
        if texts is None:
            texts = _served_texts(config, tok, calib_cfg)
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
