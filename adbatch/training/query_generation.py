"""Generated queries for the targeting training (DSI-QG / docT5query): a query generator (ad text -> query)
fine-tuned on the labelled pairs of the train split writes N queries for every ad of the catalogue.

Span pseudo-queries (:mod:`adbatch.training.pseudo_queries`) only ever use the ad's own words; real
queries also use words the title lacks ("cordless drill" for a "20V MAX Drill/Driver Kit"), which is what
a generator trained on (title -> labelled query) pairs can learn and spans cannot. The steps, each a verb:

- **pairs** (:func:`query_pairs`): (ad text -> query) from the labelled pairs the caller passes as the
  *train* split -- only those; validation / test query strings passed as ``exclude_queries`` are refused
  too (counted), so a caller's mistake cannot leak them. Empty queries, ads missing from the catalogue,
  queries equal to the ad's text and duplicates are skipped and counted.
- **fine-tune** (:func:`tune_query_generator`): the seq2seq-on-a-causal-LM fine-tune the creative model
  uses (:func:`adbatch.training.creatives.fine_tune_pairs`), on the query-generation prompt
  (:func:`adbatch.serving.prompts.encode_query_gen_prompt`, versioned) -> the query + EOS.
- **generate** (:func:`generate_queries`): ``queries_per_ad`` samples per ad with the decode engine
  (:func:`adbatch.decoding.creative.generate_creatives`, temperature + nucleus, seeded per prompt: the
  same ad gets the same queries whatever the batch or shard), then cleaned (:func:`clean_queries`:
  stripped; empty ones, copies of the ad's text and duplicates within the ad dropped and counted).
- **round trip** (optional, :func:`round_trip_filter`): keep a query only if a cheap retriever over the
  catalogue (MiniLM + exact inner-product search, the benchmark's baseline) ranks its source ad in the
  top ``round_trip_top_k``. Cost: one MiniLM pass over the catalogue titles plus one over every kept query
  (N x ads of them) and a flat search of each against the catalogue -- on the full 54,667-title Home
  Depot catalogue at N = 10 that is ~550k short queries, minutes on a GPU, far longer on a CPU.
- **cache**: the result is a Parquet file (query, ad_id, source; stats and the key in its metadata)
  keyed by :func:`generation_key`, the content hash of everything that decides it (train pairs, the
  catalogue's texts, this config, the generator's weights and tokenizer, the prompt version and
  :data:`QUERY_GEN_VERSION`), so a re-run or a nightly refresh with unchanged inputs reads it instead of
  fine-tuning and generating again. :func:`adbatch.training.train_on_index` keeps it in the model folder.

With no (or too few, ``min_pairs``) labelled train pairs the generator cannot be trained:
``no_labels = spans`` (default) trains on span pseudo-queries instead, with a warning saying so;
``zero_shot`` prompts the untuned base model with the same prompt (an instruct model can write queries
from the instruction alone; what the 135M default model writes so is measured in docs/training.md).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

from adbatch.config import ConfigBase, ConfigError
from adbatch.models import serving_dtype
from adbatch.training.quant_aware import QuantAwareConfig
from adbatch.training.trainer import TrainConfig

log = logging.getLogger(__name__)

#: bumped whenever what this module does with the same inputs changes (cleaning rules, the round-trip
#: rule, the fine-tune's examples): part of :func:`generation_key`, so older caches are not reused
QUERY_GEN_VERSION = 3  # 2: the samples are drawn from a bf16 copy of the generator on a GPU; 3: the nucleus
#                        is cut among the top 1,024 tokens (adbatch.decoding.creative.NUCLEUS_CANDIDATES)
#: the generated queries' file in a model folder (and, prefixed ``.<folder>.``, its staging copy beside it)
GENERATED_QUERIES_FILE = "generated_queries.parquet"
_META_KEY = b"adbatch_generated_queries"


class NoLabelsPolicy(str, enum.Enum):
    """What the product does when there are too few labelled train pairs to fine-tune a generator."""

    SPANS = "spans"  #: train on span pseudo-queries instead (logged as a warning, recorded)
    ZERO_SHOT = "zero_shot"  #: generate with the untuned base model from the instruction alone


class QueryOrigin(str, enum.Enum):
    """Which generator wrote a query (the ``source`` column of the generated rows)."""

    TUNED = "tuned"  #: the generator fine-tuned on the labelled train pairs
    ZERO_SHOT = "zero_shot"  #: the untuned base model (no labels, ``no_labels = zero_shot``)


@dataclasses.dataclass
class QueryGenTrainConfig(TrainConfig):
    """:class:`TrainConfig` with the query generator's defaults: a short fine-tune, not DSI (few passes, a
    lower peak lr). Its own class, so a config file setting one key of ``[query_gen.train]`` keeps these
    defaults for the others."""

    epochs: float = dataclasses.field(default=3.0, metadata={"help": "passes over the (ad text -> query) pairs"})
    lr: float = dataclasses.field(default=2e-4, metadata={"help": "peak learning rate"})
    batch_tokens: int = dataclasses.field(default=8192, metadata={"help": "padded tokens per micro-batch"})
    log_every: int = dataclasses.field(default=10, metadata={"help": "log every this many steps"})
    qat: QuantAwareConfig = dataclasses.field(default_factory=lambda: QuantAwareConfig(enabled=False), metadata={
        "help": "off: the generator is discarded after generating, never compressed"})


def _default_train() -> QueryGenTrainConfig:
    return QueryGenTrainConfig()


@dataclasses.dataclass
class QueryGenConfig(ConfigBase):
    """The query generator: its fine-tune, the sampling of N queries per ad, the optional round-trip
    filter and the no-label policy. Used when ``TrainConfig.pseudo_queries.source`` is generated or mix
    (that one knob decides; this config only says how)."""

    queries_per_ad: int = dataclasses.field(default=10, metadata={
        "help": "queries sampled per ad (cleaning and the round trip may keep fewer)"})
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = dataclasses.field(default=0.9, metadata={"help": "nucleus mass kept when sampling"})
    max_new_tokens: int = dataclasses.field(default=16, metadata={"help": "tokens per generated query at most"})
    # H200, default model after its fine-tune, 512 ads x 10 samples, bf16: 9,337 samples/s at 256 ads vs 6,426 at 64
    # (float32: 1,193 / 1,416); bench/query_gen_speed.py, bench/RESULTS.md
    batch_size: int = dataclasses.field(default=256, metadata={"help": "ads decoded together (x queries_per_ad rows)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "sampling seed (per ad and sample, see generate_creatives)"})
    train: QueryGenTrainConfig = dataclasses.field(default_factory=_default_train, metadata={
        "help": "the generator's fine-tune (sparsity / QAT / distillation not supported)"})
    train_layers: int | None = dataclasses.field(default=None, metadata={
        "help": "train only the top N decoder layers of the generator (cheaper on a CPU); None = every weight"})
    max_pairs: int | None = dataclasses.field(default=None, metadata={
        "help": "seeded sample of this many train pairs for the fine-tune (None = all)"})
    min_pairs: int = dataclasses.field(default=100, metadata={
        "help": "fewer usable train pairs than this = no labels (no_labels decides)"})
    no_labels: NoLabelsPolicy = dataclasses.field(default=NoLabelsPolicy.SPANS, metadata={
        "help": "too few labelled pairs: spans (train on span pseudo-queries) | zero_shot (untuned base model)"})
    round_trip: bool = dataclasses.field(default=False, metadata={
        "help": "keep a query only if MiniLM + exact search over the catalogue ranks its ad in the top k"})
    round_trip_top_k: int = dataclasses.field(default=10, metadata={"help": "k of the round-trip filter"})
    teacher_top_k: int = dataclasses.field(default=0, metadata={
        "help": "label the generated queries with the dense teacher (the index's query embedder over its ad "
                "vectors): keep a query only if the teacher's top k holds its source ad, and label it also with "
                "the teacher's best other ads (teacher_labels); 0 = off, the source ad alone. Not measured on a "
                "GPU yet (issue 55 item 3): off by default"})
    teacher_labels: int = dataclasses.field(default=2, metadata={
        "help": "with teacher_top_k: the teacher's best ads besides the source ad each kept query is labelled with"})
    generator_model: str | None = dataclasses.field(default=None, metadata={
        "help": "model the generator is tuned from; None = the training's starting model (on a warm start: "
                "the generator model of the model it starts from)"})

    def validate(self) -> None:
        for name in ("queries_per_ad", "max_new_tokens", "batch_size", "round_trip_top_k", "min_pairs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"QueryGenConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("teacher_top_k", "teacher_labels"):
            if getattr(self, name) < 0:
                raise ConfigError(f"QueryGenConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.teacher_top_k and self.teacher_labels >= self.teacher_top_k:
            raise ConfigError(f"QueryGenConfig.teacher_labels ({self.teacher_labels}) must be < teacher_top_k "
                              f"({self.teacher_top_k}): the labels are the teacher's top k besides the source ad")
        if not self.temperature > 0:
            raise ConfigError(f"QueryGenConfig.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"QueryGenConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.max_pairs is not None and self.max_pairs < 1:
            raise ConfigError(f"QueryGenConfig.max_pairs must be >= 1 or None, got {self.max_pairs}")
        if self.train_layers is not None and self.train_layers < 1:
            raise ConfigError(f"QueryGenConfig.train_layers must be >= 1 or None, got {self.train_layers}")
        if self.train.sparsity.enabled or self.train.qat.enabled or self.train.distill.enabled:
            raise ConfigError("QueryGenConfig.train: sparsity / QAT / distillation are not supported for the "
                              "query generator (it is discarded after generating)")

    def sampling(self) -> Any:
        """The decode engine's :class:`~adbatch.decoding.config.CreativeConfig` for the samples."""
        from adbatch.decoding.config import CreativeConfig, CreativeStrategy

        return CreativeConfig(strategy=CreativeStrategy.SAMPLE, num_return=self.queries_per_ad,
                              temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                              seed=self.seed, stop_strings=["\n"],
                              # the headline guards were measured for headlines only; a query may repeat
                              # a run of its ad's title
                              no_repeat_ngram_size=0, prompt_ngram_block=0)


