"""Rendering hierarchical codes as token sequences, two schemes behind one interface.

:class:`IdScheme.CODES` — one new special token per (level, index): the code ``(3, 7, 42)`` becomes
``<ad_L0_3><ad_L1_7><ad_L2_42>``. Token strings are listed in (level, index) order in
:attr:`RenderedIds.special_tokens`; token ``i`` of that list has id ``base_vocab_size + i`` once a
tokenizer of ``base_vocab_size`` entries adds them in order. Codes are prefix-free (hierarchical: a
cluster is either split or a leaf; residual: ``rq_levels`` entries, + a counter only on collided
codes), so no EOS is appended: every complete sequence ends at a trie leaf. Residual codes
(``ClusterConfig.method`` residual) render only this way; their ``clusters`` rows are the code
prefixes (level ``l`` node = the first ``l + 1`` codes), labelled with words like any cluster.

:class:`IdScheme.TEXT` — usable zero-shot by an instruct model: each cluster gets a short label
made of its most distinctive words against its siblings (a smoothed log-odds of document frequency
inside the cluster vs inside the sibling clusters), and an ad's sequence is
``"label1 > label2 > ... > ad text"`` followed by EOS. Each segment (``"label1 >"``,
``" label2 >"``, ``" ad text"``) is tokenized on its own, so all ads below a cluster share exactly
the same token prefix. Ad text longer than ``max_text_tokens`` tokens is cut after the last whole
word that fits (:func:`cut_at_word`); a first word longer than the cap alone is cut at the cap, on a
character boundary. Identical sequences are allowed and map (through the trie) to every ad they
denote, but the word cut never makes two ads identical that the plain token cut kept apart: such ads
keep the token cut (:func:`_word_cut_keeping_distinct`).

Cluster labels (both schemes' ``clusters`` table) are whole words: a word is a run of letters with
inner hyphens or apostrophes (``lithium-ion``, ``strong-tie``), stripped of surrounding punctuation;
words holding a digit (``4-pack``), abbreviations (``gal.``, ``ft.``) and unit words right after a
number (``1.28 gpf``, ``15 amp``) are not label words. A label's second and later words must occur
mostly in the same ads as its first (a label names one product group, not two), and a label's
words are written in the order the cluster's titles use them.

:data:`ID_RENDER_VERSION` is recorded in the index manifest; it is bumped whenever the rendering of
sequences or labels changes, so an earlier index is not mixed with this code's rendering.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import re
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from adbatch.index.clustering import Hierarchy
from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)

LABEL_SEPARATOR = " >"
#: version of the sequence / label rendering (recorded in the index manifest as ``id_render_version``).
#: 1: ad text cut at ``max_text_tokens`` tokens (mid-word), labels of regex word pieces ordered by score;
#: 2: text cut at a word boundary, labels of whole words, coherent and in reading order, codes-scheme
#: clusters labelled with words too (their code token in the ``token`` column)
ID_RENDER_VERSION = 2
# a label word: letters, with inner hyphens / apostrophes ("lithium-ion", "o'keeffe")
_LABEL_WORD = re.compile(r"[^\W\d_]+(?:[-'\u2019][^\W\d_]+)*")
_EDGE_PUNCT = "\"'()[]{}<>,;:!?*|/\u201c\u201d\u2018\u2019"
_NUMBER = re.compile(r"^[#(]?[\d.,/-]*\d[\d.,/-]*\)?$")  # "1.28", "5,000", "3/4", "(2)"
_ABBREV_LETTERS = 4  # a word of at most this many letters written with a trailing "." is an abbreviation


class IdScheme(str, enum.Enum):
    """How a code path becomes the token sequence the model decodes (see module docstring)."""

    CODES = "codes"
    TEXT = "text"


@dataclasses.dataclass
class RenderConfig(ConfigBase):
    """Semantic-ID rendering knobs."""

    scheme: IdScheme = dataclasses.field(
        default=IdScheme.TEXT, metadata={"help": "codes: new special tokens; text: labels + ad text"})
    label_terms: int = dataclasses.field(
        default=2, metadata={"help": "words per cluster label (text scheme)"})
    max_text_tokens: int = dataclasses.field(
        default=32, metadata={"help": "ad text tokens kept in a sequence (text scheme)"})
    max_label_vocab: int = dataclasses.field(
        default=50_000, metadata={"help": "most frequent words considered for labels"})

    def validate(self) -> None:
        for name in ("label_terms", "max_text_tokens", "max_label_vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RenderConfig.{name}: must be >= 1")


def check_tokenizer(tokenizer: Any, config: RenderConfig, name: str | None = None) -> None:
    """Refuse a tokenizer the scheme cannot render with: the text scheme ends every sequence with the
    tokenizer's end-of-sequence token. A driver calls it before Ray starts; rendering calls it too."""
    if config.scheme is IdScheme.TEXT and tokenizer.eos_token_id is None:
        raise ConfigError(f"IndexConfig.render.scheme 'text' ends every ad's sequence with an end-of-sequence "
                          f"token, and the tokenizer {name or type(tokenizer).__name__} has none: use "
                          "render.scheme 'codes' or a tokenizer with an EOS token")


