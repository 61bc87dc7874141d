"""Corpus input contract: schema errors up front, row problems rejected with a reason."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adbatch.config import ConfigError
from adbatch.index.corpus import (
    REJECTED_SCHEMA, CorpusConfig, CorpusSchemaError, RejectReason, read_corpus,
    resolve_corpus_paths,
)


def _write(path, **cols):
    pq.write_table(pa.table(cols), path)
    return path


def _emb(rows: list[list[float] | None], fixed: int | None = None) -> pa.Array:
    if fixed is None:
        return pa.array(rows, pa.list_(pa.float32()))
    flat = pa.array([x for r in rows for x in r], pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, fixed)


def test_example_corpus_reads_clean(example_ads):
    cfg = CorpusConfig(description="description", category="industry")
    c = read_corpus(example_ads, cfg)
    assert c.num_ads == 5346 and c.rejected.num_rows == 0
    assert c.table.column_names == ["ad_id", "text", "description", "category", "source_file",
                                    "source_row"]
    assert c.table.column("ad_id").type == pa.string()
    first = c.embedding_inputs()[0]
    assert first.startswith("computer hardware. Taking Care of Small Business Technology. The latest")
    assert len(c.input_hash) == 64


@pytest.mark.parametrize("cols,cfg,match", [
    (dict(ad_id=[1, 2], name=["a", "b"]), CorpusConfig(), "'title'"),
    (dict(id=[1, 2], title=["a", "b"]), CorpusConfig(), "'ad_id'"),
    (dict(ad_id=[1.0, 2.0], title=["a", "b"]), CorpusConfig(), "ad_id.*string or integer"),
    (dict(ad_id=[1, 2], title=[1, 2]), CorpusConfig(), "'title'.*must be string"),
    (dict(ad_id=[1, 2], title=["a", "b"], cat=[1, 2]), CorpusConfig(category="cat"), "'cat'"),
    (dict(ad_id=[1, 2], title=["a", "b"], v=["x", "y"]), CorpusConfig(embedding="v"),
     "'v'.*list of float32"),
    (dict(ad_id=[1, 2], title=["a", "b"], v=pa.array([[1], [2]], pa.list_(pa.int32()))),
     CorpusConfig(embedding="v"), "'v'.*list of float32"),
])
def test_schema_errors_name_the_column(tmp_path, cols, cfg, match):
    path = _write(tmp_path / "c.parquet", **cols)
    with pytest.raises(CorpusSchemaError, match=match):
        read_corpus(path, cfg)


def test_fixed_size_embedding_dim_mismatch_is_schema_error(tmp_path):
    path = _write(tmp_path / "c.parquet", ad_id=[1, 2], title=["a", "b"],
                  emb=_emb([[1, 2, 3], [4, 5, 6]], fixed=3))
    with pytest.raises(CorpusSchemaError, match="embedding_dim=4"):
        read_corpus(path, CorpusConfig(embedding="emb", embedding_dim=4))


def test_mixed_id_types_across_parts(tmp_path):
    _write(tmp_path / "a.parquet", ad_id=[1, 2], title=["a", "b"])
    _write(tmp_path / "b.parquet", ad_id=["x"], title=["c"])
    with pytest.raises(CorpusSchemaError, match="ad_id.*other files"):
        read_corpus(tmp_path)


def test_config_rejects_double_mapping():
    with pytest.raises(ConfigError, match="mapped twice"):
        CorpusConfig(text="title", description="title")


def test_folder_glob_and_file(tmp_path):
    (tmp_path / "parts").mkdir()
    _write(tmp_path / "parts" / "p1.parquet", ad_id=[1, 2], title=["a", "b"])
    _write(tmp_path / "parts" / "p0.parquet", ad_id=[3], title=["c"])
    assert [p.name for p in resolve_corpus_paths(tmp_path / "parts")] == ["p0.parquet",
                                                                          "p1.parquet"]
    assert len(resolve_corpus_paths(str(tmp_path / "parts" / "p*.parquet"))) == 2
    c = read_corpus(tmp_path / "parts")
    assert c.table.column("ad_id").to_pylist() == [3, 1, 2]
    assert c.table.column("ad_id").type == pa.int64()
    with pytest.raises(FileNotFoundError):
        resolve_corpus_paths(tmp_path / "nothing*.parquet")


def test_row_problems_are_rejected_with_reasons(tmp_path):
    d = 3
    good = [0.1, 0.2, 0.3]
    path = _write(
        tmp_path / "c.parquet",
        ad_id=pa.array(["a", "b", "c", None, "a", "e", "f", "g", "h", "i", "j"]),
        title=pa.array(["ok", None, "   ", "x", "dup", "x" * 50, "ok2", "ok3", "ok4", "ok5", "ok6"]),
        emb=_emb([good, good, good, good, good, good, [0.1, 0.2], None, [np.nan, 0.0, 0.0],
                  [np.inf, 0.0, 0.0], good]),
    )
    c = read_corpus(path, CorpusConfig(embedding="emb", max_text_chars=20))
    assert c.table.column("ad_id").to_pylist() == ["a", "j"]
    assert c.embeddings.shape == (2, d) and np.allclose(c.embeddings, [good, good])
    rej = {r["ad_id"]: r["reason"] for r in c.rejected.to_pylist()}
    assert rej == {
        "b": RejectReason.EMPTY_TEXT.value, "c": RejectReason.EMPTY_TEXT.value,
        None: RejectReason.NULL_AD_ID.value, "e": RejectReason.TEXT_TOO_LONG.value,
        "f": RejectReason.BAD_EMBEDDING_LENGTH.value, "g": RejectReason.NULL_EMBEDDING.value,
        "h": RejectReason.NON_FINITE_EMBEDDING.value, "i": RejectReason.NON_FINITE_EMBEDDING.value,
    } | {"a": RejectReason.DUPLICATE_AD_ID.value}
    assert c.rejected.schema == REJECTED_SCHEMA
    dup = [r for r in c.rejected.to_pylist() if r["reason"] == "duplicate_ad_id"][0]
    assert dup["source_row"] == 4 and "row 0" in dup["detail"]
    assert c.rejected_counts() == {"bad_embedding_length": 1, "duplicate_ad_id": 1,
                                   "empty_text": 2, "non_finite_embedding": 2,
                                   "null_ad_id": 1, "null_embedding": 1, "text_too_long": 1}
    assert c.num_input_rows == 11
    assert c.num_ads + c.rejected.num_rows == c.num_input_rows


def test_duplicate_keeps_first_valid_occurrence(tmp_path):
    # the first "a" is invalid (blank text), so the second one is the one kept
    path = _write(tmp_path / "c.parquet", ad_id=[7, 7, 7], title=["", "kept", "dropped"])
    c = read_corpus(path)
    assert c.table.column("text").to_pylist() == ["kept"]
    assert sorted(c.rejected.column("reason").to_pylist()) == ["duplicate_ad_id", "empty_text"]


def test_embedding_dim_inferred_from_most_common_length(tmp_path):
    rows = [[1.0, 0.0]] * 5 + [[1.0, 0.0, 0.0]]
    path = _write(tmp_path / "c.parquet", ad_id=list(range(6)), title=["t"] * 6, emb=_emb(rows))
    c = read_corpus(path, CorpusConfig(embedding="emb"))
    assert c.embeddings.shape == (5, 2)
    assert c.rejected.column("detail").to_pylist() == ["length 3 != 2"]


def test_optional_fields_join_for_embedding(tmp_path):
    path = _write(tmp_path / "c.parquet", ad_id=[1, 2], title=["Drill", "Saw"],
                  desc=pa.array(["cordless", None]), cat=pa.array([None, "tools"]))
    c = read_corpus(path, CorpusConfig(description="desc", category="cat"))
    assert c.embedding_inputs() == ["Drill. cordless", "tools. Saw"]


def test_distinct_string_ids_that_differ_only_by_trailing_nul_are_not_duplicates(tmp_path):
    """"a" and "a\\x00" are different ids; numpy's fixed-width str (astype(str)) drops trailing NULs."""
    p = _write(tmp_path / "c.parquet", ad_id=["a", "a\x00", "b"], title=["x y", "z w", "q r"])
    c = read_corpus(p)
    assert c.table.column("ad_id").to_pylist() == ["a", "a\x00", "b"]
    assert c.rejected.num_rows == 0


