"""Creative (free-text) generation on the decode engine: greedy, sampling, beam search.

Each prompt's KV is computed once (the engine's shared prompt region); its ``num_return`` samples or
``num_beams`` beams are slot rows that read it, each with its own suffix. Every step feeds one token
per row (graph-replayed on CUDA). A row ends at the model's EOS token or at a token whose text
contains a stop string, both checked on the device against a per-vocabulary mask built once per
(tokenizer, stop strings); the host looks at the rows only every ``SYNC_EVERY`` steps (are all
done?) and once at the end, when the texts are decoded and cut before the first stop string (which
also catches a stop string split across tokens). Each returned text carries the mean log-prob per
generated token (full-vocabulary log-softmax at temperature 1), counted up to and including the
token that ended it (EOS or the stop string's last token).
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch

from adbatch.decoding.config import CreativeConfig, CreativeStrategy
from adbatch.decoding.engine import DecodeEngine, check_supported, serving_engine

NEG_INF = float("-inf")
SYNC_EVERY = 4  # steps between the host's "all rows done?" checks (one 1-byte sync each)
# the nucleus is cut from this many most likely tokens, not from a sort of the whole vocabulary: a
# top-k of 1,024 of 49,152 makes the whole cut 6.0x cheaper on a 2-core CPU (256 rows: 0.49 s vs 2.9 s;
# the sort took 74 % of the query generator's CPU time); a row whose 1,024 most likely tokens hold less
# than top_p samples among those (top-k 1,024 then top-p, as HF applies its top_k before its top_p)
NUCLEUS_CANDIDATES = 1024

_STOP_MASKS: "weakref.WeakKeyDictionary[Any, dict[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is None:
            continue
        ids.update([e] if isinstance(e, int) else list(e))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def end_token_mask(model: Any, tokenizer: Any, stops: list[str], vocab: int, device: torch.device
                   ) -> torch.Tensor:
    """``Bool[vocab]``: tokens that end a text — the model's EOS ids, and tokens whose own text
    contains a stop string (decoded once per tokenizer and stop list, then cached)."""
    key = (tuple(stops), vocab, tuple(_eos_ids(model, tokenizer)))
    try:
        per_tok = _STOP_MASKS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build the mask every call
        per_tok = {}
    mask = per_tok.get(key)
    if mask is None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        if stops:
            try:
                n = min(vocab, len(tokenizer))
            except TypeError:
                n = vocab
            texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=True)
            hits = [i for i, text in enumerate(texts) if any(s in text for s in stops)]
            mask[hits] = True
        for e in _eos_ids(model, tokenizer):
            if 0 <= e < vocab:
                mask[e] = True
        per_tok[key] = mask
    return mask.to(device)


def _row_uniforms(prompts: list[list[int]], n: int, seed: int, steps: int) -> torch.Tensor:
    """``Float32[R, steps]`` in (0, 1], R = len(prompts) * n: row (prompt, sample i) draws its numbers
    from a generator seeded by (seed, i, the prompt's tokens), so a text never depends on the other
    prompts of its batch or its place there (batch size, out-of-memory halving and partitioning do
    not change a creative). Drawn once per batch, so the token loop has no per-row host work."""
    rows = []
    for p in prompts:
        for i in range(n):
            digest = hashlib.sha256(f"{seed}:{i}:{','.join(map(str, p))}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            rows.append(1.0 - torch.rand(steps, generator=gen))  # (0, 1]: never selects a zero-probability token
    return torch.stack(rows)


def _sample(logp: torch.Tensor, cfg: CreativeConfig, u: torch.Tensor | None) -> torch.Tensor:
    """``logp: Float32[R, V]`` -> ``Long[R]`` by temperature + nucleus sampling: inverse CDF at
    ``u: Float32[R]`` in (0, 1] (see :func:`_row_uniforms`). The nucleus (``top_p < 1``) is taken among
    the :data:`NUCLEUS_CANDIDATES` most likely tokens: a row whose top candidates hold less than
    ``top_p`` samples from all of them."""
    if cfg.strategy is CreativeStrategy.GREEDY:
        return logp.argmax(-1)
    probs = torch.softmax(logp / cfg.temperature, -1)
    if cfg.top_p >= 1.0:
        return _inverse_cdf(probs, u)
    sp, si = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), -1)  # sorted, most likely first
    drop = sp.cumsum(-1) - sp > cfg.top_p  # keep the smallest prefix reaching top_p
    # the CDF runs over the candidates in vocabulary order (as over the whole vocabulary, whose cut
    # tokens add zeros): [R, K] work, not a scatter and a cumsum over [R, V]
    si, order = si.sort(-1)
    return si.gather(1, _inverse_cdf(sp.masked_fill(drop, 0.0).gather(1, order), u)[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``probs: Float32[R, N]`` (unnormalised) -> ``Long[R]``: per row the first column whose cumulative
    mass reaches ``u * total``."""
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).view(-1)
    return tok.clamp_(max=probs.shape[-1] - 1)


