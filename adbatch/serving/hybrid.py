"""Targets from two channels, fused: the generative model's trie-constrained beam search and the index's
dense channel (the ad embeddings it clustered, searched by cosine).

Hybrid ranking (:attr:`FusionMode.HYBRID`) scores the *union* of both channels' candidates on both
scales: every dense candidate gets its exact generative log-probability (teacher-forced in one tree pass per
query, :func:`adbatch.decoding.score_targets`), every generative candidate its cosine; then one fused score
ranks the union (:class:`FusionParams`). The beam search runs first: the dense candidates it found already have
their exact score, the others are scored in one tree pass (:meth:`HybridRanker._exact_dense`). With
``TargetSearchConfig.dense_scoring = beam_floor`` there is no pass: a dense candidate the beams did not find gets the
query's lowest beam score in the fused score (``Candidates.floor``; the search stopped above it), and the fusion
fitted for that scoring (``FusionParams.beam_floor``) ranks.

- ``interpolation``: ``score = cosine + weight_generative * log-prob`` (the log-prob summed over the ad's
  target tokens, or their mean: ``generative_norm``); the weight and the norm are fitted at train time
  on the validation queries (or held-out pseudo-queries whose ad is known) by :func:`fit_fusion`, and stored
  in the training record, so a barely trained model leans on the dense channel by itself;
- ``rrf``: reciprocal-rank fusion ``1/(k + rank_gen) + 1/(k + rank_dense)`` over the union, the
  parameter-free fallback for a trained model with no fitted fusion (an untrained one gets the dense order).

Everything here is batched tensors: ``Q`` queries x ``M`` union slots (``M = top_k + dense_k``), padded
with row -1.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Mapping, Sequence

import numpy as np

from adbatch.config import ConfigBase, ConfigError
from adbatch.decoding.config import DenseScoring, FusionMode

log = logging.getLogger(__name__)

#: channel flags of a candidate (the targets Parquet's ``channel`` column names them)
CHANNEL_GENERATIVE = 1
CHANNEL_DENSE = 2
CHANNEL_NAMES = {CHANNEL_GENERATIVE: "generative", CHANNEL_DENSE: "dense",
                 CHANNEL_GENERATIVE | CHANNEL_DENSE: "both"}
#: interpolation weights :func:`fit_fusion` tries (0 = the dense order; large = the generative order)
FUSION_WEIGHT_GRID = (0.0, *np.round(np.logspace(-3, 1, 25), 6).tolist())


class FusionMethod(str, enum.Enum):
    INTERPOLATION = "interpolation"  #: cosine + weight x generative log-prob (fitted)
    RRF = "rrf"  #: reciprocal-rank fusion (parameter-free)


@dataclasses.dataclass
class FusionParams(ConfigBase):
    """How the two scores of a union candidate become one (stored in the training record as ``fusion``)."""

    method: FusionMethod = FusionMethod.RRF
    weight_generative: float = 0.0
    #: sum: the sequence log-prob as scored; mean: divided by the ad's target length (long ids are not
    #: penalised for their length)
    generative_norm: str = "sum"
    rrf_k: float = 60.0
    fitted_on: str = "none"  #: validation | pseudo_queries | none
    queries: int = 0  #: queries the fit saw
    #: recall@10 / MRR@10 on the fit's queries: dense alone, generative alone (the union ranked by
    #: log-prob), hybrid at the chosen parameters
    fit_metrics: dict = dataclasses.field(default_factory=dict)
    #: the fusion fitted for ``dense_scoring = beam_floor`` on the same queries (these fields, as a dict), or None:
    #: :meth:`for_scoring` then serves this one's parameters with either scoring
    beam_floor: dict | None = None

    def validate(self) -> None:
        if not np.isfinite(self.weight_generative) or self.weight_generative < 0:
            raise ConfigError(f"FusionParams.weight_generative must be finite and >= 0, got {self.weight_generative}")
        if self.generative_norm not in ("sum", "mean"):
            raise ConfigError(f"FusionParams.generative_norm must be sum or mean, got {self.generative_norm!r}")
        if not np.isfinite(self.rrf_k) or self.rrf_k <= 0:
            raise ConfigError(f"FusionParams.rrf_k must be finite and > 0, got {self.rrf_k}")

    def for_scoring(self, scoring: DenseScoring) -> "FusionParams":
        """The parameters to fuse with when dense candidates are scored by ``scoring``."""
        if scoring is DenseScoring.BEAM_FLOOR and self.beam_floor:
            return FusionParams.from_dict({**self.beam_floor, "beam_floor": None})
        return self

    @property
    def dense_order(self) -> bool:
        """Whether the fused score is the cosine alone (interpolation with generative weight 0): the dense
        candidates' generative scores are then not needed."""
        return self.method is FusionMethod.INTERPOLATION and self.weight_generative == 0.0


