"""Rank-aware distillation from the dense teacher (issue 41 item 4; tiny random-init Llamas, CPU): the config,
the two losses by hand, teacher-forced sequence log-probs against a plain forward, the candidate groups, and
an end-to-end run whose listwise KL to the teacher falls during the rank phase."""

from __future__ import annotations

import math

import pytest
import torch

from adbatch.config import ConfigError
from adbatch.training import RankLossConfig, TrainConfig, train_on_index
from adbatch.training.rank_loss import (RankLossMode, RankQueries, RankSource, TeacherQuery, build_groups,
                                        listwise_kl_loss, margin_loss, rank_batch, sequence_logprobs)
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_config_validation_and_round_trip():
    cfg = RankLossConfig()
    assert not cfg.enabled and cfg.mode is RankLossMode.LISTWISE_KL and cfg.candidates == 8 + 8 + 2
    back = RankLossConfig.from_dict(RankLossConfig(enabled=True, mode=RankLossMode.MARGIN,
                                                   sources=(RankSource.GENERATED,)).to_dict())
    assert back.mode is RankLossMode.MARGIN and back.sources == (RankSource.GENERATED,)
    # strings from a TOML / CLI override become the enums
    t = TrainConfig.from_dict({"rank": {"enabled": True, "mode": "margin", "sources": ["labelled", "spans"],
                                        "teacher_query": "source_ad"}})
    assert t.rank.mode is RankLossMode.MARGIN and t.rank.sources == (RankSource.LABELLED, RankSource.SPANS)
    assert t.rank.teacher_query is TeacherQuery.SOURCE_AD
    assert TrainConfig().rank == RankLossConfig()  # off by default
    for bad in (dict(weight=0.0), dict(weight=float("nan")), dict(temperature=0.0), dict(start_fraction=1.0),
                dict(start_fraction=-0.1), dict(teacher_k=0), dict(queries_per_step=0), dict(negatives=-1),
                dict(sources=()), dict(mode=RankLossMode.MARGIN, negatives=0), dict(margin=-1.0)):
        with pytest.raises(ConfigError):
            RankLossConfig(**bad)
    with pytest.raises(ConfigError):
        RankLossConfig.from_dict({"mode": "pairwise"})


def test_listwise_kl_by_hand():
    student = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 7.0]])
    teacher = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 123.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # group 0: p = softmax(2, 1, 0), q = softmax(-1, -2, -3) (the same shape shifted: KL 0 would need equal gaps)
    p0 = [math.exp(v) / sum(math.exp(x) for x in (2, 1, 0)) for v in (2, 1, 0)]
    q0 = [math.exp(v) / sum(math.exp(x) for x in (-1, -2, -3)) for v in (-1, -2, -3)]
    kl0 = sum(p * math.log(p / q) for p, q in zip(p0, q0))
    # group 1: only the first two candidates count: p = softmax(0, 1), q = softmax(-0.5, -4)
    p1 = [1 / (1 + math.e), math.e / (1 + math.e)]
    q1 = [math.exp(-0.5) / (math.exp(-0.5) + math.exp(-4)), math.exp(-4) / (math.exp(-0.5) + math.exp(-4))]
    kl1 = sum(p * math.log(p / q) for p, q in zip(p1, q1))
    got = listwise_kl_loss(student, teacher, mask)
    assert got.dtype == torch.float32
    assert abs(float(got) - (kl0 + kl1) / 2) < 1e-5
    assert abs(kl0) < 1e-6  # equal gaps: the same distribution
    # equal distributions -> 0; gradient moves the student toward the teacher, none reaches masked slots
    assert float(listwise_kl_loss(teacher, teacher, mask)) < 1e-6
    s = student.clone().requires_grad_(True)
    listwise_kl_loss(s, teacher, mask).backward()
    assert float(s.grad[1, 2]) == 0.0
    with torch.no_grad():
        assert listwise_kl_loss(s - 1.0 * s.grad, teacher, mask) < got


def test_margin_loss():
    pos = torch.tensor([[True, False, False, False]])
    neg = torch.tensor([[False, False, True, True]])
    ahead = torch.tensor([[-1.0, -50.0, -3.5, -2.0]])  # the positive leads both negatives by >= 1
    assert float(margin_loss(ahead, pos, neg, margin=1.0)) == 0.0
    close = torch.tensor([[-1.0, -50.0, -1.5, -0.5]])
    # pairs: relu(1 - (-1) + (-1.5)) = 0.5, relu(1 - (-1) + (-0.5)) = 1.5 -> mean 1.0 (slot 1 is neither)
    assert abs(float(margin_loss(close, pos, neg, margin=1.0)) - 1.0) < 1e-6
    none = torch.zeros_like(pos)
    assert float(margin_loss(close, pos, none, 1.0)) == 0.0
    with pytest.raises(AssertionError):
        margin_loss(close, pos, pos, 1.0)


