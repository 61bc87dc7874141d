"""Id rendering (ID_RENDER_VERSION 2): text ids cut on a word boundary within the token cap without
merging ads the plain token cut kept apart, and cluster labels made of whole, coherent words."""

from __future__ import annotations

import numpy as np
import pytest

from adbatch.index.clustering import Hierarchy
from adbatch.index.ids import (IdScheme, RenderConfig, cluster_labels, label_words, render_ids,
                                  _cluster_nodes)


def flat_hierarchy(n: int) -> Hierarchy:
    """``n`` ads in one leaf (no cluster labels): the sequence is the ad text + EOS alone."""
    return Hierarchy(np.arange(n, dtype=np.int32), np.ones(n, dtype=np.int32), 0, 1, 0)


def two_level(groups: list[int]) -> Hierarchy:
    """Ads in top-level clusters ``groups[i]`` (code = (group, position in group))."""
    pos: dict[int, int] = {}
    flat = []
    for g in groups:
        flat += [g, pos.setdefault(g, 0)]
        pos[g] += 1
    return Hierarchy(np.array(flat, dtype=np.int32), np.full(len(groups), 2, dtype=np.int32), 1,
                     len(set(groups)), 0)


def text_part(r, i: int, tok) -> str:
    return r.texts[i].removesuffix(tok.eos_token)