def fusion_of_record(record: Mapping[str, Any] | None, source: str = "the training record") -> FusionParams:
    """The fitted fusion a training record (or compressed manifest) carries; for a model trained without a fit
    (``fusion_queries`` 0, or before fits existed) the RRF fallback; for a model never trained on the index
    (no record) the dense order: its generative scores know no ads (zero-shot recall@10 0.010 on 5k).

    The record's ``fusion`` and its ``beam_floor`` fit are parsed whole: a damaged or hand-edited one (not a
    mapping, a NaN weight) is a :class:`ConfigError` naming ``source`` (the record's file), which the generate
    driver raises before Ray starts rather than every actor after."""
    if record is None:
        return FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=0.0, fitted_on="untrained model")
    fusion = record.get("fusion")
    if not fusion:
        return FusionParams()
    try:
        if not isinstance(fusion, Mapping):
            raise ConfigError(f"fusion must be a mapping (the fitted FusionParams), got {type(fusion).__name__}")
        params = FusionParams.from_dict(dict(fusion))
        if params.beam_floor is not None:
            if not isinstance(params.beam_floor, Mapping):
                raise ConfigError("fusion.beam_floor must be a mapping (FusionParams) or null, got "
                                  f"{type(params.beam_floor).__name__}")
            params.for_scoring(DenseScoring.BEAM_FLOOR)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return params


@dataclasses.dataclass
class Candidates:
    """Both channels' candidates per query, unfused: ``rows Long[Q, M]`` (-1 pad, distinct per query),
    ``generative`` / ``dense`` ``Float32[Q, M]`` (exact log-prob with the search's scoring rule; cosine;
    NaN where that channel was not computed), ``channel Int8[Q, M]`` (bit flags: who proposed it),
    ``length Long[Q, M]`` (target tokens of each row's id; 1 at padding), ``floor Float32[Q]`` (``beam_floor``
    scoring: the generative score :func:`fused_scores` gives a dense candidate without one; else None)."""

    rows: Any
    generative: Any
    dense: Any
    channel: Any
    length: Any = None
    floor: Any = None


def beam_floor_view(c: Candidates) -> Candidates:
    """``c`` as ``dense_scoring = beam_floor`` would have produced it: the generative scores of candidates only
    the dense channel found are dropped (NaN) and each query's ``floor`` is its lowest beam score (0 for a query
    the beams found nothing for: its dense candidates then keep their cosine order)."""
    import torch

    found = (c.rows >= 0) & ((c.channel.long() & CHANNEL_GENERATIVE) > 0) & torch.isfinite(c.generative)
    floor = torch.where(found, c.generative, float("inf")).amin(1)
    floor = torch.where(torch.isfinite(floor), floor, 0.0)
    gen = torch.where(found, c.generative, float("nan"))
    return Candidates(c.rows, gen, c.dense, c.channel, c.length, floor)


@dataclasses.dataclass
class RankedTargets:
    """Per query the best ``k`` rows, best first: ``rows Long[Q, k]`` (-1 pad), ``score`` (fused),
    ``generative``, ``dense`` (``Float32[Q, k]``, NaN where not computed) and ``channel Int8[Q, k]``."""

    rows: Any
    score: Any
    generative: Any
    dense: Any
    channel: Any

    def lists(self) -> list[list[int]]:
        return [[r for r in row if r >= 0] for row in self.rows.tolist()]


