"""The RESPONSES output of a job: journaled responses read back from the journal files (pyarrow's JSON reader, no
Python dict per row) into a :class:`..schemas.CheckedParquetWriter`."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from .. import schemas
from .journal import iter_journal_file

logger = logging.getLogger("eagle3_data.generate")

RESPONSE_FIELDS = [f.name for f in schemas.RESPONSES]


def journal_batches(path: Path, block_bytes: int):
    """Record batches (``schemas.RESPONSES`` columns) of one journal file, parsed by pyarrow's streaming JSON
    reader (about ``block_bytes`` of JSON per batch, extra keys ignored). Raises ``pyarrow.ArrowInvalid`` at the
    first line it can't parse (a torn write, a record longer than a block): the caller falls back to Python."""
    import pyarrow as pa
    import pyarrow.json as pj

    with pa.OSFile(str(path), "r") as fh:
        reader = pj.open_json(
            fh,
            read_options=pj.ReadOptions(block_size=block_bytes, use_threads=False),
            parse_options=pj.ParseOptions(explicit_schema=schemas.RESPONSES, unexpected_field_behavior="ignore"),
        )
        yield from reader


def write_output(
    out_path,
    journal_dir: Path,
    dataset: str,
    ok_keys: list[str],
    failed_rows: list[dict],
    batch_rows: int,
    block_bytes: int = 1 << 18,
) -> int:
    """Write a RESPONSES parquet from the journal: the journaled records of ``ok_keys`` (see
    :func:`write_journaled`) + ``failed_rows``; return the row count. (The stage itself streams its new
    responses into the writer as they arrive and reads only earlier runs' responses back from the journal.)

    Raises RuntimeError if a key is missing from the journal."""
    with schemas.CheckedParquetWriter("responses", out_path) as w:
        write_journaled(w, Path(journal_dir) / dataset, set(ok_keys), batch_rows, block_bytes)
        w.write_rows(failed_rows)
        return w.rows


def wanted_runs(keys: list, wanted: set) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of positions whose key is in ``wanted`` (each key taken once: removed from
    ``wanted``, so a later duplicate is skipped). ``["a", "x", "b", "c"]`` with wanted {a, b, c} -> [(0, 1), (2, 4)]."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, k in enumerate(keys):
        if k in wanted:
            wanted.discard(k)
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(keys)))
    return runs


def batch_suspect(rb) -> bool:
    """True if a journal batch holds a value :func:`journal.record_problem` rejects that parsing alone lets
    through (a negative count or cost, a non-finite number, a negative output or prompt token id): the arrow path and
    :func:`journal.read_journal` must agree on which records exist."""
    for name in ("turn", "prompt_tokens", "completion_tokens", "reasoning_tokens"):
        if any(v is not None and v < 0 for v in rb.column(name).to_pylist()):
            return True
    for name in ("cost_usd", "latency_s", "completed_at"):
        if any(
            v is not None and (not math.isfinite(v) or (name == "cost_usd" and v < 0))
            for v in rb.column(name).to_pylist()
        ):
            return True
    import numpy as np  # already loaded by pyarrow; np.frombuffer, unlike to_numpy, loads no pyarrow.compute

    for name in ("output_ids", "prompt_ids"):  # prompt_ids: null in journals written before it existed
        ids = rb.column(name).values  # the int32 child (a freshly parsed batch: no slicing offsets)
        if (
            len(ids)
            and int(np.frombuffer(ids.buffers()[1], dtype=np.int32, count=len(ids), offset=4 * ids.offset).min()) < 0
        ):
            return True
    return False


def write_journaled(
    w: schemas.CheckedParquetWriter,
    folder: Path,
    wanted: set,
    batch_rows: int,
    block_bytes: int = 1 << 18,
    files: list | None = None,
) -> None:
    """Write the journaled records whose ``request_key`` is in ``wanted`` (emptied as they are found) to ``w``.

    The ``*.jsonl`` files of ``folder`` (or only ``files``: those the resume index found the keys in, so that
    a shard does not parse the other shards' journals) are streamed in name order, first occurrence of a key
    wins (as in :func:`journal.read_journal`). Each file is read in ~``block_bytes`` batches by pyarrow's JSON
    reader (no Python dict per row, zero-copy slices of the wanted rows); from a line it can't parse (torn
    write) on, that file is read line by line in Python (``batch_rows`` rows a batch).

    Raises RuntimeError if a key is missing from the journal (it was appended this run or read at start)."""
    import pyarrow as pa

    for path in (sorted(files) if files is not None else sorted(folder.glob("*.jsonl"))) if wanted else []:
        try:
            for rb in journal_batches(path, block_bytes):
                if batch_suspect(rb):  # a value journal.record_problem rejects: judge each line in Python
                    raise pa.ArrowInvalid("a record with an out-of-range value")
                runs = wanted_runs(rb.column("request_key").to_pylist(), wanted)
                if runs:  # zero-copy slices: no pyarrow.compute (its kernel registry is ~50 MB RSS)
                    w.write_table(pa.Table.from_batches([rb.slice(a, b - a) for a, b in runs]))
                if not wanted:
                    break
        except pa.ArrowInvalid as exc:  # torn line or an oversized record: the rest of this file in Python
            logger.debug("journal %s: arrow reader stopped (%s); reading it line by line", path, exc)
            batch: list[dict] = []
            for rec in iter_journal_file(path):
                if rec["request_key"] in wanted:
                    wanted.discard(rec["request_key"])
                    batch.append({k: rec.get(k) for k in RESPONSE_FIELDS})
                    if len(batch) >= batch_rows:
                        w.write_rows(batch)
                        batch = []
            w.write_rows(batch)
        if not wanted:
            break
    if wanted:
        raise RuntimeError(
            f"{folder}: {len(wanted)} journaled response(s) vanished while the job "
            f"ran (e.g. request_key {sorted(wanted)[0]}); output not written"
        )
