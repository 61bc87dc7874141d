"""Evaluation data: Home Depot search relevance (targeting) and the curated slogan test set (creatives).

Neither file is ours or in the repo (``../shared/data``, see each SOURCE.md); these loaders turn them
into the shapes the stages use.

**Home Depot** (``train.csv``, latin-1): one row per judged (query, product) pair.

- Catalogue = the distinct products (54,667 ``product_uid``). ``ad_id`` = product_uid (int64),
  ``title`` = its title in the first row that names it: 15 products appear with two title variants
  (e.g. a wording change); rows naming a later variant are counted in ``stats['title_variants']``
  (24 rows) and judge the product under its first title.
  Distinct products may share a title (53,489 distinct titles): they stay distinct ads.
- Queries are normalised (lower-case, whitespace collapsed) so that "Angle bracket" and
  "angle  bracket" are one query; a pair judged twice after normalisation keeps the higher grade.
- **Split** by distinct normalised query string: ``u = sha256(f"{seed}:{query}") / 2**256`` and
  train if ``u < f_train``, valid if ``u < f_train + f_valid``, else test (default 0.8/0.1/0.1,
  seed 0). A query therefore lands in exactly one split, independent of row order or of the
  catalogue chosen.
- **Catalogue subset** (default 5,000 titles), deterministic given the seed: queries are visited in
  the order of ``sha256(f"{seed}:subset:{query}")`` (all splits alike); each query whose relevant
  products (grade >= 2.67) all fit adds them, until ``relevant_fraction`` (0.8) of the catalogue is
  used; the rest is filled with other products in the order of ``sha256(f"{seed}:fill:{uid}")``
  (distractors no sampled query is known to want). ``catalogue_size=None`` keeps all 54,667.
- **Churn** (``churn`` > 0, a subset only): the next night's catalogue, partly changed. That share of
  the chosen products, picked in the order of ``sha256(f"{seed}:churn:{uid}")``, leaves; as many
  products from outside the subset join, relevant products of the remaining queries first (in the
  subset's query order), then any. Query splits do not depend on the catalogue, so a query keeps its
  split across nights; measures what warm-starting from yesterday's model saves.
- **qrels** per split: ``{query: {ad_id: grade}}`` restricted to products in the catalogue, and only
  for queries with at least one relevant product in it (the others cannot be answered).
  ``relevant = grade >= 2.67``; grades feed nDCG as graded gains (see :mod:`adbatch.eval.metrics`).

**Slogans** (``test-curated.csv``, UTF-8, 994 rows): company description -> human headline. Rows
become ad records (``advertiser``, ``description``, ``industry``, ``url``) + ``reference``.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adbatch.config import ConfigBase, ConfigError
from adbatch.eval.metrics import HOME_DEPOT_RELEVANT

log = logging.getLogger(__name__)

HOME_DEPOT_COLUMNS = ("id", "product_uid", "product_title", "search_term", "relevance")
HOME_DEPOT_ENCODING = "latin-1"
SLOGAN_COLUMNS = ("desc", "output", "company", "industry", "url", "alias")
SLOGAN_ENCODING = "utf-8"


class QuerySplit(str, enum.Enum):
    TRAIN = "train"
    VALID = "valid"
    TEST = "test"


def require_columns(csv_path: str | Path, fieldnames: Any, columns: tuple[str, ...]) -> None:
    """Refuse (:class:`ConfigError`, naming the file) a CSV header ``fieldnames`` without every one of ``columns``."""
    missing = [c for c in columns if c not in (fieldnames or [])]
    if missing:
        raise ConfigError(f"{csv_path}: missing column(s) {missing}; found {list(fieldnames or [])}")


def check_csv_columns(csv_path: str | Path, columns: tuple[str, ...], encoding: str) -> None:
    """The header of the CSV at ``csv_path`` (read in ``encoding``), checked for ``columns`` (:func:`require_columns`)
    without reading a row: what a driver checks before a loader of this module reads the file."""
    with Path(csv_path).open(encoding=encoding, newline="") as fh:
        require_columns(csv_path, csv.DictReader(fh).fieldnames, columns)


def normalize_query(query: str) -> str:
    """Lower-case and collapse whitespace: the identity of a query for splitting and qrels."""
    return re.sub(r"\s+", " ", query.strip().lower())


def _unit_hash(text: str) -> float:
    """Deterministic uniform number in [0, 1) from ``text`` (sha256, not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest(), "big") / 2.0**256


