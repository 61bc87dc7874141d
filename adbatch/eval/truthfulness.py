"""Truthfulness of a creative: does the headline name what its ad never said, and keep the ad's name right?

Issue 57: a headline that names another company, a place or a number the ad never mentioned cannot be
published (Jin et al. 2021, the slogan data's paper, report the same failure: "false facts", above all other
companies' names). This module is the deterministic, dictionary-based measure of it; :func:`check_headline`
judges one headline against its ad's own fields, :func:`truthfulness` averages over a set.

**The ad's own fields** (its *support*): the text of every :data:`AD_TEXT_FIELDS` value of the ad
(advertiser, title, description, industry, category, keywords, url), as lower-case words (``[A-Za-z0-9]``
runs, possessive ``'s`` dropped), plus every two or three adjacent words written together ("Mann Corp"
supports "MannCorp"; "e-liquid" supports "eLiquid"; "elscience.co.uk" supports "elscience"). A headline
word is *supported* when its lower-case form, that form without a plural ``s`` / ``es``, or with one, is in the support.

**Entities a headline names** (each found word is one entity; :class:`EntityKind`):

- ``number``: a word with a digit ("100%", "24/7", "1998", "3D"); supported when its digits, commas
  dropped, are one of the digit runs of the fields.
- ``name``: a capitalised word (first letter upper case), an acronym (two or more letters, all upper
  case; in a headline written all in capitals acronyms are not told apart and only the dictionary rule
  applies) or a word with an inner capital ("MannCorp"), that is not a common English word
  (:func:`common_words`: the lower-case entries of SCOWL's ``american-english`` and ``british-english``
  word lists, 65,407 words, plus :data:`EXTRA_COMMON_WORDS`). Title Case is how headlines are written, so capitals alone
  tell nothing; "Planet" is a word, "Toronto", "Nabiz" and "UAE" are names. Single letters are not names.
- ``changed_name``: a word of the ad's name (the ``advertiser`` field) changed where the headline uses the
  name: the name's word written with another ending next to the rest of the name ("Ag Printer" for Ag
  Printers); a capitalised unsupported word in the place where the name has another word -- before a
  distinctive name word or run ("Smart Options Group" for Financial Options Group), after one only when
  it is no common word; a word that is no common word and within a small edit distance of a name word
  ("Nabiz" for nbiz). Beside a name word that is a common English word, only the word before the name's
  *last* word is checked (the brand replaced before its type), and only a name-like or alliterative
  substitute counts ("Grasshopper Travels" for Gala Travels, "Graphene Solar" for GP Solar; not "Ethical
  Yarn" for Darn Good Yarn); elsewhere a common name word alone ("Financial" of Financial Options Group)
  is not a use of the name, nor is a common name word written in lower case ("Material handling systems"
  for Automated Materials Handling); punctuation between two words parts them ("San Marcos, Texas" changes
  nothing of San Marcos Toyota) unless the ad's name is written with it. Function words and single letters
  are never changed name words.

A headline *invents* when it names at least one unsupported entity (a changed name word is never
supported). It *uses the ad's name* when it contains the name or a word of it that is distinctive (not a
common word; or the name is one word; or two or more name words in a row), or changes it; it keeps the
name *right* when it uses it and changes none of its words (case, spaces and a possessive are free:
"MannCorp's" for Manncorp, "Brand Premiums" for Brandpremiums).

What the measure misses, by construction: invented names made of common words ("Dot-Com Pros", "Business
Insider"), claims in lower-case words ("eco-friendly"). What it flags that a reader might accept: a
capitalised word the dictionary lacks that is no name ("Wellness" is in :data:`EXTRA_COMMON_WORDS` for
that reason), and an adjective capitalised before a multi-word name's last word ("Affordable Travels" for
Gala Travels: it reads as another company's name, so it counts).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import gzip
import re
from importlib import resources
from typing import Any, Iterable, Mapping, Sequence

#: the ad fields a headline may take its entities from (the creative prompt's fields, and the url)
AD_TEXT_FIELDS = ("advertiser", "title", "description", "industry", "category", "keywords", "url")

#: common words the 2020 SCOWL list lacks (modern or trade words ads use), counted as common
EXTRA_COMMON_WORDS = frozenset("""
app apps blockchain cyber ecommerce email emails fintech online website websites wellness sanitizer sanitizers
smartphone smartphones startup startups skincare healthcare eco wifi covid webinar webinars
pre non multi anti bio mid self post sub
""".split())

#: function words: never a changed word of a name ("10to8: A plan" does not rename 10to8 Appointment)
_FUNCTION = frozenset("a an the to for in on at by of with from your our my you we is are and or".split())
#: words that join a name's words ("Smith & Sons", "School of Art"): skipped when aligning a name
_CONNECTORS = frozenset({"and", "of", "the", "for", "de", "la", "von", "van"})

_BREAK = re.compile(r"[,;:.!?|()\[\]–—]")
_WORD = re.compile(r"[A-Za-z0-9]+(?:[&'’][A-Za-z0-9]+)*")
_DIGITS = re.compile(r"\d[\d,]*")


class EntityKind(str, enum.Enum):
    """What an unsupported entity of a headline is (see the module docstring)."""

    NUMBER = "number"
    NAME = "name"
    CHANGED_NAME = "changed_name"


@dataclasses.dataclass(frozen=True)
class Entity:
    """One word of a headline the ad's fields do not support: its text as written and its kind."""

    text: str
    kind: EntityKind


