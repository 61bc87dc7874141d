"""Generated queries vs span pseudo-queries for a sample of Home Depot ads, on the CPU, with the real default
model: what the query generator writes zero-shot (the no-label product path), after a short fine-tune on the
train split, and what spans give, judged by cheap proxies -- not by targeting recall (that needs the GPU
ablation, ``bench/train_eval.py check --query-source``):

- ``round_trip@k``: share of an ad's queries for which MiniLM + exact search over the whole catalogue ranks
  the ad in the top k (the round-trip filter's rule; spans pass it easily, they are the title's own words);
- ``novel_words``: share of query words absent from the ad's title (what spans can never do and labelled
  queries often do: 0 for spans by construction);
- ``label_novel_words``: the same for the labelled train queries of those ads, as the target;
- cleaning counts and a few samples.

``python bench/query_gen_cpu.py --bundle .carry/bundle --ads 40 --per-ad 4 --max-pairs 800`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _novel(queries: list[tuple[str, Any]], titles: dict[Any, str]) -> float:
    from adbatch.training.pseudo_queries import title_words

    words = [(w, set(title_words(titles[a]))) for q, a in queries for w in title_words(q)]
    return sum(w not in t for w, t in words) / max(1, len(words))


def _judge(queries: list[tuple[str, Any]], titles: dict[Any, str], ranker: Any, k: int) -> dict[str, Any]:
    from adbatch.training.query_generation import GeneratedQueries, round_trip_filter

    gen = GeneratedQueries([q for q, _ in queries], [a for _, a in queries], ["-"] * len(queries), {})
    kept = round_trip_filter(gen, ranker)
    return {"queries": len(queries), f"round_trip@{k}": round(len(kept) / max(1, len(queries)), 3),
            "novel_words": round(_novel(queries, titles), 3), "samples": [list(x) for x in queries[:8]]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True, help="bench/train_eval.py prepare's bundle (5000 titles)")
    p.add_argument("--ads", type=int, default=40, help="ads sampled (every 125th of the 5,000)")
    p.add_argument("--per-ad", type=int, default=4, help="queries per ad (spans and generated)")
    p.add_argument("--max-pairs", type=int, default=800, help="train pairs of the short fine-tune")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--train-layers", type=int, default=None)
    p.add_argument("--k", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import pyarrow.parquet as pq
    import torch

    from adbatch.models import load_causal_lm
    from adbatch.training.pseudo_queries import PseudoQueryConfig, span_pseudo_queries
    from adbatch.training.query_generation import (QueryGenConfig, QueryGenTrainConfig, QueryOrigin, generate_queries,
                                                   minilm_ranker, query_pairs, tune_query_generator)

    bundle = Path(args.bundle)
    cat = pq.read_table(bundle / "titles_5000.parquet")
    titles = dict(zip(cat.column("ad_id").to_pylist(), cat.column("title").to_pylist()))
    train = pq.read_table(bundle / "train_5000.parquet")
    labelled = list(zip(train.column("query").to_pylist(), train.column("ad_id").to_pylist()))
    held = [*json.loads((bundle / "qrels_test_5000.json").read_text()),
            *json.loads((bundle / "qrels_valid_5000.json").read_text())]
    ids = list(titles)
    step = max(1, len(ids) // args.ads)
    sample = ids[::step][:args.ads]
    t0 = time.perf_counter()
    ranker = minilm_ranker(ids, [titles[a] for a in ids], args.k)
    out: dict[str, Any] = {"ads": len(sample), "catalogue": len(ids), "minilm_catalogue_s": round(time.perf_counter() - t0, 1)}
    spans = span_pseudo_queries([titles[a] for a in sample], PseudoQueryConfig(per_ad=args.per_ad))
    out["spans"] = _judge([(q, sample[r]) for q, r in spans], titles, ranker, args.k)
    mine = [(q, a) for q, a in labelled if a in set(sample)]
    out["labelled_train_queries_of_these_ads"] = {"queries": len(mine), "novel_words": round(_novel(mine, titles), 3)}
    cfg = QueryGenConfig(queries_per_ad=args.per_ad, max_pairs=args.max_pairs, train_layers=args.train_layers,
                         train=QueryGenTrainConfig(epochs=args.epochs))
    model, tok = load_causal_lm(None, dtype=torch.float32, device="cpu")
    for name in ("zero_shot", "tuned"):
        if name == "tuned":
            pairs = query_pairs(labelled, titles, exclude_queries=held, max_pairs=cfg.max_pairs, seed=cfg.seed)
            out["fine_tune"] = tune_query_generator(model, tok, pairs, cfg, device="cpu", progress=False)
        t0 = time.perf_counter()
        gen = generate_queries(model, tok, sample, titles, cfg, origin=QueryOrigin(name), progress=False)
        out[name] = {**_judge(gen.pairs(), titles, ranker, args.k), "clean": gen.stats,
                     "generate_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
