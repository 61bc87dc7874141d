"""Pseudo-queries for ads that no labelled query mentions: short word spans of the ad's own text.

Search queries on a product catalogue are mostly a few words that also occur in the relevant
title ("angle bracket", "deck over", "2x4 hanger"), while the indexing example shows the model the
whole title. Training only on whole titles teaches a copy task that does not transfer to 2-4-word
queries (measured: the model memorises its train pairs and generalises poorly, see
bench/results/train.md). Sampling contiguous spans of 1..``max_words`` words from the title gives
every ad query-shaped inputs pointing at it, which is the role docT5query-style generated queries
play in DSI-QG / NCI. Spans are cheaper than generating with the creative model (no GPU pass over
the corpus) and are what we measure; generated queries are not implemented.

Two augmentations move the inputs closer to real search terms (on by default, as part of the best
measured recipe, see bench/RESULTS.md): ``subset_share`` draws that share of the pseudo-queries as *ordered
word subsets* instead of contiguous spans (queries often pair a brand or size with the product noun:
"behr deck stain" for "BEHR Premium 1 gal. Deck Stain"), and ``typo_rate`` gives that share of them
one character edit in a word of 4+ letters (a deletion, a doubled letter or two swapped neighbours;
labelled queries carry such typos: "toliet", "couplingg").

Spans are drawn per ad with a ``numpy`` generator seeded from ``(seed, row)``, so the same ad gets
the same pseudo-queries whatever the order or sharding of the corpus (a re-run is identical).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from adbatch.config import ConfigBase, ConfigError

#: a "word" of a product title: letters/digits with inner dots, slashes, dashes or 'x' (2x4, 3/4, 1.5)
_WORD = re.compile(r"[0-9a-z]+(?:[./\-][0-9a-z]+)*")


@dataclasses.dataclass
class PseudoQueryConfig(ConfigBase):
    """How many span pseudo-queries each ad gets and how long they are."""

    # 24 with subsets 0.5 + typos 0.1: the best measured on Home Depot (test recall@10 0.575 at 6 epochs with
    # labelled queries x4, vs 0.571 at 32 spans/ad, 0.511 at 16 without the repeat, 0.43-0.45 at 8;
    # bench/results/train.md, rounds 2-4)
    per_ad: int = dataclasses.field(default=24, metadata={"help": "span pseudo-queries per ad (0 = off)"})
    min_words: int = dataclasses.field(default=1, metadata={"help": "shortest span, in words"})
    max_words: int = dataclasses.field(default=4, metadata={"help": "longest span, in words"})
    subset_share: float = dataclasses.field(
        default=0.5, metadata={"help": "share drawn as ordered non-contiguous word subsets instead of spans"})
    typo_rate: float = dataclasses.field(default=0.1, metadata={"help": "share given one character edit"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the span sampling"})

    def validate(self) -> None:
        for name in ("subset_share", "typo_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"PseudoQueryConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.per_ad < 0:
            raise ConfigError(f"PseudoQueryConfig.per_ad must be >= 0, got {self.per_ad}")
        if not 1 <= self.min_words <= self.max_words:
            raise ConfigError(f"PseudoQueryConfig needs 1 <= min_words <= max_words, got "
                              f"{self.min_words}..{self.max_words}")


def title_words(text: str) -> list[str]:
    """Lower-cased words of ``text`` (punctuation dropped; ``2x4``, ``3/4``, ``1.5`` kept whole)."""
    return _WORD.findall(text.lower())


def span_pseudo_queries(texts: Sequence[str], config: PseudoQueryConfig) -> list[tuple[str, int]]:
    """Up to ``config.per_ad`` distinct word spans of each text, as ``(query, row)`` pairs.

    ``row`` is the text's position in ``texts``. A span never equals the whole text when the text
    has more words than ``max_words`` allows (that case is the indexing example already). Texts with
    no word yield nothing; short texts yield fewer than ``per_ad`` (only distinct spans are kept).
    """
    config.validate()
    out: list[tuple[str, int]] = []
    if config.per_ad == 0:
        return out
    for row, text in enumerate(texts):
        words = title_words(text or "")
        n = len(words)
        if n == 0:
            continue
        rng = np.random.default_rng((config.seed, row))
        hi = min(config.max_words, n)
        lo = min(config.min_words, hi)
        seen: set[str] = set()
        # a few extra draws: duplicates are dropped, and tiny titles have few distinct spans
        for _ in range(config.per_ad * 3):
            length = int(rng.integers(lo, hi + 1))
            if config.subset_share > 0 and rng.random() < config.subset_share:
                picked = np.sort(rng.choice(n, size=length, replace=False))
                chosen = [words[i] for i in picked]
            else:
                start = int(rng.integers(0, n - length + 1))
                chosen = words[start:start + length]
            if config.typo_rate > 0 and rng.random() < config.typo_rate:
                chosen = _with_typo(chosen, rng)
            span = " ".join(chosen)
            if span not in seen:
                seen.add(span)
                out.append((span, row))
                if len(seen) == config.per_ad:
                    break
    return out


def _with_typo(words: list[str], rng: np.random.Generator) -> list[str]:
    """``words`` with one character edit in a random alphabetic word of 4+ letters (unchanged if none)."""
    candidates = [i for i, w in enumerate(words) if len(w) >= 4 and w.isalpha()]
    if not candidates:
        return words
    i = candidates[int(rng.integers(len(candidates)))]
    w = words[i]
    j = int(rng.integers(1, len(w) - 1))  # keep the first letter: typos there are rare in search logs
    kind = int(rng.integers(3))
    if kind == 0:
        w = w[:j] + w[j + 1:]  # deletion
    elif kind == 1:
        w = w[:j] + w[j] + w[j:]  # doubled letter
    else:
        w = w[:j] + w[j + 1] + w[j] + w[j + 2:]  # swapped neighbours
    return [*words[:i], w, *words[i + 1:]]
