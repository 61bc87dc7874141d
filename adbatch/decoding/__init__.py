"""Decoding: trie-constrained batched beam search with prefix-tree parallel verification
(targeting) and free-text generation (creatives). See docs/decoding.md."""

from adbatch.decoding.beam_search import TargetSearchResult, search_targets
from adbatch.decoding.config import CreativeConfig, CreativeStrategy, TargetSearchConfig, VerifyMode
from adbatch.decoding.cost_model import CostModel, calibrate, load_or_calibrate
from adbatch.decoding.creative import generate_creatives

__all__ = [
    "CostModel", "CreativeConfig", "CreativeStrategy", "TargetSearchConfig", "TargetSearchResult",
    "VerifyMode", "calibrate", "generate_creatives", "load_or_calibrate", "search_targets",
]