def union_candidates(gen_rows: Any, gen_scores: Any, gen_cos: Any, dense_rows: Any, dense_cos: Any,
                     dense_gen: Any) -> Candidates:
    """Merge the two channels' lists (``[Q, k]`` and ``[Q, K]``, -1 pad) into distinct rows per query.

    A row in both lists is kept once with both flags (its two generative scores are the same exact
    number, up to float rounding; the beam's is kept)."""
    import torch

    rows = torch.cat([gen_rows, dense_rows], 1)
    g = torch.cat([gen_scores, dense_gen], 1).float()
    d = torch.cat([gen_cos, dense_cos], 1).float()
    ch = torch.cat([torch.full_like(gen_rows, CHANNEL_GENERATIVE), torch.full_like(dense_rows, CHANNEL_DENSE)], 1)
    big = torch.iinfo(torch.long).max
    key = torch.where(rows >= 0, rows, big)
    order = key.sort(dim=1, stable=True).indices  # generative first among equal rows (stable)
    rows, g, d, ch, key = (x.gather(1, order) for x in (rows, g, d, ch, key))
    dup_next = torch.zeros_like(rows, dtype=torch.bool)
    dup_next[:, :-1] = (key[:, :-1] == key[:, 1:]) & (key[:, :-1] != big)
    dup_prev = torch.zeros_like(dup_next)
    dup_prev[:, 1:] = dup_next[:, :-1]
    nxt = torch.roll(ch, -1, 1)
    ch = torch.where(dup_next, ch | nxt, ch)
    keep = (rows >= 0) & ~dup_prev
    return Candidates(torch.where(keep, rows, -1), torch.where(keep, g, float("nan")),
                      torch.where(keep, d, float("nan")), torch.where(keep, ch, 0).to(torch.int8))


def _ranks(x: Any, valid: Any) -> Any:
    """1-based rank of each entry of ``x [Q, M]`` within its row, descending, invalid last."""
    import torch

    order = torch.where(valid, x, float("-inf")).argsort(1, descending=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(1, x.shape[1] + 1, device=x.device).expand_as(order).contiguous())
    return ranks


def fused_scores(c: Candidates, params: FusionParams) -> Any:
    """``Float32[Q, M]`` fused score of each union candidate (-inf at padding)."""
    import torch

    valid = c.rows >= 0
    gen = c.generative
    if c.floor is not None:  # beam_floor scoring: a dense candidate without a generative score gets the floor
        gen = torch.where(torch.isnan(gen) & valid, c.floor[:, None].to(gen.dtype), gen)
    if params.dense_order:
        s = c.dense  # the dense order over the union (generative scores may be absent: not computed)
    elif params.method is FusionMethod.INTERPOLATION:
        g = gen / c.length.clamp(min=1) if params.generative_norm == "mean" else gen
        s = c.dense + params.weight_generative * g
    else:
        rg = _ranks(gen, valid & torch.isfinite(gen))
        rd = _ranks(c.dense, valid & torch.isfinite(c.dense))
        s = 1.0 / (params.rrf_k + rg) + 1.0 / (params.rrf_k + rd)
    return torch.where(valid & torch.isfinite(s), s, float("-inf"))


def rank_candidates(c: Candidates, score: Any, k: int) -> RankedTargets:
    """The best ``k`` of each query's union by ``score`` (``[Q, M]``)."""
    import torch

    k_eff = min(k, score.shape[1])
    top_s, idx = score.topk(k_eff, dim=1)
    ok = torch.isfinite(top_s)
    take = lambda x, fill: torch.where(ok, x.gather(1, idx), fill)  # noqa: E731
    return RankedTargets(take(c.rows, -1), top_s, take(c.generative, float("nan")), take(c.dense, float("nan")),
                         take(c.channel, 0).to(torch.int8))


def recall_mrr(ranked_rows: Any, relevant: Sequence[set[int]], k: int = 10) -> tuple[float, float]:
    """Mean recall@k and MRR@k of ranked rows ``[Q, >=k]`` against each query's relevant row set."""
    rec, mrr = [], []
    for row, rel in zip(ranked_rows[:, :k].tolist(), relevant):
        if not rel:
            continue
        hits = [r in rel for r in row]
        rec.append(sum(hits) / len(rel))
        mrr.append(next((1.0 / (i + 1) for i, h in enumerate(hits) if h), 0.0))
    return (float(np.mean(rec)) if rec else 0.0, float(np.mean(mrr)) if mrr else 0.0)


