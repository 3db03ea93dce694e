"""Column contracts of every stage's parquet files: pyarrow schemas here, pandera DataFrameModels in
``schema_models.py`` (loaded when values are checked).

Each stage builds its output as a ``pyarrow.Table`` with the schema here and calls :func:`check` before
writing, so a wrong dtype, a null id or a malformed list fails at the stage that made it, naming the file.

Conventions
- ``sample_id``: the source's own id when it has one, else a content hash (see ``io.content_hash``).
- ``messages`` / ``tools`` / ``tool_calls``: JSON text (OpenAI chat format), because their nested shapes
  differ row to row (tool calls, tool_call_id, names) and parquet structs would force one shape.
- ``input_ids``: ``list<int32>`` of target-tokenizer ids; ``loss_mask``: ``list<int8>`` of 0/1, same length,
  1 exactly on the generated completion (including its end-of-turn token).
"""

from __future__ import annotations

import pyarrow as pa

IDS = pa.list_(pa.int32())
MASK = pa.list_(pa.int8())

PROMPTS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.string()),  # JSON list of OpenAI messages
        ("tools", pa.string()),  # JSON list of OpenAI tool definitions, or null
        ("source_format", pa.string()),
        ("source_row", pa.int64()),  # 0-based row/line in the source file
    ]
)

REJECTS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("stage", pa.string()),  # normalize | generate | tokenize | validate
        ("reason", pa.string()),  # reason code, e.g. empty_conversation, missing_end_of_turn
        ("detail", pa.string()),
        ("source_row", pa.int64()),
    ]
)

RESPONSES = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("turn", pa.int32()),  # index in the source `messages` of the assistant turn regenerated
        ("request_key", pa.string()),
        ("messages", pa.string()),  # JSON: the exact prompt messages sent (regenerated history in mode all)
        ("tools", pa.string()),  # JSON tool definitions sent, or null
        ("status", pa.string()),  # ok | failed
        ("error", pa.string()),  # reason code + message when failed
        ("reasoning", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.string()),  # JSON list or null
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
        ("backend", pa.string()),
        ("provider", pa.string()),
        ("model", pa.string()),
        ("latency_s", pa.float64()),
        ("output_ids", IDS),  # exact ids when the backend returns them, else null
        ("completed_at", pa.float64()),  # unix time the response arrived
    ]
)

TOKENS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("input_ids", IDS),
        ("loss_mask", MASK),
        ("num_tokens", pa.int64()),
        ("num_prompt_tokens", pa.int64()),
        ("num_completion_tokens", pa.int64()),
        ("ids_source", pa.string()),  # exact | reconstructed | pretokenized
        ("billed_completion_tokens", pa.int64()),  # backend's usage.completion_tokens, null if none
        ("finish_reason", pa.string()),
        ("backend", pa.string()),
        ("provider", pa.string()),
        ("cost_usd", pa.float64()),
        ("reject_stage", pa.string()),  # set when an earlier stage already failed this sample
        ("reject_reason", pa.string()),
        ("reject_detail", pa.string()),
    ]
)

VALIDATED = pa.schema([f for f in TOKENS if not f.name.startswith("reject_")])

MERGED = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("input_ids", IDS),
        ("loss_mask", MASK),
        ("num_tokens", pa.int64()),
        ("num_supervised", pa.int64()),
        ("truncated", pa.bool_()),
    ]
)


def empty(schema: pa.Schema) -> pa.Table:
    """An empty table with ``schema`` (stages still write a file when a shard has no rows)."""
    return schema.empty_table()


