"""Training examples for DSI-style generative targeting, built from an ad index.

Two kinds of example, both ``prompt -> target`` where the prompt is exactly what the decoder feeds
(:func:`adbatch.serving.prompts.encode_targeting_prompts`) and the target is the ad's sequence from the index
(``ad_codes.token_ids``: code tokens for the ``codes`` scheme, title tokens for ``text``):

- **indexing**: the ad's own text (its title) as the query -> its target. Every ad of the index gets
  one, so ads no labelled query mentions are still learned (DSI's "memorise the corpus" task).
- **retrieval**: a labelled query -> the target of a relevant ad (one example per relevant pair of
  the *train* split only; valid/test queries never enter training).
- **pseudo-query** (optional): a short word span of the ad's text -> its target
  (:mod:`adbatch.training.pseudo_queries`: query-shaped inputs for every ad, labelled or not).
- **generated query** (optional): a query the fine-tuned query generator wrote for the ad -> its target
  (:mod:`adbatch.training.query_generation`, DSI-QG / docT5query); ``pseudo_queries.source`` says whether
  spans, generated queries or both are used.

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

from adbatch.serving.prompts import encode_targeting_prompts
from adbatch.training.pseudo_queries import PseudoQueryConfig, QuerySource, span_pseudo_queries

log = logging.getLogger(__name__)


class ExampleKind(int, enum.Enum):
    INDEXING = 0
    RETRIEVAL = 1
    PSEUDO_QUERY = 2
    CREATIVE = 3  # creative prompt -> the starting model's headline (adbatch.training.rehearsal)
    GENERATED_QUERY = 4  # a generated query of the ad -> its target (adbatch.training.query_generation)


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
    """The targeting prompt of every text, each distinct text encoded once (one batched call)."""
    texts = list(texts)
    distinct = list(dict.fromkeys(texts))
    encoded = dict(zip(distinct, encode_targeting_prompts(tokenizer, distinct, max_query_tokens=max_query_tokens)))
    return [encoded[t] for t in texts]


def _rows_in_index(pairs: Iterable[tuple[str, Hashable]], row_of: Mapping[Hashable, int]) -> tuple[list[tuple[str, int]], int]:
    """``(query, ad_id)`` pairs -> ``(query, index row)`` for the ads the index holds, and the count of the others."""
    rows, missing = [], 0
    for query, ad in pairs:
        r = row_of.get(ad)
        if r is None:
            missing += 1
        else:
            rows.append((query, r))
    return rows, missing


def _query_examples(tokenizer: Any, rows: list[tuple[str, int]], targets: list[list[int]], kind: ExampleKind,
                    max_query_tokens: int) -> TrainingExamples:
    """Prompted ``(query -> its ad's target)`` examples of ``kind`` from ``(query, index row)`` pairs."""
    return build_prompted(_prompts(tokenizer, [q for q, _ in rows], max_query_tokens), [targets[r] for _, r in rows],
                          kind, [r for _, r in rows])


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
    generated: Iterable[tuple[str, Hashable]] = (),
) -> tuple[TrainingExamples, dict[str, int]]:
    """Build indexing + retrieval examples for the ads of an index.

    ``ad_ids[r]`` / ``target_ids[r]``: the index's ad table by row. ``ad_texts``: ad_id -> text used
    as the indexing query (the title); every ad of the index must have one (KeyError names the
    first missing id). ``labelled``: (query, ad_id) pairs of the train split; a pair whose ad is not
    in the index is counted in ``stats['labelled_not_in_index']`` (the catalogue may be a subset).
    ``append_eos`` adds the tokenizer's EOS after each target (off by default: the trie, not EOS,
    ends a target during decoding). ``pseudo_queries``: span pseudo-queries of each ad's text
    (ads without text get none) when its ``source`` is spans or mix. ``generated``: (query, ad_id) pairs
    written by the query generator (:func:`adbatch.training.query_generation.generate_queries`), one
    generated-query example each; pairs whose ad is not in the index are counted
    (``generated_not_in_index``). Whether ``generated`` should be there for ``source`` is the caller's
    decision (:func:`adbatch.training.train_on_index` falls back to spans where it has none).
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
    pairs, not_in = _rows_in_index(labelled, row_of)
    stats["labelled_not_in_index"] = not_in
    if labelled and not pairs:  # a subset catalogue misses some pairs; missing all is a wrong file or id type
        raise ValueError(f"none of the {len(labelled)} labelled pairs names an ad of the index (e.g. "
                         f"{labelled[0][1]!r}, {type(labelled[0][1]).__name__}; the index has e.g. {ad_ids[0]!r}, "
                         f"{type(ad_ids[0]).__name__}): check the queries file's ad_id column")
    if pairs:
        parts.append(_query_examples(tokenizer, pairs, targets, ExampleKind.RETRIEVAL, max_query_tokens))
    stats["retrieval"] = len(pairs)
    if pseudo_queries is not None and pseudo_queries.per_ad > 0 and pseudo_queries.source is not QuerySource.GENERATED:
        spans = span_pseudo_queries([str(ad_texts.get(a) or "") for a in ad_ids], pseudo_queries)
        if spans:
            parts.append(_query_examples(tokenizer, spans, targets, ExampleKind.PSEUDO_QUERY, max_query_tokens))
        stats["pseudo_query"] = len(spans)
    gen_rows, gen_not_in = _rows_in_index(generated, row_of)
    if gen_rows:
        parts.append(_query_examples(tokenizer, gen_rows, targets, ExampleKind.GENERATED_QUERY, max_query_tokens))
    if gen_rows or gen_not_in:
        stats["generated_query"] = len(gen_rows)
        stats["generated_not_in_index"] = gen_not_in
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
    """A micro-batch: ``input_ids`` / ``labels`` int64 ``[B, L]`` (labels -100 off-target),
    ``attention_mask`` int64 ``[B, L]`` (1 = a real token, 0 = padding), ``target_index`` int64 ``[T]``:
    flat positions into ``[B, L-1]`` whose next token is a target (row-major), and ``num_tokens``
    (non-pad tokens; ``B * L`` slots were computed).

    Padded (:func:`collate`): one example per row, right padding; ``position_ids``/``seq_ids`` None.
    Packed (:func:`collate_packed`): several examples back to back per row; ``position_ids`` int64
    ``[B, L]`` restart at 0 for every example, ``seq_ids`` int32 ``[B, L]`` number the examples of a
    row (0, 1, ...; the padding tail of a row is one more id of its own), so attention is causal
    within one id and never crosses ids (:func:`packed_attention_mask`). A packed row's last prompt
    token predicts its first target token exactly as in a padded row, and an example's last token
    "predicts" the next example's first token, which is a prompt token (label -100): the shifted
    ``target_index`` never crosses examples.

    ``target_index`` and ``num_tokens`` are computed on the CPU by the collate functions, so the
    training step needs no device -> host sync to select target positions or count tokens (a
    boolean-mask gather or ``int(mask.sum())`` on the GPU would stall the host every micro-batch).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    target_index: torch.Tensor
    num_tokens: int
    position_ids: torch.Tensor | None = None
    seq_ids: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.seq_ids is not None

    @property
    def num_slots(self) -> int:
        """Token positions computed, padding included (``B * L``)."""
        return int(self.input_ids.numel())

    def to(self, device: Any) -> "Batch":
        device = torch.device(device)
        # pinned host memory makes the non_blocking copies asynchronous (pageable copies wait for the stream)
        move = ((lambda t: t.pin_memory().to(device, non_blocking=True)) if device.type == "cuda"
                else (lambda t: t.to(device)))
        opt = (lambda t: None if t is None else move(t))
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.labels), move(self.target_index),
                     self.num_tokens, opt(self.position_ids), opt(self.seq_ids))


