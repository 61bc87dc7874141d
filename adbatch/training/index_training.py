"""The training stage's logic: train a causal LM on an ad index (DSI) and save the model folder.

:func:`train_on_index` is the stage's verb (index + ad texts + labelled queries -> trained model folder). Around
the loop (:func:`adbatch.training.trainer.train_loop`) it prepares the model for the index (code tokens,
:func:`prepare_model_for_index`), builds the examples (:func:`index_examples`; generated queries from a tuned
query generator, creative rehearsal and creative pairs where configured), mines the rank phase's teacher
queries, and after training tunes the dense channel's query embedder and fits the fusion of the two channels
before the save. :mod:`adbatch.training` re-exports its public names.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Iterable, Mapping

from adbatch.training.checkpoint import read_training_record, save_trained
from adbatch.training.pseudo_queries import QuerySource

if TYPE_CHECKING:
    from adbatch.training.trainer import TrainConfig

__all__ = ["train_on_index", "TrainSummary", "scheme_name", "default_ad_texts", "check_index_tokenizer",
           "prepare_model_for_index", "index_examples"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainSummary:
    """What :func:`train_on_index` reports beside the model.

    ``data``: example counts by kind (``indexing``, ``retrieval``, ``pseudo_query``, ``generated_query``,
    ``labelled_not_in_index``) and the stats of the query generator, creative pairs and rehearsal when used.
    ``train``: the loop's summary (steps, first/final loss, tokens/s, epochs done, best/evals with model
    selection, ...). ``losses`` / ``density``: (step, value) curves. ``qat``: the QAT record, None unless QAT
    ran. ``sparsity``: the N:M schedule's outcome (``density``, per-layer ``patterns``), None without it.
    ``embedding_init``: how new code tokens were initialised (codes scheme). ``model_dir``: the saved folder
    (rank 0 with an ``out_dir``)."""

    scheme: str
    index_hash: str
    data: dict[str, Any]
    train: dict[str, Any]
    prepare_seconds: float
    warm_started_from_index: str | None
    losses: list[Any]
    density: list[Any]
    qat: dict[str, Any] | None = None
    sparsity: dict[str, Any] | None = None
    embedding_init: dict[str, Any] | None = None
    model_dir: str | None = None

    def flat(self) -> dict[str, Any]:
        """The scalars a manifest or a Ray Train report holds: ``train_<key>`` for the loop's numbers, the
        example counts, the scheme and index hash, and the sparsity density when pruned."""
        flat = {f"train_{k}": v for k, v in self.train.items() if v is not None}
        flat.update({"scheme": self.scheme, "index_hash": self.index_hash,
                     "examples_indexing": self.data.get("indexing", 0),
                     "examples_retrieval": self.data.get("retrieval", 0),
                     "labelled_not_in_index": self.data.get("labelled_not_in_index", 0),
                     "examples_generated": self.data.get("generated_query", 0),
                     "prepare_seconds": self.prepare_seconds})
        if self.sparsity is not None:
            flat["sparsity_density"] = self.sparsity["density"]
        return {k: v for k, v in flat.items() if not isinstance(v, (list, dict))}

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (benchmark result files)."""
        return dataclasses.asdict(self)


def scheme_name(index: Any) -> str:
    """``codes`` or ``text`` whether the index stores its scheme as an enum or a string."""
    s = getattr(index, "scheme", None) or index.manifest.get("scheme")
    return str(getattr(s, "value", s))


def _index_targets(index: Any) -> list[list[int]]:
    if "token_ids" not in index.ad_codes.column_names:
        raise ValueError(f"index ad_codes has no 'token_ids' column (columns: {index.ad_codes.column_names})")
    return [list(t) for t in index.ad_codes.column("token_ids").to_pylist()]


def default_ad_texts(index: Any) -> dict[Hashable, str]:
    """ad_id -> title from the index's ad table: its ``title`` column when present, else ``text``
    for the ``text`` scheme (the rendered sequence *is* the title there)."""
    cols = index.ad_codes.column_names
    if "title" in cols:
        col = "title"
    elif scheme_name(index) == "text" and "text" in cols:
        col = "text"
    else:
        raise ValueError("the codes scheme needs the ads' titles: pass ad_texts (ad_id -> title) "
                         f"or an index whose ad_codes has a 'title' column (has {cols})")
    return dict(zip(index.ad_ids, index.ad_codes.column(col).to_pylist()))


