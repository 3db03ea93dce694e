"""Stage 1, normalize: a raw public source file -> per-shard PROMPTS parquet (or TOKENS for pre-tokenized
sources) + one rejects file.

Output rows (``schemas.PROMPTS``): ``sample_id`` (the source's own id, else ``files.content_hash(messages,
tools)``), ``dataset``, ``messages`` (JSON text of OpenAI messages: role system/user/assistant/tool,
``content`` always a string, ``tool_calls`` with ``function.arguments`` as JSON text, ``tool_call_id``/``name``
on tool messages; original assistant turns are kept), ``tools`` (JSON text of OpenAI tool definitions, or
null), ``source_format``, ``source_row`` (0-based record index in the source file; for JSONL blank lines are
not counted). Shard of a row = ``files.shard_of(sample_id, num_shards)``, so appending records to a source never
moves existing samples.

Every conversation passes :func:`sources.base.check_conversation`: at least one message, only the four
roles, system messages only before the first turn, first non-system turn a user turn, no empty user text.
A conversation may end with a user turn (a pure prompt) or with an assistant turn (the generate stage
decides which assistant turn(s) to regenerate).

Rejects (``schemas.REJECTS``, stage ``normalize``): reason codes of ``sources.REJECT_REASONS``. A row whose
id repeats an earlier row's id is rejected as ``duplicate_id`` (the first occurrence wins).
"""

from __future__ import annotations

import contextlib
import json
import re
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import pyarrow.parquet as pq

from . import schemas
from .errors import ExpectedFailure
from .files import atomic_path, content_hash, shard_of
from .sources import FORMAT_PROBE_RECORDS, RowReject, SourceFormatError, get_adapter, iter_records
from .sources.readers import TOO_DEEP, InvalidLine

if TYPE_CHECKING:
    from .settings import NormalizeSettings

PROGRESS_EVERY_S = 10.0


class RejectCeilingError(ExpectedFailure, ValueError):
    """Normalize rejected more than ``max_reject_rate`` of a source's rows: almost always the wrong ``format``
    (or options) for the file. Nothing is written."""


def reject_ceiling_message(
    dataset: str, source_format: str, source_path, rows_read: int, rejected: Counter, examples: dict, ceiling: float
) -> str:
    """The message of :class:`RejectCeilingError`: the dataset, its format and file, the share rejected and the
    top reasons, each with one example."""
    n = sum(rejected.values())
    top = "\n".join(f"  {reason}: {k} (e.g. {examples.get(reason, '')[:160]})" for reason, k in rejected.most_common(3))
    return (
        f"normalize {dataset}: {n} of {rows_read} rows of {source_path} rejected ({n / rows_read:.0%}, more than "
        f"max_reject_rate {ceiling:.0%}) reading it as format {source_format!r}; top reasons:\n{top}\n"
        f"Check datasets.{dataset}.source.format (and its options), or raise "
        f"datasets.{dataset}.source.max_reject_rate / normalize.max_reject_rate if these rows are really unusable."
    )


class _ShardWriter:
    """Streams checked batches of one shard into a temporary parquet file; renamed into place on success."""

    def __init__(self, path: str | os.PathLike, kind: str, stack: contextlib.ExitStack, batch_rows: int):
        self.path = str(path)
        self.kind = kind
        self.schema = schemas.ARROW_SCHEMAS[kind]
        self.batch_rows = batch_rows
        tmp = stack.enter_context(atomic_path(path))
        self.writer = pq.ParquetWriter(tmp, self.schema, compression="zstd")
        stack.callback(self.writer.close)  # runs before atomic_path's rename (LIFO)
        self.rows: list[dict] = []
        self.count = 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.count += 1
        if len(self.rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        table = schemas.from_rows(self.rows, self.schema)
        schemas.check(table, self.kind, self.path)
        if table.num_rows:
            self.writer.write_table(table)
        self.rows = []


def _tokens_row(sample_id: str, dataset: str, ids: list[int], mask: list[int]) -> dict:
    # a multi-turn mask has several supervised spans: "completion" counts the supervised tokens, "prompt" the rest
    # (so prompt + completion = num_tokens, as validate checks), not the index of the first supervised token
    supervised = sum(mask)
    return {
        "sample_id": sample_id,
        "dataset": dataset,
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_prompt_tokens": len(ids) - supervised,
        "num_completion_tokens": supervised,
        "ids_source": "pretokenized",
    }


_SURROGATE = re.compile("[\ud800-\udfff]")


def _replace_surrogates(obj):
    """``obj`` (JSON-like) with every unpaired surrogate in its strings replaced by U+FFFD."""
    if isinstance(obj, str):
        return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, list):
        return [_replace_surrogates(v) for v in obj]
    if isinstance(obj, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in obj.items()}
    return obj