@dataclasses.dataclass
class RenderedIds:
    """Token sequences of every ad row.

    ``token_flat int32 [sum(token_len)]`` and ``token_len int32 [N]`` hold the sequences back to
    back; ``texts`` the rendered strings. ``clusters``: one row per cluster with ``path list<int32>``,
    ``size``, ``label`` (its words, both schemes) and ``token`` (codes scheme: its code token; text: null).
    """

    scheme: IdScheme
    token_flat: np.ndarray
    token_len: np.ndarray
    texts: list[str]
    base_vocab_size: int
    special_tokens: list[str]
    eos_token_id: int | None
    clusters: pa.Table

    def sequences(self) -> list[list[int]]:
        offs = np.concatenate([[0], np.cumsum(self.token_len, dtype=np.int64)])
        flat = self.token_flat.tolist()
        return [flat[offs[i]:offs[i + 1]] for i in range(self.token_len.shape[0])]

    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.token_len, dtype=np.int64)])


def special_token(level: int, index: int) -> str:
    return f"<ad_L{level}_{index}>"


def render_ids(hierarchy: Hierarchy, texts: list[str], tokenizer: Any,
               config: RenderConfig | None = None, label_texts: list[str] | None = None,
               fixed_labels: Mapping[tuple[int, ...], str] | None = None,
               keep_tokens: list[str] | None = None) -> RenderedIds:
    """Render every ad's code as a token sequence under ``config.scheme``.

    Args:
        hierarchy: codes of ``N`` ads.
        texts: ``N`` ad texts (the text scheme appends them).
        tokenizer: a Hugging Face tokenizer (its size is ``base_vocab_size``; EOS from it).
        label_texts: ``N`` texts that cluster labels are drawn from (default ``texts``).
        fixed_labels: cluster path -> label kept from an earlier build (text scheme; an incremental
            index keeps its clusters' labels so that unchanged ads keep their sequences).
        keep_tokens: code tokens of an earlier build (codes scheme): they keep their ids (list order)
            and the tokens this build adds come after them, so a model trained on the earlier index
            only has to learn the new rows.
    """
    cfg = config or RenderConfig()
    if len(texts) != hierarchy.num_ads:
        raise ValueError(f"{len(texts)} texts for {hierarchy.num_ads} ads")
    if cfg.scheme is IdScheme.CODES:
        return _render_codes(hierarchy, tokenizer, keep_tokens or [], cfg, label_texts or texts,
                             fixed_labels or {})
    return _render_text(hierarchy, texts, tokenizer, cfg, label_texts or texts, fixed_labels or {})


# ----------------------------------------------------------------------------- codes
def _code_levels(h: Hierarchy) -> np.ndarray:
    """``int64 [sum(code_len)]``: the level of each entry of ``code_flat``."""
    offs = np.concatenate([[0], np.cumsum(h.code_len, dtype=np.int64)])
    return np.arange(offs[-1], dtype=np.int64) - np.repeat(offs[:-1], h.code_len)


def _cluster_nodes(h: Hierarchy) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per cluster level ``l`` (0-based): node id of each ad (-1 if its path is shorter), the
    node's path ``int32 [M_l, l+1]``, and its parent node id at level ``l-1`` (-1 at level 0)."""
    padded = h.padded()
    cluster_depth = h.code_len.astype(np.int64) - 1
    node_of, paths, parents = [], [], []
    for lvl in range(int(cluster_depth.max(initial=0))):
        has = cluster_depth > lvl
        prefix = padded[has, :lvl + 1]
        uniq, inv = np.unique(prefix, axis=0, return_inverse=True)
        ids = np.full(h.num_ads, -1, dtype=np.int64)
        ids[has] = inv.reshape(-1)
        if lvl == 0:
            par = np.full(uniq.shape[0], -1, dtype=np.int64)
        else:
            first = np.zeros(uniq.shape[0], dtype=np.int64)
            first[inv.reshape(-1)] = np.flatnonzero(has)
            par = node_of[lvl - 1][first]
        node_of.append(ids)
        paths.append(uniq.astype(np.int32))
        parents.append(par)
    return node_of, paths, parents