def check_index_tokenizer(tokenizer: Any, index: Any) -> None:
    """Refuse a tokenizer whose base vocabulary (ids below the manifest's ``base_vocab_size``; code tokens
    a warm-start model added above it do not count) is not the one the index's ``token_ids`` were
    built with (the manifest's ``tokenizer_fingerprint``, see :func:`adbatch.models.tokenizer_fingerprint`).
    Indexes without a fingerprint are not checked."""
    want = (index.manifest or {}).get("tokenizer_fingerprint")
    if want is None:
        return
    from adbatch.models import tokenizer_fingerprint

    if tokenizer_fingerprint(tokenizer, below=int(index.manifest.get("base_vocab_size", len(tokenizer)))) != want:
        raise ValueError(f"the model's tokenizer is not the one index {str(index.index_hash)[:12]} was built with "
                         f"({index.manifest.get('tokenizer')}): its token_ids would mean other tokens to this model; "
                         "rebuild the index with this model's tokenizer or train the model it was built for")


def prepare_model_for_index(model: Any, tokenizer: Any, index: Any, ad_texts: Mapping[Hashable, str]) -> dict[str, Any]:
    """Make ``model``/``tokenizer`` able to emit the index's targets (adds + initialises code tokens)."""
    from adbatch.training.vocab import add_index_tokens, init_code_embeddings

    check_index_tokenizer(tokenizer, index)
    info: dict[str, Any] = {"scheme": scheme_name(index)}
    targets = _index_targets(index)
    if info["scheme"] == "codes":
        special = list(index.manifest.get("special_tokens") or [])
        base = int(index.manifest["base_vocab_size"])
        first_new = add_index_tokens(tokenizer, special, base)
        if first_new < len(special):
            info["embedding_init"] = init_code_embeddings(
                model, tokenizer, targets, [ad_texts.get(a, "") for a in index.ad_ids], base, len(special),
                first_new=first_new)
        elif model.get_input_embeddings().weight.shape[0] < base + len(special):
            model.resize_token_embeddings(base + len(special), mean_resizing=False)
    vocab = model.get_input_embeddings().weight.shape[0]
    top = max(max(t) for t in targets)
    if top >= vocab:
        raise ValueError(f"index token id {top} >= model vocabulary {vocab}: index built for another tokenizer?")
    return info


def index_examples(tokenizer: Any, index: Any, config: Any, ad_texts: Mapping[Hashable, str],
                   labelled: Iterable[tuple[str, Hashable]] = (),
                   generated: Iterable[tuple[str, Hashable]] = ()) -> tuple[Any, dict[str, Any]]:
    """The training examples of ``index`` as ``config`` (a :class:`TrainConfig`) asks: indexing, retrieval
    (``labelled`` train-split pairs), span pseudo-queries and ``generated`` (query, ad_id) pairs
    (:func:`adbatch.training.data.build_examples`). Returns ``(TrainingExamples, data stats)``; what
    :func:`train_on_index` trains on (creative rehearsal, which needs the model, is added there)."""
    from adbatch.training.data import build_examples

    return build_examples(
        tokenizer, index.ad_ids, _index_targets(index), ad_texts, labelled if config.retrieval else (),
        indexing=config.indexing, append_eos=config.append_eos, max_query_tokens=config.max_query_tokens,
        pseudo_queries=config.pseudo_queries, generated=generated)


def _query_generator(init_model: Any, warm_from: Any, query_gen: Any, model: Any, tokenizer: Any,
                     loaded_given: bool) -> tuple[Any, str | None]:
    """The base model of the query generator, as a loader, and the source the record names for it.

    ``query_gen.generator_model`` when set; on a warm start (the starting model learned an index, so it
    writes index sequences, not queries) the generator model its training record names, else the default
    model; otherwise a copy of the starting model taken before the index's tokens are added (the record
    names ``init_model``, or None for a model given in memory without one)."""
    import copy

    from adbatch.models import DEFAULT_MODEL

    source = query_gen.generator_model
    if source is None and warm_from is not None:
        rec = read_training_record(init_model) or {}
        source = (rec.get("query_gen") or {}).get("generator_model") or DEFAULT_MODEL
        log.info("query generator: warm start from a model trained on an index; tuning the generator from %s", source)
    if source is not None:
        def load() -> tuple[Any, Any]:
            import torch

            from adbatch.models import load_causal_lm

            return load_causal_lm(None if source == DEFAULT_MODEL else source, dtype=torch.float32, device="cpu")
        return load, source
    named = str(init_model) if init_model is not None else (None if loaded_given else DEFAULT_MODEL)
    # the tokenizer is shared, not copied: the generator is done (and released) before prepare_model_for_index
    # adds the index's tokens to it
    return (lambda: (copy.deepcopy(model), tokenizer)), named


