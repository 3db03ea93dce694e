"""Column contracts of every stage's parquet files, as pyarrow schemas and pandera DataFrameModels.

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

from typing import Optional

import numpy as np
import pandas as pd
import pandera.pandas as pa_pd
import pyarrow as pa
from pandera.typing import Series

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


# ---------------------------------------------------------------------------------------------------
# pandera models: value checks beyond the arrow types.


def _lists_ok(s: pd.Series, low: int, high: int | None = None) -> pd.Series:
    def ok(v) -> bool:
        if v is None:
            return False
        a = np.asarray(v)  # list cells arrive as numpy arrays from to_pandas: no per-element Python loop
        if not a.size:
            return False
        return bool(a.min() >= low and (high is None or a.max() <= high))

    return s.map(ok)


class PromptsModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False, str_length={"min_value": 1})
    dataset: Series[str] = pa_pd.Field(nullable=False)
    messages: Series[str] = pa_pd.Field(nullable=False, str_startswith="[")
    tools: Series[str] = pa_pd.Field(nullable=True)
    source_format: Series[str] = pa_pd.Field(nullable=False)
    source_row: Series[int] = pa_pd.Field(ge=0)

    class Config:
        unique = ["sample_id"]
        strict = True


class RejectsModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=True)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    stage: Series[str] = pa_pd.Field(isin=["normalize", "generate", "tokenize", "validate"])
    reason: Series[str] = pa_pd.Field(nullable=False, str_length={"min_value": 1})
    detail: Series[str] = pa_pd.Field(nullable=True)
    source_row: Series[float] = pa_pd.Field(nullable=True, coerce=True)

    class Config:
        strict = True


class ResponsesModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    turn: Series[int] = pa_pd.Field(ge=0, coerce=True)  # arrow int32
    request_key: Series[str] = pa_pd.Field(nullable=False)
    status: Series[str] = pa_pd.Field(isin=["ok", "failed"])
    completion_tokens: Series[float] = pa_pd.Field(nullable=True, ge=0, coerce=True)
    cost_usd: Series[float] = pa_pd.Field(nullable=True, ge=0)

    class Config:
        unique = ["request_key"]


class TokensModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    num_tokens: Series[int] = pa_pd.Field(ge=0)
    ids_source: Series[str] = pa_pd.Field(isin=["exact", "reconstructed", "pretokenized"], nullable=True)

    class Config:
        unique = ["sample_id"]


class ValidatedModel(pa_pd.DataFrameModel):
    sample_id: Series[str] = pa_pd.Field(nullable=False)
    dataset: Series[str] = pa_pd.Field(nullable=False)
    input_ids: Series[object] = pa_pd.Field(nullable=False)
    loss_mask: Series[object] = pa_pd.Field(nullable=False)
    num_tokens: Series[int] = pa_pd.Field(gt=0)
    num_completion_tokens: Series[int] = pa_pd.Field(gt=0)
    ids_source: Series[str] = pa_pd.Field(isin=["exact", "reconstructed", "pretokenized"])

    @pa_pd.check("input_ids")
    def ids_non_negative(cls, s: pd.Series) -> pd.Series:
        return _lists_ok(s, 0)

    @pa_pd.check("loss_mask")
    def mask_binary(cls, s: pd.Series) -> pd.Series:
        return _lists_ok(s, 0, 1)

    @pa_pd.dataframe_check
    def lengths_agree(cls, df: pd.DataFrame) -> pd.Series:
        return (df["input_ids"].map(len) == df["num_tokens"]) & (df["loss_mask"].map(len) == df["num_tokens"])

    class Config:
        unique = ["sample_id"]


class MergedModel(ValidatedModel):
    num_supervised: Series[int] = pa_pd.Field(gt=0)
    truncated: Series[bool]
    # merged rows carry no ids_source/num_completion_tokens columns
    ids_source: Optional[Series[str]]
    num_completion_tokens: Optional[Series[int]]


MODELS = {
    "prompts": (PROMPTS, PromptsModel),
    "rejects": (REJECTS, RejectsModel),
    "responses": (RESPONSES, ResponsesModel),
    "tokens": (TOKENS, TokensModel),
    "validated": (VALIDATED, ValidatedModel),
    "merged": (MERGED, MergedModel),
}


class SchemaError(ValueError):
    """A stage produced a table that breaks its contract; the message names the file and the check."""


def check(table: pa.Table, kind: str, path: str = "<memory>") -> pa.Table:
    """Check ``table`` against the ``kind`` contract (arrow schema, then pandera values); return it.

    Raises :class:`SchemaError` naming ``path``, the column and the failing check.
    ``kind`` is one of ``prompts, rejects, responses, tokens, validated, merged``.
    """
    schema, model = MODELS[kind]
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
    except (pa_pd.errors.SchemaErrors, pa_pd.errors.SchemaError) as exc:
        cases = getattr(exc, "failure_cases", None)
        summary = cases.head(10).to_string() if cases is not None else str(exc)
        raise SchemaError(f"{path}: {kind} rows fail the schema:\n{summary}") from exc
    return table


def write_checked(table: pa.Table, kind: str, path) -> None:
    """:func:`check` then write ``table`` atomically to ``path``."""
    from .io import write_parquet

    check(table, kind, str(path))
    write_parquet(table, path)
