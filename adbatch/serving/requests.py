"""Request and output contracts of the generate stage, and up-front request validation.

Two tasks read Parquet requests and write Parquet outputs whose schemas are defined here, once:

- ``targets``: in ``request_id, query`` -> out :data:`TARGETS_OUT_SCHEMA` (one row per request and
  rank: ``request_id, rank, ad_id, score, score_generative, score_dense, channel, code, verify_mode,
  batch_beams_verified``).
- ``creatives``: in ``request_id, ad_id`` + ad/product fields (any of
  :data:`adbatch.serving.prompts.CREATIVE_FIELDS`) -> out :data:`CREATIVES_OUT_SCHEMA` (one row per request
  and variant: ``request_id, ad_id, variant, headline, score, flags``; ``flags`` lists the checks the headline
  failed, :class:`adbatch.serving.checks.CreativeFlag` values, empty when it passed them all).

Validation happens before any model loads. A problem with the *file* (missing, not Parquet,
corrupt, a required column absent or of a type that cannot hold the value) raises
:class:`RequestSchemaError` naming the file and column. A problem with a *row* (null, empty or
oversized query, a request_id that is not an integer or string, a duplicate request_id, an ad with no
text at all) sends the row to :data:`REJECTED_SCHEMA` with a reason; it is counted, never dropped.

``request_id`` is carried as a string in every output (integer ids are rendered in decimal), so one
schema serves both kinds of input ids; ``ad_id`` likewise. String ids are kept byte-exact (never
stripped: ``' d3'``, ``'d3'`` and ``'d3 '`` are three requests); one with no visible character
(empty, whitespace, control or format characters only) is rejected.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from adbatch.config import ConfigBase, ConfigError
from adbatch.index.corpus import is_blank, read_parquet_schema, read_parquet_table
from adbatch.serving.prompts import CREATIVE_FIELDS


class GenerateTask(str, enum.Enum):
    """Which generation workload a request file is for."""

    TARGETS = "targets"  #: query -> ranked ad ids (trie-constrained beam search)
    CREATIVES = "creatives"  #: ad/product record -> headline variants


class RejectStage(str, enum.Enum):
    """Where a row was turned away."""

    VALIDATE = "validate"  #: before any model ran (bad row content)
    GENERATE = "generate"  #: the generator could not answer it (e.g. out of memory at batch size 1)


class RequestSchemaError(ValueError):
    """The request file itself is unusable (missing, corrupt, a column absent or mistyped)."""


#: columns every targets request file must have
TARGETS_IN_COLUMNS = ("request_id", "query")
#: columns every creatives request file must have (plus at least one of CREATIVE_FIELDS)
CREATIVES_IN_COLUMNS = ("request_id", "ad_id")

TARGETS_OUT_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),  # 1 = best
        pa.field("ad_id", pa.string(), nullable=False),
        # the ranking score: the fused score (hybrid), the log-prob (generative) or the cosine (dense)
        pa.field("score", pa.float32(), nullable=False),
        # exact sequence log-prob (length-penalized); null when the generative channel did not run (dense)
        pa.field("score_generative", pa.float32()),
        pa.field("score_dense", pa.float32()),  # cosine of query and ad; null when the dense channel did not run
        pa.field("channel", pa.string()),  # who proposed the ad: generative | dense | both
        pa.field("code", pa.list_(pa.int32())),  # the ad's semantic-ID path in the index
        pa.field("verify_mode", pa.string()),  # the search's VerifyMode value (off / auto / always)
        # beams finished by prefix-tree parallel verification in the decode batch this request ran
        # in (the decoder reports it per batch, not per query)
        pa.field("batch_beams_verified", pa.int32()),
    ]
)

CREATIVES_OUT_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("ad_id", pa.string(), nullable=False),
        pa.field("variant", pa.int32(), nullable=False),  # 0-based, best first for beam search
        pa.field("headline", pa.string(), nullable=False),
        pa.field("score", pa.float32(), nullable=False),  # mean log-prob per generated token
        # the checks the headline failed (adbatch.serving.checks.CreativeFlag values); empty = passed all
        pa.field("flags", pa.list_(pa.string()), nullable=False),
    ]
)

REJECTED_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string()),  # null when the id itself was unusable
        pa.field("file", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),  # 0-based row number inside ``file``
        pa.field("stage", pa.string(), nullable=False),  # a RejectStage value
        pa.field("reason", pa.string(), nullable=False),
        pa.field("raw", pa.string(), nullable=False),  # the row as JSON (truncated), for debugging
    ]
)


def output_schema(task: GenerateTask) -> pa.Schema:
    return TARGETS_OUT_SCHEMA if task is GenerateTask.TARGETS else CREATIVES_OUT_SCHEMA


@dataclasses.dataclass
class RequestValidationConfig(ConfigBase):
    """Limits applied to each request row."""

    max_query_chars: int = dataclasses.field(
        default=1000, metadata={"help": "queries longer than this are rejected (oversized)"}
    )
    max_ad_chars: int = dataclasses.field(
        default=4000, metadata={"help": "creative requests whose fields total more are rejected"}
    )

    def validate(self) -> None:
        if self.max_query_chars < 1:
            raise ConfigError("RequestValidationConfig.max_query_chars must be >= 1")
        if self.max_ad_chars < 1:
            raise ConfigError("RequestValidationConfig.max_ad_chars must be >= 1")


@dataclasses.dataclass
class ValidatedRequests:
    """Accepted rows (sorted by request_id, columns normalized) and rejected rows with reasons."""

    task: GenerateTask
    accepted: pa.Table  #: request_id string + task columns, sorted by request_id, ids unique
    rejected: pa.Table  #: REJECTED_SCHEMA
    files: list[Path]
    rows_in: int

    @property
    def counts(self) -> dict[str, int]:
        return {"rows_in": self.rows_in, "accepted": self.accepted.num_rows,
                "rejected": self.rejected.num_rows}


def list_request_files(path: str | Path) -> list[Path]:
    """A Parquet file, or every ``*.parquet`` file under a folder (sorted, so order is stable)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if not p.name.startswith((".", "_")))
        if not files:
            raise RequestSchemaError(f"requests folder {path} holds no *.parquet files")
        return files
    raise RequestSchemaError(f"requests not found: {path}")


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_id_type(t: pa.DataType) -> bool:
    return _is_text(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or _is_binary(t)


def check_request_schema(path: str | Path, task: GenerateTask) -> list[Path]:
    """Open every request file and check its columns, without reading the rows of a model.

    Raises :class:`RequestSchemaError` naming the file and the column. Returns the file list.
    """
    files = list_request_files(path)
    required = TARGETS_IN_COLUMNS if task is GenerateTask.TARGETS else CREATIVES_IN_COLUMNS
    for f in files:
        schema = read_parquet_schema(f, RequestSchemaError)
        names = set(schema.names)
        missing = [c for c in required if c not in names]
        if missing:
            raise RequestSchemaError(
                f"{f}: missing required column(s) {missing} for task {task.value!r}; "
                f"found {sorted(names)}"
            )
        repeated = sorted(c for c in names if schema.names.count(c) > 1)
        if repeated:
            raise RequestSchemaError(f"{f}: repeated column name(s): " + ", ".join(
                f"{c!r} {schema.names.count(c)} times" for c in repeated))
        for col in required:
            t = schema.field(col).type
            # type null: every value is null (pandas writes an all-None column so), a row problem
            ok = pa.types.is_null(t) or (
                _is_id_type(t) if col in ("request_id", "ad_id") else (_is_text(t) or _is_binary(t)))
            if not ok:
                want = "string or integer" if col in ("request_id", "ad_id") else "string"
                raise RequestSchemaError(f"{f}: column {col!r} has type {t}, expected {want}")
        if task is GenerateTask.CREATIVES:
            fields = [c for c in CREATIVE_FIELDS if c in names]
            if not fields:
                raise RequestSchemaError(
                    f"{f}: creatives requests need at least one of the ad fields {list(CREATIVE_FIELDS)}"
                )
            for col in fields:
                t = schema.field(col).type
                if not (_is_text(t) or _is_binary(t) or pa.types.is_null(t)):
                    raise RequestSchemaError(f"{f}: column {col!r} has type {t}, expected string")
    return files


def check_request_data(path: str | Path, task: GenerateTask) -> list[Path]:
    """:func:`check_request_schema`, then every file's data pages read once (nothing kept): a file whose
    bytes are corrupted inside while its footer (the schema) is intact is refused naming it, before a run
    that reads it only at its end (the refresh's generate stage) spends hours. Returns the file list."""
    files = check_request_schema(path, task)
    for f in files:
        read_parquet_table(f, error=RequestSchemaError)
    return files


def _id_to_str(value: Any) -> str | None:
    """An id value's string form, byte-exact (``' a7 '`` stays ``' a7 '``: downstream systems join on
    the id as they wrote it); integers in decimal. None when it cannot serve as an id: null, not
    UTF-8, a non-integral float, or blank (only whitespace / control / format characters)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or value != int(value):
            return None
        value = int(value)
    text = str(value)
    return None if is_blank(text) else text


def _text_value(value: Any) -> tuple[str | None, str | None]:
    """(text, problem): decode bytes as UTF-8; a non-text value is a wrong type."""
    if value is None:
        return None, "null"
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), None
        except UnicodeDecodeError:
            return None, "not valid UTF-8 text (wrong type)"
    if not isinstance(value, str):
        return None, f"wrong type {type(value).__name__}, expected string"
    return value, None


def _column_values(column: pa.ChunkedArray) -> list[Any]:
    """The column's Python values. A string column holding bytes that are not UTF-8 (some writers do
    not check) gives those values as ``bytes``, which the row checks reject, instead of raising."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        binary = (pa.large_binary() if pa.types.is_large_string(column.type) else
                  pa.binary_view() if pa.types.is_string_view(column.type) else pa.binary())
        values = []
        for v in column.cast(binary).to_pylist():
            if v is not None:
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError:
                    pass
            values.append(v)
        return values