def _render_codes(h: Hierarchy, tokenizer: Any, keep_tokens: list[str], cfg: RenderConfig,
                  label_texts: list[str], fixed_labels: Mapping[tuple[int, ...], str]) -> RenderedIds:
    base = len(tokenizer)
    levels = _code_levels(h)
    num_levels = int(h.code_len.max())
    width = np.zeros(num_levels, dtype=np.int64)
    np.maximum.at(width, levels, h.code_flat.astype(np.int64) + 1)
    level_off = np.concatenate([[0], np.cumsum(width)])
    needed = [special_token(lvl, i) for lvl in range(num_levels) for i in range(int(width[lvl]))]
    # earlier tokens first, at their old ids; this build's new ones appended (without keep_tokens the
    # list is `needed` itself and `slot` the identity)
    kept = set(keep_tokens)
    special = list(keep_tokens) + [t for t in needed if t not in kept]
    position = {t: j for j, t in enumerate(special)}
    slot = np.array([position[t] for t in needed], dtype=np.int64)  # [sum(width)], level_off layout -> list position
    token_flat = (base + slot[level_off[levels] + h.code_flat]).astype(np.int32)
    offs = np.concatenate([[0], np.cumsum(h.code_len, dtype=np.int64)])
    tok_list = token_flat.tolist()
    texts = ["".join(special[t - base] for t in tok_list[offs[i]:offs[i + 1]])
             for i in range(h.num_ads)]
    node_of, paths, parents = _cluster_nodes(h)
    # words for the reader (clusters.parquet); the model decodes the code tokens, never these
    labels = cluster_labels(node_of, paths, parents, label_texts, cfg.label_terms, cfg.max_label_vocab,
                            fixed_labels)
    rows = []
    for lvl, p in enumerate(paths):
        sizes = np.bincount(node_of[lvl][node_of[lvl] >= 0], minlength=p.shape[0])
        for j in range(p.shape[0]):
            rows.append((p[j].tolist(), int(sizes[j]), labels[lvl][j], special_token(lvl, int(p[j, -1]))))
    return RenderedIds(IdScheme.CODES, token_flat, h.code_len.astype(np.int32).copy(), texts, base,
                       special, None, _clusters_table(rows))


def _clusters_table(rows: list[tuple[list[int], int, str, str | None]]) -> pa.Table:
    return pa.table({
        "path": pa.array([r[0] for r in rows], pa.list_(pa.int32())),
        "size": pa.array([r[1] for r in rows], pa.int64()),
        "label": pa.array([r[2] for r in rows], pa.string()),
        "token": pa.array([r[3] for r in rows], pa.string()),
    })


# ----------------------------------------------------------------------------- text
def cut_at_word(text: str, offsets: list[tuple[int, int]], max_tokens: int) -> tuple[int, int]:
    """Where to cut ``text`` (tokenized with character ``offsets``, longer than ``max_tokens``):
    ``(tokens kept, characters kept)``.

    The cut falls after the last whole word that fits in ``max_tokens`` tokens: token ``j`` may end
    the kept part when the character after it is whitespace and no character is shared with the next
    token. A boundary after a word holding a letter or digit is preferred to one after bare
    punctuation (``"Shade -"``). A first word longer than the cap alone is cut at the cap, moved back
    to a character boundary when a token ends inside a character (byte-level tokenizers split
    multi-byte characters), so the kept text is always a prefix of ``text`` made of whole characters.
    """
    assert len(offsets) > max_tokens, f"cut_at_word: {len(offsets)} tokens, not over the cap {max_tokens}"
    fallback = None
    plain = None
    for j in range(max_tokens, 0, -1):
        end, next_start = offsets[j - 1][1], offsets[j][0]
        if next_start < end:  # the next token holds the rest of this character
            continue
        if fallback is None:
            fallback = (j, end)
        if end < len(text) and text[end].isspace() and text[:end].strip():
            word = text[:end].rsplit(None, 1)[-1]
            if any(ch.isalnum() for ch in word):
                return j, end
            if plain is None:
                plain = (j, end)
    if plain is not None:
        return plain
    return fallback if fallback is not None else (max_tokens, offsets[max_tokens - 1][1])


