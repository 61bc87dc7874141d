"""Index-stage benchmark (a script, not a test).

(a) Home Depot: the distinct product titles of ``../shared/data/home_depot_relevance/train.csv``
    embedded with MiniLM on Ray, then the full stage (text and codes schemes).
(b) Synthetic: Gaussian-mixture embeddings (Zipf-weighted components, so clusters are uneven like
    real catalogues) at 100k and 1M ads through the whole Ray stage with the ``codes`` scheme, plus
    a ``text``-scheme trie over synthetic token sequences (2 label tokens per cluster level + a
    random 8-20 token "title" + EOS; random titles share nothing below the labels, so this is a
    worst case for trie size).

Every configuration runs in a fresh subprocess (a fresh Ray with ``--workers`` CPUs) so peak RSS is
per configuration; RSS is sampled over the driver and all its descendants (Ray workers included).

    .venv/bin/python bench/index.py synthetic --sizes 100000 1000000 --workers 1 2
    .venv/bin/python bench/index.py homedepot --workers 2 [--limit 5000]
    .venv/bin/python bench/index.py report      # the table of every run so far (bench/results/index.md)
    .venv/bin/python bench/index.py --smoke     # seconds: 2,000 synthetic ads, codes, 1 Ray CPU, in a temp folder
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RAW = Path(os.environ.get("ADBATCH_BENCH_DIR", "/tmp/adbatch_bench_index")) / "index_raw.jsonl"
WORK = Path(os.environ.get("ADBATCH_BENCH_DIR", "/tmp/adbatch_bench_index"))
HOME_DEPOT = REPO.parent / "shared" / "data" / "home_depot_relevance" / "train.csv"

log = logging.getLogger("bench.index")


class RssSampler:
    """Peak summed RSS of this process and its descendants, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.25) -> None:
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # a worker exited between listing and reading
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def synthetic_corpus(n: int, d: int = 64, components: int = 2000, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = WORK / f"synth_{n}_{d}_titled.parquet"
    if path.is_file():
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, components + 1) ** 0.8
    weights /= weights.sum()
    mu = rng.normal(size=(components, d)).astype(np.float32)
    scale = rng.uniform(0.2, 0.6, components).astype(np.float32)
    comp = rng.choice(components, n, p=weights)
    emb = mu[comp] + scale[comp, None] * rng.normal(size=(n, d)).astype(np.float32)
    # Titles: 3 words of the component's topic + 3 catalogue-wide words + a model number, from
    # a pseudo-word vocabulary, so text-scheme labels and tokenization see realistic text.
    syll = np.array(["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "ba", "do", "fu",
                     "ga", "hi", "jo", "pe"])
    words = np.array(["".join(syll[rng.integers(0, 16, rng.integers(2, 4))]) for _ in range(4000)])
    topic = rng.integers(0, words.shape[0], size=(components, 8))
    pick_topic = topic[comp[:, None], rng.integers(0, 8, size=(n, 3))]
    pick_any = rng.integers(0, words.shape[0], size=(n, 3))
    parts = np.concatenate([words[pick_topic], words[pick_any]], axis=1)
    titles = [" ".join(row) + f" {i % 9973}" for i, row in enumerate(parts.tolist())]
    table = pa.table({
        "ad_id": pa.array(np.arange(n, dtype=np.int64)),
        "title": pa.array(titles, pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), d),
    })
    pq.write_table(table, path)
    return path