def _toy_queries(vocab: int, n_ads: int = 6, Q: int = 4, D: int = 8, seed: int = 0) -> RankQueries:
    g = torch.Generator().manual_seed(seed)
    ad_emb = torch.nn.functional.normalize(torch.randn(n_ads, D, generator=g), dim=1)
    q_emb = torch.nn.functional.normalize(torch.randn(Q, D, generator=g), dim=1)
    targets = [torch.randint(3, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_ads)]
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(Q)]
    return RankQueries(prompts=prompts, positives=[[q % n_ads] for q in range(Q)],
                       source=torch.zeros(Q, dtype=torch.int8), q_emb=q_emb, ad_emb=ad_emb,
                       teacher_rows=(q_emb @ ad_emb.T).topk(3, dim=1).indices, targets=targets, trie=None, stats={})


def test_groups_and_sequence_logprobs_match_a_plain_forward():
    vocab = 97
    model = make_tiny_llama(vocab_size=vocab, hidden=32, intermediate=64, heads=2, kv_heads=1, seed=1).float()
    rq = _toy_queries(vocab)
    cfg = RankLossConfig(enabled=True, teacher_k=3, negatives=2, max_positives=1, temperature=0.1)
    beams = torch.tensor([[5, 4, -1], [0, 1, 2], [2, 2, 3], [-1, -1, -1]])
    groups = build_groups(rq, beams, cfg)
    C = cfg.candidates
    assert groups.rows.shape == (4, C) and groups.examples.lengths.numel() == 4 * C
    for g in range(4):  # positives first, then the teacher's top-k, then fresh beam rows; no repeats
        rows = [r for r in groups.rows[g].tolist() if r >= 0]
        want = list(dict.fromkeys([*rq.positives[g], *rq.teacher_rows[g].tolist()]))
        want += [r for r in dict.fromkeys(beams[g].tolist()) if r >= 0 and r not in want][:2]
        assert rows == want and groups.mask[g].sum() == len(want)
        # a negative is a beam row outside the positives and the teacher's top-k; the label's teacher score is the top
        assert set(groups.rows[g][groups.negative[g]].tolist()) == set(want[len(dict.fromkeys(
            [*rq.positives[g], *rq.teacher_rows[g].tolist()])):])
        assert float(groups.teacher[g, 0]) == float(groups.teacher[g][groups.mask[g]].max())
        cos = float(rq.q_emb[g] @ rq.ad_emb[rows[-1]]) / cfg.temperature
        if rows[-1] not in rq.positives[g]:
            assert abs(float(groups.teacher[g, len(rows) - 1]) - cos) < 1e-5
    # every row's tokens are prompt(g) + target(candidate)
    ex = groups.examples
    for i in (0, 5, C + 3, 3 * C + C - 1):
        g, r = i // C, int(groups.rows.view(-1)[i]) if groups.mask.view(-1)[i] else int(groups.rows[i // C, 0])
        assert ex.tokens[ex.offsets[i]:ex.offsets[i + 1]].tolist() == rq.prompts[g] + rq.targets[r]
    picks = torch.tensor([2, 0])
    batch, mask, teacher, pos, neg = rank_batch(groups, picks, pad_id=0)
    assert batch.input_ids.shape == (2 * C, groups.max_len) and mask.shape == (2, C)
    got = sequence_logprobs(model, batch, (2, C), mask)
    assert got.shape == (2, C) and got.dtype == torch.float32
    # reference: one plain HF forward per candidate, summing the target tokens' log-probs
    with torch.no_grad():
        for j, g in enumerate(picks.tolist()):
            for c in range(C):
                if not mask[j, c]:
                    assert float(got[j, c]) == 0.0
                    continue
                p, t = rq.prompts[g], rq.targets[int(groups.rows[g, c])]
                logp = torch.log_softmax(model(input_ids=torch.tensor([p + t])).logits[0].float(), -1)
                want = sum(float(logp[len(p) - 1 + i, tok]) for i, tok in enumerate(t))
                assert abs(float(got[j, c]) - want) < 1e-4, (g, c, float(got[j, c]), want)
    # the chunked, checkpointed head gives the same values and gradients as one chunk
    got.sum().backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sequence_logprobs(model, batch, (2, C), mask, chunk=3).sum().backward()
    for a, b in zip(g1, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny model and a 24-ad text index whose ads the packaged MiniLM embedded (a dense channel)."""
    from test_generate_support import tiny_corpus, tiny_model_dir

    from adbatch.index.build import IndexConfig, build_index, load_index
    from adbatch.index.clustering import ClusterConfig

    root = tmp_path_factory.mktemp("rank")
    ads = tiny_corpus(root / "ads.parquet", n=24)
    build_index(ads, root / "index", IndexConfig(cluster=ClusterConfig(branching=4, leaf_size=8)), progress=False)
    return {"model": tiny_model_dir(root), "index": load_index(root / "index")}


def _labelled(index):
    """A query of each third ad: its title's two topic words (shared with the other ads of its topic)."""
    from adbatch.training import default_ad_texts

    texts = default_ad_texts(index)
    return [(texts[a].split(" item")[0], a) for a in index.ad_ids[::3]]


def _listwise_kl_now(model, rq, groups, cfg, pad_id):
    batch, mask, teacher, _, _ = rank_batch(groups, torch.arange(len(rq)), pad_id)
    with torch.no_grad():
        return float(listwise_kl_loss(sequence_logprobs(model, batch, tuple(mask.shape), mask), teacher, mask))


def _config(rank: RankLossConfig, steps: int) -> TrainConfig:
    return TrainConfig(max_steps=steps, lr=3e-3, batch_tokens=512, compile=False, log_every=1, fusion_queries=0,
                       warmup_fraction=0.0, qat=TrainConfig().qat.replace(enabled=False), rank=rank,
                       pseudo_queries=TrainConfig().pseudo_queries.replace(per_ad=4))


@pytest.mark.parametrize("mode", [RankLossMode.LISTWISE_KL, RankLossMode.MARGIN])
def test_train_on_index_with_rank_phase(assets, tmp_path, mode):
    from adbatch.index.dense import DenseRetriever
    from adbatch.models import load_causal_lm
    from adbatch.training.checkpoint import read_training_record

    index = assets["index"]
    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    # every step ranks the same 8 groups: the loss curve is the loss of one fixed set over the phase
    rank = RankLossConfig(enabled=True, mode=mode, weight=1.0, teacher_k=3, negatives=2, max_positives=1,
                          queries_per_step=8, max_queries=8, start_fraction=0.25, temperature=0.1, margin=0.5)
    cfg = _config(rank, 12)
    model, tok, summary = train_on_index(index, tmp_path / "m", cfg, model=model, tokenizer=tok, device="cpu",
                                         progress=False, labelled=_labelled(index), dense=DenseRetriever(index, "cpu"))
    r = summary.train["rank"]
    assert r["start_step"] == 3 and r["steps"] == 9 and r["minings"] == 1 and r["mode"] == mode.value
    assert r["queries"] == 8 and r["groups"] == 8 and r["by_source"] == {"labelled": 4, "spans": 4, "generated": 0}
    assert r["mining_seconds"] > 0 and r["teacher_query"] == "embed" and 3 <= r["candidates_per_group"] <= 6
    assert r["beam_negatives_per_group"] > 0 and r["mean_loss"] > 0
    assert summary.data["rank"]["queries"] == 8
    rec = read_training_record(tmp_path / "m")
    assert rec["config"]["rank"]["mode"] == mode.value and rec["train"]["rank"]["steps"] == 9
    losses = [v for _, v in r["losses"]]
    assert len(losses) == 9 and all(math.isfinite(v) for v in losses)
    # the rank loss of the fixed groups falls over the phase (steadily: the same groups every step)
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 6, losses


def test_rank_phase_moves_the_model_toward_the_teacher(assets):
    """The same start, with and without the rank loss: the listwise KL to the teacher, on the groups mined from
    the starting model (those the rank run, starting its phase at step 0, trains on), ends lower with it; CE
    alone teaches one target per query, not the teacher's order."""
    from adbatch.index.dense import DenseRetriever
    from adbatch.models import load_causal_lm
    from adbatch.training import default_ad_texts, prepare_model_for_index
    from adbatch.training.rank_loss import build_groups, mine_beams, rank_queries, spans_of

    index = assets["index"]
    dense = DenseRetriever(index, "cpu")
    rank = RankLossConfig(enabled=True, weight=1.0, teacher_k=3, negatives=2, max_positives=1, queries_per_step=8,
                          max_queries=8, start_fraction=0.0, temperature=0.1)
    texts = default_ad_texts(index)
    start, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    prepare_model_for_index(start, tok, index, texts)
    rq = rank_queries(tok, index, dense, rank, targets=index.ad_codes.column("token_ids").to_pylist(),
                      max_query_tokens=48, labelled=_labelled(index),
                      spans=spans_of([texts[a] for a in index.ad_ids], _config(rank, 8).pseudo_queries))
    with torch.no_grad():
        groups = build_groups(rq, mine_beams(start, rq, rank), rank)
    kls = {"start": _listwise_kl_now(start, rq, groups, rank, tok.pad_token_id)}
    for on in (False, True):
        model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
        model, tok, _ = train_on_index(index, None, _config(rank.replace(enabled=on), 8), model=model, tokenizer=tok,
                                       device="cpu", progress=False, labelled=_labelled(index), dense=dense)
        kls[on] = _listwise_kl_now(model, rq, groups, rank, tok.pad_token_id)
    assert kls[True] < 0.9 * kls[False] and kls[True] < 0.9 * kls["start"], kls
