"""Tune the dense channel's query embedder on the train stage's queries (issue 41).

The index's dense channel answers a query by the cosine of its embedding with every ad's stored vector
(:class:`adbatch.index.dense.DenseRetriever`). Off the shelf, the query embedder (all-MiniLM-L6-v2) has never
seen this catalogue's queries: on Home Depot 5k it ranks 67 % of the relevant ads into the top 10. The train
stage already holds what teaches it the catalogue's language: the labelled (query, ad) pairs of the train
split. This module fine-tunes a copy of the query embedder on them, against the index's ad vectors, which
stay as they are:

- **Only the query tower moves.** The ads keep the vectors the index clustered (no catalogue re-embedding,
  the trie's clusters stay consistent with the dense space, and an index built from the corpus's own
  embeddings with a configured query embedder can be tuned the same way).
- **Loss**: per query, the cross-entropy between the softmax of ``cos(q, ad) / temperature`` over the whole
  catalogue (every ad a negative, exact: ``[B, N]`` logits per step; catalogues above
  :attr:`QueryTuneConfig.max_softmax_ads` use that many uniformly sampled negatives per step) and the uniform
  distribution over the query's relevant ads.
- **Kept only when it helps**: with validation queries, the tuned embedder is kept only if its recall@10 on
  them beats the base embedder's (both measured here, stored in the record); without validation queries it
  is kept as trained.

Measured (bench/RESULTS.md, "Two channels"): Home Depot 5k, 2,166 training queries, CPU: test recall@10
0.674 -> 0.72 after 3 epochs at lr 1e-4 (valid 0.697 -> 0.753).

The tuned folder is a sentence-transformers folder saved into the model folder as :data:`QUERY_EMBEDDER_DIR`
(and copied into a compressed checkpoint); the training record's ``query_embedder`` entry names it, with the
base embedder's identity (the tuned one only fits the space of the ad vectors its base made).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Sequence

from adbatch.config import ConfigBase, ConfigError
# the index stage's encoder tuning shares these: the queries' ad rows, recall@10, the training loop
from adbatch.index.embedder_tuning import query_rows as query_targets
from adbatch.index.embedder_tuning import recall_at_10, tune_steps

log = logging.getLogger(__name__)

QUERY_EMBEDDER_DIR = "query_embedder"  #: the tuned query embedder's folder inside a model folder


@dataclass
class QueryTuneConfig(ConfigBase):
    """How the train stage tunes the dense channel's query embedder (see the module docstring)."""

    # lr 1e-4, 3 epochs, temperature 0.05: the best of the CPU sweep on Home Depot 5k (validation 0.753; lr 3e-5:
    # 0.754 valid but 0.710 test vs 0.720)
    enabled: bool = field(default=True, metadata={
        "help": "fine-tune the query embedder on the labelled queries (needs the index's dense channel)"})
    epochs: float = field(default=3.0, metadata={"help": "passes over the tuning queries"})
    lr: float = field(default=1e-4, metadata={"help": "AdamW peak learning rate (10 % warm-up, linear decay)"})
    batch_size: int = field(default=64, metadata={"help": "queries per optimizer step"})
    temperature: float = field(default=0.05, metadata={"help": "softmax temperature over cosines"})
    min_queries: int = field(default=32, metadata={
        "help": "fewer labelled queries than this: tune on span pseudo-queries instead (no_labels)"})
    # spans: Home Depot 5k with its labels withheld, 2 spans per ad, 1 epoch: validation recall@10 0.697 -> 0.730
    no_labels: str = field(default="spans", metadata={
        "help": "fewer than min_queries labelled queries: spans (tune on span pseudo-queries of the ads' texts, "
                "gated on held-out spans when there are no validation queries) | skip"})
    spans_per_ad: int = field(default=2, metadata={"help": "span pseudo-queries per ad when tuning without labels"})
    max_softmax_ads: int = field(default=1 << 20, metadata={
        "help": "catalogues above this many ads: that many sampled negatives per step instead of all ads"})
    max_seq_length: int = field(default=64, metadata={"help": "query tokens the embedder reads while tuning"})
    seed: int = field(default=0, metadata={"help": "shuffling and negative sampling"})

    def validate(self) -> None:
        if not self.epochs > 0:
            raise ConfigError(f"QueryTuneConfig.epochs must be > 0, got {self.epochs}")
        if not self.lr > 0 or not self.temperature > 0:
            raise ConfigError("QueryTuneConfig.lr and .temperature must be > 0")
        if self.no_labels not in ("spans", "skip"):
            raise ConfigError(f"QueryTuneConfig.no_labels must be spans or skip, got {self.no_labels!r}")
        if self.spans_per_ad < 1:
            raise ConfigError(f"QueryTuneConfig.spans_per_ad must be >= 1, got {self.spans_per_ad}")
        if self.batch_size < 1 or self.min_queries < 1 or self.max_softmax_ads < 2 or self.max_seq_length < 4:
            raise ConfigError("QueryTuneConfig: batch_size, min_queries >= 1, max_softmax_ads >= 2, "
                              "max_seq_length >= 4")


