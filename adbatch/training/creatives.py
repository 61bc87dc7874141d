"""The creative fine-tune: teach the model to write an ad's headline from its fields (ad -> headline).

The base model writes headlines only from a few-shot prompt, and on the example ads it mostly echoes
the prompt (docs/generate.md: 29 % of its headlines copy half their words from it); training the ad
index into it destroys the skill (slogan BLEU 1.61 -> 0.064). The corpus itself holds the supervision:
each ad's human headline (the example corpus's ``title``; the slogan data's ``output``). This module
turns those into (ad fields -> headline) training pairs and trains on them with the same loop as the
targeting training (:func:`adbatch.training.trainer.train_loop`, examples of kind
:attr:`~adbatch.training.data.ExampleKind.CREATIVE`):

- **pairs** (:func:`read_headline_pairs`): the ad's fields present among
  :data:`adbatch.serving.prompts.CREATIVE_FIELDS` (except the headline column itself) -> its headline. Rows
  without a headline or without any field, headlines longer than ``max_headline_words``, headlines that
  copy ``>= max_copy_fraction`` of their words from the fields (the prompt-copy metric of
  :mod:`adbatch.eval.report`; 39 % of the slogan ``valid.csv`` headlines do), duplicates, and the ads a caller
  holds out (requested creatives, test rows) are skipped and counted, never dropped silently.
- **prompt**: :attr:`adbatch.serving.prompts.CreativePrompt.TUNED` (instruction + fields, no worked examples),
  the rendering serving uses for a model that declares it (:func:`adbatch.serving.prompts.declare_creative_prompt`,
  saved in config.json, so a compressed checkpoint of the model declares it too); target = the headline
  + EOS (:func:`adbatch.serving.prompts.encode_creative_target`).
- **masking** (``CreativeTuneConfig.delex``, :class:`adbatch.serving.delex.DelexMode`, default ``off`` until the GPU
  measures it): the
  company name and the name-like words of the other fields become placeholders in the training prompts, and
  in the headline where it writes them (:func:`adbatch.serving.delex.delexicalise` / ``mask_text``), so the model
  learns to write ``<company>`` rather than a name, never another advertiser's (Jin et al. 2021's
  delexicalisation: 35.58 / 18.47 / 33.32 ROUGE on the slogan test set). The model declares it
  (:func:`adbatch.serving.delex.declare_delex`), and the creatives generator masks its prompts and restores
  its headlines. Separate shape only: the shared shape's training (``adbatch.training.index_training``)
  builds its examples unmasked, and its record says ``delex: off``.
- **shapes** (:class:`CreativeTuneShape`, one knob): ``separate`` = a creative model of its own,
  fine-tuned from the base model on the pairs only (:func:`tune_creatives`); ``shared`` = the pairs mixed
  into the targeting training as creative examples (:func:`adbatch.training.train_on_index` with
  ``creative_pairs``), so one served model answers both task prompts.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from pathlib import Path
from typing import Any, Hashable, Iterable

from adbatch.config import ConfigBase, ConfigError
from adbatch.serving.delex import DelexMode
from adbatch.training.quant_aware import QuantAwareConfig
from adbatch.training.trainer import TrainConfig

log = logging.getLogger(__name__)


class CreativeTuneShape(str, enum.Enum):
    """Which model learns the headline pairs."""

    SEPARATE = "separate"  #: a creative model of its own, fine-tuned from the base model on the pairs only
    SHARED = "shared"  #: the targeting model, with the pairs mixed into its training as creative examples


@dataclasses.dataclass
class CreativeTrainConfig(TrainConfig):
    """:class:`TrainConfig` with the creative fine-tune's defaults: a short fine-tune, not DSI -- few passes,
    a lower peak lr than the index training (5e-4). Its own class, so a config file that sets one key of
    ``[train.creatives.train]`` keeps these defaults for the others."""

    epochs: float = dataclasses.field(default=2.0, metadata={"help": "passes over the headline pairs"})
    lr: float = dataclasses.field(default=1e-4, metadata={"help": "peak learning rate"})
    batch_tokens: int = dataclasses.field(default=8192, metadata={"help": "padded tokens per micro-batch"})
    log_every: int = dataclasses.field(default=10, metadata={"help": "log every this many steps"})
    # the creative model is served dense by default; QAT is for one that will be compressed (the compress
    # stage then quantizes on the grid the record names, as for the targeting model). When it is on, it runs
    # over the whole fine-tune (start 0): on the H200, 994 slogan test rows, compressed ROUGE-L 29.88 with
    # QAT from step 0 vs 29.74 from half-way (4 epochs) vs 28.02 without QAT, dense 30.28 (RESULTS.md)
    qat: QuantAwareConfig = dataclasses.field(
        default_factory=lambda: QuantAwareConfig(enabled=False, start_fraction=0.0), metadata={
            "help": "quantization-aware fine-tune (for a creative model that will be compressed); from step 0"})


def _default_creative_train() -> CreativeTrainConfig:
    return CreativeTrainConfig()


@dataclasses.dataclass
class HeadlinePairsConfig(ConfigBase):
    """Which corpus column is the human headline and which pairs are kept."""

    ad_id: str = dataclasses.field(default="ad_id", metadata={"help": "corpus column holding the ad id"})
    headline: str = dataclasses.field(default="title", metadata={
        "help": "corpus column holding the ad's human headline (the example corpus: title)"})
    max_pairs: int | None = dataclasses.field(default=None, metadata={
        "help": "seeded sample of this many pairs (None = all)"})
    max_headline_words: int = dataclasses.field(default=16, metadata={
        "help": "longer 'headlines' are skipped (descriptions in the headline column)"})
    max_copy_fraction: float = dataclasses.field(default=0.5, metadata={
        "help": "skip pairs whose headline copies at least this share of its words verbatim from the fields "
                "(the prompt-copy metric; 1.0 = keep all)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the max_pairs sample"})

    def validate(self) -> None:
        if not self.ad_id or not self.headline:
            raise ConfigError("HeadlinePairsConfig.ad_id and .headline must name columns")
        if self.max_pairs is not None and self.max_pairs < 1:
            raise ConfigError(f"HeadlinePairsConfig.max_pairs must be >= 1 or None, got {self.max_pairs}")
        if self.max_headline_words < 1:
            raise ConfigError(f"HeadlinePairsConfig.max_headline_words must be >= 1, got {self.max_headline_words}")
        if not 0.0 < self.max_copy_fraction <= 1.0:
            raise ConfigError(f"HeadlinePairsConfig.max_copy_fraction must be in (0, 1], got {self.max_copy_fraction}")


@dataclasses.dataclass
class CreativeTuneConfig(ConfigBase):
    """The creative fine-tune (:mod:`adbatch.training.creatives`); stored in the model's training record."""

    enabled: bool = dataclasses.field(default=False, metadata={"help": "fine-tune on the corpus's headlines"})
    shape: CreativeTuneShape = dataclasses.field(default=CreativeTuneShape.SEPARATE, metadata={
        "help": "separate (own creative model from the base model) | shared (mixed into the targeting training)"})
    pairs: HeadlinePairsConfig = dataclasses.field(default_factory=HeadlinePairsConfig)
    train: CreativeTrainConfig = dataclasses.field(default_factory=_default_creative_train, metadata={
        "help": "training knobs of the separate shape (the shared shape trains with the targeting config)"})
    train_layers: int | None = dataclasses.field(default=None, metadata={
        "help": "separate shape: train only the top N decoder layers (embeddings frozen; backward stops "
                "there, cheaper on a CPU); None = every weight"})
    repeat: int = dataclasses.field(default=1, metadata={
        "help": "shared shape: copies of each pair per epoch of the targeting training"})
    # off by default until measured: entities is the anchor's method (Jin et al. 2021) against the invented names a
    # plain fine-tune learns, but the example's 8-step CPU fine-tune with it wrote a broken placeholder ("The latest
    # <entire> & Point of Sale technology ..."); the GPU run of bench/creatives_tune.py (tuned vs tuned-delex) decides
    delex: DelexMode = dataclasses.field(default=DelexMode.OFF, metadata={
        "help": "separate shape: mask the training pairs: off | company (the advertiser's name -> <company>) | "
                "entities (also the fields' names, places, acronyms -> <ent1>, ...); restored at generation"})

    def validate(self) -> None:
        if self.train_layers is not None and self.train_layers < 1:
            raise ConfigError(f"CreativeTuneConfig.train_layers must be >= 1 or None, got {self.train_layers}")
        if self.repeat < 1:
            raise ConfigError(f"CreativeTuneConfig.repeat must be >= 1, got {self.repeat}")
        if self.train.sparsity.enabled or self.train.distill.enabled:
            raise ConfigError("CreativeTuneConfig.train: sparsity / distillation are not supported for the "
                              "creative fine-tune (the compress stage compresses the result)")


