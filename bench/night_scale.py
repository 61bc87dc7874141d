#!/usr/bin/env python3
"""The night at scale: the product's nightly refresh over the scale set, measured stage by stage.

A benchmark script, not a test (issue 56 items 2 and 4). It runs ``jobs.nightly_refresh.run_refresh`` -- the
function ``ray job submit -- python jobs/nightly_refresh.py`` runs -- on the config file the refresh reads
(``--config``, default ``examples/refresh.toml``; refresh flags after ``--`` go to the refresh's own parser),
with only its inputs and work folder pointed at a scale set (``bench/scale_set.py``: Markov ad titles, Zipf
target requests, creative requests) of ``--ads`` / ``--requests`` / ``--creatives`` rows, and the training
budget stated by ``--train-budget-s`` (both training stages; default: the config's).

Per stage that ran, from the refresh's own stamps (``<refresh>/_refresh/<stage>.json``: when it finished, how
long it took) and a sampler thread beside it (every ``--sample-interval-s``):

- wall seconds, rows and rows/s (index: ads indexed; train stages: examples trained; generate: requests
  answered; compress and eval: none -- they do not grow with the night's data);
- peak RSS of the driver, and summed over its process tree (the local Ray's raylet and workers included;
  pages shared between processes count once per process, so this overstates);
- on a GPU (``nvidia-smi`` lists one): peak memory used on the GPUs (device-wide: the stages run in Ray
  workers, so the driver's ``torch.cuda.max_memory_allocated`` would see none of it) and the GPU busy share
  (the mean of ``utilization.gpu``: the share of time a kernel was running); ``n/a`` on a CPU.

Every output is checked: ads indexed = ads in - rejected, targets / creatives answered = requests in -
rejected, no (request_id, rank) / (request_id, variant) / ad_id twice, no input lost (neither answered nor
rejected), nothing answered that was not asked. The cost of the night is its wall time x GPUs x
``--price-per-gpu-hour`` (default 2.50 USD, an on-demand H100 hour; a CPU run prices its wall time as one GPU
held, for scale only).

**Resume.** ``--work`` holds the scale set (``data/``), the refresh's work folder (``refresh/``) and
``measured.json`` (each stage's figures from the run that last ran it). A second invocation with the same
``--work`` runs the refresh again, which skips every stage whose config, inputs and output are unchanged
(and resumes a generate stage from its finished partitions); the report says which stages were skipped and
takes their figures from ``measured.json``, and checks the outputs again.

**Projection** (``--project``): each stage's measured seconds carried to 1M ads / 1M requests / 100k
creatives (``--project-to``) by the rule of what it grows with -- index: ads; train stages: ads, with the
step loop capped by the stated budget / max_steps / epochs; generate targets: the expected *distinct*
queries of the Zipf stream (the answer cache decodes a repeated query once); generate creatives: creative
requests; compress and eval: fixed. Generate's fixed start-up (Ray, actors, model load) is the stage's
seconds less its batches' decode time and is not scaled. Labelled "projected" wherever it is shown.

Writes ``--out``/night_scale.md (the tables) and ``night_scale.json`` (everything), and prints the tables.

    .venv/bin/python bench/night_scale.py --smoke                      # seconds: tiny model, tiny set
    .venv/bin/python bench/night_scale.py --ads 20000 --requests 200 --creatives 20 --project \\
        --work /tmp/night --out bench/results/night_scale_cpu_1208
    python3 bench/night_scale.py --ads 1000000 --requests 1000000 --creatives 100000 --train-budget-s 1800 \\
        -- --config examples/refresh.toml --generate.config.concurrency 1   # on a GPU (docs/scale.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from adbatch.config import ConfigBase, ConfigError  # noqa: E402

log = logging.getLogger("bench.night_scale")

#: the scale set's own ratio of distinct queries to requests (200,000 for 1,000,000): a smaller night keeps it,
#: so its repeats look like the full night's
POOL_PER_REQUEST = 0.2
ZIPF_EXPONENT = 1.0
#: an on-demand H100 hour, USD (the order of the public clouds' list prices, 2026); --price-per-gpu-hour
H100_USD_PER_GPU_HOUR = 2.50
GIB = 1024**3
#: the refresh config the night runs unless the refresh flags name another (the CPU-sized example night)
EXAMPLE_REFRESH = REPO / "examples" / "refresh.toml"
#: refresh settings this bench wires itself: passing them after -- would point the night elsewhere
WIRED_REFRESH_FLAGS = ("--work", "--index.config.ads", "--generate.targets-requests", "--generate.creatives-requests")
NVIDIA_SMI_MEMORY_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]


class Scaling(str, enum.Enum):
    """What a stage's time grows with, for the projection."""

    ADS = "ads"  #: linear in ads (the index: embedding, clustering, the trie)
    TRAINING = "training"  #: data preparation linear in ads; the step loop capped by the budget / steps / epochs
    DISTINCT_QUERIES = "distinct queries"  #: decode time linear in distinct queries (repeats hit the answer cache)
    CREATIVE_REQUESTS = "creative requests"  #: decode time linear in creative requests
    FIXED = "fixed"  #: does not grow with the data (compress: the model; eval: its own test sets)


