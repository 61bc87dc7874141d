"""Training on tiny random-init Llamas (CPU): data, loss going down, code tokens, progressive
sparsity, checkpoints bound to their index, and the Ray Train path."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_tiny_llama
from adbatch.training import (IndexMismatchError, SparsityScheduleConfig, TrainConfig,
                              check_index_compat, load_masks, read_training_record, train_on_index)
from adbatch.training.data import ExampleKind, build_examples, collate, repeat_kinds, token_budget_batches
from adbatch.training.sparsity import ProgressiveSparsity, prunable_linears
from adbatch.training.trainer import lr_lambda

TITLES = [
    "Simpson Strong-Tie 12-Gauge Angle", "BEHR Premium Textured DeckOver 1-gal. Tugboat",
    "Delta Vero 1-Handle Shower Faucet Trim Kit in Chrome", "Whirlpool 1.9 cu. ft. Convection Microwave",
    "Hampton Bay 3-Light Brushed Nickel Ceiling Fixture", "Husky 52 in. 10-Drawer Mobile Workbench",
    "Rheem Performance 40 Gal. Electric Water Heater", "RIDGID 18-Volt Cordless Drill Kit",
]
QUERIES = [("angle bracket", 0), ("deck over", 1), ("shower faucet", 2), ("microwave", 3)]


def fake_index(tokenizer, scheme: str, titles=TITLES, salt: str = ""):
    """An AdIndex stand-in with the documented attributes (ad_codes.token_ids, manifest, hash)."""
    import pyarrow as pa

    base = len(tokenizer)
    ad_ids = list(range(100, 100 + len(titles)))
    if scheme == "text":
        tokens = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in titles]
        special = []
    else:  # two levels of 2-4 clusters; code token i has id base + i
        special = [f"<c{d}_{j}>" for d in range(2) for j in range(4)]
        tokens = [[base + (r % 2), base + 4 + r // 2] for r in range(len(titles))]
    table = pa.table({"ad_id": ad_ids, "token_ids": tokens, "text": titles})
    digest = hashlib.sha256((scheme + salt + repr(tokens)).encode()).hexdigest()
    manifest = {"scheme": scheme, "base_vocab_size": base, "special_tokens": special}
    return SimpleNamespace(ad_codes=table, ad_ids=ad_ids, manifest=manifest, scheme=scheme, index_hash=digest)


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def tiny(tok, seed=0):
    return make_tiny_llama(vocab_size=len(tok), hidden=64, layers=2, seed=seed).float()


def test_examples_and_batches(tok):
    idx = fake_index(tok, "text")
    ex, stats = build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                               dict(zip(idx.ad_ids, TITLES)), [(q, 100 + r) for q, r in QUERIES] + [("x", 999)])
    assert stats["indexing"] == 8 and stats["retrieval"] == 4 and stats["labelled_not_in_index"] == 1
    assert len(ex) == 12 and int((ex.kinds == int(ExampleKind.RETRIEVAL)).sum()) == 4
    # every labelled pair missing the index (here: ad ids as strings, the index's are ints) is an error
    with pytest.raises(ValueError, match="none of the 4 labelled pairs"):
        build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                       dict(zip(idx.ad_ids, TITLES)), [(q, str(100 + r)) for q, r in QUERIES])
    # the target of example 0 is exactly the index's token_ids of row 0, after the prompt
    e0 = ex.tokens[ex.offsets[0] + ex.prompt_lens[0]:ex.offsets[1]].tolist()
    assert e0 == idx.ad_codes.column("token_ids").to_pylist()[0]
    gen = torch.Generator().manual_seed(0)
    batches = token_budget_batches(ex.lengths, 200, gen)
    assert sorted(torch.cat(batches).tolist()) == list(range(12))
    assert all(len(b) * int(ex.lengths[b].max()) <= 200 or len(b) == 1 for b in batches)
    b = collate(ex, torch.tensor([0, 9]), pad_id=tok.pad_token_id)
    assert b.input_ids.shape[0] == 2
    n_target = int((ex.lengths[[0, 9]] - ex.prompt_lens[[0, 9]].long()).sum())
    assert int((b.labels != -100).sum()) == n_target
    # host-side target positions / token count (no device sync in the training step)
    assert b.num_tokens == int(b.attention_mask.sum()) == int(ex.lengths[[0, 9]].sum())
    L = b.labels.shape[1]
    want = [r * (L - 1) + c for r in range(2) for c in range(L - 1) if int(b.labels[r, c + 1]) != -100]
    assert b.target_index.tolist() == want and len(want) == n_target
    sub = ex.select(torch.tensor([9, 0]))
    assert sub.tokens[: int(sub.lengths[0])].tolist() == ex.tokens[ex.offsets[9]:ex.offsets[10]].tolist()
    # extra copies per epoch of one kind (retrieval x3): 8 indexing + 3 x 4 retrieval, each copy intact
    rep = repeat_kinds(ex, {ExampleKind.INDEXING: 1, ExampleKind.RETRIEVAL: 3})
    assert len(rep) == 8 + 12 and int((rep.kinds == int(ExampleKind.RETRIEVAL)).sum()) == 12
    assert sorted(rep.rows[rep.kinds == int(ExampleKind.RETRIEVAL)].tolist()) == sorted(
        ex.rows[ex.kinds == int(ExampleKind.RETRIEVAL)].tolist() * 3)
    assert rep.tokens[rep.offsets[-2]:].tolist() == ex.tokens[ex.offsets[-2]:].tolist()
    assert repeat_kinds(ex, {ExampleKind.RETRIEVAL: 1}) is ex


def test_lr_schedule():
    assert lr_lambda(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_lambda(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_lambda(100, 100, 10, 0.1) == pytest.approx(0.1)
    mid = lr_lambda(55, 100, 10, 0.0)
    assert mid == pytest.approx(0.5, abs=1e-9)


@pytest.mark.parametrize("scheme", ["text", "codes"])
def test_loss_decreases_and_checkpoint_binds_index(tok, tmp_path, scheme):
    idx = fake_index(tok, scheme)
    cfg = TrainConfig(epochs=15, lr=1e-2, batch_tokens=256, warmup_fraction=0.1, log_every=5, seed=0)
    model, tok2, summary = train_on_index(
        idx, tmp_path / "model", cfg, ad_texts=dict(zip(idx.ad_ids, TITLES)),
        labelled=[(q, 100 + r) for q, r in QUERIES], model=tiny(tok), tokenizer=tok.__class__.from_pretrained(tok.name_or_path),
        device="cpu", progress=False)
    first, final = summary.train["first_loss"], summary.train["final_loss"]
    assert final < 0.4 * first, (first, final)
    if scheme == "codes":
        base = idx.manifest["base_vocab_size"]
        assert tok2.convert_tokens_to_ids(idx.manifest["special_tokens"]) == list(range(base, base + 8))
        assert model.get_input_embeddings().weight.shape[0] == base + 8
        # tokens <c0_2>, <c0_3> belong to no ad: they fall back to the vocabulary mean
        assert summary.embedding_init == {"code_tokens": 8, "initialised": 8, "from_ads": 6, "fallback": 2}
    rec = check_index_compat(tmp_path / "model", idx)
    assert rec["trained_on_index"] == idx.index_hash and rec["scheme"] == scheme
    other = fake_index(tok, scheme, salt="changed")
    with pytest.raises(IndexMismatchError, match="trained on index"):
        check_index_compat(tmp_path / "model", other)
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_code_embedding_init_is_member_mean(tok):
    from adbatch.training.vocab import add_index_tokens, init_code_embeddings

    idx = fake_index(tok, "codes")
    model, t = tiny(tok), tok.__class__.from_pretrained(tok.name_or_path)
    base = len(t)
    before = model.get_input_embeddings().weight[:base].detach().clone()
    assert add_index_tokens(t, idx.manifest["special_tokens"], base) == 0  # all 8 added
    targets = idx.ad_codes.column("token_ids").to_pylist()
    init_code_embeddings(model, t, targets, TITLES, base, 8)
    emb = model.get_input_embeddings().weight.detach()
    # token <c0_1> (id base+1) is in the targets of the odd rows
    members = [r for r in range(8) if base + 1 in targets[r]]
    want = torch.stack([before[t(TITLES[r], add_special_tokens=False)["input_ids"]].mean(0) for r in members]).mean(0)
    torch.testing.assert_close(emb[base + 1], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(emb[:base], before)  # base rows untouched
    with pytest.raises(ValueError, match="base_vocab_size"):
        add_index_tokens(t, ["<other>"], base)
    # an incremental index appends tokens: the 8 learned rows stay, only the new ones are initialised
    special = idx.manifest["special_tokens"] + ["<c2_0>", "<c2_1>"]
    assert add_index_tokens(t, idx.manifest["special_tokens"], base) == 8  # nothing to add
    assert add_index_tokens(t, special, base) == 8 and len(t) == base + 10
    learned = model.get_input_embeddings().weight[base:base + 8].detach().clone()
    stats = init_code_embeddings(model, t, [s + [base + 8] for s in targets], TITLES, base, 10, first_new=8)
    assert stats["initialised"] == 2 and torch.equal(model.get_input_embeddings().weight[base:base + 8], learned)
    with pytest.raises(ValueError, match="other code tokens"):
        add_index_tokens(t, ["<x>"] + special[1:], base)


def test_untrained_model_refused(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(IndexMismatchError, match="no adbatch_training.json"):
        check_index_compat(tmp_path / "m", "ab" * 32)
    assert check_index_compat(tmp_path / "m", "ab" * 32, allow_untrained=True) is None


def test_schedule_levels():
    model = make_tiny_llama(vocab_size=64, hidden=32, intermediate=64)
    ps = ProgressiveSparsity(model, SparsityScheduleConfig(enabled=True, start_fraction=0.2, end_fraction=0.8), 100)
    ns = [ps.n_at(s, 2) for s in range(100)]
    assert ns[:20] == [4] * 20 and ns[80:] == [2] * 20
    assert all(a >= b for a, b in zip(ns, ns[1:])) and set(ns) == {4, 3, 2}
    n1 = [ps.n_at(s, 1) for s in range(100)]
    assert set(n1) == {4, 3, 2, 1} and n1[79] == 1


@pytest.mark.slow
def test_progressive_sparsity_hits_target(tok, tmp_path):
    idx = fake_index(tok, "text")
    sp = SparsityScheduleConfig(enabled=True, final_n=2, one_four_fraction=0.5, start_fraction=0.2,
                                end_fraction=0.6, rescore_every=2)
    cfg = TrainConfig(epochs=30, lr=3e-3, batch_tokens=1024, log_every=2, sparsity=sp)
    model, _, summary = train_on_index(idx, tmp_path / "sparse", cfg, ad_texts=dict(zip(idx.ad_ids, TITLES)),
                                       labelled=[(q, 100 + r) for q, r in QUERIES], model=tiny(tok),
                                       tokenizer=tok, device="cpu", progress=False)
    layers = prunable_linears(model)
    masks = load_masks(tmp_path / "sparse")
    assert set(masks) == set(layers) == set(summary.sparsity["patterns"])
    n_per_layer = {}
    for name, mod in layers.items():
        w = mod.weight.detach().reshape(mod.out_features, -1, 4)
        m = masks[name].reshape(mod.out_features, -1, 4)
        per_group = m.sum(-1)
        assert per_group.min() == per_group.max(), name  # exactly n in every group
        n_per_layer[name] = int(per_group[0, 0])
        assert torch.all(w[~m] == 0), name  # masked weights stay zero
        assert summary.sparsity["patterns"][name] == f"{n_per_layer[name]}:4"
    assert sorted(n_per_layer.values()).count(1) == round(0.5 * len(layers))
    assert set(n_per_layer.values()) == {1, 2}
    want = sum(layers[n].weight.numel() * k / 4 for n, k in n_per_layer.items()) / sum(
        m.weight.numel() for m in layers.values())
    assert summary.sparsity["density"] == pytest.approx(want)
    # density went down in steps over the run and the loss still fell
    dens = [d for _, d in summary.density]
    assert dens[0] == 1.0 and all(a >= b - 1e-12 for a, b in zip(dens, dens[1:]))
    assert summary.train["final_loss"] < summary.train["first_loss"]
    rec = read_training_record(tmp_path / "sparse")
    assert rec["sparsity"]["frozen"] is True and rec["layer_patterns"] == summary.sparsity["patterns"]


def _tiny_corpus(tmp_path, n=24):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    titles = [f"{TITLES[i % len(TITLES)]} model {i}" for i in range(n)]
    emb = rng.standard_normal((n, 8)).astype(np.float32)
    path = tmp_path / "ads.parquet"
    pq.write_table(pa.table({"ad_id": pa.array(range(1000, 1000 + n), pa.int64()), "title": titles,
                             "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), 8)}), path)
    queries = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": ["angle bracket", "deck over"], "ad_id": pa.array([1000, 1001], pa.int64())}), queries)
    return path, queries, titles


def tiny_train_job_inputs(tmp_path, tok):
    """A Ray train job's inputs on disk: the tiny corpus and labelled queries, its index (``tmp_path /
    "index"``, text ids) and a tiny random model with the tokenizer (``tmp_path / "init"``). Returns
    ``(ads, queries, titles, index, init, index_config)``."""
    from adbatch.index.build import IndexConfig, build_index, load_index
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.ids import IdScheme, RenderConfig

    ads, queries, titles = _tiny_corpus(tmp_path)
    cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                      cluster=ClusterConfig(branching=2, leaf_size=6), render=RenderConfig(scheme=IdScheme.TEXT))
    build_index(ads, tmp_path / "index", cfg, progress=False)
    init = tmp_path / "init"
    tiny(tok).save_pretrained(init)
    tok.save_pretrained(init)
    return ads, queries, titles, load_index(tmp_path / "index"), init, cfg


@pytest.mark.slow
def test_ray_train_one_worker_and_warm_start(tmp_path, tok, ray_local):
    from adbatch.index.build import build_index, load_index
    from pipelines.train import TrainJobConfig, run_train

    ads, queries, titles, index, init, cfg = tiny_train_job_inputs(tmp_path, tok)
    job = TrainJobConfig(index=tmp_path / "index", out=tmp_path / "model", init_model=str(init), ads=ads,
                         queries=queries, num_workers=1,
                         train=TrainConfig(epochs=3, lr=3e-3, batch_tokens=2048, log_every=1))
    out = run_train(job)
    assert out["index_hash"] == index.index_hash and out["scheme"] == "text"
    assert out["examples_indexing"] == 24 and out["examples_retrieval"] == 2
    assert out["train_final_loss"] < out["train_first_loss"]
    rec = check_index_compat(tmp_path / "model", index)
    assert rec["num_ads"] == 24 and rec["warm_started_from_index"] is None
    # the nightly refresh: the corpus changed (one more ad) -> warm start from yesterday's model
    (tmp_path / "v2").mkdir()
    ads2, _, titles2 = _tiny_corpus(tmp_path / "v2", n=25)
    build_index(ads2, tmp_path / "index2", cfg, progress=False)
    index2 = load_index(tmp_path / "index2")
    assert index2.index_hash != index.index_hash
    _, _, summary = train_on_index(index2, tmp_path / "model2", TrainConfig(epochs=1, batch_tokens=2048),
                                   ad_texts=dict(zip(range(1000, 1025), titles2)),
                                   init_model=tmp_path / "model", device="cpu", progress=False)
    assert summary.warm_started_from_index == index.index_hash
    # yesterday's model already knows most of the index: its first loss is far below a fresh model's
    assert summary.train["first_loss"] < out["train_first_loss"]
    assert check_index_compat(tmp_path / "model2", index2)["warm_started_from_index"] == index.index_hash
    with pytest.raises(IndexMismatchError):
        check_index_compat(tmp_path / "model2", index)


def test_creative_rehearsal_examples_and_training(tok, tmp_path, monkeypatch):
    """Creative rehearsal: the starting model's own greedy headline for the creative prompt of a
    sample of ads becomes a CREATIVE example (prompt exactly as the creatives stage encodes it, target
    = headline + EOS; empty headlines skipped); training mixes them in and records the counts. The
    decoder is replaced by a stand-in: a random-init model's greedy text is mostly empty after the
    creative stop strings."""
    import adbatch.decoding.creative as creative
    from adbatch.config import ConfigError
    from adbatch.serving.prompts import encode_creative_prompt
    from adbatch.training.rehearsal import CreativeRehearsalConfig, rehearsal_examples

    seen = []

    def fake_generate(model, tokenizer, prompts, config):
        seen.append((len(prompts), config.max_new_tokens))
        return [[(" " if i else "", -0.5)] if i == 1 else [(f"Great deal {i}", -0.5)] for i in range(len(prompts))]

    monkeypatch.setattr(creative, "generate_creatives", fake_generate)

    idx = fake_index(tok, "text")
    texts = dict(zip(idx.ad_ids, TITLES))
    cfg = CreativeRehearsalConfig(enabled=True, ads=5, max_new_tokens=6, seed=3)
    model = tiny(tok)
    ex, stats = rehearsal_examples(model, tok, idx.ad_ids, texts, cfg)
    again, _ = rehearsal_examples(model, tok, idx.ad_ids, texts, cfg)
    assert seen[0] == (5, 6) and stats == stats | {"sampled": 5, "examples": 4, "empty": 1}
    assert stats["samples"][0] == " Great deal 0"
    assert torch.equal(ex.tokens, again.tokens) and torch.equal(ex.rows, again.rows)  # deterministic
    assert set(ex.kinds.tolist()) == {3}
    for e in range(len(ex)):
        tokens = ex.tokens[ex.offsets[e]:ex.offsets[e + 1]].tolist()
        plen = int(ex.prompt_lens[e])
        assert tokens[:plen] == encode_creative_prompt(tok, {"title": TITLES[int(ex.rows[e])]})
        assert tokens[-1] == tok.eos_token_id and len(tokens) > plen + 1
    train_cfg = TrainConfig(epochs=1, lr=1e-3, batch_tokens=512, creative_rehearsal=cfg.replace(repeat=2))
    _, _, summary = train_on_index(idx, None, train_cfg, ad_texts=texts, model=tiny(tok),
                                   tokenizer=tok.__class__.from_pretrained(tok.name_or_path), device="cpu",
                                   progress=False)
    assert summary.data["creative_rehearsal"]["examples"] == stats["examples"]
    with pytest.raises(ConfigError):
        CreativeRehearsalConfig(ads=0).validate()


@pytest.mark.parametrize("field,value", [("weight_decay", -0.01), ("max_grad_norm", -1.0), ("time_budget_s", 0.0),
                                         ("time_budget_s", -5.0), ("epochs", float("nan")), ("lr", float("inf")),
                                         ("lr", float("nan"))])
def test_train_config_rejects_nonsense(field, value):
    """Negative weight decay (weights pushed outward), a negative clip norm (silently no clipping), a
    time budget that ends before it starts and non-finite epochs / lr are refused up front."""
    from adbatch.config import ConfigError

    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})
    TrainConfig(weight_decay=0.0, max_grad_norm=0.0, time_budget_s=1.0)  # 0 = off stays allowed


def test_index_built_with_another_tokenizer_is_refused(tmp_path, tok):
    """A text index whose token_ids come from another tokenizer (here MiniLM's WordPiece, EOS [SEP])
    must not train into a SmolLM2-vocabulary model: its targets would be other tokens there."""
    import shutil

    from transformers import AutoTokenizer

    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.embeddings import default_embedding_model_dir
    from adbatch.index.build import IndexConfig, build_index, load_index, tokenizer_fingerprint
    from adbatch.index.ids import IdScheme, RenderConfig
    from adbatch.training import prepare_model_for_index

    other = tmp_path / "other_tok"
    AutoTokenizer.from_pretrained(str(default_embedding_model_dir()), eos_token="[SEP]").save_pretrained(other)
    shutil.copy(default_embedding_model_dir() / "config.json", other / "config.json")
    ads, _, titles = _tiny_corpus(tmp_path)
    cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"), tokenizer=str(other),
                      cluster=ClusterConfig(branching=2, leaf_size=6), render=RenderConfig(scheme=IdScheme.TEXT))
    build_index(ads, tmp_path / "index", cfg, progress=False)
    index = load_index(tmp_path / "index")
    with pytest.raises(ValueError, match="tokenizer"):
        train_on_index(index, tmp_path / "model", TrainConfig(epochs=1, batch_tokens=2048),
                       ad_texts=dict(zip(range(1000, 1024), titles)), model=tiny(tok), tokenizer=tok,
                       device="cpu", progress=False)
    assert not (tmp_path / "model").exists()
    # the index's own tokenizer passes, also after a codes warm start added tokens above the base
    for scheme in ("text", "codes"):
        t = tok.__class__.from_pretrained(tok.name_or_path)
        idx = fake_index(t, scheme)
        idx.manifest["tokenizer_fingerprint"] = tokenizer_fingerprint(t)
        prepare_model_for_index(tiny(t), t, idx, dict(zip(idx.ad_ids, TITLES)))
        prepare_model_for_index(tiny(t), t, idx, dict(zip(idx.ad_ids, TITLES)))  # tokens already there


def test_train_job_validation_needs_queries_and_eval_every(tmp_path):
    """--valid-queries without --train.eval_every (default 0), --train.eval_every without
    --valid-queries, or an empty validation file would all train without any model selection."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adbatch.config import ConfigError
    from pipelines.train import TrainJobConfig, read_validation_qrels

    valid = tmp_path / "valid.parquet"
    pq.write_table(pa.table({"query": ["deck over"], "ad_id": pa.array([101], pa.int64())}), valid)
    with pytest.raises(ConfigError, match="eval_every"):
        TrainJobConfig(valid_queries=valid)
    with pytest.raises(ConfigError, match="valid_queries"):
        TrainJobConfig(train=TrainConfig(eval_every=1.0))
    TrainJobConfig(valid_queries=valid, train=TrainConfig(eval_every=1.0))
    TrainJobConfig()
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"query": pa.array([], pa.string()), "ad_id": pa.array([], pa.int64())}), empty)
    with pytest.raises(ValueError, match="no validation pairs"):
        read_validation_qrels(empty)
    assert read_validation_qrels(valid) == {"deck over": {101: 3.0}}