def _prompt_content(row: dict[str, Any]) -> dict[str, Any]:
    """A row's fields that reach the prompt: absent, null and empty fields render the same prompt, so
    two copies differing only there are identical, not conflicting."""
    return {k: v for k, v in row.items() if v}


def _raw_json(row: dict[str, Any], limit: int = 500) -> str:
    return json.dumps(row, default=lambda v: v.hex() if isinstance(v, bytes) else str(v))[:limit]


#: rows of a request file validated at a time: the Python objects of the row checks live for one batch; what is
#: kept across batches is columnar (the accepted rows' Arrow columns) or a rejected row
VALIDATE_BATCH_ROWS = 8_192
#: columns a candidate row carries until the duplicate check: its file (index into ``files``) and row there
_FILE_COL, _ROW_COL = "_file", "_row"


def _request_batches(path: Path, columns: list[str], rows: int) -> Iterator[pa.Table]:
    """The ``columns`` of one request file, ``rows`` at a time, in file order; a file whose data pages cannot be
    read (corrupt bytes inside, the footer intact) raises :class:`RequestSchemaError` naming it."""
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=columns):
            yield pa.Table.from_batches([batch])
    except (OSError, pa.ArrowException) as exc:
        raise RequestSchemaError(f"{path}: corrupt Parquet data ({exc})") from None