def span_pairs(index_ad_ids: Sequence[Hashable], texts: Sequence[str], per_ad: int, seed: int,
               max_ads: int | None = None) -> list[tuple[str, Hashable]]:
    """(span pseudo-query, ad_id) pairs: ``per_ad`` word spans of each ad's text (``texts`` in index row order;
    :func:`adbatch.training.pseudo_queries.span_pseudo_queries`), over every ad or ``max_ads`` spread evenly."""
    from adbatch.training.pseudo_queries import PseudoQueryConfig, span_pseudo_queries

    rows = list(range(len(texts)))
    if max_ads is not None and len(rows) > max_ads:
        rows = rows[:: len(rows) // max_ads][:max_ads]
    spans = span_pseudo_queries([texts[r] for r in rows], PseudoQueryConfig(per_ad=per_ad, seed=seed))
    return [(q, index_ad_ids[rows[i]]) for q, i in spans]


def tuning_pairs(index_ad_ids: Sequence[Hashable], texts: Sequence[str], labelled: Sequence[tuple[str, Hashable]],
                 valid: Sequence[tuple[str, Hashable]], config: QueryTuneConfig
                 ) -> tuple[list[tuple[str, Hashable]], list[tuple[str, Hashable]], str]:
    """What the tuning trains and is gated on: ``(train pairs, validation pairs, source)``. Enough labelled
    queries: those and ``valid``; else (``no_labels = spans``) span pseudo-queries of ``texts`` (index row order),
    gated on ``valid`` or, with none, on one held-out span (another seed) of up to 256 ads; else nothing."""
    if len({q for q, _ in labelled}) >= config.min_queries:
        return list(labelled), list(valid), "labelled"
    if config.no_labels == "skip":
        return [], [], "none"
    pairs = span_pairs(index_ad_ids, texts, config.spans_per_ad, config.seed)
    held = list(valid) or span_pairs(index_ad_ids, texts, 1, config.seed + 1, max_ads=256)
    return pairs, held, "spans"


def _recall_at_10(embedder: Any, queries: list[str], rows: list[list[int]], ads: Any, batch_size: int) -> float:
    """recall@10 of ``embedder``'s vectors of ``queries`` against ``ads`` (``[N, D]`` unit rows, on their device)."""
    import torch

    if not queries:
        return float("nan")
    with torch.inference_mode():
        q = embedder.encode(queries, batch_size=batch_size, convert_to_tensor=True, normalize_embeddings=True,
                            show_progress_bar=False).to(ads.device, ads.dtype)
    return recall_at_10(q, ads, rows)


def tune_query_embedder(dense: Any, labelled: Sequence[tuple[str, Hashable]], config: QueryTuneConfig, out_dir: Path,
                        valid: Sequence[tuple[str, Hashable]] = (), progress: bool = False) -> dict[str, Any] | None:
    """Fine-tune a copy of ``dense``'s query embedder on ``labelled`` (query, ad_id) pairs against the index's
    ad vectors; save it to ``out_dir`` (a sentence-transformers folder) and return the record entry, or None
    when there is nothing to tune on, or the tuned embedder does not beat the base on ``valid`` (validation
    (query, ad_id) pairs). ``dense``: a :class:`adbatch.index.dense.DenseRetriever` whose query embedder is a
    real model (its ``identity`` names the folder); the tuning runs on its device.
    """
    import torch

    from adbatch.index.embeddings import open_sentence_encoder

    config.validate()
    t0 = time.perf_counter()
    queries, rows = query_targets(dense.ad_ids, labelled)
    if len(queries) < config.min_queries:
        log.info("query embedder not tuned: %d labelled queries (< min_queries %d)", len(queries), config.min_queries)
        return None
    v_queries, v_rows = query_targets(dense.ad_ids, valid)
    model = open_sentence_encoder(dense.embedder_path, dense.device)
    with torch.random.fork_rng(devices=[dense.device] if dense.device.type == "cuda" else []):
        torch.manual_seed(config.seed)  # dropout: the same run tunes the same embedder, the caller's RNG untouched
        return _tune(model, queries, rows, v_queries, v_rows, dense, config, out_dir, progress, t0)


def _tune(model: Any, queries: list[str], rows: list[list[int]], v_queries: list[str], v_rows: list[list[int]],
          dense: Any, config: QueryTuneConfig, out_dir: Path, progress: bool, t0: float) -> dict[str, Any] | None:
    import torch
    import torch.nn.functional as F
    from sentence_transformers.util import batch_to_device

    from adbatch.index.dense import embedder_identity

    device = dense.device
    model.max_seq_length = config.max_seq_length
    ads = dense.matrix.float()                                                # [N, D] fp32, unit rows
    base_valid = _recall_at_10(model, v_queries, v_rows, ads, config.batch_size)
    gen = torch.Generator().manual_seed(config.seed)
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    n_ads = ads.shape[0]
    sampled = n_ads > config.max_softmax_ads

    def batch_loss(batch: list[int], _rng: Any) -> Any:
        feats = batch_to_device(preprocess([queries[i] for i in batch]), device)
        q = F.normalize(model(feats)["sentence_embedding"].float(), dim=-1)                # [B, D]
        pos_rows = [rows[i] for i in batch]
        if sampled:
            neg = torch.randint(n_ads, (config.max_softmax_ads,), generator=gen)
            pos = torch.tensor(sorted({r for rs in pos_rows for r in rs}))
            cand = torch.cat([pos, neg[~torch.isin(neg, pos)]]).to(device)             # [C]
            col = {int(r): j for j, r in enumerate(pos.tolist())}
            logits = q @ ads[cand].T / config.temperature                                # [B, C]
            pos_rows = [[col[r] for r in rs] for rs in pos_rows]
        else:
            logits = q @ ads.T / config.temperature                                      # [B, N]
        target = torch.zeros_like(logits)
        b_idx = torch.tensor([b for b, rs in enumerate(pos_rows) for _ in rs], device=device)
        r_idx = torch.tensor([r for rs in pos_rows for r in rs], device=device)
        w = torch.tensor([1.0 / len(rs) for rs in pos_rows for _ in rs], device=device)
        target[b_idx, r_idx] = w
        return -(target * F.log_softmax(logits, dim=1)).sum(1).mean()

    loss_curve, total = tune_steps(model, len(queries), epochs=config.epochs, batch_size=config.batch_size,
                                   lr=config.lr, seed=config.seed, batch_loss=batch_loss,
                                   desc="tune query embedder", progress=progress)
    tuned_valid = _recall_at_10(model, v_queries, v_rows, ads, config.batch_size)
    record = {"dir": QUERY_EMBEDDER_DIR, "base": dict(dense.identity), "queries": len(queries),
              "valid_queries": len(v_queries), "steps": total, "config": config.to_dict(),
              "valid_recall@10": {"base": round(base_valid, 4), "tuned": round(tuned_valid, 4)},
              "loss_curve": loss_curve, "seconds": round(time.perf_counter() - t0, 2)}
    if v_queries and not tuned_valid > base_valid:
        log.warning("tuned query embedder not kept: validation recall@10 %.4f <= base %.4f", tuned_valid, base_valid)
        return None
    out_dir = Path(out_dir)
    model.save(str(out_dir))
    record["sha256"] = embedder_identity(str(out_dir))["sha256"]
    log.info("query embedder tuned on %d queries in %.1f s: validation recall@10 %.4f -> %.4f", len(queries),
             record["seconds"], base_valid, tuned_valid)
    return record
