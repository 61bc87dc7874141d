"""The eval stage's library side: the evaluation data (``datasets``: Home Depot relevance, slogan
test set, read from ``../shared``), ranking metrics (``metrics``), targeting evaluation and the
MiniLM + FAISS baseline (``targeting``), creative metrics and the report writer (``report``), the truthfulness of headlines (``truthfulness``). See
docs/generate.md, "adbatch eval". Members load at first access (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adbatch.lazy import lazy_members

#: public name -> the submodule that defines it (imported at first access)
_LAZY = {
    "HomeDepotConfig": "datasets", "load_home_depot": "datasets", "load_slogan_test": "datasets",
    "QuerySplit": "datasets",
    "ranking_metrics": "metrics", "RankingReport": "metrics",
    "evaluate_targeting": "targeting", "generative_ranker": "targeting", "minilm_faiss_baseline": "targeting",
    "creative_quality": "report", "write_report": "report",
    "check_headline": "truthfulness", "truthfulness": "truthfulness",
}

if TYPE_CHECKING:
    from adbatch.eval.datasets import HomeDepotConfig, QuerySplit, load_home_depot, load_slogan_test
    from adbatch.eval.metrics import RankingReport, ranking_metrics
    from adbatch.eval.report import creative_quality, write_report
    from adbatch.eval.truthfulness import check_headline, truthfulness
    from adbatch.eval.targeting import evaluate_targeting, generative_ranker, minilm_faiss_baseline

__getattr__ = lazy_members(__name__, _LAZY)

__all__ = sorted(_LAZY)
