"""Ranking metrics for ad targeting: recall@k, success@k, MRR@k and nDCG@k with graded gains.

Conventions (shared by every stage that reports targeting quality):

- A *ranked list* is a sequence of ad ids, best first. Padding (``None`` or the integer ``-1``, the
  decoder's "no result" row) is ignored, and a repeated id counts only at its first position, so a
  decoder that emits the same ad twice gains nothing from it.
- *qrels* map a query to ``{ad_id: grade}``. Only judged ads appear; an unjudged ad is unknown, not
  irrelevant (Home Depot judgments are pooled), and scores as gain 0 like a non-relevant one.
- An ad is *relevant* when its grade is ``>= relevant_threshold`` (Home Depot: 2.67 on the 1-3 scale).
- ``recall_at_k`` is the fraction of a query's relevant ads found in the top k (the IR definition).
  ``success_at_k`` (a.k.a. hit rate) is 1 when at least one relevant ad is in the top k; DESIGN.md's
  "finds a relevant title in its top 10 for 72% of queries" is success@10.
- ``ndcg_at_k`` uses graded gains ``gain = max(grade - gain_offset, 0)``: with the default offset 1
  a Home Depot grade of 1 ("not relevant") contributes nothing and 3 contributes 2. Discount
  ``1 / log2(rank + 1)``; the ideal DCG sorts all judged gains of the query.
Queries with no relevant ad are skipped by the batch helper (their recall is undefined) and counted.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

HOME_DEPOT_RELEVANT = 2.67


def _clean(ranked: Iterable[Any], k: int) -> list[Any]:
    """First ``k`` distinct, non-padding ids of ``ranked``."""
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")
    out: list[Any] = []
    seen: set[Any] = set()
    for ad in ranked:
        if ad is None or (isinstance(ad, int) and ad == -1):
            continue
        if ad in seen:
            continue
        seen.add(ad)
        out.append(ad)
        if len(out) == k:
            break
    return out


def relevant_set(grades: Mapping[Hashable, float], relevant_threshold: float = HOME_DEPOT_RELEVANT) -> set:
    return {ad for ad, g in grades.items() if g >= relevant_threshold}


def recall_at_k(ranked: Sequence[Any], relevant: set, k: int) -> float:
    """|relevant ∩ top-k| / |relevant|. Raises on an empty relevant set (undefined)."""
    if not relevant:
        raise ValueError("recall is undefined for a query with no relevant ad")
    top = _clean(ranked, k)
    return sum(1 for ad in top if ad in relevant) / len(relevant)


def success_at_k(ranked: Sequence[Any], relevant: set, k: int) -> float:
    """1.0 when any relevant ad is in the top k, else 0.0."""
    return 1.0 if any(ad in relevant for ad in _clean(ranked, k)) else 0.0


def mrr_at_k(ranked: Sequence[Any], relevant: set, k: int) -> float:
    """1 / rank of the first relevant ad within the top k (ranks from 1), else 0."""
    for i, ad in enumerate(_clean(ranked, k)):
        if ad in relevant:
            return 1.0 / (i + 1)
    return 0.0


def ndcg_at_k(ranked: Sequence[Any], grades: Mapping[Hashable, float], k: int, gain_offset: float = 1.0) -> float:
    """nDCG@k with gains ``max(grade - gain_offset, 0)`` (see the module docstring)."""
    gains = {ad: max(float(g) - gain_offset, 0.0) for ad, g in grades.items()}
    ideal = sorted((g for g in gains.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    if idcg == 0.0:
        return 0.0
    dcg = sum(gains.get(ad, 0.0) / math.log2(i + 2) for i, ad in enumerate(_clean(ranked, k)))
    return dcg / idcg


@dataclass
class RankingReport:
    """Mean metrics over the evaluated queries (``metrics``: name -> mean) and the counts."""

    metrics: dict[str, float]
    num_queries: int
    num_skipped: int


def _id_kind(ad_id: Any) -> str:
    """What an id compares as: every integer type (Python, numpy) equals the others, never a string."""
    if isinstance(ad_id, numbers.Integral):
        return "int"
    return type(ad_id).__name__


def check_id_kinds(ad_ids: Iterable[Any], qrels: Mapping[str, Mapping[Hashable, float]], ranker: str = "ranker") -> None:
    """Refuse ranked ad ids and qrels ids of disjoint kinds (int vs str): ``7 != "7"``, so every query would
    score 0 with no word of why. Raises ``ValueError`` naming both kinds and an example of each."""
    ours: dict[str, Any] = {}
    for a in ad_ids:
        if not (a is None or (isinstance(a, int) and a == -1)):  # padding, as _clean reads it
            ours.setdefault(_id_kind(a), a)
    theirs: dict[str, Any] = {}
    for grades in qrels.values():
        for a in grades:
            theirs.setdefault(_id_kind(a), a)
    if ours and theirs and not set(ours) & set(theirs):
        raise ValueError(
            f"the {ranker}'s ad ids are {'/'.join(sorted(ours))} (e.g. {next(iter(ours.values()))!r}) but the qrels' "
            f"are {'/'.join(sorted(theirs))} (e.g. {next(iter(theirs.values()))!r}): no id can match, every query "
            "would score 0; convert one side (e.g. str(ad_id)) so both use the catalogue's ids")


def ranking_metrics(
    ranked_lists: Mapping[str, Sequence[Any]],
    qrels: Mapping[str, Mapping[Hashable, float]],
    ks: Sequence[int] = (1, 10),
    relevant_threshold: float = HOME_DEPOT_RELEVANT,
    gain_offset: float = 1.0,
) -> RankingReport:
    """Average recall/success/MRR/nDCG @ each k over the queries of ``qrels``.

    Every query in ``qrels`` with at least one relevant ad is evaluated; a query missing from
    ``ranked_lists`` is an error (a ranker that drops a query must not look better). Names:
    ``recall@k``, ``success@k``, ``mrr@k``, ``ndcg@k``.
    """
    check_id_kinds((a for lst in ranked_lists.values() for a in lst), qrels)
    sums: dict[str, float] = {}
    n = skipped = 0
    for query, grades in qrels.items():
        rel = relevant_set(grades, relevant_threshold)
        if not rel:
            skipped += 1
            continue
        if query not in ranked_lists:
            raise KeyError(f"query {query!r} has qrels but no ranked list")
        ranked = ranked_lists[query]
        n += 1
        for k in ks:
            for name, value in (
                (f"recall@{k}", recall_at_k(ranked, rel, k)),
                (f"success@{k}", success_at_k(ranked, rel, k)),
                (f"mrr@{k}", mrr_at_k(ranked, rel, k)),
                (f"ndcg@{k}", ndcg_at_k(ranked, grades, k, gain_offset)),
            ):
                sums[name] = sums.get(name, 0.0) + value
    means = {name: (total / n if n else 0.0) for name, total in sorted(sums.items())}
    return RankingReport(metrics=means, num_queries=n, num_skipped=skipped)