@dataclass
class HomeDepotConfig(ConfigBase):
    """How to turn the Home Depot CSV into a catalogue, query splits and qrels."""

    csv_path: Path = field(default=Path("../shared/data/home_depot_relevance/train.csv"),
                           metadata={"help": "Home Depot train.csv (latin-1)"})
    catalogue_size: int | None = field(default=5000, metadata={"help": "titles in the catalogue; None = all"})
    relevant_fraction: float = field(default=0.8, metadata={"help": "share of the subset filled with relevant products of sampled queries"})
    relevant_threshold: float = field(default=HOME_DEPOT_RELEVANT, metadata={"help": "grade >= this is relevant"})
    split_fractions: tuple[float, float, float] = field(default=(0.8, 0.1, 0.1), metadata={"help": "train/valid/test query shares"})
    seed: int = field(default=0, metadata={"help": "seed of the split and the subset"})
    churn: float = field(default=0.0, metadata={"help": "share of the subset replaced by other products (next night)"})

    def validate(self) -> None:
        if not 0.0 <= self.churn < 1.0:
            raise ConfigError(f"HomeDepotConfig.churn must be in [0, 1), got {self.churn}")
        if self.churn and self.catalogue_size is None:
            raise ConfigError("HomeDepotConfig.churn needs a catalogue subset (catalogue_size), not the full catalogue")
        if self.catalogue_size is not None and self.catalogue_size < 1:
            raise ConfigError(f"HomeDepotConfig.catalogue_size must be >= 1 or None, got {self.catalogue_size}")
        if not 0.0 < self.relevant_fraction <= 1.0:
            raise ConfigError(f"HomeDepotConfig.relevant_fraction must be in (0, 1], got {self.relevant_fraction}")
        if len(self.split_fractions) != 3 or any(f < 0 for f in self.split_fractions) \
                or abs(sum(self.split_fractions) - 1.0) > 1e-6:
            raise ConfigError(f"HomeDepotConfig.split_fractions must be 3 shares >= 0 summing to 1, got {self.split_fractions}")


@dataclass
class TargetingData:
    """A catalogue plus per-split queries and graded qrels.

    ``catalogue``: pyarrow Table (``ad_id`` int64, ``title`` string), in catalogue order.
    ``qrels[split]``: ``{query: {ad_id: grade}}`` (only queries with a relevant ad in the catalogue).
    ``split_of``: every normalised query of the source -> its split (also those not in qrels).
    """

    catalogue: Any
    qrels: dict[QuerySplit, dict[str, dict[int, float]]]
    split_of: dict[str, QuerySplit]
    config: HomeDepotConfig
    stats: dict[str, int] = dataclasses.field(default_factory=dict)

    def queries(self, split: QuerySplit) -> list[str]:
        return sorted(self.qrels[split])

    def titles_by_id(self) -> dict[int, str]:
        return dict(zip(self.catalogue.column("ad_id").to_pylist(), self.catalogue.column("title").to_pylist()))

    def labelled_table(self, split: QuerySplit) -> Any:
        """pyarrow Table (``query`` string, ``ad_id`` int64, ``grade`` float64) of the split's
        relevant pairs: the ``queries`` input of the train stage."""
        import pyarrow as pa

        thr = self.config.relevant_threshold
        rows = sorted((q, ad, g) for q, grades in self.qrels[split].items() for ad, g in grades.items() if g >= thr)
        return pa.table({"query": pa.array([r[0] for r in rows], pa.string()),
                         "ad_id": pa.array([r[1] for r in rows], pa.int64()),
                         "grade": pa.array([r[2] for r in rows], pa.float64())})

    def relevant_pairs(self, split: QuerySplit) -> list[tuple[str, int]]:
        """(query, ad_id) for every relevant judged pair of ``split``, sorted (for training)."""
        thr = self.config.relevant_threshold
        return sorted((q, ad) for q, grades in self.qrels[split].items() for ad, g in grades.items() if g >= thr)


def read_home_depot_rows(csv_path: str | Path) -> tuple[dict[int, str], dict[str, dict[int, float]], int]:
    """Read the CSV into ``products {uid: title}``, ``grades {normalised query: {uid: grade}}`` and
    the number of rows whose title differs from the product's first title."""
    csv_path = Path(csv_path)
    if not csv_path.is_file():
        raise FileNotFoundError(f"Home Depot CSV not found: {csv_path}")
    products: dict[int, str] = {}
    grades: dict[str, dict[int, float]] = {}
    variants = 0
    with csv_path.open(encoding=HOME_DEPOT_ENCODING, newline="") as fh:
        reader = csv.DictReader(fh)
        require_columns(csv_path, reader.fieldnames, HOME_DEPOT_COLUMNS)
        for line, row in enumerate(reader, start=2):
            try:
                uid = int(row["product_uid"])
                grade = float(row["relevance"])
            except (TypeError, ValueError):
                raise ValueError(f"{csv_path}:{line}: bad product_uid/relevance {row['product_uid']!r}/{row['relevance']!r}") from None
            title = row["product_title"].strip()
            query = normalize_query(row["search_term"])
            if not title or not query:
                raise ValueError(f"{csv_path}:{line}: empty product_title or search_term")
            if products.setdefault(uid, title) != title:
                variants += 1
            q = grades.setdefault(query, {})
            q[uid] = max(grade, q.get(uid, grade))
    return products, grades, variants


