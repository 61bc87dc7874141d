"""Rank-aware distillation from the dense teacher: a ranking objective next to the cross-entropy (issue 41).

Cross-entropy teaches the DSI model one target per query (the labelled ad, or the ad a pseudo-query was cut
from); serving ranks a *list* of ads by their sequence log-probabilities under trie-constrained beam search.
The index's dense channel (ad embeddings + the query embedder, :class:`adbatch.index.dense.DenseRetriever`)
knows a graded ordering of the whole catalogue for any query. This phase teaches the model that ordering
over the ads that matter: for each ranking query a *group* of candidate ads is formed,

- the teacher's top ``teacher_k`` ads (cosine of the query with each ad's stored embedding),
- the model's own beam outputs (``negatives`` per query, trie-constrained beam search, mined under
  ``no_grad``: the ads the model would actually serve, which is where its ranking is wrong),
- the query's labelled / source ad(s),

and the student's scores are the teacher-forced sums of target-token log-probabilities of each candidate's
id sequence (:func:`sequence_logprobs`: what beam search ranks by, ``length_penalty`` 0). Two losses
(:class:`RankLossMode`):

- ``listwise_kl``: ``KL(softmax(teacher_cos / T) || softmax(student / tau))`` over the group's candidates
  (ListNet-style listwise distillation); a labelled / source ad gets the group's top teacher score, so the
  labels never rank below the teacher's favourite. ``tau`` is a *learned* student temperature
  (``learn_student_temperature``, on by default): one log-parameterised scalar owned by the rank phase (its own
  Adam, never saved in the model), started at the ratio of the student's to the teacher's score spread on the
  first rank batch. Why: the teacher's logits span a few nats, a DSI model's summed log-probs of different ads
  tens, and the cross-entropy keeps widening them (the label towards probability 1). With ``tau = 1`` the KL
  can only fall by flattening the model's sequence distribution, which the cross-entropy undoes: the two
  fight, the KL rises (GPU: 4.4 -> 10.4 over the phase) and the pulled-together scores are bf16-fragile at
  serving. Divided by a fitted ``tau`` the loss is scale-free (scores ``a x`` as far apart reach the same
  minimum at ``a x tau``): it asks for the teacher's order and relative gaps, which the cross-entropy's
  wider gaps do not contradict (``tau`` grows with them);
- ``margin``: LTRGR's margin loss (Li et al. 2023, "Learning to Rank in Generative Retrieval"):
  ``mean relu(margin - s_pos + s_neg)`` over pairs of a positive (labelled / source ad, the teacher's top-1)
  and a negative (a beam output that is neither a positive nor in the teacher's top-k).

The rank phase is the last ``1 - start_fraction`` of the optimizer steps (the ids must be learned first:
the log-probabilities of an untrained model say nothing and its beams are noise). Each optimizer step of
the phase adds one rank micro-batch of ``queries_per_step`` groups, weighted by ``weight``, to the
cross-entropy micro-batches, which stay as they are.

"Teacher-labelled generated queries": with the ``generated`` source, the generator's queries (trained with
their one source ad as target by the cross-entropy) get the teacher's top-k as soft targets here.

Precision: the student's log-softmax, the sums and both losses are float32; the LM head's matmul runs in the
autocast dtype (bf16 on CUDA), as the cross-entropy's does.

Cost: the teacher's query embeddings and top-k once before training (one embedder pass over the ranking
queries, a matmul against the ad embeddings); one beam search over them at the start of the phase (and every
``refresh_every`` steps when set); per step one extra forward + backward over ``queries_per_step x C`` rows of
prompt + candidate id (``C`` = candidates per group).
"""

from __future__ import annotations

import enum
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)


class RankLossMode(str, enum.Enum):
    """The ranking loss over a group of candidates (see the module docstring)."""

    LISTWISE_KL = "listwise_kl"  #: KL(teacher's softmax over cosines || student's softmax over log-probs)
    MARGIN = "margin"  #: LTRGR pairwise hinge between positives and beam negatives


