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
    assert cfg.learn_student_temperature and cfg.student_temperature_lr == 0.05
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
                dict(sources=()), dict(mode=RankLossMode.MARGIN, negatives=0), dict(margin=-1.0),
                dict(student_temperature_lr=0.0), dict(student_temperature_lr=float("inf"))):
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


def test_learned_student_temperature_makes_the_listwise_loss_scale_free():
    """With the student temperature fitted, the listwise loss depends on the student scores' shape only: scores 10x
    as far apart (a more confident model) reach the same minimum at a 10x temperature, and scores that are an affine
    map of the teacher's logits reach 0 whatever their scale. The raw sums (temperature 1) are scale-bound."""
    from adbatch.training.rank_loss import initial_student_temperature

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[4, 3:] = False
    teacher = (0.6 + 0.3 * torch.rand(6, 7, generator=g)) / 0.05        # cosines ~0.6-0.9 at temperature 0.05
    student = -3.0 * torch.rand(6, 7, generator=g) - 0.3 * teacher      # summed log-probs, loosely teacher-ordered

    def fit(s: torch.Tensor) -> tuple[float, float]:
        """(min loss, temperature): log tau from the data-driven start the rank phase uses, minimised exactly."""
        log_tau = torch.tensor(math.log(initial_student_temperature(s, teacher, mask)), requires_grad=True)
        opt = torch.optim.LBFGS([log_tau], lr=1.0, max_iter=100, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = listwise_kl_loss(s, teacher, mask, log_tau.exp())
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            return float(listwise_kl_loss(s, teacher, mask, log_tau.exp())), float(log_tau.exp())

    assert abs(initial_student_temperature(10 * student, teacher, mask)
               - 10 * initial_student_temperature(student, teacher, mask)) < 1e-4
    (l1, t1), (l10, t10) = fit(student), fit(10 * student)
    assert abs(l1 - l10) < 1e-4 and abs(t10 / t1 - 10) < 1e-2, (l1, l10, t1, t10)
    raw1, raw10 = float(listwise_kl_loss(student, teacher, mask)), float(listwise_kl_loss(10 * student, teacher, mask))
    assert raw10 > 5 * raw1 and l1 < raw1, (raw1, raw10, l1)  # temperature 1: the wider the scores, the worse
    # at the fitted temperature the loss has a minimum in tau (zero gradient), so it asks nothing of the scale
    log_tau = torch.tensor(math.log(t10), requires_grad=True)
    listwise_kl_loss(10 * student, teacher, mask, log_tau.exp()).backward()
    assert abs(float(log_tau.grad)) < 1e-3
    # an affine map of the teacher's logits (any scale, any per-group shift) is a perfect student
    for scale in (0.5, 20.0):
        affine = scale * teacher - 40.0 * torch.arange(6.0)[:, None]
        loss, tau = fit(affine)
        assert loss < 1e-4 and abs(tau / scale - 1) < 1e-2, (scale, loss, tau)


@pytest.mark.parametrize("mode", [RankLossMode.LISTWISE_KL, RankLossMode.MARGIN])
def test_rank_loss_decreases_after_the_ids_are_learned(assets, mode):
    """The rank phase in the second half of a run whose first half learned the ids with cross-entropy (the GPU's
    regime, where the raw-sum listwise loss rose): through train_on_index, the rank loss of one fixed set of groups
    falls clearly over the phase, next to the CE. Listwise: the student temperature is learned (set from the first
    rank batch, moved by its own optimizer, recorded, not in the model)."""
    from adbatch.index.dense import DenseRetriever
    from adbatch.models import load_causal_lm

    index = assets["index"]
    torch.manual_seed(0)
    model, tok = load_causal_lm(str(assets["model"]), dtype=torch.float32, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    rank = RankLossConfig(enabled=True, mode=mode, weight=1.0, teacher_k=3, negatives=3, max_positives=1,
                          queries_per_step=8, max_queries=8, start_fraction=0.5, temperature=0.05, margin=1.0)
    cfg = _config(rank, 24).replace(lr=1e-2)
    model, tok, summary = train_on_index(index, None, cfg, model=model, tokenizer=tok, device="cpu", progress=False,
                                         labelled=_labelled(index), dense=DenseRetriever(index, "cpu"))
    r = summary.train["rank"]
    losses = [v for _, v in r["losses"]]
    assert r["start_step"] == 12 and len(losses) == 12 and all(math.isfinite(v) for v in losses), losses
    early, late = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert late < 0.7 * early, losses
    assert summary.train["final_loss"] < summary.train["first_loss"]  # the CE (+ rank) total fell too
    assert sum(p.numel() for p in model.parameters()) == n_params  # the temperature is not part of the model
    if mode is RankLossMode.LISTWISE_KL:
        t = r["student_temperature"]
        assert t["initial"] > 0 and len(t["logged"]) == 12 and t["final"] != pytest.approx(t["initial"], rel=1e-3), t
    else:
        assert "student_temperature" not in r


def test_ce_and_listwise_loss_fight_on_raw_sums_and_agree_with_a_learned_temperature():
    """The GPU's failure in miniature: a free-logit stand-in for the DSI model (per query a distribution over N ids,
    so the candidates' probabilities sum <= 1 like sequence probabilities) trained on CE of the label + 0.5 x the
    listwise loss over C candidates (label first, raised to the teacher's top). On raw sums the KL rises while the
    CE falls, and both stall apart; with the learned temperature both keep falling (the loss asks for the order)."""
    from adbatch.training.rank_loss import initial_student_temperature

    g = torch.Generator().manual_seed(0)
    Q, N, C = 16, 100, 10
    cos = (0.6 + 0.3 * torch.rand(Q, C, generator=g)).sort(1, descending=True).values
    teacher = torch.cat([cos[:, :1], cos[:, :-1]], 1) / 0.05   # slot 0: the label, tied with the teacher's top-1
    mask = torch.ones(Q, C, dtype=torch.bool)

    def run(learn: bool) -> list[tuple[float, float]]:
        z = torch.zeros(Q, N, requires_grad=True)
        log_tau = torch.zeros((), requires_grad=True)
        opts = [torch.optim.Adam([z], lr=0.05), torch.optim.Adam([log_tau], lr=0.05)]
        out = []
        for step in range(800):
            s = torch.log_softmax(z, 1)                         # [Q, N] "summed log-probs" of every id
            if learn and step == 0:
                with torch.no_grad():
                    log_tau.fill_(math.log(initial_student_temperature(s[:, :C], teacher, mask)))
            ce = -s[:, 0].mean()
            kl = listwise_kl_loss(s[:, :C], teacher, mask, log_tau.exp() if learn else 1.0)
            for o in opts:
                o.zero_grad()
            (ce + 0.5 * kl).backward()
            for o in opts:
                o.step()
            if step in (10, 799):
                out.append((float(ce), float(kl)))
        return out

    (ce0, kl0), (ce1, raw_kl) = run(learn=False)
    assert raw_kl > 1.5 * kl0 and ce1 > 0.2, (ce0, kl0, ce1, raw_kl)  # the KL rose; the CE stalled (label p < 0.82)
    (ce0, kl0), (ce1, kl1) = run(learn=True)
    assert kl1 < 0.6 * kl0 and kl1 < 0.3 * raw_kl and ce1 < 0.05, (ce0, kl0, ce1, kl1, raw_kl)
