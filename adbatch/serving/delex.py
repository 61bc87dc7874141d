"""Delexicalisation (entity masking) of creative inputs and headlines, and its restoration (issue 57 item 2).

Jin et al. 2021 (the slogan data's paper): a plainly fine-tuned model learns to write *other* companies'
names and places into headlines; replacing the company name (and the input's entities) by placeholders in
the training pairs, and putting them back in the output, removes that failure and lifts ROUGE. Here:

- :func:`delexicalise` masks one ad's fields: the ``advertiser`` field becomes :data:`COMPANY_SLOT`, and so
  does every whole-word, case-insensitive occurrence of it in the other fields (the slogan data's
  descriptions already write ``<company>`` there: the same placeholder). With :attr:`DelexMode.ENTITIES`, every
  name-like word of the other fields (:func:`adbatch.eval.truthfulness.check_headline`'s ``name`` rule: a
  capitalised word that is no common English word, an acronym, a word with an inner capital) becomes
  ``<ent1>``, ``<ent2>``, ... in order of first appearance (whole word, case-sensitive: "IT" is not "it"),
  at most :data:`MAX_ENTITY_SLOTS`. Numbers stay as written.
- :func:`mask_text` masks a headline with the same slots (the training target: the model learns to write
  ``<company>`` where the human wrote the name, ``<ent2>`` where they wrote "Toronto").
- :func:`restore` puts the slots' texts back into a generated headline. The company slot is restored as the
  name is written in the ad's other fields (its first occurrence there, so "gp solar" reads "GP Solar" when
  the description writes it so), else as the ``advertiser`` field. A placeholder the ad has no text for
  stays in the text, where the generation checks flag it (:mod:`adbatch.serving.checks`).

A model fine-tuned on masked pairs declares it (:func:`declare_delex`, in its config.json beside the creative
prompt it learned); the creatives generator masks its prompts and restores its headlines exactly when the
model declares it (:func:`delex_of`), so a model is never fed a rendering it was not trained on.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Mapping

COMPANY_SLOT = "<company>"
#: the most entity slots one ad gets (a long description's later names stay as written)
MAX_ENTITY_SLOTS = 8
#: any placeholder this module writes: what :func:`restore` resolves and the checks look for
SLOT_PATTERN = re.compile(r"<(?:company|ent\d+)>")
#: the ``model.config`` attribute where a fine-tuned model declares the masking it learned: ``{"mode", "version"}``
DELEX_ATTR = "adbatch_creative_delex"
#: bumped when the masking rules change: a model trained on one version's masks must be trained again
DELEX_VERSION = 1


class DelexMode(str, enum.Enum):
    """What is masked in a creative fine-tune's pairs (and so in the prompts of the model it trains)."""

    OFF = "off"  #: nothing: the ad's text as written
    COMPANY = "company"  #: the advertiser's name -> ``<company>``
    ENTITIES = "entities"  #: the name, and the name-like words of the other fields -> ``<ent1>``, ...


class DelexMismatchError(ValueError):
    """A model declares a masking version this code does not write."""


@dataclasses.dataclass(frozen=True)
class Delexicalised:
    """One ad's masked fields and the slots: placeholder -> the text it stands for."""

    fields: dict[str, str]
    slots: dict[str, str]


def _pattern(text: str, ignore_case: bool) -> re.Pattern[str]:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(text)}(?![A-Za-z0-9])", re.IGNORECASE if ignore_case else 0)


def delexicalise(ad: Mapping[str, Any], mode: DelexMode | str) -> Delexicalised:
    """``ad``'s non-empty string fields, masked per ``mode`` (see the module docstring), and the slots."""
    mode = DelexMode(mode)
    fields = {k: str(v) for k, v in ad.items() if isinstance(v, str) and v.strip()}
    slots: dict[str, str] = {}
    if mode is DelexMode.OFF:
        return Delexicalised(fields, slots)
    name = " ".join(fields.get("advertiser", "").split())
    if name:
        pat = _pattern(name, True)
        others = [v for k, v in fields.items() if k != "advertiser"]
        shown = next((m.group(0) for v in others for m in [pat.search(v)] if m), name)
        slots[COMPANY_SLOT] = shown
        fields = {k: (COMPANY_SLOT if k == "advertiser" else pat.sub(COMPANY_SLOT, v)) for k, v in fields.items()}
    if mode is DelexMode.ENTITIES:
        from adbatch.eval.truthfulness import name_like_words

        order: list[str] = []
        for k, v in fields.items():
            if k != "advertiser":
                order += [w for w in name_like_words(SLOT_PATTERN.sub(" ", v)) if w not in order]
        for i, w in enumerate(order[:MAX_ENTITY_SLOTS], 1):
            slot = f"<ent{i}>"
            slots[slot] = w
            pat = _pattern(w, False)
            fields = {k: (v if k == "advertiser" else pat.sub(slot, v)) for k, v in fields.items()}
    return Delexicalised(fields, slots)


def mask_text(text: str, slots: Mapping[str, str]) -> str:
    """``text`` (a headline) with each slot's text replaced by its placeholder: the company name
    case-insensitively, entities case-sensitively, whole words only; longer texts first."""
    for slot, orig in sorted(slots.items(), key=lambda kv: -len(kv[1])):
        text = _pattern(orig, slot == COMPANY_SLOT).sub(slot, text)
    return text


def restore(text: str, slots: Mapping[str, str]) -> str:
    """``text`` with every placeholder of ``slots`` replaced by its text (others stay as written)."""
    return SLOT_PATTERN.sub(lambda m: slots.get(m.group(0), m.group(0)), text)


def declare_delex(model: Any, mode: DelexMode | str) -> None:
    """Record on ``model.config`` the masking its creative fine-tune learned (nothing for ``off``)."""
    mode = DelexMode(mode)
    if mode is DelexMode.OFF:
        if hasattr(model.config, DELEX_ATTR):
            delattr(model.config, DELEX_ATTR)
        return
    setattr(model.config, DELEX_ATTR, {"mode": mode.value, "version": DELEX_VERSION})


def delex_of(model: Any) -> DelexMode:
    """The masking ``model`` declares (:func:`declare_delex`), else ``off``. Raises
    :class:`DelexMismatchError` for another version of the masking rules."""
    declared = getattr(getattr(model, "config", None), DELEX_ATTR, None)
    if not declared:
        return DelexMode.OFF
    try:
        mode, version = DelexMode(declared["mode"]), int(declared["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DelexMismatchError(f"model config {DELEX_ATTR} = {declared!r} is not {{'mode', 'version'}}") from exc
    if version != DELEX_VERSION:
        raise DelexMismatchError(f"the model learned masking version {version}; this code writes {DELEX_VERSION}: "
                                 "fine-tune it again")
    return mode
