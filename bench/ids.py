"""Ad-id designs measured without a trained model (issue 17 item 3): ``codes`` (hierarchical k-means,
one token per (level, index)), ``text`` (cluster labels + ad text) and ``rq`` (residual k-means codes
rendered as code tokens), on the same MiniLM embeddings of a Home Depot catalogue. CPU only.

Per scheme: build seconds (``build_index`` over the precomputed vectors: cluster + render + trie +
write), tokens added to the vocabulary, sequence length (mean / max), trie nodes per ad, ads whose
code collides before the disambiguation level (RQ; the hierarchy's leaves never collide), ads whose
final sequence equals another ad's (``text``: equal titles in one leaf), and a learnability proxy: each labelled test query is embedded with the same MiniLM and given a code the
way the ads got theirs (nearest centroid per level for RQ; nearest child cluster, by the mean of its
ads, at each level of the hierarchy), and ``prefix@d`` is the share of queries whose first ``d``
code entries equal those of at least one relevant ad (grade >= 2.67).

    .venv/bin/python bench/ids.py embed --catalogue 5000        # MiniLM, cached under --work
    .venv/bin/python bench/ids.py measure --catalogue 5000 [--rq-levels 3 --rq-codebook 256]
    .venv/bin/python bench/ids.py --smoke     # CPU, seconds: 240 example ads, random vectors, every design
    .venv/bin/python bench/ids.py agreement --index B/index_5000_text_tuned --query-emb B/query_emb_5000_tuned.npz \
        --qrels B/qrels_test_5000.json   # prefix@d of a built index (ids from a tuned encoder vs MiniLM's)

``--catalogue 5000``: the titles and test qrels of the bundle (``.carry/bundle``); ``all``: the 54,667
products of ``../shared/data/home_depot_relevance/train.csv`` and their test qrels (adbatch.eval.datasets).
Embeddings are computed once per catalogue (resumable, by chunks of 1,000 titles) under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
BUNDLE = REPO / ".carry" / "bundle"
HOME_DEPOT = REPO.parent / "shared" / "data" / "home_depot_relevance" / "train.csv"
CHUNK = 1000
SMOKE_ADS = 240

log = logging.getLogger("bench.ids")


def load_catalogue(name: str) -> tuple[list[int], list[str], dict[str, dict[int, float]]]:
    """(ad ids, titles, test qrels ``{query: {ad_id: grade}}``) of a catalogue."""
    if name == "smoke":  # the example corpus's first ads; each query is an ad's first title word
        import pyarrow.parquet as pq

        table = pq.read_table(REPO / "examples" / "slogan_ads.parquet", columns=["ad_id", "title"]).slice(0, SMOKE_ADS)
        ids, titles = list(range(table.num_rows)), table.column("title").to_pylist()  # int ids, as Home Depot's
        return ids, titles, {f"{t.split()[0]} {i}": {a: 3.0} for i, (a, t) in enumerate(zip(ids[:20], titles))}
    if name == "5000":
        import pyarrow.parquet as pq

        table = pq.read_table(BUNDLE / "titles_5000.parquet")
        qrels = json.loads((BUNDLE / "qrels_test_5000.json").read_text())
        return (table.column("ad_id").to_pylist(), table.column("title").to_pylist(),
                {q: {int(a): g for a, g in grades.items()} for q, grades in qrels.items()})
    from adbatch.eval.datasets import HomeDepotConfig, QuerySplit, load_home_depot

    data = load_home_depot(HomeDepotConfig(csv_path=HOME_DEPOT, catalogue_size=None))
    return (data.catalogue.column("ad_id").to_pylist(), data.catalogue.column("title").to_pylist(),
            data.qrels[QuerySplit.TEST])


def embed_cached(texts: list[str], folder: Path, limit: int | None = None) -> tuple[np.ndarray, dict]:
    """``float32 [len(texts), 384]`` MiniLM vectors (the index stage's embedder and config), computed
    by chunks of :data:`CHUNK` saved under ``folder`` so an interrupted run resumes. ``limit``: embed
    only the first chunks up to that many texts (the timing probe). Returns (vectors so far, timing)."""
    from adbatch.index.embeddings import EmbeddingConfig, embed_texts, load_embedder

    folder.mkdir(parents=True, exist_ok=True)
    cfg = EmbeddingConfig()
    model = None
    stats = {"embedded_now": 0, "seconds_now": 0.0}
    end = len(texts) if limit is None else min(limit, len(texts))
    parts = []
    for start in range(0, end, CHUNK):
        part = folder / f"{start:06d}.npy"
        if not part.is_file():
            if model is None:
                model = load_embedder(cfg)
            t0 = time.perf_counter()
            vec = embed_texts(texts[start:start + CHUNK], cfg, model=model)
            stats["seconds_now"] += time.perf_counter() - t0
            stats["embedded_now"] += vec.shape[0]
            np.save(part, vec, allow_pickle=False)
            log.info("%s: %d/%d embedded (%.1f texts/s, load %.1f)", folder.name, start + vec.shape[0],
                     len(texts), stats["embedded_now"] / stats["seconds_now"], os.getloadavg()[0])
        parts.append(np.load(part, allow_pickle=False))
    stats["texts_per_s"] = round(stats["embedded_now"] / max(stats["seconds_now"], 1e-9), 1)
    return np.concatenate(parts) if parts else np.zeros((0, 384), np.float32), stats


def cmd_embed(args: argparse.Namespace) -> None:
    ids, titles, qrels = load_catalogue(args.catalogue)
    work = Path(args.work) / args.catalogue
    queries = sorted(qrels)
    qvec, qstats = embed_cached(queries, work / "queries")
    tvec, tstats = embed_cached(titles, work / "titles", limit=args.limit)
    print(json.dumps({"catalogue": args.catalogue, "titles": len(titles), "embedded": tvec.shape[0],
                      "queries": qvec.shape[0], "titles_timing": tstats, "queries_timing": qstats,
                      "load": round(os.getloadavg()[0], 1)}))


def write_corpus(work: Path, ids: list[int], titles: list[str], emb: np.ndarray) -> Path:
    """The catalogue with its vectors as an ``embedding`` column (so the index stage skips MiniLM)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = work / "corpus.parquet"
    pq.write_table(pa.table({
        "ad_id": pa.array(ids, pa.int64()), "title": pa.array(titles, pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), emb.shape[1]),
    }), path)
    return path


