#!/usr/bin/env python3
"""Scale set: a 1M-ad corpus, 1M target requests and 100k creative requests that look like real data.

A data generator for scale benchmarks (issue 56 item 1), not a test; its output is never committed.
It measures how long generation takes and how realistic the set is, in ``scale_set.json``.

- **Ads** (``ads.parquet``: ``ad_id, title, advertiser, description, industry``; the index stage's default
  column mapping reads ``ad_id`` + ``title``, the others serve creatives). Titles come from a word-level
  Markov chain (order ``--order``, default 2) fitted on the 53k distinct Home Depot product titles
  (``../shared/data/home_depot_relevance/train.csv``), sampled with *length quotas*: the number of titles of
  each word count is the real titles' share of it times ``--ads`` (a quota that the chain can no longer
  fill with new titles is lifted, and logged). Titles are unique; ``ad_id`` is ``ad-NNNNNNN`` in
  generation order, so the same seed gives the same id to the same title. Advertisers (``--ads`` / 100
  of them, each ad drawn uniformly) have names from an order-1 chain over the slogan data's company names,
  a description from an order-2 chain over its meta descriptions (``<company>`` filled with the name),
  and an industry drawn with the real industries' frequencies (``../shared/data/slogan_gen``).
- **Target requests** (``requests_targets.parquet``: ``request_id, query``): a pool of ``--pool``
  distinct queries, the 11.8k real Home Depot search terms plus 1-5 word spans of generated titles
  (lower-case, span lengths following the real search terms', no span starting or ending on "with", "in",
  "x", ...). The real terms take the head ranks (in random order), the spans the tail; each request draws
  rank ``r`` with probability proportional to ``r ** -zipf`` (head queries repeat, like real query streams).
- **Creative requests** (``requests_creatives.parquet``: ``request_id, ad_id, advertiser, title,
  description, industry``): ``--creatives`` distinct ads, drawn uniformly.

Everything is deterministic for ``--seed``; files are written row group by row group. The summary
(counts, file sizes, distinct queries, the share of requests taken by the top 1 % of queries, words per
title / description / query real vs generated, seconds per phase) is printed and written to
``scale_set.json``. The files' schemas are checked with the index and generate stages' own checks.

    .venv/bin/python bench/scale_set.py --out /tmp/scale_set          # 1M ads, 1M + 100k requests
    .venv/bin/python bench/scale_set.py --out /tmp/s --ads 200000 --targets 200000 --creatives 20000
    .venv/bin/python bench/scale_set.py --smoke [--out DIR]           # seconds: tiny synthetic vocabulary
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

log = logging.getLogger("bench.scale_set")

SHARED_DATA = Path(os.environ.get("ADBATCH_SHARED_DATA", REPO.parent / "shared" / "data"))
HOME_DEPOT = Path("home_depot_relevance") / "train.csv"
SLOGANS = (Path("slogan_gen") / "valid.csv", Path("slogan_gen") / "test-curated.csv")

ADS_FILE = "ads.parquet"
TARGETS_FILE = "requests_targets.parquet"
CREATIVES_FILE = "requests_creatives.parquet"
SUMMARY_FILE = "scale_set.json"

ADS_SCHEMA = pa.schema([("ad_id", pa.string()), ("title", pa.string()), ("advertiser", pa.string()),
                        ("description", pa.string()), ("industry", pa.string())])
TARGETS_SCHEMA = pa.schema([("request_id", pa.string()), ("query", pa.string())])
CREATIVES_SCHEMA = pa.schema([("request_id", pa.string()), ("ad_id", pa.string()), ("advertiser", pa.string()),
                              ("title", pa.string()), ("description", pa.string()), ("industry", pa.string())])

#: a query span is 1..MAX_QUERY_WORDS words
MAX_QUERY_WORDS = 5
#: edge characters stripped from a title word when it becomes a query word
_QUERY_STRIP = ",;:()[]\"'!?*"
#: words a generated query span neither starts nor ends with
_QUERY_EDGE_STOP = frozenset(["a", "an", "and", "by", "for", "in", "of", "on", "or", "the", "to", "with", "x",
                              "&", "-", "+", "/"])


# --------------------------------------------------------------------------- sources
@dataclasses.dataclass
class Sources:
    """The real text the generators learn from."""

    titles: list[str]  #: distinct product titles
    queries: list[str]  #: distinct search terms
    companies: list[str]  #: advertiser names (slogan data alias, else the company title-cased)
    descriptions: list[str]  #: meta descriptions, ``<company>`` where the company's name was
    industries: list[str]  #: one per slogan row (so frequencies are real)
    origin: str  #: "shared data" or "synthetic (smoke)"


def _has_control(text: str) -> bool:
    # Home Depot's latin-1 file holds a few mojibake titles (C1 bytes such as 0x89 0x90): not learnt from
    return any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in text)


def load_sources(data: Path) -> Sources:
    """The Home Depot titles / search terms and the slogan companies / descriptions / industries."""
    missing = [str(data / p) for p in (HOME_DEPOT, *SLOGANS) if not (data / p).is_file()]
    if missing:
        raise SystemExit(f"scale_set: evaluation data not found: {', '.join(missing)} "
                         f"(set --data or ADBATCH_SHARED_DATA; --smoke needs none)")
    titles: dict[str, None] = {}
    queries: dict[str, None] = {}
    with open(data / HOME_DEPOT, encoding="latin-1", newline="") as fh:
        for row in csv.DictReader(fh):
            title = " ".join(row["product_title"].split())
            if title and not _has_control(title):
                titles.setdefault(title)
            query = " ".join(row["search_term"].split())
            if query and not _has_control(query):
                queries.setdefault(query)
    companies: dict[str, None] = {}
    descriptions, industries = [], []
    for rel in SLOGANS:
        with open(data / rel, encoding="utf-8", newline="") as fh:
            for row in csv.DictReader(fh):
                name = (row["alias"] or row["company"].title()).strip()
                if name:
                    companies.setdefault(name)
                if row["desc"].strip():
                    descriptions.append(" ".join(row["desc"].split()))
                industries.append(row["industry"].strip() or "other")
    return Sources(list(titles), list(queries), list(companies), descriptions, industries, "shared data")


def synthetic_sources(seed: int = 0) -> Sources:
    """A tiny made-up vocabulary in the same shapes (for ``--smoke``: no shared data needed)."""
    rng = np.random.default_rng(seed)
    brands = ["Acme", "Bolt", "Cedar", "Delta", "Everbilt", "Fjord", "Granite", "Halo", "Ironclad", "Juniper"]
    sizes = ["1/2 in.", "3/4 in.", "2 ft.", "6 ft.", "10 ft.", "12-Gauge", "18-Volt", "1-gal.", "60 in."]
    adjs = ["Steel", "Oak", "Cordless", "Outdoor", "Heavy Duty", "LED", "Brushed", "Adjustable", "Vinyl", "Copper"]
    nouns = ["Hammer", "Drill", "Faucet", "Ceiling Fan", "Shelf Bracket", "Door Knob", "Hose", "Ladder",
             "Vanity", "Light Fixture", "Paint Roller", "Toilet Seat", "Deck Screw", "Window Blind"]
    colors = ["White", "Black", "Satin Nickel", "Oil Rubbed Bronze", "Chrome", "Gray"]

    def pick(xs):
        return xs[int(rng.integers(len(xs)))]

    titles: dict[str, None] = {}
    while len(titles) < 600:
        parts = [pick(brands)]
        if rng.random() < 0.6:
            parts.append(pick(sizes))
        parts += [pick(adjs) for _ in range(int(rng.integers(0, 3)))] + [pick(nouns)]
        if rng.random() < 0.5:
            parts += ["in", pick(colors)]
        titles.setdefault(" ".join(parts))
    queries = list(dict.fromkeys(f"{pick(adjs)} {pick(nouns)}".lower() for _ in range(80)))
    first = ["North", "Blue", "Prime", "Summit", "Bright", "Urban", "Pacific", "Nova", "Green", "Apex"]
    second = ["Labs", "Works", "Studio", "Digital", "Partners", "Group", "Foods", "Health", "Logistics"]
    companies = list(dict.fromkeys(f"{pick(first)} {pick(second)}" if rng.random() < 0.7 else pick(first)
                                   for _ in range(120)))
    verbs = ["helps", "builds", "delivers", "designs", "offers"]
    objs = ["small businesses", "modern teams", "home owners", "families", "retailers"]
    goods = ["better software", "fresh food", "reliable shipping", "custom furniture", "expert advice"]
    descriptions = [f"<company> {pick(verbs)} {pick(objs)} with {pick(goods)}. "
                    f"{pick(['Call', 'Visit', 'Contact'])} us {pick(['today', 'now', 'online'])}."
                    for _ in range(150)]
    industries = [pick(["internet", "retail", "construction", "food & beverages", "logistics"]) for _ in range(150)]
    return Sources(list(titles), queries, companies, descriptions, industries, "synthetic (smoke)")


# --------------------------------------------------------------------------- the word chain
class WordChain:
    """A word-level Markov chain of order ``k`` in flat arrays, sampled for many texts at once.

    Word id 0 is both the start and the end marker. Each state (the last ``k`` words) owns a run of
    edges ``[offsets[s], offsets[s + 1])``: ``edge_word`` (int32, the next word), ``edge_next`` (int32,
    the state after it; -1 for the end) and ``edge_key`` (float64, ``s + `` the cumulative share of the
    run's counts, so one ``searchsorted(edge_key, s + u)`` picks an edge for every chain at once).
    """

    def __init__(self, texts: Iterable[str], order: int = 2) -> None:
        assert order >= 1, f"order must be >= 1, got {order}"
        self.order = order
        self.words: list[str] = [""]
        ids: dict[str, int] = {"": 0}
        counts: dict[tuple[int, ...], dict[int, int]] = {}  # insertion order: deterministic
        lengths = []
        for text in texts:
            seq = []
            for w in text.split():
                if w not in ids:
                    ids[w] = len(self.words)
                    self.words.append(w)
                seq.append(ids[w])
            lengths.append(len(seq))
            ctx = [0] * order + seq + [0]
            for i in range(order, len(ctx)):
                nxt = counts.setdefault(tuple(ctx[i - order:i]), {})
                nxt[ctx[i]] = nxt.get(ctx[i], 0) + 1
        assert lengths, "no texts to learn from"
        state_of = {key: s for s, key in enumerate(counts)}
        edge_word, edge_next, edge_key = [], [], []
        for s, (key, nxt) in enumerate(counts.items()):
            cum = np.cumsum(np.fromiter(nxt.values(), dtype=np.float64))
            edge_key.append(s + cum / cum[-1])
            edge_word.extend(nxt)
            edge_next.extend(state_of[key[1:] + (w,)] if w else -1 for w in nxt)
        self.edge_word = np.asarray(edge_word, dtype=np.int32)
        self.edge_next = np.asarray(edge_next, dtype=np.int32)
        self.edge_key = np.concatenate(edge_key)  # a run ends at exactly s + 1 (cum / cum[-1] == 1.0)
        self.num_states = len(counts)
        self.real_lengths = np.asarray(lengths, dtype=np.int64)  # words per training text
        self.max_len = int(self.real_lengths.max())

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` texts: word ids ``int32 [n, max_len]`` (0 past the end) and ``lengths int64 [n]``
        (-1 where the chain ran past the longest training text: such a text is not used)."""
        out = np.zeros((n, self.max_len), dtype=np.int32)
        lengths = np.full(n, -1, dtype=np.int64)
        alive = np.arange(n)
        state = np.zeros(n, dtype=np.int64)  # state 0 is the start context (all markers)
        for t in range(self.max_len + 1):
            if alive.size == 0:
                break
            edge = np.searchsorted(self.edge_key, state + rng.random(alive.size), side="right")
            word = self.edge_word[edge]
            ended = word == 0
            lengths[alive[ended]] = t
            if t == self.max_len:
                break
            keep = ~ended
            alive, edge = alive[keep], edge[keep]
            out[alive, t] = word[keep]
            state = self.edge_next[edge].astype(np.int64)
        return out, lengths

    def text(self, ids: np.ndarray) -> str:
        words = self.words
        return " ".join([words[i] for i in ids.tolist()])


def length_quota(real_lengths: np.ndarray, n: int) -> np.ndarray:
    """``int64 [max_len + 1]``: texts of each word count among ``n``, in the real texts' shares
    (largest remainders, so they sum to ``n``)."""
    share = np.bincount(real_lengths) / real_lengths.shape[0]
    raw = share * n
    quota = np.floor(raw).astype(np.int64)
    rest = n - int(quota.sum())
    quota[np.argsort(-(raw - quota), kind="stable")[:rest]] += 1
    return quota


def generate_unique(chain: WordChain, n: int, rng: np.random.Generator, what: str, batch: int = 65536,
                    progress: bool = True) -> tuple[list[str], dict[str, Any]]:
    """``n`` distinct texts from ``chain`` whose word counts follow the training texts' (length quotas).

    A batch that adds fewer than 1 % of its size lifts the quotas (the chain has run out of new texts of
    the missing lengths): the rest come at the chain's own lengths. Raises when even that stalls.
    """
    from tqdm.auto import tqdm

    quota = length_quota(chain.real_lengths, n)
    texts: list[str] = []
    seen: set[str] = set()
    stats = {"candidates": 0, "duplicates": 0, "quota_lifted_at": None}
    lifted = False
    stalled = 0
    with tqdm(total=n, desc=what, unit=what.rstrip("s"), disable=not progress) as bar:
        while len(texts) < n:
            ids, lengths = chain.sample(batch, rng)
            stats["candidates"] += batch
            ok = lengths > 0
            if not lifted:
                ok &= quota[np.maximum(lengths, 0)] > 0
            added = 0
            for row in np.flatnonzero(ok).tolist():
                length = int(lengths[row])
                if not lifted and quota[length] <= 0:
                    continue
                text = chain.text(ids[row, :length])
                if text in seen:
                    stats["duplicates"] += 1
                    continue
                seen.add(text)
                texts.append(text)
                quota[length] -= 1
                added += 1
                if len(texts) == n:
                    break
            bar.update(added)
            if len(texts) < n and added < 0.01 * batch:
                if not lifted:
                    lifted = True
                    stats["quota_lifted_at"] = len(texts)
                    log.warning("%s: length quotas lifted after %d of %d (still open: %s)", what, len(texts), n,
                                {int(k): int(v) for k, v in enumerate(quota) if v > 0})
                else:
                    stalled += 1
                    if stalled >= 20:
                        raise RuntimeError(f"{what}: the chain stopped producing new texts at {len(texts)} of {n}")
    return texts, stats


# --------------------------------------------------------------------------- queries
def query_pool(real: list[str], titles: list[str], size: int, rng: np.random.Generator) -> tuple[list[str], int]:
    """``size`` distinct queries: the real ones (up to ``size``), then 1-5 word lower-case spans of
    ``titles`` whose word counts follow the real queries' (clipped to 1-5). Returns (pool, real used)."""
    pool: dict[str, None] = dict.fromkeys(real[:size])
    n_real = len(pool)
    real_len = np.clip(np.asarray([len(q.split()) for q in real] or [2]), 1, MAX_QUERY_WORDS)
    share = np.bincount(real_len, minlength=MAX_QUERY_WORDS + 1)[1:] / real_len.shape[0]
    tries = 0
    while len(pool) < size:
        k = size - len(pool)
        which = rng.integers(0, len(titles), size=k)
        span = rng.choice(np.arange(1, MAX_QUERY_WORDS + 1), size=k, p=share)
        starts = rng.random(k)
        before = len(pool)
        for t, s, u in zip(which.tolist(), span.tolist(), starts.tolist()):
            words = [w.strip(_QUERY_STRIP).lower() for w in titles[t].split()]
            words = [w for w in words if any(c.isalnum() for c in w)]
            if not words:
                continue
            s = min(s, len(words))
            first = int(u * (len(words) - s + 1))
            span_words = words[first:first + s]
            if span_words[0] in _QUERY_EDGE_STOP or span_words[-1] in _QUERY_EDGE_STOP:
                continue  # "with heater", "faucet in": not how people search
            pool.setdefault(" ".join(span_words))
        tries = tries + 1 if len(pool) == before else 0
        if tries >= 20:
            raise RuntimeError(f"query pool: only {len(pool)} distinct spans found, {size} asked")
    return list(pool)[:size], n_real


def zipf_cdf(pool_size: int, exponent: float) -> np.ndarray:
    """``float64 [pool_size]``: cumulative probability of ranks 1..pool_size, p(r) ~ r ** -exponent."""
    weights = np.arange(1, pool_size + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def zipf_ranks(cdf: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``int64 [n]``: 0-based ranks drawn from ``cdf`` (:func:`zipf_cdf`)."""
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), cdf.shape[0] - 1)


def top_share(counts: np.ndarray, fraction: float = 0.01) -> float:
    """The share of all requests taken by the most frequent ``fraction`` of the distinct queries drawn."""
    drawn = np.sort(counts[counts > 0])[::-1]
    k = max(1, math.ceil(fraction * drawn.shape[0]))
    return float(drawn[:k].sum() / drawn.sum())


# --------------------------------------------------------------------------- writing
def _write_chunks(path: Path, schema: pa.Schema, n: int, chunk: int, make, desc: str, progress: bool) -> None:
    """``make(start, stop) -> dict of columns`` for each chunk, one row group each."""
    from tqdm.auto import tqdm

    # zstd, and dictionaries up to 16 MiB: the 10k advertiser descriptions repeat over 1M ads (the default
    # 1 MiB dictionary page falls back to plain pages: 165 MB instead of 46 MB for the 1M ads)
    with pq.ParquetWriter(path, schema, compression="zstd", dictionary_pagesize_limit=16 << 20) as writer, \
            tqdm(total=n, desc=desc, unit="row", disable=not progress) as bar:
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            writer.write_table(pa.table(make(start, stop), schema=schema), row_group_size=chunk)
            bar.update(stop - start)


def _word_stats(lengths: Iterable[int]) -> dict[str, float]:
    x = np.fromiter(lengths, dtype=np.int64)
    if x.size == 0:
        return {"n": 0}
    return {"n": int(x.size), "mean": round(float(x.mean()), 2), "p50": float(np.percentile(x, 50)),
            "p95": float(np.percentile(x, 95)), "max": int(x.max())}


@dataclasses.dataclass
class ScaleSetConfig:
    ads: int = 1_000_000
    targets: int = 1_000_000
    creatives: int = 100_000
    pool: int = 200_000
    zipf: float = 1.0
    ads_per_advertiser: int = 100
    order: int = 2
    seed: int = 0
    row_group: int = 100_000

    def validate(self) -> None:
        assert self.ads >= 1 and self.targets >= 0 and self.creatives >= 0, "counts must be >= 0 (ads >= 1)"
        assert self.creatives <= self.ads, f"--creatives {self.creatives} > --ads {self.ads}: ads are drawn once each"
        assert self.pool >= 1 and self.zipf >= 0 and self.ads_per_advertiser >= 1 and self.row_group >= 1


def build_scale_set(src: Sources, out: Path, cfg: ScaleSetConfig, progress: bool = True) -> dict[str, Any]:
    """Write the three Parquet files and ``scale_set.json`` under ``out``; return the summary."""
    cfg.validate()
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(cfg.seed)
    seconds: dict[str, float] = {}
    t_all = t = time.perf_counter()

    # ads: titles, then advertisers (name, description, industry)
    title_chain = WordChain(src.titles, cfg.order)
    titles, title_gen = generate_unique(title_chain, cfg.ads, rng, "titles", progress=progress)
    n_adv = max(1, cfg.ads // cfg.ads_per_advertiser)
    names, name_gen = generate_unique(WordChain(src.companies, 1), n_adv, rng, "advertisers", progress=progress)
    desc_chain = WordChain(src.descriptions, 2)
    desc_raw, desc_gen = generate_unique(desc_chain, n_adv, rng, "descriptions", progress=progress)
    descriptions = [d.replace("<company>", name) for d, name in zip(desc_raw, names)]
    industry_names, industry_counts = np.unique(np.asarray(src.industries, dtype=object), return_counts=True)
    industries = industry_names[rng.choice(industry_names.shape[0], n_adv,
                                           p=industry_counts / industry_counts.sum())].tolist()
    advertiser_of = rng.integers(0, n_adv, size=cfg.ads)
    seconds["generate_ads"] = time.perf_counter() - t

    t = time.perf_counter()
    id_width = max(7, len(str(cfg.ads - 1)))
    titles_arr = pa.array(titles, pa.string())
    names_arr, desc_arr, ind_arr = (pa.array(x, pa.string()) for x in (names, descriptions, industries))

    def ad_columns(start: int, stop: int) -> dict[str, Any]:
        adv = pa.array(advertiser_of[start:stop])
        return {"ad_id": [f"ad-{i:0{id_width}d}" for i in range(start, stop)],
                "title": titles_arr.slice(start, stop - start), "advertiser": names_arr.take(adv),
                "description": desc_arr.take(adv), "industry": ind_arr.take(adv)}

    _write_chunks(out / ADS_FILE, ADS_SCHEMA, cfg.ads, cfg.row_group, ad_columns, "write ads", progress)
    seconds["write_ads"] = time.perf_counter() - t

    # target requests: the query pool, Zipf draws over its (random) ranking
    t = time.perf_counter()
    pool, n_real = query_pool(src.queries, titles, cfg.pool, rng)
    # ranks: the real search terms take the head (in random order), the generated spans the tail
    pool = ([pool[i] for i in rng.permutation(n_real).tolist()]
            + [pool[n_real + i] for i in rng.permutation(len(pool) - n_real).tolist()])
    pool_arr = pa.array(pool, pa.string())
    cdf = zipf_cdf(len(pool), cfg.zipf)
    counts = np.zeros(len(pool), dtype=np.int64)

    def target_columns(start: int, stop: int) -> dict[str, Any]:
        ranks = zipf_ranks(cdf, stop - start, rng)
        counts[:] += np.bincount(ranks, minlength=len(pool))
        return {"request_id": [f"t{i:0{id_width}d}" for i in range(start, stop)], "query": pool_arr.take(ranks)}

    _write_chunks(out / TARGETS_FILE, TARGETS_SCHEMA, cfg.targets, cfg.row_group, target_columns,
                  "write targets", progress)
    seconds["targets"] = time.perf_counter() - t

    # creative requests: distinct ads, drawn uniformly
    t = time.perf_counter()
    picked = rng.choice(cfg.ads, size=cfg.creatives, replace=False)

    def creative_columns(start: int, stop: int) -> dict[str, Any]:
        ad = picked[start:stop]
        adv = pa.array(advertiser_of[ad])
        return {"request_id": [f"c{i:0{id_width}d}" for i in range(start, stop)],
                "ad_id": [f"ad-{i:0{id_width}d}" for i in ad.tolist()], "advertiser": names_arr.take(adv),
                "title": titles_arr.take(pa.array(ad)), "description": desc_arr.take(adv),
                "industry": ind_arr.take(adv)}

    _write_chunks(out / CREATIVES_FILE, CREATIVES_SCHEMA, cfg.creatives, cfg.row_group, creative_columns,
                  "write creatives", progress)
    seconds["creatives"] = time.perf_counter() - t

    t = time.perf_counter()
    check_schemas(out)
    seconds["check"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t_all

    real_set = set(src.titles)
    k_pool = max(1, math.ceil(0.01 * len(pool)))
    summary = {
        "config": dataclasses.asdict(cfg),
        "source": src.origin,
        "files": {name: (out / name).stat().st_size for name in (ADS_FILE, TARGETS_FILE, CREATIVES_FILE)},
        "counts": {"ads": cfg.ads, "advertisers": n_adv, "target_requests": cfg.targets,
                   "creative_requests": cfg.creatives},
        "titles": {
            "real_distinct": len(src.titles), "chain_order": cfg.order, "chain_states": title_chain.num_states,
            "words_real": _word_stats(title_chain.real_lengths),
            "words_generated": _word_stats(len(x.split()) for x in titles),
            "chars_real_mean": round(float(np.mean([len(x) for x in src.titles])), 1),
            "chars_generated_mean": round(float(np.mean([len(x) for x in titles])), 1),
            "verbatim_real_titles": sum(x in real_set for x in titles), **title_gen},
        "advertisers": {"names_words_real": _word_stats(len(x.split()) for x in src.companies),
                        "names_words_generated": _word_stats(len(x.split()) for x in names), **name_gen,
                        "description_words_real": _word_stats(desc_chain.real_lengths),
                        "description_words_generated": _word_stats(len(x.split()) for x in desc_raw),
                        "industries": int(industry_names.shape[0])},
        "queries": {
            "pool": len(pool), "pool_real": n_real, "zipf_exponent": cfg.zipf,
            "words_real": _word_stats(len(q.split()) for q in src.queries),
            "words_pool": _word_stats(len(q.split()) for q in pool),
            "distinct_requested": int((counts > 0).sum()),
            "top1pct_of_distinct_share": round(top_share(counts), 4) if cfg.targets else None,
            "top1pct_of_pool_share": round(float(counts[:k_pool].sum() / max(1, cfg.targets)), 4),
            "top1pct_of_pool_share_expected": round(float(cdf[k_pool - 1]), 4),
            "real_query_share": round(float(counts[:n_real].sum() / max(1, cfg.targets)), 4),
            "most_frequent": [[pool[i], int(counts[i])] for i in np.argsort(-counts, kind="stable")[:5].tolist()]},
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def check_schemas(out: Path) -> None:
    """The files' schemas against the index stage's default column mapping and the generate stage's
    request checks (footers only; the tests run the full row validation on the smoke set)."""
    from adbatch.index.corpus import CorpusConfig, check_corpus_schema
    from adbatch.serving.requests import GenerateTask, check_request_schema

    check_corpus_schema(out / ADS_FILE, CorpusConfig())
    check_request_schema(out / TARGETS_FILE, GenerateTask.TARGETS)
    check_request_schema(out / CREATIVES_FILE, GenerateTask.CREATIVES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--smoke", action="store_true",
                    help="seconds on a CPU: a tiny synthetic vocabulary, 200 ads, 1,000 target and 50 creative "
                         "requests (pool 300), in a temp folder unless --out")
    ap.add_argument("--out", default=None, help="output folder (default /tmp/adbatch_scale_set)")
    ap.add_argument("--data", default=str(SHARED_DATA), help="the evaluation data folder (../shared/data)")
    ap.add_argument("--ads", type=int, default=None, help="ads (default 1,000,000)")
    ap.add_argument("--targets", type=int, default=None, help="target requests (default 1,000,000)")
    ap.add_argument("--creatives", type=int, default=None, help="creative requests (default 100,000)")
    ap.add_argument("--pool", type=int, default=None, help="distinct queries to draw from (default 200,000)")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the query ranks (default 1.0)")
    ap.add_argument("--ads-per-advertiser", type=int, default=None,
                    help="ads / this = advertisers (default 100; smoke 10)")
    ap.add_argument("--order", type=int, default=2, help="title chain order (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-group", type=int, default=100_000, help="rows per Parquet row group")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    small = dict(ads=200, targets=1000, creatives=50, pool=300)
    big = dict(ads=1_000_000, targets=1_000_000, creatives=100_000, pool=200_000)
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else (small if args.smoke else big)[k]
             for k in big}
    per_advertiser = args.ads_per_advertiser or (10 if args.smoke else 100)
    cfg = ScaleSetConfig(**sizes, zipf=args.zipf, ads_per_advertiser=per_advertiser, order=args.order,
                         seed=args.seed, row_group=args.row_group)
    if args.out:
        out = Path(args.out)
    elif args.smoke:
        out = Path(tempfile.mkdtemp(prefix="adbatch_scale_set_smoke-"))
    else:
        out = Path(os.environ.get("ADBATCH_BENCH_DIR", "/tmp")) / "adbatch_scale_set"
    t0 = time.perf_counter()
    src = synthetic_sources(args.seed) if args.smoke else load_sources(Path(args.data))
    load_s = time.perf_counter() - t0
    summary = build_scale_set(src, out, cfg, progress=not args.no_progress)
    summary["seconds"]["load_sources"] = round(load_s, 2)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    log.info("wrote %s", out)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