def _raw_rows(path: Path, columns: list[str], rows: set[int]) -> dict[int, dict[str, Any]]:
    """Rows ``rows`` of ``path`` as read (before normalization): the ``raw`` of a rejected duplicate."""
    out: dict[int, dict[str, Any]] = {}
    wanted = np.sort(np.fromiter(rows, dtype=np.int64, count=len(rows)))
    offset = 0
    for table in _request_batches(path, columns, VALIDATE_BATCH_ROWS):
        lo, hi = np.searchsorted(wanted, [offset, offset + table.num_rows])
        if hi > lo:
            want = wanted[lo:hi] - offset
            picked = table.take(pa.array(want))
            data = {c: _column_values(picked.column(c)) for c in columns}
            out.update({offset + int(j): {c: data[c][k] for c in columns} for k, j in enumerate(want)})
        offset += table.num_rows
    return out


def _accepted_schema(task: GenerateTask, fields: list[str]) -> pa.Schema:
    """``request_id`` + the task's columns (creatives: ``ad_id`` and ``fields``), all strings."""
    if task is GenerateTask.TARGETS:
        return pa.schema([("request_id", pa.string()), ("query", pa.string())])
    return pa.schema([("request_id", pa.string()), ("ad_id", pa.string())] + [(c, pa.string()) for c in fields])


