"""Generated queries (adbatch/training/query_generation.py): train-split pairs only, seeded generation and
cleaning, the round trip, the content-keyed cache, the train job's query source and the no-label fallback.
Tiny random-init Llamas over a word-level tokenizer (CPU; one test renders the default tokenizer's chat prompt)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from adbatch.config import ConfigError
from adbatch.serving.prompts import encode_query_gen_prompt, encode_query_gen_target, encode_targeting_prompt
from adbatch.training import TrainConfig, train_on_index
from adbatch.training.data import ExampleKind, build_examples
from adbatch.training.pseudo_queries import PseudoQueryConfig, QuerySource
from adbatch.training.query_generation import (GENERATED_QUERIES_FILE, GeneratedQueries, NoLabelsPolicy,
                                               QueryGenConfig, QueryGenTrainConfig, build_generated_queries,
                                               clean_queries, generate_queries, generator_examples,
                                               generation_key, load_generated_queries, minilm_ranker, query_pairs,
                                               round_trip_filter, teacher_labelled, write_generated_queries)
from conftest import make_tiny_llama
from test_training import QUERIES, TITLES, fake_index

#: labelled train pairs over the TITLES of test_training (ad ids 100..107)
TRAIN = [(q, 100 + r) for q, r in QUERIES] + [("cordless drill", 107), ("water heater 40 gal", 106),
                                               ("ceiling light", 104), ("workbench", 105)]
#: tiny fine-tune and sampling settings: each call stays well under a second of training
FAST = QueryGenConfig(queries_per_ad=3, max_new_tokens=5, batch_size=4, min_pairs=1,
                      train=QueryGenTrainConfig(max_steps=2, batch_tokens=512, log_every=1))
#: the targeting training of the train_on_index tests: a few steps (what it trains on is what is checked)
SHORT = TrainConfig(epochs=1, lr=1e-3, batch_tokens=512, max_steps=3)


def word_tokenizer():
    """A word-level tokenizer over the words these tests use (lower-cased, punctuation split, no chat
    template, EOS ``<eos>``): the default tokenizer's 49k-token vocabulary makes a tiny model's LM head,
    nucleus sort and stop-token mask cost seconds per call on a shared CPU; 200 words cost nothing."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from adbatch.serving.prompts import QUERY_GEN_INSTRUCTION, TARGETING_INSTRUCTION

    pre = pre_tokenizers.Whitespace()
    corpus = [*TITLES, *(q for q, _ in TRAIN), QUERY_GEN_INSTRUCTION, TARGETING_INSTRUCTION,
              "Product: Query: Ad: hex drill kit bits light fixture stain 5-gal. lost"]
    words = dict.fromkeys(w for text in corpus for w, _ in pre.pre_tokenize_str(text.lower()))
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.normalizer, t.pre_tokenizer = normalizers.Lowercase(), pre
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


def tiny(tok, seed=0):
    return make_tiny_llama(vocab_size=len(tok), hidden=64, layers=2, seed=seed).float()


def texts():
    return dict(zip(range(100, 100 + len(TITLES)), TITLES))


def test_pairs_take_only_the_train_rows_given_and_refuse_held_out_queries():
    rows = TRAIN + [("  Deck   Over ", 101),  # a duplicate once spaces and case are ignored
                    ("", 102), ("missing ad", 999),
                    (TITLES[3].lower(), 103),  # the ad's own title: the indexing example already
                    ("shower faucet chrome", 102)]  # a validation query passed by mistake
    pairs = query_pairs(rows, texts(), exclude_queries=["Shower Faucet  Chrome", "never seen"])
    assert pairs.stats["skipped"] == {"duplicate": 1, "empty_query": 1, "ad_not_in_catalogue": 1,
                                      "query_is_ad_text": 1, "held_out_query": 1}
    assert pairs.queries == [q for q, _ in TRAIN] and pairs.ad_ids == [a for _, a in TRAIN]
    assert pairs.texts[0] == TITLES[0] and pairs.stats["rows"] == len(rows) and pairs.stats["pairs"] == len(TRAIN)
    assert "shower faucet chrome" not in [q.lower() for q in pairs.queries]
    sample = query_pairs(rows, texts(), max_pairs=3, seed=1)
    assert len(sample) == 3 and sample.stats["skipped"]["not_sampled"] == len(TRAIN) + 1 - 3  # + the unexcluded one
    assert sample.content_hash() == query_pairs(rows, texts(), max_pairs=3, seed=1).content_hash() != pairs.content_hash()