def fit_fusion(c: Candidates, relevant: Sequence[set[int]], fitted_on: str, k: int = 10) -> FusionParams:
    """Choose the fusion that ranks ``relevant`` (each query's relevant index rows) best in the top ``k``
    of the union ``c``: the interpolation weight from :data:`FUSION_WEIGHT_GRID` with the highest mean
    recall@k (then MRR@k; then the smaller weight), or RRF where it beats every weight."""
    import torch

    def score_of(p: FusionParams) -> tuple[float, float]:
        return recall_mrr(rank_candidates(c, fused_scores(c, p), k).rows, relevant, k)

    best, best_key = None, None
    norms = ("sum", "mean") if c.length is not None else ("sum",)
    for norm in norms:
        for w in FUSION_WEIGHT_GRID:
            p = FusionParams(method=FusionMethod.INTERPOLATION, weight_generative=float(w), generative_norm=norm)
            r, m = score_of(p)
            if best_key is None or (r, m) > best_key:
                best, best_key = p, (r, m)
    rrf = FusionParams(method=FusionMethod.RRF)
    if score_of(rrf) > best_key:
        best, best_key = rrf, score_of(rrf)
    valid = c.rows >= 0
    gen_only = torch.where(valid & torch.isfinite(c.generative), c.generative, float("-inf"))
    dense_only = torch.where(valid & ((c.channel.long() & CHANNEL_DENSE) > 0), c.dense, float("-inf"))
    g_r, g_m = recall_mrr(rank_candidates(c, gen_only, k).rows, relevant, k)
    d_r, d_m = recall_mrr(rank_candidates(c, dense_only, k).rows, relevant, k)
    best.fitted_on = fitted_on
    best.queries = sum(1 for r in relevant if r)
    best.fit_metrics = {f"dense_recall@{k}": round(d_r, 4), f"dense_mrr@{k}": round(d_m, 4),
                        f"generative_recall@{k}": round(g_r, 4), f"generative_mrr@{k}": round(g_m, 4),
                        f"hybrid_recall@{k}": round(best_key[0], 4), f"hybrid_mrr@{k}": round(best_key[1], 4)}
    log.info("fusion fitted on %d %s queries: %s (weight %.4g, %s) %s", best.queries, fitted_on, best.method.value,
             best.weight_generative, best.generative_norm, best.fit_metrics)
    return best


