"""Ids from a query-aligned embedding: tune the sentence encoder on labelled queries before the index clusters.

The semantic ids are paths of a hierarchical k-means over the ads' vectors, so the ids the generative channel
must learn are only as query-shaped as those vectors. Off the shelf (all-MiniLM-L6-v2) they group ads by how
their titles read, not by which queries find them. Tmall's CQ-SID, Kuaishou's OneSug and Spotify's semantic ids
all build ids from a query-item contrastively tuned encoder instead; this module is that step for the index
stage:

- **Both towers, one encoder.** A copy of the index's encoder is fine-tuned on the labelled (query, ad) pairs of
  the train split: each query against the ads of its batch (in-batch negatives; the ad side is the same encoder
  reading the ad's embedding text, with gradients), cross-entropy of ``softmax(cos / temperature)`` against the
  uniform distribution over the query's relevant ads in the batch. One encoder embeds queries *and* ads, so the
  index's dense channel, its clusters and its ids all live in the tuned space.
- **Kept only when it helps**: with validation pairs the tuned encoder must beat the base encoder's
  recall@10 on them (each with its own ad vectors: the whole catalogue is embedded by both); without
  validation pairs it is kept as trained.
- **Stable ids**: an incremental build (``--previous``) never re-tunes: it embeds with the encoder the earlier
  index kept (:func:`adbatch.index.build.stable_start`), so unchanged ads keep their ids and the kept clusters'
  centroids stay in the space they were made in. A full build tunes anew.
- A corpus that brings its own ``embedding`` column is not tuned (the index has no encoder of those vectors);
  the train stage can still tune the *query* side against them (:mod:`adbatch.training.query_tuning`).

The tuned folder is kept in the index as :data:`adbatch.index.dense.INDEX_EMBEDDER_DIR`; the manifest's
``dense.query_embedder`` names it (:data:`adbatch.index.dense.INDEX_EMBEDDER`) and ``embedder_tuning`` holds the
record (queries, steps, validation recall of both encoders, loss curve, seconds).

Measured (bench/RESULTS.md, "Ids from the tuned embedding"): see there for Home Depot 5k.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from adbatch.config import ConfigBase, ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EmbedderTuneConfig(ConfigBase):
    """How the index stage tunes its encoder on labelled queries before clustering (see the module docstring)."""

    # lr 2e-5 / 2 epochs / in-batch negatives: Home Depot 5k, CPU (issue 41's probe): test recall@10 0.674 -> 0.750
    enabled: bool = dataclasses.field(default=True, metadata={
        "help": "tune the encoder on the labelled queries (--queries) before embedding the ads; without "
                "enough labelled queries nothing is tuned"})
    epochs: float = dataclasses.field(default=2.0, metadata={"help": "passes over the labelled queries"})
    lr: float = dataclasses.field(default=2e-5, metadata={"help": "AdamW peak learning rate (10 % warm-up, linear decay)"})
    batch_size: int = dataclasses.field(default=64, metadata={"help": "queries (and their ads) per step"})
    temperature: float = dataclasses.field(default=0.05, metadata={"help": "softmax temperature over cosines"})
    min_queries: int = dataclasses.field(default=32, metadata={
        "help": "fewer distinct labelled queries of indexed ads than this: no tuning"})
    seed: int = dataclasses.field(default=0, metadata={"help": "shuffling, positive sampling and dropout"})

    def validate(self) -> None:
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise ConfigError(f"EmbedderTuneConfig.epochs must be finite and > 0, got {self.epochs}")
        for name in ("lr", "temperature"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"EmbedderTuneConfig.{name} must be finite and > 0, got {v}")
        if self.batch_size < 2:
            raise ConfigError(f"EmbedderTuneConfig.batch_size must be >= 2 (in-batch negatives), got {self.batch_size}")
        if self.min_queries < 1:
            raise ConfigError(f"EmbedderTuneConfig.min_queries must be >= 1, got {self.min_queries}")


@dataclasses.dataclass
class TunedEmbedding:
    """What :func:`tune_embedder` leaves: ``embeddings`` ``float32 [N, D]`` (the ads' vectors the index clusters,
    corpus row order), ``folder`` (the kept tuned encoder, or None: ``embeddings`` are the base encoder's) and
    ``record`` (for the manifest; None when tuning did not run)."""

    embeddings: np.ndarray
    folder: Path | None
    record: dict[str, Any] | None


def query_rows(ad_ids: Sequence[Hashable], pairs: Sequence[tuple[str, Hashable]]) -> tuple[list[str], list[list[int]]]:
    """Distinct queries of ``pairs`` (query, ad_id), sorted, each with the corpus rows of its ads (pairs naming an
    ad the corpus does not hold are dropped)."""
    row_of = {a: r for r, a in enumerate(ad_ids)}
    rows: dict[str, set[int]] = {}
    for q, a in pairs:
        r = row_of.get(a)
        if r is not None and q:
            rows.setdefault(str(q), set()).add(r)
    queries = sorted(rows)
    return queries, [sorted(rows[q]) for q in queries]


def recall_at_10(query_emb: Any, ad_emb: Any, rows: Sequence[Sequence[int]]) -> float:
    """Mean recall@10 of exact inner-product search: ``query_emb`` ``[Q, D]`` and ``ad_emb`` ``[N, D]`` (both
    unit rows; numpy arrays or torch tensors, on one device), ``rows``: each query's relevant ad rows."""
    import torch

    from adbatch.eval.metrics import recall_at_k

    if not len(rows):
        return float("nan")
    q, a = torch.as_tensor(query_emb), torch.as_tensor(ad_emb)
    top = (q @ a.T).topk(min(10, a.shape[0]), dim=1)
    return float(np.mean([recall_at_k(t, set(r), 10) for t, r in zip(top.indices.tolist(), rows)]))


def tune_embedder(texts: Sequence[str], ad_ids: Sequence[Hashable], labelled: Sequence[tuple[str, Hashable]],
                  valid: Sequence[tuple[str, Hashable]], config: EmbedderTuneConfig, base_folder: Path,
                  out_dir: Path, embed: Callable[[Path], np.ndarray], device: str = "cpu",
                  max_seq_length: int = 128, progress: bool = False) -> TunedEmbedding:
    """The ads' vectors the index should cluster, from a tuned copy of the encoder at ``base_folder`` when the
    labelled queries allow it and (with ``valid``) it beats the base.

    ``texts``: each ad's embedding text (corpus row order, what :meth:`Corpus.embedding_inputs` gives);
    ``ad_ids``: the corpus's ids in the same order; ``labelled`` / ``valid``: (query, ad_id) pairs of the train /
    validation splits; ``embed(folder) -> float32 [N, D]`` embeds every ad with the encoder in ``folder`` (the
    caller's way: in-process, or on Ray's actors); ``out_dir``: where a kept tuned encoder is saved (a
    sentence-transformers folder; removed again when it is not kept); ``device``: where the encoder trains;
    ``max_seq_length``: word pieces it reads (the index's ``EmbeddingConfig.max_seq_length``).
    """
    import shutil

    import torch

    from adbatch.index.sentence_encoder import open_sentence_encoder

    config.validate()
    queries, rows = query_rows(ad_ids, labelled)
    if not config.enabled or len(queries) < config.min_queries:
        if config.enabled:
            log.info("index: encoder not tuned: %d labelled queries of indexed ads (< min_queries %d)",
                     len(queries), config.min_queries)
        return TunedEmbedding(embed(base_folder), None, None)
    t0 = time.perf_counter()
    v_queries, v_rows = query_rows(ad_ids, valid)
    # the base's vectors only matter to the gate (and as its fallback): without validation queries the tuned
    # encoder is kept, and a catalogue-wide embedding pass would be wasted
    base_emb = embed(base_folder) if v_queries else None
    model = open_sentence_encoder(base_folder, device)
    model.max_seq_length = max_seq_length  # as the index embeds the ads (EmbeddingConfig.max_seq_length)
    base_valid = recall_at_10(_encode(model, v_queries), base_emb, v_rows) if v_queries else float("nan")
    with torch.random.fork_rng(devices=[torch.device(device)] if str(device).startswith("cuda") else []):
        torch.manual_seed(config.seed)  # dropout: the same corpus and queries tune the same encoder
        curve, steps = _train(model, list(texts), queries, rows, config, progress)
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save(str(out_dir))
    tuned_emb = embed(out_dir)
    tuned_valid = recall_at_10(_encode(model, v_queries), tuned_emb, v_rows) if v_queries else None
    kept = not v_queries or tuned_valid > base_valid
    record = {"queries": len(queries), "valid_queries": len(v_queries), "steps": steps, "kept": kept,
              "valid_recall@10": {"base": round(base_valid, 4) if v_queries else None,
                                  "tuned": round(tuned_valid, 4) if tuned_valid is not None else None},
              "loss_curve": curve, "seconds": round(time.perf_counter() - t0, 2), "config": config.to_dict()}
    if not kept:
        log.warning("index: tuned encoder not kept: validation recall@10 %.4f <= base %.4f", tuned_valid, base_valid)
        shutil.rmtree(out_dir, ignore_errors=True)
        return TunedEmbedding(base_emb, None, record)
    log.info("index: encoder tuned on %d queries in %.1f s (validation recall@10 %s -> %s)", len(queries),
             record["seconds"], record["valid_recall@10"]["base"], record["valid_recall@10"]["tuned"])
    return TunedEmbedding(tuned_emb, out_dir, record)


def _encode(model: Any, texts: list[str]) -> np.ndarray:
    import torch

    with torch.inference_mode():
        v = model.encode(texts, batch_size=256, convert_to_numpy=True, normalize_embeddings=True,
                         show_progress_bar=False)
    return np.ascontiguousarray(v, dtype=np.float32)


def tune_steps(model: Any, n: int, *, epochs: float, batch_size: int, lr: float, seed: int,
               batch_loss: Callable[[list[int], random.Random], Any], desc: str,
               progress: bool = False) -> tuple[list[float], int]:
    """The training loop the encoder tunings share (this module's and :mod:`adbatch.training.query_tuning`'s):
    ``ceil(epochs * ceil(n / batch_size))`` AdamW steps at ``lr`` (10 % linear warm-up, then linear decay); each
    epoch shuffles ``range(n)`` (a ``random.Random(seed)``) and cuts it into batches; ``batch_loss(batch, rng)``
    returns the batch's scalar loss (``rng`` is the loop's, for any sampling the loss does). Trains ``model`` in
    place and leaves it in eval mode; returns (a ~20-point loss curve, steps)."""
    import torch

    rng = random.Random(seed)
    total = max(1, math.ceil(epochs * math.ceil(n / batch_size)))
    warm = max(1, total // 10)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1 - s / total))
    order = list(range(n))
    losses: list[Any] = []
    model.train()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit="step")
    while len(losses) < total:
        rng.shuffle(order)
        for start in range(0, n, batch_size):
            if len(losses) >= total:
                break
            loss = batch_loss(order[start:start + batch_size], rng)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    model.eval()
    return [round(float(x), 4) for x in torch.stack(losses).cpu()[:: max(1, len(losses) // 20)]], total


def _train(model: Any, texts: list[str], queries: list[str], rows: list[list[int]], config: EmbedderTuneConfig,
           progress: bool) -> tuple[list[float], int]:
    """In-batch-negative training of ``model`` in place; returns (a 20-point loss curve, steps)."""
    import torch
    import torch.nn.functional as F
    from sentence_transformers.util import batch_to_device

    device = model.device
    preprocess = getattr(model, "preprocess", None) or model.tokenize

    def batch_loss(batch: list[int], rng: random.Random) -> Any:
        # one sampled positive per query feeds the ad side; every relevant ad that lands in the batch is a
        # target (not a negative) of its query
        ads = list(dict.fromkeys(rng.choice(rows[i]) for i in batch))                      # U distinct rows
        col = {r: j for j, r in enumerate(ads)}
        q = F.normalize(model(batch_to_device(preprocess([queries[i] for i in batch]), device))
                        ["sentence_embedding"].float(), dim=-1)                            # [B, D]
        a = F.normalize(model(batch_to_device(preprocess([texts[r] for r in ads]), device))
                        ["sentence_embedding"].float(), dim=-1)                            # [U, D]
        target = torch.zeros(len(batch), len(ads), device=device)                          # [B, U]
        for b, i in enumerate(batch):
            hits = [col[r] for r in rows[i] if r in col]
            target[b, hits] = 1.0 / len(hits)
        return -(target * F.log_softmax(q @ a.T / config.temperature, dim=1)).sum(1).mean()

    return tune_steps(model, len(queries), epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                      seed=config.seed, batch_loss=batch_loss, desc="tune index encoder", progress=progress)
