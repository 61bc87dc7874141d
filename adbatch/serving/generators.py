"""The generators behind the generate stage, usable without Ray (a notebook, the GPU machine).

:class:`TargetGenerator` loads a model (dense through :func:`adbatch.models.load_causal_lm`, or a
compressed checkpoint through :func:`adbatch.compress.load_compressed`) and an index
(:func:`adbatch.index.build.load_index`) once, then maps batches of validated target requests
(``request_id, query``) to *answers*: one row per request with its ranked ads as list columns, or an
``error``. :class:`CreativeGenerator` does the same for creative requests. ``pipelines/generate.py``
wraps them in a Ray Data actor; :func:`answers_to_output` turns answers into the output schemas of
:mod:`adbatch.serving.requests` and the rejected rows.

Batch size adapts: when a batch raises an out-of-memory error the generator halves its batch size,
logs it, and retries the same requests; a request that fails even alone becomes an error answer
(a rejected row with the reason), never a crashed job.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import enum
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa

from adbatch.artifacts import sha256_file, sha256_json, sha256_paths
from adbatch.config import ConfigBase, ConfigError
from adbatch.decoding.config import FusionMode
from adbatch.index.dense import DenseBackend
from adbatch.serving.requests import (CREATIVES_OUT_SCHEMA, REJECTED_SCHEMA, TARGETS_OUT_SCHEMA,
                              GenerateTask, RejectStage)

log = logging.getLogger(__name__)


class DeviceChoice(str, enum.Enum):
    """Where the generator runs the model."""

    AUTO = "auto"  #: CUDA when available (e.g. a Ray actor given a GPU), else CPU
    CPU = "cpu"
    CUDA = "cuda"


#: Requests per model call when none is configured, by device. CUDA: the decode engine's q/s rises
#: up to its largest measured batch (H200, default model, text index: 466 / 1,163 / 1,686 / 1,790
#: queries/s at 64 / 256 / 1,024 / 2,048; bench/RESULTS.md), and 1,024 keeps an 8B model's beam
#: cache within ~40 GB; CPU: the batch the README example was tuned at.
DEFAULT_BATCH_SIZE = {"cpu": 8, "cuda": 1024}


def default_batch_size(device: Any) -> int:
    """:data:`DEFAULT_BATCH_SIZE` for a device (``torch.device`` or its type name)."""
    return DEFAULT_BATCH_SIZE["cuda" if str(getattr(device, "type", device)).startswith("cuda") else "cpu"]


#: Model calls' worth of requests in one *block*: what one generator call maps (a Ray Data ``map_batches``
#: batch, a slice of the local executor). Inside a block the distinct uncached queries are packed into full
#: model calls, only the block's last call partial, so the larger the block the fuller the calls when queries
#: repeat (Zipf(1.0), 50,000 requests, 17,118 distinct, batch 1,024, the answer cache's own counting: mean
#: queries per model call 349 at 1 batch a block, 658 at 2 and 4, 856 at 8, 901 at 16). 8 keeps a block small
#: (8,192 requests on a GPU: a few MB of request rows and ~16 MB of answers as Python objects; the GPU holds one
#: model call, as before), a lost actor redoes at most 8 model calls, and Ray's per-task cost is paid once per
#: 8 calls. Not a knob: the block follows the batch size (:func:`block_rows`).
BLOCK_BATCHES = 8


def block_rows(batch_size: int) -> int:
    """Requests per block (:data:`BLOCK_BATCHES` model calls of ``batch_size``): the one rule both executors use."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return BLOCK_BATCHES * batch_size


#: answers a target generator keeps by query text: a query stream's head repeats (the same query thousands of
#: times in one night's requests); ~1 KB of Python objects an answer, so ~64 MB an actor at this size
DEFAULT_ANSWER_CACHE = 65_536