class HybridRanker:
    """Query texts -> ranked index rows through the configured channels (one model + one index, loaded
    by the caller). Used by the generate stage's :class:`~adbatch.serving.generators.TargetGenerator`,
    the evaluation and the training stage's fusion fit, so all three rank the same way.

    ``search``: the :class:`~adbatch.decoding.TargetSearchConfig` (its ``fusion`` picks the channels, ``dense_k``
    the dense candidates per query: their generative scores are exact, and with ``prior_weight > 0`` they
    steer the beams). ``dense``: a :class:`adbatch.index.dense.DenseRetriever` over ``index`` (required
    unless ``search.fusion`` is generative). ``fusion``: the fitted parameters (RRF fallback).
    """

    def __init__(self, model: Any, tokenizer: Any, index: Any, search: Any, *, dense: Any = None,
                 fusion: FusionParams | None = None, max_query_tokens: int = 48, cost_model: Any = None) -> None:
        self.model, self.tokenizer, self.index, self.search = model, tokenizer, index, search
        self.mode = search.fusion
        if self.mode is not FusionMode.GENERATIVE and dense is None:
            raise ValueError(f"fusion mode {self.mode.value!r} needs the dense channel (a DenseRetriever)")
        if self.mode is FusionMode.GENERATIVE and search.prior_weight > 0:
            raise ConfigError("TargetSearchConfig.prior_weight > 0 needs the dense channel: use fusion hybrid")
        self.dense, self.dense_k = dense, search.dense_k
        # the parameters fitted for this scoring of the dense candidates (exact, or the beam floor)
        self.fusion = (fusion or FusionParams()).for_scoring(search.dense_scoring)
        self.max_query_tokens = max_query_tokens
        self.cost_model = cost_model
        self.trie = index.trie
        self.row_length = _row_lengths(index.trie)  # Long[R]: target tokens of each row's id
        self.last_beams_verified = 0  # beams the last call's search finished by tree verification
        from adbatch.decoding import ScoreStats

        self.last_exact = ScoreStats()  # the last hybrid call's exact scoring of dense candidates (counters)

    def candidates(self, queries: list[str], q_emb: Any = None) -> Candidates:
        """Both channels' union for ``queries`` (``q_emb``: their embeddings when already computed). In hybrid
        mode the beam search runs first; then the dense candidates it did not find are scored exactly
        (:meth:`_exact_dense`), or, with ``dense_scoring = beam_floor``, left unscored with the beams' floor
        (:func:`beam_floor_view`)."""
        import torch

        from adbatch.decoding import DenseCandidates, ScoreStats, search_targets
        from adbatch.serving.prompts import encode_targeting_prompts

        Q = len(queries)
        self.last_beams_verified = 0
        self.last_exact = ScoreStats()
        if self.mode is FusionMode.DENSE:
            q = self.dense.embed(queries) if q_emb is None else q_emb.to(self.dense.device)
            hits = self.dense.search(q, self.dense_k)
            nan = torch.full(hits.scores.shape, float("nan"))
            return Candidates(hits.rows.cpu(), nan, hits.scores.float().cpu(),
                              torch.where(hits.rows.cpu() >= 0, CHANNEL_DENSE, 0).to(torch.int8))
        prompts = encode_targeting_prompts(self.tokenizer, queries, self.max_query_tokens)
        if self.mode is FusionMode.GENERATIVE:
            with torch.inference_mode():
                res = search_targets(self.model, prompts, self.trie, self.search, cost_model=self.cost_model)
            self.last_beams_verified = res.stats.beams_verified
            nan = torch.full(res.scores.shape, float("nan"))
            return Candidates(res.rows, res.scores.float(), nan,
                              torch.where(res.rows >= 0, CHANNEL_GENERATIVE, 0).to(torch.int8))
        q = self.dense.embed(queries) if q_emb is None else q_emb.to(self.dense.device)
        hits = self.dense.search(q, self.dense_k)
        rows_d, cos_d = hits.rows.cpu(), hits.scores.float().cpu()
        prior = DenseCandidates(hits.rows, hits.scores.float()) if self.search.prior_weight > 0 else None
        with torch.inference_mode():
            res = search_targets(self.model, prompts, self.trie, self.search, cost_model=self.cost_model, dense=prior)
        self.last_beams_verified = res.stats.beams_verified
        gen_cos = self.dense.score(q, res.rows).float().cpu()
        # a fusion that ignores the generative score (fitted weight 0: a barely trained model) needs no dense
        # candidate's; nor does the beam floor. Their score_generative stays null unless the beam found them too
        floor = self.search.dense_scoring is DenseScoring.BEAM_FLOOR
        if self.fusion.dense_order or floor:
            dense_gen = torch.full(rows_d.shape, float("nan"))
        else:
            dense_gen = self._exact_dense(prompts, res.rows, rows_d)
        assert dense_gen.shape[0] == Q
        c = union_candidates(res.rows, res.scores.float(), gen_cos, rows_d, cos_d, dense_gen)
        return beam_floor_view(c) if floor and not self.fusion.dense_order else c

    def _exact_dense(self, prompts: list[list[int]], gen_rows: Any, rows_d: Any) -> Any:
        """``Float32[Q, K]`` exact generative scores of the dense candidates ``rows_d`` the beams did not find (NaN
        where they did: the beam's score is that number), in one :func:`adbatch.decoding.score_targets` call.

        Measured, and not kept: bounding the fused score (a log-prob is <= 0, so cosine bounds it) to skip
        candidates that cannot reach the top k. On the trained 5k model (H100) it skipped 0.5 % of the rows in
        one round, 3 % over several, and every multi-round schedule was slower than one pass: the generative term
        of the fit (0.01 x a summed log-prob of -5 to -30) spans the top-20 cosines, so few candidates are
        bounded out (bench/RESULTS.md, "Two channels")."""
        import torch

        from adbatch.decoding import score_targets

        todo = (rows_d >= 0) & ~(rows_d[:, :, None] == gen_rows[:, None, :]).any(-1)
        out = torch.full(rows_d.shape, float("nan"))
        if todo.any():
            with torch.inference_mode():  # as the search
                scored = score_targets(self.model, prompts, self.trie, self.search, torch.where(todo, rows_d, -1),
                                       stats=self.last_exact)
            out = torch.where(todo, scored, out)
        return out

    def _with_lengths(self, c: Candidates) -> Candidates:
        import torch

        c.length = torch.where(c.rows >= 0, self.row_length[c.rows.clamp(min=0)], 1)
        return c

    def rank(self, queries: list[str], q_emb: Any = None, k: int | None = None) -> RankedTargets:
        """The best ``k`` (default ``search.top_k``) rows per query, fused as configured."""
        k = k or self.search.top_k
        c = self._with_lengths(self.candidates(queries, q_emb))
        if self.mode is FusionMode.GENERATIVE:
            score = _valid_scores(c, c.generative)
        elif self.mode is FusionMode.DENSE:
            score = _valid_scores(c, c.dense)
        else:
            score = fused_scores(c, self.fusion)
        return rank_candidates(c, score, k)


