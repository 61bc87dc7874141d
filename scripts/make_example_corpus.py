"""Build examples/slogan_ads.parquet from the slogan dataset (GPL-3.0; see examples/SLOGAN_ADS.md).

Each company becomes one ad: ad_id, advertiser, title (= the human-written headline), description
(the company's meta description, with the dataset's literal ``<company>`` placeholder restored to
the company's short name), industry, url. Run once; the output is committed.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="../shared/data/slogan_gen/valid.csv")
    ap.add_argument("--out", default="examples/slogan_ads.parquet")
    args = ap.parse_args()
    rows = list(csv.DictReader(open(args.src, encoding="utf-8")))
    name = lambda r: r["alias"] or r["company"].title()  # noqa: E731
    table = pa.table(
        {
            "ad_id": [f"slogan-{i:05d}" for i in range(len(rows))],
            "advertiser": [name(r) for r in rows],
            "title": [r["output"] for r in rows],
            "description": [r["desc"].replace("<company>", name(r)) for r in rows],
            "industry": [r["industry"] for r in rows],
            "url": [r["url"] for r in rows],
        }
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out, compression="zstd")
    print(f"wrote {args.out}: {table.num_rows} ads")


if __name__ == "__main__":
    main()
