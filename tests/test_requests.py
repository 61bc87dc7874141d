"""Request contracts: file-level errors raise before any model loads; bad rows are rejected with
reasons; accepted rows are normalized, unique and sorted."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adbatch.serving.requests import (CREATIVES_OUT_SCHEMA, REJECTED_SCHEMA, TARGETS_OUT_SCHEMA, GenerateTask,
                              RequestSchemaError, RequestValidationConfig, validate_requests)


def _write(path, **cols):
    pq.write_table(pa.table(cols), path)
    return path


def test_target_rows_rejected_with_reasons(tmp_path):
    path = _write(tmp_path / "r.parquet",
                  request_id=["b", "a", None, "c", "d", "e", "e", "f", "f"],
                  query=["drill bits", "  lamp  ", "x", None, "   ", "q" * 50, "same", "one", "two"])
    v = validate_requests(path, GenerateTask.TARGETS, RequestValidationConfig(max_query_chars=20))
    # "e" has one oversized copy (rejected) and one valid copy, which is answered
    assert v.accepted.column("request_id").to_pylist() == ["a", "b", "e"]
    assert v.accepted.column("query").to_pylist() == ["lamp", "drill bits", "same"]  # stripped
    reasons = dict(zip(v.rejected.column("row").to_pylist(), v.rejected.column("reason").to_pylist()))
    assert sorted(reasons) == [2, 3, 4, 5, 7, 8]
    assert "request_id is null" in reasons[2]
    assert reasons[3] == "query is null"
    assert reasons[4] == "query is empty"
    assert "oversized" in reasons[5] and "50 chars" in reasons[5]
    assert reasons[7].startswith("duplicate request_id 'f' with conflicting content")
    assert reasons[8] == reasons[7]
    assert v.rejected.schema == REJECTED_SCHEMA
    assert v.counts == {"rows_in": 9, "accepted": 3, "rejected": 6}
    assert v.counts["accepted"] + v.counts["rejected"] == 9  # nothing dropped silently


def test_identical_duplicates_keep_the_first(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=["x", "y", "x"], query=["saw", "glue", "saw"])
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["x", "y"]
    assert v.rejected.num_rows == 1
    assert v.rejected.column("row").to_pylist() == [2]
    assert "identical copy" in v.rejected.column("reason")[0].as_py()


def test_integer_and_float_ids_are_normalized_or_rejected(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=pa.array([3.0, 1.5, float("nan"), 2.0]),
                  query=["a", "b", "c", "d"])
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["2", "3"]
    assert v.rejected.num_rows == 2
    assert all("not an integer or string" in r for r in v.rejected.column("reason").to_pylist())


def test_binary_query_with_bad_utf8_is_a_wrong_type_row(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=["a", "b"],
                  query=pa.array([b"fine query", b"\xff\xfe bad"], pa.binary()))
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("query").to_pylist() == ["fine query"]
    assert "wrong type" in v.rejected.column("reason")[0].as_py()


def test_missing_column_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=["a"], text=["no query column"])
    with pytest.raises(RequestSchemaError, match=r"missing required column\(s\) \['query'\]"):
        validate_requests(path, GenerateTask.TARGETS)


def test_wrong_column_type_is_a_clear_error(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=["a"], query=pa.array([1.5]))
    with pytest.raises(RequestSchemaError, match="column 'query' has type double"):
        validate_requests(path, GenerateTask.TARGETS)


def test_corrupt_parquet_is_a_clear_error(tmp_path):
    good = _write(tmp_path / "good.parquet", request_id=["a"], query=["q"])
    bad = tmp_path / "bad.parquet"
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # truncated: footer gone
    with pytest.raises(RequestSchemaError, match="bad.parquet: not a readable Parquet"):
        validate_requests(bad, GenerateTask.TARGETS)
    (tmp_path / "notparquet.parquet").write_text("hello")
    with pytest.raises(RequestSchemaError, match="notparquet.parquet"):
        validate_requests(tmp_path / "notparquet.parquet", GenerateTask.TARGETS)
    with pytest.raises(RequestSchemaError, match="not found"):
        validate_requests(tmp_path / "absent.parquet", GenerateTask.TARGETS)


def test_folder_of_parts_with_cross_file_duplicates(tmp_path):
    d = tmp_path / "reqs"
    d.mkdir()
    _write(d / "part-0.parquet", request_id=[1, 2], query=["a", "b"])
    _write(d / "part-1.parquet", request_id=[2, 3], query=["b", "c"])
    v = validate_requests(d, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["1", "2", "3"]
    assert v.rejected.column("file").to_pylist() == [str(d / "part-1.parquet")]


def test_creative_requests(tmp_path):
    path = _write(tmp_path / "c.parquet", request_id=["r1", "r2", "r3", "r4"],
                  ad_id=["a1", None, "a3", "a4"],
                  advertiser=["Acme", "B", None, "D"],
                  description=["We sell drills.", "x", "  ", "y" * 50])
    v = validate_requests(path, GenerateTask.CREATIVES, RequestValidationConfig(max_ad_chars=40))
    assert v.accepted.column("request_id").to_pylist() == ["r1"]
    assert v.accepted.column_names == ["request_id", "ad_id", "advertiser", "description"]
    reasons = v.rejected.column("reason").to_pylist()
    assert "ad_id is null" in reasons[0]
    assert "no ad text" in reasons[1]
    assert "oversized" in reasons[2]


def test_creative_requests_need_an_ad_field(tmp_path):
    path = _write(tmp_path / "c.parquet", request_id=["r1"], ad_id=["a1"], title_typo=["x"])
    with pytest.raises(RequestSchemaError, match="at least one of the ad fields"):
        validate_requests(path, GenerateTask.CREATIVES)


def test_output_schemas_have_the_contract_columns():
    assert TARGETS_OUT_SCHEMA.names[:8] == ["request_id", "rank", "ad_id", "score", "score_generative", "score_dense",
                                            "channel", "code"]
    assert CREATIVES_OUT_SCHEMA.names == ["request_id", "ad_id", "variant", "headline", "score", "flags"]


def _invalid_utf8_strings(values):
    """A *string* column holding bytes that are not UTF-8 (as some writers produce)."""
    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


def test_string_column_with_invalid_utf8_rejects_the_row(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=_invalid_utf8_strings([b"a", b"b", b"\xff id"]),
                  query=_invalid_utf8_strings([b"drill bits", b"\xff\xfe bad", b"lamp"]))
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["a"]
    assert v.accepted.column("query").to_pylist() == ["drill bits"]
    reasons = dict(zip(v.rejected.column("row").to_pylist(), v.rejected.column("reason").to_pylist()))
    assert reasons[1] == "query is not valid UTF-8 text (wrong type)"
    assert reasons[2].startswith("request_id is null, empty or not an integer/string")
    assert v.counts == {"rows_in": 3, "accepted": 1, "rejected": 2}


def test_all_null_column_rejects_its_rows_not_the_job(tmp_path):
    # pandas writes an all-None (or empty) object column as Arrow type null: those rows are null
    # values, row problems, not a file of the wrong type
    (tmp_path / "req").mkdir()
    _write(tmp_path / "req" / "a.parquet", request_id=["a"], query=["drill bits"])
    _write(tmp_path / "req" / "b.parquet", request_id=["b", "c"], query=pa.array([None, None]))
    _write(tmp_path / "req" / "c.parquet", request_id=pa.array([None]), query=["lamp"])
    v = validate_requests(tmp_path / "req", GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["a"]
    assert sorted(v.rejected.column("reason").to_pylist()) == [
        "query is null", "query is null", "request_id is null, empty or not an integer/string"]
    with pytest.raises(RequestSchemaError, match="'query' has type int64"):
        validate_requests(_write(tmp_path / "d.parquet", request_id=["x"], query=[3]), GenerateTask.TARGETS)


def test_identical_creative_copies_with_an_extra_empty_field_are_not_a_conflict(tmp_path):
    (tmp_path / "req").mkdir()
    _write(tmp_path / "req" / "a.parquet", request_id=["r1"], ad_id=["x"], title=["Acme drills"])
    # the same ad re-exported with one more column, empty for this ad
    _write(tmp_path / "req" / "b.parquet", request_id=["r1", "r2", "r2"], ad_id=["x", "y", "y"],
           title=["Acme drills", "Lamps", "Lamps"], description=pa.array([None, "  ", None], pa.string()))
    v = validate_requests(tmp_path / "req", GenerateTask.CREATIVES)
    assert v.accepted.column("request_id").to_pylist() == ["r1", "r2"]
    assert v.rejected.num_rows == 2
    assert all("identical copy" in r for r in v.rejected.column("reason").to_pylist())


def test_duplicate_column_name_is_a_schema_error_naming_the_file(tmp_path):
    path = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["x"]), pa.array(["y"])],
                                        names=["request_id", "query", "query"]), path)
    with pytest.raises(RequestSchemaError, match=r"r\.parquet: repeated column name\(s\): 'query' 2 times"):
        validate_requests(path, GenerateTask.TARGETS)


def test_invisible_only_query_and_ad_text_are_empty(tmp_path):
    """A query or ad field of only zero-width characters is empty, not a prompt of invisible text."""
    path = _write(tmp_path / "r.parquet", request_id=["a", "b"], query=["\u200b\u2060", "lamp\u200b"])
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["b"]
    assert v.rejected.column("reason").to_pylist() == ["query is empty"]
    path = _write(tmp_path / "c.parquet", request_id=["a", "b"], ad_id=["1", "\ufeff"], title=["\u200b", "saw"])
    v = validate_requests(path, GenerateTask.CREATIVES)
    assert v.accepted.num_rows == 0
    reasons = v.rejected.column("reason").to_pylist()
    assert reasons[0].startswith("no ad text") and reasons[1].startswith("ad_id is null, empty")


def test_control_only_query_is_empty(tmp_path):
    path = _write(tmp_path / "r.parquet", request_id=["a", "b"], query=["\x00\x00", "lamp\x00"])
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == ["b"]
    assert v.rejected.column("reason").to_pylist() == ["query is empty"]


def test_ids_are_kept_byte_exact(tmp_path):
    """Issue 19 item 9: ids were stripped (' padded ' came out as 'padded'), so 'd3', 'd3 ' and ' d3'
    merged into one id and were all rejected as conflicting. They are three ids; blank ones are still
    rejected with a reason."""
    path = _write(tmp_path / "r.parquet", request_id=[" padded ", "d3", "d3 ", " d3", "\t", "x\x00"],
                  query=["saw", "drill", "lamp", "glue", "rug", "tile"])
    v = validate_requests(path, GenerateTask.TARGETS)
    assert v.accepted.column("request_id").to_pylist() == sorted([" padded ", "d3", "d3 ", " d3", "x\x00"])
    assert dict(zip(v.accepted.column("request_id").to_pylist(), v.accepted.column("query").to_pylist()))["d3 "] == "lamp"
    assert v.rejected.column("row").to_pylist() == [4]
    assert v.rejected.column("reason")[0].as_py().startswith("request_id is null, empty")
    path = _write(tmp_path / "c.parquet", request_id=["r1", "r2", "r3"], ad_id=[" a7 ", "a7", " "],
                  title=["Acme", "Acme", "Acme"])
    v = validate_requests(path, GenerateTask.CREATIVES)
    assert v.accepted.column("ad_id").to_pylist() == [" a7 ", "a7"]
    assert v.rejected.column("reason").to_pylist() == ["ad_id is null, empty or not an integer/string"]


def test_corrupt_data_pages_name_the_file(tmp_path):
    """Bytes corrupted inside the data pages (footer intact) are caught when the rows are read, by the
    same reader the corpus uses, naming the file."""
    n = 2000
    path = _write(tmp_path / "r.parquet", request_id=[f"r{i}" for i in range(n)],
                  query=[f"query number {i} words" for i in range(n)])
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(RequestSchemaError, match=r"r\.parquet: corrupt Parquet data"):
        validate_requests(path, GenerateTask.TARGETS)


@pytest.mark.parametrize("batch_rows", [1, 3, 64])
@pytest.mark.parametrize("task", [GenerateTask.TARGETS, GenerateTask.CREATIVES])
def test_validation_in_batches_equals_one_pass(tmp_path, monkeypatch, task, batch_rows):
    """Files are validated VALIDATE_BATCH_ROWS rows at a time (the driver holds no Python object per request
    beyond one batch): duplicates that straddle batches and files, rejected rows' numbers and raw values, the
    accepted columns (a field only some files carry) come out as in a single pass."""
    import random

    import adbatch.serving.requests as req

    rnd = random.Random(7)
    d = tmp_path / "reqs"
    d.mkdir()
    for k, fields in enumerate((["advertiser"], ["advertiser", "title"], ["description"])):
        n = 20
        ids = [rnd.choice([None, " ", f"r{rnd.randint(0, 12)}", f"r{rnd.randint(0, 12)} "]) for _ in range(n)]
        cols = {"request_id": ids}
        texts = ["drill", "  lamp ", "", None, "x" * 30]
        if task is GenerateTask.TARGETS:
            cols["query"] = [rnd.choice(texts) for _ in range(n)]
        else:
            cols["ad_id"] = [rnd.choice([None, "a1", "a2"]) for _ in range(n)]
            cols.update({f: [rnd.choice(texts) for _ in range(n)] for f in fields})
        # identical copies (file 0, rows 0 and 19: the first is answered), copies that disagree (files 1 and 2)
        for rid, row, text in [("twin", 0, "drill"), ("twin", 19, "drill")] if k == 0 else [("clash", 3 * k, f"lamp {k}")]:
            for c in cols:
                cols[c][row] = {"request_id": rid, "ad_id": "a1"}.get(c, text)
        _write(d / f"part-{k}.parquet", **cols)
    cfg = RequestValidationConfig(max_query_chars=20, max_ad_chars=25)
    monkeypatch.setattr(req, "VALIDATE_BATCH_ROWS", 1 << 20)
    whole = validate_requests(d, task, cfg)
    monkeypatch.setattr(req, "VALIDATE_BATCH_ROWS", batch_rows)
    batched = validate_requests(d, task, cfg)
    assert batched.accepted.equals(whole.accepted) and batched.rejected.equals(whole.rejected)
    assert whole.accepted.num_rows > 3 and whole.rows_in == 60
    reasons = whole.rejected.column("reason").to_pylist()
    assert any("conflicting" in r for r in reasons) and any("identical copy" in r for r in reasons)
    ids = whole.accepted.column("request_id").to_pylist()
    assert ids == sorted(set(ids))
    assert whole.accepted.num_rows + whole.rejected.num_rows == 60  # nothing dropped silently