def _check_row(task: GenerateTask, raw: dict[str, Any], present: list[str],
               config: RequestValidationConfig) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """One row's checks: (normalized row, None, None) when accepted, else (None, reason, request_id or None)."""
    rid = _id_to_str(raw["request_id"])
    if rid is None:
        return None, ("request_id is null, empty or not an integer/string" if raw["request_id"] is None
                      or isinstance(raw["request_id"], (str, bytes)) else
                      f"request_id {raw['request_id']!r} is not an integer or string (wrong type)"), None
    row: dict[str, Any] = {"request_id": rid}
    if task is GenerateTask.TARGETS:
        query, problem = _text_value(raw["query"])
        if problem:
            return None, f"query is {problem}", rid
        query = query.strip()
        if is_blank(query):
            return None, "query is empty", rid
        if len(query) > config.max_query_chars:
            return None, (f"query is oversized ({len(query)} chars > max_query_chars="
                          f"{config.max_query_chars})"), rid
        row["query"] = query
        return row, None, None
    ad_id = _id_to_str(raw["ad_id"])
    if ad_id is None:
        return None, "ad_id is null, empty or not an integer/string", rid
    row["ad_id"] = ad_id
    problems = []
    total = 0
    for c in present:
        text, problem = _text_value(raw[c])
        if problem and problem != "null":
            problems.append(f"{c} is {problem}")
        row[c] = text.strip() if text and not is_blank(text) else None
        total += len(row[c] or "")
    if problems:
        return None, "; ".join(problems), rid
    if total == 0:
        return None, f"no ad text: all of {present} are null or empty", rid
    if total > config.max_ad_chars:
        return None, f"ad fields are oversized ({total} chars > max_ad_chars={config.max_ad_chars})", rid
    return row, None, None