class RankSource(str, enum.Enum):
    """Which training queries become ranking queries (each only when it is among the training examples)."""

    LABELLED = "labelled"  #: train-split labelled queries (positives: all their labelled ads in the index)
    SPANS = "spans"  #: span pseudo-queries (positive: the ad they were cut from)
    GENERATED = "generated"  #: the query generator's queries (positive: their source ad)


class TeacherQuery(str, enum.Enum):
    """How the teacher places a ranking query in the embedding space."""

    #: the index's query embedder embeds the query text (the dense channel as served)
    EMBED = "embed"
    #: the embedding of the query's (first) labelled / source ad stands in for the query: no query embedder
    #: needed (a device without the embedder, or with only precomputed vectors of the test queries); the
    #: teacher's list is then the ad's nearest neighbours, the same for every query of that ad
    SOURCE_AD = "source_ad"


@dataclass
class RankLossConfig(ConfigBase):
    """Rank-aware distillation from the dense teacher (off by default; :mod:`adbatch.training.rank_loss`)."""

    enabled: bool = field(default=False, metadata={"help": "add the ranking loss in the last part of training"})
    weight: float = field(default=0.5, metadata={"help": "lambda: loss = CE + weight * rank loss"})
    mode: RankLossMode = field(default=RankLossMode.LISTWISE_KL, metadata={"help": "listwise_kl | margin"})
    teacher_k: int = field(default=8, metadata={"help": "the teacher's top-k ads per query (soft targets)"})
    negatives: int = field(default=8, metadata={"help": "the model's beam outputs per query (mined negatives)"})
    max_positives: int = field(default=2, metadata={"help": "labelled / source ads kept per query"})
    temperature: float = field(default=0.05, metadata={
        "help": "temperature of the teacher's softmax over cosines (cosines of one query span ~0.3: 0.05 "
                "gives a distribution that prefers its top few without ignoring the rest)"})
    margin: float = field(default=1.0, metadata={"help": "margin of the margin loss, in summed log-prob"})
    learn_student_temperature: bool = field(default=True, metadata={
        "help": "listwise_kl: divide the student's summed log-probs by a learned scalar temperature (scale-free: "
                "the loss asks for the teacher's order, not its calibration); off = the raw sums (temperature 1)"})
    student_temperature_lr: float = field(default=0.05, metadata={
        "help": "Adam learning rate of the student temperature's log (its own optimizer; not saved in the model)"})
    start_fraction: float = field(default=0.5, metadata={
        "help": "share of the optimizer steps after which the rank phase starts (CE alone before)"})
    queries_per_step: int = field(default=16, metadata={"help": "ranking groups in each step's rank micro-batch"})
    sources: tuple[RankSource, ...] = field(
        default=(RankSource.LABELLED, RankSource.SPANS, RankSource.GENERATED),
        metadata={"help": "which training queries rank: labelled, spans, generated"})
    max_queries: int = field(default=4096, metadata={
        "help": "cap on ranking queries (sampled evenly over the sources, seeded)"})
    teacher_query: TeacherQuery = field(default=TeacherQuery.EMBED, metadata={
        "help": "embed (the index's query embedder) | source_ad (the source ad's vector stands in)"})
    refresh_every: int = field(default=0, metadata={
        "help": "re-mine the beam negatives every this many steps of the phase (0 = once at its start)"})
    mine_batch: int = field(default=256, metadata={"help": "queries per beam-search call when mining"})
    num_beams: int = field(default=0, metadata={"help": "beam width of the mining (0 = negatives)"})
    seed: int = field(default=0, metadata={"help": "seed of the query sample and the group order"})

    def validate(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ConfigError(f"RankLossConfig.weight must be finite and > 0, got {self.weight}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"RankLossConfig.temperature must be finite and > 0, got {self.temperature}")
        if not (self.student_temperature_lr > 0 and math.isfinite(self.student_temperature_lr)):
            raise ConfigError(f"RankLossConfig.student_temperature_lr must be finite and > 0, got {self.student_temperature_lr}")
        if not (self.margin >= 0 and math.isfinite(self.margin)):
            raise ConfigError(f"RankLossConfig.margin must be finite and >= 0, got {self.margin}")
        if not 0.0 <= self.start_fraction < 1.0:
            raise ConfigError(f"RankLossConfig.start_fraction must be in [0, 1), got {self.start_fraction}")
        for name in ("teacher_k", "max_positives", "queries_per_step", "max_queries", "mine_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RankLossConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("negatives", "refresh_every", "num_beams"):
            if getattr(self, name) < 0:
                raise ConfigError(f"RankLossConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.sources:
            raise ConfigError("RankLossConfig.sources must name at least one of labelled / spans / generated")
        if self.mode is RankLossMode.MARGIN and self.negatives == 0:
            raise ConfigError("RankLossConfig: the margin loss needs beam negatives (negatives >= 1)")

    @property
    def candidates(self) -> int:
        """``C``: candidate slots per group (teacher top-k + beam negatives + positives, before dedup)."""
        return self.teacher_k + self.negatives + self.max_positives


# ---------------------------------------------------------------------------------------------
# losses (pure functions)
# ---------------------------------------------------------------------------------------------
def listwise_kl_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                     student_temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Mean over groups of ``KL(softmax(teacher) || softmax(student / student_temperature))`` over each group's
    valid candidates.

    ``student``: float ``[G, C]`` scores (summed sequence log-probs; any value where masked);
    ``teacher``: float ``[G, C]`` logits of the teacher (cosine / temperature); ``mask``: bool ``[G, C]``
    (True = a real candidate; every group needs one); ``student_temperature``: a positive float or float32
    scalar tensor (a learned one receives its gradient through it). Scaling ``student`` and
    ``student_temperature`` by one factor leaves the loss unchanged. Math in float32; returns a float32 scalar.
    """
    assert student.shape == teacher.shape == mask.shape and student.ndim == 2, (student.shape, teacher.shape, mask.shape)
    assert bool(mask.any(1).all()), "every group needs at least one valid candidate"
    neg = torch.finfo(torch.float32).min
    log_q = torch.log_softmax((student.float() / student_temperature).masked_fill(~mask, neg), dim=1)  # [G, C]
    log_p = torch.log_softmax(teacher.float().masked_fill(~mask, neg), dim=1)  # [G, C]
    # where() keeps masked entries out of the sum and of the gradient (their p is 0, log q ~ -inf)
    kl = torch.where(mask, log_p.exp() * (log_p - log_q), torch.zeros_like(log_q)).sum(1)  # [G]
    return kl.mean()


def initial_student_temperature(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> float:
    """A starting value of the learned student temperature: the median over groups of (spread of the student's
    scores) / (spread of the teacher's logits), so ``student / temperature`` starts on the teacher's scale.

    ``student`` / ``teacher``: float ``[G, C]``; ``mask``: bool ``[G, C]``. Spread = standard deviation over a
    group's valid candidates; groups with fewer than two candidates or a flat teacher are skipped (1.0 when
    none is left). One host sync (called once, at the phase's first rank micro-batch). Clamped to
    ``[1e-2, 1e4]``.
    """
    m = mask.float()
    n = m.sum(1)  # [G]

    def spread(x: torch.Tensor) -> torch.Tensor:  # [G] std over the valid candidates
        x = torch.where(mask, x.float(), torch.zeros((), device=x.device))
        mean = x.sum(1) / n.clamp(min=1)
        return (((x - mean[:, None]) ** 2 * m).sum(1) / n.clamp(min=1)).sqrt()

    s, t = spread(student.detach()), spread(teacher)
    ok = (n >= 2) & (t > 1e-6) & (s > 1e-6)
    if not bool(ok.any()):
        return 1.0
    return float((s[ok] / t[ok]).median().clamp(1e-2, 1e4))


def margin_loss(student: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, margin: float) -> torch.Tensor:
    """LTRGR margin loss: mean of ``relu(margin - s[g, p] + s[g, n])`` over every (positive, negative) pair.

    ``student``: float ``[G, C]``; ``positive`` / ``negative``: bool ``[G, C]`` (disjoint). Groups without a
    pair contribute nothing; zero (with a gradient path) when no group has one. Returns a float32 scalar.
    """
    assert student.shape == positive.shape == negative.shape and student.ndim == 2
    assert not bool((positive & negative).any()), "a candidate cannot be both positive and negative"
    s = student.float()
    hinge = F.relu(margin - s[:, :, None] + s[:, None, :])              # [G, C(pos), C(neg)]
    pairs = positive[:, :, None] & negative[:, None, :]                  # [G, C, C]
    n = pairs.sum()
    return torch.where(pairs, hinge, torch.zeros_like(hinge)).sum() / n.clamp(min=1)


def sequence_logprobs(model: Any, batch: Any, shape: tuple[int, int], mask: torch.Tensor,
                      chunk: int = 2048) -> torch.Tensor:
    """Teacher-forced sum of target-token log-probabilities of each candidate row, as a ``[G, C]`` grid.

    ``batch``: a padded :class:`adbatch.training.data.Batch` of ``G * C`` rows, group-major (row
    ``g * C + c`` = prompt of query ``g`` + target of its candidate ``c``; labels -100 off the target).
    ``mask``: bool ``[G, C]``; masked entries come back as 0 (their rows are still computed: keeping every
    batch ``G * C`` rows keeps compiled layers to one shape). ``model``: a plain HF causal LM (decoder body
    + LM head; not DDP). The head's log-softmax runs ``chunk`` target positions at a time under activation
    checkpointing, so ``[positions, vocab]`` float32 log-probs never exist for the whole batch (recomputed
    per chunk in the backward). Returns float32 ``[G, C]``.
    """
    from torch.utils.checkpoint import checkpoint

    from adbatch.training.batch_forward import model_inputs, target_hidden

    G, C = shape
    assert batch.input_ids.shape[0] == G * C, f"expected {G * C} rows (G={G} x C={C}), got {batch.input_ids.shape[0]}"
    assert mask.shape == (G, C), f"mask {tuple(mask.shape)} != ({G}, {C})"
    kw = model_inputs(model, batch)
    h, targets, head = target_hidden(model, kw["input_ids"], kw["attention_mask"], batch.labels, batch.target_index,
                                     kw.get("position_ids"))  # [n, H], [n]

    def token_logprob(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(head(hc).float(), dim=-1).gather(1, tc[:, None]).squeeze(1)  # [c]

    parts = [checkpoint(token_logprob, h[s:s + chunk], targets[s:s + chunk], use_reentrant=False)
             if torch.is_grad_enabled() else token_logprob(h[s:s + chunk], targets[s:s + chunk])
             for s in range(0, h.shape[0], chunk)]
    lp = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)  # [n]
    row = torch.div(batch.target_index, batch.input_ids.shape[1] - 1, rounding_mode="floor")  # [n] row of each target
    out = torch.zeros(G * C, dtype=torch.float32, device=lp.device).index_add(0, row, lp)  # [G*C]
    return torch.where(mask.to(out.device), out.view(G, C), torch.zeros((), device=out.device))


# ---------------------------------------------------------------------------------------------
# ranking queries and groups
# ---------------------------------------------------------------------------------------------
@dataclass
class RankQueries:
    """The ranking queries of a run, with what the teacher says about them (built before training).

    ``prompts``: ``Q`` token-id lists (targeting prompts); ``positives``: ``Q`` lists of index rows
    (labelled / source ads, at most ``max_positives``); ``source``: int8 ``[Q]`` (position in
    :class:`RankSource` order); ``q_emb``: float32 ``[Q, D]`` query vectors (CPU);
    ``ad_emb``: float32 ``[N, D]`` the index's ad embeddings (CPU, L2-normalised);
    ``teacher_rows``: int64 ``[Q, k]`` the teacher's top-k rows, best first; ``targets``: ``N`` target
    token lists (row -> its id sequence, as the training examples have it); ``trie``: the index's trie
    (beam search mines the negatives in it); ``stats``: counts for the record.
    """

    prompts: list[list[int]]
    positives: list[list[int]]
    source: torch.Tensor
    q_emb: torch.Tensor
    ad_emb: torch.Tensor
    teacher_rows: torch.Tensor
    targets: list[list[int]]
    trie: Any
    stats: dict[str, Any]

    def __len__(self) -> int:
        return len(self.prompts)


def pick_rank_queries(config: RankLossConfig, row_of: Mapping[Hashable, int], *,
                      labelled: Iterable[tuple[str, Hashable]] = (), spans: Iterable[tuple[str, int]] = (),
                      generated: Iterable[tuple[str, Hashable]] = ()) -> dict[str, tuple[RankSource, list[int]]]:
    """Which training queries rank: ``{query: (source, positive rows)}``, in the phase's order. Queries of one
    text are merged (their positives united); at most ``config.max_queries`` are kept, drawn in turn from each of
    ``config.sources`` (shuffled with ``config.seed``) so a large source does not crowd out the labelled one.
    ``row_of``: ad id -> index row; ``spans`` are ``(query, row)`` pairs already. Depends on nothing but its
    arguments: a benchmark embeds exactly these queries where the teacher's encoder is (the device has none)."""
    chosen = set(config.sources)
    by_source: dict[RankSource, dict[str, list[int]]] = {s: {} for s in RankSource}
    feeds = [(RankSource.LABELLED, ((q, row_of.get(a)) for q, a in labelled)),
             (RankSource.SPANS, iter(spans)),
             (RankSource.GENERATED, ((q, row_of.get(a)) for q, a in generated))]
    for src, pairs in feeds:
        if src not in chosen:
            continue
        for q, r in pairs:
            if r is not None and q:
                rows = by_source[src].setdefault(str(q), [])
                if r not in rows:
                    rows.append(int(r))
    rng = random.Random(config.seed)
    order = {s: rng.sample(sorted(d), len(d)) for s, d in by_source.items()}
    picked: dict[str, tuple[RankSource, list[int]]] = {}
    cursors = {s: 0 for s in RankSource}
    while len(picked) < config.max_queries and any(cursors[s] < len(order[s]) for s in RankSource):
        for s in RankSource:  # round-robin over the sources
            if cursors[s] < len(order[s]) and len(picked) < config.max_queries:
                q = order[s][cursors[s]]
                cursors[s] += 1
                if q not in picked:  # a text in two sources keeps the first source's label
                    picked[q] = (s, by_source[s][q][:config.max_positives])
    return picked


def rank_queries(tokenizer: Any, index: Any, dense: Any, config: RankLossConfig, *,
                 targets: Sequence[Sequence[int]], max_query_tokens: int,
                 labelled: Iterable[tuple[str, Hashable]] = (), spans: Iterable[tuple[str, int]] = (),
                 generated: Iterable[tuple[str, Hashable]] = ()) -> RankQueries:
    """The ranking queries of ``config.sources`` among the run's training queries (:func:`pick_rank_queries`),
    with the teacher's top-k.

    ``index``: an ``AdIndex`` (``ad_ids``, ``trie``); ``dense``: a
    :class:`~adbatch.index.dense.DenseRetriever` over it (its ``matrix`` ``[N, D]`` and, for
    ``teacher_query = embed``, its ``embed``); ``labelled`` / ``generated``: ``(query, ad_id)`` pairs;
    ``spans``: ``(query, row)`` pairs; ``targets``: each row's target tokens.
    """
    from adbatch.serving.prompts import encode_targeting_prompts

    picked = pick_rank_queries(config, {a: r for r, a in enumerate(index.ad_ids)}, labelled=labelled, spans=spans,
                               generated=generated)
    queries = list(picked)
    if not queries:
        raise ValueError(f"rank loss: no ranking queries from sources {[s.value for s in config.sources]} "
                         "(no labelled pairs in the index, spans off, or no generated queries)")
    positives = [picked[q][1] for q in queries]
    src_order = list(RankSource)
    source = torch.tensor([src_order.index(picked[q][0]) for q in queries], dtype=torch.int8)
    ad_emb = dense.matrix.detach().float().cpu()  # [N, D]
    if config.teacher_query is TeacherQuery.EMBED:
        q_emb = dense.embed(queries).float().cpu()  # [Q, D]
    else:
        q_emb = ad_emb[torch.tensor([p[0] for p in positives])]
    q_emb = F.normalize(q_emb, dim=1)
    k = min(config.teacher_k, ad_emb.shape[0])
    teacher_rows = (q_emb @ ad_emb.T).topk(k, dim=1).indices  # [Q, k]
    prompts = encode_targeting_prompts(tokenizer, queries, max_query_tokens=max_query_tokens)
    stats = {"queries": len(queries), "teacher_query": config.teacher_query.value,
             "by_source": {s.value: int((source == i).sum()) for i, s in enumerate(src_order) if s in config.sources},
             # how often the teacher's top-k holds a labelled / source ad (a check of the teacher's agreement)
             "teacher_hits_positive": round(sum(bool(set(p) & set(t)) for p, t in zip(positives, teacher_rows.tolist()))
                                            / len(queries), 4)}
    return RankQueries(prompts=[list(map(int, p)) for p in prompts], positives=positives, source=source,
                       q_emb=q_emb, ad_emb=ad_emb, teacher_rows=teacher_rows,
                       targets=[list(map(int, t)) for t in targets], trie=index.trie, stats=stats)


@dataclass
class RankGroups:
    """Candidate groups of every ranking query, as flat prompt + candidate rows (``Q`` groups of ``C`` slots).

    ``examples``: :class:`adbatch.training.data.TrainingExamples` of ``Q * C`` rows, group-major (a padding
    slot repeats the group's first candidate); ``rows``: int64 ``[Q, C]`` candidate index rows (-1 padding);
    ``mask``: bool ``[Q, C]``; ``teacher``: float32 ``[Q, C]`` teacher logits (cosine / temperature; labelled
    positives raised to the group's top); ``positive`` / ``negative``: bool ``[Q, C]`` (margin loss);
    ``max_len``: longest row (every rank micro-batch is padded to it: one shape for compiled layers).
    """

    examples: Any
    rows: torch.Tensor
    mask: torch.Tensor
    teacher: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor
    max_len: int
    stats: dict[str, Any]


def build_groups(rq: RankQueries, beam_rows: torch.Tensor, config: RankLossConfig) -> RankGroups:
    """The candidate groups of ``rq`` given the model's beam outputs ``beam_rows`` (int64 ``[Q, M]``, -1 pad).

    Candidates per query, deduplicated in this order: positives, the teacher's top-k, beam outputs; ``C =
    config.candidates`` slots. Runs once per mining (offline, Python over queries is fine).
    """
    from adbatch.training.data import ExampleKind, build_prompted

    Q, C = len(rq), config.candidates
    rows = torch.full((Q, C), -1, dtype=torch.int64)
    positive = torch.zeros(Q, C, dtype=torch.bool)
    negative = torch.zeros(Q, C, dtype=torch.bool)
    teacher_lists = rq.teacher_rows.tolist()
    beams = beam_rows.tolist()
    n_neg = 0
    for g in range(Q):
        pos, top = rq.positives[g], teacher_lists[g]
        cands = list(dict.fromkeys([*pos, *top]))
        # positives for the margin loss: labelled / source ads and the teacher's favourite
        positive[g, :len(cands)] = torch.tensor([r in pos or r == top[0] for r in cands])
        fresh = [r for r in dict.fromkeys(beams[g]) if r >= 0 and r not in cands][:config.negatives]
        n_neg += len(fresh)
        negative[g, len(cands):len(cands) + len(fresh)] = True  # beam outputs the teacher does not rank top-k
        cands = (cands + fresh)[:C]
        rows[g, :len(cands)] = torch.tensor(cands)
    mask = rows >= 0
    safe = torch.where(mask, rows, rows[:, :1])  # padding slots repeat the first candidate (a real sequence)
    cos = torch.einsum("qcd,qd->qc", rq.ad_emb[safe], rq.q_emb)  # [Q, C]
    is_label = torch.zeros(Q, C, dtype=torch.bool)
    for g, pos in enumerate(rq.positives):
        is_label[g, :len(dict.fromkeys(pos))] = True  # positives come first in every group
    top_cos = cos.masked_fill(~mask, -2.0).max(1, keepdim=True).values
    teacher = torch.where(is_label, top_cos.expand_as(cos), cos) / config.temperature
    # one example per slot, group-major: prompt(g) + target(candidate); once per mining
    grp = torch.arange(Q).repeat_interleave(C).tolist()   # [Q*C] group of each row
    cand = safe.reshape(-1).tolist()                      # [Q*C] ad row of each row
    examples = build_prompted([rq.prompts[g] for g in grp], [rq.targets[r] for r in cand], ExampleKind.RETRIEVAL, cand)
    n_cand = mask.sum(1).float()
    stats = {"groups": Q, "candidates_per_group": round(float(n_cand.mean()), 3),
             "beam_negatives_per_group": round(n_neg / max(1, Q), 3)}
    return RankGroups(examples, rows, mask, teacher.float(), positive & mask, negative & mask,
                      int(examples.lengths.max()), stats)


def mine_beams(model: Any, rq: RankQueries, config: RankLossConfig) -> torch.Tensor:
    """The model's top ``config.negatives`` ads per ranking query by trie-constrained beam search
    (int64 ``[Q, negatives]``, -1 padding; CPU). The caller sets eval mode / no_grad / autocast."""
    from adbatch.decoding import FusionMode, TargetSearchConfig, VerifyMode, search_targets

    if config.negatives == 0:
        return torch.full((len(rq), 0), -1, dtype=torch.int64)
    # verify off: no cost-model calibration, plain beam search (the negatives need not be exact top-k)
    search = TargetSearchConfig(fusion=FusionMode.GENERATIVE, verify=VerifyMode.OFF, top_k=config.negatives,
                                num_beams=max(config.num_beams or config.negatives, config.negatives))
    res = search_targets(model, rq.prompts, rq.trie, search, batch_size=config.mine_batch)
    return res.rows.long()


def rank_batch(groups: RankGroups, picks: torch.Tensor, pad_id: int) -> tuple[Any, torch.Tensor, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor]:
    """The rank micro-batch of groups ``picks`` (int64 ``[G]``): a padded Batch of ``G * C`` rows, right-padded
    to ``groups.max_len``, and the groups' ``mask`` / ``teacher`` / ``positive`` / ``negative`` (``[G, C]``)."""
    from adbatch.training.data import collate

    C = groups.rows.shape[1]
    idx = (picks[:, None] * C + torch.arange(C)[None, :]).reshape(-1)  # [G*C]
    b = collate(groups.examples, idx, pad_id, pad_to=groups.max_len)  # one shape for every rank micro-batch
    return b, groups.mask[picks], groups.teacher[picks], groups.positive[picks], groups.negative[picks]


def group_loss(student: torch.Tensor, mask: torch.Tensor, teacher: torch.Tensor, positive: torch.Tensor,
               negative: torch.Tensor, config: RankLossConfig,
               student_temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The configured loss of one rank micro-batch (all ``[G, C]``; float32 scalar). ``student_temperature``:
    the listwise loss's (learned) student temperature; the margin loss, in summed log-prob, ignores it."""
    if config.mode is RankLossMode.LISTWISE_KL:
        return listwise_kl_loss(student, teacher.to(student.device), mask.to(student.device), student_temperature)
    return margin_loss(student, positive.to(student.device), negative.to(student.device), config.margin)


def spans_of(texts: Sequence[str], pseudo_queries: Any) -> list[tuple[str, int]]:
    """The span pseudo-queries the training examples hold (none when the source is generated only)."""
    from adbatch.training.pseudo_queries import QuerySource, span_pseudo_queries

    if pseudo_queries.per_ad == 0 or pseudo_queries.source is QuerySource.GENERATED:
        return []
    return span_pseudo_queries(list(texts), pseudo_queries)