def _norm(text: Any) -> str:
    return " ".join(str(text or "").lower().split())


# ---------------------------------------------------------------------------------------------
# pairs and the generator's fine-tune
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class QueryPairs:
    """(ad text -> query) training pairs of the generator: ``texts[i]`` is the text of ad ``ad_ids[i]``."""

    ad_ids: list[Hashable]
    texts: list[str]
    queries: list[str]
    stats: dict[str, Any]

    def __len__(self) -> int:
        return len(self.queries)

    def content_hash(self) -> str:
        """sha256 of the pairs themselves (what the generator learns)."""
        from adbatch.artifacts import sha256_json

        return sha256_json({"texts": self.texts, "queries": self.queries})


def query_pairs(train_pairs: Iterable[tuple[str, Hashable]], ad_texts: Mapping[Hashable, str], *,
                exclude_queries: Iterable[str] = (), max_pairs: int | None = None, seed: int = 0) -> QueryPairs:
    """The generator's pairs from ``train_pairs`` ((query, ad_id) of the labelled *train* split: the
    caller passes only those) and the catalogue's ``ad_texts`` (ad_id -> text).

    ``exclude_queries``: validation / test query strings; a pair whose query equals one (case and spacing
    ignored) is refused, so held-out queries never reach the generator even through a wrong file. Skipped
    rows are counted in ``stats['skipped']`` by reason: ``empty_query``, ``ad_not_in_catalogue``,
    ``held_out_query``, ``query_is_ad_text`` (teaches a copy, which the indexing example already is),
    ``duplicate`` (same text and query), ``not_sampled`` (``max_pairs``).
    """
    held = {_norm(q) for q in exclude_queries if _norm(q)}
    skipped: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    ad_ids, texts, queries = [], [], []
    n = 0

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for query, ad in train_pairs:
        n += 1
        q = " ".join(str(query or "").split())
        text = ad_texts.get(ad)
        key = (_norm(text), _norm(q))
        if not q:
            skip("empty_query")
        elif text is None or not str(text).strip():
            skip("ad_not_in_catalogue")
        elif key[1] in held:
            skip("held_out_query")
        elif key[0] == key[1]:
            skip("query_is_ad_text")
        elif key in seen:
            skip("duplicate")
        else:
            seen.add(key)
            ad_ids.append(ad)
            texts.append(" ".join(str(text).split()))
            queries.append(q)
    if max_pairs is not None and len(queries) > max_pairs:
        import torch

        gen = torch.Generator().manual_seed(seed)
        pick = torch.randperm(len(queries), generator=gen)[:max_pairs].sort().values.tolist()
        skipped["not_sampled"] = len(queries) - len(pick)
        ad_ids, texts, queries = [ad_ids[i] for i in pick], [texts[i] for i in pick], [queries[i] for i in pick]
    stats = {"rows": n, "pairs": len(queries), "ads": len({str(a) for a in ad_ids}), "skipped": skipped}
    log.info("query-generator pairs: %s", stats)
    return QueryPairs(ad_ids, texts, queries, stats)