STAGE_SCALING = {"index": Scaling.ADS, "train": Scaling.TRAINING, "train_creatives": Scaling.TRAINING,
                 "compress": Scaling.FIXED, "compress_creatives": Scaling.FIXED,
                 "generate_targets": Scaling.DISTINCT_QUERIES, "generate_creatives": Scaling.CREATIVE_REQUESTS,
                 "eval": Scaling.FIXED}


@dataclasses.dataclass
class NightSize(ConfigBase):
    """The night's data: ads in the corpus, target requests, creative requests."""

    ads: int = 1_000_000
    requests: int = 1_000_000
    creatives: int = 100_000

    def validate(self) -> None:
        if self.ads < 1 or self.requests < 1 or self.creatives < 1:
            raise ConfigError(f"NightSize: ads, requests and creatives must be >= 1, got {self.to_dict()}")
        if self.creatives > self.ads:
            raise ConfigError(f"NightSize: creatives {self.creatives} > ads {self.ads} (each asks for a distinct ad)")

    @property
    def pool(self) -> int:
        """Distinct queries the requests are drawn from (the scale set's ratio)."""
        return max(1, round(self.requests * POOL_PER_REQUEST))


@dataclasses.dataclass
class NightScaleConfig(ConfigBase):
    """One measured night: the scale set's size, the refresh's config, the budget and the price."""

    work: Path = Path("/tmp/adbatch_night_scale")
    out: Path = REPO / "bench" / "out" / "night_scale"
    size: NightSize = dataclasses.field(default_factory=lambda: NightSize(ads=20_000, requests=400, creatives=40))
    refresh_args: list[str] = dataclasses.field(default_factory=lambda: ["--config", str(EXAMPLE_REFRESH)])
    model: str | None = None  #: the refresh's base model (None: the config's)
    train_budget_s: float | None = None  #: each training stage's time_budget_s (None: the config's)
    price_per_gpu_hour: float = H100_USD_PER_GPU_HOUR
    gpus: int | None = None  #: GPUs the night holds (None: as many as nvidia-smi lists)
    project_to: NightSize | None = None  #: project each stage to this size (None: no projection)
    sample_interval_s: float = 0.5
    data: Path = REPO.parent / "shared" / "data"  #: the evaluation data the scale set learns its text from
    synthetic_text: bool = False  #: the scale set's tiny made-up vocabulary instead (smoke)

    def validate(self) -> None:
        wired = [a for a in self.refresh_args if a.split("=", 1)[0] in WIRED_REFRESH_FLAGS]
        if wired:
            raise ConfigError(f"refresh flags {wired} are this bench's own (--work, --ads, --requests, --creatives)")
        if self.train_budget_s is not None and not self.train_budget_s > 0:
            raise ConfigError(f"--train-budget-s must be > 0, got {self.train_budget_s}")
        if not self.price_per_gpu_hour >= 0:
            raise ConfigError(f"--price-per-gpu-hour must be >= 0, got {self.price_per_gpu_hour}")
        if self.gpus is not None and self.gpus < 0:
            raise ConfigError(f"--gpus must be >= 0, got {self.gpus}")
        if not self.sample_interval_s > 0:
            raise ConfigError(f"--sample-interval-s must be > 0, got {self.sample_interval_s}")


# --------------------------------------------------------------------------- sampling host and GPU
@dataclasses.dataclass
class Sample:
    unix: float
    driver_rss: int  #: bytes
    tree_rss: int  #: bytes, the driver and every descendant
    gpu_util_pct: list[float]  #: per GPU
    gpu_mem_mib: list[float]  #: per GPU, device-wide