def test_duplicates_still_found_with_nulls_and_parts(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    _write(d / "p0.parquet", ad_id=["a", None, "b"], title=["x", "y", "z"])
    _write(d / "p1.parquet", ad_id=["b", "c", "a"], title=["u", "v", "w"])
    c = read_corpus(d)
    assert c.table.column("ad_id").to_pylist() == ["a", "b", "c"]
    assert sorted(c.rejected.column("reason").to_pylist()) == ["duplicate_ad_id", "duplicate_ad_id", "null_ad_id"]


def test_uint64_ids_beyond_int64_are_a_schema_error_naming_the_column(tmp_path):
    p = _write(tmp_path / "c.parquet", ad_id=pa.array([1, 2**63 + 5], pa.uint64()), title=["x", "y"])
    with pytest.raises(CorpusSchemaError, match="ad_id"):
        read_corpus(p)
    ok = _write(tmp_path / "ok.parquet", ad_id=pa.array([1, 2**62], pa.uint64()), title=["x", "y"])
    assert read_corpus(ok).table.column("ad_id").to_pylist() == [1, 2**62]


def test_blank_string_ids_are_rejected_like_null_ones(tmp_path):
    p = _write(tmp_path / "c.parquet", ad_id=["a", "", "  ", "b"], title=["x y", "z w", "q r", "s t"])
    c = read_corpus(p)
    assert c.table.column("ad_id").to_pylist() == ["a", "b"]
    assert c.rejected.column("reason").to_pylist() == ["null_ad_id", "null_ad_id"]


def test_invisible_only_text_and_ids_are_blank(tmp_path):
    """Zero-width spaces, joiners and BOMs render as nothing but are not whitespace to str.strip or
    Arrow's trim: a title or id of only these is rejected like a blank one; visible text around them stays."""
    p = _write(tmp_path / "c.parquet", ad_id=["a", "b", "\u200b", "d"],
               title=["x y", "\u200b\ufeff \u200d", "q r", "s\u200bt"])
    c = read_corpus(p)
    assert c.table.column("ad_id").to_pylist() == ["a", "d"]
    assert sorted(c.rejected.column("reason").to_pylist()) == ["empty_text", "null_ad_id"]


def test_control_only_text_and_ids_are_blank(tmp_path):
    """NUL and other control characters render as nothing: a title or id of only these (with or without
    whitespace) is rejected like a blank one; visible text around a control character stays."""
    p = _write(tmp_path / "c.parquet", ad_id=["a", "b", "\x00", "d", "e"],
               title=["x y", "\x00\x00", "q r", "s\x07t", " \x1f\u00ad "])
    c = read_corpus(p)
    assert c.table.column("ad_id").to_pylist() == ["a", "d"]
    assert sorted(c.rejected.column("reason").to_pylist()) == ["empty_text", "empty_text", "null_ad_id"]


def test_vectors_whose_squared_norm_overflows_float32_are_rejected(tmp_path):
    """Issue 19 item 2: 16 x 1e20 is finite in float32 but its squared norm (1.6e41) is not; such a row
    broke the whole build (NaN probabilities in k-means++, an abort in FAISS). It is rejected, named,
    with a reason; a vector just inside the range and an all-zero one are told apart."""
    ok = [0.5] * 16
    rows = [ok, [1e20] * 16, [3e38] * 16, [4e18] * 16, [0.0] * 16, [-1e19] + [0.0] * 15, ok]
    p = _write(tmp_path / "c.parquet", ad_id=[f"a{i}" for i in range(7)], title=[f"t {i}" for i in range(7)],
               emb=_emb(rows))
    c = read_corpus(p, CorpusConfig(embedding="emb"))
    rej = {r["ad_id"]: (r["reason"], r["detail"]) for r in c.rejected.to_pylist()}
    assert set(rej) == {"a1", "a2", "a4"}
    assert rej["a1"][0] == rej["a2"][0] == RejectReason.EMBEDDING_OUT_OF_RANGE.value
    assert "squared norm 1.6e+41 overflows float32" in rej["a1"][1]
    assert rej["a4"][0] == RejectReason.ZERO_EMBEDDING.value
    assert c.table.column("ad_id").to_pylist() == ["a0", "a3", "a5", "a6"]
    assert np.isfinite(c.embeddings).all() and c.embeddings.shape == (4, 16)
    assert c.num_ads + c.rejected.num_rows == c.num_input_rows == 7


def test_float64_values_beyond_float32_are_rejected_not_cast_to_inf(tmp_path):
    rows = pa.array([[1e300, 0.0], [0.25, 0.5]], pa.list_(pa.float64()))
    p = _write(tmp_path / "c.parquet", ad_id=["big", "ok"], title=["x y", "z w"], emb=rows)
    c = read_corpus(p, CorpusConfig(embedding="emb"))
    assert c.rejected.to_pylist()[0]["ad_id"] == "big"
    assert c.rejected.to_pylist()[0]["reason"] == RejectReason.NON_FINITE_EMBEDDING.value
    assert c.embeddings.tolist() == [[0.25, 0.5]]


def _corrupt_middle(path, span: int = 64) -> None:
    """Flip bytes in the middle of a Parquet file (inside its data pages); the footer stays intact."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + span):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("as_part", [False, True])
def test_corrupt_data_pages_raise_naming_the_file(tmp_path, as_part):
    """Issue 19 item 8: bytes corrupted mid-file gave a bare 'OSError: Corrupt snappy compressed data.'
    naming no file; alone or as one part of a folder, the error names the file."""
    n = 2000
    d = tmp_path / "parts"
    d.mkdir()
    bad = _write(d / "p1.parquet", ad_id=[f"b{i}" for i in range(n)], title=[f"title {i} with words" for i in range(n)])
    _corrupt_middle(bad)
    pq.read_schema(bad)  # the footer is intact: only reading the rows finds it
    if as_part:
        _write(d / "p0.parquet", ad_id=["a"], title=["fine"])
    with pytest.raises(CorpusSchemaError, match=r"p1\.parquet: corrupt Parquet data \(.*[Cc]orrupt"):
        read_corpus(d if as_part else bad)