def generator_examples(tokenizer: Any, pairs: QueryPairs) -> Any:
    """``TrainingExamples`` of the generator: the query-generation prompt of each pair's ad text -> its
    query + EOS (kind CREATIVE: a free-text answer ended by EOS; ``rows`` = the pair's position)."""
    from adbatch.serving.prompts import encode_query_gen_prompt, encode_query_gen_target
    from adbatch.training.data import ExampleKind, build_prompted

    if not len(pairs):
        raise ValueError("no (ad text -> query) pairs to train the query generator on (see the pairs' skipped counts)")
    prompts = [encode_query_gen_prompt(tokenizer, t) for t in pairs.texts]
    targets = [encode_query_gen_target(tokenizer, q) for q in pairs.queries]
    return build_prompted(prompts, targets, ExampleKind.CREATIVE, list(range(len(pairs))))


def tune_query_generator(model: Any, tokenizer: Any, pairs: QueryPairs, config: QueryGenConfig, *,
                         device: str = "cpu", rank: int = 0, world_size: int = 1,
                         progress: bool = True) -> dict[str, Any]:
    """Fine-tune ``model`` (in place, left on ``device``) on ``pairs``; returns the fine-tune's summary
    (examples, tokens, trainable parameters, first/final loss, seconds). DDP under torch.distributed."""
    import torch

    from adbatch.training.creatives import fine_tune_pairs

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    examples = generator_examples(tokenizer, pairs)
    stats, trainable = fine_tune_pairs(model, tokenizer, examples, config.train, train_layers=config.train_layers,
                                       device=device, rank=rank, world_size=world_size, progress=progress)
    train = stats.summary(model, torch.device(device))
    return {"examples": len(examples), "target_tokens": examples.num_target_tokens(), "trainable_params": trainable,
            **{k: train.get(k) for k in ("steps", "first_loss", "final_loss", "seconds", "tokens_per_s")}}


