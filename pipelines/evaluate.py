"""``adbatch eval``: targeting and creative quality beside speed, written as ``report.md`` + PNGs.

Targeting runs on Home Depot (``../shared/data``; relevant = relevance >= 2.67): a catalogue subset
(:class:`adbatch.eval.datasets.HomeDepotConfig`), indexed by the index stage (text scheme) unless an index
is given, queries from one split. Rows: the dense model and the compressed checkpoint, each with
verification off and auto; an extra (index, model) pair such as a ``codes``-scheme trained model;
and the MiniLM + FAISS nearest-neighbour baseline on the same catalogue. Creatives run on the slogan
``test-curated.csv`` (all 994 rows unless ``creatives.max_examples`` bounds them): ROUGE-1/2/L F1,
BLEU (sacrebleu), METEOR (exact + stem), distinct-1/2, the prompt-copy share and the empty share
(:func:`adbatch.eval.report.creative_quality`), dense vs compressed, and a sample table. Every quality
number sits beside the throughput and latency measured with it.

Sample sizes are bounded by config (a 2-core CPU is slow). The models run through the same
generator classes as the generate stage (no Ray needed).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from adbatch.artifacts import (ArtifactKind, StageTimer, artifact_kind, build_manifest, check_output_owner,
                               claim_output, code_version, sha256_file, write_json_atomic, write_parquet_atomic)
from adbatch.config import ConfigBase, ConfigError
from adbatch.eval.datasets import HomeDepotConfig, QuerySplit
from adbatch.decoding import CreativeConfig, FusionMode, TargetSearchConfig, VerifyMode
from adbatch.serving.generators import CreativeGenerator, GenerateConfig, ModelSpec, TargetGenerator
from pipelines.stage import StageContract

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@dataclasses.dataclass
class TargetingEvalConfig(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "evaluate targeting"})
    home_depot: HomeDepotConfig = dataclasses.field(
        default_factory=lambda: HomeDepotConfig(csv_path=SHARED_DATA / "home_depot_relevance" / "train.csv",
                                                catalogue_size=1000))
    split: QuerySplit = dataclasses.field(default=QuerySplit.TEST, metadata={"help": "query split"})
    max_queries: int = dataclasses.field(default=40, metadata={"help": "queries evaluated (first, sorted)"})
    index: Path | None = dataclasses.field(
        default=None, metadata={"help": "index of the Home Depot catalogue; None = build one (text scheme)"})
    model: str | None = dataclasses.field(default=None, metadata={"help": "dense model; None = the default"})
    compressed: Path | None = dataclasses.field(default=None, metadata={"help": "compressed checkpoint"})
    extra_index: Path | None = dataclasses.field(
        default=None, metadata={"help": "a second index (e.g. codes scheme) with its trained model"})
    extra_model: str | None = dataclasses.field(default=None, metadata={"help": "the model trained on extra_index"})
    verify_modes: list[VerifyMode] = dataclasses.field(
        default_factory=lambda: [VerifyMode.OFF, VerifyMode.AUTO], metadata={"help": "verification modes compared"})
    channels: list[FusionMode] = dataclasses.field(
        default_factory=lambda: [FusionMode.HYBRID, FusionMode.GENERATIVE, FusionMode.DENSE],
        metadata={"help": "targeting channels compared: hybrid (fused), generative, dense (each alone)"})
    search: TargetSearchConfig = dataclasses.field(
        default_factory=lambda: TargetSearchConfig(num_beams=10, top_k=10))
    batch_size: int = dataclasses.field(default=8, metadata={"help": "queries per model call"})
    minilm: bool = dataclasses.field(default=True, metadata={"help": "include the MiniLM + FAISS baseline"})

    def validate(self) -> None:
        if self.max_queries < 1:
            raise ConfigError(f"TargetingEvalConfig.max_queries must be >= 1, got {self.max_queries}")
        if self.batch_size < 1:
            raise ConfigError(f"TargetingEvalConfig.batch_size must be >= 1, got {self.batch_size}")
        if (self.extra_index is None) != (self.extra_model is None):
            raise ConfigError("TargetingEvalConfig: extra_index and extra_model go together")
        if self.search.top_k < 10:  # the report's metrics are @10, the MiniLM baseline ranks 10
            raise ConfigError(f"TargetingEvalConfig.search.top_k must be >= 10 (recall@10 etc.), got {self.search.top_k}")
        if not self.verify_modes:
            raise ConfigError("TargetingEvalConfig.verify_modes must name at least one mode")
        if not self.channels:
            raise ConfigError("TargetingEvalConfig.channels must name at least one channel")


@dataclasses.dataclass
class CreativesEvalConfig(ConfigBase):
    enabled: bool = dataclasses.field(default=True, metadata={"help": "evaluate creatives"})
    csv: Path = dataclasses.field(default=SHARED_DATA / "slogan_gen" / "test-curated.csv",
                                  metadata={"help": "slogan test-curated.csv"})
    max_examples: int | None = dataclasses.field(
        default=None, metadata={"help": "first N rows evaluated; None = the whole file (994 rows)"})
    model: str | None = dataclasses.field(default=None, metadata={"help": "dense model; None = the default"})
    compressed: Path | None = dataclasses.field(default=None, metadata={"help": "compressed checkpoint"})
    creative: CreativeConfig = dataclasses.field(default_factory=lambda: CreativeConfig(max_new_tokens=16))
    batch_size: int = dataclasses.field(default=8, metadata={"help": "requests per model call"})
    samples: int = dataclasses.field(default=10, metadata={"help": "example outputs shown in the report"})

    def validate(self) -> None:
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError(f"CreativesEvalConfig.max_examples must be >= 1, got {self.max_examples}")
        if self.batch_size < 1:
            raise ConfigError(f"CreativesEvalConfig.batch_size must be >= 1, got {self.batch_size}")


@dataclasses.dataclass
class EvalJobConfig(ConfigBase):
    """``adbatch eval``: where the report goes and what it compares."""

    out: Path = dataclasses.field(default=Path("runs/eval"), metadata={"help": "report folder"})
    model: str | None = dataclasses.field(
        default=None, metadata={"help": "dense model for both tasks unless a task sets its own"})
    compressed: Path | None = dataclasses.field(
        default=None, metadata={"help": "compressed checkpoint for both tasks unless a task sets its own"})
    targeting: TargetingEvalConfig = dataclasses.field(default_factory=TargetingEvalConfig)
    creatives: CreativesEvalConfig = dataclasses.field(default_factory=CreativesEvalConfig)
    num_threads: int = dataclasses.field(default=0, metadata={"help": "torch threads (0 = default)"})


def _target_ranker(gen: TargetGenerator):
    def rank(queries: list[str]) -> list[list[str]]:
        table = pa.table({"request_id": [f"q{i}" for i in range(len(queries))], "query": queries})
        answers = gen(table)
        errors = [e for e in answers.column("error").to_pylist() if e]
        if errors:
            raise RuntimeError(f"targeting failed: {errors[0]}")
        return answers.column("ad_ids").to_pylist()
    return rank


def _build_hd_index(catalogue: pa.Table, out: Path) -> Path:
    from adbatch.index.build import IndexConfig, build_index

    cat_file = out / "hd_catalogue.parquet"
    write_parquet_atomic(catalogue.select(["ad_id", "title"]), cat_file)
    index_dir = out / "hd_index"
    stamp = index_dir / "manifest.json"
    if stamp.is_file():
        from adbatch.artifacts import read_manifest

        if read_manifest(index_dir).get("inputs", {}).get("corpus") == sha256_file(cat_file):
            return index_dir
    build_index(cat_file, index_dir, IndexConfig(), progress=False)
    return index_dir


def eval_targeting(cfg: TargetingEvalConfig, out: Path, model: str | None, compressed: Path | None,
                   num_threads: int) -> dict[str, Any]:
    from adbatch.eval.datasets import load_home_depot
    from adbatch.index.build import load_index
    from adbatch.eval.targeting import EmbeddingRanker, embed_texts, evaluate_targeting, load_minilm

    if not Path(cfg.home_depot.csv_path).is_file():
        return {"skipped": f"Home Depot data not found at {cfg.home_depot.csv_path}"}
    data = load_home_depot(cfg.home_depot)
    qrels = {q: {str(a): g for a, g in grades.items()} for q, grades in data.qrels[cfg.split].items()}
    n_q = min(cfg.max_queries, len(qrels))
    index_dir = cfg.index or _build_hd_index(data.catalogue, out)
    index = load_index(index_dir)
    res: dict[str, Any] = {
        "catalogue": f"{data.catalogue.num_rows} Home Depot products (subset: {cfg.home_depot.relevant_fraction:.0%} "
                     f"relevant products of sampled queries, rest random; seed {cfg.home_depot.seed})",
        "query_split": f"{cfg.split.value} split (by query string, fractions {tuple(cfg.home_depot.split_fractions)}), "
                       f"first {n_q} of {len(qrels)} sorted queries with a relevant product in the catalogue",
        "index": f"{index_dir} (scheme {index.scheme.value}, {index.num_ads} ads)",
        "rows": [],
    }
    model = cfg.model or model
    compressed = cfg.compressed or compressed
    variants: list[tuple[str, Path, ModelSpec, list[VerifyMode]]] = [
        ("dense", Path(index_dir), ModelSpec(model=model), cfg.verify_modes)]
    if compressed:
        variants.append(("compressed", Path(index_dir), ModelSpec(compressed=str(compressed)), cfg.verify_modes))
    if cfg.extra_index:
        variants.append(("extra", Path(cfg.extra_index), ModelSpec(model=cfg.extra_model), cfg.verify_modes[:1]))
    gen_cfg = GenerateConfig(batch_size=cfg.batch_size, num_threads=num_threads)
    # the dense channel alone has no model and no verify mode: one row, with the first variant
    runs = [(name, ix_dir, spec, mode, channel) for name, ix_dir, spec, modes in variants for channel in cfg.channels
            for mode in (modes if channel is not FusionMode.DENSE else modes[:1])
            if channel is not FusionMode.DENSE or name == variants[0][0]]
    for name, ix_dir, spec, mode, channel in runs:
        scheme = load_index(ix_dir).scheme.value
        row: dict[str, Any] = {"variant": name if channel is not FusionMode.DENSE else "index embeddings",
                               "channel": channel.value, "scheme": scheme,
                               "verify": mode.value if channel is not FusionMode.DENSE else None}
        try:
            gen = TargetGenerator(spec, ix_dir, cfg.search.replace(verify=mode, fusion=channel), gen_cfg)
            m = evaluate_targeting(_target_ranker(gen), qrels, ks=(1, 10), batch_size=cfg.batch_size,
                                   max_queries=n_q)
        except (ValueError, RuntimeError, OSError) as exc:  # another index's model, a missing checkpoint
            log.warning("targeting %s/%s/%s not evaluated: %s", name, channel.value, mode.value, exc)
            row["note"] = f"not evaluated: {exc}"[:160]
            res["rows"].append(row)
            continue
        row.update({k: m.get(k) for k in ("recall@1", "recall@10", "mrr@10", "ndcg@10")})
        row.update({"queries": int(m["queries"]), "queries_per_s": m["queries_per_s"],
                    "ms_per_query": 1000.0 * m["seconds"] / max(m["queries"], 1),
                    "note": f"model load {gen.load_seconds:.1f}s"})
        res["rows"].append(row)
        log.info("targeting %s/%s/%s: %s", name, channel.value, mode.value, row)
    if cfg.minilm:
        encoder = load_minilm()
        t0 = time.perf_counter()
        ids = [str(a) for a in data.catalogue.column("ad_id").to_pylist()]
        ranker = EmbeddingRanker(encoder, ids, embed_texts(encoder, data.catalogue.column("title").to_pylist()), k=10)
        build_s = time.perf_counter() - t0
        m = evaluate_targeting(ranker, qrels, ks=(1, 10), batch_size=cfg.batch_size, max_queries=n_q)
        res["rows"].append({"variant": f"MiniLM+{ranker.backend.value}", "scheme": "embedding", "verify": None,
                            **{k: m.get(k) for k in ("recall@1", "recall@10", "mrr@10", "ndcg@10")},
                            "queries": int(m["queries"]), "queries_per_s": m["queries_per_s"],
                            "ms_per_query": 1000.0 * m["seconds"] / max(m["queries"], 1),
                            "note": f"catalogue embedded in {build_s:.1f}s"})
    return res


def eval_creatives(cfg: CreativesEvalConfig, model: str | None, compressed: Path | None,
                   num_threads: int) -> dict[str, Any]:
    from adbatch.eval.datasets import load_slogan_test
    from adbatch.serving.prompts import creative_prompt_text
    from adbatch.eval.report import creative_quality

    if not Path(cfg.csv).is_file():
        return {"skipped": f"slogan test data not found at {cfg.csv}"}
    full = load_slogan_test(cfg.csv)
    table = full if cfg.max_examples is None else full.slice(0, cfg.max_examples)
    refs = table.column("reference").to_pylist()
    requests = pa.table({"request_id": table.column("ad_id"), "ad_id": table.column("ad_id"),
                         "advertiser": table.column("advertiser"),
                         "description": table.column("description"), "industry": table.column("industry")})
    fields = requests.select(["advertiser", "description", "industry"]).to_pylist()
    ads = table.select(["advertiser", "description", "industry", "url"]).to_pylist()
    model = cfg.model or model
    compressed = cfg.compressed or compressed
    variants = [("dense", ModelSpec(model=model))]
    if compressed:
        variants.append(("compressed", ModelSpec(compressed=str(compressed))))
    rows, outputs = [], {}
    gen_cfg = GenerateConfig(batch_size=cfg.batch_size, num_threads=num_threads)
    for name, spec in variants:
        try:
            gen = CreativeGenerator(spec, cfg.creative, gen_cfg)
            t0 = time.perf_counter()
            answers = []
            for s in range(0, requests.num_rows, cfg.batch_size):
                answers.append(gen(requests.slice(s, cfg.batch_size)))
            secs = time.perf_counter() - t0
        except (ValueError, RuntimeError, OSError) as exc:  # e.g. a missing or damaged checkpoint
            log.warning("creatives %s not evaluated: %s", name, exc)
            rows.append({"variant": name, "note": f"not evaluated: {exc}"[:160]})
            continue
        ans = pa.concat_tables(answers)
        hyps = [(h[0] if h else "") for h in ans.column("headlines").to_pylist()]
        flagged = [bool(f and f[0]) for f in ans.column("flags").to_pylist()]  # the written (first) headline's checks
        outputs[name] = hyps
        # the text each headline was written from (the prompt this model reads): what the copy share compares against
        prompt_texts = [creative_prompt_text(r, style=gen.prompt_style) for r in fields]
        # truthfulness against each ad's own record (its url too: the headline may name what the ad says anywhere)
        rows.append({"variant": name, **creative_quality(hyps, refs, prompt_texts, ads=ads),
                     "flagged_share": sum(flagged) / max(len(flagged), 1), "examples": len(hyps),
                     "requests_per_s": len(hyps) / secs, "ms_per_request": 1000.0 * secs / len(hyps),
                     "note": f"{cfg.creative.strategy.value}, max {cfg.creative.max_new_tokens} tokens"})
        log.info("creatives %s: %s", name, rows[-1])
    adv = table.column("advertiser").to_pylist()
    samples = [{"advertiser": adv[i], "reference": refs[i], "outputs": {k: v[i] for k, v in outputs.items()}}
               for i in range(min(cfg.samples, len(refs)))]
    return {"data": str(cfg.csv), "examples": len(refs), "rows_in_file": full.num_rows, "rows": rows,
            "samples": samples}


def _check_index(index: Path, name: str) -> None:
    """``index`` (the field ``name``) is there, is an index folder, and its files match its manifest."""
    from adbatch.index.build import load_index

    if not Path(index).is_dir():
        raise FileNotFoundError(f"{name}: index folder not found: {index}")
    if artifact_kind(index) != ArtifactKind.INDEX.value:
        raise ConfigError(f"{name}: {index} is not an index folder (adbatch index writes one)")
    load_index(index)  # every file it lists, by its manifest's sha256


def preflight(config: EvalJobConfig) -> None:
    """Every outside input of an eval run whose mistake would end the run, checked in the driver before its
    ``--out`` is claimed and before a model loads, each failing with its own line (a user error, exit status 2):

    1. ``out`` is not another stage's folder (:func:`adbatch.artifacts.check_output_owner`; claimed again under its
    lock when the run starts); with targeting on: 2. the Home Depot CSV, when it is there, has the columns it is
    read by (:data:`adbatch.eval.datasets.HOME_DEPOT_COLUMNS`); 3. ``targeting.index`` and ``targeting.extra_index``,
    when given, are there, are index folders, and their files match their manifests; with creatives on: 4. the
    slogan CSV, when it is there, has its columns (:data:`adbatch.eval.datasets.SLOGAN_COLUMNS`).

    Not refused here, as before: an evaluation data file that is not there (its section is reported skipped)
    and a model or checkpoint that cannot load (its rows say why: tests/test_generate_eval.py). Nothing an earlier
    stage of the refresh writes is read here, so the refresh runs this same pre-flight before its first stage."""
    from adbatch.eval.datasets import (HOME_DEPOT_COLUMNS, HOME_DEPOT_ENCODING, SLOGAN_COLUMNS, SLOGAN_ENCODING,
                                       check_csv_columns)

    check_output_owner(config.out, ArtifactKind.EVAL)
    t, c = config.targeting, config.creatives
    if t.enabled:
        if Path(t.home_depot.csv_path).is_file():
            check_csv_columns(t.home_depot.csv_path, HOME_DEPOT_COLUMNS, HOME_DEPOT_ENCODING)
        for name in ("index", "extra_index"):
            if getattr(t, name) is not None:
                _check_index(getattr(t, name), f"TargetingEvalConfig.{name}")
    if c.enabled and Path(c.csv).is_file():
        check_csv_columns(c.csv, SLOGAN_COLUMNS, SLOGAN_ENCODING)


def run_eval(config: EvalJobConfig) -> dict[str, Any]:
    """Evaluate and write ``out/report.md``, PNGs, ``results.json`` and ``manifest.json``.

    Its inputs are checked (:func:`preflight`) and the output folder claimed before a model loads."""
    out = Path(config.out)
    preflight(config)
    with claim_output(out, ArtifactKind.EVAL):
        return _eval_into(config, out)


def _eval_into(config: EvalJobConfig, out: Path) -> dict[str, Any]:
    """The part of :func:`run_eval` that writes: under the folder's claim."""
    from adbatch.eval.report import write_report

    timer = StageTimer()
    results: dict[str, Any] = {"meta": {"created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "machine": f"{platform.node()} ({platform.machine()}, "
                                                   f"{__import__('os').cpu_count()} CPUs)",
                                        "code_version": code_version()}}
    with timer.phase("targeting"):
        results["targeting"] = (eval_targeting(config.targeting, out, config.model, config.compressed,
                                               config.num_threads)
                                if config.targeting.enabled else {"skipped": "disabled in the config"})
    with timer.phase("creatives"):
        results["creatives"] = (eval_creatives(config.creatives, config.model, config.compressed,
                                               config.num_threads)
                                if config.creatives.enabled else {"skipped": "disabled in the config"})
    files = write_report(out, results)
    write_json_atomic(out / "results.json", results)
    manifest = build_manifest(
        stage="eval", config=config, inputs={}, outputs={p.name: sha256_file(p) for p in files.values()},
        counts={"targeting_rows": len(results["targeting"].get("rows", [])),
                "creative_rows": len(results["creatives"].get("rows", []))},
        timings=timer.seconds)
    write_json_atomic(out / "manifest.json", manifest)
    return {"report": str(files["report"]), "targeting": results["targeting"].get("rows", results["targeting"]),
            "creatives": results["creatives"].get("rows", results["creatives"]), "timings_s": manifest["timings_s"]}


def _model_or_reason(model: str | None) -> str:
    from pipelines.stage import model_input_hash

    try:
        return model_input_hash(model)
    except (OSError, ValueError) as e:  # not resolvable here: the eval stage will say why
        return f"unresolved: {e}"


def eval_inputs(config: EvalJobConfig) -> dict[str, Any]:
    """What invalidates a report beyond its config: the evaluation data files and every model, checkpoint
    and index it names (``model`` None = the default model) by content. Their paths are in the config,
    their contents are not: a re-trained model or an updated test file re-runs the evaluation."""
    from pipelines.stage import file_hash, folder_hash

    t, c = config.targeting, config.creatives
    data = {"home_depot_csv": file_hash(t.home_depot.csv_path), "slogans_csv": file_hash(c.csv)}
    folders = {"model": _model_or_reason(config.model), "compressed": folder_hash(config.compressed),
               "targeting.compressed": folder_hash(t.compressed), "targeting.index": folder_hash(t.index),
               "targeting.extra_index": folder_hash(t.extra_index),
               "creatives.compressed": folder_hash(c.compressed)}
    for name, model in (("targeting.model", t.model), ("targeting.extra_model", t.extra_model),
                        ("creatives.model", c.model)):
        if model is not None:
            folders[name] = _model_or_reason(model)
    return {"data": data, "folders": {k: v for k, v in folders.items() if v is not None}}


#: ``run`` looks the verb up when called, so the refresh runs whatever this module's ``run_eval`` is then
STAGE = StageContract("eval", EvalJobConfig, ArtifactKind.EVAL, inputs=eval_inputs,
                      run=lambda config: run_eval(config), wired=("out",))
