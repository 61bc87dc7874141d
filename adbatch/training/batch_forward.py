"""A causal LM's forward over a training batch: its keyword inputs (padded, or packed with a block-diagonal mask)
and its hidden states / logits at the target positions only.

Shared by the training loop (:mod:`adbatch.training.trainer`: the batch loss) and the rank-aware loss
(:mod:`adbatch.training.rank_loss`: sequence log-probs of candidate groups), which both import it; it imports
neither. The LM head is applied at target positions only (the loss is on target tokens only), which avoids
materialising ``[B, L, vocab]`` logits for prompt tokens -- most of a batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from adbatch.training.data import Batch, packed_attention_mask
from adbatch.training.sparsity import unwrap_ddp

__all__ = ["PackingUnsupported", "packed_masks", "model_inputs", "fast_parts", "target_hidden", "target_logits"]


class PackingUnsupported(ValueError):
    """The model's attention cannot take the packed block-diagonal mask (the loop then pads)."""


def packed_masks(core: nn.Module, seq_ids: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument that makes ``core``'s decoder attend block-diagonally.

    ``seq_ids``: int32 ``[B, L]`` (:attr:`Batch.seq_ids`). Returns a prepared 4D mask ``[B, 1, L, L]``
    (HF returns a 4D mask as-is), or, for a model with other layer types than full attention (Gemma3's
    sliding layers, Qwen2 with ``use_sliding_window``), the dict layer type -> mask that those models
    take instead of building their own (a 2D mask or positions alone would make them build it from
    ``position_ids``, which costs a device -> host sync per forward). Masks are boolean for SDPA and
    additive float32 (0 / finfo.min) for eager attention, as HF's own mask functions make them.
    Raises :class:`PackingUnsupported` for other attention implementations or layer types.
    """
    cfg = core.config
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        raise PackingUnsupported(f"attention implementation {impl!r} (packing supports sdpa and eager)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise PackingUnsupported("bidirectional attention")
    L = seq_ids.shape[1]
    types = set(getattr(cfg, "layer_types", None) or ("full_attention",))
    full = packed_attention_mask(seq_ids)
    out: dict[str, torch.Tensor] = {}
    for kind in types:
        if kind == "full_attention":
            out[kind] = full
        elif kind == "sliding_attention":
            window = getattr(cfg, "sliding_window", None)
            # a window at least a row long never binds: the full mask is the sliding one
            out[kind] = full if window is None or window >= L else packed_attention_mask(seq_ids, int(window))
        else:
            raise PackingUnsupported(f"layer type {kind!r}")
    if impl == "eager":
        out = {k: torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, torch.finfo(torch.float32).min)
               for k, m in out.items()}
    return out["full_attention"] if types == {"full_attention"} else out


def model_inputs(core: nn.Module, batch: Batch) -> dict[str, Any]:
    """Keyword arguments of the decoder / model forward for ``batch`` (padded or packed)."""
    if not batch.packed:
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    return {"input_ids": batch.input_ids, "attention_mask": packed_masks(core, batch.seq_ids),
            "position_ids": batch.position_ids}


def fast_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder body, LM head) when the head can be applied at target positions only, else None
    (DDP must see the forward through its own wrapper so gradients are all-reduced)."""
    core = unwrap_ddp(model)
    decoder = core.get_decoder() if hasattr(core, "get_decoder") else None
    head = core.get_output_embeddings() if hasattr(core, "get_output_embeddings") else None
    if decoder is None or head is None or model is not core:
        return None
    return decoder, head


def _as_batch(input_ids, attention_mask, labels, target_index, position_ids) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    shift_labels = labels[:, 1:]
    if target_index is None:
        target_index = (shift_labels != -100).reshape(-1).nonzero().squeeze(1)
    targets = shift_labels.reshape(-1).index_select(0, target_index)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    return kwargs, target_index, targets


def target_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: Any, labels: torch.Tensor,
                  target_index: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """Final hidden states ``[n, H]`` at the ``n`` target positions, their targets (int64 ``[n]``) and
    the LM head (``model`` must expose ``get_decoder()`` / ``get_output_embeddings()`` and not be DDP)."""
    parts = fast_parts(model)
    if parts is None:
        raise ValueError("target_hidden needs a plain model with get_decoder() and get_output_embeddings()")
    decoder, head = parts
    kwargs, target_index, targets = _as_batch(input_ids, attention_mask, labels, target_index, position_ids)
    hidden = decoder(**kwargs, use_cache=False).last_hidden_state  # [B, L, H]
    return hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, target_index), targets, head


def target_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: Any,
                  labels: torch.Tensor, target_index: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits ``[n, V]`` at the ``n`` target positions and their targets (int64 ``[n]``).

    ``input_ids``/``labels``: int64 ``[B, L]`` (labels -100 where no loss). ``attention_mask``: int64
    ``[B, L]`` padding mask, or for a packed batch the prepared mask of :func:`packed_masks` (with
    ``position_ids`` int64 ``[B, L]``). ``target_index``: int64 ``[n]`` flat positions into
    ``[B, L-1]`` whose next token is a target (:attr:`adbatch.training.data.Batch.target_index`,
    computed on the host: no device sync here); derived from ``labels`` when None. Uses the decoder
    body + LM head at target positions only when the model exposes them (``get_decoder()`` /
    ``get_output_embeddings()``), else a plain forward (DDP must see the forward through its own
    wrapper so gradients are all-reduced).
    """
    if fast_parts(model) is None:
        kwargs, target_index, targets = _as_batch(input_ids, attention_mask, labels, target_index, position_ids)
        logits = model(**kwargs).logits  # [B, L, V]
        return logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, target_index).float(), targets
    h, targets, head = target_hidden(model, input_ids, attention_mask, labels, target_index, position_ids)
    return head(h).float(), targets