def split_queries(queries: list[str], fractions: tuple[float, float, float], seed: int) -> dict[str, QuerySplit]:
    """Assign each distinct query to one split by its seeded sha256 (see the module docstring)."""
    f_train, f_valid, _ = fractions
    out: dict[str, QuerySplit] = {}
    for q in queries:
        u = _unit_hash(f"{seed}:{q}")
        out[q] = QuerySplit.TRAIN if u < f_train else QuerySplit.VALID if u < f_train + f_valid else QuerySplit.TEST
    return out


def _churn(chosen: list[int], query_order: list[str], fill_order: list[int], grades: dict[str, dict[int, float]],
           config: HomeDepotConfig) -> list[int]:
    """``chosen`` with ``round(churn * len)`` products swapped for outside ones (module docstring);
    ``query_order`` / ``fill_order``: the subset's visiting orders of queries and products."""
    n_out = round(config.churn * len(chosen))
    leaving = set(sorted(chosen, key=lambda u: _unit_hash(f"{config.seed}:churn:{u}"))[:n_out])
    kept = [u for u in chosen if u not in leaving]
    taken = set(chosen)
    joining: list[int] = []
    for q in query_order:
        if len(joining) >= n_out:
            break
        for uid, g in sorted(grades[q].items()):
            if g >= config.relevant_threshold and uid not in taken and len(joining) < n_out:
                joining.append(uid)
                taken.add(uid)
    for uid in fill_order:
        if len(joining) >= n_out:
            break
        if uid not in taken:
            joining.append(uid)
            taken.add(uid)
    return kept + joining


def load_home_depot(config: HomeDepotConfig) -> TargetingData:
    """Load Home Depot into a catalogue (subset or full), query splits and graded qrels."""
    import pyarrow as pa

    products, grades, variants = read_home_depot_rows(config.csv_path)
    thr = config.relevant_threshold
    split_of = split_queries(sorted(grades), config.split_fractions, config.seed)

    if config.catalogue_size is None or config.catalogue_size >= len(products):
        chosen = sorted(products)
    else:
        size = config.catalogue_size
        budget = round(size * config.relevant_fraction)
        picked: dict[int, None] = {}  # insertion-ordered set
        query_order = sorted(grades, key=lambda q: _unit_hash(f"{config.seed}:subset:{q}"))
        fill_order = sorted(products, key=lambda u: _unit_hash(f"{config.seed}:fill:{u}"))
        for q in query_order:
            rel = [uid for uid, g in sorted(grades[q].items()) if g >= thr and uid not in picked]
            if not rel or len(picked) + len(rel) > budget:
                continue
            picked.update(dict.fromkeys(rel))
            if len(picked) >= budget:
                break
        for uid in fill_order:
            if len(picked) >= size:
                break
            picked.setdefault(uid, None)
        chosen = list(picked)
        if config.churn:
            chosen = _churn(chosen, query_order, fill_order, grades, config)

    in_cat = set(chosen)
    qrels: dict[QuerySplit, dict[str, dict[int, float]]] = {s: {} for s in QuerySplit}
    for q, g in grades.items():
        kept = {uid: v for uid, v in g.items() if uid in in_cat}
        if any(v >= thr for v in kept.values()):
            qrels[split_of[q]][q] = kept
    catalogue = pa.table({
        "ad_id": pa.array(chosen, pa.int64()),
        "title": pa.array([products[u] for u in chosen], pa.string()),
    })
    stats = {"products_total": len(products), "queries_total": len(grades), "catalogue": len(chosen),
             "title_variants": variants}
    stats.update({f"queries_{s.value}": len(qrels[s]) for s in QuerySplit})
    log.info("Home Depot: %s", stats)
    return TargetingData(catalogue=catalogue, qrels=qrels, split_of=split_of, config=config, stats=stats)


def load_slogan_test(csv_path: str | Path) -> Any:
    """The curated slogan test set as a pyarrow Table of ad records plus the human ``reference``.

    Columns: ``ad_id`` (``slogan-<row>``), ``advertiser`` (alias when given, else company),
    ``description``, ``industry``, ``url``, ``reference``. Rows with an empty ``desc`` or ``output``
    are an error naming the row (the curated file has none).
    """
    import pyarrow as pa

    csv_path = Path(csv_path)
    if not csv_path.is_file():
        raise FileNotFoundError(f"slogan CSV not found: {csv_path}")
    cols: dict[str, list[str]] = {k: [] for k in ("ad_id", "advertiser", "description", "industry", "url", "reference")}
    with csv_path.open(encoding=SLOGAN_ENCODING, newline="") as fh:
        reader = csv.DictReader(fh)
        require_columns(csv_path, reader.fieldnames, SLOGAN_COLUMNS)
        for i, row in enumerate(reader):
            desc, ref = row["desc"].strip(), row["output"].strip()
            if not desc or not ref:
                raise ValueError(f"{csv_path}: row {i} has an empty desc or output")
            cols["ad_id"].append(f"slogan-{i}")
            cols["advertiser"].append((row["alias"] or row["company"]).strip())
            cols["description"].append(desc)
            cols["industry"].append(row["industry"].strip())
            cols["url"].append(row["url"].strip())
            cols["reference"].append(ref)
    return pa.table(cols)