def collate(ex: TrainingExamples, index: torch.Tensor, pad_id: int, pad_to: int | None = None) -> Batch:
    """Pad the examples at ``index`` (int64 ``[B]``) into a :class:`Batch` (vectorised scatter), right-padded
    to the longest of them, or to ``pad_to`` tokens when given (a fixed shape for compiled layers)."""
    lens = ex.lengths[index]
    plen = ex.prompt_lens[index].long()
    B, L = len(index), int(lens.max())
    if pad_to is not None:
        assert pad_to >= L, f"pad_to {pad_to} < the longest example ({L} tokens)"
        L = pad_to
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


# ---------------------------------------------------------------------------------------------
# sequence packing (rows of a fixed length, several examples per row, no cross-example attention)
# ---------------------------------------------------------------------------------------------
@dataclass
class PackedMicroBatch:
    """Which examples go where: ``index`` int64 ``[k]`` (examples, row by row, in row order) and
    ``row_sizes`` int64 ``[rows]`` (examples per row; rows past ``len(row_sizes)`` of a batch are all padding)."""

    index: torch.Tensor
    row_sizes: torch.Tensor


def _best_fit_rows(lens: list[int], row_len: int) -> tuple[list[int], int]:
    """Best-fit decreasing: the row of each example (``lens`` sorted descending) and the number of rows.

    Each example goes to the open row with the least room that still fits it (a new row when none
    does). Rooms are bucketed by size and the non-empty buckets kept as bits of one int, so finding the
    smallest room >= l is a shift and a lowest-set-bit, not a scan (~0.6 us an example in CPython:
    1.4M examples in ~0.8 s, once an epoch, like :func:`token_budget_batches`' own per-example loop).
    """
    buckets: list[list[int]] = [[] for _ in range(row_len + 1)]
    nonempty = 0  # bit c set <=> buckets[c] holds a row with exactly c free slots
    row_of = [0] * len(lens)
    n_rows = 0
    min_len = lens[-1] if lens else 1  # later examples are never shorter: rooms below it are closed
    for i, length in enumerate(lens):
        m = nonempty >> length
        if m:
            room = length + ((m & -m).bit_length() - 1)
            bucket = buckets[room]
            r = bucket.pop()
            if not bucket:
                nonempty &= ~(1 << room)
        else:
            room, r = row_len, n_rows
            n_rows += 1
        row_of[i] = r
        left = room - length
        if left >= min_len:
            bucket = buckets[left]
            if not bucket:
                nonempty |= 1 << left
            bucket.append(r)
    return row_of, n_rows