class ResourceSampler:
    """A daemon thread sampling the driver's process tree (psutil) and, with GPUs, ``nvidia-smi``, while the
    ``with`` block runs; ``samples`` holds the timeline."""

    def __init__(self, interval_s: float, gpus: int) -> None:
        self.interval_s, self.gpus = interval_s, gpus
        self.samples: list[Sample] = []
        self._stop = threading.Event()

    def __enter__(self) -> "ResourceSampler":
        import psutil

        self._me = psutil.Process(os.getpid())
        self._thread = threading.Thread(target=self._loop, name="night-scale-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self.samples.append(self._sample())
            if self._stop.wait(self.interval_s):
                return

    def _sample(self) -> Sample:
        import psutil

        driver = self._me.memory_info().rss
        tree = driver
        for child in self._me.children(recursive=True):
            try:
                tree += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # a worker that exited between the two calls
                continue
        util, mem = self._gpu() if self.gpus else ([], [])
        return Sample(time.time(), driver, tree, util, mem)

    @staticmethod
    def _gpu() -> tuple[list[float], list[float]]:
        try:
            done = subprocess.run(NVIDIA_SMI_MEMORY_QUERY, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return [], []
        util, mem = [], []
        for line in done.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                util.append(float(parts[0]))
                mem.append(float(parts[1]))
            except (ValueError, IndexError):  # "[N/A]" on some cards: the sample has no value
                continue
        return util, mem


def peaks(samples: list[Sample], start: float, end: float) -> dict[str, Any]:
    """The samples taken in ``[start, end]``: peak driver / tree RSS (GiB), peak GPU memory summed over the
    GPUs (GiB) and the GPU busy share (mean utilisation over the samples and GPUs, 0..1); None where no
    sample fell in the window (a stage shorter than the interval) or no GPU was sampled."""
    inside = [s for s in samples if start <= s.unix <= end]
    gpu = [s for s in inside if s.gpu_util_pct]
    return {
        "samples": len(inside),
        "driver_rss_gib": round(max(s.driver_rss for s in inside) / GIB, 3) if inside else None,
        "tree_rss_gib": round(max(s.tree_rss for s in inside) / GIB, 3) if inside else None,
        "gpu_mem_gib": round(max(sum(s.gpu_mem_mib) for s in gpu) / 1024, 3) if gpu else None,
        "gpu_busy": round(sum(sum(s.gpu_util_pct) / len(s.gpu_util_pct) for s in gpu) / len(gpu) / 100, 3)
        if gpu else None,
    }


# --------------------------------------------------------------------------- output checks
@dataclasses.dataclass
class OutputCheck:
    """One stage output against its input: every input row answered or rejected, each answer once."""

    output: str
    inputs: int  #: input rows (a duplicated id counts each time it appears)
    rejected: int  #: rows the stage set aside, with a reason
    answered: int  #: distinct input ids with output rows
    duplicate_rows: int  #: output rows whose key (id, rank | variant) an earlier row has
    lost: int  #: input ids neither answered nor rejected
    unexpected: int  #: answered ids that are not input ids

    @property
    def ok(self) -> bool:
        return (self.answered == self.inputs - self.rejected
                and self.duplicate_rows == self.lost == self.unexpected == 0)


def check_answers(output: str, input_ids: list[Any], output_keys: list[tuple[Any, ...]],
                  rejected_ids: list[Any]) -> OutputCheck:
    """``output_keys``: one tuple per output row whose first entry is the input id it answers (targets:
    ``(request_id, rank)``, creatives: ``(request_id, variant)``, the index: ``(ad_id,)``). ``rejected_ids``:
    one per rejected row (None where the id itself was unusable)."""
    answered = {k[0] for k in output_keys}
    wanted = set(input_ids)
    return OutputCheck(output=output, inputs=len(input_ids), rejected=len(rejected_ids), answered=len(answered),
                       duplicate_rows=len(output_keys) - len(set(output_keys)),
                       lost=len(wanted - answered - set(rejected_ids)), unexpected=len(answered - wanted))


def check_night(refresh_work: Path, data: Path, stages: dict[str, Any]) -> list[OutputCheck]:
    """The index and both generate outputs of the night in ``refresh_work`` against the scale set in ``data``."""
    import pyarrow.parquet as pq

    from bench.scale_set import ADS_FILE, CREATIVES_FILE, TARGETS_FILE

    def column(path: Path, name: str) -> list[Any]:
        return pq.read_table(path, columns=[name]).column(name).to_pylist()

    def keys(folder: Path, names: tuple[str, ...]) -> list[tuple[Any, ...]]:
        table = pq.read_table(folder, columns=list(names))
        return list(zip(*(table.column(n).to_pylist() for n in names)))

    index = refresh_work / "index"
    checks = [check_answers("index (ad_id)", column(data / ADS_FILE, "ad_id"), keys(index / "ad_codes.parquet", ("ad_id",)),
                            column(index / "rejected.parquet", "ad_id"))]
    for stage, task, requests, key in (("generate_targets", "targets", TARGETS_FILE, ("request_id", "rank")),
                                       ("generate_creatives", "creatives", CREATIVES_FILE, ("request_id", "variant"))):
        if stage in stages:
            out = refresh_work / "generate" / task
            checks.append(check_answers(f"{task} ({', '.join(key)})", column(data / requests, "request_id"),
                                        keys(out / task, key), column(out / "rejected.parquet", "request_id")))
    return checks


# --------------------------------------------------------------------------- projection
def expected_distinct(pool: int, exponent: float, requests: int) -> float:
    """Expected distinct queries among ``requests`` draws of ranks 1..``pool`` with p(r) ~ r ** -exponent
    (the scale set's stream): sum over ranks of 1 - (1 - p)^n."""
    import numpy as np

    weights = np.arange(1, pool + 1, dtype=np.float64) ** -exponent
    p = weights / weights.sum()
    return float(np.sum(-np.expm1(requests * np.log1p(-np.minimum(p, 1 - 1e-16)))))


@dataclasses.dataclass
class TrainLoop:
    """A training stage's step loop as measured, and the caps the configured night puts on it."""

    seconds: float
    steps: int
    seconds_per_epoch: float  #: at the measured size
    epochs: float  #: configured
    max_steps: int | None
    budget_s: float | None

    def projected(self, ads_ratio: float) -> float:
        """The loop's seconds when an epoch is ``ads_ratio`` times longer: the first cap reached."""
        caps = [self.seconds_per_epoch * ads_ratio * self.epochs]
        if self.budget_s is not None:
            caps.append(self.budget_s)
        if self.max_steps is not None and self.steps:
            caps.append(self.max_steps * self.seconds / self.steps)
        return min(caps)


def project_stage(scaling: Scaling, seconds: float, ratio: float, fixed_s: float = 0.0,
                  loop: TrainLoop | None = None) -> float:
    """A stage's seconds at the projected size. ``ratio``: projected / measured units of what it grows with
    (:data:`STAGE_SCALING`); ``fixed_s``: the part that does not grow (generate's start-up); ``loop``: a
    training stage's step loop (the rest of the stage grows with the ads)."""
    if scaling is Scaling.FIXED:
        return seconds
    if scaling is Scaling.TRAINING:
        assert loop is not None, "a training stage's projection needs its step loop"
        loop_s = min(loop.seconds, seconds)
        return (seconds - loop_s) * ratio + loop.projected(ratio)
    fixed_s = min(max(fixed_s, 0.0), seconds)
    return fixed_s + (seconds - fixed_s) * ratio


def gpu_cost(seconds: float, gpus: int, price_per_gpu_hour: float) -> float:
    """USD for holding ``gpus`` (at least one machine's worth) for ``seconds``."""
    return seconds / 3600 * max(gpus, 1) * price_per_gpu_hour


# --------------------------------------------------------------------------- the night
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def make_scale_set(config: NightScaleConfig, data: Path) -> dict[str, Any]:
    """The scale set of ``config.size`` in ``data``, generated unless the one there has the same config (the
    same seed gives the same files: a re-run would only cost time)."""
    from bench.scale_set import SUMMARY_FILE, ScaleSetConfig, build_scale_set, load_sources, synthetic_sources

    size = config.size
    want = ScaleSetConfig(ads=size.ads, targets=size.requests, creatives=size.creatives, pool=size.pool,
                          zipf=ZIPF_EXPONENT, ads_per_advertiser=10 if config.synthetic_text else 100)
    have = _read_json(data / SUMMARY_FILE)
    if have and have.get("config") == dataclasses.asdict(want):
        log.info("scale set in %s: already there", data)
        return have
    src = synthetic_sources() if config.synthetic_text else load_sources(config.data)
    return build_scale_set(src, data, want, progress=False)


def refresh_config(config: NightScaleConfig, data: Path, refresh_work: Path) -> Any:
    """The refresh's config as its own parser reads ``config.refresh_args``, pointed at the scale set and the
    work folder, with the stated training budget on both training stages."""
    from bench.scale_set import ADS_FILE, CREATIVES_FILE, TARGETS_FILE
    from jobs.config_cli import parse_job_config
    from jobs.nightly_refresh import RefreshConfig

    cfg = parse_job_config(RefreshConfig, list(config.refresh_args), "refresh", "the nightly refresh")
    train = cfg.train
    if config.train_budget_s is not None:
        train = train.replace(config=train.config.replace(train=train.config.train.replace(
                              time_budget_s=config.train_budget_s)),
                              creatives=train.creatives.replace(train=train.creatives.train.replace(
                                  time_budget_s=config.train_budget_s)))
    return cfg.replace(work=refresh_work, model=config.model or cfg.model, train=train,
                       index=cfg.index.replace(config=cfg.index.config.replace(ads=data / ADS_FILE)),
                       generate=cfg.generate.replace(targets_requests=data / TARGETS_FILE,
                                                     creatives_requests=data / CREATIVES_FILE))


def _stage_rows(stage: str, refresh_work: Path) -> int | None:
    """What a stage processed, from its own outputs: ads indexed, examples trained, requests answered."""
    if stage == "index":
        return ((_read_json(refresh_work / "index" / "manifest.json") or {}).get("counts") or {}).get("ads_indexed")
    if stage in ("train", "train_creatives"):
        folder = "model" if stage == "train" else "creative_model"
        return ((_read_json(refresh_work / folder / "adbatch_training.json") or {}).get("train") or {}).get("examples")
    if stage.startswith("generate_"):
        return _generate_counts(stage, refresh_work).get("answered")
    return None


def _generate_counts(stage: str, refresh_work: Path) -> dict[str, Any]:
    """A generate stage's counts (its manifest): answered, rejected, partitions run and skipped, ..."""
    task = stage.removeprefix("generate_")
    return (_read_json(refresh_work / "generate" / task / "manifest.json") or {}).get("counts") or {}


def _fixed_seconds(stage: str, refresh_work: Path, seconds: float, concurrency: int) -> float:
    """The part of a stage's seconds that does not grow with its rows, from its manifest: the index's time
    outside its phases (read, embed, cluster, render, trie, write: Ray's tasks starting); generate's start-up
    (Ray Data, actors, model load): its seconds less its batches' decode time (the median batch x batches /
    actors). 0 for the other stages."""
    if stage == "index":
        phases = (_read_json(refresh_work / "index" / "manifest.json") or {}).get("timings_s") or {}
        return max(0.0, seconds - sum(phases.values()))
    if not stage.startswith("generate_"):
        return 0.0
    manifest = _read_json(refresh_work / "generate" / stage.removeprefix("generate_") / "manifest.json") or {}
    tp = manifest.get("throughput") or {}
    decode = tp.get("batch_latency_p50_s", 0.0) * tp.get("batches", 0) / max(1, concurrency)
    return max(0.0, seconds - decode)


def _train_loop(stage: str, refresh_work: Path, refresh: Any) -> TrainLoop | None:
    folder, train_cfg = (("model", refresh.train.config.train) if stage == "train"
                         else ("creative_model", refresh.train.creatives.train))
    rec = ((_read_json(refresh_work / folder / "adbatch_training.json") or {}).get("train") or {})
    if not rec:
        return None
    return TrainLoop(seconds=rec["seconds"], steps=rec["steps"], seconds_per_epoch=rec["seconds_per_epoch"],
                     epochs=train_cfg.epochs, max_steps=train_cfg.max_steps, budget_s=train_cfg.time_budget_s)


def _stage_figures(stage: str, stamp: dict[str, Any], refresh_work: Path, samples: list[Sample],
                   size: NightSize, concurrency: int) -> dict[str, Any]:
    """One finished stage's figures: its seconds and window from the refresh's stamp, its rows from its
    outputs, its peaks from the samples inside the window (None without samples)."""
    seconds, end = stamp["seconds"], stamp["finished_unix"]
    rows = _stage_rows(stage, refresh_work)
    return {"seconds": seconds, "rows": rows, "rows_per_s": round(rows / seconds, 2) if rows and seconds > 0 else None,
            **peaks(samples, end - seconds, end),
            "fixed_s": round(_fixed_seconds(stage, refresh_work, seconds, concurrency), 3),
            "size": size.to_dict(), "measured_unix": end,
            # a generate stage that resumed: the partitions an earlier, interrupted run had committed
            **({"partitions_skipped": _generate_counts(stage, refresh_work).get("partitions_skipped")}
               if stage.startswith("generate_") else {})}


def measure_night(config: NightScaleConfig) -> dict[str, Any]:
    """Run the refresh over the scale set under ``config.work`` and return the report: per-stage figures
    (this run's, or for a skipped stage those of the run that last ran it), the output checks, the cost and,
    with ``config.project_to``, the projected night. Writes ``night_scale.{json,md}`` under ``config.out``."""
    from jobs.nightly_refresh import STAMP_DIR, run_refresh

    work = config.work.resolve()
    from bench.scale_out import visible_gpus

    data, refresh_work, measured_file = work / "data", work / "refresh", work / "measured.json"
    gpus = visible_gpus() if config.gpus is None else config.gpus
    t0 = time.perf_counter()
    scale_set = make_scale_set(config, data)
    scale_set_s = time.perf_counter() - t0
    refresh = refresh_config(config, data, refresh_work)

    load_before = os.getloadavg()[0]  # a shared CPU's other work slows every stage: the report says how busy it was
    with ResourceSampler(config.sample_interval_s, gpus) as sampler:
        t0 = time.perf_counter()
        summary = run_refresh(refresh)
        wall = time.perf_counter() - t0
    measured: dict[str, Any] = _read_json(measured_file) or {}
    stages: dict[str, Any] = {}
    for stage, status in summary["stages"].items():
        stamp = _read_json(refresh_work / STAMP_DIR / f"{stage}.json") or {}
        if status["status"] == "ran":
            measured[stage] = _stage_figures(stage, stamp, refresh_work, sampler.samples, config.size,
                                             refresh.generate.config.concurrency)
        elif stage not in measured:
            # ran in an invocation that did not finish (killed): its stamp still says how long it took
            measured[stage] = _stage_figures(stage, stamp, refresh_work, [], config.size,
                                             refresh.generate.config.concurrency)
        stages[stage] = {"status": status["status"], **measured[stage]}
    measured_file.write_text(json.dumps(measured, indent=1) + "\n")

    checks = check_night(refresh_work, data, stages)
    stage_s = sum(s["seconds"] for s in stages.values())
    overhead = max(0.0, wall - sum(st["seconds"] for st in summary["stages"].values()))
    night_s = stage_s + overhead
    report: dict[str, Any] = {
        "config": config.to_dict(), "gpus": gpus, "scale_set": {"counts": scale_set["counts"],
                                                                "queries": scale_set["queries"]},
        "scale_set_seconds": round(scale_set_s, 2), "wall_s": round(wall, 2),
        "load_avg_1m": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
        "outside_stages_s": round(overhead, 2), "night_s": round(night_s, 2),
        "night_cost_usd": round(gpu_cost(night_s, gpus, config.price_per_gpu_hour), 4),
        "driver_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
        "stages": stages, "checks": [dataclasses.asdict(c) | {"ok": c.ok} for c in checks],
        "all_outputs_ok": all(c.ok for c in checks),
        "train_budget_s": {"train": refresh.train.config.train.time_budget_s,
                           "train_creatives": refresh.train.creatives.train.time_budget_s},
    }
    if config.project_to is not None:
        report["projection"] = project_night(config, refresh, refresh_work, stages, overhead,
                                             scale_set["queries"]["distinct_requested"], gpus)
    write_report(report, config.out)
    return report


def project_night(config: NightScaleConfig, refresh: Any, refresh_work: Path, stages: dict[str, Any],
                  overhead_s: float, distinct_measured: int, gpus: int) -> dict[str, Any]:
    """Every stage's projected seconds at ``config.project_to`` (see :func:`project_stage`), and the night's."""
    measured, target = config.size, config.project_to
    distinct_target = expected_distinct(target.pool, ZIPF_EXPONENT, target.requests)
    ratios = {Scaling.ADS: target.ads / measured.ads, Scaling.TRAINING: target.ads / measured.ads,
              Scaling.DISTINCT_QUERIES: distinct_target / max(1, distinct_measured),
              Scaling.CREATIVE_REQUESTS: target.creatives / measured.creatives, Scaling.FIXED: 1.0}
    projected: dict[str, Any] = {}
    for stage, figures in stages.items():
        scaling = STAGE_SCALING[stage]
        loop = _train_loop(stage, refresh_work, refresh) if scaling is Scaling.TRAINING else None
        projected[stage] = {"scaling": scaling.value, "ratio": round(ratios[scaling], 3),
                            "seconds": round(project_stage(scaling, figures["seconds"], ratios[scaling],
                                                           figures.get("fixed_s", 0.0), loop), 1)}
    # outside the stages: input checks (they read the corpus and requests), Ray's start, the headline pairs
    outside = overhead_s * ratios[Scaling.ADS]
    night = sum(p["seconds"] for p in projected.values()) + outside
    return {"to": target.to_dict(), "distinct_queries": {"measured": distinct_measured,
                                                         "projected": round(distinct_target)},
            "stages": projected, "outside_stages_s": round(outside, 1), "night_s": round(night, 1),
            "night_cost_usd": round(gpu_cost(night, gpus, config.price_per_gpu_hour), 2)}


# --------------------------------------------------------------------------- the report
def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown(report: dict[str, Any]) -> str:
    """The report's tables."""
    cfg, size = report["config"], report["config"]["size"]
    proj = report.get("projection")
    on_gpu = report["gpus"] > 0
    lines = [f"Night at {size['ads']:,} ads / {size['requests']:,} target requests / {size['creatives']:,} creative "
             f"requests; {'%d GPU(s)' % report['gpus'] if on_gpu else 'CPU (no GPU)'}; training budget per training "
             f"stage {report['train_budget_s']['train']} / {report['train_budget_s']['train_creatives']} s.", "",
             "| stage | this run | wall s | rows | rows/s | driver RSS peak GiB | process tree RSS peak GiB "
             "| GPU mem peak GiB | GPU busy |" + (" **projected** s |" if proj else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if proj else "")]
    for stage, s in report["stages"].items():
        busy = f"{s['gpu_busy']:.0%}" if s.get("gpu_busy") is not None else "n/a"
        status = s["status"]
        if status == "ran" and s.get("partitions_skipped"):
            status = f"ran, resumed ({s['partitions_skipped']} partitions already committed)"
        row = (f"| {stage} | {status} | {_fmt(s.get('seconds'))} | {_fmt(s.get('rows'))} | "
               f"{_fmt(s.get('rows_per_s'))} | {_fmt(s.get('driver_rss_gib'), 2)} | {_fmt(s.get('tree_rss_gib'), 2)} | "
               f"{_fmt(s.get('gpu_mem_gib'), 2)} | {busy} |")
        if proj:
            p = proj["stages"].get(stage)
            row += f" {_fmt(p['seconds']) if p else 'n/a'} ({p['scaling'] if p else ''}) |"
        lines.append(row)
    cost = (f"{report['night_cost_usd']:.4f} USD at {cfg['price_per_gpu_hour']:.2f} USD per GPU-hour"
            + ("" if on_gpu else " (CPU run: its wall time priced as one GPU held, for scale only)"))
    lines += ["", f"Night: {report['night_s']:,.1f} s of stages and start-up ({report['outside_stages_s']:,.1f} s "
              f"outside the stages); this invocation {report['wall_s']:,.1f} s (1-minute load average "
              f"{report['load_avg_1m']['start']} at its start, {report['load_avg_1m']['end']} at its end); cost {cost}. "
              f"Driver peak RSS (getrusage) {report['driver_maxrss_gib']:.2f} GiB."]
    if proj:
        to = proj["to"]
        lines += ["", f"**Projected** to {to['ads']:,} ads / {to['requests']:,} requests ({proj['distinct_queries']['projected']:,} "
                  f"expected distinct queries vs {proj['distinct_queries']['measured']:,} measured) / {to['creatives']:,} "
                  f"creatives: **{proj['night_s']:,.0f} s** ({proj['night_s'] / 3600:.2f} h), "
                  f"**{proj['night_cost_usd']:,.2f} USD** at {cfg['price_per_gpu_hour']:.2f} USD per GPU-hour "
                  "(a projection from this run's rates, not a measurement)."]
    lines += ["", "| output | inputs | rejected | answered | duplicate rows | lost | unexpected | ok |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {c['output']} | {c['inputs']:,} | {c['rejected']:,} | {c['answered']:,} | {c['duplicate_rows']} | "
              f"{c['lost']} | {c['unexpected']} | {'yes' if c['ok'] else '**NO**'} |" for c in report["checks"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "night_scale.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    (out / "night_scale.md").write_text(markdown(report))


# --------------------------------------------------------------------------- command line
def parse_args(argv: list[str]) -> tuple[NightScaleConfig, bool]:
    """This bench's flags, then after ``--`` the refresh's own (``--config FILE``, ``--generate.config....``);
    returns the config and whether this is the smoke run."""
    ours, refresh_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="seconds on a CPU: a tiny random-init model, 200 ads, 100 + 10 requests, eval off")
    ap.add_argument("--work", type=Path, default=None, help="the scale set, the refresh's work folder and the "
                    "measurements (default /tmp/adbatch_night_scale[_smoke]); the same folder again resumes")
    ap.add_argument("--out", type=Path, default=None, help="where night_scale.{md,json} go (default $OUT or bench/out)")
    ap.add_argument("--ads", type=int, default=None, help="ads (default 20,000; smoke 200)")
    ap.add_argument("--requests", type=int, default=None, help="target requests (default 400; smoke 100)")
    ap.add_argument("--creatives", type=int, default=None, help="creative requests (default 40; smoke 10)")
    ap.add_argument("--train-budget-s", type=float, default=None,
                    help="time_budget_s of both training stages (default: the refresh config's; smoke 5)")
    ap.add_argument("--price-per-gpu-hour", type=float, default=H100_USD_PER_GPU_HOUR,
                    help=f"USD (default {H100_USD_PER_GPU_HOUR:.2f}: an on-demand H100 hour)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs the night holds (default: nvidia-smi's count)")
    ap.add_argument("--project", action="store_true", help="also project each stage to --project-to (labelled)")
    ap.add_argument("--project-to", default="1000000,1000000,100000", metavar="ADS,REQUESTS,CREATIVES",
                    help="the projected night (default the scale set's full size: 1M, 1M, 100k)")
    ap.add_argument("--sample-interval-s", type=float, default=0.5, help="RSS / nvidia-smi sampling interval")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data",
                    help="the evaluation data the scale set learns its text from")
    args = ap.parse_args(ours)
    smoke = args.smoke
    size = NightSize(ads=args.ads or (200 if smoke else 20_000), requests=args.requests or (100 if smoke else 400),
                     creatives=args.creatives or (10 if smoke else 40))
    if not any(a.split("=", 1)[0] == "--config" for a in refresh_args):
        refresh_args = ["--config", str(EXAMPLE_REFRESH), *refresh_args]
    if smoke:  # eval scores the base model on Home Depot and the slogan test set: minutes, none of it the scale set
        refresh_args = [*refresh_args, "--eval.enabled", "false"]
    project_to = None
    if args.project:
        try:
            ads, requests, creatives = (int(float(x)) for x in args.project_to.split(","))
        except ValueError:
            ap.error(f"--project-to wants ADS,REQUESTS,CREATIVES, got {args.project_to!r}")
        project_to = NightSize(ads=ads, requests=requests, creatives=creatives)
    try:
        config = NightScaleConfig(
            work=args.work or Path("/tmp/adbatch_night_scale_smoke" if smoke else "/tmp/adbatch_night_scale"),
            out=args.out or Path(os.environ.get("OUT") or REPO / "bench" / "out"), size=size,
            refresh_args=refresh_args,
            train_budget_s=args.train_budget_s or (5.0 if smoke else None), price_per_gpu_hour=args.price_per_gpu_hour,
            gpus=args.gpus, project_to=project_to, sample_interval_s=args.sample_interval_s, data=args.data,
            synthetic_text=smoke)
    except ConfigError as exc:
        ap.error(str(exc))
    return config, smoke


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    config, smoke = parse_args(argv)
    if smoke:  # --smoke: a tiny random-init model over the default tokenizer
        from bench.generate_gpu import make_random_model

        config = config.replace(model=str(make_random_model(config.work / "random-model-tiny", None, tiny=True)))
    report = measure_night(config)
    print(markdown(report), flush=True)
    return 0 if report["all_outputs_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
