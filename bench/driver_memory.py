#!/usr/bin/env python3
"""The generate driver's peak host memory against the number of requests (issue 56: "peak host memory of the
driver independent of the request count (streamed)").

For each request count N it writes ``N`` target requests (``request_id, query``; queries drawn Zipf(``--zipf``)
from a pool of ``--pool`` distinct queries, bench/scale_set.py's ``query_pool`` / ``zipf_ranks`` over the example
ads' titles) and runs the real CLI entry point (``adbatch generate``, :func:`jobs.cli.main`) in a fresh process
with ``--targets.fusion dense``: the dense channel only (MiniLM query embedding + a search of the index's
vectors), no LLM decoding, so the driver -- validation, partitioning, blocks, commits, the manifest -- is what is
exercised, not the model. The driver process (the one that runs ``run_generate``; never the Ray workers) reports
its own peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's high-water mark) and a sampled peak of its
anonymous memory (``RssAnon``, every 0.1 s: RSS without the shared-memory pages of Ray's object store the driver
mapped). The table gives, per executor and N: peak RSS, peak anon, the wall time of the whole command (Python
and Ray start-up included), the generate phase's seconds and its requests/s (the manifest's ``throughput``).

    .venv/bin/python bench/driver_memory.py --out bench/results/driver_memory_cpu_1208
    .venv/bin/python bench/driver_memory.py --requests 10000,100000 --executors local
    .venv/bin/python bench/driver_memory.py --smoke [--out DIR]     # 2-4 min on 2 cores: a 200-ad index, N = 200 / 800

The default index is the example refresh's (``runs/example_refresh/index``, scripts/run_example.sh); when it is
absent (and with ``--smoke``) an index of the example ads' first ``--ads`` rows is built under ``--work``.
Results: ``driver_memory.json`` (every run, with its RSS time series) and ``driver_memory.md`` (the table)
under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

log = logging.getLogger("bench.driver_memory")

EXAMPLE_ADS = REPO / "examples" / "slogan_ads.parquet"
EXAMPLE_QUERIES = REPO / "examples" / "requests_targets.parquet"
DEFAULT_INDEX = REPO / "runs" / "example_refresh" / "index"
SAMPLE_S = 0.1


# --- the driver process: run the CLI, report its own memory ---------------------------------------------------
def _status_kb(fields: tuple[str, ...]) -> dict[str, int]:
    """``/proc/self/status`` fields in kB (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


def as_driver(report: Path, argv: list[str]) -> int:
    """Run ``adbatch <argv>`` in this process and write its memory report to ``report``: the peak RSS (kernel
    high-water mark), the sampled peak of RssAnon / RssShmem, and an RSS time series (MiB, every ~``SAMPLE_S``)."""
    from jobs.cli import main

    peaks = {"RssAnon": 0, "RssShmem": 0}
    series: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            kb = _status_kb(("VmRSS", "RssAnon", "RssShmem"))
            for k in peaks:
                peaks[k] = max(peaks[k], kb.get(k, 0))
            series.append((round(time.perf_counter() - t0, 2), round(kb.get("VmRSS", 0) / 1024, 1)))
            stop.wait(SAMPLE_S)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        rc = main(argv)
    finally:
        stop.set()
        thread.join()
        step = max(1, len(series) // 400)  # keep the JSON small
        report.write_text(json.dumps({
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "peak_anon_mib": round(peaks["RssAnon"] / 1024, 1),
            "peak_shmem_mib": round(peaks["RssShmem"] / 1024, 1),
            "rss_series_mib": series[::step]}))
    return rc


# --- inputs ----------------------------------------------------------------------------------------------------
def build_small_index(work: Path, ads: int) -> Path:
    """An index (text scheme, MiniLM vectors) of the example ads' first ``ads`` rows, built once under ``work``."""
    import pyarrow.parquet as pq

    from adbatch.index.build import IndexConfig, build_index

    out = work / f"index_{ads}"
    if (out / "manifest.json").is_file():
        return out
    corpus = work / f"ads_{ads}.parquet"
    pq.write_table(pq.read_table(EXAMPLE_ADS, columns=["ad_id", "title"]).slice(0, ads), corpus)
    t = time.perf_counter()
    build_index(corpus, out, IndexConfig(), progress=False)
    log.info("built the index of %d ads in %.1f s -> %s", ads, time.perf_counter() - t, out)
    return out


def write_requests(path: Path, n: int, pool_size: int, zipf: float, seed: int = 0) -> dict[str, Any]:
    """``n`` target requests (``request_id`` r0000000.., ``query``), queries Zipf-drawn from a pool of distinct
    queries (the example requests' queries, then word spans of the example ads' titles); row groups of 65,536."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.scale_set import query_pool, zipf_cdf, zipf_ranks

    rng = np.random.default_rng(seed)
    titles = pq.read_table(EXAMPLE_ADS, columns=["title"]).column("title").to_pylist()
    real = pq.read_table(EXAMPLE_QUERIES, columns=["query"]).column("query").to_pylist()
    pool, _ = query_pool([q.lower() for q in real], [t for t in titles if t], pool_size, rng)
    pool_arr = pa.array(pool, pa.string())
    cdf = zipf_cdf(len(pool), zipf)
    drawn = np.zeros(len(pool), dtype=bool)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    schema = pa.schema([("request_id", pa.string()), ("query", pa.string())])
    chunk = 65536
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            ranks = zipf_ranks(cdf, stop - start, rng)
            drawn[ranks] = True
            writer.write_table(pa.table({"request_id": [f"r{i:07d}" for i in range(start, stop)],
                                         "query": pool_arr.take(pa.array(ranks))}, schema=schema))
    tmp.replace(path)
    return {"requests": n, "pool": len(pool), "distinct_drawn": int(drawn.sum()), "zipf": zipf}


# --- one measurement -------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace, index: Path, requests: Path, executor: str, n: int, work: Path) -> dict[str, Any]:
    out = work / f"out_{executor}_{n}"
    report = work / f"driver_{executor}_{n}.json"
    report.unlink(missing_ok=True)
    cli = ["generate", "--task", "targets", "--requests", str(requests), "--index", str(index), "--out", str(out),
           "--targets.fusion", "dense", "--executor", executor, "--overwrite", "true", "--progress", "false",
           "--partition-size", str(args.partition_size), "--num-cpus", str(args.num_cpus), "--log-level", "WARNING"]
    if args.batch_size:
        cli += ["--batch-size", str(args.batch_size)]
    # a fresh output folder each time: a resumed run would skip every partition
    if out.exists():
        import shutil

        shutil.rmtree(out)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--as-driver", str(report), "--", *cli]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"generate ({executor}, N={n}) failed ({done.returncode}):\n{done.stderr[-4000:]}")
    mem = json.loads(report.read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    thr, counts, timings = manifest["throughput"], manifest["counts"], manifest["timings_s"]
    row = {"executor": executor, "requests": n, "answered": counts["answered"], "partitions": counts["partitions"],
           "output_rows": counts["output_rows"], **{k: mem[k] for k in ("peak_rss_mib", "peak_anon_mib",
                                                                           "peak_shmem_mib")},
           "wall_s": round(wall, 1), "validate_s": round(timings.get("validate", 0.0), 2),
           "generate_s": round(timings.get("generate", 0.0), 1), "finalize_s": round(timings.get("finalize", 0.0), 2),
           "requests_per_s": thr["requests_per_s"], "decoded": thr.get("decoded"),
           "model_calls": thr.get("model_calls"), "rss_series_mib": mem["rss_series_mib"]}
    assert counts["answered"] == n, f"{executor} N={n}: {counts['answered']} answered of {n}"
    log.info("%s N=%d: peak RSS %.0f MiB (anon %.0f), wall %.1f s, %.1f req/s", executor, n, row["peak_rss_mib"],
             row["peak_anon_mib"], wall, row["requests_per_s"])
    return row


def table(rows: list[dict[str, Any]], title: str) -> str:
    head = ("| executor | requests | partitions | driver peak RSS MiB | peak anon MiB | wall s | validate s | "
            "generate s | req/s (generate) |")
    lines = [f"### {title}", "", head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['executor']} | {r['requests']:,} | {r['partitions']:,} | {r['peak_rss_mib']:.0f} | "
                     f"{r['peak_anon_mib']:.0f} | {r['wall_s']:.1f} | {r['validate_s']:.2f} | {r['generate_s']:.1f} | "
                     f"{r['requests_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-driver"]:  # the measured driver process (see measure)
        rest = argv[2:]
        return as_driver(Path(argv[1]), rest[1:] if rest[:1] == ["--"] else rest)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny N (200, 800) over a 200-ad index built under --work")
    ap.add_argument("--requests", default=None, help="comma-separated request counts (default 10000,100000,300000)")
    ap.add_argument("--executors", default="ray,local", help="comma-separated: ray, local (default both)")
    ap.add_argument("--index", type=Path, default=None,
                    help=f"index folder (default {DEFAULT_INDEX.relative_to(REPO)}, else one built under --work)")
    ap.add_argument("--ads", type=int, default=None, help="ads of the index built when there is none (default 1000; smoke 200)")
    ap.add_argument("--pool", type=int, default=None, help="distinct queries to draw from (default 5,000; smoke 100)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the query ranks (default 1.0)")
    ap.add_argument("--batch-size", type=int, default=None, help="generate --batch-size (default: the CLI's, 8 on CPU)")
    ap.add_argument("--partition-size", type=int, default=256, help="generate --partition-size (default 256, the CLI's)")
    ap.add_argument("--num-cpus", type=int, default=2, help="local Ray's CPUs (default 2)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default /tmp/adbatch_driver_memory[_smoke])")
    ap.add_argument("--out", type=Path, default=None, help="folder for driver_memory.json / .md (default: --work)")
    ap.add_argument("--title", default=None, help="the table's title (default: the run's settings)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    counts = [int(x) for x in (args.requests or ("200,800" if args.smoke else "10000,100000,300000")).split(",")]
    executors = args.executors.split(",")
    assert set(executors) <= {"ray", "local"}, f"--executors: ray and/or local, got {executors}"
    work = args.work or Path("/tmp/adbatch_driver_memory" + ("_smoke" if args.smoke else ""))
    work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or work
    out_dir.mkdir(parents=True, exist_ok=True)
    index = args.index or (DEFAULT_INDEX if DEFAULT_INDEX.joinpath("manifest.json").is_file() and not args.smoke
                           else build_small_index(work, args.ads or (200 if args.smoke else 1000)))
    pool = args.pool or (100 if args.smoke else 5000)

    rows, inputs = [], {}
    for n in counts:
        requests = work / f"requests_{n}_p{pool}_z{args.zipf}.parquet"
        meta = requests.with_suffix(".json")
        if not requests.is_file() or not meta.is_file():
            meta.write_text(json.dumps(write_requests(requests, n, pool, args.zipf)))
        inputs[n] = json.loads(meta.read_text())
        for executor in executors:
            rows.append(measure(args, index, requests, executor, n, work))
    title = args.title or (f"driver peak memory, targets.fusion dense, pool {pool} Zipf({args.zipf}), "
                           f"partition_size {args.partition_size}, batch_size {args.batch_size or 'default'}")
    rows.sort(key=lambda r: (r["executor"], r["requests"]))
    md = table(rows, title)
    print(md)
    (out_dir / "driver_memory.md").write_text(md)
    (out_dir / "driver_memory.json").write_text(json.dumps(
        {"title": title, "index": str(index), "inputs": inputs, "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