# ---------------------------------------------------------------------------------------------
# generation, cleaning, round trip
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GeneratedQueries:
    """Generated queries of a catalogue: ``queries[i]`` was written for ad ``ad_ids[i]`` by ``origins[i]``
    (:class:`QueryOrigin` values); ``stats`` counts what was sampled, dropped and kept; ``key`` is the
    :func:`generation_key` it was made for."""

    queries: list[str]
    ad_ids: list[Hashable]
    origins: list[str]
    stats: dict[str, Any]
    key: str = ""

    def __len__(self) -> int:
        return len(self.queries)

    def rows(self) -> list[tuple[str, Hashable, str]]:
        """``(query, ad_id, source)`` rows."""
        return list(zip(self.queries, self.ad_ids, self.origins))

    def pairs(self) -> list[tuple[str, Hashable]]:
        """``(query, ad_id)`` pairs, what :func:`adbatch.training.data.build_examples` reads as ``generated``."""
        return list(zip(self.queries, self.ad_ids))


def clean_queries(ad_text: str, samples: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """The usable queries among one ad's ``samples``: spaces collapsed and surrounding quotes stripped;
    empty ones, copies of ``ad_text`` and repeats (case and spacing ignored) dropped. Returns
    ``(kept, counts)`` with counts ``empty``, ``same_as_ad_text``, ``duplicate``, ``kept``."""
    counts = {"empty": 0, "same_as_ad_text": 0, "duplicate": 0, "kept": 0}
    title = _norm(ad_text)
    seen: set[str] = set()
    kept = []
    for s in samples:
        q = " ".join(str(s).split()).strip("\"'` ")
        key = _norm(q)
        if not key:
            counts["empty"] += 1
        elif key == title:
            counts["same_as_ad_text"] += 1
        elif key in seen:
            counts["duplicate"] += 1
        else:
            seen.add(key)
            kept.append(q)
            counts["kept"] += 1
    return kept, counts


def generate_queries(model: Any, tokenizer: Any, ad_ids: Sequence[Hashable], ad_texts: Mapping[Hashable, str],
                     config: QueryGenConfig, *, origin: QueryOrigin = QueryOrigin.TUNED, rank: int = 0,
                     world_size: int = 1, progress: bool = True) -> GeneratedQueries:
    """``config.queries_per_ad`` sampled queries for every ad of ``ad_ids`` (texts from ``ad_texts``), cleaned
    (:func:`clean_queries`), in ad order. Under torch.distributed each rank samples the ads ``rank::world_size``
    and the results are gathered, so every rank returns the whole catalogue's queries. Deterministic for a
    seed: each (ad prompt, sample) draws from its own seeded generator (``generate_creatives``)."""
    from tqdm.auto import tqdm

    from adbatch.decoding.creative import generate_creatives
    from adbatch.serving.prompts import encode_query_gen_prompt

    t0 = time.perf_counter()
    sampling = config.sampling()
    rows = list(range(rank, len(ad_ids), world_size))
    counts = {"ads": 0, "no_text": 0, "sampled": 0, "empty": 0, "same_as_ad_text": 0, "duplicate": 0, "kept": 0}
    out: list[tuple[int, str]] = []  # (row, query)
    with tqdm(total=len(rows), desc="generate queries", unit="ad", disable=not progress) as bar:
        for s in range(0, len(rows), config.batch_size):
            chunk = rows[s:s + config.batch_size]
            texts = [" ".join(str(ad_texts.get(ad_ids[r]) or "").split()) for r in chunk]
            live = [(r, t) for r, t in zip(chunk, texts) if t]
            counts["no_text"] += len(chunk) - len(live)
            if live:
                prompts = [encode_query_gen_prompt(tokenizer, t) for _, t in live]
                for (r, text), samples in zip(live, generate_creatives(model, tokenizer, prompts, sampling)):
                    kept, c = clean_queries(text, [q for q, _ in samples])
                    counts["sampled"] += len(samples)
                    for k, v in c.items():
                        counts[k] += v
                    out.extend((r, q) for q in kept)
            counts["ads"] += len(chunk)
            bar.update(len(chunk))
    if world_size > 1:
        import torch.distributed as dist

        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (out, counts))
        out = sorted((x for part, _ in gathered for x in part), key=lambda x: x[0])  # stable: sample order kept
        counts = {k: sum(c[k] for _, c in gathered) for k in counts}
    counts["seconds"] = round(time.perf_counter() - t0, 3)
    log.info("generated queries (%s): %s", QueryOrigin(origin).value, counts)
    return GeneratedQueries([q for _, q in out], [ad_ids[r] for r, _ in out], [QueryOrigin(origin).value] * len(out),
                            counts)