def _mask_banned(logits: torch.Tensor, bans: list[torch.Tensor]) -> torch.Tensor:
    """``logits: [R, V]`` with ``-inf`` at the tokens listed in ``bans`` (each ``Long[R, J]``; the value ``V``
    bans nothing): one scatter and one masked fill for every guard together."""
    if not bans:
        return logits
    R, V = logits.shape
    idx = bans[0] if len(bans) == 1 else torch.cat(bans, 1)
    banned = torch.zeros(R, V + 1, dtype=torch.bool, device=logits.device).scatter_(1, idx, True)[:, :V]
    return logits.masked_fill(banned, NEG_INF)


def _repeat_bans(generated: torch.Tensor, t: int, n: int, V: int) -> torch.Tensor | None:
    """``Long[R, J]``: per row the tokens that would complete an n-gram already in its generated tokens
    ``generated[:, :t]`` (``V`` where none), or None while ``t < n`` (no earlier n-gram yet).

    The ``t - n + 1`` earlier windows of ``n - 1`` tokens are compared with the row's last ``n - 1`` tokens
    at once; a matching window bans the token that followed it."""
    if n < 2 or t < n:
        return None
    seen = generated[:, :t]
    windows = seen.unfold(1, n - 1, 1)[:, : t - n + 1]            # [R, J, n-1]: windows j = 0 .. t-n
    match = (windows == seen[:, None, t - n + 1:]).all(-1)        # [R, J]: window j equals the last n-1 tokens
    follow = seen[:, n - 1:]                                      # [R, J]: the token that followed window j
    return torch.where(match & (follow >= 0), follow, V)          # ended rows hold -1: nothing banned


def ban_repeated_ngrams(logits: torch.Tensor, generated: torch.Tensor, t: int, n: int) -> torch.Tensor:
    """``logits: [R, V]`` with ``-inf`` at every token that would complete an n-gram already present in
    the row's generated tokens ``generated[:, :t]`` (``Long[R, >= t]``; the step writes token ``t``).

    Only generated tokens count, not the prompt: a headline may repeat the advertiser's name (several
    tokens), but not loop ("Sports & Fitness & Sports & Sports"). All on the device. A no-op (the input
    returned) while ``t < n``.
    """
    bans = _repeat_bans(generated, t, n, logits.shape[1])
    return logits if bans is None else _mask_banned(logits, [bans])


class PromptNgrams:
    """The n-grams of each prompt of a batch, for :meth:`bans`: built once per batch on the device.

    ``windows: Long[Qb, J, n-1]`` (window ``j`` = prompt tokens ``j .. j+n-2``, padding ``-1``) and
    ``follow: Long[Qb, J]`` (the token after window ``j``; ``-1`` past the prompt's end), ``J`` = the
    longest prompt's ``len - n + 1``. Row ``r`` of a step belongs to prompt ``r // rows_per_prompt``.
    """

    def __init__(self, prompts: list[list[int]], n: int, rows_per_prompt: int, Qb: int, device: torch.device) -> None:
        self.n = n
        width = max(max((len(p) for p in prompts), default=0), n)
        padded = torch.full((Qb, width), -1, dtype=torch.long)
        for q, p in enumerate(prompts):
            padded[q, : len(p)] = torch.tensor(p, dtype=torch.long)
        padded = padded.to(device)
        prompt_of_row = torch.arange(Qb * rows_per_prompt, device=device) // rows_per_prompt
        self.windows = padded.unfold(1, n - 1, 1)[:, : width - n + 1][prompt_of_row]  # [R, J, n-1]
        self.follow = padded[:, n - 1:][prompt_of_row]                                # [R, J]

    def bans(self, generated: torch.Tensor, t: int, V: int) -> torch.Tensor | None:
        """``Long[R, J]``: per row the tokens that would make its last ``n`` generated tokens
        (``generated: Long[R, >= t]``, the step writes token ``t``) an n-gram of its prompt (``V`` where
        none), or None while ``t < n - 1``: only n-grams made of generated tokens count."""
        n = self.n
        if t < n - 1:
            return None
        last = generated[:, t - n + 1: t]                                   # [R, n-1]
        match = (self.windows == last[:, None]).all(-1)                     # [R, J]
        return torch.where(match & (self.follow >= 0) & (last[:, :1] >= 0), self.follow, V)


def _guarded(logits: torch.Tensor, generated: torch.Tensor, t: int, cfg: CreativeConfig,
             copy_guard: PromptNgrams | None) -> torch.Tensor:
    """``logits: [R, V]`` after both n-gram guards of ``cfg`` (one mask for the two)."""
    V = logits.shape[1]
    bans = [b for b in (_repeat_bans(generated, t, cfg.no_repeat_ngram_size, V),
                        copy_guard.bans(generated, t, V) if copy_guard is not None else None) if b is not None]
    return _mask_banned(logits, bans)