def _fit_fusion(model: Any, tokenizer: Any, index: Any, config: TrainConfig, ad_texts: Mapping[Hashable, str],
                valid_qrels: Mapping[str, Mapping[Hashable, float]] | None, device: str, dense: Any) -> Any:
    """The fusion fitted for the trained ``model`` (None: no dense channel, no queries, or ``fusion_queries`` 0)."""
    from adbatch.index.dense import stored_dense

    if config.fusion_queries == 0 or not (dense is not None or stored_dense(index.manifest)):
        return None
    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT
    from adbatch.serving.hybrid import fit_fusion_on, fit_queries

    queries, relevant, source = fit_queries(index, ad_texts, valid_qrels, config.fusion_queries, HOME_DEPOT_RELEVANT,
                                            seed=config.pseudo_queries.seed)
    if not queries:
        log.warning("no queries to fit the fusion on: generate falls back to reciprocal-rank fusion")
        return None
    if dense is None:
        from adbatch.index.dense import DenseRetriever

        dense = DenseRetriever(index, device)
    # search_targets / score_targets run the model in eval mode themselves
    return fit_fusion_on(model, tokenizer, index, queries, relevant, source, dense)


def _query_embedder_staging(out_dir: str | Path) -> Path:
    """Where the tuned query embedder waits beside ``out_dir`` until the model folder's save moves it in."""
    return Path(out_dir).with_name(f".{Path(out_dir).name}.query_embedder")


