"""Creative (free-text) generation on the same KV-cache loop: greedy, sampling, beam search.

Rows are ``prompt x candidate`` on one left-padded cache (``kv.left_pad``), the prompt prefilled
once and its cache rows repeated. Every step feeds one token per row. A row ends at the model's EOS
token or when its text contains a stop string; its text is cut before the stop string. Each
returned text carries the mean log-prob per generated token (full-vocabulary log-softmax at
temperature 1), counted up to and including the token that ended it (EOS or the stop string's
last token). Stop strings are checked by decoding the rows' tails once per step (one batched
tokenizer call), which is the one host sync of a step besides the EOS check.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from adbatch.decoding.config import CreativeConfig, CreativeStrategy
from adbatch.decoding.kv import check_supported, forward_hidden, head_logprobs, keep_rows, left_pad, model_device, new_cache

NEG_INF = float("-inf")


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
    ``u: Float32[R]`` in (0, 1] (see :func:`_row_uniforms`)."""
    if cfg.strategy is CreativeStrategy.GREEDY:
        return logp.argmax(-1)
    probs = torch.softmax(logp / cfg.temperature, -1)
    if cfg.top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > cfg.top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    cdf = probs.cumsum(-1)
    # the first token whose cumulative mass reaches u * total (total < 1 after the nucleus cut)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).view(-1)
    return tok.clamp_(max=probs.shape[-1] - 1)


@torch.no_grad()
def _sample_batch(model: Any, tokenizer: Any, prompts: list[list[int]], cfg: CreativeConfig
                  ) -> list[list[tuple[str, float]]]:
    dev = model_device(model)
    n = cfg.num_return
    u = (None if cfg.strategy is CreativeStrategy.GREEDY
         else _row_uniforms(prompts, n, cfg.seed, cfg.max_new_tokens).to(dev))
    eos = torch.tensor(_eos_ids(model, tokenizer) or [-1], device=dev)
    ids, attn, pos = left_pad(prompts, 0, dev)
    cache = new_cache()
    hidden = forward_hidden(model, ids, attn, pos, cache)
    rep = torch.arange(len(prompts), device=dev).repeat_interleave(n)
    keep_rows(cache, rep)
    attn, next_pos = attn[rep], attn.sum(1)[rep]
    logp = head_logprobs(model, hidden[:, -1])[rep]
    R = rep.shape[0]
    out_tok = torch.full((R, cfg.max_new_tokens), -1, dtype=torch.long, device=dev)
    out_lp = torch.zeros(R, cfg.max_new_tokens, device=dev)
    done = np.zeros(R, dtype=bool)
    length = np.full(R, cfg.max_new_tokens)
    texts = [""] * R
    for t in range(cfg.max_new_tokens):
        tok = _sample(logp, cfg, None if u is None else u[:, t])
        out_tok[:, t], out_lp[:, t] = tok, logp.gather(1, tok[:, None])[:, 0]
        is_eos = torch.isin(tok, eos).cpu().numpy()
        live = np.flatnonzero(~done)
        decoded = tokenizer.batch_decode(out_tok[live, : t + 1].clamp(min=0).tolist(), skip_special_tokens=True)
        for i, text in zip(live, decoded):  # host bookkeeping of the step's finished rows
            texts[i], hit = _cut(text, cfg.stop_strings)
            if hit or is_eos[i]:
                done[i], length[i] = True, t + 1
        if done.all() or t + 1 == cfg.max_new_tokens:
            break
        attn = torch.cat([attn, torch.ones(R, 1, dtype=attn.dtype, device=dev)], 1)
        hidden = forward_hidden(model, tok[:, None], attn, next_pos[:, None], cache)
        next_pos = next_pos + 1
        logp = head_logprobs(model, hidden[:, -1])
    lens = torch.from_numpy(length).to(dev)
    mask = torch.arange(cfg.max_new_tokens, device=dev)[None] < lens[:, None]
    mean = ((out_lp * mask).sum(1) / lens).cpu().tolist()
    return [[(texts[q * n + i], mean[q * n + i]) for i in range(n)] for q in range(len(prompts))]