def _offsets_by_decoding(tokenizer: Any, ids: list[int]) -> list[tuple[int, int]]:
    """Character offsets of ``ids`` from decoding growing prefixes (slow tokenizers have no offset map)."""
    out, prev = [], 0
    for j in range(1, len(ids) + 1):
        end = len(tokenizer.decode(ids[:j]).rstrip("\ufffd"))
        out.append((min(prev, end), end))
        prev = end
    return out


def _word_cut_keeping_distinct(prefixes: list[list[int]], text_tokens: list[list[int]],
                               word_cut: Mapping[int, tuple[int, int]], k: int) -> set[int]:
    """Rows whose word cut would give the same sequence as another ad's while their plain
    ``k``-token cuts differ: those rows keep the token cut, so the word cut never merges two ads the
    plain cut kept apart (a row that keeps the token cut can only equal an ad it equalled before)."""
    def word(i: int) -> tuple[int, ...]:
        n = word_cut[i][0] if i in word_cut else len(text_tokens[i])
        return (*prefixes[i], -1, *text_tokens[i][:n])

    def plain(i: int) -> tuple[int, ...]:
        return (*prefixes[i], -1, *text_tokens[i][:k])

    shortened = [i for i, (n, _) in word_cut.items() if n < k]
    if not shortened:
        return set()
    short_keys = {word(i) for i in shortened}
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(text_tokens)):
        key = word(i)
        if key in short_keys:
            groups.setdefault(key, []).append(i)
    keep = set()
    for rows in groups.values():
        if len({plain(i) for i in rows}) > 1:
            keep.update(i for i in rows if i in word_cut)
    return keep


@functools.lru_cache(maxsize=1)
def _stop_words() -> frozenset[str]:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS)


def label_words(text: str) -> list[str]:
    """The label words of ``text`` in reading order, lower-cased (see the module docstring): whole
    whitespace-separated words without digits, abbreviations, unit words after a number or English
    stop words."""
    stop = _stop_words()
    out: list[str] = []
    prev = ""
    for raw in text.split():
        core = raw.strip(_EDGE_PUNCT)
        abbrev = core.endswith(".")
        core = core.rstrip(".").strip(_EDGE_PUNCT).lower()
        after_number = bool(_NUMBER.match(prev))
        prev = raw
        if (len(core) < 2 or not _LABEL_WORD.fullmatch(core) or core in stop
                or (abbrev and len(core) <= _ABBREV_LETTERS) or (after_number and len(core) <= 4)):
            continue
        out.append(core)
    return out


