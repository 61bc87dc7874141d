"""The ad corpus input contract: Parquet in, validated columns out, bad rows set aside with a reason.

A corpus is a Parquet file, a folder of Parquet parts, or a glob. :class:`CorpusConfig` maps the
user's column names onto ours:

=============  ========================================================  ===========
ours           type                                                       required
=============  ========================================================  ===========
``ad_id``      string or integer (unique)                                 yes
``text``       string (the ad's main text, e.g. the title)                yes
``description``, ``keywords``, ``category``  string                       no
``embedding``  fixed_size_list<float32> (or list<float32/float64>)        no
=============  ========================================================  ===========

Schema problems (a mapped column missing, a wrong type, files that disagree) raise
:class:`CorpusSchemaError` naming the column before any work is done. Row problems never stop a run
and are never dropped silently: each such row is returned in :attr:`Corpus.rejected` with a
:class:`RejectReason`, and the index stage writes them to ``rejected.parquet``.
"""

from __future__ import annotations

import dataclasses
import enum
import glob as globlib
import logging
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from adbatch.artifacts import sha256_paths
from adbatch.config import ConfigBase, ConfigError

# Characters that render as nothing: control characters (Unicode Cc, e.g. NUL) and format characters
# (Cf: zero-width space / non-joiner / joiner, word joiner, BOM, ...). Neither Python's str.strip nor
# Arrow's utf8_trim_whitespace removes them, so a title of only these would pass a plain "blank?" test
# and reach training / prompts as an invisible ad.
INVISIBLE_CHARS = "\u200b\u200c\u200d\u2060\ufeff"  # the common Cf ones (documentation, tests)
_INVISIBLE_RE = r"[\p{Cc}\p{Cf}]"


