"""Stage 1, normalize: a raw public source file -> per-shard PROMPTS parquet (or TOKENS for pre-tokenized
sources) + one rejects file.

Output rows (``schemas.PROMPTS``): ``sample_id`` (the source's own id, else ``files.content_hash(messages,
tools)``), ``dataset``, ``messages`` (JSON text of OpenAI messages: role system/user/assistant/tool,
``content`` a string, or for a user message with images its text and image parts (:mod:`eagle3_data.images`), ``tool_calls`` with ``function.arguments`` as JSON text, ``tool_call_id``/``name``
on tool messages; original assistant turns are kept), ``tools`` (JSON text of OpenAI tool definitions, or
null), ``source_format``, ``source_row`` (0-based record index in the source file; for JSONL blank lines are
not counted). Shard of a row = ``files.shard_of(sample_id, num_shards)``, so appending records to a source never
moves existing samples.

Every conversation passes :func:`sources.base.check_conversation`: at least one message, only the four
roles, system messages only before the first turn, first non-system turn a user turn, no empty user text.
A conversation may end with a user turn (a pure prompt) or with an assistant turn (the generate stage
decides which assistant turn(s) to regenerate).

Rejects (``schemas.REJECTS``, stage ``normalize``): reason codes of ``sources.REJECT_REASONS``. A row whose
id repeats an earlier row's id is rejected as ``duplicate_id`` (the first occurrence wins); a row whose prompt (its
system, user and tool messages and tools: the assistant turns, which generate replaces, are not compared) repeats
an earlier row's under another id is rejected as ``duplicate_prompt`` unless ``duplicate_prompts`` is ``keep``.

``prompt_key`` (:func:`prompt_key`) is the key the merge's held-out split goes by: copies of one prompt text, in
any dataset, under any id, with other case, punctuation or spacing, always fall on the same side.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import pyarrow.parquet as pq

from . import schemas
from .errors import ExpectedFailure
from .decontaminate.overlap import normalized, squash
from .files import atomic_path, content_hash, shard_of
from .images import content_text, image_parts
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


def prompt_key(messages: list) -> str | None:
    """The key of a conversation's prompt text: 16 hex digits (BLAKE2b) of its user messages' texts, each reduced
    to its words (:func:`eagle3_data.decontaminate.overlap.normalized`: case, punctuation and spacing ignored),
    one line per message; a text without a word counts with its spacing squashed. None without a user text.

    ``[{"role": "user", "content": "What is 2+2?"}]`` and ``[{"role": "system", ...}, {"role": "user", "content":
    "what is 2 + 2"}]`` get the same key: system prompts and assistant turns are not part of it. A user message's
    images (:mod:`eagle3_data.images`) are part of its line, by their digests: one question about two pictures
    is two prompts."""
    lines = []
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") == "user"):
            continue
        text, pictures = content_text(m.get("content")), image_parts([m])
        line = (normalized(text) or squash(text)) if text.strip() else ""
        line += "".join(f" <image {p['image']['sha256']}>" for p in pictures)
        if line:
            lines.append(line)
    return content_hash("prompt", lines, length=8) if lines else None


def _prompt_digest(messages: list, tools) -> bytes:
    """The 8-byte BLAKE2b digest of a conversation's prompt as sent: its non-assistant messages and tools (the
    ``duplicate_prompt`` rule)."""
    asked = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "assistant")]
    blob = json.dumps([asked, tools], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=8).digest()


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
    log = log or logging.getLogger("eagle3_data.normalize")
    if len(out_paths) != settings.shards:
        raise ValueError(f"normalize: {len(out_paths)} output paths for {settings.shards} shards")
    if settings.max_samples is not None and settings.max_samples < 0:
        raise ValueError(f"normalize: max_samples must be >= 0 or null, got {settings.max_samples}")
    adapter = get_adapter(settings.format, settings.options)
    kind = "tokens" if adapter.output == "tokens" else "prompts"
    source_path = Path(settings.path)
    tally = _Tally(settings.dataset)
    t0 = last = time.monotonic()
    log.info(
        "normalize %s: reading %s as %s -> %d shard(s) of %s",
        settings.dataset,
        source_path,
        settings.format,
        settings.shards,
        kind,
    )
    with contextlib.ExitStack() as stack:
        shards = [_ShardWriter(p, kind, stack, batch_rows) for p in out_paths]
        records = stack.enter_context(contextlib.closing(iter_records(source_path, on_error=settings.on_error)))
        for index, record, where in records:
            if settings.max_samples is not None and tally.kept >= settings.max_samples:
                break
            tally.rows_read += 1
            row = _row_of(record, index, where, adapter, kind, settings, tally)
            if row is None:
                continue
            shards[shard_of(row["sample_id"], settings.shards)].add(row)
            tally.kept += 1
            last = _log_progress(log, tally, t0, last)
        if tally.rows_read and sum(tally.rejected.values()) > settings.max_reject_rate * tally.rows_read:
            raise RejectCeilingError(
                reject_ceiling_message(
                    settings.dataset,
                    settings.format,
                    source_path,
                    tally.rows_read,
                    tally.rejected,
                    tally.examples,
                    settings.max_reject_rate,
                )
            )
        for s in shards:
            s.flush()
        schemas.write_checked(schemas.from_rows(tally.rejects, schemas.REJECTS), "rejects", rejects_path)
    if tally.rows_read == 0:
        raise SourceFormatError(
            f"{source_path}: the source holds no records (dataset {settings.dataset}, format {settings.format}); "
            "point datasets.<name>.source.path at a non-empty file"
        )
    counts = tally.counts([s.count for s in shards], kind)
    _log_done(log, settings.dataset, source_path, counts, t0)
    return counts


@dataclass
class _Tally:
    """What :func:`normalize` counts while it reads a source: rows read and kept, the rejects (rows, per reason,
    one example each), the repairs of kept rows, the ids seen and the skipped (not JSON) lines."""

    dataset: str
    rows_read: int = 0
    kept: int = 0
    rejects: list[dict] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    repaired: Counter = field(default_factory=Counter)
    seen: set[str] = field(default_factory=set)
    #: prompt digest -> (sample_id, source row) of the first row with that prompt (``duplicate_prompt``)
    prompts: dict[bytes, tuple[str, int]] = field(default_factory=dict)
    skipped_lines: list[int] = field(default_factory=list)

    def reject(self, reason: str, detail: str, sid: str | None, index: int) -> None:
        self.rejected[reason] += 1
        self.examples.setdefault(reason, detail)
        self.rejects.append(
            {
                "sample_id": sid,
                "dataset": self.dataset,
                "stage": "normalize",
                "reason": reason,
                "detail": detail[:2000],
                "source_row": index,
            }
        )

    def counts(self, per_shard: list[int], kind: str) -> dict:
        """:func:`normalize`'s result."""
        return {
            "rows_read": self.rows_read,
            "kept": self.kept,
            "rejected": dict(sorted(self.rejected.items())),
            "per_shard": per_shard,
            "repaired": dict(sorted(self.repaired.items())),
            "output": kind,
            "skipped_lines": self.skipped_lines,
        }


