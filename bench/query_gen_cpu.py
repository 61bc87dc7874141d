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
``python bench/query_gen_cpu.py --smoke``: seconds; a tiny random model on a 24-ad bundle of example titles.
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


def smoke_bundle(folder: Path) -> Path:
    """The files this script reads from a bundle, for 24 example ads: titles, a labelled query per ad (its title's
    first two words), and empty held-out qrels."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(Path(__file__).resolve().parents[1] / "examples" / "slogan_ads.parquet", columns=["title"]).slice(0, 24)
    titles = t.column("title").to_pylist()
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"ad_id": list(range(len(titles))), "title": titles}), folder / "titles_5000.parquet")
    pq.write_table(pa.table({"query": [" ".join(x.split()[:2]) for x in titles], "ad_id": list(range(len(titles)))}),
                   folder / "train_5000.parquet")
    for split in ("test", "valid"):
        (folder / f"qrels_{split}_5000.json").write_text("{}")
    return folder


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="bench/train_eval.py prepare's bundle (5000 titles)")
    p.add_argument("--ads", type=int, default=40, help="ads sampled (every 125th of the 5,000)")
    p.add_argument("--per-ad", type=int, default=4, help="queries per ad (spans and generated)")
    p.add_argument("--max-pairs", type=int, default=800, help="train pairs of the short fine-tune")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--train-layers", type=int, default=None)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--smoke", action="store_true",
                   help="plumbing check: a 2-layer random model over the default tokenizer, a 24-ad bundle of example "
                        "titles, 4 ads x 2 queries, a 16-pair fine-tune")
    args = p.parse_args(argv)
    model_src = None
    if args.smoke:
        import tempfile

        from bench.creatives_tune import smoke_model

        work = Path(tempfile.mkdtemp(prefix="query-gen-cpu-smoke-"))
        args.bundle, model_src = str(smoke_bundle(work / "bundle")), str(smoke_model(work / "model"))
        args.ads, args.per_ad, args.max_pairs = 4, 2, 16
    elif not args.bundle:
        p.error("--bundle is required (or --smoke)")
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
    model, tok = load_causal_lm(model_src, dtype=torch.float32, device="cpu")
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