def from_rows(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Build a table of ``schema`` from row dicts (missing keys become null)."""
    if not rows:
        return empty(schema)
    return pa.Table.from_pylist(rows, schema=schema)


ARROW_SCHEMAS = {
    "prompts": PROMPTS,
    "rejects": REJECTS,
    "responses": RESPONSES,
    "tokens": TOKENS,
    "validated": VALIDATED,
    "merged": MERGED,
}


class SchemaError(ValueError):
    """A stage produced a table that breaks its contract; the message names the file and the check."""


def check(table: pa.Table, kind: str, path: str = "<memory>") -> pa.Table:
    """Check ``table`` against the ``kind`` contract (arrow schema, then pandera values); return it.

    Raises :class:`SchemaError` naming ``path``, the column and the failing check.
    ``kind`` is one of ``prompts, rejects, responses, tokens, validated, merged``.
    """
    from pandera import errors as pandera_errors

    from .schema_models import MODELS  # pandas + pandera load only when values are checked

    schema, model = ARROW_SCHEMAS[kind], MODELS[kind]
    if not table.schema.equals(schema, check_metadata=False):
        missing = set(schema.names) - set(table.schema.names)
        extra = set(table.schema.names) - set(schema.names)
        wrong = [
            f"{f.name}: {table.schema.field(f.name).type} (expected {f.type})"
            for f in schema
            if f.name in table.schema.names and table.schema.field(f.name).type != f.type
        ]
        raise SchemaError(
            f"{path}: {kind} table does not match its schema; missing={sorted(missing)} "
            f"extra={sorted(extra)} wrong_types={wrong}"
        )
    if table.num_rows == 0:
        return table
    df = table.to_pandas(types_mapper=None)
    try:
        model.validate(df, lazy=True)
    except (pandera_errors.SchemaErrors, pandera_errors.SchemaError) as exc:
        cases = getattr(exc, "failure_cases", None)
        summary = cases.head(10).to_string() if cases is not None else str(exc)
        raise SchemaError(f"{path}: {kind} rows fail the schema:\n{summary}") from exc
    return table


def write_checked(table: pa.Table, kind: str, path) -> None:
    """:func:`check` then write ``table`` atomically to ``path``."""
    from .io import write_parquet

    check(table, kind, str(path))
    write_parquet(table, path)


# ---------------------------------------------------------------------------------------------------
# arrow-level checks and a streaming checked writer (no pandas copy; for large outputs written in batches)


def _arrow_fail(path, kind: str, column: str, check: str, mask, table: pa.Table) -> None:
    import pyarrow.compute as pc

    n = pc.sum(pc.cast(mask, pa.int64())).as_py() or 0
    if n:
        idx = pc.indices_nonzero(mask).to_pylist()[:5]
        sample = table.column(column).take(idx).to_pylist()
        raise SchemaError(f"{path}: {kind} rows fail the schema: column {column!r} check {check}: "
                          f"{n} row(s), e.g. rows {idx} values {sample}")


def check_responses_arrow(table: pa.Table, path: str = "<memory>", seen_keys: set | None = None) -> pa.Table:
    """The RESPONSES contract of ``schema_models.ResponsesModel``, checked with pyarrow compute (no pandas copy).

    Checks: the arrow schema; ``sample_id``/``dataset``/``request_key``/``status`` not null; ``status`` in
    ok|failed; ``turn >= 0``; ``completion_tokens``/``cost_usd`` null or ``>= 0``; ``request_key`` unique within
    the table and, when ``seen_keys`` is given, across earlier batches (the set is updated). Raises
    :class:`SchemaError` naming ``path``, the column and the failing check.
    """
    import pyarrow.compute as pc

    if not table.schema.equals(RESPONSES, check_metadata=False):
        check(table.slice(0, 0), "responses", path)  # the schema message
    if table.num_rows == 0:
        return table
    for col in ("sample_id", "dataset", "request_key", "status"):
        _arrow_fail(path, "responses", col, "not_nullable", pc.is_null(table.column(col)), table)
    _arrow_fail(path, "responses", "status", "isin(['ok', 'failed'])",
                pc.invert(pc.is_in(table.column("status"), value_set=pa.array(["ok", "failed"]))), table)
    for col, low in (("turn", 0), ("completion_tokens", 0), ("cost_usd", 0)):
        _arrow_fail(path, "responses", col, f"greater_than_or_equal_to({low})",
                    pc.fill_null(pc.less(table.column(col), low), False), table)
    keys = table.column("request_key")
    if pc.count_distinct(keys).as_py() != table.num_rows:
        counts = pc.value_counts(keys)
        dup = [v["values"] for v in counts.to_pylist() if v["counts"] > 1][:5]
        raise SchemaError(f"{path}: responses rows fail the schema: column 'request_key' check unique: "
                          f"duplicates {dup}")
    if seen_keys is not None:
        ks = keys.to_pylist()
        dup = [k for k in ks if k in seen_keys]
        if dup:
            raise SchemaError(f"{path}: responses rows fail the schema: column 'request_key' check unique: "
                              f"duplicates across batches {dup[:5]}")
        seen_keys.update(ks)
    return table


ARROW_CHECKS = {"responses": check_responses_arrow}


class CheckedParquetWriter:
    """Write a ``kind`` table batch by batch, each batch checked at the arrow level, atomically renamed on close.

    ``with CheckedParquetWriter("responses", path) as w: w.write_rows(rows); w.write_table(t)``. Uniqueness
    checks span all batches. On an exception inside the block (or a failed check) ``path`` is left untouched.
    Only kinds in :data:`ARROW_CHECKS` are supported (ValueError otherwise). An empty output still gets a file
    with the schema. Memory: one batch at a time (plus the set of unique keys).
    """

    def __init__(self, kind: str, path):
        if kind not in ARROW_CHECKS:
            raise ValueError(f"no arrow-level check for {kind!r}; known: {sorted(ARROW_CHECKS)}")
        self.kind, self.path = kind, path
        self.schema = ARROW_SCHEMAS[kind]
        self.rows = 0
        self._seen: set = set()
        self._cm = None
        self._writer = None

    def __enter__(self) -> "CheckedParquetWriter":
        import pyarrow.parquet as pq

        from .io import atomic_path

        self._cm = atomic_path(self.path)
        tmp = self._cm.__enter__()
        self._writer = pq.ParquetWriter(tmp, self.schema, compression="zstd")
        return self

    def write_rows(self, rows: list[dict]) -> None:
        if rows:
            self.write_table(from_rows(rows, self.schema))

    def write_table(self, table: pa.Table) -> None:
        ARROW_CHECKS[self.kind](table, str(self.path), self._seen)
        if table.num_rows:
            self._writer.write_table(table)
            self.rows += table.num_rows

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._writer.close()
        except BaseException as err:
            if exc_type is None:  # a failed close: remove the temp file, keep ``path`` untouched
                self._cm.__exit__(type(err), err, err.__traceback__)
                raise
        try:
            return bool(self._cm.__exit__(exc_type, exc, tb))
        finally:
            pa.default_memory_pool().release_unused()  # batch buffers back to the OS
