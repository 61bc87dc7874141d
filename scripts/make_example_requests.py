"""Write the example request files used by examples/refresh.toml (deterministic; re-run to refresh).

- examples/requests_targets.parquet: 50 short search queries written for the bundled example corpus
  (company/product searches of the kind the slogan advertisers serve).
- examples/requests_creatives.parquet: 24 ads drawn from examples/slogan_ads.parquet (every 223rd
  row), without their human headline (the ``title`` column), which is what a creative replaces.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent / "examples"

QUERIES = [
    "cloud accounting software", "small business payroll", "point of sale system rental",
    "dog grooming salon", "wedding photographer", "organic skin care", "used car dealer",
    "home solar panels", "commercial cleaning services", "it support for small business",
    "online marketing agency", "custom web design", "dental clinic", "physiotherapy near me",
    "yoga classes", "craft beer brewery", "coffee roasters", "vegan restaurant", "hotel booking",
    "luxury travel tours", "real estate agent", "mortgage broker", "life insurance quote",
    "employment lawyer", "tax preparation", "recruitment agency", "forklift rental",
    "industrial safety equipment", "3d printing service", "cyber security consulting",
    "data backup solution", "event venue hire", "catering for events", "children's toys",
    "furniture store", "kitchen renovation", "roofing contractor", "plumbing repair",
    "electric bikes", "fitness equipment", "language school", "online courses for nurses",
    "medical devices supplier", "pet insurance", "wine delivery", "florist same day delivery",
    "video production company", "printing and signage", "hr software", "logistics and freight",
]


def main() -> None:
    assert len(QUERIES) == 50 and len(set(QUERIES)) == 50
    pq.write_table(pa.table({"request_id": [f"t{i:03d}" for i in range(len(QUERIES))],
                             "query": QUERIES}), ROOT / "requests_targets.parquet")
    ads = pq.read_table(ROOT / "slogan_ads.parquet")
    rows = [ads.slice(i, 1).to_pylist()[0] for i in range(0, ads.num_rows, 223)][:24]
    pq.write_table(pa.table({
        "request_id": [f"c{i:03d}" for i in range(len(rows))],
        "ad_id": [r["ad_id"] for r in rows],
        "advertiser": [r["advertiser"] for r in rows],
        "description": [r["description"] for r in rows],
        "industry": [r["industry"] for r in rows],
    }), ROOT / "requests_creatives.parquet")


if __name__ == "__main__":
    main()