def minilm_ranker(ad_ids: Sequence[Hashable], texts: Sequence[str], top_k: int, device: str = "cpu") -> Callable:
    """``queries -> top_k ad ids`` by MiniLM + exact inner-product search over ``texts`` (FAISS where
    installed, torch otherwise): the retriever of the round trip, the benchmark's MiniLM+FAISS baseline."""
    from adbatch.eval.targeting import EmbeddingRanker, embed_texts, load_minilm

    encoder = load_minilm(device=device)
    return EmbeddingRanker(encoder, list(ad_ids), embed_texts(encoder, list(texts)), k=top_k)


def round_trip_filter(generated: GeneratedQueries, ranker: Callable[[list[str]], list[list[Hashable]]],
                      batch_size: int = 4096) -> GeneratedQueries:
    """The queries of ``generated`` whose own ad ``ranker`` (queries -> ranked ad ids, e.g.
    :func:`minilm_ranker` over the catalogue) returns among its results; the others are dropped and
    counted (``round_trip_dropped``). DSI-QG's filter: a query the catalogue's text does not lead back
    to its ad teaches the targeting model noise."""
    keep: list[bool] = []
    for s in range(0, len(generated), batch_size):
        ranked = ranker(generated.queries[s:s + batch_size])
        keep.extend(str(ad) in {str(a) for a in top} for ad, top in zip(generated.ad_ids[s:s + batch_size], ranked))
    idx = [i for i, k in enumerate(keep) if k]
    stats = {**generated.stats, "round_trip_dropped": len(keep) - len(idx), "kept": len(idx)}
    log.info("round trip kept %d of %d generated queries", len(idx), len(keep))
    return GeneratedQueries([generated.queries[i] for i in idx], [generated.ad_ids[i] for i in idx],
                            [generated.origins[i] for i in idx], stats, generated.key)