@dataclasses.dataclass
class HeadlinePairs:
    """(ad fields -> human headline) pairs: ``fields[i]`` maps CREATIVE_FIELDS names to text."""

    ad_ids: list[Hashable]
    fields: list[dict[str, str]]
    headlines: list[str]
    stats: dict[str, Any]

    def __len__(self) -> int:
        return len(self.headlines)

    def content_hash(self) -> str:
        """sha256 of the pairs themselves (what the fine-tune learns; not the file bytes)."""
        from adbatch.artifacts import sha256_json

        return sha256_json({"ad_ids": [str(a) for a in self.ad_ids], "fields": self.fields,
                            "headlines": self.headlines})


def _norm(text: Any) -> str:
    return " ".join(str(text or "").lower().split())


def headline_pairs(rows: Iterable[dict[str, Any]], config: HeadlinePairsConfig, *,
                   exclude_ad_ids: Iterable[Hashable] = (), exclude_texts: Iterable[str] = ()) -> HeadlinePairs:
    """Pairs from corpus rows (dicts with ``config.ad_id``, ``config.headline`` and any CREATIVE_FIELDS).

    ``exclude_ad_ids``: ads never trained on (e.g. the ads a creatives request asks a headline for).
    ``exclude_texts``: texts of held-out evaluation rows (``test-curated.csv`` descriptions and
    headlines); a pair whose description or headline equals one (case and spacing ignored) is skipped.
    Every skipped row is counted in ``stats['skipped']`` by reason.
    """
    from adbatch.serving.prompts import CREATIVE_FIELDS, render_ad_fields
    from adbatch.eval.report import prompt_copy_fraction

    held_ids = {str(a) for a in exclude_ad_ids}
    held_texts = {_norm(t) for t in exclude_texts if _norm(t)}
    keys = [k for k in CREATIVE_FIELDS if k != config.headline]
    skipped: dict[str, int] = {}
    seen: set[str] = set()
    ad_ids, fields, heads = [], [], []
    n = 0

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for row in rows:
        n += 1
        ad, head = row.get(config.ad_id), " ".join(str(row.get(config.headline) or "").split())
        f = {k: str(row[k]).strip() for k in keys if row.get(k) is not None and str(row[k]).strip()}
        if ad is None:
            skip("null_ad_id")
        elif not head:
            skip("no_headline")
        elif not f:
            skip("no_fields")
        elif str(ad) in seen:
            skip("duplicate_ad_id")
        elif str(ad) in held_ids:
            skip("held_out_ad")
        elif held_texts and (_norm(head) in held_texts or _norm(f.get("description")) in held_texts):
            skip("held_out_text")
        elif len(head.split()) > config.max_headline_words:
            skip("headline_too_long")
        elif config.max_copy_fraction < 1.0 and prompt_copy_fraction(head, render_ad_fields(f)) >= config.max_copy_fraction:
            skip("headline_copies_fields")
        else:
            seen.add(str(ad))
            ad_ids.append(ad)
            fields.append(f)
            heads.append(head)
    if config.max_pairs is not None and len(heads) > config.max_pairs:
        import torch

        gen = torch.Generator().manual_seed(config.seed)
        pick = torch.randperm(len(heads), generator=gen)[:config.max_pairs].sort().values.tolist()
        skip_n = len(heads) - len(pick)
        ad_ids, fields, heads = [ad_ids[i] for i in pick], [fields[i] for i in pick], [heads[i] for i in pick]
        skipped["not_sampled"] = skip_n
    stats = {"rows": n, "pairs": len(heads), "skipped": skipped,
             "fields": [k for k in keys if any(k in f for f in fields)]}  # the inputs the pairs carry
    log.info("headline pairs: %s", stats)
    return HeadlinePairs(ad_ids, fields, heads, stats)