def _prompt_json(sample) -> tuple[str, str | None]:
    """The PROMPTS ``messages``/``tools`` JSON text of ``sample``. Text with an unpaired surrogate (a broken emoji
    from a ``\\ud83d`` escape, common in scraped ShareGPT dumps) is not valid Unicode: it can't be sent as UTF-8
    or tokenized, and pyarrow would silently write ``?``. Such strings get U+FFFD instead, noted on the sample
    (``replaced_unpaired_surrogates``, counted in ``repaired``)."""
    messages = json.dumps(sample.messages, ensure_ascii=False)
    tools = json.dumps(sample.tools, ensure_ascii=False) if sample.tools else None
    if _SURROGATE.search(messages) or (tools and _SURROGATE.search(tools)):
        sample.messages = _replace_surrogates(sample.messages)
        sample.tools = _replace_surrogates(sample.tools)
        sample.notes.append("replaced_unpaired_surrogates")
        return _prompt_json(sample)
    return messages, tools


def normalize(
    settings: NormalizeSettings,
    out_paths: Sequence[str | os.PathLike],
    rejects_path: str | os.PathLike,
    *,
    log: logging.Logger | None = None,
    batch_rows: int = 2048,
) -> dict:
    """Normalize one dataset's source file into ``settings.shards`` shard files and one rejects file.

    ``settings``: the dataset's source (:class:`~eagle3_data.settings.NormalizeSettings`): ``path`` (``.jsonl``,
    ``.json`` array or ``.parquet``, ``.gz`` allowed on the JSON kinds; read streaming), ``format`` (a name from
    ``sources.ADAPTERS``), ``options`` (that adapter's options), ``max_samples``, ``max_reject_rate``, ``shards``
    and the ``dataset`` name.
    ``out_paths[i]``: shard ``i``'s file — PROMPTS rows, or TOKENS rows (``ids_source="pretokenized"``) for the
    ``pretokenized`` format. Every shard file is written (an empty table when the shard has no rows), and
    ``rejects_path`` (REJECTS rows, stage ``normalize``), all atomically and checked against ``schemas``.
    ``max_samples``: keep the first N usable rows (None: all), then stop reading. ``max_reject_rate``: the largest share of
    the rows read that may be rejected; above it nothing is written and :class:`RejectCeilingError` names the
    format, the file and the top reasons (a wrong ``format`` rejects nearly every row). ``on_error="skip"``: a
    JSONL line that is not valid JSON is rejected ``invalid_json`` (detail ``file:line: error``), counted and
    logged with its line number, instead of raising.

    Returns ``{"rows_read": int, "kept": int, "rejected": {reason: n}, "per_shard": [n, ...],
    "repaired": {note: n}, "output": "prompts"|"tokens", "skipped_lines": [1-based line, ...]}``;
    ``repaired`` counts kept rows that were fixed up (e.g. ``merged_consecutive_turns``).

    Raises SourceFormatError (file not the named format: invalid JSON anywhere, naming the line/record; a
    record without the format's required field among the first 10), RejectCeilingError (too many rows
    rejected), ValueError (unknown format/option, ``len(out_paths) != settings.shards``), FileNotFoundError.
    """
    source_path, source_format, dataset = settings.path, settings.format, settings.dataset
    num_shards, max_samples, options = settings.shards, settings.max_samples, settings.options
    max_reject_rate, on_error = settings.max_reject_rate, settings.on_error
    log = log or logging.getLogger("eagle3_data.normalize")
    if len(out_paths) != num_shards:
        raise ValueError(f"normalize: {len(out_paths)} output paths for {num_shards} shards")
    if max_samples is not None and max_samples < 0:
        raise ValueError(f"normalize: max_samples must be >= 0 or null, got {max_samples}")
    adapter = get_adapter(source_format, options)
    kind = "tokens" if adapter.output == "tokens" else "prompts"
    source_path = Path(source_path)

    rejects: list[dict] = []
    rejected: Counter = Counter()
    examples: dict[str, str] = {}
    repaired: Counter = Counter()
    seen: set[str] = set()
    skipped_lines: list[int] = []
    rows_read = kept = 0
    t0 = last = time.monotonic()

    def reject(reason: str, detail: str, sid: str | None, index: int) -> None:
        rejected[reason] += 1
        examples.setdefault(reason, detail)
        rejects.append(
            {
                "sample_id": sid,
                "dataset": dataset,
                "stage": "normalize",
                "reason": reason,
                "detail": detail[:2000],
                "source_row": index,
            }
        )

    log.info(
        "normalize %s: reading %s as %s -> %d shard(s) of %s", dataset, source_path, source_format, num_shards, kind
    )
    with contextlib.ExitStack() as stack:
        shards = [_ShardWriter(p, kind, stack, batch_rows) for p in out_paths]
        records = stack.enter_context(contextlib.closing(iter_records(source_path, on_error=on_error)))
        for index, record, where in records:
            if max_samples is not None and kept >= max_samples:
                break
            rows_read += 1
            if isinstance(record, InvalidLine):  # on_error: skip
                reject("invalid_json", f"{source_path}:{where.removeprefix('line ')}: {record.message}", None, index)
                skipped_lines.append(int(where.removeprefix("line ")))
                continue
            problem = adapter.shape_problem(record)
            if problem is not None:
                if index < FORMAT_PROBE_RECORDS:
                    raise SourceFormatError(f"{source_path} {where}: expected {adapter.expected}, {problem}")
                reject("malformed_record", f"{where}: {problem}", None, index)
                continue
            try:
                sample = adapter.convert(record)
                if kind == "tokens":
                    sid = sample.sample_id or content_hash(sample.input_ids, sample.loss_mask)
                else:
                    messages_json, tools_json = _prompt_json(sample)
                    sid = sample.sample_id or content_hash(sample.messages, sample.tools)
            except RowReject as rej:
                reject(rej.reason, f"{where}: {rej.detail}", rej.sample_id, index)
                continue
            except RecursionError:  # a record that decodes, nested too deep to be walked or written as JSON
                reject("nested_too_deep", f"{source_path} {where}: {TOO_DEEP}", None, index)
                continue
            if _SURROGATE.search(sid):  # an id must be stable and exact: not repaired
                reject(
                    "invalid_id", f"{where}: sample id {sid!r} is not valid Unicode (unpaired surrogate)", None, index
                )
                continue
            if sid in seen:
                reject("duplicate_id", f"{where}: sample_id {sid!r} already used by an earlier row", sid, index)
                continue
            seen.add(sid)
            if kind == "tokens":
                row = _tokens_row(sid, dataset, sample.input_ids, sample.loss_mask)
            else:
                row = {
                    "sample_id": sid,
                    "dataset": dataset,
                    "messages": messages_json,
                    "tools": tools_json,
                    "source_format": source_format,
                    "source_row": index,
                }
            shards[shard_of(sid, num_shards)].add(row)
            kept += 1
            repaired.update(sample.notes)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                log.info(
                    "normalize %s: %d read, %d kept, %d rejected (%.0f rows/s)",
                    dataset,
                    rows_read,
                    kept,
                    sum(rejected.values()),
                    rows_read / max(now - t0, 1e-9),
                )
        if rows_read and sum(rejected.values()) > max_reject_rate * rows_read:
            raise RejectCeilingError(
                reject_ceiling_message(
                    dataset, source_format, source_path, rows_read, rejected, examples, max_reject_rate
                )
            )
        for s in shards:
            s.flush()
        schemas.write_checked(schemas.from_rows(rejects, schemas.REJECTS), "rejects", rejects_path)

    if rows_read == 0:
        raise SourceFormatError(
            f"{source_path}: the source holds no records (dataset {dataset}, format {source_format}); "
            "point datasets.<name>.source.path at a non-empty file"
        )
    counts = {
        "rows_read": rows_read,
        "kept": kept,
        "rejected": dict(sorted(rejected.items())),
        "per_shard": [s.count for s in shards],
        "repaired": dict(sorted(repaired.items())),
        "output": kind,
        "skipped_lines": skipped_lines,
    }
    if skipped_lines:
        shown = ", ".join(map(str, skipped_lines[:20])) + (", ..." if len(skipped_lines) > 20 else "")
        log.warning(
            "normalize %s: skipped %d line(s) of %s that are not valid JSON (source.on_error: skip; "
            "rejected invalid_json): line(s) %s",
            dataset,
            len(skipped_lines),
            source_path,
            shown,
        )
    log.info(
        "normalize %s: done in %.1fs: %d read, %d kept, rejected %s, per shard %s",
        dataset,
        time.monotonic() - t0,
        rows_read,
        kept,
        counts["rejected"] or "{}",
        counts["per_shard"],
    )
    return counts
