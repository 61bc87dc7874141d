"""Training throughput pieces: sequence packing, the fused chunked LM head + cross-entropy, MFU accounting.

The packing tests hold the promise that packing changes how a step is computed, not what: each
example's packed loss equals its unpacked loss (fp32, tiny random-init Llama / Qwen2 / Gemma3 with
sliding windows shorter than the examples), and one optimizer step over the same examples gives the
same weights packed or padded.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adbatch.config import ConfigError
from adbatch.training import trainer
from adbatch.training.data import (ExampleKind, build_prompted, collate, collate_packed, packed_attention_mask,
                                   packed_batches)
from adbatch.training.head_loss import linear_cross_entropy
from adbatch.training.trainer import (TrainConfig, TrainStats, check_packing, count_params,
                                      packed_masks, target_logits, train_loop)

from conftest import make_tiny_llama

REPO = Path(__file__).resolve().parent.parent


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0):
    """Random-init causal LMs of real architectures; sliding windows (6) shorter than the test examples."""
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "llama":
        model = make_tiny_llama(seed=seed)
    elif family == "qwen2":  # layer 0 full, layer 1 sliding (max_window_layers=1)
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                             tie_word_embeddings=True))
    elif family == "gemma3":  # its own mask mapping: layer 0 sliding, layer 1 full
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=6,
                                                   layer_types=["sliding_attention", "full_attention"]))
    else:
        raise ValueError(family)
    model.config._attn_implementation = attn
    return model.float().eval()


def random_examples(n: int, seed: int = 0, vocab: int = 512, prompt=(3, 9), target=(1, 8)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(*prompt, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    targets = [torch.randint(1, vocab, (int(torch.randint(*target, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    return build_prompted(prompts, targets, ExampleKind.INDEXING, list(range(n)))


@pytest.mark.parametrize("row_len,rows,shuffle", [(16, 3, True), (32, 2, False), (64, 8, True)])
def test_packed_batches_cover_every_example_once(row_len, rows, shuffle):
    ex = random_examples(200, seed=1)
    plans = packed_batches(ex.lengths, row_len, rows, torch.Generator().manual_seed(0), shuffle=shuffle)
    seen = torch.cat([p.index for p in plans])
    assert torch.equal(seen.sort().values, torch.arange(len(ex)))  # each example exactly once
    assert all(p.row_sizes.numel() == rows for p in plans[:-1]) and plans[-1].row_sizes.numel() <= rows
    n_rows = sum(p.row_sizes.numel() for p in plans)
    for p in plans:  # no row over its length
        used = torch.zeros(p.row_sizes.numel(), dtype=torch.int64)
        used.index_add_(0, torch.repeat_interleave(torch.arange(p.row_sizes.numel()), p.row_sizes), ex.lengths[p.index])
        assert int(used.max()) <= row_len
    # best-fit decreasing wastes less than one shortest example per row on average
    assert n_rows * row_len - int(ex.lengths.sum()) < n_rows * int(ex.lengths.min())
    # the row count depends only on the lengths: the unshuffled count is every epoch's count
    again = packed_batches(ex.lengths, row_len, rows, torch.Generator().manual_seed(5), shuffle=True)
    assert len(again) == len(plans)
    with pytest.raises(ValueError, match="does not fit"):
        packed_batches(ex.lengths, int(ex.lengths.max()) - 1, rows)


def test_collate_packed_layout():
    ex = random_examples(12, seed=2)
    plan = packed_batches(ex.lengths, 32, 4, torch.Generator().manual_seed(0))[0]
    b = collate_packed(ex, plan, 5, 32, pad_id=0)  # one more row than the plan: all padding
    assert b.input_ids.shape == b.position_ids.shape == b.seq_ids.shape == (5, 32) and b.packed
    assert b.num_tokens == int(ex.lengths[plan.index].sum()) == int(b.attention_mask.sum())
    assert b.num_slots == 160 and int(b.attention_mask[4].sum()) == 0
    k = 0
    for r, size in enumerate(plan.row_sizes.tolist()):
        col = 0
        for j in range(size):
            e = int(plan.index[k])
            lo, hi = int(ex.offsets[e]), int(ex.offsets[e + 1])
            n, p = hi - lo, int(ex.prompt_lens[e])
            assert b.input_ids[r, col:col + n].tolist() == ex.tokens[lo:hi].tolist()
            assert b.position_ids[r, col:col + n].tolist() == list(range(n))
            assert (b.seq_ids[r, col:col + n] == j).all()
            assert (b.labels[r, col:col + p] == -100).all()
            assert b.labels[r, col + p:col + n].tolist() == ex.tokens[lo + p:hi].tolist()
            col, k = col + n, k + 1
        assert (b.seq_ids[r, col:] == size).all() and (b.labels[r, col:] == -100).all()  # the tail: its own id
        assert b.position_ids[r, col:].tolist() == list(range(32 - col))
    # every target's predicting position is in the same example as the target
    flat_seq = b.seq_ids[:, :-1].reshape(-1)[b.target_index]
    assert torch.equal(flat_seq, b.seq_ids[:, 1:].reshape(-1)[b.target_index])


def test_packed_attention_mask_is_block_diagonal_causal():
    seq = torch.tensor([[0, 0, 0, 1, 1, 2]], dtype=torch.int32)
    m = packed_attention_mask(seq)[0, 0]
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(m, want)
    w = packed_attention_mask(seq, sliding_window=2)[0, 0]
    assert torch.equal(w, want & ~torch.tensor([[i - j >= 2 for j in range(6)] for i in range(6)]))


def _per_example_losses(model, ex, plan, rows, row_len):
    """(packed, unpacked) per-example mean target cross-entropy, float64 ``[k]`` in plan order."""
    b = collate_packed(ex, plan, rows, row_len, pad_id=0)
    with torch.no_grad():
        logits, targets = target_logits(model, b.input_ids, packed_masks(model, b.seq_ids), b.labels,
                                        b.target_index, b.position_ids)
    ce = F.cross_entropy(logits, targets, reduction="none").double()
    # example (in plan order) of each target: its row's first example + its seq id
    L1 = row_len - 1
    row, col = b.target_index // L1, b.target_index % L1
    first = torch.zeros(plan.row_sizes.numel() + 1, dtype=torch.int64)
    first[1:] = torch.cumsum(plan.row_sizes, 0)
    which = first[row] + b.seq_ids[row, col + 1].long()
    k = plan.index.numel()
    packed = torch.zeros(k, dtype=torch.float64).index_add_(0, which, ce)
    packed /= torch.bincount(which, minlength=k).double()
    unpacked = []
    for e in plan.index.tolist():
        ub = collate(ex, torch.tensor([e]), pad_id=0)
        with torch.no_grad():
            lg, t = target_logits(model, ub.input_ids, ub.attention_mask, ub.labels, ub.target_index)
        unpacked.append(float(F.cross_entropy(lg, t)))
    return packed, torch.tensor(unpacked, dtype=torch.float64)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"),
                                         ("gemma3", "sdpa"), ("gemma3", "eager")])
def test_packed_loss_equals_unpacked_loss(family, attn):
    model = tiny_model(family, attn)
    assert check_packing(model) is None
    # prompts 3-8 and targets 1-7 tokens: examples up to 15 tokens, longer than the window of 6
    ex = random_examples(40, seed=3, prompt=(3, 9), target=(1, 8))
    plans = packed_batches(ex.lengths, 32, 4, torch.Generator().manual_seed(0))
    for plan in plans[:3]:
        packed, unpacked = _per_example_losses(model, ex, plan, 4, 32)
        assert torch.allclose(packed, unpacked, rtol=0, atol=2e-5), (family, (packed - unpacked).abs().max())
    assert unpacked.std() > 0.01  # the examples differ: equal losses are not a coincidence


def test_wrong_mask_is_caught_and_training_falls_back_to_padding(monkeypatch, caplog):
    model = tiny_model("llama")
    # a mask that lets examples see each other (plain causal over the whole row)
    monkeypatch.setattr(trainer, "packed_masks",
                        lambda core, seq: packed_attention_mask(torch.zeros_like(seq)))
    why = check_packing(model)
    assert why is not None and "differ" in why
    ex = random_examples(30, seed=4)
    with caplog.at_level(logging.WARNING, logger="adbatch.training.trainer"):
        stats, _ = train_loop(model, ex, TrainConfig(max_steps=2, batch_tokens=128, pack_length=32),
                              pad_id=0, progress=False)
    assert stats.packing == {"enabled": False, "fallback": why}
    assert "packing is off" in caplog.text
    assert stats.summary(model, torch.device("cpu"))["packing"]["fallback"] == why


def test_unsupported_attention_is_reported():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in check_packing(model)


@pytest.mark.parametrize("n,chunk", [(37, 8), (5, 4096)])
def test_linear_cross_entropy_matches_plain_head(n, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (n,), generator=g)
    loss = linear_cross_entropy(h, w, t, chunk)
    (loss * 3.0).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.t()).float(), t)
    (ref * 3.0).backward()
    assert loss.dtype == torch.float32 and torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(gh, h.grad, atol=1e-6) and torch.allclose(gw, w.grad, atol=1e-6)


def test_linear_cross_entropy_under_bf16_autocast_matches_the_autocast_head():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = torch.randn(64, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 64, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t, 16)
        ref = F.cross_entropy(F.linear(h, w).float(), t)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref.backward()
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert torch.allclose(loss, ref, atol=1e-5)
    # bf16 matmuls: same grid as autocast's, accumulation order differs by chunk
    assert torch.allclose(gh, h.grad, rtol=2e-2, atol=2e-3) and torch.allclose(gw, w.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_step_packed_equals_one_step_padded(family):
    """All examples in one micro-batch either way: the same loss, gradients and updated weights."""
    ex = random_examples(24, seed=5)
    a, b = tiny_model(family), tiny_model(family)
    cfg = TrainConfig(max_steps=1, batch_tokens=4096, pack_length=64, warmup_fraction=0.0, max_grad_norm=0.0)
    sa, _ = train_loop(a, ex, cfg, pad_id=0, progress=False)
    sb, _ = train_loop(b, ex, cfg.replace(packing=False), pad_id=0, progress=False)
    assert sa.packing["enabled"] and not sb.packing["enabled"]
    assert sa.tokens == sb.tokens == int(ex.lengths.sum()) and sa.target_tokens == sb.target_tokens
    assert sa.losses[0][1] == pytest.approx(sb.losses[0][1], abs=1e-5)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def test_mfu_counts_the_head_at_target_positions_and_padding_share():
    tied = make_tiny_llama()  # vocab 512 x 64, tied
    body, head = count_params(tied)
    total = sum(p.numel() for p in tied.parameters())
    assert head == 512 * 64 and body == total - head
    from transformers import LlamaConfig, LlamaForCausalLM

    untied = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    b2, h2 = count_params(untied)
    assert h2 == 512 * 64 and b2 == sum(p.numel() for p in untied.parameters()) - 2 * 512 * 64
    st = TrainStats(tokens=900, padded_tokens=1000, target_tokens=200, seconds=2.0, micro_batches=1,
                    micro_batches_per_epoch=1)
    s = st.summary(tied, torch.device("cuda"))  # numbers only: no CUDA needed
    flops = 6 * body * 900 + 6 * head * 200
    assert s["model_flops"] == flops and s["mfu"] == round(flops / 2.0 / 989e12, 4)
    assert s["mfu_peak_tflops"] == 989.0 and s["padded_share"] == 0.1 and s["tokens_per_s"] == 450.0
    assert s["padded_tokens_per_s"] == 500.0
    assert "mfu" not in st.summary(tied, torch.device("cpu"))


def test_packing_knobs_validated_and_recorded():
    with pytest.raises(ConfigError, match="pack_length"):
        TrainConfig(pack_length=0).validate()
    with pytest.raises(ConfigError, match="ce_chunk_tokens"):
        TrainConfig(ce_chunk_tokens=0).validate()
    with pytest.raises(ConfigError, match="batch_tokens"):
        TrainConfig(batch_tokens=128, pack_length=256).validate()
    TrainConfig(batch_tokens=128, pack_length=256, packing=False).validate()
    d = TrainConfig().to_dict()
    assert d["packing"] is True and d["pack_length"] == 256 and d["compile"] is True and d["ce_chunk_tokens"] == 8192
    assert TrainConfig.from_dict(d) == TrainConfig()


def test_long_example_widens_the_rows():
    ex = random_examples(10, seed=6, prompt=(3, 5), target=(1, 3))
    long = build_prompted([[5] * 40], [[6, 7]], ExampleKind.INDEXING, [0])
    from adbatch.training.data import TrainingExamples

    both = TrainingExamples.concat([ex, long])
    stats, _ = train_loop(make_tiny_llama().train(), both, TrainConfig(max_steps=1, batch_tokens=256, pack_length=16),
                          pad_id=0, progress=False)
    assert stats.packing == {"enabled": True, "rows": 5, "row_tokens": 48}


def test_throughput_bench_smoke(tmp_path):
    """bench/train_throughput.py --smoke: the device script's CPU path, two variants, JSON out."""
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "train_throughput.py"), "--smoke", "--out", str(out),
                           "--variant", "packing=off"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    res = json.loads(out.read_text())
    names = [v["name"] for v in res["variants"]]
    assert names == ["default", "packing=off"]
    for v in res["variants"]:
        assert v["steps_timed"] >= 3 and v["tokens_per_s"] > 0 and v["real_tokens_per_s"] > 0
        assert 0 <= v["padded_share"] < 1 and math.isfinite(v["step_ms"])
    assert res["variants"][0]["packing"]["enabled"] and not res["variants"][1]["packing"]["enabled"]
    assert "tokens/s" in proc.stdout
