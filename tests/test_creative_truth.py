"""Issue 57: the truthfulness measure (hand-made cases), delexicalisation's round trip (pairs, model
declaration, generator), and the generation checks: every written headline carries its checks' outcome, a
failing candidate is never written unflagged, a request whose candidates all fail is written flagged."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from adbatch.eval.truthfulness import EntityKind, check_headline, common_words, truthfulness
from adbatch.serving.checks import CreativeFlag, choose, creative_flags
from adbatch.serving.delex import (COMPANY_SLOT, DelexMismatchError, DelexMode, declare_delex, delex_of, delexicalise,
                                   mask_text, restore)
from adbatch.serving.prompts import creative_prompt_text

GALA = {"advertiser": "Gala Travels", "description": "Gala Travels plans group tours and river cruises from London "
        "since 1998.", "industry": "leisure, travel & tourism"}
NBIZ = {"advertiser": "nbiz infosol", "description": "Accredited training centre in Dubai, UAE.", "industry": "education"}
MANN = {"advertiser": "Manncorp", "description": "Surface mount equipment for electronics assembly.", "industry": "machinery"}
BRAND = {"advertiser": "Brandpremiums", "description": "We create merchandise and POS material.", "industry": "marketing"}
EYEQ = {"advertiser": "Eye Q Optical", "description": "Jamaica's leading eye care provider.", "industry": "health"}
PRINT = {"advertiser": "Ag Printers", "description": "Labels and packaging for farms.", "industry": "printing"}


def _kinds(headline, ad):
    return [(e.text, e.kind) for e in check_headline(headline, ad).invented]


@pytest.mark.parametrize("headline, ad, invented, uses, right", [
    # the issue's own example: the brand replaced before its type, and a place the ad never named
    ("Grasshopper Travels for a Grasshoppers Grass, Toronto", GALA,
     [("Grasshopper", EntityKind.CHANGED_NAME), ("Toronto", EntityKind.NAME)], True, False),
    ("Gala Travels: Tours and Cruises Since 1998", GALA, [], True, True),
    ("River Cruises from London for Everyone", GALA, [], False, None),  # Title Case words are not names
    ("Cruises from Paris", GALA, [("Paris", EntityKind.NAME)], False, None),
    ("Save 50% on Group Tours", GALA, [("50", EntityKind.NUMBER)], False, None),
    ("GALA TRAVELS GROUP TOURS", GALA, [], True, True),  # all capitals: no word is an acronym for that alone
    ("Gala Travel: Group Tours", GALA, [("Travel", EntityKind.CHANGED_NAME)], True, False),
    ("Nabiz Training in Dubai, UAE", NBIZ, [("Nabiz", EntityKind.CHANGED_NAME)], True, False),
    ("Training for the NHS", NBIZ, [("NHS", EntityKind.NAME)], False, None),
    ("MannCorp's Surface Mount Kits", MANN, [], True, True),  # case and possessive are free
    ("Brand Premiums for Business", BRAND, [], True, True),  # so is a space inside the name
    ("Eye Q's Jamaica Clinic", EYEQ, [], True, True),
    ("Advertiser: Ag Printer", PRINT, [("Printer", EntityKind.CHANGED_NAME)], True, False),
    ("Labels That Last", PRINT, [], False, None),
    ("You'll Love Our Labels", PRINT, [], False, None),  # a contraction is no name
    ("", PRINT, [], False, None),
])
def test_check_headline_hand_made_cases(headline, ad, invented, uses, right):
    verdict = check_headline(headline, ad)
    assert _kinds(headline, ad) == invented
    assert verdict.uses_name is uses and verdict.name_right is right


def test_truthfulness_shares_and_the_word_list():
    heads = ["Grasshopper Travels in Toronto", "Gala Travels: Tours Since 1998", "River Cruises", ""]
    assert truthfulness(heads, [GALA] * 4) == {"invented_share": 0.25, "name_use_share": 0.5, "name_right_share": 0.5}
    assert truthfulness(["River Cruises"], [GALA])["name_right_share"] is None
    with pytest.raises(ValueError, match="headlines vs"):
        truthfulness(["a"], [])
    words = common_words()
    assert {"planet", "grasshopper", "customised", "wellness"} <= words and not {"toronto", "nabiz"} & words


# --- delexicalisation ---------------------------------------------------------------------------------

AD = {"advertiser": "gala travels", "description": "Gala Travels plans tours from London and Paris for UK groups. "
      "IT is not it.", "industry": "leisure"}


def test_delexicalise_masks_the_name_and_the_entities_and_restores_them():
    d = delexicalise(AD, DelexMode.ENTITIES)
    assert d.fields["advertiser"] == COMPANY_SLOT
    assert d.fields["description"] == ("<company> plans tours from <ent1> and <ent2> for <ent3> groups. <ent4> is not it.")
    # the company is restored as the ad's own text writes it, not as the lower-case advertiser field
    assert d.slots == {"<company>": "Gala Travels", "<ent1>": "London", "<ent2>": "Paris", "<ent3>": "UK", "<ent4>": "IT"}
    head = "Gala Travels: London to Paris, UK Tours"
    masked = mask_text(head, d.slots)
    assert masked == "<company>: <ent1> to <ent2>, <ent3> Tours"
    assert restore(masked, d.slots) == head
    assert mask_text("GALA TRAVELS for it", d.slots) == "<company> for it"  # the name in any case; "it" is no "IT"
    assert restore("<company> and <ent9>", d.slots) == "Gala Travels and <ent9>"  # unknown slot: left, flagged later
    only = delexicalise(AD, DelexMode.COMPANY)
    assert only.slots == {"<company>": "Gala Travels"} and "London" in only.fields["description"]
    off = delexicalise(AD, DelexMode.OFF)
    assert off.slots == {} and off.fields == AD


@pytest.mark.parametrize("mode", list(DelexMode))
def test_round_trip_of_every_pair_of_a_corpus(mode):
    rows = [GALA, NBIZ, MANN, EYEQ, PRINT, AD]
    heads = ["Gala Travels Since 1998", "nbiz infosol Training in Dubai", "Manncorp Kits", "Eye Q Optical in Jamaica",
             "Ag Printers Labels", "London and Paris with Gala Travels"]
    for ad, head in zip(rows, heads):
        d = delexicalise(ad, mode)
        assert restore(mask_text(head, d.slots), d.slots).lower() == head.lower()
        if mode is not DelexMode.OFF:
            assert ad["advertiser"].lower() not in " ".join(d.fields.values()).lower()


def test_model_declares_its_masking_and_another_version_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_llama

    model = make_tiny_llama()
    assert delex_of(model) is DelexMode.OFF
    declare_delex(model, DelexMode.ENTITIES)
    model.save_pretrained(tmp_path / "m")
    assert delex_of(AutoModelForCausalLM.from_pretrained(tmp_path / "m")) is DelexMode.ENTITIES
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["adbatch_creative_delex"]["version"] += 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DelexMismatchError, match="fine-tune it again"):
        delex_of(AutoModelForCausalLM.from_pretrained(tmp_path / "m"))


def test_training_pairs_are_masked(default_tokenizer):
    from adbatch.serving.prompts import CreativePrompt, encode_creative_prompt
    from adbatch.training.creatives import HeadlinePairs, creative_examples, masked_pairs

    pairs = HeadlinePairs(["a"], [dict(AD)], ["Gala Travels: London Tours"], {})
    fields, heads = masked_pairs(pairs, DelexMode.ENTITIES)
    assert heads == ["<company>: <ent1> Tours"] and fields[0]["advertiser"] == COMPANY_SLOT
    ex = creative_examples(default_tokenizer, pairs, DelexMode.ENTITIES)
    plen = int(ex.prompt_lens[0])
    assert ex.tokens[:plen].tolist() == encode_creative_prompt(default_tokenizer, fields[0], style=CreativePrompt.TUNED)
    assert "<company>: <ent1> Tours" in default_tokenizer.decode(ex.tokens[plen:].tolist())


# --- checks at generation ------------------------------------------------------------------------------

@pytest.mark.parametrize("headline, flags", [
    ("Group Tours Worth Taking", []),
    ("Grasshopper Travels in Toronto", [CreativeFlag.INVENTED_ENTITY, CreativeFlag.NAME_CHANGED]),
    ("Advertiser: Gala Travels", [CreativeFlag.ECHO]),
    ("Gala Travels plans group tours and river cruises", [CreativeFlag.COPY]),
    ("", [CreativeFlag.LENGTH]),
    ("Tours tours and more tours for every single traveller in every town of the land", [CreativeFlag.LENGTH,
                                                                                         CreativeFlag.REPETITION]),
    ("Business Insider Business Business Company", [CreativeFlag.REPETITION, CreativeFlag.OFF_TOPIC]),
    ("<company> Tours", [CreativeFlag.PLACEHOLDER]),
    # no word of the ad's: an invented name of common words (the example's sampled headline), a slogan of any ad
    ("Grasshopper Tents for a Greener Future", [CreativeFlag.OFF_TOPIC]),
    ("Luxury and luxury in a greener future", [CreativeFlag.OFF_TOPIC]),
    ("Wanderlust!", []),  # one content word: too little to judge
    ("Cruise Away", []),  # "Cruise" is the ad's "cruises"
    # cut by the token cap (the example at 16 new tokens); a place's abbreviation in capitals is no connector
    ("Group tours for the lowest prices and on", [CreativeFlag.UNFINISHED]),
    ("River Cruises, Group Tours-", [CreativeFlag.UNFINISHED]),
    ("Group Tours from London &", [CreativeFlag.UNFINISHED]),
    ("Group Tours from London, ON", [CreativeFlag.INVENTED_ENTITY]),  # ON: a name the ad lacks, not an open end
])
def test_creative_flags(headline, flags):
    assert creative_flags(headline, GALA, creative_prompt_text(GALA)) == flags


def test_grounding_counts_the_content_words_the_ad_supports():
    from adbatch.eval.truthfulness import grounding

    assert grounding("Group Tours Worth Taking", GALA) == (2, 4)  # group, tours of group, tours, worth, taking
    assert grounding("The Best of the Rest", GALA) == (0, 2)  # function words and short words do not count
    assert grounding("", GALA) == (0, 0)


def test_choose_keeps_passing_candidates_first_and_fills_with_flagged_ones():
    cands = [("a", -0.1), ("b", -0.5), ("c", -0.2), ("d", -0.9)]
    flags = [[CreativeFlag.ECHO], [], [CreativeFlag.COPY, CreativeFlag.LENGTH], []]
    assert choose(cands, flags, 1) == [1]
    assert choose(cands, flags, 3) == [1, 3, 0]  # passing by score, then the failing one with fewest flags
    assert choose(cands, [[CreativeFlag.ECHO]] * 4, 1) == [0]  # all fail: the best is still written (flagged)
    with pytest.raises(ValueError):
        choose(cands, flags[:2], 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from test_generate_support import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("truth"))


def _generator(model_dir, monkeypatch, texts, **creative):
    """A CreativeGenerator whose decoder returns ``texts[request_id]`` ((text, score) candidates)."""
    import adbatch.decoding as decoding
    from adbatch.decoding import CreativeConfig
    from adbatch.serving.generators import CreativeGenerator, GenerateConfig, ModelSpec

    gen = CreativeGenerator(ModelSpec(model=str(model_dir)), CreativeConfig(**creative),
                            GenerateConfig(device="cpu", batch_size=4))
    seen = {}

    def fake(model, tokenizer, prompts, config, batch_size=None):
        seen["n"], seen["prompts"] = config.num_return, [tokenizer.decode(p) for p in prompts]
        return [texts[i] for i in range(len(prompts))]

    monkeypatch.setattr(decoding, "generate_creatives", fake, raising=False)
    return gen, seen


def test_generator_writes_the_best_passing_candidate_and_flags_the_rest(model_dir, monkeypatch, tmp_path):
    from adbatch.serving.generators import answers_to_output
    from adbatch.serving.requests import GenerateTask

    texts = [[("Grasshopper Travels in Toronto", -0.1), ("Group Tours Worth Taking", -0.4), ("", -0.2)],
             [("Advertiser: Gala Travels", -0.1), ("Grasshopper Travels", -0.3), ("", -0.5)]]
    gen, seen = _generator(model_dir, monkeypatch, texts, strategy="sample", num_return=1, candidates=3)
    reqs = pa.Table.from_pylist([{"request_id": f"r{i}", "ad_id": f"a{i}", **GALA} for i in range(2)])
    answers = gen(reqs)
    assert seen["n"] == 3  # the decoder wrote every candidate
    out, rejected = answers_to_output(GenerateTask.CREATIVES, answers.drop_columns(["batch_seconds"]))
    assert rejected.num_rows == 0 and out.num_rows == 2  # no request lost to the checks
    rows = out.to_pylist()
    assert rows[0]["headline"] == "Group Tours Worth Taking" and rows[0]["flags"] == []
    # every candidate of r1 fails: the one with the fewest failed checks is written, flagged with its reasons
    assert rows[1]["headline"] == "Advertiser: Gala Travels" and rows[1]["flags"] == ["echo"]
    for r in rows:  # a written headline's flags are exactly the checks it fails: never unflagged
        assert r["flags"] == [f.value for f in creative_flags(r["headline"], GALA, creative_prompt_text(GALA))]
    import pyarrow.parquet as pq

    pq.write_table(out, tmp_path / "part.parquet")
    back = pq.read_table(tmp_path / "part.parquet")
    assert back.schema.field("flags").type == pa.list_(pa.string())
    assert back.column("flags").to_pylist() == [[], ["echo"]]


def test_generator_masks_prompts_and_restores_headlines_of_a_masking_model(model_dir, monkeypatch, tmp_path):
    import shutil

    from transformers import AutoConfig

    masked_dir = tmp_path / "masked"
    shutil.copytree(model_dir, masked_dir)
    cfg = AutoConfig.from_pretrained(masked_dir)
    setattr(cfg, "adbatch_creative_delex", {"mode": "entities", "version": 1})
    cfg.save_pretrained(masked_dir)
    gen, seen = _generator(masked_dir, monkeypatch, [[("<company>: <ent1> Tours", -0.1)]])
    assert gen.delex is DelexMode.ENTITIES
    answers = gen(pa.Table.from_pylist([{"request_id": "r0", "ad_id": "a0", **AD}]))
    assert "gala travels" not in seen["prompts"][0].lower() and "<company>" in seen["prompts"][0]
    assert answers.column("headlines").to_pylist() == [["Gala Travels: London Tours"]]
    assert answers.column("flags").to_pylist() == [[[]]]


def test_an_answer_without_flags_is_never_written():
    from adbatch.serving.generators import CREATIVE_ANSWER_SCHEMA, answers_to_output
    from adbatch.serving.requests import GenerateTask

    bad = pa.Table.from_pylist([{"request_id": "r0", "ad_id": "a0", "error": None, "headlines": ["Hi"],
                                 "scores": [-0.1], "flags": None}], schema=CREATIVE_ANSWER_SCHEMA)
    with pytest.raises(ValueError, match="flags"):
        answers_to_output(GenerateTask.CREATIVES, bad)
