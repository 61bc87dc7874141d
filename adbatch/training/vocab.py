"""Special tokens of a ``codes`` index: add them to the tokenizer and initialise their embeddings.

The index manifest lists the code tokens in order; token i must get id ``base_vocab_size + i`` so
that the index's ``token_ids`` mean the same thing to the model. We add them, check the ids, resize
the (tied) embedding matrix, and initialise every new row as the **mean title-token embedding of
the ads whose target contains that token**. Why: with tied input/output embeddings the logit of a
code token is ``h · e_code``; starting ``e_code`` at the centroid of its ads' title embeddings makes
a hidden state "about" those titles already prefer that branch of the trie (a semantic prior that
mirrors how the index clustered the ads), whereas random rows start with no relation to the text
and the cluster-centroid embeddings of the index live in MiniLM space, not the LM's. A token whose
ads are unknown falls back to the mean embedding of the base vocabulary.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)


def add_index_tokens(tokenizer: Any, special_tokens: Sequence[str], base_vocab_size: int) -> int:
    """Add ``special_tokens`` (manifest order) to ``tokenizer``; return the position in the list of
    the first token added (``len(special_tokens)`` when none was).

    A tokenizer that already holds a prefix of these tokens at the right ids (a warm start from a
    model trained on an earlier ``codes`` index: an incremental index keeps the earlier tokens and
    appends its new ones) gets only the rest.
    """
    if not special_tokens:
        return 0
    have = len(tokenizer) - base_vocab_size
    if have < 0 or have > len(special_tokens):
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the index expects base_vocab_size={base_vocab_size} "
            f"(+{len(special_tokens)} code tokens): it was built with another tokenizer")
    if have:
        ids = tokenizer.convert_tokens_to_ids(list(special_tokens[:have]))
        if list(ids) != list(range(base_vocab_size, base_vocab_size + have)):
            raise ValueError(f"the tokenizer's {have} added tokens are not this index's first {have} code tokens "
                             "at their ids: it was trained on an index with other code tokens")
    if have == len(special_tokens):
        return have
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens[have:]])
    ids = tokenizer.convert_tokens_to_ids(list(special_tokens))
    expected = list(range(base_vocab_size, base_vocab_size + len(special_tokens)))
    if list(ids) != expected:
        bad = next(i for i, (a, b) in enumerate(zip(ids, expected)) if a != b)
        raise ValueError(f"special token {special_tokens[bad]!r} got id {ids[bad]}, expected {expected[bad]}")
    return have


@torch.no_grad()
def init_code_embeddings(model: Any, tokenizer: Any, target_ids: Sequence[Sequence[int]], ad_texts: Sequence[str],
                         base_vocab_size: int, num_special: int, first_new: int = 0) -> dict[str, int]:
    """Resize the embeddings to ``base_vocab_size + num_special`` and set the rows of code tokens
    ``first_new..num_special-1`` (earlier rows are a warm start's learned ones and stay).

    ``target_ids[r]``: the index's token_ids of ad row r; ``ad_texts[r]``: its title. Returns
    counts (tokens initialised from ads, tokens that fell back to the vocabulary mean).
    """
    new_size = base_vocab_size + num_special
    model.resize_token_embeddings(new_size, mean_resizing=False)
    emb = model.get_input_embeddings().weight  # [V', H]
    base = emb[:base_vocab_size].float()
    enc = tokenizer(list(ad_texts), add_special_tokens=False)["input_ids"]
    lens = torch.tensor([max(len(e), 1) for e in enc])
    flat = torch.tensor([t for e in enc for t in (e or [tokenizer.eos_token_id])], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(enc)), lens)
    ad_vec = torch.zeros(len(enc), base.shape[1]).index_add_(0, owner, base[flat.to(base.device)].cpu())
    ad_vec /= lens[:, None].float()  # [A, H] mean title-token embedding per ad

    tgt_lens = torch.tensor([len(t) for t in target_ids])
    tgt = torch.tensor([t for seq in target_ids for t in seq], dtype=torch.long)
    tgt_owner = torch.repeat_interleave(torch.arange(len(target_ids)), tgt_lens)
    is_code = tgt >= base_vocab_size
    code = tgt[is_code] - base_vocab_size
    sums = torch.zeros(num_special, base.shape[1]).index_add_(0, code, ad_vec[tgt_owner[is_code]])
    counts = torch.bincount(code, minlength=num_special).float()
    fallback = base.mean(0).cpu()
    rows = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], fallback)
    lo = base_vocab_size + first_new
    rows, counts = rows[first_new:], counts[first_new:]
    emb[lo:new_size] = rows.to(emb.dtype).to(emb.device)
    out = model.get_output_embeddings()
    if out is not None and out.weight.data_ptr() != emb.data_ptr():  # untied head: same init
        out.weight[lo:new_size] = rows.to(out.weight.dtype).to(out.weight.device)
    stats = {"code_tokens": num_special, "initialised": num_special - first_new,
             "from_ads": int((counts > 0).sum()), "fallback": int((counts == 0).sum())}
    log.info("code-token embeddings: %s", stats)
    return stats