def _run_schedule(steps: int, total: int = 120) -> tuple[ProgressiveSparsity, dict[str, list[int]]]:
    """Drive a tiny model's ProgressiveSparsity (window = the whole run of ``total`` steps, half the layers
    ending at 1:4) through its first ``steps`` optimizer steps; returns it and each layer's kept-per-4 history."""
    model = make_tiny_llama(vocab_size=64, hidden=32, intermediate=64)
    ps = ProgressiveSparsity(model, SparsityScheduleConfig(enabled=True, one_four_fraction=0.5, start_fraction=0.0,
                                                           end_fraction=1.0), total)
    x = torch.randint(0, 64, (2, 8))
    levels: dict[str, list[int]] = {}
    for s in range(steps):
        if ps.wants_stats(s):
            ps.start_stats()
        model(x).logits.sum().backward()
        ps.before_optimizer_step(s)
        model.zero_grad()
        ps.after_optimizer_step()
        for name, n in ps.current_n.items():
            levels.setdefault(name, []).append(n)
    return ps, levels


def test_one_four_layer_schedule_shares():
    """docs/training.md: kept-per-4 steps 4 -> 3 -> 2 in equal shares of the window; the layers picked
    for 1:4 (when the others reach 2) then step 2 -> 1: 1/2 of the window at 3 kept, 1/6 at 2, 1/3 at 1
    (the schedule the measured sparse results used)."""
    from collections import Counter

    ps, levels = _run_schedule(120)
    ends = Counter(h[-1] for h in levels.values())
    assert ends[1] == round(0.5 * len(levels)) and ends[1] + ends[2] == len(levels)
    for name, h in levels.items():
        want = {3: 60, 2: 20, 1: 40} if h[-1] == 1 else {3: 60, 2: 60}
        assert dict(Counter(h)) == want, name