def _tune_query_embedder(index: Any, config: TrainConfig, labelled: list[tuple[str, Hashable]],
                         ad_texts: Mapping[Hashable, str],
                         valid_qrels: Mapping[str, Mapping[Hashable, float]] | None, out_dir: str | Path, device: str,
                         dense: Any, progress: bool) -> tuple[dict[str, Any] | None, Any]:
    """Tune the dense channel's query embedder (:mod:`adbatch.training.query_tuning`) when the config asks, the
    index has a dense channel and the caller did not bring its own retriever (``dense``: it owns the channel then).
    Returns the record entry (None: not tuned or not kept) and the retriever the fusion is fitted with."""
    from adbatch.index.dense import stored_dense

    if not config.query_tuning.enabled or dense is not None or not stored_dense(index.manifest):
        return None, dense
    import shutil

    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT
    from adbatch.index.dense import DenseRetriever
    from adbatch.training.query_tuning import tune_query_embedder, tuning_pairs

    staging = _query_embedder_staging(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    base = DenseRetriever(index, device)
    valid = [(q, a) for q, grades in (valid_qrels or {}).items() for a, g in grades.items() if g >= HOME_DEPOT_RELEVANT]
    texts = [str(ad_texts.get(a) or "") for a in index.ad_ids]
    pairs, valid, source = tuning_pairs(index.ad_ids, texts, labelled, valid, config.query_tuning)
    if not pairs:
        return None, base
    tuned = tune_query_embedder(base, pairs, config.query_tuning, staging, valid=valid, progress=progress)
    if tuned is None:
        return None, base
    return {**tuned, "source": source}, base.with_query_embedder({"name": str(staging), "sha256": tuned["sha256"]})


def _teacher_labelled(generated: Any, index: Any, query_gen: Any, dense: Any, device: str) -> Any:
    """The generated queries filtered and labelled by the dense teacher (``dense``, else the index's own dense
    channel; :func:`adbatch.training.query_generation.teacher_labelled`). An index without a dense channel has
    no teacher: the queries keep their source ad alone, with a warning."""
    from adbatch.index.dense import DenseRetriever, stored_dense
    from adbatch.training.query_generation import teacher_labelled

    if dense is None:
        if not stored_dense(index.manifest):
            log.warning("query_gen.teacher_top_k: the index has no dense channel to label the generated queries "
                        "with; they keep their source ad alone")
            return generated
        dense = DenseRetriever(index, device)
    k = query_gen.teacher_top_k

    def ranker(queries: list[str]) -> list[list[Hashable]]:
        return [[index.ad_ids[r] for r in row if r >= 0] for row in dense.search(dense.embed(queries), k).rows.tolist()]

    return teacher_labelled(generated, ranker, k, query_gen.teacher_labels)


def _rank_queries(tokenizer: Any, index: Any, config: TrainConfig, ad_texts: Mapping[Hashable, str],
                  labelled: list[tuple[str, Hashable]], generated: Any, dense: Any, device: str) -> Any:
    """The ranking queries of the rank phase (:func:`adbatch.training.rank_loss.rank_queries`) from this run's
    training queries, with the dense teacher's (``dense``, else one over ``index``) top-k of each."""
    from adbatch.training.rank_loss import rank_queries, spans_of

    if dense is None:
        from adbatch.index.dense import DenseRetriever

        dense = DenseRetriever(index, device)
    t = time.perf_counter()
    eos = [tokenizer.eos_token_id] if config.append_eos else []
    targets = [t_ + eos for t_ in _index_targets(index)]
    spans = spans_of([str(ad_texts.get(a) or "") for a in index.ad_ids], config.pseudo_queries)
    rq = rank_queries(tokenizer, index, dense, config.rank, targets=targets, max_query_tokens=config.max_query_tokens,
                      labelled=labelled if config.retrieval else (), spans=spans,
                      generated=generated.pairs() if generated is not None else ())
    rq.stats["teacher_seconds"] = round(time.perf_counter() - t, 3)
    log.info("rank phase: %d ranking queries %s (teacher %.1f s)", len(rq), rq.stats["by_source"],
             rq.stats["teacher_seconds"])
    return rq


def train_on_index(
    index: Any,
    out_dir: str | Path | None,
    config: TrainConfig,
    *,
    ad_texts: Mapping[Hashable, str] | None = None,
    labelled: Iterable[tuple[str, Hashable]] = (),
    init_model: str | Path | None = None,
    model: Any = None,
    tokenizer: Any = None,
    device: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    evaluate: Any = None,
    valid_qrels: Mapping[str, Mapping[Hashable, float]] | None = None,
    progress: bool = True,
    creative_pairs: Any = None,
    creative_config: Any = None,
    query_gen: Any = None,
    query_cache: str | Path | None = None,
    exclude_queries: Iterable[str] = (),
    dense: Any = None,
) -> tuple[Any, Any, TrainSummary]:
    """Train a causal LM on ``index`` and (rank 0, when ``out_dir``) save the model folder.

    ``index``: an ``AdIndex`` (``ad_codes`` with ``token_ids``, ``ad_ids``, ``manifest``,
    ``index_hash``). ``labelled``: (query, ad_id) pairs of the train split. ``init_model``: a model
    folder / GGUF / None (the default model); a folder trained on an earlier index is a warm start.
    ``model``/``tokenizer`` override loading (tests pass tiny models; ``init_model`` then only names
    where they came from, for the warm-start record). ``evaluate(model) -> float``:
    the validation metric for model selection when ``config.eval_every > 0`` (see
    :func:`adbatch.training.trainer.train_loop`); or ``valid_qrels`` (query -> {ad_id: grade}) of
    the validation split, which builds that callback from ``config.valid_metric`` over this index.
    ``creative_pairs`` (:class:`adbatch.training.creatives.HeadlinePairs`) with ``creative_config`` (its
    ``CreativeTuneConfig``): the *shared* creative shape -- the pairs join the examples as creative
    examples (``creative_config.repeat`` copies per epoch) and the saved model declares the tuned creative prompt.
    ``query_gen`` (:class:`adbatch.training.query_generation.QueryGenConfig`, None = its defaults): how the
    generated queries are made when ``config.pseudo_queries.source`` is generated or mix -- a generator
    fine-tuned on ``labelled`` (never on ``valid_qrels`` or ``exclude_queries``: those are refused) writes
    queries for every ad before the targeting model is prepared; they are cached in ``out_dir`` (file
    ``generated_queries.parquet``, keyed by the content hash of their inputs; a staging copy beside the
    folder until the save) or ``query_cache`` when given, so a re-run with unchanged inputs reads them.
    Too few labelled pairs: ``query_gen.no_labels`` (spans, with a warning, or zero-shot generation).
    After training, when the index has a dense channel, the fusion of the two channels is fitted on up to
    ``config.fusion_queries`` of ``valid_qrels`` (else held-out pseudo-queries) and stored in the record
    (``fusion``; :func:`adbatch.serving.hybrid.fit_fusion_on`). ``dense``: the
    :class:`~adbatch.index.dense.DenseRetriever` to fit with (default: one over ``index`` on ``device``).
    With ``config.rank.enabled`` the same ``dense`` retriever (default: one over ``index``) is the teacher of
    the rank phase (:mod:`adbatch.training.rank_loss`): its top-k of the run's training queries, before training.
    Returns ``(model, tokenizer, TrainSummary)``.
    """
    import torch

    from adbatch.training.trainer import train_loop

    t0 = time.perf_counter()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    warm_from = None
    loaded_given = model is not None and tokenizer is not None
    if not loaded_given:
        from adbatch.models import load_causal_lm

        model, tokenizer = load_causal_lm(init_model, dtype=torch.float32, device="cpu")
    if init_model is not None and Path(str(init_model)).is_dir():  # also when the caller loaded it
        rec = read_training_record(init_model)
        warm_from = rec.get("trained_on_index") if rec else None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    ad_texts = dict(ad_texts) if ad_texts is not None else default_ad_texts(index)
    labelled = list(labelled)
    generated, gen_info = None, None
    if config.pseudo_queries.source is not QuerySource.SPANS:
        # before prepare_model_for_index: the generator copies the starting model without the index's tokens
        from adbatch.training.query_generation import (GENERATED_QUERIES_FILE, QueryGenConfig,
                                                       build_generated_queries)

        query_gen = query_gen or QueryGenConfig()
        loader, gen_source = _query_generator(init_model, warm_from, query_gen, model, tokenizer, loaded_given)
        if query_cache is not None:
            cache = [Path(query_cache)]
        elif out_dir is not None:  # last run's model folder, then a staging copy a run that failed later left
            cache = [Path(out_dir) / GENERATED_QUERIES_FILE,
                     Path(out_dir).with_name(f".{Path(out_dir).name}.{GENERATED_QUERIES_FILE}")]
        else:
            cache = []
        generated, gen_info = build_generated_queries(
            labelled, index.ad_ids, ad_texts, query_gen, loader,
            exclude_queries=[*exclude_queries, *(valid_qrels or {})], cache=cache,
            write_to=cache[-1] if cache else None, device=device, rank=rank, world_size=world_size, progress=progress)
        gen_info["generator_model"] = gen_source
        if generated is not None and query_gen.teacher_top_k:
            generated = _teacher_labelled(generated, index, query_gen, dense, device)
        if generated is None:  # no labels, no_labels = spans: the span pseudo-queries of this config instead
            config = config.replace(pseudo_queries=config.pseudo_queries.replace(source=QuerySource.SPANS))
    info = prepare_model_for_index(model, tokenizer, index, ad_texts)
    model.to(device)
    examples, data_stats = index_examples(tokenizer, index, config, ad_texts, labelled,
                                          generated.pairs() if generated is not None else ())
    if gen_info is not None:
        data_stats["query_gen"] = {**gen_info, "generated": generated.stats if generated is not None else None}
    if config.creative_rehearsal.enabled:
        from adbatch.training.data import TrainingExamples
        from adbatch.training.rehearsal import rehearsal_examples

        creative, data_stats["creative_rehearsal"] = rehearsal_examples(
            model, tokenizer, index.ad_ids, ad_texts, config.creative_rehearsal)
        examples = TrainingExamples.concat([examples, creative])
    if creative_pairs is not None:
        from adbatch.training.creatives import CreativeTuneConfig, CreativeTuneShape, creative_examples
        from adbatch.training.data import TrainingExamples

        creative_config = creative_config or CreativeTuneConfig(enabled=True, shape=CreativeTuneShape.SHARED)
        pairs_ex = creative_examples(tokenizer, creative_pairs)
        if creative_config.repeat > 1:
            pairs_ex = pairs_ex.select(torch.arange(len(pairs_ex)).repeat(creative_config.repeat))
        examples = TrainingExamples.concat([examples, pairs_ex])
        data_stats["creative_pairs"] = {**creative_pairs.stats, "examples": len(pairs_ex)}
    prep_s = time.perf_counter() - t0
    if evaluate is None and valid_qrels and config.eval_every > 0:
        from adbatch.eval.targeting import validation_metric

        evaluate = validation_metric(tokenizer, index, valid_qrels, metric=config.valid_metric,
                                     max_queries=config.valid_max_queries)
    rank_qs = None
    if config.rank.enabled:
        rank_qs = _rank_queries(tokenizer, index, config, ad_texts, labelled, generated, dense, device)
        data_stats["rank"] = rank_qs.stats
    teacher = None
    if config.distill.enabled:
        import copy

        if warm_from is None and (init_model is not None or not loaded_given):
            log.warning("distilling from a model with no training record: start from one trained on this index")
        teacher = copy.deepcopy(model)  # frozen copy of the starting weights, already on the device
    trained = model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None)
    stats, sparsity = train_loop(trained, examples, config, pad_id=tokenizer.pad_token_id, device=device,
                                 rank=rank, world_size=world_size, evaluate=evaluate, progress=progress,
                                 teacher=teacher, rank_queries=rank_qs)
    del teacher, rank_qs
    if creative_pairs is not None:
        from adbatch.serving.prompts import declare_creative_prompt

        declare_creative_prompt(model)  # in config.json: dense and compressed loads render the tuned prompt
    # qat: None unless QAT ran; the compression stage reads it to use the same INT4 grid (uniform groups)
    summary = TrainSummary(scheme=info["scheme"], index_hash=index.index_hash, data=data_stats,
                           train=stats.summary(model, torch.device(device)), prepare_seconds=round(prep_s, 3),
                           warm_started_from_index=warm_from, losses=stats.losses, density=stats.density,
                           qat=stats.qat, sparsity=stats.sparsity or None, embedding_init=info.get("embedding_init"))
    fusion, tuned, folders = None, None, {}
    if out_dir is not None and rank == 0:
        tuned, dense = _tune_query_embedder(index, config, labelled, ad_texts, valid_qrels, out_dir, device, dense,
                                            progress)
        if tuned is not None:
            from adbatch.training.query_tuning import QUERY_EMBEDDER_DIR

            folders[QUERY_EMBEDDER_DIR] = _query_embedder_staging(out_dir)
        fusion = _fit_fusion(model, tokenizer, index, config, ad_texts, valid_qrels, device, dense)
    if out_dir is not None and rank == 0:
        from adbatch.serving.prompts import TARGETING_PROMPT_VERSION

        record = {"trained_on_index": index.index_hash, "scheme": info["scheme"],
                  "targeting_prompt_version": TARGETING_PROMPT_VERSION,
                  "num_ads": len(index.ad_ids), "init_model": str(init_model) if init_model else "default",
                  "warm_started_from_index": warm_from, "config": config.to_dict(), "world_size": world_size,
                  "train": summary.train, "losses": summary.losses, "data": data_stats,
                  "sparsity": {k: v for k, v in (stats.sparsity or {}).items() if k != "patterns"},
                  "layer_patterns": (stats.sparsity or {}).get("patterns", {}),
                  "qat": stats.qat, "fusion": fusion.to_dict() if fusion is not None else None,
                  "query_embedder": tuned}
        if creative_pairs is not None:
            from adbatch.training.creatives import creative_record

            record["creative"] = creative_record(creative_config, creative_pairs)
        if gen_info is not None:
            record["query_gen"] = {"config": query_gen.to_dict(), "generator_model": gen_info["generator_model"],
                                   "key": gen_info.get("key"), "status": gen_info["status"]}
        save_trained(model, tokenizer, out_dir, record, masks=sparsity.masks if sparsity is not None else None,
                     folders=folders)
        if generated is not None and query_cache is None:
            # the cache lives in the model folder the save just replaced: the next run with the same inputs reads it
            from adbatch.training.query_generation import GENERATED_QUERIES_FILE, write_generated_queries

            write_generated_queries(generated, Path(out_dir) / GENERATED_QUERIES_FILE)
            Path(out_dir).with_name(f".{Path(out_dir).name}.{GENERATED_QUERIES_FILE}").unlink(missing_ok=True)
        summary.model_dir = str(out_dir)
    return model, tokenizer, summary