def packed_batches(lengths: torch.Tensor, row_len: int, rows_per_batch: int,
                   generator: torch.Generator | None = None, shuffle: bool = True) -> list[PackedMicroBatch]:
    """Pack every example once into rows of ``row_len`` tokens, ``rows_per_batch`` rows per micro-batch.

    ``lengths``: int64 ``[E]`` (each ``<= row_len``). The examples are shuffled, sorted by length
    (longest first, ties in shuffled order) and placed best-fit decreasing; the rows are then shuffled
    and cut into micro-batches (the last one may have fewer rows: its remaining rows are padding). An
    epoch sees exactly the examples it sees unpacked; only which examples share a micro-batch changes.
    """
    E = lengths.numel()
    if E and int(lengths.max()) > row_len:
        raise ValueError(f"an example of {int(lengths.max())} tokens does not fit a packed row of {row_len}")
    perm = torch.randperm(E, generator=generator) if shuffle else torch.arange(E)
    order = perm[torch.argsort(lengths[perm], descending=True, stable=True)]
    row_of, n_rows = _best_fit_rows(lengths[order].tolist(), row_len)
    row_of_t = torch.tensor(row_of, dtype=torch.int64)
    row_perm = torch.randperm(n_rows, generator=generator) if shuffle else torch.arange(n_rows)
    rank = torch.empty_like(row_perm)
    rank[row_perm] = torch.arange(n_rows)  # new position of each row
    new_row = rank[row_of_t]
    by_row = torch.argsort(new_row, stable=True)
    index, new_row = order[by_row], new_row[by_row]
    sizes = torch.bincount(new_row, minlength=n_rows)
    starts = torch.zeros(n_rows + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(sizes, 0)
    out = []
    for b in range(0, n_rows, rows_per_batch):
        e = min(b + rows_per_batch, n_rows)
        out.append(PackedMicroBatch(index[starts[b]:starts[e]], sizes[b:e]))
    return out


def plan_examples(plan: torch.Tensor | PackedMicroBatch) -> int:
    """How many examples a micro-batch plan (of either batcher) holds."""
    return int(plan.index.numel() if isinstance(plan, PackedMicroBatch) else plan.numel())


def _split_plan(plan: torch.Tensor | PackedMicroBatch) -> list[Any]:
    """Two micro-batches holding the examples of ``plan`` (at least two): a padded batch's first and second
    half; a packed one's first and last rows, or, with a single row, the first and second half of its examples."""
    if not isinstance(plan, PackedMicroBatch):
        return [plan[: plan.numel() // 2], plan[plan.numel() // 2:]]
    if plan.row_sizes.numel() >= 2:
        h = plan.row_sizes.numel() // 2
        k = int(plan.row_sizes[:h].sum())
        return [PackedMicroBatch(plan.index[:k], plan.row_sizes[:h]), PackedMicroBatch(plan.index[k:], plan.row_sizes[h:])]
    k = plan.index.numel()
    return [PackedMicroBatch(plan.index[: k // 2], torch.tensor([k // 2])),
            PackedMicroBatch(plan.index[k // 2:], torch.tensor([k - k // 2]))]


def split_for_ranks(batches: list[Any], world_size: int) -> list[Any]:
    """``batches`` (of :func:`token_budget_batches` or :func:`packed_batches`) with the largest cut in two
    until their number is a multiple of ``world_size``.

    Under DDP every rank takes every ``world_size``-th micro-batch of the same list and all ranks must run
    the same number of them, so a remainder would be dropped: after the cuts every example of the epoch is
    seen exactly once across the ranks (none dropped, none repeated). A half stays within its batch's token
    budget (fewer examples; a packed half keeps the batch's shape, with more padding rows). The two halves
    sit side by side, so they go to different ranks. Falls short of a multiple only when no batch has two
    examples left to cut (fewer examples than ranks).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    out = list(batches)
    while len(out) % world_size:
        sizes = [plan_examples(b) for b in out]
        i = max(range(len(out)), key=sizes.__getitem__)
        if sizes[i] < 2:
            break
        out[i:i + 1] = _split_plan(out[i])
    return out


def collate_packed(ex: TrainingExamples, plan: PackedMicroBatch, rows: int, row_len: int, pad_id: int) -> Batch:
    """Lay the examples of ``plan`` into a packed :class:`Batch` of ``[rows, row_len]`` (vectorised).

    Every batch of a run has the same shape (a short last batch gets all-padding rows), so a compiled
    step never recompiles. Padding sits at the end of each row, with positions continuing from 0 and a
    ``seq_ids`` value of its own (it attends only to itself and never enters the loss).
    """
    index, sizes = plan.index, plan.row_sizes
    k = index.numel()
    assert sizes.numel() <= rows and int(sizes.sum()) == k, "plan does not match the batch shape"
    lens = ex.lengths[index]
    plen = ex.prompt_lens[index].long()
    if k and int(plen.min()) < 1:
        raise ValueError("packing needs a prompt of >= 1 token per example (its first token predicts nothing)")
    row = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # [k] row of each example
    first = torch.zeros(sizes.numel() + 1, dtype=torch.int64)
    first[1:] = torch.cumsum(sizes, 0)
    slot_in_row = torch.arange(k) - first[row]  # [k] 0, 1, ... within the row
    # start column of each example = exclusive cumsum of lengths within its row
    csum = torch.cumsum(lens, 0)
    start = csum - lens - (csum - lens)[first[row]]
    used = torch.zeros(rows, dtype=torch.int64)
    used.index_add_(0, row, lens)
    if k and int(used.max()) > row_len:
        raise ValueError(f"a row holds {int(used.max())} tokens, more than its {row_len}")
    # per token of the examples: (row, column, example, position within it)
    ex_of_tok = torch.repeat_interleave(torch.arange(k), lens)
    within = torch.arange(int(lens.sum())) - (csum - lens)[ex_of_tok]
    col = start[ex_of_tok] + within
    flat = row[ex_of_tok] * row_len + col
    n = rows * row_len
    ids = torch.full((n,), pad_id, dtype=torch.int64)
    ids[flat] = ex.tokens[ex.offsets[index][ex_of_tok] + within].long()
    labels = torch.full((n,), -100, dtype=torch.int64)
    is_tgt = within >= plen[ex_of_tok]
    labels[flat[is_tgt]] = ids[flat[is_tgt]]
    real = torch.zeros(n, dtype=torch.int64)
    real[flat] = 1
    # padding tail: positions 0.. from the row's used length, its own id (one past the row's examples)
    cols = torch.arange(row_len).expand(rows, row_len)
    n_ex = torch.zeros(rows, dtype=torch.int64)
    n_ex[: sizes.numel()] = sizes
    pos = (cols - used[:, None]).reshape(-1).clone()
    seq = n_ex[:, None].expand(rows, row_len).reshape(-1).clone()
    pos[flat] = within
    seq[flat] = slot_in_row[ex_of_tok]
    ids, labels, real = ids.view(rows, row_len), labels.view(rows, row_len), real.view(rows, row_len)
    target_index = (labels[:, 1:] != -100).reshape(-1).nonzero().squeeze(1)
    return Batch(ids, real, labels, target_index, int(lens.sum()), pos.view(rows, row_len),
                 seq.view(rows, row_len).to(torch.int32))


def packed_attention_mask(seq_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean ``[B, 1, L, L]`` (True = may attend): causal within one ``seq_ids`` value, nothing across.

    ``seq_ids``: int ``[B, L]`` (:attr:`Batch.seq_ids`). ``sliding_window``: also keep only keys less
    than that many positions back (HF's rule ``kv_idx > q_idx - sliding_window``; positions within
    an example are the row's columns shifted, so the difference is the same).
    """
    L = seq_ids.shape[1]
    i = torch.arange(L, device=seq_ids.device)
    allowed = i[:, None] >= i[None, :]  # [L, L] causal
    if sliding_window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # [B, L, L]
    return (same & allowed)[:, None]