def hierarchy_paths(ad_emb: np.ndarray, ad_paths: list[tuple[int, ...]], q_emb: np.ndarray
                    ) -> list[tuple[int, ...]]:
    """Each query's cluster path: from the root, the nearest child cluster (L2 to the mean of its ads'
    vectors, as ``update_hierarchy`` places a new ad) until a leaf. ``ad_paths``: each ad's cluster
    path (its code without the leaf position)."""
    sums: dict[tuple[int, ...], np.ndarray] = {}
    counts: dict[tuple[int, ...], int] = {}
    children: dict[tuple[int, ...], set[int]] = {}
    for row, path in enumerate(ad_paths):
        for d in range(1, len(path) + 1):
            sums[path[:d]] = sums.get(path[:d], 0.0) + ad_emb[row].astype(np.float64)
            counts[path[:d]] = counts.get(path[:d], 0) + 1
            children.setdefault(path[:d - 1], set()).add(path[d - 1])
    out = []
    for q in q_emb:
        node: tuple[int, ...] = ()
        while node in children:
            kids = sorted(children[node])
            cent = np.stack([sums[node + (j,)] / counts[node + (j,)] for j in kids])
            node = node + (kids[int(np.argmin(((cent - q) ** 2).sum(axis=1)))],)
        out.append(node)
    return out


def prefix_agreement(q_paths: list[tuple[int, ...]], ad_paths: list[tuple[int, ...]], relevant: list[list[int]],
                     depths: tuple[int, ...]) -> dict[str, float]:
    """``prefix@d``: share of queries whose first ``d`` code entries equal a relevant ad's (rows in
    ``relevant``); ``ads_per_prefix@d``: mean number of ads sharing an ad's first ``d`` entries (how
    far a matched prefix narrows the catalogue)."""
    out: dict[str, float] = {}
    for d in depths:
        hit = [any(ad_paths[r][:d] == qp[:d] for r in rel) for qp, rel in zip(q_paths, relevant)]
        out[f"prefix@{d}"] = round(float(np.mean(hit)), 4)
        size: dict[tuple[int, ...], int] = {}
        for p in ad_paths:
            size[p[:d]] = size.get(p[:d], 0) + 1
        out[f"ads_per_prefix@{d}"] = round(float(np.mean([size[p[:d]] for p in ad_paths])), 1)
    return out


