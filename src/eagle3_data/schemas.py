"""Column contracts of every stage's parquet files: pyarrow schemas here, pandera DataFrameModels in
``schema_models.py`` (loaded when values are checked).

Each stage builds its output as a ``pyarrow.Table`` with the schema here and calls :func:`check` before
writing, so a wrong dtype, a null id or a malformed list fails at the stage that made it, naming the file.

Conventions
- ``sample_id``: the source's own id when it has one, else a content hash (see ``files.content_hash``).
- ``messages`` / ``tools`` / ``tool_calls``: JSON text (OpenAI chat format), because their nested shapes
  differ row to row (tool calls, tool_call_id, names) and parquet structs would force one shape.
- ``input_ids``: ``list<int32>`` of target-tokenizer ids; ``loss_mask``: ``list<int8>`` of 0/1, same length,
  1 exactly on the generated completion (including its end-of-turn token).
"""

from __future__ import annotations

import json

import pyarrow as pa

IDS = pa.list_(pa.int32())
#: RESPONSES token ids and usage counts lie in [0, INT32_END): ids are int32, a count past it is no real token
#: count, and sums of real ones never overflow int64 (checked by the generate client and the journal reader)
INT32_END = 2**31


def is_token_ids(v) -> bool:
    """``v`` is a list of token ids: ints (not bools) in ``[0, INT32_END)``."""
    return isinstance(v, list) and all(type(i) is int and 0 <= i < INT32_END for i in v)


MASK = pa.list_(pa.int8())

PROMPTS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.string()),  # JSON list of OpenAI messages
        ("tools", pa.string()),  # JSON list of OpenAI tool definitions, or null
        ("source_format", pa.string()),
        ("source_row", pa.int64()),  # 0-based row/line in the source file
        # 16 hex digits of the normalized user text (normalize.prompt_key): the held-out split goes by it
        ("prompt_key", pa.string()),
    ]
)

REJECTS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("stage", pa.string()),  # normalize | decontaminate | generate | original_answers | tokenize | validate
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
        # the prompt's ids as the server rendered them (vLLM return_token_ids: prompt_token_ids), else null;
        # tokenize compares them with its own render (reject server_prompt_mismatch)
        ("prompt_ids", IDS),
        # the backend's id of the reply (OpenRouter's generation id: its billing record, GET /generation?id=), else
        # null; null in responses written before the column existed
        ("generation_id", pa.string()),
        # HTTP attempts the request took (1: the first try; retries after 429s, 5xx, timeouts add one each), null for
        # rows no request was sent for (answers: original) and in journal records written before the column existed
        ("attempts", pa.int32()),
        # the server's own word on its engine build, when it gives one: the reply's `system_fingerprint`, else null
        ("system_fingerprint", pa.string()),
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
        ("billed_prompt_tokens", pa.int64()),  # backend's usage.prompt_tokens, null if none (report audit.sql)
        ("finish_reason", pa.string()),
        ("backend", pa.string()),
        ("provider", pa.string()),
        ("cost_usd", pa.float64()),
        # JSON list of the prompt's images, in order, or null (a text row): each {"url", "sha256", "width",
        # "height"} (eagle3_data.images.image_part) and "start", "length": its placeholder positions in input_ids
        ("images", pa.string()),
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
        ("source", pa.string()),  # key of the validated shard the row came from ("<dataset>/<shard>"), or null
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


def table_from_json_lines(data: bytes, schema: pa.Schema) -> pa.Table:
    """Parse JSON lines (one object per line) into a table of ``schema`` with pyarrow's JSON reader: keys missing
    from a line are null, keys not in ``schema`` are ignored. Raises ``pyarrow.ArrowInvalid`` naming the bad value.

    Unlike ``pa.Table.from_pylist`` (``pa.array`` on a Python list imports pandas, ~50 MB of RSS, to check
    for pandas objects), this never imports pandas: the generate stage writes its output with it."""
    import io

    import pyarrow.json as pj

    return pj.read_json(
        io.BytesIO(data),
        read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, len(data) + 1)),
        parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
    )


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
    from .files import write_parquet

    check(table, kind, str(path))
    write_parquet(table, path)