def _repeated(ids: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """``bool [n]``: the rows of a sorted id column whose id is also on a neighbouring row."""
    ids = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    rep = np.zeros(len(ids), dtype=bool)
    if len(ids) > 1:
        same = pc.equal(ids.slice(1), ids.slice(0, len(ids) - 1)).to_numpy(zero_copy_only=False)
        rep[1:] |= same
        rep[:-1] |= same
    return rep


def validate_requests(
    path: str | Path, task: GenerateTask, config: RequestValidationConfig | None = None
) -> ValidatedRequests:
    """Read and validate a request file or folder; see the module docstring for the rules.

    Duplicate ``request_id``: identical copies keep the first (file order) and reject the rest;
    copies that disagree are all rejected (which one is meant cannot be known).

    Memory: the files are read :data:`VALIDATE_BATCH_ROWS` rows at a time, and only Arrow columns are kept across
    batches (the accepted rows) beside the rejected rows: no Python object per request outlives its batch.
    Duplicates are found on the sorted ids; only the rows of a repeated id come back to Python (their raw values
    re-read from their file).
    """
    config = config or RequestValidationConfig()
    task = GenerateTask(task)
    files = check_request_schema(path, task)
    text_cols = ["query"] if task is GenerateTask.TARGETS else list(CREATIVE_FIELDS)
    rejected: list[dict[str, Any]] = []
    kept_tables: list[pa.Table] = []  # each batch's normalized rows + their origin (_file, _row)
    read_cols: list[list[str]] = []  # per file: the columns read
    rows_in = 0
    for fi, f in enumerate(files):
        names = read_parquet_schema(f, RequestSchemaError).names
        present = [c for c in text_cols if c in names]
        cols = ["request_id"] + (["ad_id"] if task is GenerateTask.CREATIVES else []) + present
        read_cols.append(cols)
        schema = _accepted_schema(task, present)
        file_row = 0  # the row number of the batch's first row in f
        for table in _request_batches(f, cols, VALIDATE_BATCH_ROWS):
            data = {c: _column_values(table.column(c)) for c in cols}
            kept, kept_rows = [], []
            for j in range(table.num_rows):
                raw = {c: data[c][j] for c in cols}
                row, reason, rid = _check_row(task, raw, present, config)
                if row is None:
                    rejected.append({"request_id": rid, "file": str(f), "row": file_row + j,
                                     "stage": RejectStage.VALIDATE.value, "reason": reason, "raw": _raw_json(raw)})
                else:
                    kept.append(row)
                    kept_rows.append(file_row + j)
            if kept:
                batch = pa.Table.from_pylist(kept, schema=schema)
                kept_tables.append(batch.append_column(_FILE_COL, pa.array([fi] * len(kept), pa.int32()))
                                   .append_column(_ROW_COL, pa.array(kept_rows, pa.int64())))
            rows_in += table.num_rows
            file_row += table.num_rows
            del data, kept

    # every field any file carries, null where a file lacks it; the columns of no accepted row are dropped below
    full = _accepted_schema(task, [c for c in text_cols if any(c in cols for cols in read_cols)])
    full = full.append(pa.field(_FILE_COL, pa.int32())).append(pa.field(_ROW_COL, pa.int64()))
    cand = pa.concat_tables([pa.table({n: t.column(n) if n in t.column_names else pa.nulls(t.num_rows, full.field(n).type)
                                       for n in full.names}, schema=full) for t in kept_tables]) \
        if kept_tables else full.empty_table()
    del kept_tables
    # sorted by id, then file order: a repeated id's copies are adjacent, first copy first
    cand = cand.take(pc.sort_indices(cand, sort_keys=[("request_id", "ascending"), (_FILE_COL, "ascending"),
                                                       (_ROW_COL, "ascending")]))
    rep = _repeated(cand.column("request_id"))
    winners: list[int] = []
    if rep.any():
        dup_at = np.flatnonzero(rep)
        dups = cand.take(pa.array(dup_at)).to_pylist()
        content = [c for c in cand.column_names if c not in (_FILE_COL, _ROW_COL)]
        losers: list[tuple[dict[str, Any], str]] = []
        start = 0
        while start < len(dups):
            stop = start
            while stop < len(dups) and dups[stop]["request_id"] == dups[start]["request_id"]:
                stop += 1
            items, first = dups[start:stop], dups[start]
            rid = first["request_id"]
            body = [_prompt_content({c: it[c] for c in content}) for it in items]
            if all(b == body[0] for b in body[1:]):
                winners.append(int(dup_at[start]))
                losers += [(it, f"duplicate request_id {rid!r} (identical copy of {files[first[_FILE_COL]]} row "
                                f"{first[_ROW_COL]}, which is answered)") for it in items[1:]]
            else:
                losers += [(it, f"duplicate request_id {rid!r} with conflicting content ({len(items)} rows)")
                           for it in items]
            start = stop
        by_file: dict[int, set[int]] = {}
        for it, _ in losers:
            by_file.setdefault(it[_FILE_COL], set()).add(it[_ROW_COL])
        raws = {fi: _raw_rows(files[fi], read_cols[fi], rows) for fi, rows in by_file.items()}
        for it, why in losers:
            rejected.append({"request_id": it["request_id"], "file": str(files[it[_FILE_COL]]), "row": it[_ROW_COL],
                             "stage": RejectStage.VALIDATE.value, "reason": why,
                             "raw": _raw_json(raws[it[_FILE_COL]][it[_ROW_COL]])})
    keep = ~rep
    keep[winners] = True
    # ids are unique now, and sorted (byte order of UTF-8 = code-point order, as Python sorts str)
    accepted = cand.filter(pa.array(keep))
    if task is GenerateTask.CREATIVES:  # the fields of the files an accepted row came from
        used = set(pc.unique(accepted.column(_FILE_COL)).to_pylist())
        accepted = accepted.select(["request_id", "ad_id"] + [
            c for c in CREATIVE_FIELDS if any(c in read_cols[fi] for fi in used)])
    else:
        accepted = accepted.drop_columns([_FILE_COL, _ROW_COL])
    rejected_table = pa.Table.from_pylist(rejected, schema=REJECTED_SCHEMA)
    if rejected_table.num_rows:
        rejected_table = rejected_table.sort_by([("file", "ascending"), ("row", "ascending")])
    return ValidatedRequests(task=task, accepted=accepted, rejected=rejected_table,
                             files=files, rows_in=rows_in)


def empty_output(task: GenerateTask) -> pa.Table:
    return output_schema(task).empty_table()


def unique_request_ids(table: pa.Table) -> int:
    """Number of distinct request ids in an output table."""
    return len(pc.unique(table.column("request_id"))) if table.num_rows else 0