def test_generator_examples_are_prompt_then_query_and_eos(default_tokenizer):
    tok = default_tokenizer  # the chat template's rendering
    pairs = query_pairs(TRAIN, texts())
    ex = generator_examples(tok, pairs)
    assert len(ex) == len(TRAIN) and set(ex.kinds.tolist()) == {int(ExampleKind.CREATIVE)}
    plen = int(ex.prompt_lens[1])
    tokens = ex.tokens[ex.offsets[1]:ex.offsets[2]].tolist()
    assert tokens[:plen] == encode_query_gen_prompt(tok, TITLES[1])
    assert tokens[plen:] == encode_query_gen_target(tok, "deck over") and tokens[-1] == tok.eos_token_id
    assert TITLES[1] in tok.decode(tokens[:plen]) and "search query" in tok.decode(tokens[:plen])
    with pytest.raises(ValueError, match="empty query"):
        encode_query_gen_target(tok, "  ")


def test_clean_queries_counts_what_it_drops():
    kept, counts = clean_queries("RIDGID 18-Volt Cordless Drill Kit",
                                 [" cordless  drill", "", "\"  \"", "ridgid 18-volt cordless drill kit", "Cordless Drill",
                                  "'drill bits'"])
    assert kept == ["cordless drill", "drill bits"]
    assert counts == {"empty": 2, "same_as_ad_text": 1, "duplicate": 1, "kept": 2}


def test_generation_is_seeded_per_ad_and_cleaned(tok):
    model = tiny(tok, seed=3)
    ads = list(range(100, 106))
    first = generate_queries(model, tok, ads, texts(), FAST, progress=False)
    # another batch size (so other batch neighbours) gives the same queries: each ad is seeded on its own
    again = generate_queries(model, tok, ads, texts(), FAST.replace(batch_size=5), progress=False)
    assert first.rows() == again.rows()
    s = first.stats
    assert s["ads"] == 6 and s["sampled"] == 6 * FAST.queries_per_ad
    assert s["sampled"] == s["kept"] + s["empty"] + s["same_as_ad_text"] + s["duplicate"]
    # a random model's samples are distinct random words; one of its 18 starts with EOS (empty, counted)
    assert s["kept"] == len(first) == 17 and s["empty"] == 1
    per_ad = [[q for q, a, _ in first.rows() if a == ad] for ad in ads]
    assert sorted(len(m) for m in per_ad) == [2] + [FAST.queries_per_ad] * 5
    for ad, mine in zip(ads, per_ad):
        assert len({q.lower() for q in mine}) == len(mine) and all(q and q == " ".join(q.split()) for q in mine)
        assert all(q.lower() != texts()[ad].lower() for q in mine)
    assert set(first.origins) == {"tuned"}
    other = generate_queries(model, tok, ads, texts(), FAST.replace(seed=1), progress=False)
    assert other.queries != first.queries


def test_round_trip_keeps_queries_that_lead_back_to_their_ad():
    titles = ["RIDGID 18-Volt Cordless Drill Kit", "Hampton Bay 3-Light Ceiling Fixture", "BEHR DeckOver Stain"]
    gen = GeneratedQueries(["cordless drill", "ceiling light fixture", "deck stain", "ceiling light fixture"],
                           [1, 2, 3, 1], ["tuned"] * 4, {"kept": 4})
    kept = round_trip_filter(gen, minilm_ranker([1, 2, 3], titles, top_k=1))
    assert kept.pairs() == [("cordless drill", 1), ("ceiling light fixture", 2), ("deck stain", 3)]
    assert kept.stats["round_trip_dropped"] == 1 and kept.stats["kept"] == 3