def read_headline_pairs(path: str | Path, config: HeadlinePairsConfig | None = None, *,
                        exclude_ad_ids: Iterable[Hashable] = (), exclude_texts: Iterable[str] = ()) -> HeadlinePairs:
    """:func:`headline_pairs` of an ad corpus (a Parquet file, folder of parts or glob, as
    :func:`adbatch.index.corpus.resolve_corpus_paths` reads it). The headline and id columns must exist
    (ConfigError naming the file otherwise); the CREATIVE_FIELDS columns present are the inputs."""
    from adbatch.index.corpus import read_parquet_schema, read_parquet_table, resolve_corpus_paths
    from adbatch.serving.prompts import CREATIVE_FIELDS

    config = config or HeadlinePairsConfig()
    rows: list[dict[str, Any]] = []
    for f in resolve_corpus_paths(path):
        names = read_parquet_schema(f, error=ConfigError).names
        missing = [c for c in (config.ad_id, config.headline) if c not in names]
        if missing:
            raise ConfigError(f"{f}: the creative fine-tune needs column(s) {missing} (ad id, human headline: "
                              f"--pairs.ad-id / --pairs.headline); columns: {names}")
        cols = [config.ad_id, config.headline, *[c for c in CREATIVE_FIELDS if c in names and c != config.headline]]
        rows.extend(read_parquet_table(f, columns=list(dict.fromkeys(cols)), error=ConfigError).to_pylist())
    return headline_pairs(rows, config, exclude_ad_ids=exclude_ad_ids, exclude_texts=exclude_texts)