def teacher_labelled(generated: GeneratedQueries, ranker: Callable[[list[str]], list[list[Hashable]]], top_k: int,
                     labels: int, batch_size: int = 4096) -> GeneratedQueries:
    """``generated`` filtered and labelled by a dense teacher (issue 55 item 3; DSI-QG filters its generated
    queries with a ranker, PAG distils a dense teacher's ranking): ``ranker`` maps queries to the teacher's ranked
    ad ids. A query whose source ad is not in the teacher's ``top_k`` is dropped (``teacher_dropped``); a kept one
    keeps its source-ad row and gains one row, same query and origin, for each of the teacher's first ``labels``
    other ads (``teacher_labels_added``): the model learns the teacher's neighbours of a query, not one ad alone."""
    queries: list[str] = []
    ads: list[Hashable] = []
    origins: list[str] = []
    dropped = 0
    for s in range(0, len(generated), batch_size):
        part = slice(s, s + batch_size)
        ranked = ranker(generated.queries[part])
        for q, ad, origin, top in zip(generated.queries[part], generated.ad_ids[part], generated.origins[part], ranked):
            top = list(top)[:top_k]
            if str(ad) not in {str(a) for a in top}:
                dropped += 1
                continue
            rows = [ad, *[a for a in top if str(a) != str(ad)][:labels]]
            queries += [q] * len(rows)
            ads += rows
            origins += [origin] * len(rows)
    kept = len(generated) - dropped
    stats = {**generated.stats, "teacher_dropped": dropped, "teacher_labels_added": len(queries) - kept,
             "teacher_kept": kept}
    log.info("teacher kept %d of %d generated queries and added %d labels", kept, len(generated), len(queries) - kept)
    return GeneratedQueries(queries, ads, origins, stats, generated.key)


