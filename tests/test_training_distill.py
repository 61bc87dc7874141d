"""Distillation from a frozen dense teacher (tiny random-init Llamas, CPU): the loss formula, the
target-position logits on both forward paths, and a sparse run that starts from a trained model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from adbatch.config import ConfigError
from adbatch.training import DistillConfig, SparsityScheduleConfig, TrainConfig, train_on_index
from adbatch.training.data import build_examples, collate
from adbatch.training.distill import distill_loss
from adbatch.training.trainer import target_logits, train_loop
from tests.test_training import QUERIES, TITLES, fake_index, tiny

LABELLED = [(q, 100 + r) for q, r in QUERIES]


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def test_distill_loss_formula():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g)
    y = torch.randint(0, 11, (6,), generator=g)
    ce = F.cross_entropy(s, y)
    # same distributions: the soft term vanishes and only (1 - alpha) of the label loss is left
    torch.testing.assert_close(distill_loss(s, s.clone(), y, DistillConfig(alpha=0.25)), 0.75 * ce)
    torch.testing.assert_close(distill_loss(s, t, y, DistillConfig(alpha=0.0)), ce)
    # alpha 1, T = 3: T^2 * KL(p_t || p_s) at temperature 3, by hand
    p_t, log_p_s = torch.softmax(t / 3, -1), torch.log_softmax(s / 3, -1)
    want = 9.0 * (p_t * (p_t.log() - log_p_s)).sum(-1).mean()
    torch.testing.assert_close(distill_loss(s, t, y, DistillConfig(alpha=1.0, temperature=3.0)), want)
    # its gradient moves the student's distribution toward the teacher's
    s2 = s.clone().requires_grad_(True)
    cfg = DistillConfig(alpha=1.0, temperature=1.0)
    distill_loss(s2, t, y, cfg).backward()
    with torch.no_grad():
        assert distill_loss(s2 - 0.5 * s2.grad, t, y, cfg) < distill_loss(s, t, y, cfg)
    for bad in (dict(alpha=1.5), dict(alpha=-0.1), dict(temperature=0.0)):
        with pytest.raises(ConfigError):
            DistillConfig(**bad)


def test_target_logits_fast_and_plain_forward_agree(tok):
    """The decoder + head at target positions only equals slicing a plain forward's logits (the path
    taken under DDP)."""

    class Plain(torch.nn.Module):  # no get_decoder(): forces the plain forward
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, **kw):
            return self.m(**kw)

    idx = fake_index(tok, "text")
    ex, _ = build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                           dict(zip(idx.ad_ids, TITLES)), LABELLED)
    b = collate(ex, torch.arange(len(ex)), tok.pad_token_id)
    model = tiny(tok)
    with torch.no_grad():
        fast, y1 = target_logits(model, b.input_ids, b.attention_mask, b.labels, b.target_index)
        plain, y2 = target_logits(Plain(model), b.input_ids, b.attention_mask, b.labels, b.target_index)
    assert fast.shape == (b.target_index.numel(), len(tok)) and fast.dtype == torch.float32
    assert torch.equal(y1, y2) and torch.equal(y1, b.labels[:, 1:].reshape(-1)[b.target_index])
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)


def test_distill_and_teacher_go_together(tok):
    idx = fake_index(tok, "text")
    ex, _ = build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                           dict(zip(idx.ad_ids, TITLES)), LABELLED)
    cfg = TrainConfig(epochs=1, batch_tokens=256, distill=DistillConfig(enabled=True))
    with pytest.raises(ValueError, match="no teacher"):
        train_loop(tiny(tok), ex, cfg, pad_id=tok.pad_token_id, progress=False)
    with pytest.raises(ValueError, match="not enabled"):
        train_loop(tiny(tok), ex, TrainConfig(epochs=1, batch_tokens=256), pad_id=tok.pad_token_id,
                   progress=False, teacher=tiny(tok))


def test_teacher_copy_gives_zero_soft_loss_at_the_start(tok):
    """alpha = 1 and a teacher identical to the student: the first step's loss is exactly 0 (same
    distributions), and the teacher never changes."""
    idx = fake_index(tok, "text")
    ex, _ = build_examples(tok, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(),
                           dict(zip(idx.ad_ids, TITLES)), LABELLED)
    student = tiny(tok, seed=3)
    teacher = copy.deepcopy(student)
    before = [p.detach().clone() for p in teacher.parameters()]
    cfg = TrainConfig(epochs=2, lr=1e-2, batch_tokens=4096, log_every=1,
                      distill=DistillConfig(enabled=True, alpha=1.0, temperature=2.0))
    stats, _ = train_loop(student, ex, cfg, pad_id=tok.pad_token_id, progress=False, teacher=teacher)
    assert stats.losses[0][1] == pytest.approx(0.0, abs=1e-6)
    assert stats.losses[-1][1] > 0  # the student moved away (lr 1e-2) and the soft term saw it
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))
    assert not any(p.requires_grad for p in teacher.parameters())


def test_sparsify_a_trained_model_with_distillation(tok, tmp_path):
    """Dense run on the index, then progressive 2:4 from its output with the dense copy as teacher:
    the run finishes with exact 2:4 masks and a label loss well below the untrained model's."""
    idx = fake_index(tok, "text")
    texts = dict(zip(idx.ad_ids, TITLES))
    fresh_tok = lambda: tok.__class__.from_pretrained(tok.name_or_path)  # noqa: E731
    dense_cfg = TrainConfig(epochs=15, lr=1e-2, batch_tokens=256, warmup_fraction=0.1, log_every=5)
    dense, t1, s1 = train_on_index(idx, tmp_path / "dense", dense_cfg, ad_texts=texts, labelled=LABELLED,
                                   model=tiny(tok), tokenizer=fresh_tok(), device="cpu", progress=False)
    sp = SparsityScheduleConfig(enabled=True, final_n=2, one_four_fraction=0.0, start_fraction=0.1,
                                end_fraction=0.5, rescore_every=1)
    cfg = TrainConfig(epochs=10, lr=3e-3, batch_tokens=256, warmup_fraction=0.1, log_every=5, sparsity=sp,
                      distill=DistillConfig(enabled=True, alpha=0.5, temperature=2.0))
    model, _, s2 = train_on_index(idx, None, cfg, ad_texts=texts, labelled=LABELLED, init_model=tmp_path / "dense",
                                  device="cpu", progress=False)
    assert s2.sparsity["density"] == pytest.approx(0.5, abs=0.02)
    assert s2.warm_started_from_index == idx.index_hash
    ex, _ = build_examples(t1, idx.ad_ids, idx.ad_codes.column("token_ids").to_pylist(), texts, LABELLED)
    b = collate(ex, torch.arange(len(ex)), t1.pad_token_id)
    with torch.no_grad():
        ce = [F.cross_entropy(*target_logits(m, b.input_ids, b.attention_mask, b.labels, b.target_index)).item()
              for m in (model, tiny(tok))]
    assert ce[0] < 0.5 * ce[1], ce