@dataclasses.dataclass
class GenerateConfig(ConfigBase):
    """Runtime knobs of one generator (not the decoding algorithm: that is the decoding config)."""

    batch_size: int | None = dataclasses.field(
        default=None, metadata={"help": "requests per model call (halved on out-of-memory); default by "
                                        "device: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH_SIZE.items())})
    device: DeviceChoice = dataclasses.field(
        default=DeviceChoice.AUTO, metadata={"help": "auto | cpu | cuda"})
    num_threads: int = dataclasses.field(
        default=0, metadata={"help": "torch CPU threads in this process (0 = leave torch's default)"})
    max_query_tokens: int = dataclasses.field(
        default=48, metadata={"help": "query tokens kept in the targeting prompt"})
    dense_backend: DenseBackend = dataclasses.field(
        default=DenseBackend.EXACT, metadata={"help": "dense channel search: exact (matmul + top-k on the device) | faiss_flat | "
                                           "faiss_hnsw (approximate, CPU; catalogues in the millions)"})
    answer_cache: int = dataclasses.field(
        default=DEFAULT_ANSWER_CACHE, metadata={
            "help": "targets: distinct queries whose answers one generator keeps (least recently used out), so a "
                    "query repeated in the requests is decoded once; 0 = decode every request"})

    def validate(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"GenerateConfig.batch_size must be >= 1, got {self.batch_size}")
        if self.num_threads < 0:
            raise ConfigError(f"GenerateConfig.num_threads must be >= 0, got {self.num_threads}")
        if self.max_query_tokens < 1:
            raise ConfigError(f"GenerateConfig.max_query_tokens must be >= 1, got {self.max_query_tokens}")
        if self.answer_cache < 0:
            raise ConfigError(f"GenerateConfig.answer_cache must be >= 0, got {self.answer_cache}")


class ModelKind(str, enum.Enum):
    DENSE = "dense"  #: an HF folder, a GGUF, or the default model, loaded as plain torch modules
    COMPRESSED = "compressed"  #: an ``adbatch compress`` checkpoint (INT4 + N:M packed linears)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model a generator loads: ``compressed`` when set, else ``model`` (None = default)."""

    model: str | None = None
    compressed: str | None = None

    @property
    def kind(self) -> ModelKind:
        return ModelKind.COMPRESSED if self.compressed else ModelKind.DENSE

    def folder(self) -> Path:
        """The local folder holding the weights (the default model is converted once)."""
        if self.compressed:
            return Path(self.compressed)
        from adbatch.models import resolve_model

        return resolve_model(self.model)

    def identity(self) -> dict[str, Any]:
        """kind, folder and a content hash (the checkpoint manifest, or the weight files)."""
        folder = self.folder()
        if self.kind is ModelKind.COMPRESSED:
            digest = sha256_file(folder / "manifest.json")
        else:
            files = sorted(p for p in folder.iterdir()
                           if p.suffix in (".safetensors", ".json") and not p.name.startswith("."))
            digest = sha256_paths(files)
        return {"kind": self.kind.value, "source": self.compressed or self.model or "default",
                "folder": str(folder), "sha256": digest}

    def check(self) -> None:
        """What can be checked of the model without loading it, so a driver refuses a bad one before Ray
        starts (the actors load it): a checkpoint's shards and side files against its manifest, a dense
        folder's weight format, custom code and file headers (:func:`adbatch.models.check_model_folder`)."""
        if self.kind is ModelKind.COMPRESSED:
            from adbatch.compress.checkpoint import verify_checkpoint

            verify_checkpoint(self.compressed)
        else:
            from adbatch.models import check_model_folder

            check_model_folder(self.folder())

    def vocab_size(self) -> int | None:
        """``vocab_size`` of the model's config.json (None when it names none)."""
        cfg = json.loads((self.folder() / "config.json").read_text())
        size = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
        return None if size is None else int(size)

    def training_record(self) -> dict[str, Any] | None:
        """The ``adbatch_training.json`` binding this model to an index, if it has one."""
        from adbatch.training.checkpoint import read_training_record

        folder = self.folder()
        record = read_training_record(folder)
        if record is None and self.kind is ModelKind.COMPRESSED:
            # A compressed checkpoint may carry the binding in its manifest instead.
            from adbatch.training.checkpoint import model_binding

            manifest = json.loads((folder / "manifest.json").read_text())
            if manifest.get("trained_on_index"):
                record = model_binding(manifest)
        return record


def check_model_index(spec: ModelSpec, index_dir: str | Path, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """Refuse a model trained on another index; allow an untrained model only on a text index.

    Reads only the index's manifest (``index_hash``, ``scheme``, ``tokenizer_fingerprint``) and the
    model's training record and tokenizer (no weights), so a driver can check before any index or
    model is loaded. An untrained model over a ``codes`` index cannot emit the code tokens at all, so it
    is refused with a message saying what to do; a model whose tokenizer is not the one the index's
    token ids were built with is refused (:func:`check_model_tokenizer`), and one whose vocabulary is
    smaller than the trie's token ids (:func:`check_model_vocab`).
    """
    from adbatch.training.checkpoint import IndexMismatchError, check_binding

    record = spec.training_record()
    want = manifest["index_hash"]
    if record is None:
        if str(manifest.get("scheme")) == "codes":
            raise IndexMismatchError(
                f"model {spec.folder()} was never trained on an index, and index {index_dir} "
                f"uses the 'codes' scheme (special tokens it cannot emit): train it first "
                f"(adbatch train) or use a 'text' index")
        check_model_tokenizer(spec, index_dir, manifest)
        check_model_vocab(spec, index_dir, manifest)
        log.warning("model %s is untrained (zero-shot) over text index %s; expect low recall",
                    spec.folder(), str(want)[:12])
        return None
    check_binding(record, want, f"model {spec.folder()} (decoding index {index_dir})")
    check_model_tokenizer(spec, index_dir, manifest)
    check_model_vocab(spec, index_dir, manifest)
    return record


def check_training_record(spec: ModelSpec, record: Mapping[str, Any] | None) -> None:
    """What generate reads of a trained model's record beyond its binding to the index (:func:`check_model_index`),
    parsed in the driver before Ray starts (every actor parses it again): the fitted fusion
    (:func:`adbatch.serving.hybrid.fusion_of_record`) and the tuned query embedder's folder, which must lie inside
    the model folder (:func:`adbatch.index.dense.tuned_embedder_dir`). One line naming the record's file when not."""
    if record is None:
        return
    from adbatch.artifacts import MANIFEST_NAME
    from adbatch.index.dense import tuned_embedder_dir
    from adbatch.serving.hybrid import fusion_of_record
    from adbatch.training.checkpoint import TRAINING_RECORD

    folder = spec.folder()
    source = folder / TRAINING_RECORD if (folder / TRAINING_RECORD).is_file() else folder / MANIFEST_NAME
    fusion_of_record(record, source=str(source))
    if record.get("query_embedder"):
        tuned_embedder_dir(folder, record["query_embedder"])


def check_model_vocab(spec: ModelSpec, index_dir: str | Path, manifest: Mapping[str, Any]) -> None:
    """Refuse a model whose vocabulary is smaller than the token ids of the index's trie (the search would
    fail in every actor). Reads the trie file's header and the model's config.json only (no torch)."""
    from safetensors import safe_open

    from adbatch.artifacts import ArtifactIntegrityError
    from adbatch.training.checkpoint import IndexMismatchError

    trie_file = Path(index_dir) / manifest.get("trie_file", "trie.safetensors")
    try:
        with safe_open(str(trie_file), framework="numpy") as fh:
            bound = int(fh.metadata()["vocab_upper_bound"])
    except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError); KeyError
        raise ArtifactIntegrityError(f"{trie_file}: not a readable trie header ({exc})") from None
    vocab = spec.vocab_size()
    if vocab is not None and vocab < bound:
        raise IndexMismatchError(f"model {spec.folder()} has a vocabulary of {vocab} tokens but index {index_dir}'s "
                                 f"trie uses token ids up to {bound - 1}: it was built for another model")


def check_model_tokenizer(spec: ModelSpec, index_dir: str | Path, manifest: Mapping[str, Any]) -> None:
    """Refuse a model whose tokenizer is not the one the index's ``token_ids`` were built with: the
    trie would constrain it to ids that mean other tokens to it (meaningless ads, no error).

    Compares :func:`adbatch.models.tokenizer_fingerprint` of the model's tokenizer below the index's
    ``base_vocab_size`` (code tokens a training run added above it do not count) with the manifest's
    ``tokenizer_fingerprint``; an index without one is not checked.
    """
    from adbatch.models import tokenizer_file_fingerprint, tokenizer_fingerprint
    from adbatch.training.checkpoint import IndexMismatchError

    want = manifest.get("tokenizer_fingerprint")
    if want is None:
        return
    folder = spec.folder()
    below = manifest.get("base_vocab_size")
    below = None if below is None else int(below)
    # The vocabulary read straight from tokenizer.json (tokenizers, no transformers import) is what
    # get_vocab() returns for a fast tokenizer; it accepts in ~0.3 s where loading the tokenizer took
    # the driver seconds. Anything else (no tokenizer.json, or a vocabulary that differs) is decided
    # by the tokenizer transformers loads, as the index was built with.
    if tokenizer_file_fingerprint(folder, below=below) == want:
        return
    from adbatch.index.build import load_tokenizer

    try:
        tokenizer, _ = load_tokenizer(str(folder))
    except (OSError, ValueError) as exc:
        raise IndexMismatchError(f"model {folder}: no readable tokenizer to check against index {index_dir} "
                                 f"({exc})") from None
    if tokenizer_fingerprint(tokenizer, below=below) != want:
        raise IndexMismatchError(
            f"model {folder} has another tokenizer than index {index_dir} was built with "
            f"({manifest.get('tokenizer')}): the index's token ids would mean other tokens to this model. "
            "Rebuild the index with this model's tokenizer (--index.tokenizer) or generate with the "
            "model it was built for")


def resolve_device(choice: DeviceChoice) -> str:
    import torch

    if choice is DeviceChoice.AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice is DeviceChoice.CUDA and not torch.cuda.is_available():
        raise RuntimeError("GenerateConfig.device=cuda but torch sees no CUDA device")
    return choice.value


def load_model(spec: ModelSpec, device: str) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode on ``device``."""
    if spec.kind is ModelKind.COMPRESSED:
        from adbatch.compress import load_compressed

        model, tok = load_compressed(spec.compressed, device=device)
        if not str(device).startswith("cuda"):
            # Off the GPU a CompressedLinear runs the pure-torch reference, which dequantizes its whole
            # weight on every call (measured on the default model, 32 rows: 0.88 s per decode step vs
            # 0.086 s dense). Dequantizing once into nn.Linear gives the same fp32 values -- identical
            # logits -- at dense speed and the memory of an fp32 dense model, the CPU default anyway.
            from adbatch.compress.linear import densify_

            log.info("compressed model on %s: %d packed layers dequantized once to dense fp32", device, densify_(model))
    else:
        from adbatch.models import load_causal_lm

        model, tok = load_causal_lm(spec.model, device=device)
    if getattr(tok, "pad_token_id", None) is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


#: request-level answers of the targets generator (one row per request; internal to the stage)
TARGET_ANSWER_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("error", pa.string()),  # null when answered
    ("ad_ids", pa.list_(pa.string())),
    ("scores", pa.list_(pa.float32())),
    ("scores_generative", pa.list_(pa.float32())),  # null entries where the channel did not run
    ("scores_dense", pa.list_(pa.float32())),
    ("channels", pa.list_(pa.string())),
    ("codes", pa.list_(pa.list_(pa.int32()))),
    ("verify_mode", pa.string()),
    ("beams_verified", pa.int32()),  # beams verified in the decode batch this request ran in
])

#: request-level answers of the creatives generator
CREATIVE_ANSWER_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("ad_id", pa.string()),
    ("error", pa.string()),
    ("headlines", pa.list_(pa.string())),
    ("scores", pa.list_(pa.float32())),
    ("flags", pa.list_(pa.list_(pa.string()))),  # per headline: the checks it failed (adbatch.serving.checks)
])


#: per-call counts a generator call appends to its answers, on the call's first row: requests sent to the model,
#: model calls (see :meth:`_GeneratorBase.__call__`)
BLOCK_STATS = ("block_decoded", "block_model_calls")


def answer_schema(task: GenerateTask) -> pa.Schema:
    return TARGET_ANSWER_SCHEMA if task is GenerateTask.TARGETS else CREATIVE_ANSWER_SCHEMA


class _AdaptiveBatcher:
    """Runs ``fn`` over items in batches of ``batch_size`` (full ones, the last excepted); on out-of-memory
    halves the batch size and retries. Counts the calls that answered and their items (the model calls' fill)."""

    def __init__(self, batch_size: int, on_oom: Callable[[], None] | None = None) -> None:
        self.batch_size = batch_size
        self.on_oom = on_oom
        self.oom_events = 0
        self.calls = 0  # calls of fn that answered
        self.call_items = 0  # items those calls answered

    def run(self, items: Sequence[Any], fn: Callable[[Sequence[Any]], list[Any]],
            fail: Callable[[Any, str], Any]) -> list[Any]:
        out: list[Any] = []
        i = 0
        while i < len(items):
            chunk = items[i:i + self.batch_size]
            try:
                res = fn(chunk)
            except Exception as exc:  # only OOM is recoverable here; anything else propagates
                if not _is_oom(exc):
                    raise
                self.oom_events += 1
                if self.on_oom:
                    self.on_oom()
                if len(chunk) == 1:
                    log.error("out of memory on a single request; rejecting it: %s", exc)
                    out.append(fail(chunk[0], f"out of memory at batch size 1: {exc}"[:300]))
                    i += 1
                    continue
                self.batch_size = max(1, min(self.batch_size, len(chunk)) // 2)
                log.warning("out of memory at batch size %d; halving to %d and retrying",
                            len(chunk), self.batch_size)
                continue
            out.extend(res)
            i += len(chunk)
            self.calls += 1
            self.call_items += len(chunk)
        return out


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _GeneratorBase(abc.ABC):
    task: GenerateTask

    def __init__(self, spec: ModelSpec, config: GenerateConfig) -> None:
        import torch

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.spec = spec
        self.config = config
        self.device = resolve_device(config.device)
        t0 = time.perf_counter()
        self.model, self.tokenizer = load_model(spec, self.device)
        self.load_seconds = time.perf_counter() - t0
        batch_size = config.batch_size or default_batch_size(self.device)
        self.batcher = _AdaptiveBatcher(batch_size, on_oom=_empty_cuda_cache)
        # requests per call of this generator that the executors form (fixed: an out-of-memory halving lowers the
        # model calls, not the blocks, which Ray has cut by then)
        self.block_rows = block_rows(batch_size)
        self.requests_done = 0
        self.busy_seconds = 0.0
        # answers by _answer_key, least recently used first (targets only; see GenerateConfig.answer_cache)
        self.answers: collections.OrderedDict[Any, dict[str, Any]] = collections.OrderedDict()
        self.decoded = 0  # requests the model answered (the rest: repeats answered from self.answers)

    @property
    def batch_size(self) -> int:
        return self.batcher.batch_size

    def stats(self) -> dict[str, Any]:
        """Counters since load. ``decoded``: requests sent to the model (the rest were answered from the answer
        cache); ``model_calls``: model calls that answered; ``model_call_fill``: their mean requests per call
        (``batch_size`` when every call was full)."""
        b = self.batcher
        return {"requests": self.requests_done, "decoded": self.decoded, "busy_s": round(self.busy_seconds, 4),
                "load_s": round(self.load_seconds, 4), "batch_size": self.batch_size, "block_rows": self.block_rows,
                "model_calls": b.calls, "model_call_fill": round(b.call_items / b.calls, 2) if b.calls else 0.0,
                "oom_events": b.oom_events, "device": self.device}

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Answers for one block of validated requests (extra ``partition`` column passed through), in its order.

        Beside :func:`answer_schema`'s columns: ``batch_seconds`` (the call's wall time, every row: each request's
        latency) and :data:`BLOCK_STATS`, the call's ``block_decoded`` requests sent to the model and
        ``block_model_calls``, carried on the block's first row (0 on the others: sums over any set of whole rows
        count each call once, however blocks and partitions overlap)."""
        t0 = time.perf_counter()
        rows = batch.to_pylist()
        decoded, calls = self.decoded, self.batcher.calls
        answers = self._answer(rows)
        table = pa.Table.from_pylist(answers, schema=answer_schema(self.task))
        if "partition" in batch.column_names:
            table = table.append_column("partition", batch.column("partition"))
        seconds = time.perf_counter() - t0
        # every request of a call finishes together, so the call's wall time is each one's latency
        table = table.append_column("batch_seconds", pa.array([seconds] * len(rows), pa.float64()))
        for name, count in zip(BLOCK_STATS, (self.decoded - decoded, self.batcher.calls - calls)):
            table = table.append_column(name, pa.array([count] + [0] * (len(rows) - 1) if rows else [], pa.int32()))
        self.busy_seconds += seconds
        self.requests_done += len(rows)
        return table

    def _answer_key(self, row: dict[str, Any]) -> Any:
        """What decides a request's answer besides the generator's fixed model and config (requests with equal
        keys get equal answers, decoded once); None: every request is decoded (the default)."""
        return None

    def _answer(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One answer per row, in order. Rows whose key was answered before (in this batch or, while the cache
        holds it, an earlier one) are not decoded again: the model sees each distinct key once, and the keys to
        decode are packed into full model calls (``batch_size`` each, the last one partial): a block of
        :data:`BLOCK_BATCHES` batches with repeats still gives full calls. Per row: one key and dict lookups."""
        keys = [self._answer_key(r) for r in rows] if self.config.answer_cache else [None] * len(rows)
        known: dict[Any, dict[str, Any]] = {}  # key -> its answer: cached, or decoded in this batch
        todo: dict[Any, int] = {}  # key -> the row decoded for it
        run = []  # rows the model answers: those without a key, and the first row of each new key
        for i, k in enumerate(keys):
            if k is None:
                run.append(i)
            elif k in self.answers:
                self.answers.move_to_end(k)
                known[k] = self.answers[k]
            elif k not in todo:
                todo[k] = i
                run.append(i)
        decoded = dict(zip(run, self.batcher.run([rows[i] for i in run], self._generate, self._failed)))
        self.decoded += len(run)
        for k, i in todo.items():
            known[k] = decoded[i]
            if decoded[i]["error"] is None:  # an error (out of memory alone) is not kept: a later batch retries
                self.answers[k] = decoded[i]
        while len(self.answers) > self.config.answer_cache:
            self.answers.popitem(last=False)
        out = []
        for i, (row, k) in enumerate(zip(rows, keys)):
            a = decoded[i] if k is None else known[k]
            out.append(a if a["request_id"] == row["request_id"] else {**a, "request_id": row["request_id"]})
        return out

    @abc.abstractmethod
    def _generate(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Answers for ``rows`` (one model call); may raise out-of-memory."""

    @abc.abstractmethod
    def _failed(self, row: dict[str, Any], reason: str) -> dict[str, Any]:
        """The error answer for ``row``."""


class TargetGenerator(_GeneratorBase):
    """Query -> ranked ads over an index: trie-constrained beam search (+ verification), the index's dense
    channel, or both fused (``search.fusion``; :mod:`adbatch.serving.hybrid`).

    Loads the model, the index and (unless generative) the ad embeddings and query embedder (the model's tuned
    one when its training record names one) once; each call
    maps a ``pa.Table`` of ``request_id, query`` (validated, see
    :func:`adbatch.serving.requests.validate_requests`) to a table of :data:`TARGET_ANSWER_SCHEMA`.
    The fusion's parameters come from the model's training record (:func:`adbatch.serving.hybrid.fusion_of_record`:
    RRF for a trained model without a fit, the dense order for a model never trained on the index).
    """

    task = GenerateTask.TARGETS

    def __init__(self, spec: ModelSpec, index_dir: str | Path, search: Any,
                 config: GenerateConfig | None = None) -> None:
        from adbatch.decoding import TargetSearchConfig
        from adbatch.index.build import load_index

        if not isinstance(search, TargetSearchConfig):
            raise TypeError(f"search must be a TargetSearchConfig, got {type(search).__name__}")
        self.index = load_index(index_dir)
        self.training_record = check_model_index(spec, self.index.directory, self.index.manifest)
        super().__init__(spec, config or GenerateConfig())
        self.search = search
        self.ad_ids = [str(a) for a in self.index.ad_ids]
        self.codes = self.index.ad_codes.column("code").to_pylist()
        self.cost_model = None
        if search.verify.value == "auto" and search.fusion is not FusionMode.DENSE:
            from adbatch.decoding import load_or_calibrate

            # measured once per generator, not once per batch
            self.cost_model = load_or_calibrate(self.model)
        from adbatch.serving.hybrid import HybridRanker, fusion_of_record

        dense = None
        if search.fusion is not FusionMode.GENERATIVE:
            from adbatch.index.dense import DenseRetriever, tuned_query_embedder

            tuned = tuned_query_embedder(spec.folder(), self.training_record, self.index.directory, self.index.manifest)
            dense = DenseRetriever(self.index, self.device, backend=self.config.dense_backend, query_embedder=tuned)
        self.fusion = fusion_of_record(self.training_record)
        self.ranker = HybridRanker(self.model, self.tokenizer, self.index, search, dense=dense, fusion=self.fusion,
                                   max_query_tokens=self.config.max_query_tokens, cost_model=self.cost_model)
        if search.fusion is not FusionMode.DENSE:
            self._warm_up()

    def _warm_up(self) -> None:
        """Route a compressed model's linear plan at every row bucket this generator's passes will run (prefill,
        steps, tree passes) before the first request: the plan's choices are saved per device, so the first batch
        neither times candidates nor builds copies inside the work (issue 60: a trained model's first 297 queries
        ran at 22.6 q/s, the next at 2,122, H200). A no-op for a dense model and on the CPU (no graphs)."""
        from adbatch.decoding.config import DenseScoring, VerifyMode
        from adbatch.decoding.engine import warm_up_search
        from adbatch.decoding.tree_verify import SCORE_PASS_TOKENS
        from adbatch.serving.prompts import encode_targeting_prompt

        longest = len(encode_targeting_prompt(self.tokenizer, "x " * self.config.max_query_tokens,
                                              self.config.max_query_tokens))
        tree = self.search.max_tokens_per_pass if self.search.verify is not VerifyMode.OFF else 0
        if self.search.fusion is FusionMode.HYBRID and self.search.dense_scoring is DenseScoring.EXACT:
            tree = max(tree, SCORE_PASS_TOKENS)  # exact scoring of the dense candidates runs larger tree passes
        warm_up_search(self.model, self.search, self.batch_size, longest, tree)

    def _answer_key(self, row: dict[str, Any]) -> Any:
        return row["query"]  # the ranking reads the query alone (each query's beams are its own)

    def _generate(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        import math

        from adbatch.serving.hybrid import CHANNEL_NAMES

        ranked = self.ranker.rank([r["query"] for r in rows])
        # one host copy per batch; per request, its ranked rows become lists
        cols = [x.tolist() for x in (ranked.rows, ranked.score, ranked.generative, ranked.dense, ranked.channel)]
        verified = self.ranker.last_beams_verified
        out = []

        def opt(x: float) -> float | None:  # a channel that did not run leaves NaN: null in the Parquet
            return None if math.isnan(x) else float(x)

        for r, ad_rows, sc, gen, den, ch in zip(rows, *cols):
            keep = [i for i, a in enumerate(ad_rows) if a >= 0]
            out.append({
                "request_id": r["request_id"], "error": None,
                "ad_ids": [self.ad_ids[ad_rows[i]] for i in keep],
                "scores": [float(sc[i]) for i in keep],
                "scores_generative": [opt(gen[i]) for i in keep],
                "scores_dense": [opt(den[i]) for i in keep],
                "channels": [CHANNEL_NAMES[ch[i]] for i in keep],
                "codes": [self.codes[ad_rows[i]] for i in keep],
                "verify_mode": self.search.verify.value, "beams_verified": verified,
            })
        return out

    def _failed(self, row: dict[str, Any], reason: str) -> dict[str, Any]:
        return {"request_id": row["request_id"], "error": reason, "ad_ids": [], "scores": [],
                "scores_generative": [], "scores_dense": [], "channels": [],
                "codes": [], "verify_mode": self.search.verify.value, "beams_verified": 0}


_CUT_WARNED = False


def _warn_cut_ad_text(rows: Sequence[dict[str, Any]]) -> None:
    """Log (once per process) that ad text beyond AD_PROMPT_CHARS does not reach the model: validation
    accepts up to ``max_ad_chars`` (4,000), so a long description would otherwise be cut silently."""
    global _CUT_WARNED
    if _CUT_WARNED:
        return
    from adbatch.serving.prompts import AD_PROMPT_CHARS, render_ad_fields

    cut = [r["request_id"] for r in rows if len(render_ad_fields(r, None)) > AD_PROMPT_CHARS]
    if cut:
        _CUT_WARNED = True
        log.warning("creative prompts keep the first %d characters of the ad fields; request %s (and %d more in "
                    "this batch) is longer: the rest does not reach the model (logged once per process)",
                    AD_PROMPT_CHARS, cut[0], len(cut) - 1)


class CreativeGenerator(_GeneratorBase):
    """Ad/product record -> headline variants (free-text generation), each checked.

    Each call maps a ``pa.Table`` of validated creative requests (``request_id, ad_id`` + ad fields)
    to a table of :data:`CREATIVE_ANSWER_SCHEMA`. Per ad the decoder writes ``creative.num_candidates``
    texts; placeholders are restored when the model learned masked pairs (:func:`adbatch.serving.delex.delex_of`:
    its prompts are masked the same way); every text is checked (:func:`adbatch.serving.checks.creative_flags`,
    against the ad's own fields) and the ``num_return`` best that pass are kept, failing ones only when too few
    pass, with their flags (:func:`adbatch.serving.checks.choose`): no request loses its headlines to the
    checks, and none is written without its checks' outcome.
    """

    task = GenerateTask.CREATIVES

    def __init__(self, spec: ModelSpec, creative: Any, config: GenerateConfig | None = None) -> None:
        from adbatch.decoding import CreativeConfig

        if not isinstance(creative, CreativeConfig):
            raise TypeError(f"creative must be a CreativeConfig, got {type(creative).__name__}")
        super().__init__(spec, config or GenerateConfig())
        self.creative = creative
        # the decoder returns every candidate; the checks choose num_return of them
        self.decoding = creative.replace(num_return=creative.num_candidates)
        from adbatch.serving.delex import delex_of
        from adbatch.serving.prompts import creative_prompt_of

        # the prompt the model declares it was fine-tuned on (adbatch.training.creatives), else few-shot
        self.prompt_style = creative_prompt_of(self.model)
        self.delex = delex_of(self.model)  # the masking the fine-tune learned (off for an untuned model)

    def _generate(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        from adbatch.decoding import generate_creatives
        from adbatch.serving.checks import choose, creative_flags
        from adbatch.serving.delex import delexicalise, restore
        from adbatch.serving.prompts import creative_prompt_text, encode_creative_prompt

        masked = [delexicalise(r, self.delex) for r in rows]
        prompts = [encode_creative_prompt(self.tokenizer, m.fields if m.slots else r, style=self.prompt_style)
                   for r, m in zip(rows, masked)]
        _warn_cut_ad_text(rows)
        results = generate_creatives(self.model, self.tokenizer, prompts, self.decoding)
        out = []
        for r, m, res in zip(rows, masked, results):
            prompt_text = creative_prompt_text(r, style=self.prompt_style)
            cands = [(restore(t, m.slots), float(s)) for t, s in res]
            flags = [[f.value for f in creative_flags(t, r, prompt_text)] for t, _ in cands]
            keep = choose(cands, flags, self.creative.num_return)
            out.append({"request_id": r["request_id"], "ad_id": r["ad_id"], "error": None,
                        "headlines": [cands[i][0] for i in keep], "scores": [cands[i][1] for i in keep],
                        "flags": [flags[i] for i in keep]})
        return out

    def _failed(self, row: dict[str, Any], reason: str) -> dict[str, Any]:
        return {"request_id": row["request_id"], "ad_id": row["ad_id"], "error": reason,
                "headlines": [], "scores": [], "flags": []}


def _flat_lists(answers: pa.Table, lists: Sequence[str], per_request: Sequence[str]) -> dict[str, pa.Array]:
    """The list columns ``lists`` of ``answers`` (one row per request, lists of equal length per row) flattened one
    level, the columns ``per_request`` repeated once per list item, and ``_pos`` the item's 0-based place in its
    list: columnar, no loop per request or item."""
    import numpy as np
    import pyarrow.compute as pc

    first = answers.column(lists[0]).combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(first), 0).to_numpy(zero_copy_only=False)
    for name in lists[1:]:
        other = pc.fill_null(pc.list_value_length(answers.column(name).combine_chunks()), 0)
        bad = np.flatnonzero(other.to_numpy(zero_copy_only=False) != lengths)
        if bad.size:
            rid = answers.column("request_id")[int(bad[0])].as_py()
            raise ValueError(f"answer {rid!r}: {name} has {other[int(bad[0])].as_py()} items but {lists[0]} "
                             f"{lengths[bad[0]]}")
    parent = np.repeat(np.arange(len(lengths)), lengths)  # [items] request row of each item
    starts = np.cumsum(lengths) - lengths
    out = {name: pc.list_flatten(answers.column(name).combine_chunks()) for name in lists}
    out.update({name: answers.column(name).take(pa.array(parent)) for name in per_request})
    out["_pos"] = pa.array(np.arange(len(parent)) - starts[parent], pa.int32())
    return out


def answers_to_output(task: GenerateTask, answers: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Explode request-level answers into (output rows, rejected rows).

    Targets: one output row per (request, rank), rank 1 = best. Creatives: one per (request,
    variant). An answer with an ``error`` becomes a rejected row (stage ``generate``).
    Columnar (Arrow list flattening), so the driver's cost per committed request stays small.
    """
    import pyarrow.compute as pc

    failed = answers.filter(pc.is_valid(answers.column("error")))
    ok = answers.filter(pc.is_null(answers.column("error")))
    rejected = [{"request_id": rid, "file": "", "row": -1, "stage": RejectStage.GENERATE.value, "reason": err,
                 "raw": json.dumps({"request_id": rid})}
                for rid, err in zip(failed.column("request_id").to_pylist(), failed.column("error").to_pylist())]
    if task is GenerateTask.TARGETS:
        schema = TARGETS_OUT_SCHEMA
        f = _flat_lists(ok, ("ad_ids", "scores", "scores_generative", "scores_dense", "channels", "codes"),
                        ("request_id", "verify_mode", "beams_verified"))
        cols = {"request_id": f["request_id"], "rank": pc.add(f["_pos"], 1), "ad_id": f["ad_ids"],
                "score": f["scores"], "score_generative": f["scores_generative"], "score_dense": f["scores_dense"],
                "channel": f["channels"], "code": f["codes"], "verify_mode": f["verify_mode"],
                "batch_beams_verified": f["beams_verified"]}
    else:
        schema = CREATIVES_OUT_SCHEMA
        flags = ok.column("flags")
        headlines = pc.fill_null(pc.list_value_length(ok.column("headlines")), 0)
        nflags = pc.list_value_length(flags)
        # every written headline carries its checks' outcome: an answer without it is a bug, not a pass
        bad = pc.or_kleene(pc.is_null(nflags), pc.not_equal(nflags, headlines))
        if ok.num_rows and pc.any(pc.fill_null(bad, True)).as_py():
            i = pc.index(bad, True).as_py()
            raise ValueError(f"creative answer {ok.column('request_id')[i].as_py()!r} has "
                             f"{headlines[i].as_py()} headlines but flags {flags[i].as_py()!r}")
        f = _flat_lists(ok, ("headlines", "scores", "flags"), ("request_id", "ad_id"))
        if f["flags"].null_count:
            raise ValueError("creative answers hold a null flags list for a headline (every headline needs its "
                             "checks' outcome, [] when it passed them all)")
        cols = {"request_id": f["request_id"], "ad_id": f["ad_id"], "variant": f["_pos"], "headline": f["headlines"],
                "score": f["scores"], "flags": f["flags"]}
    out = pa.table({name: pa.chunked_array([c]) if isinstance(c, pa.Array) else c for name, c in cols.items()})
    return (out.select(schema.names).cast(schema),
            pa.Table.from_pylist(rejected, schema=REJECTED_SCHEMA))


def generator_fingerprint(task: GenerateTask, decoding: Any, config: GenerateConfig) -> str:
    """Hash of everything that decides the content of the answers (not the batch size), the
    prompt's rendering version included: a resumed run must not keep answers to another prompt."""
    from adbatch.serving.prompts import CREATIVE_PROMPT_VERSION, TARGETING_PROMPT_VERSION, TUNED_CREATIVE_PROMPT_VERSION

    from adbatch.serving.checks import CHECKS_VERSION
    from adbatch.serving.delex import DELEX_VERSION

    # creatives: both renderings' versions (the model decides which one it reads; its hash is in the key too), and
    # the checks' and the masking's rule versions (they decide which headline is written)
    prompt = (TARGETING_PROMPT_VERSION if task is GenerateTask.TARGETS
              else f"{CREATIVE_PROMPT_VERSION}/tuned{TUNED_CREATIVE_PROMPT_VERSION}/checks{CHECKS_VERSION}/delex{DELEX_VERSION}")
    return sha256_json({"task": task.value, "decoding": decoding.to_dict(),
                        "max_query_tokens": config.max_query_tokens, "prompt_version": prompt,
                        # an approximate dense search may rank other ads: part of what decides the answers
                        **({"dense_backend": config.dense_backend.value} if config.dense_backend is not DenseBackend.EXACT else {})})
