"""How many unchanged ads keep their target sequence from one night's index to the next: a full
rebuild vs an incremental build (``build_index(..., previous=...)``). CPU, no model weights.

    python bench/stable_ids.py --night1 CORPUS1.parquet --night2 CORPUS2.parquet [--out DIR]

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


def main(argv: list[str] | None = None) -> list[dict]:
    from adbatch.index.corpus import CorpusConfig
    from adbatch.index.build import IndexConfig, build_index
    from adbatch.index.ids import IdScheme, RenderConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--night1", required=True)
    ap.add_argument("--night2", required=True)
    ap.add_argument("--out", help="folder for stable_ids.json")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
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
