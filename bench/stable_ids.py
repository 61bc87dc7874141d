"""How many unchanged ads keep their target sequence from one night's index to the next: a full
rebuild vs an incremental build (``build_index(..., previous=...)``). CPU, no model weights.

    python bench/stable_ids.py --night1 CORPUS1.parquet --night2 CORPUS2.parquet [--out DIR]
    python bench/stable_ids.py --smoke [--out DIR]   # CPU, seconds: 300 example ads, random vectors, 10 % replaced

The corpora need ``ad_id``, ``title`` and an ``embedding`` column (``bench/train_eval.py prepare --churn``
writes them as ``corpus_<name>.parquet`` under its ``--work`` folder). Prints one row per scheme.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sequences(index_dir: Path) -> dict:
    from adbatch.index.build import load_index

    ix = load_index(index_dir)
    return dict(zip(ix.ad_ids, map(tuple, ix.sequences())))


def smoke_corpora(folder: Path) -> tuple[Path, Path]:
    """Two nights of the example corpus's first 300 ads with random vectors; night 2 replaces every tenth ad by
    a new one (the `prepare --churn 0.1` shape, without MiniLM or the Home Depot data)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(Path(__file__).resolve().parents[1] / "examples" / "slogan_ads.parquet",
                      columns=["ad_id", "title"]).slice(0, 330)
    ids, titles = t.column("ad_id").to_pylist(), t.column("title").to_pylist()
    emb = np.random.default_rng(0).standard_normal((len(ids), 16)).astype(np.float32)
    keep = [i for i in range(300) if i % 10]
    nights = {"night1": list(range(300)), "night2": keep + list(range(300, 300 + 300 - len(keep)))}
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in nights.items():
        path = folder / f"corpus_{name}.parquet"
        pq.write_table(pa.table({"ad_id": [ids[i] for i in rows], "title": [titles[i] for i in rows],
                                 "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb[rows].ravel()), 16)}), path)
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> list[dict]:
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.ids import IdScheme, RenderConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--night1")
    ap.add_argument("--night2")
    ap.add_argument("--out", help="folder for stable_ids.json")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check on two generated 300-ad nights")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke:
            args.night1, args.night2 = smoke_corpora(work / "corpora")
        elif not (args.night1 and args.night2):
            ap.error("--night1 and --night2 are required (or --smoke)")
        for scheme in (IdScheme.TEXT, IdScheme.CODES):
            cfg = IndexConfig(columns=CorpusConfig(text="title", embedding="embedding"),
                              render=RenderConfig(scheme=scheme))
            night1 = work / f"night1_{scheme.value}"
            build_index(args.night1, night1, cfg, progress=False)
            before = _sequences(night1)
            row = {"scheme": scheme.value}
            for mode, previous in (("full", None), ("incremental", night1)):
                t0 = time.perf_counter()
                manifest = build_index(args.night2, work / f"night2_{scheme.value}_{mode}", cfg, progress=False,
                                       previous=previous)
                row[f"{mode}_s"] = round(time.perf_counter() - t0, 2)
                after = _sequences(work / f"night2_{scheme.value}_{mode}")
                common = [a for a in after if a in before]
                row["unchanged_ads"] = len(common)
                row[f"{mode}_same_sequence"] = round(sum(before[a] == after[a] for a in common) / max(1, len(common)), 4)
                if mode == "incremental":
                    row["stable_ids"] = manifest.get("stable_ids")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stable_ids.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
