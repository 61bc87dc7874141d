"""bench/scale_set.py (issue 56 item 1): the smoke set is what the index and generate stages read (their own
validation, and an index built over its ads), ids are unique, a seed fixes the set, the requests are Zipf-skewed
and the titles follow the real titles' word counts. Its --smoke run itself is in test_bench_smoke.py."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import scale_set as ss  # noqa: E402

SMOKE = ss.ScaleSetConfig(ads=200, targets=1000, creatives=50, pool=300, ads_per_advertiser=10, row_group=64)


@pytest.fixture(scope="module")
def smoke_set(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("scale_set")
    return out, ss.build_scale_set(ss.synthetic_sources(0), out, SMOKE, progress=False)


def test_smoke_set_passes_the_stages_own_validation(smoke_set):
    from adbatch.index.corpus import CorpusConfig, read_corpus
    from adbatch.serving.requests import GenerateTask, validate_requests

    out, summary = smoke_set
    corpus = read_corpus(out / ss.ADS_FILE, CorpusConfig())  # the product's default column mapping
    assert corpus.num_ads == 200 and corpus.rejected.num_rows == 0
    targets = validate_requests(out / ss.TARGETS_FILE, GenerateTask.TARGETS)
    assert targets.counts == {"rows_in": 1000, "accepted": 1000, "rejected": 0}
    creatives = validate_requests(out / ss.CREATIVES_FILE, GenerateTask.CREATIVES)
    assert creatives.counts == {"rows_in": 50, "accepted": 50, "rejected": 0}
    assert set(creatives.accepted.column_names) == {"request_id", "ad_id", "advertiser", "title", "description",
                                                    "industry"}
    # a creative request carries its ad's own fields
    ads = {r["ad_id"]: r for r in pq.read_table(out / ss.ADS_FILE).to_pylist()}
    for row in pq.read_table(out / ss.CREATIVES_FILE).to_pylist():
        ad = ads[row["ad_id"]]
        assert [row[k] for k in ("advertiser", "title", "description", "industry")] == \
               [ad[k] for k in ("advertiser", "title", "description", "industry")]
        assert "<company>" not in row["description"] and row["advertiser"] in row["description"]
    assert summary["counts"] == {"ads": 200, "advertisers": 20, "target_requests": 1000, "creative_requests": 50}
    assert pq.ParquetFile(out / ss.ADS_FILE).metadata.num_row_groups == 4  # written in row groups of 64


def test_index_stage_builds_over_the_smoke_ads(smoke_set, tmp_path):
    """The default index config (MiniLM embeddings, text scheme, ``ad_id`` + ``title``) over the 200 ads."""
    from adbatch.index.build import IndexConfig, build_index, load_index
    from adbatch.index.clustering import ClusterConfig

    out, _ = smoke_set
    manifest = build_index(out / ss.ADS_FILE, tmp_path / "idx", IndexConfig(cluster=ClusterConfig(branching=4,
                                                                                                   leaf_size=20)),
                           progress=False)
    ix = load_index(tmp_path / "idx")
    assert manifest["counts"]["ads_indexed"] == ix.num_ads == 200 and manifest["counts"]["rejected"] == 0
    assert sorted(ix.ad_ids) == sorted(pq.read_table(out / ss.ADS_FILE).column("ad_id").to_pylist())


def test_ids_and_titles_are_unique(smoke_set):
    out, _ = smoke_set
    ads = pq.read_table(out / ss.ADS_FILE)
    ids = ads.column("ad_id").to_pylist()
    assert len(set(ids)) == len(ids) == 200 and ids[0] == "ad-0000000" and ids[-1] == "ad-0000199"
    assert len(set(ads.column("title").to_pylist())) == 200
    for name, n in ((ss.TARGETS_FILE, 1000), (ss.CREATIVES_FILE, 50)):
        rids = pq.read_table(out / name).column("request_id").to_pylist()
        assert len(set(rids)) == len(rids) == n
    creative_ads = pq.read_table(out / ss.CREATIVES_FILE).column("ad_id").to_pylist()
    assert len(set(creative_ads)) == 50 and set(creative_ads) <= set(ids)


def test_a_seed_fixes_the_set(smoke_set, tmp_path):
    out, _ = smoke_set
    again = ss.build_scale_set(ss.synthetic_sources(0), tmp_path / "a", SMOKE, progress=False)
    other = ss.build_scale_set(ss.synthetic_sources(0), tmp_path / "b", ss.ScaleSetConfig(
        **{**SMOKE.__dict__, "seed": 1}), progress=False)
    for name in (ss.ADS_FILE, ss.TARGETS_FILE, ss.CREATIVES_FILE):
        assert pq.read_table(tmp_path / "a" / name).equals(pq.read_table(out / name)), name
    assert again["queries"] == smoke_set[1]["queries"]
    titles = pq.read_table(out / ss.ADS_FILE).column("title").to_pylist()
    assert pq.read_table(tmp_path / "b" / ss.ADS_FILE).column("title").to_pylist() != titles
    assert other["counts"] == again["counts"]


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.0, 1.2])
def test_zipf_draws_give_the_head_its_expected_share(exponent):
    pool, n = 10_000, 200_000
    cdf = ss.zipf_cdf(pool, exponent)
    ranks = ss.zipf_ranks(cdf, n, np.random.default_rng(0))
    assert ranks.min() >= 0 and ranks.max() < pool
    counts = np.bincount(ranks, minlength=pool)
    expected = (np.arange(1, 101, dtype=float) ** -exponent).sum() / (np.arange(1, pool + 1, dtype=float)
                                                                       ** -exponent).sum()
    assert cdf[99] == pytest.approx(expected)
    assert counts[:100].sum() / n == pytest.approx(expected, abs=0.01)  # top 1 % of the pool
    if exponent == 1.0:  # H(100) / H(10,000): the head 1 % takes about half of all requests
        assert 0.52 < expected < 0.54


def test_the_requests_file_has_the_summarys_skew(smoke_set):
    out, summary = smoke_set
    queries = pq.read_table(out / ss.TARGETS_FILE).column("query").to_pylist()
    counts = np.asarray(sorted(Counter(queries).values(), reverse=True))
    q = summary["queries"]
    assert q["distinct_requested"] == counts.shape[0] < q["pool"]
    assert q["top1pct_of_distinct_share"] == round(ss.top_share(counts), 4)
    # pool 300 -> the top 3 ranks; Zipf(1) expects H(3) / H(300) of the requests there
    assert q["top1pct_of_pool_share_expected"] == pytest.approx(
        sum(1 / r for r in range(1, 4)) / sum(1 / r for r in range(1, 301)), abs=1e-4)
    assert abs(q["top1pct_of_pool_share"] - q["top1pct_of_pool_share_expected"]) < 0.05
    assert counts[0] / counts.sum() > 0.1  # the rank-1 query alone: about 1 / H(300) = 16 %
    # real search terms take the head ranks: they carry more than their share of the pool
    assert q["real_query_share"] > 2 * q["pool_real"] / q["pool"]


def test_titles_follow_the_real_word_counts_and_the_chain(smoke_set):
    out, summary = smoke_set
    src = ss.synthetic_sources(0)
    chain = ss.WordChain(src.titles, 2)
    titles = pq.read_table(out / ss.ADS_FILE).column("title").to_pylist()
    assert summary["titles"]["quota_lifted_at"] is None
    got = np.bincount([len(t.split()) for t in titles], minlength=chain.max_len + 1)
    assert got.tolist() == ss.length_quota(chain.real_lengths, 200).tolist()
    # every generated (w1, w2) -> w3 step is one seen in a real title (start / end markers included)
    seen = set()
    for t in src.titles:
        w = ["", ""] + t.split() + [""]
        seen.update(zip(w, w[1:], w[2:]))
    for t in titles:
        w = ["", ""] + t.split() + [""]
        assert set(zip(w, w[1:], w[2:])) <= seen, t


def test_length_quota_sums_to_n_in_the_real_shares():
    real = np.asarray([1, 2, 2, 3, 3, 3, 3, 10])
    q = ss.length_quota(real, 1000)
    assert q.sum() == 1000 and q.tolist() == [0, 125, 250, 500, 0, 0, 0, 0, 0, 0, 125]


@pytest.mark.shareddata
def test_real_data_titles_and_queries(shared_data, tmp_path):
    """2,000 ads from the Home Depot / slogan vocabularies: real word counts, mostly new titles, real queries
    in the pool."""
    src = ss.load_sources(shared_data)
    assert len(src.titles) > 50_000 and len(src.queries) > 11_000
    summary = ss.build_scale_set(src, tmp_path, ss.ScaleSetConfig(ads=2000, targets=3000, creatives=10,
                                                                   pool=20_000), progress=False)
    t = summary["titles"]
    assert t["words_generated"]["p50"] == t["words_real"]["p50"]
    assert abs(t["words_generated"]["mean"] - t["words_real"]["mean"]) < 0.1
    assert t["verbatim_real_titles"] < 0.1 * 2000
    assert summary["queries"]["pool_real"] == len(src.queries)


def test_missing_data_fails_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="evaluation data not found.*--smoke needs none"):
        ss.main(["--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
