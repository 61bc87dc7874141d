"""The generate stage on Ray Data: validated requests -> actor pool -> atomic Parquet partitions.

``adbatch generate --task targets|creatives --requests PATH --index DIR [--model M | --compressed DIR]
--out DIR``. Plan:

1. Validate the requests in the driver, before any model loads (:mod:`adbatch.serving.requests`): a bad
   file or column raises; bad rows go to ``rejected.parquet``.
2. Partition deterministically: the accepted rows sorted by ``request_id``, cut into fixed-size
   chunks of ``partition_size``; chunk ``i`` is ``_work/requests/part-i.parquet``. The same input
   and config always give the same partitions, which is what makes resuming exact.
3. ``ray.data.from_arrow(<pending chunks, cut into blocks>)`` -> ``map_batches(GeneratorActor, batch_size=block,
   compute=actor pool of concurrency, num_gpus=1 when the cluster has GPUs else CPU actors)``: a block is
   ``BLOCK_BATCHES`` model batches (:func:`adbatch.serving.generators.block_rows`), inside which the generator packs
   the distinct uncached queries into full model calls; the actor wraps
   :class:`adbatch.serving.generators.TargetGenerator` / :class:`CreativeGenerator` (loaded once).
   Actors restart and their tasks retry when a worker dies (``max_restarts`` /
   ``max_task_retries``), so a lost actor loses no request.
4. The driver streams the answers, and once every request of a partition is answered it writes
   ``<task>/part-i.parquet`` atomically (temp + rename), then the partition's completion record
   ``_progress/part-i.json`` (with the part file's sha256). A re-run skips partitions whose record
   and file agree, so after a crash only the missing partitions run and nothing is duplicated.
5. ``manifest.json``: counts in / out / rejected, model and index hashes, config, timings,
   throughput and batch latency.

``executor=local`` runs the same plan in-process without Ray (a machine without Ray, or a debugger).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from adbatch.artifacts import (MANIFEST_NAME, ArtifactKind, StageTimer, build_manifest, claim_output,
                               sha256_file, sha256_json, sha256_paths, write_json_atomic,
                               write_parquet_atomic)
from adbatch.config import LOG_FORMAT, ConfigBase, ConfigError
from adbatch.decoding import CreativeConfig, FusionMode, TargetSearchConfig
from adbatch.index.dense import DenseBackend
from adbatch.serving.generators import (BLOCK_BATCHES, BLOCK_STATS, DEFAULT_ANSWER_CACHE, DEFAULT_BATCH_SIZE,
                                       CreativeGenerator, DeviceChoice, GenerateConfig, ModelSpec, TargetGenerator, answers_to_output,
                                       block_rows, check_model_index, default_batch_size, generator_fingerprint)
from adbatch.serving.requests import (REJECTED_SCHEMA, GenerateTask, RequestValidationConfig, list_request_files,
                                      output_schema, validate_requests)
from pipelines.stage import StageContract

log = logging.getLogger(__name__)

WORK_DIR = "_work"
PROGRESS_DIR = "_progress"
RUN_RECORD = "run.json"
REJECTED_FILE = "rejected.parquet"
#: environment variable naming a flag file: a generation actor that finds it deletes it and
#: exits hard on its second batch (fault-injection tests of actor loss)
FAULT_KILL_ENV = "ADBATCH_FAULT_KILL_ONCE"


class Executor(str, enum.Enum):
    """What runs the generators."""

    RAY = "ray"  #: Ray Data actor pool (local Ray, or the cluster at RAY_ADDRESS)
    LOCAL = "local"  #: in this process, no Ray (same partitions, same outputs)


@dataclasses.dataclass
class GenerateJobConfig(ConfigBase):
    """``adbatch generate``: what to generate, from what, with which model, and where to.

    That ``requests``, ``out`` and (for targets) ``index`` are given is checked when the job runs
    (:meth:`check_paths`), not here: the refresh fills them in (:data:`STAGE`'s ``wired``)."""

    task: GenerateTask = dataclasses.field(
        default=GenerateTask.TARGETS, metadata={"help": "targets (query -> ads) | creatives (ad -> headline)"})
    requests: Path | None = dataclasses.field(
        default=None, metadata={"help": "request Parquet file or folder (see docs/generate.md)"})
    index: Path | None = dataclasses.field(
        default=None, metadata={"help": "index folder (adbatch index); required for targets"})
    model: str | None = dataclasses.field(
        default=None, metadata={"help": "HF folder or GGUF; None = the default model (dense)"})
    compressed: Path | None = dataclasses.field(
        default=None, metadata={"help": "compressed checkpoint folder (adbatch compress); replaces --model"})
    out: Path | None = dataclasses.field(default=None, metadata={"help": "output folder"})
    targets: TargetSearchConfig = dataclasses.field(default_factory=TargetSearchConfig)
    creatives: CreativeConfig = dataclasses.field(default_factory=CreativeConfig)
    validation: RequestValidationConfig = dataclasses.field(default_factory=RequestValidationConfig)
    concurrency: int = dataclasses.field(default=1, metadata={"help": "generation actors (one model each)"})
    batch_size: int | None = dataclasses.field(
        default=None, metadata={"help": "requests per model call (halved on out-of-memory); default by the "
                                        "actors' device: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH_SIZE.items())
                                        + f"; each actor call maps a block of {BLOCK_BATCHES} batches"})
    partition_size: int = dataclasses.field(
        default=256, metadata={"help": "requests per output partition (the unit of resume)"})
    device: DeviceChoice = dataclasses.field(default=DeviceChoice.AUTO, metadata={"help": "auto | cpu | cuda"})
    executor: Executor = dataclasses.field(default=Executor.RAY, metadata={"help": "ray | local"})
    num_cpus: int | None = dataclasses.field(
        default=None, metadata={"help": "CPUs of a local Ray (ignored when joining RAY_ADDRESS)"})
    max_query_tokens: int = dataclasses.field(default=48, metadata={"help": "query tokens in the prompt"})
    dense_backend: DenseBackend = dataclasses.field(
        default=DenseBackend.EXACT, metadata={"help": "dense channel search: exact | faiss_flat | faiss_hnsw (GenerateConfig)"})
    answer_cache: int = dataclasses.field(default=DEFAULT_ANSWER_CACHE, metadata={
        "help": "targets: distinct queries each actor keeps answers of, so a repeated query is decoded once (0 = off)"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an --out folder that holds a different run"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show progress bars"})

    def validate(self) -> None:
        if self.requests is not None and self.out is not None:
            # realpath, not Path.resolve(): a symlink loop raises RuntimeError there; here it stays a path
            # that does not exist, refused with one line when the run lists its requests
            req, out = Path(os.path.realpath(self.requests)), Path(os.path.realpath(self.out))
            if out == req or req in out.parents:
                # the requests folder is read recursively: a rerun would read the answers as requests
                raise ConfigError(f"GenerateJobConfig.out: {self.out} lies inside the requests folder "
                                  f"{self.requests}; choose an output folder outside it")
        if self.model is not None and self.compressed is not None:
            raise ConfigError("GenerateJobConfig: give --model or --compressed, not both")
        for name in ("concurrency", "batch_size", "partition_size", "max_query_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"GenerateJobConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"GenerateJobConfig.num_cpus must be >= 1, got {self.num_cpus}")
        if self.answer_cache < 0:
            raise ConfigError(f"GenerateJobConfig.answer_cache must be >= 0 (0 = off), got {self.answer_cache}")

    def check_paths(self) -> None:
        """The paths a run needs are given."""
        if self.requests is None:
            raise ConfigError("GenerateJobConfig.requests: required (request Parquet file or folder)")
        if self.out is None:
            raise ConfigError("GenerateJobConfig.out: required (output folder)")
        if self.task is GenerateTask.TARGETS and self.index is None:
            raise ConfigError("GenerateJobConfig.index: required for task targets")

    # --- derived pieces -------------------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(model=self.model, compressed=str(self.compressed) if self.compressed else None)

    @property
    def decoding(self) -> ConfigBase:
        return self.targets if self.task is GenerateTask.TARGETS else self.creatives

    def model_batch_size(self, device: str) -> int:
        """Requests per model call of a generator on ``device`` ("cuda" / "cpu"): ``batch_size``, else the
        device's default -- what the generator itself picks (:class:`adbatch.serving.generators.GenerateConfig`)."""
        return self.batch_size or default_batch_size(device)

    def generate_config(self, num_threads: int = 0) -> GenerateConfig:
        return GenerateConfig(batch_size=self.batch_size, device=self.device, num_threads=num_threads,
                              max_query_tokens=self.max_query_tokens, dense_backend=self.dense_backend,
                              answer_cache=self.answer_cache)


def build_generator(task: GenerateTask, spec: ModelSpec, index: str | None,
                    decoding: TargetSearchConfig | CreativeConfig, gen: GenerateConfig
                    ) -> TargetGenerator | CreativeGenerator:
    """The core generator of ``task``: what an actor builds (its arguments travel pickled, typed)."""
    if task is GenerateTask.TARGETS:
        return TargetGenerator(spec, index, decoding, gen)
    return CreativeGenerator(spec, decoding, gen)


class GeneratorActor:
    """Ray Data callable class: loads the generator once in ``__init__``; ``__call__`` maps a batch."""

    def __init__(self, task: GenerateTask, spec: ModelSpec, index: str | None,
                 decoding: TargetSearchConfig | CreativeConfig, gen: GenerateConfig) -> None:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        t0 = time.perf_counter()
        log.info("generation actor pid %d: loading the %s generator", os.getpid(), task.value)
        self.generator = build_generator(task, spec, index, decoding, gen)
        # the job's log reads as a timeline: the driver's "Starting execution" line to this one is the
        # actor's process start and imports, this line's seconds its model / index load
        log.info("generation actor pid %d: generator ready in %.2f s", os.getpid(), time.perf_counter() - t0)
        self.calls = 0

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.calls += 1
        _maybe_inject_fault(self.calls)
        out = self.generator(batch)
        s = self.generator.stats()
        log.info("generation actor pid %d: block %d (%d requests) in %.2f s; so far %d requests, %d decoded in %d "
                 "model calls (%.1f a call)", os.getpid(), self.calls, batch.num_rows, out.column("batch_seconds")[0].as_py()
                 if out.num_rows else 0.0, s["requests"], s["decoded"], s["model_calls"], s["model_call_fill"])
        return out


def _maybe_inject_fault(calls: int) -> None:
    """Test hook: die hard (as a crashed worker does) once, on the second batch, if flagged."""
    flag = os.environ.get(FAULT_KILL_ENV)
    if not flag or calls < 2:
        return
    try:
        os.unlink(flag)  # only one actor can win the unlink, so only one dies
    except FileNotFoundError:
        return
    log.error("fault injection: generation actor pid %d exits now", os.getpid())
    os._exit(17)


# --- partitions and their records -------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    """Paths inside an output folder."""

    out: Path
    task: GenerateTask

    @property
    def parts_dir(self) -> Path:
        return self.out / self.task.value

    @property
    def work_dir(self) -> Path:
        return self.out / WORK_DIR / "requests"

    @property
    def progress_dir(self) -> Path:
        return self.out / PROGRESS_DIR

    def part_name(self, i: int) -> str:
        return f"part-{i:05d}"

    def part_file(self, i: int) -> Path:
        return self.parts_dir / f"{self.part_name(i)}.parquet"

    def work_file(self, i: int) -> Path:
        return self.work_dir / f"{self.part_name(i)}.parquet"

    def record_file(self, i: int) -> Path:
        return self.progress_dir / f"{self.part_name(i)}.json"

    def rejected_file(self, i: int) -> Path:
        return self.progress_dir / f"{self.part_name(i)}.rejected.parquet"


def _read_json(path: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def partition_done(layout: Layout, i: int) -> dict[str, Any] | None:
    """The completion record of partition ``i`` if it and the files it names agree, else None."""
    rec = _read_json(layout.record_file(i))
    if rec is None:
        return None
    part = layout.part_file(i)
    if not part.is_file() or sha256_file(part) != rec.get("sha256"):
        log.warning("partition %d: record present but %s is missing or differs; redoing it", i, part)
        return None
    if sha256_file(layout.work_file(i)) != rec.get("requests_sha256"):
        return None
    return rec


def _prepare_out(config: GenerateJobConfig, run_identity: dict[str, Any], layout: Layout) -> None:
    """Start this run in ``out`` (a generate folder, claimed by :func:`adbatch.artifacts.claim_output`),
    or resume it when the folder holds this same run; ``--overwrite`` replaces another generate run."""
    run_file = layout.progress_dir / RUN_RECORD
    existing = _read_json(run_file)
    if existing is not None and existing.get("run_key") != run_identity["run_key"]:
        if not config.overwrite:
            diff = sorted(k for k in run_identity if existing.get(k) != run_identity[k])
            raise ConfigError(
                f"{config.out} holds another generate run (differs in {diff}); use a new --out "
                f"or --overwrite true to replace it")
        log.warning("overwriting %s (a different run)", config.out)
    if existing is None or existing.get("run_key") != run_identity["run_key"]:
        # every task's folder: an --overwrite by the other task must not leave the old answers
        for d in [layout.out / t.value for t in GenerateTask] + [layout.out / WORK_DIR, layout.progress_dir]:
            shutil.rmtree(d, ignore_errors=True)
        (layout.out / MANIFEST_NAME).unlink(missing_ok=True)
        layout.progress_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_file, run_identity)
    layout.parts_dir.mkdir(parents=True, exist_ok=True)


def _write_work_partitions(accepted: pa.Table, layout: Layout, size: int) -> list[int]:
    """Cut the sorted accepted rows into chunk files (skipping chunks already written identically)."""
    counts = []
    for i, start in enumerate(range(0, accepted.num_rows, size)):
        chunk = accepted.slice(start, size)
        chunk = chunk.append_column("partition", pa.array([i] * chunk.num_rows, pa.int64()))
        path = layout.work_file(i)
        if not path.is_file() or pq.read_table(path) != chunk:
            write_parquet_atomic(chunk, path)
        counts.append(chunk.num_rows)
    return counts


def _commit_partition(layout: Layout, task: GenerateTask, i: int, answers: pa.Table) -> dict[str, Any]:
    """Write partition ``i``'s output and rejected rows atomically, then its completion record."""
    out_table, rejected = answers_to_output(task, answers.drop_columns(
        [c for c in ("partition", "batch_seconds", *BLOCK_STATS) if c in answers.column_names]))
    write_parquet_atomic(out_table, layout.part_file(i))
    write_parquet_atomic(rejected, layout.rejected_file(i))
    rec = {
        "partition": i,
        "requests": answers.num_rows,
        "answered": answers.num_rows - rejected.num_rows,
        "rejected": rejected.num_rows,
        "output_rows": out_table.num_rows,
        "sha256": sha256_file(layout.part_file(i)),
        "requests_sha256": sha256_file(layout.work_file(i)),
        "batch_seconds": sorted(set(answers.column("batch_seconds").to_pylist()))
        if "batch_seconds" in answers.column_names else [],
        # the model work of the blocks whose first row is in this partition (BLOCK_STATS): summed over partitions,
        # each block counted once
        **{name.removeprefix("block_"): int(pc.sum(answers.column(name)).as_py() or 0)
           for name in BLOCK_STATS if name in answers.column_names},
        "committed_unix": time.time(),
    }
    # the record is written last: its presence means the partition is complete
    write_json_atomic(layout.record_file(i), rec)
    return rec


class _PartitionCollector:
    """Gathers streamed answers per partition and commits each partition once it is complete."""

    def __init__(self, layout: Layout, task: GenerateTask, expected: dict[int, int]) -> None:
        self.layout, self.task, self.expected = layout, task, expected
        self.pending: dict[int, list[pa.Table]] = {}
        self.seen: dict[int, set[str]] = {}
        self.records: dict[int, dict[str, Any]] = {}
        self.duplicates = 0

    def add(self, batch: pa.Table) -> None:
        for i in sorted(set(batch.column("partition").to_pylist())):
            part = batch.filter(pc.equal(batch.column("partition"), i))
            if i in self.records:
                # re-emitted answers of a partition already committed: committing it again would
                # replace its file with just these (already answered) rows
                self.duplicates += part.num_rows
                continue
            seen = self.seen.setdefault(i, set())
            ids = part.column("request_id").to_pylist()
            keep = [rid not in seen for rid in ids]
            if not all(keep):
                # a retried task may re-emit answers; the first copy wins, later ones are counted
                self.duplicates += keep.count(False)
                part = part.filter(pa.array(keep))
            seen.update(part.column("request_id").to_pylist())
            self.pending.setdefault(i, []).append(part)
            if len(seen) == self.expected[i]:
                answers = pa.concat_tables(self.pending.pop(i)).sort_by("request_id")
                self.records[i] = _commit_partition(self.layout, self.task, i, answers)
                del self.seen[i]  # a committed partition's later copies are caught by records: hold no ids
                log.info("partition %d committed (%d requests)", i, answers.num_rows)

    def check_complete(self) -> None:
        missing = sorted(set(self.expected) - set(self.records))
        if missing:
            raise RuntimeError(f"generation finished but partitions {missing[:10]} are incomplete "
                               f"({len(missing)} in all); re-run to resume them")


def request_blocks(tables: Iterable[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The rows of ``tables``, in order, cut into blocks of ``rows`` (the last one shorter): blocks span
    partitions, and a partition commits once all its rows are back. Reads the tables one at a time, carrying a
    partial block into the next; each block is one contiguous table (its own buffers, not a view of a larger one)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    carry: list[pa.Table] = []
    held = 0
    for table in tables:
        carry.append(table)
        held += table.num_rows
        while held >= rows:
            joined = pa.concat_tables(carry)
            yield joined.slice(0, rows).combine_chunks()
            rest = joined.slice(rows)
            carry, held = ([rest] if rest.num_rows else []), rest.num_rows
    if held:
        yield pa.concat_tables(carry).combine_chunks()


def _iter_local(config: GenerateJobConfig, layout: Layout, pending: list[int]) -> Iterator[pa.Table]:
    from tqdm.auto import tqdm

    gen = build_generator(config.task, config.spec, str(config.index) if config.index else None,
                          config.decoding, config.generate_config())
    total = sum(pq.read_metadata(layout.work_file(i)).num_rows for i in pending)
    with tqdm(total=total, desc=f"generate {config.task.value}", unit="req",
              disable=not config.progress) as bar:
        # the blocks Ray's actors get (block_rows of the generator's batch size), partitions read one at a time
        for block in request_blocks((pq.read_table(layout.work_file(i)) for i in pending), gen.block_rows):
            yield gen(block)
            bar.update(block.num_rows)
        log.info("generator: %s", gen.stats())


def _actor_device(config: GenerateJobConfig, resources: dict[str, Any]) -> str:
    """The device the actors' generators will pick (``DeviceChoice.AUTO``: CUDA when the actor gets a GPU)."""
    if config.device is not DeviceChoice.AUTO:
        return config.device.value
    return "cuda" if resources.get("num_gpus") else "cpu"


def _actor_resources(config: GenerateJobConfig) -> tuple[dict[str, Any], int]:
    """(map_batches resource arguments, torch threads per actor) for this cluster.

    The actors are the plan's only tasks (the requests enter as in-memory blocks, see
    :func:`_iter_ray`), so on CPU they share every CPU of the cluster, one CPU included."""
    import ray

    res = ray.cluster_resources()
    gpus, cpus = float(res.get("GPU", 0)), float(res.get("CPU", 1))
    if gpus >= 1:
        return {"num_gpus": 1, "num_cpus": 1}, max(1, int(cpus // max(gpus, 1)))
    # an actor lives on one node: never ask for more CPUs than the largest node has
    node_cpus = max((float(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")), default=cpus)
    per_actor = max(0.05, min(cpus / config.concurrency, node_cpus))
    return {"num_cpus": round(per_actor, 3)}, max(1, int(per_actor))


#: rows of one object the requests enter Ray in (a multiple of the block; one block when the block is larger): Ray
#: keeps ~50 KB in the driver per object from_arrow puts (measured: 4,688 blocks of 64 requests, 300,000 on the CPU,
#: +254 MB of driver RSS), so objects of one CPU block each made the driver's memory grow with the request count
INPUT_OBJECT_ROWS = 4096
#: objects per actor, at least, when a run is too small for INPUT_OBJECT_ROWS (every actor still gets blocks)
INPUT_OBJECTS_PER_ACTOR = 4


def input_object_rows(total: int, rows: int, concurrency: int) -> int:
    """Rows of each object the ``total`` pending requests enter Ray in: a multiple of the block's ``rows`` (so the
    actors' batches are the blocks :func:`request_blocks` cuts, the same as ``--executor local``), about
    :data:`INPUT_OBJECT_ROWS`, smaller when that would leave an actor of ``concurrency`` without
    :data:`INPUT_OBJECTS_PER_ACTOR` objects."""
    want = min(INPUT_OBJECT_ROWS, -(-total // (concurrency * INPUT_OBJECTS_PER_ACTOR)))
    return max(rows, -(-want // rows) * rows)


def _iter_ray(config: GenerateJobConfig, layout: Layout, pending: list[int]) -> Iterator[pa.Table]:
    import ray

    from pipelines.ray_runtime import init_ray

    init_ray(config.num_cpus)
    resources, threads = _actor_resources(config)
    ctx = ray.data.DataContext.get_current()
    # partitions then complete in input order, so the driver holds few incomplete ones at a time
    ctx.execution_options.preserve_order = True
    runtime_env = None
    if os.environ.get(FAULT_KILL_ENV):
        runtime_env = {"env_vars": {FAULT_KILL_ENV: os.environ[FAULT_KILL_ENV]}}
    batch = config.model_batch_size(_actor_device(config, resources))
    rows = block_rows(batch)
    log.info("generate on Ray: %d actor(s), %s each, %d torch thread(s); blocks of %d requests (%d model calls "
             "of %d)", config.concurrency, resources, threads, rows, BLOCK_BATCHES, batch)
    # The requests are small and already validated by this driver: they enter the plan in memory
    # (ray.data.from_arrow), cut into blocks of block_rows -- one actor call each, its distinct uncached queries
    # packed into full model calls -- and partitions commit (and survive a driver crash) as their blocks finish.
    # read_parquet would add a file-listing task and read tasks that each need a whole CPU: on a one-CPU cluster
    # they wait forever behind the actors. Blocks, not partitions: one ray.put and one task per 8 model calls
    # (a 100,000-request run: 13 objects, not 391). On a CPU a block is 64 requests: the objects hold several blocks
    # (input_object_rows), which map_batches cuts back into blocks, one actor call each.
    total = sum(pq.read_metadata(layout.work_file(i)).num_rows for i in pending)
    obj_rows = input_object_rows(total, rows, config.concurrency)
    ds = ray.data.from_arrow(list(request_blocks((pq.read_table(layout.work_file(i)) for i in pending), obj_rows)))
    ds = ds.map_batches(
        GeneratorActor,
        fn_constructor_args=(config.task, config.spec, str(config.index) if config.index else None,
                             config.decoding, config.generate_config(num_threads=threads)),
        batch_size=rows,  # one block per actor call (an input object is a whole number of blocks)
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=config.concurrency),
        # a dead actor is restarted and its in-flight batch retried: no request is lost
        max_restarts=-1,
        max_task_retries=-1,
        runtime_env=runtime_env,
        **resources,
    )
    yield from ds.iter_batches(batch_format="pyarrow", batch_size=None)


def _latency(batch_seconds: Iterable[float]) -> dict[str, float]:
    vals = sorted(batch_seconds)
    if not vals:
        return {}
    q = statistics.quantiles(vals, n=20) if len(vals) > 1 else [vals[0]] * 19
    return {"batch_latency_p50_s": round(statistics.median(vals), 4),
            "batch_latency_p95_s": round(q[18], 4), "batches": len(vals)}


@dataclasses.dataclass
class Preflight:
    """What :func:`preflight` checked and a run is keyed on: the validated requests, the model's identity, the
    index's hash and (unless generative) the dense channel's identity."""

    validated: Any
    model_id: dict[str, Any]
    index_hash: str | None = None
    dense_id: dict[str, str] | None = None


def preflight(config: GenerateJobConfig) -> Preflight:
    """Every outside input of a generate run, checked in the driver before its ``--out`` is claimed and before Ray
    starts (the actors load them after): each check fails with its own line (a user error, exit status 2).

    1. the paths a run needs are given; 2. the request files, their schema and rows (bad rows are set aside);
    3. the model folder or compressed checkpoint, without loading it; targets: 4. the index's manifest and every
    file against it; 5. the model's binding to the index (trained on it, its tokenizer and vocabulary);
    6. the model's training record (its fitted fusion, its tuned query embedder's folder); unless generative:
    7. the dense channel: its embeddings file, the query embedder that answers (hash, folder, custom code)."""
    config.check_paths()
    validated = validate_requests(config.requests, config.task, config.validation)
    config.spec.check()
    found = Preflight(validated, config.spec.identity())
    if config.task is not GenerateTask.TARGETS:
        return found
    from adbatch.artifacts import read_manifest, verify_outputs
    from adbatch.serving.generators import check_training_record

    manifest = read_manifest(config.index)
    found.index_hash = manifest.get("index_hash")
    if not found.index_hash:
        raise ConfigError(f"GenerateJobConfig.index: {config.index} is not an index folder")
    verify_outputs(config.index, manifest)  # every file the actors read, by its manifest's sha256
    # a model trained on another index: refused here, not inside each Ray actor after start-up
    record = check_model_index(config.spec, config.index, manifest)
    check_training_record(config.spec, record)
    if config.targets.fusion is not FusionMode.GENERATIVE:  # the dense channel, checked the same way
        from adbatch.index.dense import (check_embedder_folder, check_embeddings_file, check_query_embedder,
                                         dense_identity, embedder_folder, tuned_query_embedder)

        found.dense_id = dense_identity(config.index, manifest)
        check_embeddings_file(config.index, manifest)
        tuned = tuned_query_embedder(config.spec.folder(), record, config.index, manifest)
        if tuned is None:
            check_embedder_folder(embedder_folder(check_query_embedder(config.index, manifest)["name"], config.index))
        else:  # the model's own query embedder answers: a re-tuned one redoes the partitions
            check_embedder_folder(tuned["name"])
            found.dense_id["query_embedder"] = tuned["sha256"]
    return found


def run_generate(config: GenerateJobConfig) -> dict[str, Any]:
    """Run (or resume) one generate job; returns the run summary (also in ``out/manifest.json``)."""
    timer = StageTimer()
    t_start = time.perf_counter()
    with timer.phase("validate"):
        found = preflight(config)
    layout = Layout(Path(config.out), config.task)
    validated, model_id, index_hash = found.validated, found.model_id, found.index_hash
    log.info("requests: %d rows in, %d accepted, %d rejected", validated.rows_in,
             validated.accepted.num_rows, validated.rejected.num_rows)
    identity = {
        "task": config.task.value,
        "requests_sha256": sha256_paths(validated.files),
        "model_sha256": model_id["sha256"],
        "index_hash": index_hash,
        **({"dense": found.dense_id} if found.dense_id else {}),
        "decoding": generator_fingerprint(config.task, config.decoding, config.generate_config()),
        "partition_size": config.partition_size,
        "validation": config.validation.to_dict(),
    }
    identity["run_key"] = sha256_json(identity)
    # one writer per folder, and never another stage's folder (docs/INTERFACES.md, "Output folders")
    with claim_output(layout.out, ArtifactKind.GENERATE):
        return _generate_into(config, layout, validated, identity, model_id, index_hash, timer, t_start)


def _generate_into(config: GenerateJobConfig, layout: Layout, validated: Any, identity: dict[str, Any],
                   model_id: dict[str, Any], index_hash: str | None, timer: StageTimer,
                   t_start: float) -> dict[str, Any]:
    """The part of :func:`run_generate` that writes: under the folder's claim."""
    _prepare_out(config, identity, layout)
    counts_per_part = _write_work_partitions(validated.accepted, layout, config.partition_size)
    # the partitions on disk are the requests from here on (the blocks are read from them): the driver lets the
    # validated table go, keeping its row count, so a long run does not hold every request for its whole length
    accepted_rows = validated.accepted.num_rows
    validated.accepted = validated.accepted.schema.empty_table()
    expected = dict(enumerate(counts_per_part))
    done = {i: rec for i in expected if (rec := partition_done(layout, i)) is not None}
    pending = [i for i in expected if i not in done]
    log.info("%d partition(s): %d already complete, %d to run", len(expected), len(done), len(pending))

    collector = _PartitionCollector(layout, config.task, {i: expected[i] for i in pending})
    with timer.phase("generate"):
        if pending:
            it = _iter_local(config, layout, pending) if config.executor is Executor.LOCAL \
                else _iter_ray(config, layout, pending)
            try:
                for batch in it:
                    collector.add(batch)
            finally:
                # on an error here (a full disk while committing) the Ray Data pipeline must stop now: left
                # running, its executor threads kept the driver alive after the traceback, holding the lock
                it.close()
        collector.check_complete()
    records = {**done, **collector.records}

    with timer.phase("finalize"):
        rejected_parts = [validated.rejected] + [
            pq.read_table(layout.rejected_file(i)) for i in sorted(records)]
        rejected = pa.concat_tables([t.cast(REJECTED_SCHEMA) for t in rejected_parts])
        write_parquet_atomic(rejected, layout.out / REJECTED_FILE)
    gen_seconds = timer.seconds.get("generate", 0.0)
    run_requests = sum(collector.records[i]["requests"] for i in collector.records)
    batch_secs = [s for i in collector.records for s in collector.records[i]["batch_seconds"]]
    counts = {
        "rows_in": validated.rows_in,
        "accepted": accepted_rows,
        "rejected_validation": validated.rejected.num_rows,
        "rejected_generation": sum(r["rejected"] for r in records.values()),
        "answered": sum(r["answered"] for r in records.values()),
        "output_rows": sum(r["output_rows"] for r in records.values()),
        "partitions": len(expected),
        "partitions_skipped": len(done),
        "partitions_run": len(collector.records),
        "duplicate_answers_dropped": collector.duplicates,
    }
    counts["rejected"] = counts["rejected_validation"] + counts["rejected_generation"]
    decoded = sum(collector.records[i].get("decoded", 0) for i in collector.records)
    model_calls = sum(collector.records[i].get("model_calls", 0) for i in collector.records)
    throughput = {
        "requests_run": run_requests,
        "requests_per_s": round(run_requests / gen_seconds, 4) if gen_seconds > 0 and run_requests else 0.0,
        # the model's share of the work: requests it decoded (the rest: repeats answered from the actors' answer
        # caches), its calls, and their mean size (the batch size when every call was full)
        "decoded": decoded, "model_calls": model_calls,
        "model_call_fill": round(decoded / model_calls, 2) if model_calls else 0.0,
        **_latency(batch_secs),
    }
    timings = {**timer.seconds, "total": time.perf_counter() - t_start}
    outputs = {f"{config.task.value}/{layout.part_name(i)}.parquet": records[i]["sha256"]
               for i in sorted(records)}
    if not expected:
        # nothing accepted: one empty part with the output schema, so a reader of <out>/<task> still
        # gets the contract's columns (an empty folder reads as a table without any)
        write_parquet_atomic(output_schema(config.task).empty_table(), layout.part_file(0))
        outputs[f"{config.task.value}/{layout.part_name(0)}.parquet"] = sha256_file(layout.part_file(0))
    outputs[REJECTED_FILE] = sha256_file(layout.out / REJECTED_FILE)
    manifest = build_manifest(
        stage="generate", config=config,
        inputs={"requests": identity["requests_sha256"], "model": model_id["sha256"],
                **({"index": index_hash} if index_hash else {})},
        outputs=outputs, counts=counts, timings=timings,
        extra={"model": model_id, "index_hash": index_hash, "run_key": identity["run_key"],
               "throughput": throughput, "executor": config.executor.value,
               "task": config.task.value},
    )
    write_json_atomic(layout.out / MANIFEST_NAME, manifest)
    log.info("generate done: %s answered, %s rejected, %.2f req/s -> %s", counts["answered"],
             counts["rejected"], throughput["requests_per_s"], layout.parts_dir)
    return {"out": str(layout.out), "outputs": str(layout.parts_dir),
            "rejected": str(layout.out / REJECTED_FILE), "counts": counts,
            "throughput": throughput, "timings_s": manifest["timings_s"]}


def generate_inputs(config: GenerateJobConfig) -> dict[str, Any]:
    """What invalidates a generate run beyond its config: the request files and the index by content, the
    model (a compressed checkpoint by its manifest) and, for creatives, the versions of both creative prompt
    renderings (the model's config says which one it reads)."""
    from pipelines.stage import folder_hash, model_input_hash

    inputs = {"requests": sha256_paths(list_request_files(config.requests)),
              "model": folder_hash(config.compressed) if config.compressed else model_input_hash(config.model)}
    if config.index is not None:
        inputs["index"] = folder_hash(config.index)
    if config.task is GenerateTask.CREATIVES:  # a new creative prompt rendering rewrites the headlines
        from adbatch.serving.prompts import CREATIVE_PROMPT_VERSION, TUNED_CREATIVE_PROMPT_VERSION

        inputs.update({"creative_prompt_version": str(CREATIVE_PROMPT_VERSION),
                       "tuned_creative_prompt_version": str(TUNED_CREATIVE_PROMPT_VERSION)})
    return inputs


#: ``run`` looks the verb up when called, so the refresh runs whatever this module's ``run_generate`` is then
STAGE = StageContract("generate", GenerateJobConfig, ArtifactKind.GENERATE, inputs=generate_inputs,
                      run=lambda config: run_generate(config),
                      wired=("task", "requests", "index", "model", "compressed", "out", "num_cpus", "overwrite",
                             "progress"))