@dataclasses.dataclass(frozen=True)
class HeadlineTruth:
    """:func:`check_headline`'s verdict. ``invented``: the unsupported entities, in headline order;
    ``uses_name``: the headline uses the ad's name; ``name_right``: it uses it unchanged (None when it
    does not use it)."""

    invented: tuple[Entity, ...]
    uses_name: bool
    name_right: bool | None

    @property
    def invents(self) -> bool:
        return bool(self.invented)


@functools.lru_cache(maxsize=1)
def common_words() -> frozenset[str]:
    """The common English words (lower case): the lower-case, letters-only entries of SCOWL's
    ``american-english`` and ``british-english`` lists (Debian ``wamerican`` / ``wbritish`` 2020.12.07;
    adbatch/eval/data/SOURCE.md), and
    :data:`EXTRA_COMMON_WORDS`. Loaded once per process."""
    data = resources.files("adbatch.eval").joinpath("data/common_words_en.txt.gz").read_bytes()
    return frozenset(gzip.decompress(data).decode("utf-8").split()) | EXTRA_COMMON_WORDS


def _strip_possessive(word: str) -> str:
    return re.sub(r"['’]s$", "", word)


def _words(text: str) -> list[str]:
    """Words of ``text`` as written (possessive ``'s`` dropped)."""
    return [_strip_possessive(w) for w in _WORD.findall(text)]


def _variants(low: str) -> tuple[str, ...]:
    """``low`` and its forms without a plural ending."""
    out = [low]
    if len(low) > 3 and low.endswith("es"):
        out.append(low[:-2])
    if len(low) > 2 and low.endswith("s"):
        out.append(low[:-1])
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Support:
    words: frozenset[str]
    digits: frozenset[str]
    name: tuple[str, ...]  # the advertiser's words, lower case, connectors dropped

    def has(self, low: str) -> bool:
        """``low`` or its singular is a word of the fields, or ``low`` is the singular of one ("cruise" of cruises)."""
        return any(v in self.words for v in (*_variants(low), low + "s", low + "es"))


def _support(ad: Mapping[str, Any], fields: Sequence[str]) -> _Support:
    texts = [str(ad[k]) for k in fields if ad.get(k) is not None and str(ad[k]).strip()]
    words: set[str] = set()
    digits: set[str] = set()
    for text in texts:
        low = [w.lower() for w in _words(text)]
        words.update(low)
        for n in (2, 3):
            words.update("".join(low[i:i + n]) for i in range(len(low) - n + 1))
        digits.update(d.replace(",", "") for d in _DIGITS.findall(text))
    name = tuple(w.lower() for w in _words(str(ad.get("advertiser") or "")) if w.lower() not in _CONNECTORS)
    return _Support(frozenset(words), frozenset(digits), name)


