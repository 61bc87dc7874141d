"""KV-cache and forward helpers shared by targeting search and creative decoding.

Works on transformers 5.17 and 5.24: the decoder's cache keyword is read from its signature
(``past_key_values`` up to 5.2x, ``cache`` in 5.24 where the old name is deprecated), and caches
are handled through ``DynamicCache`` methods that exist in both (``reorder_cache``, ``update``).

Layout convention (documented in docs/decoding.md): prompts are LEFT-padded to a common length;
every cache row carries a 2-D attention mask ``Long[R, L]`` (0 on padding) and the position of its
next token (``prompt length + tokens fed so far``), so padding never shifts a row's positions.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_CACHE_KWARG: dict[type, str] = {}


def decoder_of(model: Any) -> Any:
    """The transformer body of a causal LM (without its LM head)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, "model", None)
    if dec is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder body (get_decoder/model)")
    return dec


def check_supported(model: Any) -> None:
    """Refuse models whose next-token log-probs are not ``log_softmax(lm_head(hidden))``."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} uses final_logit_softcapping; adbatch decoding "
                         "computes log-probs as log_softmax(lm_head(hidden)) and does not support it")
    if model.get_output_embeddings() is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (LM head)")


def cache_kwarg(decoder: Any) -> str:
    """Name of the decoder forward's cache keyword: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier)."""
    kind = type(decoder)
    if kind not in _CACHE_KWARG:
        params = inspect.signature(decoder.forward).parameters
        _CACHE_KWARG[kind] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[kind]


def new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each ``[R, kv_heads, L, head_dim]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # older DynamicCache layout


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def keep_rows(cache: Any, rows: torch.Tensor) -> None:
    """In place: the cache keeps rows ``rows: Long[R']`` of its batch, in that order (repeats allowed)."""
    cache.reorder_cache(rows)


def copy_rows(cache: Any, rows: torch.Tensor) -> Any:
    """A new cache holding rows ``rows: Long[R']`` of ``cache`` (for a throw-away tree pass)."""
    out = new_cache()
    for i, (k, v) in enumerate(cache_layers(cache)):
        out.update(k.index_select(0, rows), v.index_select(0, rows), i)
    return out


def forward_hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Run the decoder body, appending to ``cache``.

    Args:
        input_ids: ``Long[R, T]``.
        attention_mask: ``Long[R, L + T]`` (2-D, 1 = visible) or an additive float mask
            ``[R, 1, T, L + T]`` in the model's dtype (0 = visible, dtype min = hidden).
        position_ids: ``Long[R, T]``.
        cache: a ``DynamicCache`` of length ``L`` (grows to ``L + T``).
    Returns:
        last hidden states ``[R, T, H]`` in the model's dtype.
    """
    dec = decoder_of(model)
    out = dec(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
              use_cache=True, **{cache_kwarg(dec): cache})
    return out.last_hidden_state


def head_logprobs(model: Any, hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Exact next-token log-probs over the FULL vocabulary.

    Args:
        hidden: ``[N, H]`` final hidden states.
        chunk: rows per LM-head call (bounds the fp32 logits buffer).
    Returns:
        ``Float32[N, V]`` = ``log_softmax(lm_head(hidden))``.
    """
    head = model.get_output_embeddings()
    n = hidden.shape[0]
    if n <= chunk:
        return torch.log_softmax(head(hidden).float(), dim=-1)
    parts = [torch.log_softmax(head(hidden[s:s + chunk]).float(), dim=-1) for s in range(0, n, chunk)]
    return torch.cat(parts, 0)


def head_logits_lse(model: Any, hidden: torch.Tensor, chunk: int = 1024
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """LM-head logits and their full-vocabulary log-normalizer, without a float32 ``[N, V]`` copy.

    ``log_softmax(logits.float())[i, t] == logits[i, t].float() - lse[i]``; gather the few entries
    needed with :func:`gather_logprobs`.

    Args:
        hidden: ``[N, H]`` final hidden states.
    Returns:
        ``(logits [N, V]`` in the head's output dtype, ``lse Float32[N])``.
    """
    head = model.get_output_embeddings()
    logits = head(hidden)
    n = logits.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    for s in range(0, n, chunk):  # bounds the float32 temporary to chunk x V
        lse[s:s + chunk] = torch.logsumexp(logits[s:s + chunk].float(), dim=-1)
    return logits, lse


def gather_logprobs(logits: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None,
                    tokens: torch.Tensor) -> torch.Tensor:
    """Exact log-probs at chosen entries: ``logits[rows, tokens].float() - lse[rows]``.

    ``rows``/``tokens``: Long tensors of one shape (``rows=None``: ``tokens`` is ``[N, C]`` and row
    ``i`` of it reads row ``i``); negative tokens read token 0 (mask them afterwards).
    """
    tok = tokens.clamp(min=0)
    if rows is None:
        return logits.gather(1, tok).float() - lse[:, None]
    return logits[rows, tok].float() - lse[rows]


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts.

    Returns:
        ``input_ids Long[Q, L]``, ``attention_mask Long[Q, L]``, ``position_ids Long[Q, L]``
        (0-based within each prompt; padding gets position 0).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # once per prompt at prefill, not per step
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model: Any) -> torch.dtype:
    """Dtype of the activations (the input embeddings' dtype; compressed linears keep it too)."""
    emb = model.get_input_embeddings()
    w = getattr(emb, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
