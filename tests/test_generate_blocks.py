"""Blocks and model-call fill (issue 56 item 3): one generator call maps a block of BLOCK_BATCHES model batches,
and its distinct uncached queries are packed into full model calls (the block's last one partial), whatever the
repeats; every request still gets its own rows, once, in order. Also the columnar ``answers_to_output`` against the
per-row one it replaced. Tiny random Llama + tiny index (test_generate_support)."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipelines.generate as pg
from adbatch.decoding import TargetSearchConfig
from adbatch.serving.generators import (BLOCK_BATCHES, BLOCK_STATS, CREATIVE_ANSWER_SCHEMA, TARGET_ANSWER_SCHEMA,
                                        GenerateConfig, ModelSpec, TargetGenerator, answers_to_output, block_rows)
from adbatch.serving.requests import CREATIVES_OUT_SCHEMA, REJECTED_SCHEMA, TARGETS_OUT_SCHEMA, GenerateTask
from test_generate_support import WORDS, tiny_index_dir, tiny_model_dir

SEARCH = {"num_beams": 3, "top_k": 3, "verify": "off", "fusion": "generative"}  # the tiny index has no query embedder


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_block_assets")
    return {"model": tiny_model_dir(root), "index": tiny_index_dir(root)}


@pytest.fixture
def model_calls(monkeypatch):
    """The size of every model call (the decoder's search over a batch of prompts), in order."""
    import adbatch.decoding as dec

    real, sizes = dec.search_targets, []

    def spy(model, prompts, trie, config, cost_model=None):
        sizes.append(len(prompts))
        return real(model, prompts, trie, config, cost_model=cost_model)

    monkeypatch.setattr(dec, "search_targets", spy)
    return sizes


def _zipfish(n: int, distinct: int, seed: int) -> list[str]:
    """``n`` queries over ``distinct`` ones, the first few far more often (a query stream's head), shuffled."""
    rng = random.Random(seed)
    pool = [f"{WORDS[i % len(WORDS)]} {WORDS[(5 * i + 1) % len(WORDS)]} {i}" for i in range(distinct)]
    out = pool + rng.choices(pool, weights=[1 / (r + 1) for r in range(distinct)], k=n - distinct)
    rng.shuffle(out)
    return out


def _expected_calls(queries: list[str], block: int, batch: int) -> list[int]:
    """The model calls a generator with an unbounded answer cache makes over ``queries`` in blocks of ``block``:
    each block's new distinct queries in full calls of ``batch``, the last partial."""
    seen: set[str] = set()
    calls = []
    for s in range(0, len(queries), block):
        new = [q for q in dict.fromkeys(queries[s:s + block]) if q not in seen]
        seen.update(new)
        calls += [batch] * (len(new) // batch) + ([len(new) % batch] if len(new) % batch else [])
    return calls


def test_block_rows_is_the_batch_times_the_stated_multiple():
    assert block_rows(1024) == 1024 * BLOCK_BATCHES and block_rows(1) == BLOCK_BATCHES
    with pytest.raises(ValueError, match=">= 1"):
        block_rows(0)
    assert pg.GenerateJobConfig(batch_size=5).model_batch_size("cuda") == 5
    assert pg.GenerateJobConfig().model_batch_size("cpu") == 8 and pg.GenerateJobConfig().model_batch_size("cuda") == 1024
    # the actors' device, as their generator picks it: a forced CPU stays CPU on a GPU cluster
    assert pg._actor_device(pg.GenerateJobConfig(device="cpu"), {"num_gpus": 1}) == "cpu"
    assert pg._actor_device(pg.GenerateJobConfig(), {"num_gpus": 1}) == "cuda"
    assert pg._actor_device(pg.GenerateJobConfig(), {"num_cpus": 2}) == "cpu"


def test_a_block_with_repeats_makes_full_model_calls_and_the_same_rows(assets, model_calls):
    """40 requests over 14 distinct queries in one block: 4 model calls of 4, 4, 4, 2 (the same requests in blocks
    of one batch -- the Ray batch before -- made 10 calls); every request answered, in order, as without the cache."""
    queries = _zipfish(40, 14, seed=3)
    ids = [f"r{i:03d}" for i in range(40)]
    block = pa.table({"request_id": ids, "query": queries})
    search = TargetSearchConfig(**SEARCH)
    spec = ModelSpec(model=str(assets["model"]))
    gen = TargetGenerator(spec, assets["index"], search, GenerateConfig(batch_size=4, device="cpu"))
    assert gen.block_rows == 4 * BLOCK_BATCHES == 32
    got = gen(block)
    assert model_calls == [4, 4, 4, 2]
    st = gen.stats()
    assert (st["decoded"], st["model_calls"], st["model_call_fill"], st["requests"]) == (14, 4, 3.5, 40)
    # the call's counts ride on its first row only
    assert got.column("block_decoded").to_pylist() == [14] + [0] * 39
    assert got.column("block_model_calls").to_pylist() == [4] + [0] * 39
    assert got.column("request_id").to_pylist() == ids

    # the old Ray batch (= the model batch): the dedup left most calls short
    del model_calls[:]
    small = TargetGenerator(spec, assets["index"], search, GenerateConfig(batch_size=4, device="cpu"))
    for s in range(0, 40, 4):
        small(block.slice(s, 4))
    assert len(model_calls) > 4 and sum(model_calls) == 14 and min(model_calls) < 4
    assert model_calls == _expected_calls(queries, 4, 4)

    # the same rows as decoding every request (cache off: 10 full calls)
    del model_calls[:]
    plain = TargetGenerator(spec, assets["index"], search, GenerateConfig(batch_size=4, device="cpu", answer_cache=0))
    ref = plain(block)
    assert model_calls == [4] * 10
    assert ref.column("request_id").to_pylist() == ids
    assert got.column("ad_ids").to_pylist() == ref.column("ad_ids").to_pylist()
    assert got.column("codes").to_pylist() == ref.column("codes").to_pylist()
    for a, b in zip(got.column("scores").to_pylist(), ref.column("scores").to_pylist()):
        assert a == pytest.approx(b, rel=1e-4)
    # the output rows the driver writes from them: equal but for the scores' last bits
    out, ref_out = (answers_to_output(GenerateTask.TARGETS, t.drop_columns(["batch_seconds", *BLOCK_STATS]))[0]
                    for t in (got, ref))
    for col in ("request_id", "rank", "ad_id", "channel", "code"):
        assert out.column(col).to_pylist() == ref_out.column(col).to_pylist()


def test_a_small_answer_cache_still_packs_each_block(assets, model_calls):
    """The cache holds 2 answers: a block still decodes each of its distinct queries once, in full calls."""
    queries = ["lamp", "bulb", "lamp", "drill", "saw", "bulb", "pipe", "lamp", "tile", "glue"]  # 7 distinct
    gen = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"], TargetSearchConfig(**SEARCH),
                          GenerateConfig(batch_size=3, device="cpu", answer_cache=2))
    out = gen(pa.table({"request_id": [f"a{i}" for i in range(10)], "query": queries}))
    assert model_calls == [3, 3, 1] and len(gen.answers) == 2
    ids = out.column("ad_ids").to_pylist()
    assert ids[0] == ids[2] == ids[7] and ids[1] == ids[5]
    # the next block: the two kept (the block's last two distinct, tile and glue) are not decoded again
    gen(pa.table({"request_id": ["b0", "b1", "b2"], "query": ["glue", "tile", "lamp"]}))
    assert model_calls == [3, 3, 1, 1]


def test_local_run_with_repeats_fills_calls_and_writes_each_request_once(assets, tmp_path, model_calls):
    """The local executor's blocks (BLOCK_BATCHES batches, spanning partitions): the model calls are the packed
    ones, the manifest counts them, every accepted request is written once with its own rows, the rejected rows
    are kept, and the ranking is the one decoding every request gives."""
    queries = _zipfish(70, 16, seed=5)
    ids = [f"q{i:03d}" for i in range(70)]
    req = tmp_path / "req.parquet"
    # + an empty query and a conflicting duplicate id: rejected by validation, written to rejected.parquet
    pq.write_table(pa.table({"request_id": ids + ["bad", "q007"], "query": queries + ["", "other"]}), req)
    accepted = [i for i in ids if i != "q007"]
    acc_queries = [q for i, q in zip(ids, queries) if i != "q007"]

    def cfg(out, **kw):
        return pg.GenerateJobConfig(task="targets", requests=req, index=assets["index"], model=str(assets["model"]),
                                    out=out, executor="local", batch_size=4, partition_size=5, targets=SEARCH,
                                    device="cpu", progress=False, **kw)

    res = pg.run_generate(cfg(tmp_path / "out"))
    want = _expected_calls(acc_queries, 32, 4)
    # blocks of 32, 32 and 5 requests: at most one partial call each
    assert model_calls == want and len(want) <= -(-len(set(acc_queries)) // 4) + 2
    thr = res["throughput"]
    assert thr["decoded"] == len(set(acc_queries)) == sum(want) and thr["model_calls"] == len(want)
    assert thr["model_call_fill"] == pytest.approx(sum(want) / len(want), abs=0.01)
    counts = res["counts"]
    assert counts["accepted"] == 69 and counts["answered"] == 69 and counts["output_rows"] == 69 * 3
    out = pq.read_table(tmp_path / "out" / "targets")
    keys = list(zip(out.column("request_id").to_pylist(), out.column("rank").to_pylist()))
    assert len(keys) == len(set(keys)) == 69 * 3 and sorted({k[0] for k in keys}) == accepted
    assert out.column("request_id").to_pylist() == sorted(out.column("request_id").to_pylist())  # partition order
    rej = pq.read_table(tmp_path / "out" / "rejected.parquet").column("request_id").to_pylist()
    assert sorted(rej) == ["bad", "q007", "q007"]

    del model_calls[:]
    pg.run_generate(cfg(tmp_path / "plain", answer_cache=0))
    assert model_calls == [4] * 17 + [1]  # 69 requests, each decoded
    ref = pq.read_table(tmp_path / "plain" / "targets")
    assert out.column("request_id").to_pylist() == ref.column("request_id").to_pylist()
    assert out.column("ad_id").to_pylist() == ref.column("ad_id").to_pylist()
    manifest = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert manifest["throughput"]["decoded"] == 69 and manifest["throughput"]["model_call_fill"] == round(69 / 18, 2)


def test_request_blocks_cut_across_partitions_in_order():
    parts = [pa.table({"request_id": [f"r{i}" for i in range(s, s + n)],
                       "partition": pa.array([p] * n, pa.int64())})
             for p, (s, n) in enumerate([(0, 5), (5, 5), (10, 2), (12, 9)])]
    blocks = list(pg.request_blocks(iter(parts), 8))
    assert [b.num_rows for b in blocks] == [8, 8, 5]
    assert sum((b.column("request_id").to_pylist() for b in blocks), []) == [f"r{i}" for i in range(21)]
    assert blocks[0].column("partition").to_pylist() == [0] * 5 + [1] * 3
    assert all(c.num_chunks == 1 for b in blocks for c in b.columns)  # one contiguous table each
    assert [b.num_rows for b in pg.request_blocks(parts, 100)] == [21]
    assert list(pg.request_blocks([], 4)) == []
    with pytest.raises(ValueError, match=">= 1"):
        list(pg.request_blocks(parts, 0))


@pytest.mark.parametrize("total, rows, actors, want", [
    (300_000, 64, 1, pg.INPUT_OBJECT_ROWS),  # CPU blocks: 64 of them an object (74 objects, not 4,688)
    (300_000, 8192, 1, 8192),  # GPU blocks are larger than an object: one block each, as before
    (24, 8, 2, 8),  # a small run: every actor still gets INPUT_OBJECTS_PER_ACTOR objects where blocks allow
    (1000, 64, 1, 256),
    (5, 64, 4, 64),
])
def test_input_objects_are_whole_blocks(total, rows, actors, want):
    """The requests enter Ray in objects of several blocks (Ray keeps ~50 KB in the driver per object): a whole
    number of blocks each, so map_batches(batch_size=rows) hands the actors the blocks --executor local maps."""
    got = pg.input_object_rows(total, rows, actors)
    assert got == want and got % rows == 0
    assert got <= max(rows, pg.INPUT_OBJECT_ROWS)


# --- answers_to_output: columnar, the same tables as the per-row one ----------------------------------------------
def _rowwise_answers_to_output(task: GenerateTask, answers: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The per-row implementation ``answers_to_output`` had before (the reference)."""
    out = {f.name: [] for f in (TARGETS_OUT_SCHEMA if task is GenerateTask.TARGETS else CREATIVES_OUT_SCHEMA)}
    rejected = []
    for a in answers.to_pylist():
        if a["error"] is not None:
            rejected.append({"request_id": a["request_id"], "file": "", "row": -1, "stage": "generate",
                             "reason": a["error"], "raw": json.dumps({"request_id": a["request_id"]})})
            continue
        if task is GenerateTask.TARGETS:
            for rank, row in enumerate(zip(a["ad_ids"], a["scores"], a["scores_generative"], a["scores_dense"],
                                           a["channels"], a["codes"]), 1):
                for name, v in zip(("ad_id", "score", "score_generative", "score_dense", "channel", "code"), row):
                    out[name].append(v)
                out["request_id"].append(a["request_id"])
                out["rank"].append(rank)
                out["verify_mode"].append(a["verify_mode"])
                out["batch_beams_verified"].append(a["beams_verified"])
        else:
            for v, (text, score, fl) in enumerate(zip(a["headlines"], a["scores"], a["flags"])):
                for name, x in zip(("request_id", "ad_id", "variant", "headline", "score", "flags"),
                                   (a["request_id"], a["ad_id"], v, text, score, list(fl))):
                    out[name].append(x)
    schema = TARGETS_OUT_SCHEMA if task is GenerateTask.TARGETS else CREATIVES_OUT_SCHEMA
    return pa.Table.from_pydict(out, schema=schema), pa.Table.from_pylist(rejected, schema=REJECTED_SCHEMA)


def _random_answers(task: GenerateTask, n: int, seed: int) -> pa.Table:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        err = "out of memory at batch size 1" if rng.random() < 0.15 else None
        k = 0 if err else rng.choice([0, 1, 3, 10])
        if task is GenerateTask.TARGETS:
            rows.append({"request_id": f"r{i}", "error": err, "ad_ids": [f"ad-{rng.randrange(99)}" for _ in range(k)],
                         "scores": [rng.random() for _ in range(k)],
                         "scores_generative": [rng.choice([None, -rng.random()]) for _ in range(k)],
                         "scores_dense": [rng.choice([None, rng.random()]) for _ in range(k)],
                         "channels": [rng.choice(["generative", "dense", "both"]) for _ in range(k)],
                         "codes": [[rng.randrange(9) for _ in range(rng.randrange(1, 4))] for _ in range(k)],
                         "verify_mode": "auto", "beams_verified": rng.randrange(5)})
        else:
            k = min(k, 3)
            rows.append({"request_id": f"c{i}", "ad_id": f"ad-{i}", "error": err,
                         "headlines": [f"Headline {i}.{j}" for j in range(k)], "scores": [-rng.random() for _ in range(k)],
                         "flags": [rng.choice([[], ["echo"], ["copy", "length"]]) for _ in range(k)]})
    schema = TARGET_ANSWER_SCHEMA if task is GenerateTask.TARGETS else CREATIVE_ANSWER_SCHEMA
    return pa.Table.from_pylist(rows, schema=schema)


@pytest.mark.parametrize("task", [GenerateTask.TARGETS, GenerateTask.CREATIVES])
@pytest.mark.parametrize("n", [0, 1, 60])
def test_columnar_answers_to_output_equals_the_per_row_one(task, n):
    answers = _random_answers(task, n, seed=n)
    if n > 2:  # several chunks, as the collector's concatenated partitions are
        answers = pa.concat_tables([answers.slice(0, n // 3), answers.slice(n // 3)])
    got, got_rej = answers_to_output(task, answers)
    want, want_rej = _rowwise_answers_to_output(task, answers)
    assert got.schema == want.schema and got.equals(want)
    assert got_rej.equals(want_rej)
    if n == 60:
        assert got.num_rows > 60 and got_rej.num_rows > 0


def test_columnar_answers_to_output_refuses_ragged_lists():
    bad = pa.Table.from_pylist([{"request_id": "r0", "error": None, "ad_ids": ["a", "b"], "scores": [1.0],
                                 "scores_generative": [None, None], "scores_dense": [None, None],
                                 "channels": ["dense", "dense"], "codes": [[1], [2]], "verify_mode": "off",
                                 "beams_verified": 0}], schema=TARGET_ANSWER_SCHEMA)
    with pytest.raises(ValueError, match="'r0': scores has 1 items"):
        answers_to_output(GenerateTask.TARGETS, bad)
    ragged = pa.Table.from_pylist([{"request_id": "c0", "ad_id": "a0", "error": None, "headlines": ["A", "B"],
                                    "scores": [-0.1, -0.2], "flags": [[]]}], schema=CREATIVE_ANSWER_SCHEMA)
    with pytest.raises(ValueError, match="'c0' has 2 headlines but flags"):
        answers_to_output(GenerateTask.CREATIVES, ragged)


@pytest.mark.parametrize("overrides, tree", [({}, 0), ({"verify": "auto"}, 4096), ({"verify": "off", "fusion": "hybrid"},
                                                                                       "score")])
def test_the_generator_warms_its_engine_before_the_first_request(assets, monkeypatch, overrides, tree):
    """Issue 60 item 4: a target generator routes its model's linear plan at every bucket of its passes when it
    is built (prompts of up to max_query_tokens at its batch size; tree passes where it verifies or scores dense
    candidates exactly), so no work batch pays the plan's timing."""
    import adbatch.decoding.engine as engine
    from adbatch.decoding.tree_verify import SCORE_PASS_TOKENS
    from adbatch.serving.prompts import encode_targeting_prompt

    calls = []
    monkeypatch.setattr(engine, "warm_up_search", lambda model, config, q, p, t: calls.append((config, q, p, t)) or [])
    search = TargetSearchConfig(**{**SEARCH, **overrides})
    if search.fusion.value == "hybrid":  # the tiny index has no query embedder: the dense channel is stubbed out
        monkeypatch.setattr("adbatch.index.dense.DenseRetriever", lambda *a, **k: object())
        monkeypatch.setattr("adbatch.index.dense.tuned_query_embedder", lambda *a, **k: None)
    gen = TargetGenerator(ModelSpec(model=str(assets["model"])), assets["index"], search,
                          GenerateConfig(batch_size=4, device="cpu", max_query_tokens=12))
    longest = len(encode_targeting_prompt(gen.tokenizer, "x " * 12, 12))
    assert calls == [(search, 4, longest, SCORE_PASS_TOKENS if tree == "score" else tree)]