def synthetic_text_sequences(code_flat: np.ndarray, code_len: np.ndarray, seed: int = 0,
                             vocab: int = 49152, eos: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Text-scheme-shaped sequences: 2 label tokens per cluster level, a random title, EOS."""
    from adbatch.index.clustering import Hierarchy

    rng = np.random.default_rng(seed)
    h = Hierarchy(code_flat, code_len, 0, 0, 0)
    padded = h.padded()
    n = padded.shape[0]
    depth = code_len.astype(np.int64) - 1
    title_len = rng.integers(8, 21, n)
    lengths = 2 * depth + title_len + 1
    width = int(lengths.max())
    out = np.full((n, width), -1, dtype=np.int64)
    for lvl in range(int(depth.max(initial=0))):  # per level, vectorized over ads
        has = depth > lvl
        _, inv = np.unique(padded[has, :lvl + 1], axis=0, return_inverse=True)
        label = rng.integers(3, vocab, size=(int(inv.max()) + 1, 2))
        out[has, 2 * lvl:2 * lvl + 2] = label[inv.reshape(-1)]
    zipf = np.minimum(rng.zipf(1.3, size=(n, 20)) + 2, vocab - 1)
    cols = np.arange(width)[None, :]
    start = 2 * depth[:, None]
    in_title = (cols >= start) & (cols < start + title_len[:, None])
    out[in_title] = zipf[:, :20][np.arange(20)[None, :] < title_len[:, None]]
    out[np.arange(n), lengths - 1] = eos
    flat = out[cols < lengths[:, None]]
    return flat, lengths


def run_one(kind: str, n: int, workers: int, scheme: str, limit: int) -> dict:
    """One configuration in this process (called in a fresh subprocess)."""
    import ray

    from adbatch.index.build import IndexConfig, load_index
    from adbatch.index.trie import Trie
    from pipelines.index import IndexJobConfig, run_index

    load1 = os.getloadavg()[0]
    out = WORK / f"idx_{kind}_{n}_{workers}_{scheme}"
    if kind == "synthetic":
        ads = synthetic_corpus(n)
        icfg = IndexConfig.from_dict({"columns": {"embedding": "embedding"},
                                      "render": {"scheme": scheme}})
    elif kind == "homedepot":  # MiniLM embedding on the Ray actor pool inside the stage
        ads = home_depot_corpus(limit)
        icfg = IndexConfig.from_dict({"render": {"scheme": scheme}})
    else:  # "homedepot_emb": MiniLM vectors precomputed by `embed_home_depot`, as a column
        ads = WORK / "home_depot_all_emb.parquet"
        icfg = IndexConfig.from_dict({"columns": {"embedding": "embedding"},
                                      "render": {"scheme": scheme}})
    # address="local": never attach to a `ray start` head another user runs on this machine
    ray.init(address="local", num_cpus=workers, include_dashboard=False)
    t0 = time.perf_counter()
    with RssSampler() as rss:
        summary = run_index(IndexJobConfig(ads=str(ads), out=str(out), index=icfg,
                                           num_cpus=workers, progress=False))
    wall = time.perf_counter() - t0
    ray.shutdown()
    ix = load_index(out)
    counts = summary["counts"]
    row = {
        "kind": kind, "n": counts["ads_indexed"], "workers": workers, "scheme": scheme,
        "wall_s": round(wall, 2), "phases_s": summary["timings_s"],
        "peak_rss_gb": round(rss.peak / 2**30, 2),
        "trie_bytes_per_ad": round(ix.trie.nbytes() / ix.num_ads, 1),
        "trie_file_bytes_per_ad": round((out / "trie.safetensors").stat().st_size / ix.num_ads, 1),
        "nodes_per_ad": round(ix.trie.num_nodes / ix.num_ads, 3),
        "splits": counts["splits"], "leaves": counts["leaves"],
        "max_code_length": counts["max_code_length"],
        "load_avg_start": round(load1, 2), "load_avg_end": round(os.getloadavg()[0], 2),
    }
    if kind == "synthetic":
        code = ix.ad_codes.column("code").combine_chunks()
        code_len = np.asarray(code.value_lengths(), dtype=np.int32)
        code_flat = np.asarray(code.flatten(), dtype=np.int32)
        t1 = time.perf_counter()
        flat, lengths = synthetic_text_sequences(code_flat, code_len)
        t2 = time.perf_counter()
        trie = Trie.from_flat(flat, lengths)
        t3 = time.perf_counter()
        row["text_synthetic"] = {
            "seq_gen_s": round(t2 - t1, 2), "trie_build_s": round(t3 - t2, 2),
            "tokens_per_ad": round(float(lengths.mean()), 2),
            "trie_bytes_per_ad": round(trie.nbytes() / lengths.shape[0], 1),
            "nodes_per_ad": round(trie.num_nodes / lengths.shape[0], 3),
        }
    return row


def home_depot_corpus(limit: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = WORK / f"home_depot_{limit or 'all'}.parquet"
    if path.is_file():
        return path
    WORK.mkdir(parents=True, exist_ok=True)
    titles: dict[int, str] = {}
    with open(HOME_DEPOT, encoding="latin-1", newline="") as fh:
        for r in csv.DictReader(fh):
            titles.setdefault(int(r["product_uid"]), r["product_title"])
    # distinct titles (a few products share one), in product order
    seen: dict[str, int] = {}
    for uid, title in titles.items():
        seen.setdefault(title, uid)
    items = sorted(seen.items(), key=lambda kv: kv[1])
    if limit:
        items = items[:limit]
    pq.write_table(pa.table({"ad_id": [u for _, u in items], "title": [t for t, _ in items]}),
                   path)
    return path


def embed_home_depot(chunk: int = 2048, partial: bool = False) -> dict:
    """MiniLM over all distinct titles in one process (2 torch threads), resumable by chunk.

    Separate from Ray so a Ray restart elsewhere on a shared machine cannot lose the work; the
    index runs then read the vectors as an ``embedding`` column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from adbatch.index.embeddings import EmbeddingConfig, embed_texts, load_embedder

    out = WORK / "home_depot_all_emb.parquet"
    table = pq.read_table(home_depot_corpus(0))
    titles = table.column("title").to_pylist()
    cfg = EmbeddingConfig()
    model = load_embedder(cfg)
    parts_dir = WORK / "hd_emb_parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    stats = {"embedded_now": 0, "seconds_now": 0.0, "loads": []}
    for start in range(0, len(titles), chunk):
        part = parts_dir / f"{start:06d}.npy"
        if part.is_file() or partial:
            continue
        t0 = time.perf_counter()
        vec = embed_texts(titles[start:start + chunk], cfg, model=model)
        stats["seconds_now"] += time.perf_counter() - t0
        stats["embedded_now"] += vec.shape[0]
        stats["loads"].append(round(os.getloadavg()[0], 1))
        np.save(part, vec, allow_pickle=False)
        log.info("embedded %d/%d titles (%.1f titles/s so far, load %.1f)", start + vec.shape[0],
                 len(titles), stats["embedded_now"] / stats["seconds_now"], os.getloadavg()[0])
    # --partial: index only the titles embedded so far (a prefix of the product order)
    done = [s for s in range(0, len(titles), chunk) if (parts_dir / f"{s:06d}.npy").is_file()]
    done = [s for i, s in enumerate(done) if s == i * chunk]
    emb = np.concatenate([np.load(parts_dir / f"{s:06d}.npy", allow_pickle=False) for s in done])
    table = table.slice(0, emb.shape[0])
    pq.write_table(table.append_column(
        "embedding", pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), emb.shape[1])), out)
    stats["titles"] = len(titles)
    stats["titles_per_s"] = round(stats["embedded_now"] / max(stats["seconds_now"], 1e-9), 1)
    if not partial:
        (WORK / "hd_embed_stats.json").write_text(json.dumps(stats))
    return stats


