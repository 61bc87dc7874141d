"""Variable-length attention for packed training rows: each example attends to itself only, with no mask.

A packed micro-batch (:func:`adbatch.training.data.collate_packed`) lays several examples back to back
in every row. With a block-diagonal boolean mask ``[B, 1, L, L]`` SDPA cannot use its flash kernel;
on the H200 it ran cuDNN's masked attention, 18 % of a compiled training step's GPU time for 4 % of
its FLOPs (bench/results/device_1204b/train_profile_compiled_noqat.txt: 14 ms of 79 ms). Here the
rows are flattened to ``[B * L]`` tokens and cut into segments -- every example, and every row's
padding tail -- by cumulative offsets ``cu_seqlens`` (int32 ``[S + 1]``, built on the host by the
collate function), and :func:`torch.nn.attention.varlen.varlen_attn` (flash attention over ragged
sequences) runs causal attention within each segment: no mask tensor, no work across examples.

The segment list has a fixed capacity per run (unused entries repeat the total: empty segments), so
every batch has the same shapes and the compiled decoder layers never recompile.

Wiring into a Hugging Face model: the attention function is registered in transformers'
``AttentionInterface`` as :data:`VARLEN_IMPL`; :class:`VarlenAttention` switches a model's
``config._attn_implementation`` to it for the training forwards and back for anything else
(validation decoding, saving). transformers builds no mask for an implementation without a mask
function, and passes the decoder call's extra keyword arguments (``adbatch_cu_seqlens``,
``adbatch_max_seqlen``) through to the attention function. On a CPU the function computes the same
thing with SDPA and a block-diagonal mask (the reference the tests compare against).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["VARLEN_IMPL", "VarlenAttention", "segment_offsets", "varlen_attention_forward", "varlen_unsupported"]

#: the name under which the attention function is registered in transformers' AttentionInterface
VARLEN_IMPL = "adbatch_varlen"


def segment_offsets(lengths: torch.Tensor, rows: int, row_len: int, capacity: int) -> torch.Tensor:
    """Cumulative segment offsets of a packed batch, int32 ``[capacity + 1]``.

    ``lengths``: int ``[rows, E]`` tokens of each row's examples in order, 0 after a row's last one
    (a row with no example: all 0). Segments, in flattened ``[rows * row_len]`` order: each row's
    examples, then its padding tail when the row is not full. Entries past the last segment repeat
    ``rows * row_len`` (empty segments). ``capacity`` must be at least the number of segments.
    """
    lengths = lengths.to(torch.int64)
    tail = row_len - lengths.sum(1, keepdim=True)  # [rows, 1]
    if bool((tail < 0).any()):
        raise ValueError("a row holds more tokens than row_len")
    seg = torch.cat([lengths, tail], 1).reshape(-1)
    seg = seg[seg > 0]
    if seg.numel() > capacity:
        raise ValueError(f"{seg.numel()} segments exceed the capacity {capacity}")
    out = torch.full((capacity + 1,), rows * row_len, dtype=torch.int64)
    out[0] = 0
    out[1: seg.numel() + 1] = torch.cumsum(seg, 0)
    return out.to(torch.int32)


def segment_capacity(rows: int, row_len: int, shortest: int) -> int:
    """Segments a packed batch of ``rows`` x ``row_len`` can hold when no example is shorter than
    ``shortest`` tokens: the examples that fit in every row plus one padding tail per row."""
    return rows * (row_len // max(1, shortest) + 1)


@functools.lru_cache(maxsize=1)
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """torch's ``varlen_attn`` and its parameter names (the signature changed across torch releases:
    ``is_causal`` before, ``window_size`` / ``enable_gqa`` / ``scale`` after), None when absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_unsupported(core: nn.Module, device: torch.device) -> str | None:
    """Why ``core`` cannot train with varlen attention on ``device``; None = it can."""
    if device.type != "cuda":
        return "varlen attention runs on CUDA only"
    if _varlen_kernel() is None:
        return "this torch has no torch.nn.attention.varlen"
    cfg = getattr(core, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"attention implementation {getattr(cfg, '_attn_implementation', None)!r} (varlen replaces sdpa / eager)"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if set(getattr(cfg, "layer_types", None) or ("full_attention",)) != {"full_attention"}:
        return "layer types other than full attention (sliding windows)"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "a sliding window"
    if getattr(cfg, "attention_dropout", 0.0):
        return "attention dropout"
    return None


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with a block-diagonal causal mask over the flattened tokens: ``[T, H, D]`` in, ``[T, H, D]`` out."""
    t = q.shape[0]
    tok = torch.arange(t, device=q.device)
    seg = torch.searchsorted(cu[1:].to(torch.int64), tok, right=True)  # [T] segment of each token
    mask = (seg[:, None] == seg[None, :]) & (tok[:, None] >= tok[None, :])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def varlen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                             adbatch_cu_seqlens: torch.Tensor | None = None, adbatch_max_seqlen: int | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[B, Hq, L, D]``, key / value ``[B, Hkv, L, D]`` ->
    ``([B, L, Hq, D], None)``, causal within each segment of ``adbatch_cu_seqlens`` (int32 ``[S + 1]``
    over the ``B * L`` flattened tokens; ``adbatch_max_seqlen``: a bound on a segment's length)."""
    if adbatch_cu_seqlens is None:
        raise ValueError(f"{VARLEN_IMPL} attention needs adbatch_cu_seqlens (a packed training batch)")
    if dropout:
        raise ValueError(f"{VARLEN_IMPL} attention has no dropout")
    b, hq, length, d = query.shape
    hkv = key.shape[1]
    scale = d ** -0.5 if scaling is None else float(scaling)
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, hkv, d)
    v = value.transpose(1, 2).reshape(b * length, hkv, d)
    kernel = _varlen_kernel() if query.is_cuda else None
    params = kernel[1] if kernel is not None else frozenset()
    if hkv != hq and "enable_gqa" not in params:  # each KV head serves hq / hkv query heads, in order
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    if kernel is None:
        out = _reference(q, k, v, adbatch_cu_seqlens, scale)
        return out.reshape(b, length, hq, d), None
    fn = kernel[0]
    dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16  # flash: half types
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    extra: dict[str, Any] = {}
    if "scale" in params:
        extra["scale"] = scale
    elif not math.isclose(scale, d ** -0.5):  # an old varlen_attn without scale: fold it into q
        q = q * (scale * math.sqrt(d))
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if hkv != hq and "enable_gqa" in params:
        extra["enable_gqa"] = True
    max_len = int(adbatch_max_seqlen or length)
    out = fn(q, k, v, adbatch_cu_seqlens, adbatch_cu_seqlens, max_len, max_len, **extra)
    return out.reshape(b, length, hq, d).to(query.dtype), None


@functools.lru_cache(maxsize=1)
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_IMPL, varlen_attention_forward)


class VarlenAttention:
    """Switches a model between its own attention implementation and :data:`VARLEN_IMPL`.

    ``on()`` for the training forwards (which then pass ``adbatch_cu_seqlens``), ``off()`` for
    anything else: decoding, evaluation and saving see the model's own implementation.
    """

    def __init__(self, core: nn.Module) -> None:
        _register()
        self.config = core.config
        self.original = core.config._attn_implementation

    def on(self) -> None:
        self.config._attn_implementation = VARLEN_IMPL

    def off(self) -> None:
        self.config._attn_implementation = self.original
