"""Training examples for DSI-style generative targeting, built from an ad index.

Two kinds of example, both ``prompt -> target`` where the prompt is exactly what the decoder feeds
(:func:`adbatch.prompts.encode_targeting_prompt`) and the target is the ad's sequence from the index
(``ad_codes.token_ids``: code tokens for the ``codes`` scheme, title tokens for ``text``):

- **indexing**: the ad's own text (its title) as the query -> its target. Every ad of the index gets
  one, so ads no labelled query mentions are still learned (DSI's "memorise the corpus" task).
- **retrieval**: a labelled query -> the target of a relevant ad (one example per relevant pair of
  the *train* split only; valid/test queries never enter training).
- **pseudo-query** (optional): a short word span of the ad's text -> its target
  (:mod:`adbatch.training.pseudo_queries`: query-shaped inputs for every ad, labelled or not).

Examples are stored flat: ``tokens`` int32 ``[T]`` (prompt + target of each example back to back),
``offsets`` int64 ``[E+1]`` and ``prompt_lens`` int32 ``[E]``. The loss is taken on target tokens
only (positions ``>= prompt_len``).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import torch

from adbatch.prompts import encode_targeting_prompt
from adbatch.training.pseudo_queries import PseudoQueryConfig, span_pseudo_queries

log = logging.getLogger(__name__)


class ExampleKind(int, enum.Enum):
    INDEXING = 0
    RETRIEVAL = 1
    PSEUDO_QUERY = 2
    CREATIVE = 3  # creative prompt -> the starting model's headline (adbatch.training.rehearsal)


@dataclass
class TrainingExamples:
    """Flat prompt+target examples.

    ``tokens``: int32 ``[T]``; ``offsets``: int64 ``[E+1]`` (example e is ``tokens[offsets[e]:offsets[e+1]]``);
    ``prompt_lens``: int32 ``[E]``; ``kinds``: int8 ``[E]`` (:class:`ExampleKind`); ``rows``: int64 ``[E]``
    (the ad row of the index the example points to).
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    kinds: torch.Tensor
    rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def lengths(self) -> torch.Tensor:
        """int64 ``[E]``: prompt + target length of each example."""
        return self.offsets[1:] - self.offsets[:-1]

    def num_target_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens.long()).sum())

    def select(self, index: torch.Tensor) -> "TrainingExamples":
        """The examples at ``index`` (int64 ``[E']``), in that order."""
        lens = self.lengths[index]
        starts = self.offsets[index]
        new_offsets = torch.zeros(len(index) + 1, dtype=torch.int64)
        new_offsets[1:] = torch.cumsum(lens, 0)
        # token gather without a per-example loop: position i of example e -> starts[e] + i
        ex_of_tok = torch.repeat_interleave(torch.arange(len(index)), lens)
        within = torch.arange(int(new_offsets[-1])) - new_offsets[:-1][ex_of_tok]
        return TrainingExamples(self.tokens[starts[ex_of_tok] + within], new_offsets,
                                self.prompt_lens[index], self.kinds[index], self.rows[index])

    @staticmethod
    def concat(parts: Sequence["TrainingExamples"]) -> "TrainingExamples":
        offs, base = [torch.zeros(1, dtype=torch.int64)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return TrainingExamples(torch.cat([p.tokens for p in parts]), torch.cat(offs),
                                torch.cat([p.prompt_lens for p in parts]), torch.cat([p.kinds for p in parts]),
                                torch.cat([p.rows for p in parts]))


def build_prompted(prompts: list[list[int]], targets: list[list[int]], kind: ExampleKind, rows: list[int]) -> TrainingExamples:
    """Examples of one kind from token-id prompts and targets (``rows``: the ad row of each)."""
    lens = [len(p) + len(t) for p, t in zip(prompts, targets)]
    flat: list[int] = []
    for p, t in zip(prompts, targets):
        flat.extend(p)
        flat.extend(t)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return TrainingExamples(
        tokens=torch.tensor(flat, dtype=torch.int32), offsets=offsets,
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        kinds=torch.full((len(lens),), int(kind), dtype=torch.int8),
        rows=torch.tensor(rows, dtype=torch.int64),
    )


def _prompts(tokenizer: Any, texts: Iterable[str], max_query_tokens: int) -> list[list[int]]:
    cache: dict[str, list[int]] = {}
    out = []
    for t in texts:
        if t not in cache:
            cache[t] = encode_targeting_prompt(tokenizer, t, max_query_tokens=max_query_tokens)
        out.append(cache[t])
    return out


def build_examples(
    tokenizer: Any,
    ad_ids: Sequence[Hashable],
    target_ids: Sequence[Sequence[int]],
    ad_texts: Mapping[Hashable, str],
    labelled: Iterable[tuple[str, Hashable]] = (),
    *,
    indexing: bool = True,
    append_eos: bool = False,
    max_query_tokens: int = 48,
    pseudo_queries: PseudoQueryConfig | None = None,
) -> tuple[TrainingExamples, dict[str, int]]:
    """Build indexing + retrieval examples for the ads of an index.

    ``ad_ids[r]`` / ``target_ids[r]``: the index's ad table by row. ``ad_texts``: ad_id -> text used
    as the indexing query (the title); every ad of the index must have one (KeyError names the
    first missing id). ``labelled``: (query, ad_id) pairs of the train split; a pair whose ad is not
    in the index is counted in ``stats['labelled_not_in_index']`` (the catalogue may be a subset).
    ``append_eos`` adds the tokenizer's EOS after each target (off by default: the trie, not EOS,
    ends a target during decoding). ``pseudo_queries``: span pseudo-queries of each ad's text
    (ads without text get none).
    """
    eos = [tokenizer.eos_token_id] if append_eos else []
    targets = [list(map(int, t)) + eos for t in target_ids]
    if any(len(t) == 0 for t in targets):
        raise ValueError("an ad of the index has an empty target sequence (ad_codes.token_ids)")
    parts, stats = [], {"ads": len(ad_ids)}
    if indexing:
        missing = [a for a in ad_ids if a not in ad_texts]
        if missing:
            raise KeyError(f"no text for ad_id {missing[0]!r} ({len(missing)} ads without text)")
        texts = [ad_texts[a] for a in ad_ids]
        parts.append(build_prompted(_prompts(tokenizer, texts, max_query_tokens), targets, ExampleKind.INDEXING,
                            list(range(len(ad_ids)))))
        stats["indexing"] = len(ad_ids)
    row_of = {a: r for r, a in enumerate(ad_ids)}
    pairs, not_in = [], 0
    for query, ad in labelled:
        r = row_of.get(ad)
        if r is None:
            not_in += 1
        else:
            pairs.append((query, r))
    stats["labelled_not_in_index"] = not_in
    if labelled and not pairs:  # a subset catalogue misses some pairs; missing all is a wrong file or id type
        raise ValueError(f"none of the {len(labelled)} labelled pairs names an ad of the index (e.g. "
                         f"{labelled[0][1]!r}, {type(labelled[0][1]).__name__}; the index has e.g. {ad_ids[0]!r}, "
                         f"{type(ad_ids[0]).__name__}): check the queries file's ad_id column")
    if pairs:
        parts.append(build_prompted(_prompts(tokenizer, [q for q, _ in pairs], max_query_tokens),
                            [targets[r] for _, r in pairs], ExampleKind.RETRIEVAL, [r for _, r in pairs]))
    stats["retrieval"] = len(pairs)
    if pseudo_queries is not None and pseudo_queries.per_ad > 0:
        spans = span_pseudo_queries([str(ad_texts.get(a) or "") for a in ad_ids], pseudo_queries)
        if spans:
            parts.append(build_prompted(_prompts(tokenizer, [q for q, _ in spans], max_query_tokens),
                                [targets[r] for _, r in spans], ExampleKind.PSEUDO_QUERY, [r for _, r in spans]))
        stats["pseudo_query"] = len(spans)
    if not parts:
        raise ValueError("no training examples: indexing is off and no labelled pair matches the index")
    ex = TrainingExamples.concat(parts)
    stats["tokens"] = int(ex.offsets[-1])
    stats["target_tokens"] = ex.num_target_tokens()
    log.info("training examples: %s", stats)
    return ex, stats


def repeat_kinds(examples: TrainingExamples, repeats: Mapping[ExampleKind, int]) -> TrainingExamples:
    """``examples`` plus ``repeats[kind] - 1`` extra copies of every example of that kind (an epoch then
    sees each such example ``repeats[kind]`` times; the batcher shuffles the copies apart)."""
    idx = torch.arange(len(examples))
    extra = [idx[examples.kinds == int(kind)].repeat(r - 1) for kind, r in repeats.items() if r > 1]
    return examples.select(torch.cat([idx, *extra])) if extra else examples


@dataclass
class Batch:
    """A padded micro-batch: ``input_ids`` / ``labels`` int64 ``[B, L]`` (labels -100 off-target),
    ``attention_mask`` int64 ``[B, L]`` (right padding), ``target_index`` int64 ``[T]``: flat positions
    into ``[B, L-1]`` whose next token is a target (row-major), and ``num_tokens`` (non-pad tokens).

    ``target_index`` and ``num_tokens`` are computed on the CPU by :func:`collate`, so the training
    step needs no device -> host sync to select target positions or count tokens (a boolean-mask
    gather or ``int(mask.sum())`` on the GPU would stall the host every micro-batch).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    target_index: torch.Tensor
    num_tokens: int

    def to(self, device: Any) -> "Batch":
        device = torch.device(device)
        # pinned host memory makes the non_blocking copies asynchronous (pageable copies wait for the stream)
        move = ((lambda t: t.pin_memory().to(device, non_blocking=True)) if device.type == "cuda"
                else (lambda t: t.to(device)))
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.labels), move(self.target_index),
                     self.num_tokens)


def collate(ex: TrainingExamples, index: torch.Tensor, pad_id: int) -> Batch:
    """Pad the examples at ``index`` (int64 ``[B]``) into a :class:`Batch` (vectorised scatter)."""
    lens = ex.lengths[index]
    plen = ex.prompt_lens[index].long()
    B, L = len(index), int(lens.max())
    pos = torch.arange(L).expand(B, L)
    valid = pos < lens[:, None]
    src = (ex.offsets[index][:, None] + pos).clamp(max=int(ex.offsets[-1]) - 1)
    ids = torch.where(valid, ex.tokens[src].long(), torch.full_like(src, pad_id))
    labels = torch.where(valid & (pos >= plen[:, None]), ids, torch.full_like(ids, -100))
    target_index = (labels[:, 1:] != -100).reshape(-1).nonzero().squeeze(1)
    return Batch(ids, valid.long(), labels, target_index, int(lens.sum()))


def token_budget_batches(lengths: torch.Tensor, max_tokens: int, generator: torch.Generator | None = None,
                         shuffle: bool = True) -> list[torch.Tensor]:
    """Group examples of similar length so that ``batch_size * max_len <= max_tokens``.

    ``lengths``: int64 ``[E]``. Returns a list of int64 index tensors covering every example once
    (batch order shuffled when ``shuffle``; an example longer than the budget is a batch alone).
    Sorting by length after a random permutation keeps padding small while ties stay random.
    """
    E = lengths.numel()
    perm = torch.randperm(E, generator=generator) if shuffle else torch.arange(E)
    order = perm[torch.argsort(lengths[perm], stable=True)]
    sorted_lens = lengths[order].tolist()
    batches, start = [], 0
    while start < E:
        end = start + 1
        # lengths ascend, so the batch's max is its last element's length
        while end < E and (end - start + 1) * sorted_lens[end] <= max_tokens:
            end += 1
        batches.append(order[start:end])
        start = end
    if shuffle:
        bperm = torch.randperm(len(batches), generator=generator).tolist()
        batches = [batches[i] for i in bperm]
    return batches