def spawn(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, "_one", *args]
    log.info("running %s", " ".join(cmd))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"benchmark run failed: {args}")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    row["machine"] = f"{platform.node()} ({os.cpu_count()} CPU)"
    row["command"] = "bench/index.py _one " + " ".join(args)
    with RAW.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    log.info("%s", row)
    return row


def report() -> str:
    rows = [json.loads(x) for x in RAW.read_text().splitlines() if x.strip()]
    lines = ["| date | data | ads | scheme | Ray CPUs | wall s | read | embed | cluster | render | "
             "trie | write | peak RSS GB | trie B/ad | nodes/ad | load avg (start/end) |",
             "|" + "---|" * 16]
    for r in rows:
        p = r["phases_s"]
        lines.append(
            f"| {r['date']} | {r['kind']} | {r['n']:,} | {r['scheme']} | {r['workers']} | "
            f"{r['wall_s']} | {p.get('read', 0):.1f} | {p.get('embed', 0):.1f} | "
            f"{p.get('cluster', 0):.1f} | {p.get('render', 0):.1f} | {p.get('trie', 0):.1f} | "
            f"{p.get('write', 0):.1f} | {r['peak_rss_gb']} | {r['trie_bytes_per_ad']} | "
            f"{r['nodes_per_ad']} | {r['load_avg_start']}/{r['load_avg_end']} |")
    text_rows = [r for r in rows if "text_synthetic" in r]
    if text_rows:
        lines += ["", "Text-scheme trie over synthetic token sequences (same hierarchies):", "",
                  "| ads | Ray CPUs | tokens/ad | seq gen s | trie build s | trie B/ad | nodes/ad |",
                  "|---|---|---|---|---|---|---|"]
        for r in text_rows:
            t = r["text_synthetic"]
            lines.append(f"| {r['n']:,} | {r['workers']} | {t['tokens_per_ad']} | "
                         f"{t['seq_gen_s']} | {t['trie_build_s']} | {t['trie_bytes_per_ad']} | "
                         f"{t['nodes_per_ad']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    global RAW, WORK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="plumbing check: `synthetic --sizes 2000 --workers 1 --schemes codes` then `report`, in a temp "
                         "folder (ADBATCH_BENCH_DIR) so no real run's rows are touched")
    sub = ap.add_subparsers(dest="cmd", required=False)
    s = sub.add_parser("synthetic")
    s.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    s.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    s.add_argument("--schemes", nargs="+", default=["codes"])
    h = sub.add_parser("homedepot")
    h.add_argument("--workers", type=int, nargs="+", default=[2])
    h.add_argument("--limit", type=int, default=0, help="first N distinct titles (0 = all)")
    h.add_argument("--schemes", nargs="+", default=["text"])
    eh = sub.add_parser("embed-homedepot", help="MiniLM over all distinct titles (resumable)")
    eh.add_argument("--partial", action="store_true",
                    help="embed nothing; write the corpus of the titles embedded so far")
    e = sub.add_parser("homedepot-emb", help="index runs on the precomputed MiniLM vectors")
    e.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    e.add_argument("--schemes", nargs="+", default=["text", "codes"])
    sub.add_parser("report")
    o = sub.add_parser("_one")
    o.add_argument("kind")
    o.add_argument("n", type=int)
    o.add_argument("workers", type=int)
    o.add_argument("scheme")
    o.add_argument("--limit", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.smoke:
        import tempfile

        WORK = Path(tempfile.mkdtemp(prefix="adbatch_bench_index_smoke-"))
        RAW = WORK / "index_raw.jsonl"
        os.environ["ADBATCH_BENCH_DIR"] = str(WORK)  # the spawned run writes there too
        args.cmd, args.sizes, args.workers, args.schemes = "synthetic", [2000], [1], ["codes"]
    elif args.cmd is None:
        ap.error("a command or --smoke is required")
    if args.cmd == "_one":
        row = run_one(args.kind, args.n, args.workers, args.scheme, args.limit)
        print(json.dumps(row))
    elif args.cmd == "synthetic":
        for n in args.sizes:
            synthetic_corpus(n)
            for scheme in args.schemes:
                for w in args.workers:
                    spawn(["synthetic", str(n), str(w), scheme])
        if args.smoke:
            print(report(), end="")
    elif args.cmd == "homedepot":
        for scheme in args.schemes:
            for w in args.workers:
                spawn(["homedepot", "0", str(w), scheme, "--limit", str(args.limit)])
    elif args.cmd == "embed-homedepot":
        print(json.dumps(embed_home_depot(partial=args.partial)))
    elif args.cmd == "homedepot-emb":
        for scheme in args.schemes:
            for w in args.workers:
                spawn(["homedepot_emb", "0", str(w), scheme])
    else:
        print(report(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