def _capitalised(word: str) -> bool:
    return word[:1].isupper()


def _name_like(word: str, shouting: bool, common: frozenset[str]) -> bool:
    """Whether a digit-free headline word looks like a name (the module docstring's ``name`` rule)."""
    if len(word) < 2 or not any(c.isupper() for c in word):
        return False
    if not shouting and (word.isupper() or re.search(r"[a-z][A-Z]", word)):
        return True  # an acronym, or an inner capital
    low = re.split(r"['’]", word.lower())[0]  # a contraction by its first part: "Can't", "You'll"
    return _capitalised(word) and not any(v in common for v in _variants(low))


def name_like_words(text: str) -> list[str]:
    """The words of ``text`` (possessive dropped, in order, repeats kept) that the ``name`` rule calls names."""
    common = common_words()
    return [w for w in _words(text) if not any(c.isdigit() for c in w) and _name_like(w, False, common)]


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _near_name(low: str, name: Sequence[str], common: frozenset[str]) -> bool:
    """A distinctive word within a small edit distance of a name word (not equal to one)."""
    if len(low) < 4 or low in common or low in name:
        return False
    return any(len(n) >= 3 and 0 < _edit_distance(low, n) <= max(1, min(len(low), len(n)) // 4) for n in name)


def check_headline(headline: str, ad: Mapping[str, Any], fields: Sequence[str] = AD_TEXT_FIELDS) -> HeadlineTruth:
    """Judge one headline against its ad's own ``fields`` (see the module docstring for every rule)."""
    common = common_words()
    sup = _support(ad, fields)
    spans = list(_WORD.finditer(headline))
    raw = [m.group(0) for m in spans]
    words = [_strip_possessive(w) for w in raw]
    # punctuation between two words parts them, unless the ad's name itself is written with it ("Benson, Pantello")
    name_punct = bool(_BREAK.search(str(ad.get("advertiser") or "")))
    parted = [not name_punct and bool(_BREAK.search(headline[a.end():b.start()])) for a, b in zip(spans, spans[1:])]
    lows = [w.lower() for w in words]
    letters = [w for w in words if any(c.isalpha() for c in w)]
    shouting = len(letters) >= 2 and all(not any(c.islower() for c in w) for w in letters)
    name, name_set = sup.name, set(sup.name)
    joined_name = "".join(name)
    found: dict[int, Entity] = {}

    # -- the ad's name: exact hits (a name word, or name words written together), then changes around them
    # a common word of the name counts only capitalised ("handling" in "Material handling systems" is no name)
    hit = [(lo in name_set and (lo not in common or _capitalised(w))) or (len(lo) >= 4 and lo == joined_name)
           for w, lo in zip(words, lows)]
    for i in range(len(lows) - 1):  # "Brand Premiums" for Brandpremiums
        if joined_name and lows[i] + lows[i + 1] == joined_name:
            hit[i] = hit[i + 1] = True
    uses = False
    for i, lo in enumerate(lows):
        if not hit[i]:
            continue
        run = (i > 0 and hit[i - 1]) or (i + 1 < len(lows) and hit[i + 1])
        distinctive = len(name) == 1 or lo not in common or run or lo == joined_name
        uses = uses or distinctive
        if lo not in name_set:
            continue
        j = name.index(lo)
        # the neighbours where the name has another word: before it (any name word, or the last one's
        # brand word), after it (a distinctive name word only)
        sides = []
        if i > 0 and j > 0 and not parted[i - 1]:
            sides.append((i - 1, name[j - 1]))
        if i + 1 < len(lows) and j + 1 < len(name) and not parted[i]:
            sides.append((i + 1, name[j + 1]))
        for k, expected in sides:
            w, lk = words[k], lows[k]
            if (hit[k] or lk == expected or lk in _CONNECTORS or lk in _FUNCTION or len(lk) < 2 or not _capitalised(w)
                    or any(c.isdigit() for c in w)):
                continue
            if expected in _variants(lk) or lk in _variants(expected):
                changed = True  # "Ag Printer" for Ag Printers
            elif sup.has(lk) or not (distinctive or (k < i and j == len(name) - 1)):
                changed = False
            elif k < i:  # before the name's word: any word beside a distinctive hit; beside a common last
                # word only a name-like or alliterative one ("Grasshopper Travels" for Gala Travels)
                changed = distinctive or lk not in common or lk[0] == expected[0]
            else:  # after it: only a word that is no common word ("Nabiz Inc" is not caught here)
                changed = lk not in common
            if changed:
                found[k] = Entity(raw[k], EntityKind.CHANGED_NAME)
    for i, lo in enumerate(lows):
        if not hit[i] and i not in found and _capitalised(words[i]) and _near_name(lo, name, common):
            found[i] = Entity(raw[i], EntityKind.CHANGED_NAME)  # "Nabiz" for nbiz
    uses = uses or bool(found)
    name_right = (not found) if uses else None

    # -- numbers and names the fields do not support
    for i, (w, lo) in enumerate(zip(words, lows)):
        if i in found or hit[i]:
            continue
        if any(c.isdigit() for c in w):
            if not all(d.replace(",", "") in sup.digits for d in _DIGITS.findall(w)) and not sup.has(lo):
                found[i] = Entity(raw[i], EntityKind.NUMBER)
        elif _name_like(w, shouting, common) and not sup.has(lo):
            found[i] = Entity(raw[i], EntityKind.NAME)
    return HeadlineTruth(tuple(found[i] for i in sorted(found)), uses, name_right)


def grounding(headline: str, ad: Mapping[str, Any], fields: Sequence[str] = AD_TEXT_FIELDS) -> tuple[int, int]:
    """``(supported, content)``: how many of ``headline``'s content words (three or more characters, no function
    word) the ad's own ``fields`` support (the module docstring's *supported*), of how many. A headline of two or
    more content words none of which its ad supports is about something else ("Grasshopper Tents for a Greener
    Future" for a travel agent): an invented name made of common words, or a slogan that fits any ad."""
    sup = _support(ad, fields)
    content = [w.lower() for w in _words(headline) if len(w) >= 3 and w.lower() not in _FUNCTION]
    return sum(sup.has(w) for w in content), len(content)


def truthfulness(headlines: Sequence[str], ads: Sequence[Mapping[str, Any]],
                 fields: Sequence[str] = AD_TEXT_FIELDS) -> dict[str, float | None]:
    """Over a set of headlines (``headlines[i]`` written for ``ads[i]``):

    - ``invented_share``: the share that name at least one entity absent from their ad's fields;
    - ``name_use_share``: the share that use the ad's name;
    - ``name_right_share``: of those, the share that keep it right (None when none uses it).

    Empty headlines count in the denominator of ``invented_share`` (they invent nothing)."""
    if len(headlines) != len(ads):
        raise ValueError(f"{len(headlines)} headlines vs {len(ads)} ads")
    verdicts = [check_headline(h, a, fields) for h, a in zip(headlines, ads)]
    n = len(verdicts)
    users = [v for v in verdicts if v.uses_name]
    return {"invented_share": sum(v.invents for v in verdicts) / n if n else 0.0,
            "name_use_share": len(users) / n if n else 0.0,
            "name_right_share": sum(bool(v.name_right) for v in users) / len(users) if users else None}


def invented_entities(headlines: Iterable[str], ads: Iterable[Mapping[str, Any]]) -> list[tuple[Entity, ...]]:
    """The unsupported entities of each headline (for a sample table or a flag's detail)."""
    return [check_headline(h, a).invented for h, a in zip(headlines, ads)]
