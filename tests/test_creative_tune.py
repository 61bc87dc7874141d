"""The creative fine-tune (adbatch/training/creatives.py): headline pairs, the tuned prompt, both shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from adbatch.config import ConfigError
from adbatch.serving.prompts import (CREATIVE_EXAMPLES, CreativePrompt, CreativePromptMismatchError, TUNED_CREATIVE_PROMPT_VERSION,
                             creative_prompt_of, creative_prompt_text, declare_creative_prompt, encode_creative_prompt,
                             encode_creative_target)
from adbatch.training.creatives import (CreativeTrainConfig, CreativeTuneConfig, CreativeTuneShape, HeadlinePairsConfig,
                                        creative_examples,
                                        freeze_below, headline_pairs, read_headline_pairs, tune_creatives)
from adbatch.training.trainer import TrainConfig
from conftest import REPO, make_tiny_llama

REPO_EXAMPLES = REPO / "examples"

ROWS = [
    {"ad_id": "a0", "advertiser": "Northbrook Dental", "title": "Smiles You Can Trust",
     "description": "Family dentistry with evening hours.", "industry": "medical practice"},
    {"ad_id": "a1", "advertiser": "Gridline", "title": "Payroll Done in Minutes",
     "description": "Payroll and HR software for small teams.", "industry": "computer software"},
    {"ad_id": "a2", "advertiser": "Copycat", "title": "Payroll and HR software",  # copies the description
     "description": "Payroll and HR software for growing companies.", "industry": "computer software"},
    {"ad_id": "a3", "advertiser": "Nohead", "title": "  ", "description": "No headline here.", "industry": "x"},
    {"ad_id": "a1", "advertiser": "Gridline", "title": "Dup", "description": "dup", "industry": "y"},
    {"ad_id": "a4", "advertiser": "Held", "title": "Requested Ad", "description": "Asked for a headline.",
     "industry": "z"},
    {"ad_id": "a5", "advertiser": "Testy", "title": "A Test Headline", "description": "A row of the test set.",
     "industry": "z"},
    {"ad_id": "a6", "advertiser": "Blue Fern", "title": "Fresh Flowers, Delivered Today",
     "description": "Same-day bouquets across the city.", "industry": "retail"},
]


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def tiny(tok, seed=0):
    return make_tiny_llama(vocab_size=len(tok), hidden=64, layers=2, seed=seed).float()


def test_pairs_skip_reasons_are_counted_and_held_out_rows_never_train():
    pairs = headline_pairs(ROWS, HeadlinePairsConfig(), exclude_ad_ids=["a4"],
                           exclude_texts=["a ROW of the test  set."])
    assert pairs.ad_ids == ["a0", "a1", "a6"]
    assert pairs.headlines[1] == "Payroll Done in Minutes"
    assert pairs.stats["skipped"] == {"headline_copies_fields": 1, "no_headline": 1, "duplicate_ad_id": 1,
                                      "held_out_ad": 1, "held_out_text": 1}
    assert pairs.stats["rows"] == len(ROWS) and pairs.stats["pairs"] == 3
    # the headline column is never an input field
    assert all("title" not in f for f in pairs.fields) and pairs.fields[0]["advertiser"] == "Northbrook Dental"
    keep_all = headline_pairs(ROWS, HeadlinePairsConfig(max_copy_fraction=1.0))
    assert "a2" in keep_all.ad_ids
    sample = headline_pairs(ROWS, HeadlinePairsConfig(max_copy_fraction=1.0, max_pairs=2, seed=1))
    assert len(sample) == 2 and sample.stats["skipped"]["not_sampled"] == len(keep_all) - 2
    assert sample.content_hash() == headline_pairs(ROWS, HeadlinePairsConfig(max_copy_fraction=1.0, max_pairs=2,
                                                                            seed=1)).content_hash()
    assert sample.content_hash() != keep_all.content_hash()
    with pytest.raises(ConfigError):
        HeadlinePairsConfig(max_copy_fraction=0.0).validate()


def test_read_pairs_from_a_corpus_file_names_a_missing_headline_column(tmp_path, example_ads):
    path = tmp_path / "ads.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_headline_pairs(path).ad_ids == ["a0", "a1", "a4", "a5", "a6"]
    with pytest.raises(ConfigError, match="headline"):
        read_headline_pairs(path, HeadlinePairsConfig(headline="slogan"))
    ex = read_headline_pairs(example_ads)  # the bundled corpus: title is the human headline
    assert ex.stats["fields"] == ["advertiser", "description", "industry"]
    assert 2500 < len(ex) < ex.stats["rows"] == 5346


def test_tuned_prompt_has_no_worked_examples_and_target_ends_with_eos(tok):
    ad = ROWS[0]
    few = tok.decode(encode_creative_prompt(tok, ad))
    tuned_ids = encode_creative_prompt(tok, ad, style=CreativePrompt.TUNED)
    tuned = tok.decode(tuned_ids)
    assert CREATIVE_EXAMPLES[0][1] in few and CREATIVE_EXAMPLES[0][1] not in tuned
    assert "Advertiser: Northbrook Dental" in tuned and len(tuned_ids) < len(encode_creative_prompt(tok, ad)) / 2
    target = encode_creative_target(tok, "Smiles  You Can Trust")
    assert target[-1] == tok.eos_token_id
    # prompt + target is exactly the chat rendering of the answered conversation (up to the template's newline)
    answered = tok.apply_chat_template(
        [{"role": "system", "content": creative_prompt_text(ad, style=CreativePrompt.TUNED).split("\n")[0]},
         {"role": "user", "content": creative_prompt_text(ad, style=CreativePrompt.TUNED).split("\n", 1)[1]},
         {"role": "assistant", "content": "Smiles You Can Trust"}], tokenize=False)
    assert answered.startswith(tok.decode(tuned_ids + target))
    with pytest.raises(ValueError):
        encode_creative_target(tok, "   ")


def test_model_declares_its_creative_prompt_and_another_version_is_refused(tmp_path):
    model = make_tiny_llama()
    assert creative_prompt_of(model) is CreativePrompt.FEW_SHOT
    declare_creative_prompt(model)
    model.save_pretrained(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert creative_prompt_of(again) is CreativePrompt.TUNED
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["adbatch_creative_prompt"]["version"] = TUNED_CREATIVE_PROMPT_VERSION + 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CreativePromptMismatchError, match="fine-tune it again"):
        creative_prompt_of(AutoModelForCausalLM.from_pretrained(tmp_path / "m"))


def test_separate_shape_trains_saves_and_serves_with_the_tuned_prompt(tok, tmp_path):
    from adbatch.decoding import CreativeConfig
    from adbatch.serving.generators import CreativeGenerator, GenerateConfig, ModelSpec

    pairs = headline_pairs(ROWS, HeadlinePairsConfig())
    ex = creative_examples(tok, pairs)
    assert set(ex.kinds.tolist()) == {3} and len(ex) == 5
    plen = int(ex.prompt_lens[0])
    assert ex.tokens[:plen].tolist() == encode_creative_prompt(tok, pairs.fields[0], style=CreativePrompt.TUNED)
    # unmasked (delex off): the tuned prompt as written; the masked default is tested below and in test_creative_truth
    cfg = CreativeTuneConfig(enabled=True, delex="off", train=CreativeTrainConfig(epochs=30, lr=3e-3, batch_tokens=1024,
                                                                            log_every=1, warmup_fraction=0.0))
    out = tmp_path / "creative_model"
    _, _, summary = tune_creatives(pairs, out, cfg, model=tiny(tok), tokenizer=tok.__class__.from_pretrained(
        tok.name_or_path), device="cpu", progress=False)
    losses = [v for _, v in summary["losses"]]
    assert losses[-1] < 0.5 * losses[0]
    record = json.loads((out / "adbatch_training.json").read_text())
    assert record["trained_on_index"] is None and record["task"] == "creatives"
    assert record["creative"]["pairs_hash"] == pairs.content_hash() and record["creative"]["shape"] == "separate"
    gen = CreativeGenerator(ModelSpec(model=str(out)), CreativeConfig(max_new_tokens=8),
                            GenerateConfig(device="cpu", batch_size=4))
    assert gen.prompt_style is CreativePrompt.TUNED
    answers = gen(pa.Table.from_pylist([{"request_id": "r0", "ad_id": "a0", **pairs.fields[0]}]))
    text = answers.column("headlines").to_pylist()[0][0]
    # the generator fed the tuned prompt: the same text as decoding that prompt directly, and the tiny
    # model's start of its first pair's headline
    from adbatch.decoding import generate_creatives

    direct = generate_creatives(gen.model, gen.tokenizer, [encode_creative_prompt(
        gen.tokenizer, pairs.fields[0], style=CreativePrompt.TUNED)], CreativeConfig(max_new_tokens=8))
    assert text == direct[0][0][0] and text.strip() and pairs.headlines[0].startswith(text.strip())


def test_masked_fine_tune_declares_its_masking_and_records_it(tok, tmp_path):
    from adbatch.serving.delex import DelexMode, delex_of
    from transformers import AutoModelForCausalLM

    pairs = headline_pairs(ROWS, HeadlinePairsConfig())
    assert CreativeTuneConfig().delex is DelexMode.OFF  # the default, until a GPU run measures the masking
    cfg = CreativeTuneConfig(enabled=True, delex=DelexMode.ENTITIES,
                             train=CreativeTrainConfig(max_steps=1, batch_tokens=512, warmup_fraction=0.0))
    out = tmp_path / "masked_model"
    tune_creatives(pairs, out, cfg, model=tiny(tok), tokenizer=tok.__class__.from_pretrained(tok.name_or_path),
                   device="cpu", progress=False)
    record = json.loads((out / "adbatch_training.json").read_text())
    assert record["creative"]["delex"] == "entities" and record["creative"]["config"]["delex"] == "entities"
    assert delex_of(AutoModelForCausalLM.from_pretrained(out)) is DelexMode.ENTITIES
    # the shared shape builds its examples unmasked: its record says so
    from adbatch.training.creatives import creative_record

    assert creative_record(cfg.replace(shape=CreativeTuneShape.SHARED), pairs)["delex"] == "off"


def test_creative_fine_tune_with_qat_records_the_grid_compress_follows(tok, tmp_path):
    from adbatch.compress import CompressConfig
    from adbatch.compress.recipe import GroupPolicy, follow_training_qat
    from adbatch.training.quant_aware import QuantAwareConfig

    pairs = headline_pairs(ROWS, HeadlinePairsConfig())
    train = CreativeTrainConfig(epochs=4, lr=1e-3, batch_tokens=512, warmup_fraction=0.0,
                                qat=QuantAwareConfig(enabled=True, start_fraction=0.5, group_size=32))
    out = tmp_path / "creative_qat"
    _, _, summary = tune_creatives(pairs, out, CreativeTuneConfig(enabled=True, train=train), model=tiny(tok),
                                   tokenizer=tok.__class__.from_pretrained(tok.name_or_path), device="cpu",
                                   progress=False)
    record = json.loads((out / "adbatch_training.json").read_text())
    assert record["qat"] == summary["qat"] and record["qat"]["group_size"] == 32
    assert 1 <= record["qat"]["steps"] <= summary["train"]["steps"] // 2 + 1
    cfg, note = follow_training_qat(CompressConfig(), record)
    assert cfg.group_policy is GroupPolicy.UNIFORM and cfg.reference_group_size == 32 and not cfg.clip_search
    assert note and "QAT" in note
    with pytest.raises(ConfigError):  # sparsity stays refused for the creative fine-tune
        CreativeTuneConfig(train=CreativeTrainConfig(sparsity=train.sparsity.replace(enabled=True))).validate()


def test_train_layers_freezes_all_but_the_top_layers(tok):
    model = tiny(tok)
    n = freeze_below(model, 1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith(("model.layers.1.", "model.norm")) for name in trainable)
    assert n == sum(p.numel() for p in model.model.layers[1].parameters()) + model.model.norm.weight.numel()
    with pytest.raises(ConfigError):
        CreativeTuneConfig(train_layers=0).validate()


def test_shared_shape_mixes_pairs_into_the_targeting_training(tok, tmp_path):
    from test_training import TITLES, fake_index

    from adbatch.training import train_on_index

    idx = fake_index(tok, "text")
    pairs = headline_pairs(ROWS, HeadlinePairsConfig())
    cfg = CreativeTuneConfig(enabled=True, shape=CreativeTuneShape.SHARED, repeat=2)
    model, _, summary = train_on_index(idx, tmp_path / "m", TrainConfig(epochs=1, lr=1e-3, batch_tokens=512),
                                       ad_texts=dict(zip(idx.ad_ids, TITLES)), model=tiny(tok),
                                       tokenizer=tok.__class__.from_pretrained(tok.name_or_path), device="cpu",
                                       progress=False, creative_pairs=pairs, creative_config=cfg)
    assert summary.data["creative_pairs"]["examples"] == 2 * len(pairs)
    assert creative_prompt_of(model) is CreativePrompt.TUNED
    record = json.loads((tmp_path / "m" / "adbatch_training.json").read_text())
    assert record["trained_on_index"] == idx.index_hash and record["creative"]["shape"] == "shared"


def test_refresh_pairs_hold_out_requested_ads_and_eval_rows(tmp_path, example_ads):
    from adbatch.serving.requests import GenerateTask
    from adbatch.training.creatives import load_headline_pairs
    from jobs.nightly_refresh import RefreshConfig, _creative_pairs

    requests = tmp_path / "req.parquet"
    pq.write_table(pa.table({"request_id": ["c0", "c1"], "ad_id": ["slogan-00000", "slogan-00001"],
                             "advertiser": ["x", "y"]}), requests)
    test_csv = tmp_path / "test.csv"
    test_csv.write_text("desc,output,company,industry,url,alias\n"
                        "\"Powerful lead generation software that converts abandoning visitors into subscribers with "
                        "our dynamic marketing tools and Exit Intent® technology.\",Other,c,i,u,a\n")
    cfg = RefreshConfig(work=tmp_path / "work")
    cfg = cfg.replace(train=cfg.train.replace(creatives=CreativeTuneConfig(enabled=True)),
                      eval=cfg.eval.replace(config=cfg.eval.config.replace(
                          creatives=cfg.eval.config.creatives.replace(csv=test_csv))))
    path, digest = _creative_pairs(cfg, example_ads, {GenerateTask.CREATIVES: [requests]}, tmp_path)
    pairs = load_headline_pairs(path)
    assert pairs.stats["skipped"]["held_out_ad"] == 2 and pairs.stats["skipped"]["held_out_text"] == 1
    assert "slogan-00000" not in pairs.ad_ids and "slogan-00002" not in pairs.ad_ids  # the test row's description
    assert digest == pairs.content_hash() and pairs.fields[0] == {k: v for k, v in pairs.fields[0].items() if v}
    again, digest2 = _creative_pairs(cfg.replace(train=cfg.train.replace(creatives_hold_out_requested=False)),
                                     example_ads, {GenerateTask.CREATIVES: [requests]}, tmp_path / "b")
    assert digest2 != digest and "slogan-00000" in load_headline_pairs(again).ad_ids


def test_refresh_config_rules_for_the_creative_fine_tune():
    from jobs.nightly_refresh import RefreshConfig

    cfg = RefreshConfig()
    with pytest.raises(ConfigError, match="creatives_model = tuned"):
        cfg.replace(generate=cfg.generate.replace(creatives_model="tuned")).validate()
    shared = CreativeTuneConfig(enabled=True, shape=CreativeTuneShape.SHARED)
    with pytest.raises(ConfigError, match="shared"):
        cfg.replace(train=cfg.train.replace(enabled=False, creatives=shared)).validate()
    cfg.replace(train=cfg.train.replace(creatives=CreativeTuneConfig(enabled=True)),
                generate=cfg.generate.replace(creatives_model="tuned")).validate()


def _refresh_with_fake_creative_stages(monkeypatch, trained: list, generated: list):
    """The refresh without Ray (test_jobs._refresh_without_ray) whose train_creatives and generate stages
    record their jobs in ``trained`` / ``generated`` and write only their marker files."""
    import pipelines.generate
    import pipelines.train
    from adbatch.artifacts import write_json_atomic
    from test_jobs import _refresh_without_ray

    def fake_tune(job):
        trained.append(job)
        write_json_atomic(Path(job.out) / "adbatch_training.json",
                          {"trained_on_index": None, "task": "creatives", "train": {"steps": len(trained)},
                           "creative": {"pairs": {"pairs": 1}}})
        return {}

    def fake_generate(job):
        generated.append(job)
        write_json_atomic(Path(job.out) / "manifest.json", {"stage": "generate"})
        return {}

    nr = _refresh_without_ray(monkeypatch)
    monkeypatch.setattr(pipelines.train, "run_train_creatives", fake_tune)
    monkeypatch.setattr(pipelines.generate, "run_generate", fake_generate)
    return nr


def test_refresh_trains_the_creative_model_only_when_its_inputs_change(tmp_path, monkeypatch):
    """Stage logic without Ray: train_creatives runs, generate-creatives is served by its folder, a second run
    skips both; another creative train config or another tuned prompt version retrains."""
    import adbatch.serving.prompts

    trained, generated = [], []
    nr = _refresh_with_fake_creative_stages(monkeypatch, trained, generated)
    cfg = nr.RefreshConfig.from_dict({
        "work": str(tmp_path / "work"), "index": {"config": {"ads": "examples/slogan_ads.parquet"}, "stable_ids": False},
        "train": {"enabled": False, "creatives": {"enabled": True}}, "compress": {"enabled": False},
        "eval": {"enabled": False},
        "generate": {"targets_requests": None, "creatives_model": "tuned"}})
    first = nr.run_refresh(cfg)
    assert first["stages"]["train_creatives"]["status"] == "ran" and first["creatives_prompt"] == "tuned"
    assert Path(generated[-1].model) == Path(first["creative_model"]) and generated[-1].compressed is None
    pairs = pq.read_table(trained[-1].pairs).column("ad_id").to_pylist()
    requested = pq.read_table(REPO_EXAMPLES / "requests_creatives.parquet").column("ad_id").to_pylist()
    assert not set(pairs) & set(requested)
    second = nr.run_refresh(cfg)
    assert second["stages"]["train_creatives"]["status"] == "skipped"
    assert second["stages"]["generate_creatives"]["status"] == "skipped"
    lr = cfg.replace(train=cfg.train.replace(creatives=cfg.train.creatives.replace(
        train=cfg.train.creatives.train.replace(lr=3e-4))))
    assert nr.run_refresh(lr)["stages"]["train_creatives"]["status"] == "ran"
    monkeypatch.setattr(adbatch.serving.prompts, "TUNED_CREATIVE_PROMPT_VERSION", adbatch.serving.prompts.TUNED_CREATIVE_PROMPT_VERSION + 1)
    again = nr.run_refresh(lr)
    assert again["stages"]["train_creatives"]["status"] == "ran" and again["stages"]["generate_creatives"]["status"] == "ran"
    assert len(trained) == 3


def test_refresh_serves_the_creative_model_compressed_when_asked(tmp_path, monkeypatch):
    """generate.creatives_use = compressed: the creative fine-tune runs with QAT, stage compress_creatives
    compresses its model with the compress stage's settings, generate-creatives reads that checkpoint, and a
    new creative model recompresses; the default (dense) serves the creative folder and compresses nothing."""
    import pipelines.compress
    from adbatch.artifacts import write_json_atomic
    from adbatch.config import ConfigError

    trained, compressed, generated = [], [], []

    def fake_compress(job):
        compressed.append(job)
        write_json_atomic(Path(job.out) / "manifest.json", {"stage": "compress", "model": str(job.model),
                                                            "n": len(compressed)})
        return {}

    nr = _refresh_with_fake_creative_stages(monkeypatch, trained, generated)
    monkeypatch.setattr(pipelines.compress, "run_compress", fake_compress)
    base = {"work": str(tmp_path / "work"), "index": {"config": {"ads": "examples/slogan_ads.parquet"}, "stable_ids": False},
            "train": {"enabled": False, "creatives": {"enabled": True}}, "eval": {"enabled": False},
            "compress": {"config": {"eval_texts": 3}},
            "generate": {"targets_requests": None, "creatives_model": "tuned", "creatives_use": "compressed"}}
    cfg = nr.RefreshConfig.from_dict(base)
    first = nr.run_refresh(cfg)
    assert first["stages"]["compress_creatives"]["status"] == "ran"
    assert trained[-1].creatives.train.qat.enabled and trained[-1].creatives.train.qat.start_fraction == 0.0
    creative_job = compressed[-1]
    assert Path(creative_job.model) == Path(first["creative_model"]) and creative_job.eval_texts == 3
    assert creative_job.index is None and creative_job.queries is None
    assert generated[-1].model is None and Path(generated[-1].compressed) == Path(first["creative_compressed"])
    again = nr.run_refresh(cfg)
    assert again["stages"]["compress_creatives"]["status"] == "skipped"
    assert again["stages"]["generate_creatives"]["status"] == "skipped"
    # a retrained creative model is compressed again and its headlines rewritten
    lr = cfg.replace(train=cfg.train.replace(creatives=cfg.train.creatives.replace(
        train=cfg.train.creatives.train.replace(lr=3e-4))))
    third = nr.run_refresh(lr)
    assert third["stages"]["compress_creatives"]["status"] == "ran"
    assert third["stages"]["generate_creatives"]["status"] == "ran"
    # the default serves the creative folder dense and trains without QAT
    n = len(compressed)
    dense = nr.RefreshConfig.from_dict({**base, "work": str(tmp_path / "dense"),
                                        "generate": {**base["generate"], "creatives_use": "dense"}})
    out = nr.run_refresh(dense)
    assert "compress_creatives" not in out["stages"] and out["creative_compressed"] is None
    assert not trained[-1].creatives.train.qat.enabled
    assert Path(generated[-1].model) == Path(out["creative_model"]) and generated[-1].compressed is None
    assert len(compressed) == n + 1  # the targeting model's compress stage only
    with pytest.raises(ConfigError, match="creatives_use = compressed"):
        nr.RefreshConfig.from_dict({**base, "generate": {**base["generate"], "creatives_model": "base"}})
    with pytest.raises(ConfigError, match="creatives_use = compressed"):
        nr.RefreshConfig.from_dict({**base, "compress": {"enabled": False}})


def test_run_train_creatives_on_ray_train_writes_a_marked_creative_model(tmp_path, ray_local):
    from test_generate_support import tiny_model_dir

    from adbatch.artifacts import artifact_kind
    from adbatch.training.creatives import write_headline_pairs
    from pipelines.train import CreativeTrainJobConfig, run_train_creatives

    pairs = write_headline_pairs(headline_pairs(ROWS, HeadlinePairsConfig()), tmp_path / "pairs.parquet")
    cfg = CreativeTuneConfig(enabled=True, train=CreativeTrainConfig(epochs=1, batch_tokens=512))
    out = run_train_creatives(CreativeTrainJobConfig(out=tmp_path / "creative", pairs=pairs,
                                                     init_model=str(tiny_model_dir(tmp_path)), creatives=cfg))
    assert out["pairs"] == 5 and out["train_steps"] >= 1
    assert artifact_kind(tmp_path / "creative") == "train"
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "creative").adbatch_creative_prompt["style"] == "tuned"
    with pytest.raises(ConfigError):
        CreativeTrainJobConfig(out=tmp_path / "x").validate()