def test_save_cut_short_between_its_renames_keeps_last_nights_model(tmp_path, tok, monkeypatch):
    """save_trained moves the old folder aside, then the new one in: stopped in between, the next run
    (save_trained itself, or the refresh's warm-start planning) puts last night's model back."""
    import os
    from pathlib import Path

    import adbatch.training.checkpoint as ck
    from adbatch.training import read_training_record, save_trained

    out = tmp_path / "model"
    save_trained(tiny(tok), tok, out, {"trained_on_index": "night1"})
    real = os.replace

    def stop_before_second(src, dst):
        if Path(dst) == out and not out.exists():
            raise KeyboardInterrupt  # killed after moving the old folder aside, before the new one is in
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", stop_before_second)
    with pytest.raises(KeyboardInterrupt):
        save_trained(tiny(tok), tok, out, {"trained_on_index": "night2"})
    monkeypatch.undo()
    assert not out.exists()
    ck.recover_interrupted_save(out)
    assert read_training_record(out)["trained_on_index"] == "night1"
    save_trained(tiny(tok), tok, out, {"trained_on_index": "night2"})
    assert read_training_record(out)["trained_on_index"] == "night2"
    assert not any(p.name.startswith(".model.") for p in tmp_path.iterdir())


def test_run_stopped_mid_schedule_still_leaves_exact_final_masks():
    """A time budget / max_steps stopping inside the sparsity window: finish_early jumps to the final
    masks (exactly final_n of every 4; 1:4 layers chosen), keeps earlier pruning, freezes them."""
    ps, _ = _run_schedule(30)  # stopped a quarter into the window: 3 kept of 4 so far
    assert not ps.frozen and set(ps.current_n.values()) == {3}
    before = {name: ps.masks[name].clone() for name in ps.layers}
    ps.finish_early()
    assert ps.frozen and ps.summary()["finished_early"]
    ends = sorted(ps.current_n.values())
    assert set(ends) == {1, 2} and ends.count(1) == round(0.5 * len(ends))
    for name, mod in ps.layers.items():
        kept = (mod.weight != 0).reshape(mod.weight.shape[0], -1, 4).sum(-1)
        assert (kept <= ps.current_n[name]).all() and (ps.masks[name].reshape(kept.shape[0], -1, 4).sum(-1)
                                                       == ps.current_n[name]).all()
        assert not (ps.masks[name] & ~before[name]).any()  # nothing pruned earlier comes back