@pytest.mark.parametrize("text", [
    "Microsoft Office Home and Business 2019 standard edition license for one PC or Mac, download",
    "Crème brûlée café au lait — élégante théière en porcelaine émaillée, fabriquée à Limoges, "
    "édition spéciale numérotée",
    "Ткань льняная натуральная для штор и скатертей, ширина сто пятьдесят сантиметров",
])
def test_text_is_cut_after_the_last_whole_word_that_fits(default_tokenizer, text):
    tok, k = default_tokenizer, 12
    assert len(tok(text, add_special_tokens=False)["input_ids"]) > k
    r = render_ids(flat_hierarchy(1), [text], tok, RenderConfig(max_text_tokens=k))
    kept = text_part(r, 0, tok)
    seq = r.sequences()[0]
    assert seq[-1] == tok.eos_token_id and len(seq) - 1 <= k
    # a prefix of the text ending right before a space: the last word is whole
    assert text.startswith(kept) and text[len(kept)] == " " and "\ufffd" not in kept
    # and it is the longest such prefix within the cap (a word of bare punctuation, "—", never ends it)
    rest = text[len(kept):].split(" ")[1:]
    more = next(j for j in range(1, len(rest) + 1) if any(ch.isalnum() for ch in rest[j - 1]))
    longer = " ".join([kept, *rest[:more]])
    assert len(tok(longer, add_special_tokens=False)["input_ids"]) > k
    # the tokens are exactly those of the kept text
    assert seq[:-1] == tok(kept, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("word", ["Donaudampfschifffahrtsgesellschaftskapitänswitwenrente" * 2,
                                  "ü" * 40])
def test_a_first_word_longer_than_the_cap_is_cut_at_the_cap_on_a_character(default_tokenizer, word):
    tok, k = default_tokenizer, 8
    r = render_ids(flat_hierarchy(1), [word + " tail"], tok, RenderConfig(max_text_tokens=k))
    kept = text_part(r, 0, tok)
    seq = r.sequences()[0][:-1]
    assert 0 < len(seq) <= k and word.startswith(kept) and "\ufffd" not in kept
    assert tok.decode(seq) == kept  # no token ends inside a character
    assert len(seq) >= k - 1  # cut at the cap (one token back at most, to a character boundary)


def test_word_cut_keeps_apart_ads_the_token_cut_kept_apart(default_tokenizer):
    tok, k = default_tokenizer, 10
    base = "Standard edition software license for one computer with download and"
    texts = [base + " licensed support", base + " licensing support", base + " a b c"]
    plain = [tuple(tok(t, add_special_tokens=False)["input_ids"][:k]) for t in texts]
    r = render_ids(flat_hierarchy(3), texts, tok, RenderConfig(max_text_tokens=k))
    seqs = [tuple(s) for s in r.sequences()]
    # exactly as many distinct ids as the plain token cut gives, every sequence within the cap
    assert len(set(seqs)) == len(set(plain))
    assert all(len(s) - 1 <= k for s in seqs)
    # ads that stay apart only through the token cut keep it; the others end on a whole word
    for i, t in enumerate(texts):
        kept = text_part(r, i, tok)
        assert seqs[i][:-1] == plain[i] or (t.startswith(kept) and t[len(kept)] == " ")


def test_short_texts_and_the_rendered_prefix_are_unchanged(default_tokenizer):
    tok = default_tokenizer
    texts = ["cordless drill kit", "  paint   primer  white "]
    r = render_ids(flat_hierarchy(2), texts, tok, RenderConfig(max_text_tokens=32))
    assert [text_part(r, i, tok) for i in range(2)] == ["cordless drill kit", "paint primer white"]


def test_label_words_are_whole_words():
    words = label_words("Simpson Strong-Tie 12-Gauge Angle (4-Pack) 1.28 GPF 1-gal. 8 ft. Lithium-Ion "
                        "Hampton Bay's 15 Amp Crème brûlée")
    assert words == ["simpson", "strong-tie", "angle", "lithium-ion", "hampton", "bay's", "crème", "brûlée"]


def _labels(texts: list[str], groups: list[int], terms: int = 2) -> dict[int, str]:
    h = two_level(groups)
    node_of, paths, parents = _cluster_nodes(h)
    labels = cluster_labels(node_of, paths, parents, texts, terms, 50_000)
    return {int(p[-1]): lab for p, lab in zip(paths[0], labels[0])}


def test_labels_are_coherent_whole_words_in_reading_order():
    rng = np.random.default_rng(0)
    texts, groups = [], []
    for i in range(60):
        # cluster 0 mixes two products: Cub Cadet mowers and, fewer, elongated toilets
        if i % 3 == 2:
            texts.append(f"Glacier Elongated Toilet Bowl 1.28 GPF white model {i}")
        else:
            texts.append(f"Cub Cadet Lithium-Ion Riding Mower 42 in. deck {rng.choice(['red', 'blue'])} {i}")
        groups.append(0)
    for i in range(60):
        texts.append(f"Behr Premium Exterior Paint 1-gal. Satin {rng.choice(['white', 'grey'])} {i}")
        groups.append(1)
    labels = _labels(texts, groups)
    for g, label in labels.items():
        words = label.split()
        assert words and all(w == w.strip(".,()") and not any(ch.isdigit() for ch in w) for w in words)
        members = [t.lower() for t, gg in zip(texts, groups) if gg == g]
        # one product group: some title of the cluster holds all the label's words ...
        assert any(all(w in label_words(t) for w in words) for t in members), label
        # ... in the order the titles write them
        holder = next(label_words(t) for t in members if all(w in label_words(t) for w in words))
        assert words == sorted(words, key=holder.index), label
    assert "toilet" not in labels[0] and "gpf" not in labels[0] and "gal" not in labels[1]


def test_codes_scheme_clusters_get_word_labels_and_keep_their_tokens(default_tokenizer):
    texts = [f"cordless drill kit {i}" for i in range(20)] + [f"exterior paint gallon {i}" for i in range(20)]
    r = render_ids(two_level([0] * 20 + [1] * 20), texts, default_tokenizer,
                   RenderConfig(scheme=IdScheme.CODES))
    rows = r.clusters.to_pylist()
    assert [row["token"] for row in rows] == ["<ad_L0_0>", "<ad_L0_1>"]
    assert set(rows[0]["label"].split()) <= {"cordless", "drill", "kit"}
    assert set(rows[1]["label"].split()) <= {"exterior", "paint", "gallon"}
    # the decoded sequences are the code tokens, as before
    assert r.texts[0] == "<ad_L0_0><ad_L1_0>"
