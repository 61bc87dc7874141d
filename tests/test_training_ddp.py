"""Training on several ranks: how an epoch's micro-batches are shared between ranks (every example
once per epoch, none dropped, none repeated), and the N-worker Ray Train path on CPU (DDP over gloo)."""

from __future__ import annotations

import pytest
import torch

from adbatch.training import TrainConfig, check_index_compat, read_training_record, train_on_index
from adbatch.training.data import (PackedMicroBatch, build_examples, collate_packed, packed_batches, repeat_kinds,
                                   split_for_ranks, token_budget_batches)
from adbatch.training.data import ExampleKind
from adbatch.training.trainer import train_loop
from tests.test_training import QUERIES, TITLES, fake_index, tiny, tiny_train_job_inputs


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def _examples(tok):
    idx = fake_index(tok, "text")
    ex, _ = build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                           dict(zip(idx.ad_ids, TITLES)), [(q, 100 + r) for q, r in QUERIES])
    return ex


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_split_for_ranks_covers_every_example_once(tok, world_size, packed):
    ex = _examples(tok)  # 12 examples
    gen = torch.Generator().manual_seed(0)
    if packed:
        batches = packed_batches(ex.lengths, row_len=64, rows_per_batch=2, generator=gen)
    else:
        batches = token_budget_batches(ex.lengths, 120, gen)
    out = split_for_ranks(batches, world_size)
    assert len(out) % world_size == 0 and len(out) >= len(batches)
    index = torch.cat([b.index if packed else b for b in out])
    assert sorted(index.tolist()) == list(range(len(ex)))  # each example exactly once
    for b in out:
        if packed:  # a half keeps the batch's shape: at most its rows, no row over row_len
            assert isinstance(b, PackedMicroBatch) and b.index.numel() >= 1
            assert collate_packed(ex, b, rows=2, row_len=64, pad_id=0).input_ids.shape == (2, 64)
        else:
            assert b.numel() >= 1 and (b.numel() * int(ex.lengths[b].max()) <= 120 or b.numel() == 1)
    if len(batches) % world_size == 0:
        assert out == batches  # nothing to cut: the list is the one given


def test_split_for_ranks_cuts_a_single_row_and_stops_when_nothing_is_left():
    one_row = PackedMicroBatch(torch.tensor([4, 7, 1]), torch.tensor([3]))
    a, b = split_for_ranks([one_row], 2)
    assert a.index.tolist() == [4] and a.row_sizes.tolist() == [1]
    assert b.index.tolist() == [7, 1] and b.row_sizes.tolist() == [2]
    # fewer examples than ranks: as many single-example batches as there are examples
    assert [t.tolist() for t in split_for_ranks([torch.tensor([5, 6])], 4)] == [[5], [6]]
    with pytest.raises(ValueError, match="world_size"):
        split_for_ranks([], 0)


@pytest.mark.parametrize("packing, batch_tokens", [(False, 200), (True, 256)])
def test_ranks_share_every_epoch_without_dropping_examples(tok, packing, batch_tokens):
    """Rank 0 and rank 1 of a world of 2 (run one after the other, without torch.distributed: the sharing
    is the loop's own) together train on exactly the examples one rank trains on alone; each sees about
    half, in the same number of micro-batches (DDP needs that)."""
    ex = _examples(tok)
    cfg = TrainConfig(epochs=3, lr=1e-3, batch_tokens=batch_tokens, packing=packing, log_every=1, seed=0)
    # the run's examples (labelled pairs repeated) give an odd number of micro-batches: one is cut for 2 ranks
    run_ex = repeat_kinds(ex, {ExampleKind.RETRIEVAL: cfg.retrieval_repeat})
    g = torch.Generator().manual_seed(0)
    n_batches = len(packed_batches(run_ex.lengths, 256, 1, g) if packing
                    else token_budget_batches(run_ex.lengths, batch_tokens, g))
    assert n_batches % 2 == 1, n_batches

    def run(rank: int, world_size: int):
        model = tiny(tok)
        stats, _ = train_loop(model, ex, cfg, pad_id=tok.pad_token_id, rank=rank, world_size=world_size,
                              progress=False)
        return stats

    alone = run(0, 1)
    r0, r1 = run(0, 2), run(1, 2)
    assert alone.examples == cfg.epochs * len(run_ex)
    assert r0.examples + r1.examples == alone.examples
    assert r0.tokens + r1.tokens == alone.tokens and r0.target_tokens + r1.target_tokens == alone.target_tokens
    assert r0.micro_batches == r1.micro_batches == 3 * (n_batches + 1) // 2
    assert 0 < r0.examples < alone.examples and 0 < r1.examples < alone.examples
    # one rank: the job's totals are its own; two ranks without torch.distributed: not known
    s = alone.summary(tiny(tok), torch.device("cpu"))
    assert s["world_size"] == 1 and s["examples_all_ranks"] == s["examples"] == alone.examples
    assert s["tokens_all_ranks"] == alone.tokens and s["tokens_per_s_all_ranks"] == s["tokens_per_s"]
    s0 = r0.summary(tiny(tok), torch.device("cpu"))
    assert s0["world_size"] == 2 and "examples_all_ranks" not in s0