# ---------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------
def model_fingerprint(model: Any, tokenizer: Any) -> str:
    """sha256 of ``model``'s parameters and buffers (names, dtypes, shapes, bytes) and of what of the
    tokenizer shapes the prompts (class, vocabulary size, special-token frame, chat template): the
    generator's identity in :func:`generation_key`, whether it came from a folder, a GGUF or memory."""
    import torch

    from adbatch.serving.prompts import special_tokens_around

    h = hashlib.sha256()
    for name, t in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(json.dumps([type(tokenizer).__name__, len(tokenizer), special_tokens_around(tokenizer),
                         getattr(tokenizer, "chat_template", None)], default=str).encode())
    return h.hexdigest()


def generation_key(pairs: QueryPairs | None, ad_ids: Sequence[Hashable], ad_texts: Mapping[Hashable, str],
                   config: QueryGenConfig, generator: str) -> str:
    """Content hash of everything deciding the generated queries: the train pairs (None: zero-shot), the
    catalogue (ids and texts in order), ``config``, the generator's :func:`model_fingerprint`, the prompt
    rendering version and :data:`QUERY_GEN_VERSION` (not the decode batch size, which changes no query)."""
    from adbatch.artifacts import sha256_json
    from adbatch.serving.prompts import QUERY_GEN_PROMPT_VERSION

    catalogue = hashlib.sha256()
    for a in ad_ids:
        catalogue.update(json.dumps([str(a), str(ad_texts.get(a) or "")]).encode())
    # the decode batch size changes no query (each ad's samples are seeded on their own), and the teacher's labels
    # are applied to the cached queries after they are read: not part of the key
    knobs = {k: v for k, v in config.to_dict().items() if k not in ("batch_size", "teacher_top_k", "teacher_labels")}
    return sha256_json({"pairs": pairs.content_hash() if pairs is not None else None,
                        "catalogue": catalogue.hexdigest(), "config": knobs, "generator": generator,
                        "prompt_version": QUERY_GEN_PROMPT_VERSION, "version": QUERY_GEN_VERSION})


def write_generated_queries(generated: GeneratedQueries, path: str | Path) -> Path:
    """Write ``generated`` as Parquet (``query``, ``ad_id``, ``source``; the key and stats in the schema
    metadata), atomically; :func:`load_generated_queries` reads it back exactly."""
    import pyarrow as pa

    from adbatch.artifacts import write_parquet_atomic

    table = pa.table({"query": pa.array(generated.queries, pa.string()), "ad_id": pa.array(generated.ad_ids),
                      "source": pa.array(generated.origins, pa.string())})
    meta = json.dumps({"key": generated.key, "stats": generated.stats}).encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(table.replace_schema_metadata({_META_KEY: meta}), path)
    return path


def load_generated_queries(path: str | Path, key: str | None = None) -> GeneratedQueries | None:
    """The queries :func:`write_generated_queries` wrote to ``path``; None when the file is absent or (with
    ``key``) was made for other inputs. A file that is not a generated-queries file raises ConfigError."""
    from adbatch.index.corpus import read_parquet_table

    path = Path(path)
    if not path.is_file():
        return None
    table = read_parquet_table(path, error=ConfigError)
    meta = (table.schema.metadata or {}).get(_META_KEY)
    if meta is None or not {"query", "ad_id", "source"} <= set(table.column_names):
        raise ConfigError(f"{path}: not a generated-queries file (write_generated_queries writes one)")
    info = json.loads(meta)
    if key is not None and info["key"] != key:
        return None
    return GeneratedQueries(table.column("query").to_pylist(), table.column("ad_id").to_pylist(),
                            table.column("source").to_pylist(), info["stats"], info["key"])