def _row_of(record, index: int, where: str, adapter, kind: str, settings: NormalizeSettings, tally: _Tally):
    """The PROMPTS (or TOKENS) row of source record number ``index`` (at ``where``), or None when it is rejected
    (noted in ``tally``); the repairs of a kept row are counted in ``tally.repaired``. Raises SourceFormatError
    for a record of another shape among the first :data:`FORMAT_PROBE_RECORDS`."""
    source_path = Path(settings.path)
    if isinstance(record, InvalidLine):  # on_error: skip
        tally.reject("invalid_json", f"{source_path}:{where.removeprefix('line ')}: {record.message}", None, index)
        tally.skipped_lines.append(int(where.removeprefix("line ")))
        return None
    problem = adapter.shape_problem(record)
    if problem is not None:
        if index < FORMAT_PROBE_RECORDS:
            raise SourceFormatError(f"{source_path} {where}: expected {adapter.expected}, {problem}")
        tally.reject("malformed_record", f"{where}: {problem}", None, index)
        return None
    try:
        sample = adapter.convert(record)
        if kind == "tokens":
            sid = sample.sample_id or content_hash(sample.input_ids, sample.loss_mask)
        else:
            messages_json, tools_json = _prompt_json(sample)
            sid = sample.sample_id or content_hash(sample.messages, sample.tools)
    except RowReject as rej:
        tally.reject(rej.reason, f"{where}: {rej.detail}", rej.sample_id, index)
        return None
    except RecursionError:  # a record that decodes, nested too deep to be walked or written as JSON
        tally.reject("nested_too_deep", f"{source_path} {where}: {TOO_DEEP}", None, index)
        return None
    if _SURROGATE.search(sid):  # an id must be stable and exact: not repaired
        tally.reject("invalid_id", f"{where}: sample id {sid!r} is not valid Unicode (unpaired surrogate)", None, index)
        return None
    if sid in tally.seen:
        tally.reject("duplicate_id", f"{where}: sample_id {sid!r} already used by an earlier row", sid, index)
        return None
    if kind != "tokens" and settings.duplicate_prompts == "drop":
        digest = _prompt_digest(sample.messages, sample.tools)
        first = tally.prompts.setdefault(digest, (sid, index))
        if first[0] != sid:
            tally.reject(
                "duplicate_prompt",
                f"{where}: the same prompt as {first[0]!r} (source row {first[1]}), an earlier row",
                sid,
                index,
            )
            return None
    tally.seen.add(sid)
    tally.repaired.update(sample.notes)
    if kind == "tokens":
        return _tokens_row(sid, settings.dataset, sample.input_ids, sample.loss_mask)
    return {
        "sample_id": sid,
        "dataset": settings.dataset,
        "messages": messages_json,
        "tools": tools_json,
        "source_format": settings.format,
        "source_row": index,
        "prompt_key": prompt_key(sample.messages),
    }


def _log_progress(log: logging.Logger, tally: _Tally, t0: float, last: float) -> float:
    """Log the progress every :data:`PROGRESS_EVERY_S` seconds; returns the time of the last progress line."""
    now = time.monotonic()
    if now - last < PROGRESS_EVERY_S:
        return last
    log.info(
        "normalize %s: %d read, %d kept, %d rejected (%.0f rows/s)",
        tally.dataset,
        tally.rows_read,
        tally.kept,
        sum(tally.rejected.values()),
        tally.rows_read / max(now - t0, 1e-9),
    )
    return now


def _log_done(log: logging.Logger, dataset: str, source_path: Path, counts: dict, t0: float) -> None:
    """Log the skipped lines (a warning) and the final counts."""
    skipped_lines = counts["skipped_lines"]
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
        counts["rows_read"],
        counts["kept"],
        counts["rejected"] or "{}",
        counts["per_shard"],
    )