PAIRS_STATS_KEY = b"adbatch_headline_pairs"


def write_headline_pairs(pairs: HeadlinePairs, path: str | Path) -> Path:
    """Write ``pairs`` as Parquet (``ad_id`` string, ``headline``, one string column per field; the
    pairs' stats in the schema metadata), atomically; :func:`load_headline_pairs` reads it back exactly."""
    import json

    import pyarrow as pa

    from adbatch.artifacts import write_parquet_atomic
    from adbatch.serving.prompts import CREATIVE_FIELDS

    keys = [k for k in CREATIVE_FIELDS if any(k in f for f in pairs.fields)]
    cols = {"ad_id": pa.array([str(a) for a in pairs.ad_ids], pa.string()),
            "headline": pa.array(pairs.headlines, pa.string()),
            **{k: pa.array([f.get(k) for f in pairs.fields], pa.string()) for k in keys}}
    table = pa.table(cols).replace_schema_metadata({PAIRS_STATS_KEY: json.dumps(pairs.stats).encode()})
    write_parquet_atomic(table, Path(path))
    return Path(path)


def load_headline_pairs(path: str | Path) -> HeadlinePairs:
    """The pairs :func:`write_headline_pairs` wrote (no filtering: they were chosen when written)."""
    import json

    from adbatch.index.corpus import read_parquet_table

    table = read_parquet_table(Path(path), error=ConfigError)
    meta = (table.schema.metadata or {}).get(PAIRS_STATS_KEY)
    if meta is None or "headline" not in table.column_names:
        raise ConfigError(f"{path}: not a headline-pairs file (write_headline_pairs writes one)")
    keys = [c for c in table.column_names if c not in ("ad_id", "headline")]
    rows = table.to_pylist()
    return HeadlinePairs([r["ad_id"] for r in rows], [{k: r[k] for k in keys if r[k]} for r in rows],
                         [r["headline"] for r in rows], json.loads(meta))


def masked_pairs(pairs: HeadlinePairs, delex: DelexMode | str) -> tuple[list[dict[str, str]], list[str]]:
    """The pairs' fields and headlines as the fine-tune reads them: masked per ``delex``
    (:func:`adbatch.serving.delex.delexicalise` on the fields; the headline with the same slots)."""
    from adbatch.serving.delex import delexicalise, mask_text

    masked = [delexicalise(f, delex) for f in pairs.fields]
    return [m.fields for m in masked], [mask_text(h, m.slots) for h, m in zip(pairs.headlines, masked)]


def creative_examples(tokenizer: Any, pairs: HeadlinePairs, delex: DelexMode | str = DelexMode.OFF) -> Any:
    """``TrainingExamples`` of kind CREATIVE: the tuned creative prompt of each pair's fields -> its
    headline + EOS (``rows`` = the pair's position), masked per ``delex`` (:func:`masked_pairs`)."""
    from adbatch.serving.prompts import CreativePrompt, encode_creative_prompt, encode_creative_target
    from adbatch.training.data import ExampleKind, build_prompted

    if not len(pairs):
        raise ValueError("no headline pairs to train on (see the pairs' skipped counts)")
    fields, headlines = masked_pairs(pairs, delex)
    prompts = [encode_creative_prompt(tokenizer, f, style=CreativePrompt.TUNED) for f in fields]
    targets = [encode_creative_target(tokenizer, h) for h in headlines]
    return build_prompted(prompts, targets, ExampleKind.CREATIVE, list(range(len(pairs))))