def designs(rq_specs: list[str]) -> list[tuple[str, dict]]:
    """(name, IndexConfig overrides) per id design: codes, text, then one rq per ``L:K`` spec."""
    out = [("codes", {"render": {"scheme": "codes"}}), ("text", {"render": {"scheme": "text"}})]
    for spec in rq_specs:
        levels, k = (int(v) for v in spec.split(":"))
        out.append((f"rq {levels}x{k}", {"render": {"scheme": "codes"},
                                         "cluster": {"method": "residual", "rq_levels": levels, "rq_codebook": k}}))
    return out


def cmd_measure(args: argparse.Namespace) -> list[dict]:
    from adbatch.index.clustering import ClusterMethod, build_codes, residual_encode
    from adbatch.index.build import IndexConfig, build_index, load_index, load_tokenizer
    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT
    from adbatch.index.ids import label_words

    ids, titles, qrels = load_catalogue(args.catalogue)
    work = Path(args.work) / args.catalogue
    emb, _ = embed_cached(titles, work / "titles")
    queries = sorted(qrels)
    q_emb, _ = embed_cached(queries, work / "queries")
    if emb.shape[0] != len(titles):
        raise SystemExit(f"only {emb.shape[0]} of {len(titles)} titles embedded: run `embed` first")
    corpus = write_corpus(work, ids, titles, emb)
    row_of = {a: i for i, a in enumerate(ids)}
    relevant = [[row_of[a] for a, g in qrels[q].items() if g >= HOME_DEPOT_RELEVANT and a in row_of] for q in queries]
    load_tokenizer(None)  # cached: the first design's render time would include loading it
    label_words("warm up")  # and importing scikit-learn's stop words
    rows = []
    for name, overrides in designs(args.rq):
        cfg = IndexConfig.from_dict({"columns": {"text": "title", "embedding": "embedding"}, **overrides})
        out = work / f"index_{name.replace(' ', '_')}"
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        manifest = build_index(corpus, out, cfg, progress=False)
        build_s = time.perf_counter() - t0
        ix = load_index(out)
        seqs = [tuple(s) for s in ix.sequences()]
        lengths = np.array([len(s) for s in seqs])
        seq_count: dict[tuple[int, ...], int] = {}
        for sq in seqs:
            seq_count[sq] = seq_count.get(sq, 0) + 1
        codes = [tuple(c) for c in ix.ad_codes.column("code").to_pylist()]
        if cfg.cluster.method is ClusterMethod.RESIDUAL:
            h = build_codes(emb, cfg.cluster)  # deterministic: the index's own codes, with the codebooks
            assert [tuple(c) for c in h.codes()] == codes, "residual codes differ between two builds"
            ad_paths = [c[:cfg.cluster.rq_levels] for c in codes]
            q_paths = [tuple(c) for c in residual_encode(q_emb, h.codebooks).tolist()]
        else:
            ad_paths = [c[:-1] for c in codes]
            q_paths = hierarchy_paths(emb, ad_paths, q_emb)
        counts = manifest["counts"]
        row = {
            "catalogue": args.catalogue, "ads": counts["ads_indexed"], "design": name,
            "build_s": round(build_s, 2), **{f"{k}_s": round(v, 2) for k, v in manifest["timings_s"].items()
                                             if k in ("cluster", "render", "trie")},
            "tokens_added": len(ix.special_tokens), "seq_len_mean": round(float(lengths.mean()), 2),
            "seq_len_max": int(lengths.max()), "trie_nodes_per_ad": round(counts["trie_nodes"] / ix.num_ads, 3),
            "distinct_sequences": counts["distinct_sequences"], "collisions": counts["code_collisions"],
            "shared_sequence_ads": sum(c for c in seq_count.values() if c > 1),
            "queries": len(queries), **prefix_agreement(q_paths, ad_paths, relevant, (1, 2, 3)),
            "index_hash": ix.index_hash, "load_start": round(load0, 1),
        }
        rows.append(row)
        log.info("%s", row)
        with (Path(args.work) / "ids_results.jsonl").open("a") as fh:  # per design: a long run keeps what it did
            fh.write(json.dumps(row) + "\n")
    print(table(rows), end="")
    return rows