@pytest.mark.slow
def test_ray_train_two_workers_ddp(tmp_path, tok, ray_local):
    """``run_train`` with ``num_workers=2`` on CPU: two Ray Train workers, DDP over gloo, each rank on its
    share of every epoch, rank 0 writing the model folder. The job trains on exactly the examples (and
    tokens) a single worker trains on."""
    from pipelines.train import TrainJobConfig, read_ad_texts, read_labelled_queries, run_train

    assert ray_local.cluster_resources().get("CPU", 0) >= 2  # one CPU per Ray Train worker
    ads, queries, _, index, init, _ = tiny_train_job_inputs(tmp_path, tok)
    train = TrainConfig(epochs=3, lr=1e-2, batch_tokens=256, log_every=1)
    # 2 span pseudo-queries per ad: 80 examples, 23 packed micro-batches an epoch (odd: one is cut for 2 ranks)
    train = train.replace(pseudo_queries=train.pseudo_queries.replace(per_ad=2))
    job = TrainJobConfig(index=tmp_path / "index", out=tmp_path / "model", init_model=str(init), ads=ads,
                         queries=queries, num_workers=2, use_gpu=False, train=train)
    out = run_train(job)
    assert out["num_workers"] == 2 and out["world_size"] == 2
    assert out["examples_indexing"] == 24 and out["examples_retrieval"] == 2 and out["examples_pseudo_query"] == 48
    assert out["train_final_loss"] < 0.5 * out["train_first_loss"]
    rec = check_index_compat(tmp_path / "model", index)  # rank 0 wrote the folder, bound to the index
    assert rec["world_size"] == 2 and rec["num_ads"] == 24
    assert read_training_record(tmp_path / "model")["train"]["world_size"] == 2

    # the same job on one worker, in this process: the same examples, tokens and target tokens in all
    _, _, alone = train_on_index(index, None, train, ad_texts=read_ad_texts(ads, index.manifest["config"]["columns"]),
                                 labelled=read_labelled_queries(queries), init_model=str(init), device="cpu",
                                 progress=False)
    assert alone.train["examples"] == 3 * (24 + 2 * train.retrieval_repeat + 48)
    for key in ("examples", "tokens", "target_tokens"):
        assert out[f"train_{key}_all_ranks"] == alone.train[key], key
    # each rank trained on its own share: rank 0 on about half, in half the micro-batches of the job
    assert 0 < out["train_examples"] < out["train_examples_all_ranks"]
    assert out["train_micro_batches_all_ranks"] == 2 * out["train_micro_batches"] == 3 * 24
    assert out["train_steps"] == out["train_micro_batches"] < alone.train["steps"]


def test_budget_clock_agrees_between_logged_steps(monkeypatch):
    """Under several ranks the time budget reads one clock the ranks agree on, refreshed only at every
    ``every``-th step (rank 0's reading is broadcast there), so no rank stops a step before another;
    one process reads its own clock every step."""
    from adbatch.training import trainer

    now = [100.0]
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: now[0])
    shared = trainer._BudgetClock(100.0, world_size=2, device=torch.device("cpu"), every=3)
    alone = trainer._BudgetClock(100.0, world_size=1, device=torch.device("cpu"), every=3)
    seen = []
    for step in range(7):
        now[0] = 100.0 + step
        seen.append((shared.elapsed(step), shared.latest(), alone.elapsed(step), alone.latest()))
    assert [s[0] for s in seen] == [0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 6.0]
    assert [s[1] for s in seen] == [s[0] for s in seen]
    assert [s[2] for s in seen] == [s[3] for s in seen] == [float(i) for i in range(7)]
