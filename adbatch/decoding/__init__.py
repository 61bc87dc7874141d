"""Decoding: trie-constrained batched beam search with prefix-tree parallel verification
(targeting) and free-text generation (creatives). See docs/decoding.md.

The configs import without torch: a generate job's driver validates them and hands them to its
actors, and never decodes itself (importing torch + triton there cost it seconds of start-up). The
verbs load their modules on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adbatch.decoding.config import (CreativeConfig, CreativeStrategy, DenseScoring, FusionMode, LinearFormats,
                                     TargetSearchConfig, VerifyMode)
from adbatch.lazy import lazy_members

#: public name -> the submodule that defines it (imported at first access)
_LAZY = {
    "SearchStats": "beam_search", "TargetSearchResult": "beam_search", "search_targets": "beam_search",
    "DenseCandidates": "beam_search", "ScoreStats": "beam_search", "score_targets": "beam_search",
    "CostModel": "cost_model", "calibrate": "cost_model", "load_or_calibrate": "cost_model",
    "generate_creatives": "creative",
}

if TYPE_CHECKING:
    from adbatch.decoding.beam_search import (DenseCandidates, ScoreStats, SearchStats, TargetSearchResult, score_targets,
                                              search_targets)
    from adbatch.decoding.cost_model import CostModel, calibrate, load_or_calibrate
    from adbatch.decoding.creative import generate_creatives

__getattr__ = lazy_members(__name__, _LAZY)

__all__ = [
    "CostModel", "CreativeConfig", "DenseCandidates", "DenseScoring", "FusionMode", "CreativeStrategy", "LinearFormats", "ScoreStats", "SearchStats",
    "TargetSearchConfig", "TargetSearchResult", "VerifyMode", "calibrate", "generate_creatives", "load_or_calibrate",
    "score_targets", "search_targets",
]