def table(rows: list[dict]) -> str:
    cols = ["design", "build_s", "cluster_s", "render_s", "tokens_added", "seq_len_mean", "seq_len_max",
            "trie_nodes_per_ad", "collisions", "shared_sequence_ads", "prefix@1", "prefix@2", "prefix@3",
            "ads_per_prefix@1", "ads_per_prefix@2", "ads_per_prefix@3"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def seed_smoke_vectors(work: Path) -> None:
    """Random unit vectors in embed_cached's chunk layout for the smoke catalogue: MiniLM is not what the
    smoke run checks, and skipping it keeps the run to seconds on a 2-core CPU."""
    ids, titles, qrels = load_catalogue("smoke")
    rng = np.random.default_rng(0)
    for sub, n in (("titles", len(titles)), ("queries", len(qrels))):
        (work / sub).mkdir(parents=True, exist_ok=True)
        vec = rng.standard_normal((n, 16)).astype(np.float32)
        np.save(work / sub / f"{0:06d}.npy", vec / np.linalg.norm(vec, axis=1, keepdims=True), allow_pickle=False)


def cmd_agreement(args: argparse.Namespace) -> dict:
    """``prefix@d`` of a built index (its stored vectors and codes) for queries given as vectors: how far the ids agree
    with where the queries land, without a trained model. ``--query-emb``: an ``.npz`` of ``queries`` / ``emb`` in the
    index's query space (``bench/train_eval.py prepare`` / ``tune-queries`` write them); ``--qrels``: test qrels JSON."""
    from safetensors.numpy import load_file

    from adbatch.eval.metrics import HOME_DEPOT_RELEVANT
    from adbatch.index.build import load_index

    index = load_index(args.index)
    ad_emb = load_file(str(Path(args.index) / "embeddings.safetensors"))["embeddings"].astype(np.float32)
    ad_paths = [tuple(c[:-1]) for c in index.ad_codes.column("code").to_pylist()]  # cluster path: code less leaf slot
    z = np.load(args.query_emb, allow_pickle=False)
    vec = {str(q): v for q, v in zip(z["queries"], z["emb"].astype(np.float32))}
    qrels = json.loads(Path(args.qrels).read_text())
    row_of = {str(a): r for r, a in enumerate(index.ad_ids)}
    queries = sorted(q for q in qrels if q in vec)
    relevant = [[row_of[a] for a, g in qrels[q].items() if g >= HOME_DEPOT_RELEVANT and a in row_of] for q in queries]
    q_emb = np.stack([vec[q] / max(np.linalg.norm(vec[q]), 1e-12) for q in queries])
    out = {"index": str(args.index), "query_emb": str(args.query_emb), "queries": len(queries),
           **prefix_agreement(hierarchy_paths(ad_emb, ad_paths, q_emb), ad_paths, relevant, (1, 2, 3))}
    print(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=os.environ.get("ADBATCH_BENCH_DIR", "/tmp/adbatch_bench_ids"))
    ap.add_argument("--smoke", action="store_true",
                    help="CPU plumbing check: `measure` on 240 example ads with random vectors, designs codes, text, rq 2:8")
    sub = ap.add_subparsers(dest="cmd", required=False)
    e = sub.add_parser("embed", help="MiniLM over a catalogue's titles and test queries (cached)")
    e.add_argument("--catalogue", choices=("5000", "all", "smoke"), default="5000")
    e.add_argument("--limit", type=int, help="embed only the first N titles (timing probe)")
    m = sub.add_parser("measure", help="build each id design's index and measure it")
    m.add_argument("--catalogue", choices=("5000", "all", "smoke"), default="5000")
    m.add_argument("--rq", nargs="*", default=["3:256", "3:64", "4:16"], metavar="L:K",
                   help="residual designs: rq_levels:rq_codebook")
    g = sub.add_parser("agreement", help="prefix@d of a built index for queries given as vectors (e.g. ids from a "
                                         "tuned encoder vs MiniLM's)")
    g.add_argument("--index", required=True)
    g.add_argument("--query-emb", required=True, help=".npz with queries / emb in the index's query space")
    g.add_argument("--qrels", required=True, help="test qrels JSON {query: {ad_id: grade}}")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.smoke:
        args.cmd, args.catalogue, args.rq = "measure", "smoke", ["2:8"]
        seed_smoke_vectors(Path(args.work) / "smoke")
    elif args.cmd is None:
        ap.error("a command (embed | measure) or --smoke is required")
    if args.cmd == "embed":
        cmd_embed(args)
    elif args.cmd == "agreement":
        cmd_agreement(args)
    else:
        cmd_measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