# ---------------------------------------------------------------------------------------------------
# arrow-level checks and a streaming checked writer (no pandas copy; for large outputs written in batches)


def _rows_fail(path, kind: str, column: str, check: str, bad: list[int], values: list) -> None:
    if bad:
        raise SchemaError(
            f"{path}: {kind} rows fail the schema: column {column!r} check {check}: "
            f"{len(bad)} row(s), e.g. rows {bad[:5]} values {[values[i] for i in bad[:5]]}"
        )


def check_responses_arrow(table: pa.Table, path: str = "<memory>", seen_keys: set | None = None) -> pa.Table:
    """The RESPONSES contract of ``schema_models.ResponsesModel``, checked on the arrow table (no pandas copy).

    Checks: the arrow schema; ``sample_id``/``dataset``/``request_key``/``status`` not null; ``status`` in
    ok|failed; ``turn >= 0``; ``completion_tokens``/``cost_usd`` null or ``>= 0``; ``request_key`` unique within
    the table and, when ``seen_keys`` is given, across earlier batches (the set is updated). Raises
    :class:`SchemaError` naming ``path``, the column and the failing check.

    Only the small columns are converted to Python (never the texts), and ``pyarrow.compute`` is not used:
    loading its kernel registry costs ~50 MB of RSS, more than the generate stage's whole output batch.
    """
    if not table.schema.equals(RESPONSES, check_metadata=False):
        check(table.slice(0, 0), "responses", path)  # the schema message
    if table.num_rows == 0:
        return table
    for col in ("sample_id", "dataset", "request_key", "status"):
        if table.column(col).null_count:
            vals = table.column(col).to_pylist()
            _rows_fail(path, "responses", col, "not_nullable", [i for i, v in enumerate(vals) if v is None], vals)
    status = table.column("status").to_pylist()
    _rows_fail(
        path,
        "responses",
        "status",
        "isin(['ok', 'failed'])",
        [i for i, v in enumerate(status) if v not in ("ok", "failed")],
        status,
    )
    for col, low in (("turn", 0), ("completion_tokens", 0), ("cost_usd", 0)):
        vals = table.column(col).to_pylist()
        _rows_fail(
            path,
            "responses",
            col,
            f"greater_than_or_equal_to({low})",
            [i for i, v in enumerate(vals) if v is not None and v < low],
            vals,
        )
    keys = table.column("request_key").to_pylist()
    distinct = set(keys)
    if len(distinct) != len(keys):
        seen: set = set()
        dup = [k for k in keys if k in seen or seen.add(k)]
        raise SchemaError(
            f"{path}: responses rows fail the schema: column 'request_key' check unique: "
            f"duplicates {sorted(set(dup))[:5]}"
        )
    if seen_keys is not None:
        dup = distinct & seen_keys
        if dup:
            raise SchemaError(
                f"{path}: responses rows fail the schema: column 'request_key' check unique: "
                f"duplicates across batches {sorted(dup)[:5]}"
            )
        seen_keys.update(distinct)
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

    def __enter__(self) -> CheckedParquetWriter:
        import pyarrow.parquet as pq

        from .files import atomic_path

        self._cm = atomic_path(self.path, lock=True)  # a live writer's temp file is never taken for stale
        tmp = self._cm.__enter__()
        self._writer = pq.ParquetWriter(tmp, self.schema, compression="zstd")
        return self

    def write_rows(self, rows: list[dict]) -> None:
        """Write row dicts (JSON-serialisable values; missing keys null) as one checked batch."""
        if rows:
            self.write_json_lines(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows))

    def write_json_lines(self, data: bytes) -> None:
        """Write JSON lines (one row object per line, e.g. journal lines) as one checked batch; see
        :func:`table_from_json_lines`."""
        if data.strip():
            self.write_table(table_from_json_lines(data, self.schema))

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
