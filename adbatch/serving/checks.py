"""Checks a generated headline must pass before it is written unflagged, and the choice among candidates
(issue 57 item 3).

:func:`creative_flags` judges one headline (its text, after placeholders are restored) against its ad's own
fields and the prompt text the model read; each failed check is one :class:`CreativeFlag`:

- ``invented_entity``: it names a number, name or place absent from the ad's fields
  (:func:`adbatch.eval.truthfulness.check_headline`; 21.7 % of the base model's few-shot headlines on
  every 4th row of the slogan test set, 16.6 % of its human references by this measure -- docs/generate.md);
- ``name_changed``: it uses the ad's name with a word changed ("Grasshopper Travels" for Gala Travels);
- ``echo``: it reproduces the prompt (:func:`adbatch.eval.report.prompt_echo`: a field label such as
  "Advertiser:", the instruction, or half of the prompt's words in one run);
- ``copy``: it copies :data:`COPY_RUN_WORDS` or more consecutive words verbatim from the ad's fields (a
  sentence of the description, not a headline; 3.9 % of the slogan test set's human headlines do);
- ``length``: no word, or more than :data:`MAX_WORDS` words (the prompt asks for at most 10; the longest
  human headline of the slogan test set has 10);
- ``repetition``: the same word twice in a row, a word pair twice, or a word of three or more letters that
  is no function word three times ("Business Insider Business Business");
- ``placeholder``: a masking placeholder (``<company>``, ``<ent3>``) left that the ad has no text for;
- ``unfinished``: it stops mid-phrase -- its last word is a connector or function word (:data:`_OPEN_ENDINGS`;
  not written in capitals: "Guelph, ON" is a place) or it ends in a hyphen, comma, ampersand, colon, slash or
  an open bracket: the decoder's token cap (``max_new_tokens``) cut it ("... for the lowest prices and on",
  "Eco-Solvent, Hand-Sanitizers, Disinfectants-" in the example at 16 tokens); 1 of the slogan test set's 994
  human headlines ends that way ("... to do business with");
- ``off_topic``: two or more content words and not one of them in the ad's fields
  (:func:`adbatch.eval.truthfulness.grounding`): the invented names the entity rule cannot see because they are
  made of common words ("Grasshopper Tents for a Greener Future" for Gala Travels, a travel agent), and slogans
  that would fit any ad. 10.6 % (105) of the slogan test set's 994 human headlines share no word with their ad this way
  (a reviewer's call, not a defect): with several candidates the checks pick a grounded one; one written flagged
  asks for review.

:func:`choose` keeps, per ad, the best candidates that pass every check (by the decoder's score), and fills
with the best failing ones, flagged, when fewer pass than are wanted: a request is never dropped for its
headlines and a failing headline is never written unflagged.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Mapping, Sequence

#: bumped whenever a check's rule changes: the generate stage's run key includes it (a resumed run never
#: keeps partitions checked by other rules)
CHECKS_VERSION = 2
#: a run of this many words copied verbatim from the ad's fields flags a headline as a copy
COPY_RUN_WORDS = 6
#: more words than this flag a headline's length
MAX_WORDS = 12

_FUNCTION = frozenset("a an the to for in on at by of with from your our my you we is are and or it its".split())
#: last words that leave a headline open (a phrase the token cap cut): connectors, articles, prepositions, possessives
_OPEN_ENDINGS = frozenset("a an the to for in on at by of with from and or & your our my".split())
_OPEN_PUNCT = re.compile(r"[-,&:/(]\s*$")


class CreativeFlag(str, enum.Enum):
    """A check a headline failed (the creatives Parquet's ``flags`` values)."""

    INVENTED_ENTITY = "invented_entity"
    NAME_CHANGED = "name_changed"
    ECHO = "echo"
    COPY = "copy"
    LENGTH = "length"
    REPETITION = "repetition"
    PLACEHOLDER = "placeholder"
    UNFINISHED = "unfinished"
    OFF_TOPIC = "off_topic"


def _repeats(words: Sequence[str]) -> bool:
    if any(a == b for a, b in zip(words, words[1:])):
        return True
    pairs = list(zip(words, words[1:]))
    if len(set(pairs)) < len(pairs):
        return True
    counts: dict[str, int] = {}
    for w in words:
        if len(w) >= 3 and w not in _FUNCTION:
            counts[w] = counts.get(w, 0) + 1
    return any(c >= 3 for c in counts.values())


def _unfinished(headline: str) -> bool:
    """Whether ``headline`` stops mid-phrase (the ``unfinished`` rule of the module docstring)."""
    if _OPEN_PUNCT.search(headline):
        return True
    last = re.findall(r"[A-Za-z&']+", headline)[-1:]
    return bool(last) and last[0].lower() in _OPEN_ENDINGS and not (len(last[0]) > 1 and last[0].isupper())


def creative_flags(headline: str, ad: Mapping[str, Any], prompt_text: str) -> list[CreativeFlag]:
    """The checks ``headline`` fails against ``ad`` (its own fields, unmasked) and ``prompt_text`` (what the
    model read, e.g. :func:`adbatch.serving.prompts.creative_prompt_text`), in :class:`CreativeFlag` order;
    empty when it passes all."""
    from adbatch.eval.report import _tokens, prompt_copy_fraction, prompt_echo
    from adbatch.eval.truthfulness import EntityKind, check_headline, grounding
    from adbatch.serving.delex import SLOT_PATTERN
    from adbatch.serving.prompts import render_ad_fields

    flags: set[CreativeFlag] = set()
    words = _tokens(headline)
    truth = check_headline(headline, ad)
    if any(e.kind is not EntityKind.CHANGED_NAME for e in truth.invented):
        flags.add(CreativeFlag.INVENTED_ENTITY)
    if truth.name_right is False:
        flags.add(CreativeFlag.NAME_CHANGED)
    if words and prompt_echo(headline, prompt_text):
        flags.add(CreativeFlag.ECHO)
    if round(prompt_copy_fraction(headline, render_ad_fields(ad, None)) * len(words)) >= COPY_RUN_WORDS:
        flags.add(CreativeFlag.COPY)
    if not words or len(words) > MAX_WORDS:
        flags.add(CreativeFlag.LENGTH)
    if _repeats(words):
        flags.add(CreativeFlag.REPETITION)
    if SLOT_PATTERN.search(headline):
        flags.add(CreativeFlag.PLACEHOLDER)
    if words and _unfinished(headline):
        flags.add(CreativeFlag.UNFINISHED)
    supported, content = grounding(headline, ad)
    if content >= 2 and not supported:
        flags.add(CreativeFlag.OFF_TOPIC)
    return [f for f in CreativeFlag if f in flags]


def choose(candidates: Sequence[tuple[str, float]], flags: Sequence[Sequence[CreativeFlag]], n: int) -> list[int]:
    """Indices of the ``n`` candidates to write, best first: those with no flag by descending score, then
    (only when fewer than ``n`` pass) the failing ones by fewest flags, then score. ``candidates``:
    ``(text, score)``; ``flags[i]``: candidate ``i``'s failed checks."""
    if len(candidates) != len(flags):
        raise ValueError(f"{len(candidates)} candidates vs {len(flags)} flag lists")
    order = sorted(range(len(candidates)), key=lambda i: (len(flags[i]) > 0, len(flags[i]), -candidates[i][1], i))
    return order[:n]