def _decode(tokenizer: Any, seq: list[int]) -> str:
    return tokenizer.batch_decode([seq], skip_special_tokens=True)[0]


def _texts(tokenizer: Any, seqs: list[list[int]], stops: list[str]) -> list[tuple[str, int]]:
    """Decode ``seqs`` (generated ids, ended) once; cut before the first stop string. Returns
    ``(text, tokens counted)``: where a stop string spans tokens (the device mask sees one token at
    a time), the count is cut back to the token that completes it."""
    out = []
    for seq, text in zip(seqs, tokenizer.batch_decode(seqs, skip_special_tokens=True)):
        cut, hit = _cut(text, stops)
        n = len(seq)
        if hit and _cut(_decode(tokenizer, seq[:-1]), stops)[1]:
            # the stop string was complete before the last token: find the shortest prefix showing it
            for k in range(1, len(seq)):
                if _cut(_decode(tokenizer, seq[:k]), stops)[1]:
                    n = k
                    break
        out.append((cut, n))
    return out


@torch.no_grad()
def _sample_batch(engine: DecodeEngine, tokenizer: Any, prompts: list[list[int]], cfg: CreativeConfig,
                  end_mask: torch.Tensor) -> list[list[tuple[str, float]]]:
    dev = engine.device
    n, T = cfg.num_return, cfg.max_new_tokens
    Q = len(prompts)
    logits, lse, Qb = engine.prefill(prompts, n, T)
    R = Qb * n
    u = None
    if cfg.strategy is not CreativeStrategy.GREEDY:
        u = torch.ones(R, T)
        u[: Q * n] = _row_uniforms(prompts, n, cfg.seed, T)
        u = u.to(dev)
    row = torch.arange(R, device=dev)
    logit_row = row // n                         # the first token comes from the prompt's prefill row
    copy_guard = PromptNgrams(prompts, cfg.prompt_ngram_block, n, Qb, dev) if cfg.prompt_ngram_block else None
    out_tok = torch.full((R, T), -1, dtype=torch.long, device=dev)
    out_lp = torch.zeros(R, T, device=dev)
    done = row >= Q * n                          # padding rows are done from the start
    length = torch.full((R,), T, dtype=torch.long, device=dev)
    for t in range(T):
        # the first token reads each prompt's prefill row; later steps' outputs are already per row
        lg, ls = (logits, lse) if logit_row is None else (logits[logit_row], lse[logit_row])
        lg = _guarded(lg, out_tok, t, cfg, copy_guard)
        if u is None:
            tok = lg.argmax(-1)
        else:
            tok = _sample(lg.float() - ls[:, None], cfg, u[:, t])
        lp = lg.gather(1, tok[:, None])[:, 0].float() - ls
        out_tok[:, t] = torch.where(done, -1, tok)
        out_lp[:, t] = torch.where(done, 0.0, lp)
        ended = end_mask[tok] & ~done
        length = torch.where(ended, t + 1, length)
        done = done | ended
        if t + 1 == T or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
            break
        logits, lse = engine.step(torch.where(done, 0, tok), t, Qb)
        logit_row = None
    lens = torch.minimum(length, (out_tok >= 0).sum(1).clamp(min=1))
    h_tok, h_len = out_tok[: Q * n].tolist(), lens[: Q * n].tolist()
    seqs = [toks[:k] for toks, k in zip(h_tok, h_len)]
    texts = _texts(tokenizer, seqs, cfg.stop_strings)
    counted = torch.tensor([c for _, c in texts], device=dev)
    mask = torch.arange(T, device=dev)[None] < counted[:, None]
    mean = ((out_lp[: Q * n] * mask).sum(1) / counted).tolist()
    return [[(texts[q * n + i][0], mean[q * n + i]) for i in range(n)] for q in range(Q)]