def test_teacher_filters_and_labels_the_generated_queries():
    """Issue 55 item 3: a query stays only if the teacher's top k holds its source ad, and then also labels the
    teacher's best other ads; the origin follows its query; the generation key ignores the teacher's knobs (they
    apply to the cached queries)."""
    gen = GeneratedQueries(["drill", "lamp", "saw"], [1, 2, 3], ["tuned", "zero_shot", "tuned"], {"kept": 3})
    teacher = {"drill": [4, 1, 5, 6], "lamp": [7, 8, 9, 2], "saw": [3, 1, 2, 4]}
    seen = []

    def ranker(queries):
        seen.append(len(queries))
        return [teacher[q] for q in queries]

    out = teacher_labelled(gen, ranker, top_k=3, labels=2, batch_size=2)
    assert seen == [2, 1]  # batched
    # drill: source 1 at rank 2 -> kept, plus 4 and 5; lamp: 2 only at rank 4 -> dropped; saw: source first -> 1, 2
    assert out.pairs() == [("drill", 1), ("drill", 4), ("drill", 5), ("saw", 3), ("saw", 1), ("saw", 2)]
    assert out.origins == ["tuned"] * 6
    assert out.stats["teacher_dropped"] == 1 and out.stats["teacher_kept"] == 2
    assert out.stats["teacher_labels_added"] == 4
    assert teacher_labelled(gen, ranker, top_k=3, labels=0).pairs() == [("drill", 1), ("saw", 3)]
    key = lambda cfg: generation_key(None, [1, 2, 3], {1: "a", 2: "b", 3: "c"}, cfg, "g")  # noqa: E731
    assert key(FAST) == key(FAST.replace(teacher_top_k=10, teacher_labels=3))


def test_train_stage_labels_generated_queries_with_its_dense_teacher():
    """The train stage's hook: the given dense retriever ranks the generated queries (a fake one here); an index
    without a dense channel and no retriever leaves them as they are, with a warning."""
    from types import SimpleNamespace

    from adbatch.training.index_training import _teacher_labelled

    idx = SimpleNamespace(ad_ids=[10, 11, 12, 13], manifest={})
    gen = GeneratedQueries(["a", "b"], [10, 13], ["tuned", "tuned"], {"kept": 2})
    order = {"a": [1, 0, 2, 3], "b": [0, 1, 2, 3]}  # rows; "b"'s ad (row 3) is outside the teacher's top 3
    dense = SimpleNamespace(embed=lambda qs: list(qs),
                            search=lambda qs, k: SimpleNamespace(rows=torch.tensor([order[q][:k] for q in qs])))
    out = _teacher_labelled(gen, idx, QueryGenConfig(teacher_top_k=3, teacher_labels=1), dense, "cpu")
    assert out.pairs() == [("a", 10), ("a", 11)]
    assert _teacher_labelled(gen, idx, QueryGenConfig(teacher_top_k=3, teacher_labels=1), None, "cpu") is gen


