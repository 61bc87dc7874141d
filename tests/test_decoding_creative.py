"""Creative generation on the shared KV-cache loop, and the real default model on a small trie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adbatch.config import ConfigError
from adbatch.decoding import CreativeConfig, TargetSearchConfig, generate_creatives, search_targets
from conftest import make_tiny_llama


class _Tok:
    """Minimal tokenizer: token t decodes to chr(ord('a') + t % 26); token 2 is EOS."""

    eos_token_id = 2

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join("" if (t == 2 and skip_special_tokens) else chr(97 + t % 26) for t in s) for s in seqs]


# HF's greedy knows neither n-gram guard (they are on by default): off where texts are compared with it
NO_GUARDS = {"no_repeat_ngram_size": 0, "prompt_ngram_block": 0}


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(vocab_size=40, seed=4)


def _hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_and_scores_are_mean_logprob(tiny):
    prompts = [[5, 6, 7, 8], [9, 10]]
    cfg = CreativeConfig(strategy="greedy", max_new_tokens=6, stop_strings=["zzzz"], **NO_GUARDS)
    out = generate_creatives(tiny, _Tok(), prompts, cfg)
    for prompt, [(text, score)] in zip(prompts, out):
        toks = _hf_greedy(tiny, prompt, 6)
        if 2 in toks:
            toks = toks[: toks.index(2) + 1]
        assert text == _Tok().batch_decode([toks])[0]
        with torch.no_grad():
            lp = torch.log_softmax(tiny(torch.tensor([prompt + toks])).logits.float(), -1)[0]
        want = np.mean([float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(toks)])
        assert score == pytest.approx(want, abs=1e-4)


def test_stop_string_cuts_text(tiny):
    prompts = [[5, 6, 7, 8]]
    full = _Tok().batch_decode([_hf_greedy(tiny, prompts[0], 8)])[0]
    stop = full[3:5]
    cfg = CreativeConfig(strategy="greedy", max_new_tokens=8, stop_strings=[stop], **NO_GUARDS)
    [(text, _)] = generate_creatives(tiny, _Tok(), prompts, cfg)[0]
    assert text == full[: full.find(stop)]


def test_sampling_is_seeded_and_beam_is_ranked(tiny):
    prompts = [[5, 6, 7], [11, 12, 13, 14]]
    cfg = CreativeConfig(strategy="sample", num_return=3, max_new_tokens=5, temperature=0.9, top_p=0.9,
                         seed=7, stop_strings=["zzzz"])
    a = generate_creatives(tiny, _Tok(), prompts, cfg)
    b = generate_creatives(tiny, _Tok(), prompts, cfg)
    assert a == b and all(len(x) == 3 for x in a)
    beam = generate_creatives(tiny, _Tok(), prompts, CreativeConfig(strategy="beam", num_beams=4, num_return=3,
                                                                    max_new_tokens=5, stop_strings=["zzzz"]))
    for cands in beam:
        assert 1 <= len(cands) <= 3
        scores = [s for _, s in cands]
        assert scores == sorted(scores, reverse=True)
    greedy = generate_creatives(tiny, _Tok(), prompts, CreativeConfig(max_new_tokens=5, stop_strings=["zzzz"]))
    # beam search keeps the greedy path among its hypotheses, so its best mean log-prob is not lower
    # when both run to the same length without EOS
    for g, bm in zip(greedy, beam):
        if len(g[0][0]) == 5 and all(len(t) == 5 for t, _ in bm):
            assert bm[0][1] >= g[0][1] - 1e-5


def test_creative_config_validation():
    with pytest.raises(ConfigError, match="num_return"):
        CreativeConfig(strategy="greedy", num_return=2)
    with pytest.raises(ConfigError, match="top_p"):
        CreativeConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="stop_strings"):
        CreativeConfig(stop_strings=[""])


@pytest.mark.slow
@pytest.mark.realmodel
def test_real_model_small_trie_exact_and_creative():
    from adbatch.models import load_causal_lm
    from adbatch.serving.prompts import encode_creative_prompt, encode_targeting_prompt
    from adbatch.index.trie import Trie

    model, tok = load_causal_lm()
    titles = ["Behr Premium Plus Ultra exterior paint", "Behr interior eggshell paint", "DEWALT 20V drill",
              "DEWALT 20V impact driver", "Husky 26 in. tool chest", "Ryobi 18V cordless drill kit",
              "Rust-Oleum spray paint gloss black", "Glacier Bay bathroom faucet"]
    seqs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in titles]
    trie = Trie.from_sequences(seqs)
    prompts = [encode_targeting_prompt(tok, q) for q in ("paint for outside walls", "cordless drill")]
    res = {m: search_targets(model, prompts, trie, TargetSearchConfig(num_beams=4, top_k=3, verify=m))
           for m in ("off", "always")}
    for q, prompt in enumerate(prompts):
        for mode, r in res.items():
            for row, score in zip(r.rows[q].tolist()[:2], r.scores[q].tolist()[:2]):
                with torch.no_grad():
                    lp = torch.log_softmax(model(torch.tensor([prompt + seqs[row]])).logits.float(), -1)[0]
                want = float(sum(lp[len(prompt) - 1 + j, t] for j, t in enumerate(seqs[row])))
                assert score == pytest.approx(want, abs=2e-3), mode
        assert (res["always"].scores[q] >= res["off"].scores[q] - 1e-3).all()
    ad = {"advertiser": "Acme Paint", "description": "Exterior paint that lasts 20 years"}
    [(text, score)] = generate_creatives(model, tok, [encode_creative_prompt(tok, ad)],
                                         CreativeConfig(max_new_tokens=12))[0]
    assert text.strip() and "\n" not in text and -10 < score < 0


def test_sampled_texts_do_not_depend_on_batch_composition(tiny):
    """A prompt's sampled texts are the same alone, in a batch, or at another place in the batch
    (the generate stage's batches, OOM halving and partitioning must not change a creative)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [9, 10], [12, 13, 14, 15]]
    cfg = CreativeConfig(strategy="sample", num_return=2, max_new_tokens=6, stop_strings=["zz"], seed=3)
    batched = generate_creatives(tiny, _Tok(), prompts, cfg)
    alone = [generate_creatives(tiny, _Tok(), [p], cfg)[0] for p in prompts]
    reordered = generate_creatives(tiny, _Tok(), prompts[::-1], cfg)[::-1]
    for b, a, r in zip(batched, alone, reordered):
        assert [t for t, _ in b] == [t for t, _ in a] == [t for t, _ in r]
        for (_, sb), (_, sa) in zip(b, a):
            assert sb == pytest.approx(sa, abs=1e-4)


class _NewlineTok:
    """Token 2 is EOS; tokens 3..19 decode to a newline + letter (like '\\n\\n' or '.\\n' in real
    vocabularies), the others to one letter."""

    eos_token_id = 2

    def batch_decode(self, seqs, skip_special_tokens=True):
        def f(t):
            return "" if t == 2 else ("\n" + chr(97 + t) if 3 <= t < 20 else chr(97 + t % 26))

        return ["".join(f(t) for t in s) for s in seqs]


def test_beam_returns_distinct_texts():
    model = make_tiny_llama(vocab_size=40, seed=4)
    cfg = CreativeConfig(strategy="beam", num_beams=4, num_return=4, max_new_tokens=6)
    for prompt in ([5, 6, 7], [11, 12, 13, 14], [30, 31]):
        [cands] = generate_creatives(model, _NewlineTok(), [prompt], cfg)
        texts = [t for t, _ in cands]
        assert len(texts) == len(set(texts)) >= 1
        scores = [s for _, s in cands]
        assert scores == sorted(scores, reverse=True)


def test_inverse_cdf_sampling_follows_the_distribution():
    """_sample picks by inverse CDF at u: over an even grid of u the token shares equal the
    (temperature-scaled, nucleus-cut and renormalised) probabilities, and a cut token is never drawn."""
    from adbatch.decoding.creative import _sample

    n = 1000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    logp = torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(n, 3)
    tok = _sample(logp, CreativeConfig(strategy="sample", temperature=1.0, top_p=1.0), u)
    assert torch.bincount(tok, minlength=3).tolist() == [500, 300, 200]
    tok = _sample(logp, CreativeConfig(strategy="sample", temperature=1.0, top_p=0.6), u)
    assert torch.bincount(tok, minlength=3).tolist() == [625, 375, 0]


def test_nucleus_is_cut_among_the_top_candidates():
    """The nucleus comes from a top-k of NUCLEUS_CANDIDATES, not a full sort: on a peaked row it draws
    exactly the tokens the full-vocabulary cut draws; on a flat row (its top candidates hold < top_p) it
    draws only among those candidates."""
    from adbatch.decoding.creative import NUCLEUS_CANDIDATES, _sample

    V, n = 3 * NUCLEUS_CANDIDATES, 512
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    gen = torch.Generator().manual_seed(0)
    peaked = torch.log_softmax(torch.randn(V, generator=gen) * 4, -1).expand(n, V)
    cfg = CreativeConfig(strategy="sample", temperature=1.0, top_p=0.9)
    tok = _sample(peaked, cfg, u)
    # the reference: the whole vocabulary sorted, the same inverse CDF over vocabulary order
    p = peaked[0].exp()
    sp, si = p.sort(descending=True)
    keep = torch.zeros(V).scatter_(0, si, sp.masked_fill(sp.cumsum(0) - sp > 0.9, 0.0))
    ref = torch.searchsorted(keep.cumsum(0), (u * keep.sum())[:, None]).view(-1).clamp(max=V - 1)
    assert torch.equal(tok, ref)
    m = 4 * NUCLEUS_CANDIDATES  # an even grid of u over (0, 1]: every candidate of a flat row is drawn
    # near-flat with a strict order (no ties for top-k to break): its top candidates hold ~1/3 < top_p
    flat = (-torch.arange(V, dtype=torch.float32) * 1e-6).log_softmax(-1).expand(m, V)
    drawn = _sample(flat, cfg, (torch.arange(m, dtype=torch.float32) + 0.5) / m).unique()
    top = flat[0].topk(NUCLEUS_CANDIDATES).indices
    assert torch.isin(drawn, top).all() and len(drawn) == NUCLEUS_CANDIDATES


def test_ban_repeated_ngrams_bans_exactly_the_tokens_that_complete_a_seen_ngram():
    from adbatch.decoding.creative import ban_repeated_ngrams

    gen = torch.tensor([[5, 6, 7, 5, 6, -1], [1, 2, 3, 4, 5, -1], [-1, -1, -1, -1, -1, -1]])
    logits = torch.zeros(3, 10)
    out = ban_repeated_ngrams(logits, gen, 5, 3)
    # row 0: last two tokens (5, 6) were followed by 7 before -> 7 banned, nothing else
    assert torch.isinf(out[0, 7]) and torch.isfinite(out[0]).sum() == 9
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[2]).all()  # no repeat / an ended row
    assert ban_repeated_ngrams(logits, gen, 2, 3) is logits  # too early for an earlier 3-gram
    # bigrams: (6) was followed by 7 -> banned
    assert torch.isinf(ban_repeated_ngrams(logits, gen, 5, 2)[0, 7])