@torch.no_grad()
def _beam_batch(engine: DecodeEngine, tokenizer: Any, prompts: list[list[int]], cfg: CreativeConfig,
                end_mask: torch.Tensor) -> list[list[tuple[str, float]]]:
    """Beam search ranked by mean log-prob per token, bookkept on the device: per step the top
    ``2B`` continuations of each query; ended ones among the first ``B`` enter a pool of ``B``
    finished hypotheses (HF's rule), the best ``B`` others run on. A query stops once its pool is
    full. Finished texts that are equal after the stop-string cut count once (their best score)."""
    dev = engine.device
    Q, B, T = len(prompts), cfg.num_beams, cfg.max_new_tokens
    logits, lse, Qb = engine.prefill(prompts, B, T)
    R = Qb * B
    V = logits.shape[1]
    beam_s = torch.full((Qb, B), NEG_INF, device=dev)
    beam_s[:Q, 0] = 0.0  # all beams start identical: only one may expand at the first step
    seqs = torch.full((R, T), -1, dtype=torch.long, device=dev)
    pool_s = torch.full((Qb, B), NEG_INF, device=dev)
    pool_seq = torch.full((Qb, B, T), -1, dtype=torch.long, device=dev)
    logit_row = torch.arange(R, device=dev) // B
    rank = torch.arange(2 * B, device=dev)[None]
    copy_guard = PromptNgrams(prompts, cfg.prompt_ngram_block, B, Qb, dev) if cfg.prompt_ngram_block else None
    for t in range(T):
        lg, ls = (logits, lse) if logit_row is None else (logits[logit_row], lse[logit_row])
        logp = _guarded(lg.float() - ls[:, None], seqs, t, cfg, copy_guard)  # [R, V]
        cand = (beam_s.view(-1, 1) + logp).view(Qb, B * V)
        top_s, top_i = cand.topk(2 * B, dim=1)                                # [Qb, 2B]
        src = torch.arange(Qb, device=dev)[:, None] * B + top_i // V          # [Qb, 2B] rows
        tok = top_i % V
        new_seqs = seqs[src.view(-1)]
        new_seqs[:, t] = tok.view(-1)
        new_seqs = new_seqs.view(Qb, 2 * B, T)
        live = torch.isfinite(top_s)
        ended = end_mask[tok] | (t + 1 == T)
        fin = ended & live & (rank < B)
        all_s = torch.cat([pool_s, torch.where(fin, top_s / (t + 1), NEG_INF)], 1)
        pool_s, keep = all_s.topk(B, dim=1)
        pool_seq = torch.cat([pool_seq, new_seqs], 1).gather(1, keep[..., None].expand(-1, -1, T))
        run_ok = live & ~ended
        pick = torch.where(run_ok, rank, rank + 2 * B).argsort(1)[:, :B]       # first B running, by rank
        ok = run_ok.gather(1, pick) & ~torch.isfinite(pool_s).all(1, keepdim=True)
        beam_s = torch.where(ok, top_s.gather(1, pick), NEG_INF)
        if t + 1 == T or ((t + 1) % SYNC_EVERY == 0 and not bool(torch.isfinite(beam_s).any())):
            break
        rows = src.gather(1, pick).view(-1)
        seqs = new_seqs.gather(1, pick[..., None].expand(-1, -1, T)).view(R, T)
        logits, lse = engine.step(tok.gather(1, pick).view(-1), t, Qb, rows)
        logit_row = None
    h_s = pool_s[:Q].tolist()
    h_seq = pool_seq[:Q].tolist()
    out = []
    for q in range(Q):  # host: decode and dedupe the B finished texts of each query, once
        best: dict[str, float] = {}
        live = [(sc, [x for x in seq if x >= 0]) for sc, seq in zip(h_s[q], h_seq[q]) if sc != NEG_INF]
        for (sc, _), (text, _) in zip(live, _texts(tokenizer, [sq for _, sq in live], cfg.stop_strings)):
            if sc > best.get(text, NEG_INF):
                best[text] = sc
        ranked = sorted(best.items(), key=lambda x: -x[1])[: cfg.num_return]
        out.append([(text, float(score)) for text, score in ranked])
    return out


def generate_creatives(model: Any, tokenizer: Any, prompts: list[list[int]], config: CreativeConfig,
                       batch_size: int | None = None) -> list[list[tuple[str, float]]]:
    """Free-text generation for each prompt.

    Args:
        prompts: ``Q`` token-id lists (e.g. from ``encode_creative_prompt``).
        config: :class:`CreativeConfig`.
        batch_size: prompts decoded together; None = all of them (the generators pass one batch, sized by
            the generate job's ``batch_size``).
    Returns:
        per prompt up to ``num_return`` ``(text, mean log-prob per generated token)``, best first
        for beam search, in sample order otherwise.
    """
    check_supported(model)
    if not isinstance(config, CreativeConfig):
        raise TypeError(f"config must be a CreativeConfig, got {type(config).__name__}")
    out: list[list[tuple[str, float]]] = []
    with serving_engine(model, config.linear_formats) as engine:
        end_mask = end_token_mask(model, tokenizer, config.stop_strings, engine.vocab, engine.device)
        step = batch_size or max(len(prompts), 1)
        for s in range(0, len(prompts), step):
            chunk = [list(map(int, p)) for p in prompts[s:s + step]]
            if config.strategy is CreativeStrategy.BEAM:
                out.extend(_beam_batch(engine, tokenizer, chunk, config, end_mask))
            else:
                out.extend(_sample_batch(engine, tokenizer, chunk, config, end_mask))
    return out