def test_cache_is_reused_for_the_same_inputs_and_invalidated_when_they_change(tok, tmp_path, monkeypatch):
    import adbatch.training.query_generation as qg

    calls = []
    real = qg.generate_queries

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(qg, "generate_queries", counting)
    loader = lambda: (tiny(tok, seed=1), tok)  # noqa: E731
    path = tmp_path / "gen.parquet"
    ads, t = list(range(100, 104)), texts()

    def build(pairs=TRAIN, ad_texts=t, cfg=FAST):
        return build_generated_queries(pairs, ads, ad_texts, cfg, loader, cache=[path], write_to=path, progress=False)

    first, info = build()
    assert info["status"] == "generated" and len(calls) == 1 and path.is_file() and len(first) > 0
    again, info2 = build()
    assert info2["status"] == "cached" and len(calls) == 1 and again.rows() == first.rows()
    assert info2["key"] == info["key"] == load_generated_queries(path).key
    assert build(cfg=FAST.replace(batch_size=2))[1]["status"] == "cached"  # batching changes no query
    for changed in (dict(pairs=TRAIN + [("drill kit", 107)]),  # the labelled pairs
                    dict(ad_texts={**t, 101: "BEHR DeckOver 5-gal."}),  # the catalogue
                    dict(cfg=FAST.replace(temperature=0.7))):  # the config
        _, info3 = build(**changed)
        assert info3["status"] == "generated" and info3["key"] != info["key"]
    assert len(calls) == 4
    # another generator (other weights, same everything else) has another key
    loader = lambda: (tiny(tok, seed=2), tok)  # noqa: E731
    other = build()[1]
    assert other["status"] == "generated" and other["key"] != info["key"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(ConfigError, match="not a generated-queries file"):
        load_generated_queries(tmp_path / "other.parquet")


def test_generated_pairs_become_retrieval_examples_of_their_own_kind(tok):
    idx = fake_index(tok, "text")
    targets = idx.ad_codes.column("token_ids").to_pylist()
    spans = PseudoQueryConfig(per_ad=2, source=QuerySource.GENERATED)
    ex, stats = build_examples(tok, idx.ad_ids, targets, texts(), TRAIN, pseudo_queries=spans,
                               generated=[("hex drill", 107), ("lost", 999)])
    assert stats["generated_query"] == 1 and stats["generated_not_in_index"] == 1 and "pseudo_query" not in stats
    e = int((ex.kinds == int(ExampleKind.GENERATED_QUERY)).nonzero()[0, 0])
    tokens = ex.tokens[ex.offsets[e]:ex.offsets[e + 1]].tolist()
    assert tokens[:int(ex.prompt_lens[e])] == encode_targeting_prompt(tok, "hex drill")
    assert tokens[int(ex.prompt_lens[e]):] == targets[7] and int(ex.rows[e]) == 7
    _, mixed = build_examples(tok, idx.ad_ids, targets, texts(), TRAIN, pseudo_queries=spans.replace(source="mix"),
                              generated=[("hex drill", 107)])
    assert mixed["pseudo_query"] > 0 and mixed["generated_query"] == 1
    with pytest.raises(ConfigError, match="mix needs per_ad"):
        PseudoQueryConfig(per_ad=0, source=QuerySource.MIX)


@pytest.mark.parametrize("source", ["generated", "mix"])
def test_train_on_index_trains_on_generated_queries_and_caches_them_in_the_model_folder(tok, tmp_path, source):
    idx = fake_index(tok, "text")
    cfg = SHORT.replace(pseudo_queries=PseudoQueryConfig(per_ad=2, source=source))
    out = tmp_path / "model"

    def train():
        return train_on_index(idx, out, cfg, ad_texts=texts(), labelled=TRAIN, model=tiny(tok),
                              tokenizer=tok, device="cpu", progress=False, query_gen=FAST,
                              valid_qrels={"shower faucet chrome": {102: 3.0}})

    _, tokenizer, summary = train()
    data = summary.data
    assert data["generated_query"] == data["query_gen"]["generated"]["kept"] > 0
    assert (data.get("pseudo_query", 0) > 0) == (source == "mix")
    assert data["query_gen"]["status"] == "generated" and data["query_gen"]["pairs"]["pairs"] == len(TRAIN)
    cached = load_generated_queries(out / GENERATED_QUERIES_FILE)
    assert cached is not None and len(cached) == data["generated_query"]
    assert not (tmp_path / f".model.{GENERATED_QUERIES_FILE}").exists()  # the staging copy is gone after the save
    record = json.loads((out / "adbatch_training.json").read_text())
    assert record["query_gen"]["key"] == cached.key and record["config"]["pseudo_queries"]["source"] == source
    assert len(tokenizer) == len(tok)  # text scheme: the generator's copy and the model share one vocabulary
    _, _, again = train()  # a re-run with unchanged inputs: read from the model folder, not generated again
    assert again.data["query_gen"]["status"] == "cached"
    assert again.data["generated_query"] == data["generated_query"]


def test_no_labels_falls_back_to_spans_or_prompts_the_base_model(tok, tmp_path, caplog):
    idx = fake_index(tok, "text")
    cfg = SHORT.replace(pseudo_queries=PseudoQueryConfig(per_ad=2, source=QuerySource.GENERATED))
    with caplog.at_level(logging.WARNING, logger="adbatch.training.query_generation"):
        _, _, summary = train_on_index(idx, tmp_path / "m", cfg, ad_texts=texts(), labelled=[], model=tiny(tok),
                                       tokenizer=tok, device="cpu", progress=False,
                                       query_gen=FAST.replace(min_pairs=3))
    assert "cannot be trained; training on span pseudo-queries instead" in caplog.text
    data = summary.data
    assert data["query_gen"]["status"] == "no_labels" and data["pseudo_query"] == 2 * len(TITLES)
    assert "generated_query" not in data
    # zero-shot: the untuned base model writes the queries; nothing is fine-tuned
    zero = FAST.replace(min_pairs=3, no_labels=NoLabelsPolicy.ZERO_SHOT)
    gen, info = build_generated_queries(TRAIN[:2], list(range(100, 104)), texts(), zero,
                                        lambda: (tiny(tok, seed=5), tok), progress=False)
    assert info["status"] == "generated" and "fine_tune" not in info and set(gen.origins) == {"zero_shot"}
    assert len(gen) > 0


def test_query_gen_config_rejects_nonsense():
    for bad in (dict(queries_per_ad=0), dict(top_p=0.0), dict(temperature=0.0), dict(max_pairs=0),
                dict(min_pairs=0), dict(train_layers=0), dict(teacher_top_k=-1), dict(teacher_top_k=2, teacher_labels=2)):
        with pytest.raises(ConfigError):
            QueryGenConfig(**bad)
    assert QueryGenConfig.from_dict(FAST.to_dict()) == FAST
    assert QueryGenConfig().sampling().num_return == 10
    assert PseudoQueryConfig().source is QuerySource.SPANS  # the default until the GPU ablation says otherwise


def test_warm_start_tunes_the_generator_from_the_recorded_generator_model_not_the_dsi_model(tok, tmp_path):
    """A warm start's starting model learned an index (it writes index sequences): the generator comes from
    the generator model its record names (else the default model), never from a copy of it."""
    from adbatch.artifacts import write_json_atomic
    from adbatch.training.index_training import _query_generator

    warm = tmp_path / "last_night"
    write_json_atomic(warm / "adbatch_training.json", {"trained_on_index": "abc",
                                                       "query_gen": {"generator_model": str(tmp_path / "base")}})
    model = tiny(tok)
    _, source = _query_generator(warm, "abc", FAST, model, tok, loaded_given=True)
    assert source == str(tmp_path / "base")
    write_json_atomic(warm / "adbatch_training.json", {"trained_on_index": "abc"})
    assert _query_generator(warm, "abc", FAST, model, tok, loaded_given=True)[1] == "default"
    assert _query_generator(warm, "abc", FAST.replace(generator_model="/m"), model, tok, loaded_given=True)[1] == "/m"
    # a cold start: a copy of the starting model (the same weights, another object), named as it was given
    load, source = _query_generator(None, None, FAST, model, tok, loaded_given=True)
    copy_model, copy_tok = load()
    assert source is None and copy_model is not model and copy_tok is tok
    assert all(torch.equal(a, b) for a, b in zip(copy_model.state_dict().values(), model.state_dict().values()))


def test_train_job_config_carries_the_query_generator():
    from pipelines.train import TrainJobConfig

    job = TrainJobConfig.from_dict({"train": {"pseudo_queries": {"source": "mix"}},
                                    "query_gen": {"queries_per_ad": 4, "train": {"epochs": 1}}})
    assert job.train.pseudo_queries.source is QuerySource.MIX and job.query_gen.queries_per_ad == 4
    assert job.query_gen.train.epochs == 1 and job.query_gen.train.lr == QueryGenTrainConfig().lr  # defaults kept
    assert TrainJobConfig.from_dict(job.to_dict()) == job