def _row_lengths(trie: Any) -> Any:
    """``Long[R]``: the depth of each row's terminal node (its id's target tokens)."""
    import torch

    counts = (trie.terminal_ptr[1:] - trie.terminal_ptr[:-1]).long()
    nodes = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = torch.empty(trie.terminal_rows.numel(), dtype=torch.long)
    out[trie.terminal_rows.long()] = trie.depth.long()[nodes]
    return out


def _valid_scores(c: Candidates, x: Any) -> Any:
    import torch

    return torch.where((c.rows >= 0) & torch.isfinite(x), x, float("-inf"))


def fit_queries(index: Any, ad_texts: Mapping[Any, str], qrels: Mapping[str, Mapping[Any, float]] | None,
                max_queries: int, relevant_threshold: float, seed: int = 0) -> tuple[list[str], list[set[int]], str]:
    """The queries a fusion is fitted on, with each one's relevant index rows, and what they are.

    Validation ``qrels`` when given (relevant = grade >= ``relevant_threshold``; ad ids matched as
    strings, so int and str ids agree); else one held-out span pseudo-query for each of up to
    ``max_queries`` ads spread over the index (a seed the training's spans do not use), whose source ad
    is the one relevant row."""
    row_of = {str(a): r for r, a in enumerate(index.ad_ids)}
    if qrels:
        queries, relevant = [], []
        for q in sorted(qrels)[:max_queries]:
            rel = {row_of[str(a)] for a, g in qrels[q].items() if g >= relevant_threshold and str(a) in row_of}
            if rel:
                queries.append(q)
                relevant.append(rel)
        return queries, relevant, "validation"
    from adbatch.training.pseudo_queries import PseudoQueryConfig, span_pseudo_queries

    n = index.num_ads
    rows = np.unique(np.linspace(0, n - 1, num=min(max_queries, n)).astype(np.int64)).tolist()
    texts = [ad_texts.get(index.ad_ids[r], "") for r in rows]
    spans = span_pseudo_queries(texts, PseudoQueryConfig(per_ad=1, min_words=2, max_words=4, seed=seed + 7919))
    return [q for q, _ in spans], [{rows[i]} for _, i in spans], "pseudo_queries"


def fit_fusion_on(model: Any, tokenizer: Any, index: Any, queries: list[str], relevant: Sequence[set[int]],
                  fitted_on: str, dense: Any, search: Any = None, batch_size: int = 256,
                  q_emb: Any = None) -> FusionParams:
    """Rank ``queries`` through both channels (the union, every dense candidate scored exactly) and
    :func:`fit_fusion` on ``relevant``; the fit for ``dense_scoring = beam_floor`` (:func:`beam_floor_view` of the
    same union) goes in the result's ``beam_floor``.

    ``search``: the decoding config of the candidates (default: the generate stage's ``TargetSearchConfig``
    with ``verify = off``, hybrid); ``q_emb``: the queries' embeddings when already computed."""
    import torch

    from adbatch.decoding import TargetSearchConfig, VerifyMode

    search = (search or TargetSearchConfig(verify=VerifyMode.OFF)).replace(fusion=FusionMode.HYBRID,
                                                                          dense_scoring=DenseScoring.EXACT)
    ranker = HybridRanker(model, tokenizer, index, search, dense=dense)
    parts = [ranker._with_lengths(ranker.candidates(queries[s:s + batch_size],
                                                    None if q_emb is None else q_emb[s:s + batch_size]))
             for s in range(0, len(queries), batch_size)]
    cat = lambda name: torch.cat([getattr(p, name) for p in parts], 0)  # noqa: E731
    union = Candidates(cat("rows"), cat("generative"), cat("dense"), cat("channel"), cat("length"))
    fitted = fit_fusion(union, relevant, fitted_on, k=search.top_k)
    # the same queries as dense_scoring = beam_floor sees them: its own weight (the floor is coarser than an exact
    # score, so the fit leans on it differently: 0.046 vs 0.01 on the trained 5k model)
    fitted.beam_floor = fit_fusion(beam_floor_view(union), relevant, fitted_on, k=search.top_k).to_dict()
    return fitted