# ---------------------------------------------------------------------------------------------
# the verb
# ---------------------------------------------------------------------------------------------
def build_generated_queries(
    train_pairs: Iterable[tuple[str, Hashable]],
    ad_ids: Sequence[Hashable],
    ad_texts: Mapping[Hashable, str],
    config: QueryGenConfig,
    generator: Callable[[], tuple[Any, Any]],
    *,
    exclude_queries: Iterable[str] = (),
    cache: Sequence[str | Path] = (),
    write_to: str | Path | None = None,
    device: str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> tuple[GeneratedQueries | None, dict[str, Any]]:
    """Pairs -> fine-tune -> generate -> clean -> (round trip) for the catalogue ``ad_ids``, or the cached
    result for the same inputs.

    ``train_pairs``: the labelled (query, ad_id) pairs of the *train* split; ``exclude_queries``: the
    validation / test query strings (refused, :func:`query_pairs`). ``generator()``: the base model and
    tokenizer the generator is tuned from, on the CPU (called once; the model is changed in place and
    released here). ``cache``: files read first (the first whose key matches wins); ``write_to``: where the
    result is written on rank 0 when generated (None = nowhere). Returns ``(queries, info)``; queries is
    None when there are fewer than ``config.min_pairs`` usable pairs and ``config.no_labels`` is spans (the
    caller trains on spans then). ``info``: what happened (``status`` = cached | generated | no_labels,
    the key, the pairs' and the fine-tune's stats).
    """
    pairs = query_pairs(train_pairs, ad_texts, exclude_queries=exclude_queries, max_pairs=config.max_pairs,
                        seed=config.seed)
    info: dict[str, Any] = {"pairs": pairs.stats}
    zero_shot = len(pairs) < config.min_pairs
    if zero_shot and config.no_labels is NoLabelsPolicy.SPANS:
        log.warning("query generation: %d usable labelled train pairs (< min_pairs %d): the generator cannot be "
                    "trained; training on span pseudo-queries instead (query_gen.no_labels = spans)",
                    len(pairs), config.min_pairs)
        return None, {**info, "status": "no_labels", "fallback": "spans"}
    model, tokenizer = generator()
    key = generation_key(None if zero_shot else pairs, ad_ids, ad_texts, config, model_fingerprint(model, tokenizer))
    info["key"] = key
    for path in cache:
        hit = load_generated_queries(path, key)
        if hit is not None:
            log.info("generated queries: %d from %s (inputs unchanged)", len(hit), path)
            return hit, {**info, "status": "cached", "cache": str(path)}
    if zero_shot:
        log.warning("query generation: %d usable labelled train pairs (< min_pairs %d): generating with the untuned "
                    "base model from the instruction alone (query_gen.no_labels = zero_shot)", len(pairs),
                    config.min_pairs)
        model.to(device)
    else:
        info["fine_tune"] = tune_query_generator(model, tokenizer, pairs, config, device=device, rank=rank,
                                                 world_size=world_size, progress=progress)
    # the fine-tune keeps fp32 weights; the N x ads samples are drawn in serving's dtype (bf16 on a GPU)
    model.to(serving_dtype(device))
    out = generate_queries(model, tokenizer, ad_ids, ad_texts, config,
                           origin=QueryOrigin.ZERO_SHOT if zero_shot else QueryOrigin.TUNED, rank=rank,
                           world_size=world_size, progress=progress)
    del model
    if config.round_trip:
        ranker = minilm_ranker(ad_ids, [str(ad_texts.get(a) or "") for a in ad_ids], config.round_trip_top_k,
                               device="cuda" if str(device).startswith("cuda") else "cpu")
        out = round_trip_filter(out, ranker)
    out.key = key
    if write_to is not None and rank == 0:
        write_generated_queries(out, write_to)
    return out, {**info, "status": "generated"}