def cluster_labels(node_of: list[np.ndarray], paths: list[np.ndarray], parents: list[np.ndarray],
                   label_texts: list[str], num_terms: int, max_vocab: int,
                   fixed: Mapping[tuple[int, ...], str] | None = None) -> list[list[str]]:
    """A label per cluster node, per level: up to ``num_terms`` distinctive whole words (:func:`label_words`).

    Distinctiveness of word ``w`` for cluster ``c`` with parent ``p``:
    ``f_c * log(f_c / f_s)`` with ``f_c = (df_c(w) + a) / (n_c + 2a)`` and ``f_s`` the same over
    the sibling clusters (``p`` minus ``c``); ``df`` counts ads containing the word. Ties break by
    word. The best word comes first; a further word is taken only if at least half of the cluster's
    ads holding it also hold the first word (one product group, not two), and the chosen words are
    written in the order they appear in the cluster's texts (mean relative position). Words already
    in an ancestor's label are skipped. Sibling labels are made distinct (next-best words, else the
    cluster index). Nodes whose path is in ``fixed`` keep that label; the others avoid their fixed
    siblings' labels.
    """
    import scipy.sparse as sp
    from sklearn.feature_extraction.text import CountVectorizer

    n = len(label_texts)
    analyzed = [label_words(t or "") for t in label_texts]
    vec = CountVectorizer(analyzer=lambda words: words, binary=True, max_features=max_vocab,
                          dtype=np.float32)
    try:
        x = vec.fit_transform(analyzed).tocsr()  # [N, V] 0/1
        vocab = np.asarray(vec.get_feature_names_out())
    except ValueError:  # no word at all in the corpus
        x, vocab = sp.csr_matrix((n, 1), dtype=np.float32), np.array(["group"])
    positions: dict[int, dict[str, float]] = {}  # row -> word -> relative position of its first use

    def in_reading_order(words: list[str], rows: np.ndarray) -> str:
        """``words`` joined in the order the texts ``rows`` use them: mean relative position over the
        texts holding all of them (else over those holding each)."""
        for i in rows.tolist():
            if i not in positions:
                first: dict[str, float] = {}
                for j, u in enumerate(analyzed[i]):
                    first.setdefault(u, j / len(analyzed[i]))
                positions[i] = first
        at = [positions[i] for i in rows.tolist()]
        every = [p for p in at if all(w in p for w in words)]
        where = {w: float(np.mean([p[w] for p in (every or at) if w in p] or [1.0])) for w in words}
        return " ".join(sorted(words, key=lambda w: (where[w], w)))

    alpha = 0.5
    out: list[list[str]] = []
    # words already said by a node's ancestors; a child repeating them tells the reader nothing
    said: list[frozenset[str]] = []
    prev_df = None
    prev_size = None
    for lvl, ids in enumerate(node_of):
        m = paths[lvl].shape[0]
        has = ids >= 0
        memb = sp.csr_matrix((np.ones(int(has.sum()), np.float32), (ids[has], np.flatnonzero(has))),
                             shape=(m, n))
        members = np.split(np.flatnonzero(has)[np.argsort(ids[has], kind="stable")],
                           np.cumsum(np.bincount(ids[has], minlength=m))[:-1])  # rows of each node
        df = (memb @ x).tocsr()                                  # [M, V] doc freq per cluster
        size = np.asarray(memb.sum(axis=1)).ravel()              # [M]
        par = parents[lvl]
        if lvl == 0:
            pdf = np.asarray(x.sum(axis=0)).ravel()[None, :]     # root: every ad
            psize = np.array([float(n)])
            par_idx = np.zeros(m, dtype=np.int64)
        else:
            pdf, psize, par_idx = prev_df, prev_size, par
        coo = df.tocoo()
        r, c, v = coo.row, coo.col, coo.data.astype(np.float64)
        parent_df = np.asarray(pdf[par_idx[r], c]).ravel()
        sib_df = parent_df - v
        sib_n = psize[par_idx[r]] - size[r]
        f_c = (v + alpha) / (size[r] + 2 * alpha)
        f_s = (sib_df + alpha) / (sib_n + 2 * alpha)
        score = f_c * np.log(f_c / f_s)
        order = np.lexsort((vocab[c], -score, r))               # per node: best first, then word
        r_o, c_o, s_o = r[order], c[order], score[order]
        starts = np.searchsorted(r_o, np.arange(m + 1))
        labels = [""] * m
        # group nodes by parent so siblings can be kept distinct
        by_parent: dict[int, list[int]] = {}
        for node in range(m):
            by_parent.setdefault(int(par_idx[node]), []).append(node)
        node_said: list[frozenset[str]] = [frozenset()] * m
        for parent_node, sibs in by_parent.items():
            above = said[parent_node] if lvl > 0 else frozenset()
            sib_paths = {node: tuple(int(v) for v in paths[lvl][node]) for node in sibs} if fixed else {}
            kept = {node: fixed[p] for node, p in sib_paths.items() if p in fixed}
            used: set[str] = set(kept.values())
            for node in sibs:
                if node in kept:
                    labels[node] = kept[node]
                    node_said[node] = above | frozenset(kept[node].split())
                    continue
                a, b = starts[node], starts[node + 1]
                cols = [int(c_o[i]) for i in range(a, min(b, a + 8 * num_terms + len(above)))
                        if s_o[i] > 0 and vocab[c_o[i]] not in above]
                rows = members[node]
                if cols:
                    sub = x[rows][:, cols].toarray() > 0             # [n_node, len(cols)] word present
                    with_first = sub[:, 0]
                    cnt = sub.sum(axis=0)
                    both = (sub & with_first[:, None]).sum(axis=0)
                    coherent = [j for j in range(len(cols)) if 2 * both[j] >= cnt[j]]
                    rest = [j for j in range(len(cols)) if 2 * both[j] < cnt[j]]
                    cand = [str(vocab[cols[j]]) for j in coherent + rest]
                    n_coherent = len(coherent)
                else:
                    cand, n_coherent = [], 0

                take = min(num_terms, n_coherent)
                words = cand[:take]
                label = in_reading_order(words, rows) if words else f"group {int(paths[lvl][node, -1])}"
                extra = take
                while label in used and extra < len(cand):
                    words = words + [cand[extra]]
                    extra += 1
                    label = in_reading_order(words, rows)
                if label in used:
                    label = f"{label} {int(paths[lvl][node, -1])}"
                used.add(label)
                labels[node] = label
                node_said[node] = above | frozenset(label.split())
        said = node_said
        out.append(labels)
        prev_df, prev_size = df, size
    return out