def freeze_below(model: Any, train_layers: int | None) -> int:
    """Freeze every weight but the top ``train_layers`` decoder layers and the final norm (embeddings
    too, and so a tied LM head); returns the number of parameters left trainable. None: nothing frozen."""
    if train_layers is None:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"train_layers needs a decoder with .layers; {type(model).__name__} has none")
    model.requires_grad_(False)
    for layer in list(layers)[-train_layers:]:
        layer.requires_grad_(True)
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        norm.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def fine_tune_pairs(model: Any, tokenizer: Any, examples: Any, config: TrainConfig, *, train_layers: int | None,
                    device: str, rank: int = 0, world_size: int = 1, progress: bool = True) -> tuple[Any, int]:
    """Train ``model`` in place on prompted ``examples`` (``TrainingExamples``: prompt -> answer + EOS)
    with :func:`adbatch.training.trainer.train_loop`: the seq2seq-on-a-causal-LM fine-tune the creative
    model (ad fields -> headline) and the query generator (:mod:`adbatch.training.query_generation`, ad
    text -> query) share. Only the top ``train_layers`` decoder layers train (:func:`freeze_below`; all are
    trainable again afterwards); under torch.distributed (``world_size > 1``) the model is DDP-wrapped
    here. Returns ``(TrainStats, trainable parameter count)``; the model is left on ``device``."""
    import torch

    from adbatch.training.trainer import train_loop

    trainable = freeze_below(model, train_layers)
    model.to(device)
    trained = model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None)
    try:
        stats, _ = train_loop(trained, examples, config, pad_id=tokenizer.pad_token_id, device=device, rank=rank,
                              world_size=world_size, progress=progress)
    finally:
        model.requires_grad_(True)
    return stats, trainable


def creative_record(config: CreativeTuneConfig, pairs: HeadlinePairs) -> dict[str, Any]:
    """What a training record says about the creative fine-tune (both shapes)."""
    from adbatch.serving.prompts import TUNED_CREATIVE_PROMPT_VERSION, CreativePrompt

    from adbatch.serving.delex import DELEX_VERSION

    # the masking the model learned: the separate shape's; the shared shape's examples are built unmasked
    delex = config.delex if config.shape is CreativeTuneShape.SEPARATE else DelexMode.OFF
    if config.shape is CreativeTuneShape.SHARED and config.delex is not DelexMode.OFF:
        log.warning("train.creatives.delex = %s applies to the separate shape only: the shared shape trains on "
                    "unmasked pairs (recorded as delex: off)", config.delex.value)
    return {"shape": config.shape.value, "prompt": CreativePrompt.TUNED.value,
            "creative_prompt_version": TUNED_CREATIVE_PROMPT_VERSION, "pairs_hash": pairs.content_hash(),
            "pairs": pairs.stats, "delex": delex.value, "delex_version": DELEX_VERSION, "config": config.to_dict()}


def tune_creatives(
    pairs: HeadlinePairs,
    out_dir: str | Path | None,
    config: CreativeTuneConfig,
    *,
    init_model: str | Path | None = None,
    model: Any = None,
    tokenizer: Any = None,
    device: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> tuple[Any, Any, dict[str, Any]]:
    """The ``separate`` shape: fine-tune ``init_model`` (None = the default model) on ``pairs`` and (rank
    0, when ``out_dir``) save it as a model folder declaring the tuned creative prompt. Its training
    record says ``trained_on_index: None`` (it learned no index: targeting refuses it on a codes index)
    and ``task: creatives``. ``model``/``tokenizer`` override loading (tests). Under torch.distributed
    pass the rank and world size (the caller wraps nothing: DDP is applied here). Returns
    ``(model, tokenizer, summary)``."""
    import torch

    from adbatch.serving.delex import declare_delex
    from adbatch.serving.prompts import declare_creative_prompt
    from adbatch.training.checkpoint import save_trained

    t0 = time.perf_counter()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None or tokenizer is None:
        from adbatch.models import load_causal_lm

        model, tokenizer = load_causal_lm(init_model, dtype=torch.float32, device="cpu")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    examples = creative_examples(tokenizer, pairs, config.delex)
    prep_s = time.perf_counter() - t0
    stats, trainable = fine_tune_pairs(model, tokenizer, examples, config.train, train_layers=config.train_layers,
                                       device=device, rank=rank, world_size=world_size, progress=progress)
    declare_creative_prompt(model)
    declare_delex(model, config.delex)  # the generator masks its prompts and restores its headlines the same way
    data = {"creative": len(examples), "tokens": int(examples.offsets[-1]),
            "target_tokens": examples.num_target_tokens(), "trainable_params": trainable}
    summary = {"task": "creatives", "data": data, "train": stats.summary(model, torch.device(device)),
               "prepare_seconds": round(prep_s, 3), "losses": stats.losses, "creative": creative_record(config, pairs),
               "qat": stats.qat}
    if out_dir is not None and rank == 0:
        record = {"trained_on_index": None, "task": "creatives", "init_model": str(init_model) if init_model else "default",
                  "config": config.train.to_dict(), "train": summary["train"], "data": data,
                  "creative": summary["creative"], "qat": stats.qat}  # the compress stage follows its grid
        save_trained(model, tokenizer, out_dir, record)
        summary["model_dir"] = str(out_dir)
    return model, tokenizer, summary
