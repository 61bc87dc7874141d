"""Home Depot and slogan loaders: split disjointness, determinism, subset contents, qrels."""

from __future__ import annotations

import pytest

from adbatch.config import ConfigError
from adbatch.eval.datasets import (HomeDepotConfig, QuerySplit, load_home_depot, load_slogan_test,
                              normalize_query, split_queries)


def test_normalize_query():
    assert normalize_query("  Angle   Bracket ") == "angle bracket"


def test_split_is_deterministic_and_roughly_proportional():
    qs = [f"query {i}" for i in range(4000)]
    a = split_queries(qs, (0.8, 0.1, 0.1), seed=0)
    assert a == split_queries(list(reversed(qs)), (0.8, 0.1, 0.1), seed=0)
    counts = {s: sum(1 for v in a.values() if v is s) for s in QuerySplit}
    assert 0.77 < counts[QuerySplit.TRAIN] / 4000 < 0.83
    assert split_queries(qs, (0.8, 0.1, 0.1), seed=1) != a


def test_config_validation():
    with pytest.raises(ConfigError, match="split_fractions"):
        HomeDepotConfig(split_fractions=(0.5, 0.1, 0.1))
    with pytest.raises(ConfigError, match="catalogue_size"):
        HomeDepotConfig(catalogue_size=0)
    with pytest.raises(ConfigError, match="churn"):
        HomeDepotConfig(churn=1.0)
    with pytest.raises(ConfigError, match="churn needs a catalogue subset"):
        HomeDepotConfig(churn=0.1, catalogue_size=None)


def test_tiny_csv(tmp_path):
    csv = tmp_path / "hd.csv"
    rows = ['"id","product_uid","product_title","search_term","relevance"']
    for i in range(60):
        rows.append(f'{i},{100 + i},"Title {i} caf\xe9","query {i % 30}",{3 if i % 2 else 1.67}')
    rows.append('999,100,"Title 0 variant","Query  0",3')  # title variant + normalised query
    csv.write_bytes("\n".join(rows).encode("latin-1"))
    data = load_home_depot(HomeDepotConfig(csv_path=csv, catalogue_size=20, relevant_fraction=0.5))
    assert data.catalogue.num_rows == 20
    assert data.stats["title_variants"] == 1
    titles = data.titles_by_id()
    full = load_home_depot(HomeDepotConfig(csv_path=csv, catalogue_size=None))
    assert full.catalogue.num_rows == 60 and full.titles_by_id()[100] == "Title 0 café"
    assert len(set(data.catalogue.column("ad_id").to_pylist())) == 20
    # every query with qrels has a relevant ad in the catalogue; grades are per product
    for split in QuerySplit:
        for q, grades in data.qrels[split].items():
            assert any(g >= 2.67 and ad in titles for ad, g in grades.items())
    assert "query 0" in data.split_of and "Query  0" not in data.split_of
    # the next night: 25 % of the 20 products replaced by outside ones, splits unchanged
    night2 = load_home_depot(HomeDepotConfig(csv_path=csv, catalogue_size=20, relevant_fraction=0.5, churn=0.25))
    a, b = data.catalogue.column("ad_id").to_pylist(), night2.catalogue.column("ad_id").to_pylist()
    assert len(b) == len(set(b)) == 20 and len(set(a) - set(b)) == 5 and len(set(b) - set(a)) == 5
    assert night2.split_of == data.split_of
    again = load_home_depot(HomeDepotConfig(csv_path=csv, catalogue_size=20, relevant_fraction=0.5, churn=0.25))
    assert again.catalogue.column("ad_id").to_pylist() == b


@pytest.mark.parametrize("size", [5000, None])
def test_home_depot_real(home_depot_csv, size):
    data = load_home_depot(HomeDepotConfig(csv_path=home_depot_csv, catalogue_size=size))
    n = data.catalogue.num_rows
    assert n == (5000 if size else 54667)
    ids = data.catalogue.column("ad_id").to_pylist()
    assert len(set(ids)) == n
    splits = [set(data.qrels[s]) for s in QuerySplit]
    assert not (splits[0] & splits[1]) and not (splits[0] & splits[2]) and not (splits[1] & splits[2])
    # each query's qrels sit in the split assigned to it
    for s in QuerySplit:
        assert all(data.split_of[q] is s for q in data.qrels[s])
    assert len(data.queries(QuerySplit.TEST)) > (250 if size else 900)
    ids_set = set(ids)
    for q, grades in data.qrels[QuerySplit.TEST].items():
        assert set(grades) <= ids_set
        assert max(grades.values()) >= 2.67
    if size:  # the subset is deterministic
        again = load_home_depot(HomeDepotConfig(csv_path=home_depot_csv, catalogue_size=size))
        assert again.catalogue.column("ad_id").to_pylist() == ids


def test_slogan_test(shared_data):
    path = shared_data / "slogan_gen" / "test-curated.csv"
    if not path.is_file():
        pytest.skip("test-curated.csv absent")
    table = load_slogan_test(path)
    assert table.num_rows == 994
    assert table.column_names == ["ad_id", "advertiser", "description", "industry", "url", "reference"]
    assert all(table.column("reference").to_pylist())