def is_blank(text: str) -> bool:
    """True when ``text`` has no visible character (whitespace, control and format characters only)."""
    return all(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") for ch in text)


def invalid_utf8_rows(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """``bool [len(col)]``: rows of a string column whose bytes are not valid UTF-8. Arrow's readers do
    not check (its string kernels raise later, naming no row); one full validation first, so a valid
    column costs no per-row work."""
    try:
        col.validate(full=True)
        return np.zeros(len(col), dtype=bool)
    except pa.ArrowInvalid:
        pass
    binary = pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary()
    out = np.zeros(len(col), dtype=bool)
    for i, v in enumerate(col.cast(binary).to_pylist()):
        if v is not None:
            try:
                v.decode("utf-8")
            except UnicodeDecodeError:
                out[i] = True
    return out


def visible_lengths(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Per row, the length of a string column without control / format characters and outer
    whitespace (0 where null): the vectorized :func:`is_blank`."""
    cleaned = pc.utf8_trim_whitespace(pc.replace_substring_regex(col, _INVISIBLE_RE, ""))
    return np.nan_to_num(pc.utf8_length(cleaned).to_numpy(zero_copy_only=False)).astype(np.int64)

log = logging.getLogger(__name__)

#: largest finite float32; an embedding whose squared norm exceeds it is rejected
F32_MAX = float(np.finfo(np.float32).max)

#: the normalized column names of :attr:`Corpus.table`
OPTIONAL_TEXT_FIELDS = ("description", "keywords", "category")


class CorpusSchemaError(ValueError):
    """The corpus files cannot be read with the configured column mapping."""


# What pyarrow raises for a file that is not Parquet, is cut short or has corrupt pages (e.g.
# "OSError: Corrupt snappy compressed data." -- which names no file).
_PARQUET_READ_ERRORS = (OSError, pa.ArrowException)


def read_parquet_schema(path: Path, error: type[Exception] = CorpusSchemaError) -> pa.Schema:
    """The schema of one Parquet file (its footer); ``error`` naming the file when it has none."""
    try:
        return pq.read_schema(path)
    except _PARQUET_READ_ERRORS as exc:
        raise error(f"{path}: not a readable Parquet file ({exc})") from None


def read_parquet_table(path: Path, columns: list[str] | None = None,
                       error: type[Exception] = CorpusSchemaError) -> pa.Table:
    """The rows of one Parquet file; ``error`` naming the file when its data pages cannot be read
    (bytes corrupted inside the file while the footer, hence the schema, is intact)."""
    try:
        return pq.read_table(path, columns=columns)
    except _PARQUET_READ_ERRORS as exc:
        raise error(f"{path}: corrupt Parquet data ({exc})") from None


class RejectReason(str, enum.Enum):
    """Why a row was set aside (the ``reason`` column of ``rejected.parquet``)."""

    INVALID_UTF8 = "invalid_utf8"
    NULL_AD_ID = "null_ad_id"
    EMPTY_TEXT = "empty_text"
    TEXT_TOO_LONG = "text_too_long"
    DUPLICATE_AD_ID = "duplicate_ad_id"
    NULL_EMBEDDING = "null_embedding"
    BAD_EMBEDDING_LENGTH = "bad_embedding_length"
    NON_FINITE_EMBEDDING = "non_finite_embedding"
    EMBEDDING_OUT_OF_RANGE = "embedding_out_of_range"
    ZERO_EMBEDDING = "zero_embedding"


REJECTED_SCHEMA = pa.schema([
    ("source_file", pa.string()),
    ("source_row", pa.int64()),   # row number inside source_file
    ("ad_id", pa.string()),       # as text, whatever the corpus type (null when missing)
    ("reason", pa.string()),      # a RejectReason value
    ("detail", pa.string()),
])


@dataclasses.dataclass
class CorpusConfig(ConfigBase):
    """Column mapping and row limits of an ad corpus."""

    ad_id: str = dataclasses.field(default="ad_id", metadata={"help": "column holding the unique ad id"})
    text: str = dataclasses.field(default="title", metadata={"help": "column holding the ad's main text"})
    description: str | None = dataclasses.field(default=None, metadata={"help": "optional description column"})
    keywords: str | None = dataclasses.field(default=None, metadata={"help": "optional keywords column"})
    category: str | None = dataclasses.field(default=None, metadata={"help": "optional category column"})
    embedding: str | None = dataclasses.field(
        default=None, metadata={"help": "optional precomputed embedding column (list<float32>)"})
    embedding_dim: int | None = dataclasses.field(
        default=None, metadata={"help": "expected embedding length (default: from the schema, "
                                        "else the most common length)"})
    max_text_chars: int = dataclasses.field(
        default=2000, metadata={"help": "rows whose text is longer are rejected"})

    def validate(self) -> None:
        for name in ("ad_id", "text"):
            if not getattr(self, name):
                raise ConfigError(f"CorpusConfig.{name}: a column name is required")
        if self.max_text_chars < 1:
            raise ConfigError("CorpusConfig.max_text_chars: must be >= 1")
        if self.embedding_dim is not None and self.embedding_dim < 1:
            raise ConfigError("CorpusConfig.embedding_dim: must be >= 1")
        mapped = [v for v in self.mapping().values()]
        if len(set(mapped)) != len(mapped):
            raise ConfigError(f"CorpusConfig: a source column is mapped twice: {self.mapping()}")

    def mapping(self) -> dict[str, str]:
        """our name -> the corpus column, for every mapped field."""
        out = {"ad_id": self.ad_id, "text": self.text}
        for name in (*OPTIONAL_TEXT_FIELDS, "embedding"):
            col = getattr(self, name)
            if col:
                out[name] = col
        return out


@dataclasses.dataclass
class Corpus:
    """A validated corpus.

    ``table`` has the accepted rows with columns ``ad_id`` (string or int64), ``text`` and the
    mapped optional text fields (string), ``source_file`` and ``source_row``. ``embeddings`` is
    ``float32 [len(table), D]`` when the corpus brought its own, else None. ``rejected`` follows
    :data:`REJECTED_SCHEMA`.
    """

    table: pa.Table
    embeddings: np.ndarray | None
    rejected: pa.Table
    paths: list[Path]
    input_hash: str
    num_input_rows: int

    @property
    def num_ads(self) -> int:
        return self.table.num_rows

    def rejected_counts(self) -> dict[str, int]:
        if self.rejected.num_rows == 0:
            return {}
        reasons = self.rejected.column("reason").to_pylist()
        return {r: reasons.count(r) for r in sorted(set(reasons))}

    def embedding_inputs(self) -> list[str]:
        """Text fed to the sentence encoder per ad: category, text, description, keywords."""
        parts = []
        for name in ("category", "text", "description", "keywords"):
            if name in self.table.column_names:
                parts.append(pc.fill_null(self.table.column(name), ""))
        joined = pc.binary_join_element_wise(*parts, ". ") if len(parts) > 1 else parts[0]
        # collapse the separators left by empty optional fields
        cleaned = pc.replace_substring_regex(joined, r"^(\. )+|(\. )+$", "")
        cleaned = pc.replace_substring_regex(cleaned, r"(\. ){2,}", ". ")
        return cleaned.to_pylist()


def resolve_corpus_paths(path: str | Path) -> list[Path]:
    """A file, a folder (its ``*.parquet`` files, recursively) or a glob -> sorted Parquet files."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(x for x in p.rglob("*.parquet") if x.is_file())
        if not files:
            raise FileNotFoundError(f"no *.parquet files under {p}")
        return files
    matches = sorted(Path(x) for x in globlib.glob(str(path), recursive=True) if Path(x).is_file())
    if not matches:
        raise FileNotFoundError(f"corpus {path!r}: no such file, folder, or glob match")
    return matches


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _check_schema(paths: list[Path], cfg: CorpusConfig) -> tuple[str, int | None]:
    """Validate every file's schema; return (ad_id kind 'string'|'int', fixed embedding dim)."""
    id_kind: str | None = None
    fixed_dim: int | None = None
    for path in paths:
        schema = read_parquet_schema(path)
        for ours, col in cfg.mapping().items():
            if col not in schema.names:
                raise CorpusSchemaError(
                    f"{path}: column {col!r} (mapped to {ours}) is missing; columns: {schema.names}")
            t = schema.field(col).type
            if ours == "ad_id":
                kind = "string" if _is_string(t) else "int" if pa.types.is_integer(t) else None
                if kind is None:
                    raise CorpusSchemaError(
                        f"{path}: column {col!r} (ad_id) must be string or integer, got {t}")
                if id_kind is not None and kind != id_kind:
                    raise CorpusSchemaError(
                        f"{path}: column {col!r} (ad_id) is {kind} here but {id_kind} in other files")
                id_kind = kind
            elif ours == "embedding":
                ok_list = (pa.types.is_fixed_size_list(t) or pa.types.is_list(t)
                           or pa.types.is_large_list(t))
                if not ok_list or not (pa.types.is_float32(t.value_type)
                                       or pa.types.is_float64(t.value_type)):
                    raise CorpusSchemaError(
                        f"{path}: column {col!r} (embedding) must be a list of float32, got {t}")
                if pa.types.is_fixed_size_list(t):
                    if fixed_dim is not None and t.list_size != fixed_dim:
                        raise CorpusSchemaError(
                            f"{path}: column {col!r} (embedding) has size {t.list_size}, "
                            f"other files {fixed_dim}")
                    fixed_dim = t.list_size
            elif not _is_string(t):
                raise CorpusSchemaError(f"{path}: column {col!r} ({ours}) must be string, got {t}")
    if fixed_dim is not None and cfg.embedding_dim is not None and fixed_dim != cfg.embedding_dim:
        raise CorpusSchemaError(f"column {cfg.embedding!r} (embedding) has size {fixed_dim} but "
                                f"embedding_dim={cfg.embedding_dim} was configured")
    assert id_kind is not None
    return id_kind, fixed_dim


def check_corpus_schema(path: str | Path, config: CorpusConfig | None = None) -> list[Path]:
    """The corpus's Parquet files (:func:`resolve_corpus_paths`), each file's schema checked against
    ``config``'s column mapping without reading a row (what :func:`read_corpus` checks first): for a driver
    checking a corpus that a later step reads in full."""
    paths = resolve_corpus_paths(path)
    _check_schema(paths, config or CorpusConfig())
    return paths


def read_corpus(path: str | Path, config: CorpusConfig | None = None) -> Corpus:
    """Read and validate a corpus. Schema errors raise; row errors land in ``Corpus.rejected``."""
    cfg = config or CorpusConfig()
    paths = resolve_corpus_paths(path)
    id_kind, fixed_dim = _check_schema(paths, cfg)
    mapping = cfg.mapping()
    parts = []
    not_utf8_parts: list[np.ndarray] = []  # per part, per row: the column whose bytes are not UTF-8
    for path_i in paths:
        t = read_parquet_table(path_i, columns=list(mapping.values()))
        cols = {ours: t.column(col) for ours, col in mapping.items()}
        # string values whose bytes are not UTF-8 (writers that do not check produce them) would make
        # every string kernel below raise for the whole corpus: such a row is nulled here and rejected
        not_utf8 = np.full(t.num_rows, "", dtype=object)
        for ours, col in cols.items():
            if ours != "embedding" and _is_string(col.type):
                bad = invalid_utf8_rows(col)
                if bad.any():
                    cols[ours] = pc.if_else(pa.array(bad), pa.scalar(None, col.type), col)
                    not_utf8[bad & (not_utf8 == "")] = mapping[ours]
        try:
            cols["ad_id"] = cols["ad_id"].cast(pa.string() if id_kind == "string" else pa.int64())
        except pa.ArrowInvalid as exc:  # e.g. uint64 ids above 2**63 - 1
            raise CorpusSchemaError(f"{path_i}: column {cfg.ad_id!r} (ad_id) does not fit int64: {exc}") from None
        for name in ("text", *OPTIONAL_TEXT_FIELDS):
            if name in cols:
                cols[name] = cols[name].cast(pa.string())
        if "embedding" in cols:
            cols["embedding"] = cols["embedding"].cast(pa.list_(pa.float32()))
        cols["source_file"] = pa.array([str(path_i)] * t.num_rows, pa.string())
        cols["source_row"] = pa.array(np.arange(t.num_rows, dtype=np.int64))
        not_utf8_parts.append(not_utf8)
        parts.append(pa.table(cols))
    table = pa.concat_tables(parts).combine_chunks()
    n = table.num_rows
    reason = np.full(n, "", dtype=object)
    detail = np.full(n, "", dtype=object)

    def flag(mask: np.ndarray, why: RejectReason, what: str | np.ndarray) -> None:
        new = mask & (reason == "")  # the first problem found is the one reported
        reason[new] = why.value
        detail[new] = what if isinstance(what, str) else what[new]

    not_utf8 = np.concatenate(not_utf8_parts)  # row order of the concatenated table
    flag(not_utf8 != "", RejectReason.INVALID_UTF8,
         np.array([f"column {c!r} holds bytes that are not UTF-8" for c in not_utf8], object))
    ad_null = table.column("ad_id").is_null().to_numpy(zero_copy_only=False)
    if id_kind == "string":  # a blank id joins to nothing downstream: as unusable as a null one
        ad_null = ad_null | (visible_lengths(table.column("ad_id")) == 0)
    flag(ad_null, RejectReason.NULL_AD_ID, f"column {cfg.ad_id!r} is null or blank")
    text = table.column("text")
    empty = text.is_null().to_numpy(zero_copy_only=False) | (visible_lengths(text) == 0)
    flag(empty, RejectReason.EMPTY_TEXT, f"column {cfg.text!r} is null or blank")
    lengths = np.nan_to_num(pc.utf8_length(text).to_numpy(zero_copy_only=False)).astype(np.int64)
    too_long = lengths > cfg.max_text_chars
    flag(too_long, RejectReason.TEXT_TOO_LONG,
         np.array([f"{x} chars > max_text_chars={cfg.max_text_chars}" for x in lengths], object)
         if too_long.any() else "")

    embeddings = None
    if "embedding" in table.column_names:
        emb_col = table.column("embedding")
        emb_null = emb_col.is_null().to_numpy(zero_copy_only=False)
        flag(emb_null, RejectReason.NULL_EMBEDDING, f"column {cfg.embedding!r} is null")
        emb_len = np.nan_to_num(pc.list_value_length(emb_col).to_numpy(zero_copy_only=False)
                                ).astype(np.int64)
        dim = cfg.embedding_dim or fixed_dim
        if dim is None:
            valid_lengths = emb_len[~emb_null & (emb_len > 0)]
            if valid_lengths.size == 0:
                raise CorpusSchemaError(f"column {cfg.embedding!r} (embedding) holds no vectors")
            dim = int(np.bincount(valid_lengths).argmax())
        bad_len = ~emb_null & (emb_len != dim)
        flag(bad_len, RejectReason.BAD_EMBEDDING_LENGTH,
             np.array([f"length {x} != {dim}" for x in emb_len], object) if bad_len.any() else "")
        ok_shape = ~emb_null & ~bad_len
        flat = pc.list_flatten(emb_col.filter(pa.array(ok_shape))).to_numpy(zero_copy_only=False)
        mat = np.asarray(flat, dtype=np.float32).reshape(-1, dim)
        shaped = np.flatnonzero(ok_shape)
        finite = np.ones(n, dtype=bool)
        finite[shaped] = np.isfinite(mat).all(axis=1)
        flag(~finite, RejectReason.NON_FINITE_EMBEDDING,
             "NaN or infinity in the vector (or a float64 value beyond float32's range)")
        # squared norms in float64: a finite float32 vector can still have one that overflows float32
        # (16 x 1e20 -> 1.6e41), and k-means distances then become inf / NaN
        sq_norm = np.zeros(n, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            sq_norm[shaped] = np.einsum("ij,ij->i", mat, mat, dtype=np.float64)
        too_big = finite & (sq_norm > F32_MAX)
        flag(too_big, RejectReason.EMBEDDING_OUT_OF_RANGE,
             np.array([f"squared norm {x:.3g} overflows float32 (max {F32_MAX:.3g})" for x in sq_norm], object)
             if too_big.any() else "")
        zero = ok_shape & finite & (sq_norm == 0.0)
        flag(zero, RejectReason.ZERO_EMBEDDING, "all-zero vector: no direction to cluster by "
                                                "(a placeholder for a missing embedding?)")
        embeddings = np.zeros((n, dim), dtype=np.float32)
        embeddings[ok_shape] = mat

    # Duplicates last, among rows otherwise fine: the first good occurrence wins.
    ok = reason == ""
    ids_ok = table.column("ad_id").filter(pa.array(ok)).combine_chunks()
    # strings: compare Arrow's exact values (numpy's astype(str) drops trailing NULs: "a" == "a\x00")
    keys = (ids_ok.dictionary_encode().indices.to_numpy(zero_copy_only=False) if id_kind == "string"
            else ids_ok.to_numpy(zero_copy_only=False))
    _, first_idx, inverse = np.unique(keys, return_index=True, return_inverse=True)
    ok_rows = np.flatnonzero(ok)
    dup = np.zeros(n, dtype=bool)
    is_dup_ok = np.ones(ok_rows.shape[0], dtype=bool)
    is_dup_ok[first_idx] = False
    dup[ok_rows[is_dup_ok]] = True
    first_global = ok_rows[first_idx[inverse]]
    dup_detail = np.full(n, "", dtype=object)
    if dup.any():
        src_rows = table.column("source_row").to_numpy()
        src_files = table.column("source_file").to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(is_dup_ok):  # only over duplicates, usually few
            g = first_global[i]
            dup_detail[ok_rows[i]] = f"first seen at {src_files[g]} row {src_rows[g]}"
    flag(dup, RejectReason.DUPLICATE_AD_ID, dup_detail)

    keep = reason == ""
    rejected_idx = np.flatnonzero(~keep)
    rej = table.take(pa.array(rejected_idx, pa.int64()))
    rejected = pa.table({
        "source_file": rej.column("source_file"),
        "source_row": rej.column("source_row"),
        "ad_id": rej.column("ad_id").cast(pa.string()),
        "reason": pa.array(reason[rejected_idx].tolist(), pa.string()),
        "detail": pa.array(detail[rejected_idx].tolist(), pa.string()),
    }, schema=REJECTED_SCHEMA)
    accepted = table.filter(pa.array(keep))
    if "embedding" in accepted.column_names:
        accepted = accepted.drop_columns(["embedding"])
        embeddings = np.ascontiguousarray(embeddings[keep])
    if rejected.num_rows:
        log.warning("corpus: %d of %d rows rejected (%s)", rejected.num_rows, n,
                    ", ".join(f"{k}={v}" for k, v in
                              Corpus(accepted, None, rejected, [], "", n).rejected_counts().items()))
    return Corpus(table=accepted, embeddings=embeddings, rejected=rejected, paths=paths,
                  input_hash=sha256_paths(paths), num_input_rows=n)