def test_train_job_refuses_validation_queries_that_are_training_queries(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.train import TrainJobConfig, run_train

    (tmp_path / "index").mkdir()
    pq.write_table(pa.table({"query": ["deck over", "angle bracket"], "ad_id": [1, 2]}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"query": ["angle bracket"], "ad_id": [2]}), tmp_path / "valid.parquet")
    job = TrainJobConfig(index=tmp_path / "index", out=tmp_path / "model", queries=tmp_path / "train.parquet",
                         valid_queries=tmp_path / "valid.parquet", train=TrainConfig(eval_every=1.0))
    with pytest.raises(ValueError, match="1 validation queries are also training queries"):
        run_train(job)



def test_train_jobs_take_the_gpu_when_the_ray_cluster_has_one(monkeypatch):
    """Unset use_gpu: a GPU per worker when Ray sees enough of them (the refresh on a GPU machine trained on
    CPU before: 132 tokens/s on the H200, 2026-12-04); an explicit value always wins."""
    import ray

    from pipelines.train import CreativeTrainJobConfig, TrainJobConfig, resolve_use_gpu

    assert TrainJobConfig.__dataclass_fields__["use_gpu"].default is None
    assert CreativeTrainJobConfig.__dataclass_fields__["use_gpu"].default is None
    for gpus, workers, want in ((0, 1, False), (1, 1, True), (1, 2, False), (4, 2, True)):
        monkeypatch.setattr(ray, "cluster_resources", lambda g=gpus: {"CPU": 8.0, "GPU": float(g)} if g else {"CPU": 8.0})
        assert resolve_use_gpu(None, workers) is want
        assert resolve_use_gpu(False, workers) is False and resolve_use_gpu(True, workers) is True