def _render_text(h: Hierarchy, texts: list[str], tokenizer: Any, cfg: RenderConfig,
                 label_texts: list[str], fixed_labels: Mapping[tuple[int, ...], str]) -> RenderedIds:
    check_tokenizer(tokenizer, cfg)
    eos = tokenizer.eos_token_id
    node_of, paths, parents = _cluster_nodes(h)
    labels = cluster_labels(node_of, paths, parents, label_texts, cfg.label_terms,
                            cfg.max_label_vocab, fixed_labels)
    # One tokenization per cluster segment; the first level has no leading space.
    seg_tokens: list[list[list[int]]] = []
    seg_strings: list[list[str]] = []
    for lvl, labs in enumerate(labels):
        strings = [("" if lvl == 0 else " ") + lab + LABEL_SEPARATOR for lab in labs]
        seg_strings.append(strings)
        seg_tokens.append(tokenizer(strings, add_special_tokens=False)["input_ids"] if strings
                          else [])
    cluster_depth = h.code_len.astype(np.int64) - 1
    lead = np.where(cluster_depth > 0, " ", "")
    text_strings = [lead[i] + " ".join(t.split()) for i, t in enumerate(texts)]
    # split_special_tokens: an ad that spells "<|im_end|>" is text, not an EOS in mid-sequence
    enc = tokenizer(text_strings, add_special_tokens=False, split_special_tokens=True,
                    return_offsets_mapping=bool(getattr(tokenizer, "is_fast", False)))
    text_tokens = enc["input_ids"]
    k = cfg.max_text_tokens
    long_rows = [i for i, tt in enumerate(text_tokens) if len(tt) > k]
    has_offsets = "offset_mapping" in enc
    word_cut = {}  # row -> (tokens kept, characters kept) of the word-boundary cut
    for i in long_rows:
        offsets = (enc["offset_mapping"][i] if has_offsets
                   else _offsets_by_decoding(tokenizer, text_tokens[i][:k + 1]))
        word_cut[i] = cut_at_word(text_strings[i], offsets, k)
    node_cols = [ids.tolist() for ids in node_of]
    prefixes = [[t for lvl in range(int(cluster_depth[i])) for t in seg_tokens[lvl][node_cols[lvl][i]]]
                for i in range(h.num_ads)]
    token_cut = _word_cut_keeping_distinct(prefixes, text_tokens, word_cut, k)
    seqs: list[list[int]] = []
    rendered: list[str] = []
    eos_str = tokenizer.eos_token or ""
    for i in range(h.num_ads):  # assembling per-ad lists; all heavy work above is batched
        seq: list[int] = list(prefixes[i])
        parts: list[str] = [seg_strings[lvl][node_cols[lvl][i]] for lvl in range(int(cluster_depth[i]))]
        tt = text_tokens[i]
        if i in token_cut:  # the word cut would merge this ad with another: the plain token cut
            tt = tt[:k]
            parts.append(tokenizer.decode(tt))
        elif i in word_cut:
            n_tok, n_chars = word_cut[i]
            tt = tt[:n_tok]
            # offsets are the tokenizer's own; decoded prefixes (a slow tokenizer) may differ in spaces
            parts.append(text_strings[i][:n_chars] if has_offsets else tokenizer.decode(tt))
        else:
            parts.append(text_strings[i])
        seq.extend(tt)
        seq.append(eos)
        seqs.append(seq)
        rendered.append("".join(parts) + eos_str)
    token_len = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
    token_flat = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(token_len.sum()))
    rows = []
    for lvl, p in enumerate(paths):
        sizes = np.bincount(node_of[lvl][node_of[lvl] >= 0], minlength=p.shape[0])
        for j in range(p.shape[0]):
            rows.append((p[j].tolist(), int(sizes[j]), labels[lvl][j], None))
    return RenderedIds(IdScheme.TEXT, token_flat, token_len, rendered, len(tokenizer), [], int(eos),
                       _clusters_table(rows))