@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam"])
def test_no_repeat_ngram_size_keeps_every_text_free_of_repeated_ngrams(strategy):
    """A random-init model loops; with the guard no token 3-gram occurs twice in any generated text
    (vocabulary of 26: ``_Tok`` decodes token t to one letter, so the text gives the ids back)."""
    model = make_tiny_llama(vocab_size=26, seed=5)
    prompts = [[3, 4, 5], [7, 8, 9, 10], [11, 11, 11]]
    kw = ({"num_beams": 3, "num_return": 2} if strategy == "beam"
          else {"num_return": 2, "temperature": 0.2} if strategy == "sample" else {})
    base = dict(strategy=strategy, max_new_tokens=14, stop_strings=["zzzz"], prompt_ngram_block=0, **kw)
    plain = generate_creatives(model, _Tok(), prompts, CreativeConfig(**base, no_repeat_ngram_size=0))
    guarded = generate_creatives(model, _Tok(), prompts, CreativeConfig(**base, no_repeat_ngram_size=3))

    def repeats(text):
        ids = [ord(c) - 97 for c in text]
        grams = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
        return len(grams) - len(set(grams))

    assert sum(repeats(t) for outs in plain for t, _ in outs) > 0  # the model does loop without the guard
    assert all(repeats(t) == 0 for outs in guarded for t, _ in outs), guarded
    with pytest.raises(ConfigError):
        CreativeConfig(no_repeat_ngram_size=1)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_prompt_ngram_block_never_copies_an_ngram_of_the_prompt(strategy):
    model = make_tiny_llama(vocab_size=26, seed=5)
    # every token twice in a row: a random model's loop ("kkkk") copies a bigram of each prompt
    doubled = [t for t in range(26) for _ in range(2)]
    prompts = [doubled, doubled[::-1], doubled[20:] + doubled[:20]]
    kw = {"num_beams": 3, "num_return": 2} if strategy == "beam" else {}
    base = dict(strategy=strategy, max_new_tokens=10, stop_strings=["zzzz"], no_repeat_ngram_size=0, **kw)

    def copied(outs, n):
        hits = 0
        for p, per_prompt in zip(prompts, outs):
            grams = {tuple(p[i:i + n]) for i in range(len(p) - n + 1)}
            for text, _ in per_prompt:
                ids = [ord(c) - 97 for c in text]
                hits += sum(tuple(ids[i:i + n]) in grams for i in range(len(ids) - n + 1))
        return hits

    assert copied(generate_creatives(model, _Tok(), prompts, CreativeConfig(**base, prompt_ngram_block=0)), 2) > 0
    guarded = generate_creatives(model, _Tok(), prompts, CreativeConfig(**base, prompt_ngram_block=2))
    assert copied(guarded, 2) == 0, guarded