@torch.no_grad()
def _beam_batch(model: Any, tokenizer: Any, prompts: list[list[int]], cfg: CreativeConfig
                ) -> list[list[tuple[str, float]]]:
    """Beam search ranked by mean log-prob per token; a query stops once ``num_beams`` distinct
    texts ended."""
    dev = model_device(model)
    Q, B = len(prompts), cfg.num_beams
    eos = torch.tensor(_eos_ids(model, tokenizer) or [-1], device=dev)
    ids, attn, pos = left_pad(prompts, 0, dev)
    cache = new_cache()
    hidden = forward_hidden(model, ids, attn, pos, cache)
    rep = torch.arange(Q, device=dev).repeat_interleave(B)
    keep_rows(cache, rep)
    attn, next_pos = attn[rep], attn.sum(1)[rep]
    logp = head_logprobs(model, hidden[:, -1])[rep]                      # [Q*B, V]
    V = logp.shape[1]
    beam_s = torch.full((Q, B), NEG_INF, device=dev)
    beam_s[:, 0] = 0.0  # all beams start identical: only one may expand at the first step
    seqs = torch.zeros(Q * B, 0, dtype=torch.long, device=dev)
    # finished texts per query: text -> best mean log-prob. Hypotheses that differ only after a
    # stop string are cut to one text; it counts (and is returned) once.
    finished: list[dict[str, float]] = [{} for _ in range(Q)]
    q_done = np.zeros(Q, dtype=bool)
    for t in range(cfg.max_new_tokens):
        cand = (beam_s.view(-1, 1) + logp).view(Q, B * V)
        top_s, top_i = cand.topk(2 * B, dim=1)                            # [Q, 2B]
        src = (torch.arange(Q, device=dev)[:, None] * B + top_i // V)     # [Q, 2B] rows
        tok = top_i % V
        new_seqs = torch.cat([seqs[src.view(-1)], tok.view(-1, 1)], 1)    # [Q*2B, t+1]
        ended = torch.isin(tok, eos).cpu().numpy()
        h_s = top_s.cpu().numpy()
        texts = tokenizer.batch_decode(new_seqs.tolist(), skip_special_tokens=True)
        run_pick = np.zeros((Q, B), dtype=np.int64)
        run_ok = np.zeros((Q, B), dtype=bool)
        for q in np.flatnonzero(~q_done):  # host bookkeeping per query (B-sized lists)
            k = 0
            for r in range(2 * B):
                if not np.isfinite(h_s[q, r]):
                    continue
                text, hit = _cut(texts[q * 2 * B + r], cfg.stop_strings)
                if ended[q, r] or hit or t + 1 == cfg.max_new_tokens:
                    if r < B:
                        score = float(h_s[q, r] / (t + 1))
                        if score > finished[q].get(text, NEG_INF):
                            finished[q][text] = score
                elif k < B:
                    run_pick[q, k], run_ok[q, k] = r, True
                    k += 1
            if len(finished[q]) >= B or not run_ok[q].any():
                q_done[q] = True
        if q_done.all() or t + 1 == cfg.max_new_tokens:
            break
        pick = torch.from_numpy(run_pick).to(dev)
        ok = torch.from_numpy(run_ok & ~q_done[:, None]).to(dev)
        beam_s = torch.where(ok, top_s.gather(1, pick), NEG_INF)
        rows = src.gather(1, pick).view(-1)
        seqs = new_seqs.view(Q, 2 * B, -1).gather(1, pick[:, :, None].expand(-1, -1, t + 1)).view(Q * B, -1)
        keep_rows(cache, rows)
        attn = torch.cat([attn[rows], torch.ones(Q * B, 1, dtype=attn.dtype, device=dev)], 1)
        step_pos = next_pos[rows]
        hidden = forward_hidden(model, tok.gather(1, pick).view(-1, 1), attn, step_pos[:, None], cache)
        next_pos = step_pos + 1
        logp = head_logprobs(model, hidden[:, -1])
    out = []
    for q in range(Q):
        best = sorted(finished[q].items(), key=lambda x: -x[1])[: cfg.num_return]
        out.append([(text, float(score)) for text, score in best])
    return out


def generate_creatives(model: Any, tokenizer: Any, prompts: list[list[int]], config: CreativeConfig
                       ) -> list[list[tuple[str, float]]]:
    """Free-text generation for each prompt.

    Args:
        prompts: ``Q`` token-id lists (e.g. from ``encode_creative_prompt``).
        config: :class:`CreativeConfig`.
    Returns:
        per prompt up to ``num_return`` ``(text, mean log-prob per generated token)``, best first
        for beam search, in sample order otherwise.
    """
    check_supported(model)
    if not isinstance(config, CreativeConfig):
        raise TypeError(f"config must be a CreativeConfig, got {type(config).__name__}")
    was_training = model.training
    model.eval()
    out: list[list[tuple[str, float]]] = []
    try:
        for s in range(0, len(prompts), config.batch_size):
            chunk = [list(map(int, p)) for p in prompts[s:s + config.batch_size]]
            if config.strategy is CreativeStrategy.BEAM:
                out.extend(_beam_batch(model, tokenizer, chunk, config))
            else:
                out.extend(_sample_batch(model, tokenizer, chunk, config))
    finally:
        model.train(was_training)
    return out
