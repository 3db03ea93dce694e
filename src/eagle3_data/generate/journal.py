"""Append-only response journal: what has been paid for survives crashes, kills and deleted results.

Layout: ``<journal_dir>/<dataset>/<shard>.jsonl``, one JSON object per line, each a completed response
(``status == "ok"``) with its ``request_key`` and every ``schemas.RESPONSES`` field. A job appends only to
its own shard file, but reads *all* ``*.jsonl`` files of the dataset on start, so a changed shard count still
finds earlier responses.

Durability: each record is written to the OS with one ``os.write`` on an ``O_APPEND`` descriptor as soon
as it arrives, before its request counts as done (a ``kill -9`` of the job loses nothing written), and
``fsync``-ed in small batches (every ``sync_every`` records or ``sync_interval_s`` seconds, and on close) against
power loss. The batches are fsync-ed by a thread of the writer (the fsync releases the GIL), so an event loop
appending records never waits for the disk. A crash can leave a
torn last line; the reader skips lines that are not complete JSON objects (counted and reported), and the
writer starts a fresh line if the file does not end in a newline, so a torn fragment never glues onto the
next record. Failed requests are never journaled: a rerun retries them; a *paid reject* (a 200 reply that can't be kept:
:mod:`eagle3_data.backends.paid`) is, as a record with ``status == "failed"`` and its reason in ``error`` (no text), so a
rerun neither pays for it again nor loses its cost (an ``undecodable_reply`` reject also keeps the start of the
raw body, keys scrubbed, under ``raw_reply``: a key no RESPONSES column reads). The file is opened at the first record (or
:meth:`JournalWriter.ensure_open`, before a job sends anything): a job with nothing to send never needs to write;
a journal that can't be written (disk full, read-only) raises :class:`JournalWriteError`, one line naming the
directory and the reason; records that arrive after it (replies in flight, given the stop grace) are held by the
job and written by :func:`save_held` to the journal if it can take them by then, else to a fallback file in the
system's temp directory (:func:`held_dir`: a folder of the user's own, mode 0700, the files 0600). The rerun moves
those files into the journal before it reads it (:func:`adopt_held`), and :func:`read_journal` reads any still
there: nothing paid for is bought again with the command the user types.

The journal never holds an API key: records are response fields only (no headers, no request options).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import ExpectedFailure
from ..schemas import INT32_END, is_token_ids

logger = logging.getLogger("eagle3_data.generate.journal")


class JournalError(RuntimeError):
    """The journal directory or a record is unusable (message names the file)."""


class JournalWriteError(ExpectedFailure):
    """The journal can't be written (disk full, read-only, no permission): ``message`` names the directory and the
    reason, ``hint`` says that a rerun resumes once it can be. The job must stop sending (a reply it can't journal
    would be paid for again)."""

    @classmethod
    def of(cls, path: Path, exc: OSError) -> "JournalWriteError":
        why = {
            errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is used up",
            errno.EROFS: "the file system is read-only",
            errno.EACCES: "no permission to write there",
            errno.EPERM: "no permission to write there",
        }.get(exc.errno, exc.strerror or str(exc))
        return cls(
            f"cannot write the response journal in {path.parent}/: {why} ({path.name}: "
            f"[Errno {exc.errno}] {exc.strerror})",
            hint=f"free space in (or make writable) {path.parent}/, then rerun the same command: every "
            "response journaled so far is kept and not paid for again; no request was sent after this",
        )


def journal_path(journal_dir: str | os.PathLike, dataset: str, shard: str) -> Path:
    """``<journal_dir>/<dataset>/<shard>.jsonl``."""
    return Path(journal_dir) / dataset / f"{shard}.jsonl"


_TEXT_FIELDS = (
    "sample_id",
    "dataset",
    "messages",
    "tools",
    "status",
    "error",
    "reasoning",
    "content",
    "tool_calls",
    "finish_reason",
    "backend",
    "provider",
    "model",
    "generation_id",
    "system_fingerprint",
)
_COUNT_FIELDS = ("turn", "prompt_tokens", "completion_tokens", "reasoning_tokens", "attempts")
_NUMBER_FIELDS = ("cost_usd", "latency_s", "completed_at")


def record_problem(rec: dict) -> str | None:
    """Why ``rec`` can't be a RESPONSES row (a field of the wrong type, a NaN cost, a negative count, an id out of
    int32 ...), or None. A hand-edited or foreign line that fails this is skipped like a torn one."""
    import math

    for k in _TEXT_FIELDS:
        v = rec.get(k)
        if v is not None and not isinstance(v, str):
            return f"field {k!r} is {type(v).__name__}, not text"
    for k in _COUNT_FIELDS:
        v = rec.get(k)
        if v is not None and (type(v) is not int or not 0 <= v < INT32_END):
            return f"field {k!r} is {v!r}, not a count"
    for k in _NUMBER_FIELDS:
        v = rec.get(k)
        if v is not None and (type(v) not in (int, float) or not math.isfinite(v) or (k == "cost_usd" and v < 0)):
            return f"field {k!r} is {v!r}, not a finite number"
    for k in ("output_ids", "prompt_ids"):  # prompt_ids: absent from journals written before it existed
        ids = rec.get(k)
        if ids is not None and not is_token_ids(ids):
            return f"field {k!r} is not a list of token ids"
    return None


def iter_journal_file(path: str | os.PathLike, stats: dict | None = None, warn: bool = False) -> Iterator[dict]:
    """Yield the complete records of one journal file in line order (torn/invalid lines skipped and counted in
    ``stats["bad_lines"]``, complete lines in ``stats["lines"]``)."""
    stats = stats if stats is not None else {}
    for k in ("lines", "bad_lines"):
        stats.setdefault(k, 0)
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            stats["lines"] += 1
            try:
                rec = json.loads(raw)
                if not isinstance(rec, dict) or not isinstance(rec.get("request_key"), str):
                    raise ValueError("not a record with a request_key (torn write?)")
                problem = record_problem(rec)
                if problem:
                    raise ValueError(problem)
            except ValueError as exc:
                stats["bad_lines"] += 1
                if warn:
                    logger.warning(
                        "journal %s line %d: %s; skipped (its request is sent again)",
                        path,
                        lineno,
                        str(exc)[:200],
                        extra={"reason": "journal_bad_line"},
                    )
                continue
            yield rec


def read_journal(
    journal_dir: str | os.PathLike, dataset: str, fields: Iterable[str] | None = None, key_files: dict | None = None
) -> tuple[dict[str, dict], dict]:
    """Read every ``*.jsonl`` of ``<journal_dir>/<dataset>/``, then those :func:`save_held` wrote to
    ``held_dir(journal_dir, dataset)`` when the journal could not take them.

    Returns ``(records, stats)``: ``records`` maps ``request_key`` -> record dict (first occurrence wins;
    a duplicate key is counted, not an error); with ``fields``, each record keeps only those keys (the
    resume index of a large journal without its texts); ``stats`` = ``{"files", "lines", "records",
    "bad_lines", "duplicates"}``. A line that is not a JSON object with a string ``request_key`` (a torn
    write) is skipped with a warning naming file and line number. ``key_files`` (a dict, filled in) maps each
    key to the file (a ``Path``) its record was taken from.
    """
    records: dict[str, dict] = {}
    stats = {"files": 0, "lines": 0, "records": 0, "bad_lines": 0, "duplicates": 0}
    keep = None if fields is None else tuple(fields)
    folder = Path(journal_dir) / dataset
    held = held_dir(journal_dir, dataset)  # paid replies a full disk kept from the journal (read after it)
    paths = [*(sorted(folder.glob("*.jsonl")) if folder.is_dir() else [])]
    # (and a file a job was moving into the journal when it died: ``*.adopting-<pid>``, :func:`adopt_held`)
    paths += sorted([*held.glob("*.jsonl"), *held.glob("*.adopting-*")]) if held.is_dir() else []
    for path in paths:
        stats["files"] += 1
        for rec in iter_journal_file(path, stats, True):
            key = rec["request_key"]
            if key in records:
                stats["duplicates"] += 1
                continue
            records[key] = rec if keep is None else {k: rec.get(k) for k in keep}
            if key_files is not None:
                key_files[key] = path
            stats["records"] += 1
    return records, stats


class JournalWriter:
    """Appends completed responses to ``<journal_dir>/<dataset>/<shard>.jsonl``.

    Use as a context manager (``close`` fsyncs). ``append(record)`` requires ``record["request_key"]``;
    values must be JSON-serialisable (lists of ints, strings, numbers, None). A daemon thread (started with the
    writer, stopped by ``close``) fsyncs the batches; ``sync()`` fsyncs at once in the caller's thread.
    """

    def __init__(
        self,
        journal_dir: str | os.PathLike,
        dataset: str,
        shard: str,
        *,
        sync_every: int = 32,
        sync_interval_s: float = 1.0,
    ):
        self.path = journal_path(journal_dir, dataset, shard)
        self.sync_every = max(1, int(sync_every))
        self.sync_interval_s = float(sync_interval_s)
        self._fd: int | None = None  # opened at the first record: a job with nothing to send never writes here
        self._closed = False
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self.written = 0
        self._cond = threading.Condition()
        self._closing = False
        self._sync_error: OSError | None = None
        self._syncer = threading.Thread(target=self._sync_loop, name=f"journal-sync-{dataset}-{shard}", daemon=True)
        self._syncer.start()

    def _sync_loop(self) -> None:
        """The syncer thread: fsync when ``sync_every`` records wait, or ``sync_interval_s`` after the last sync
        while any does; ends at ``close``."""
        cond = self._cond
        while True:
            with cond:
                cond.wait_for(lambda: self._closing or self._unsynced >= self.sync_every, timeout=self.sync_interval_s)
                if self._closing:
                    return
                if not self._unsynced or (
                    self._unsynced < self.sync_every and time.monotonic() - self._last_sync < self.sync_interval_s
                ):
                    continue
                self._unsynced = 0
                self._last_sync = time.monotonic()
            try:
                os.fsync(self._fd)  # the fd stays open: close() joins this thread first
            except OSError as exc:  # a full or failing disk: raised by the next append / sync / close
                self._sync_error = exc
                return

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if created:
                dfd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            else:
                size = os.fstat(self._fd).st_size
                if size:
                    with open(self.path, "rb") as fh:
                        fh.seek(size - 1)
                        if fh.read(1) != b"\n":  # torn last line: never glue the next record onto it
                            os.write(self._fd, b"\n")
        except OSError as exc:
            raise JournalWriteError.of(self.path, exc) from None
        return self._fd

    def ensure_open(self) -> None:
        """Open (create) the file now: a job calls it before it sends anything, so an unwritable journal stops it
        before it pays. Raises :class:`JournalWriteError`."""
        if self._fd is None and not self._closed:
            self._open()

    def append(self, record: dict) -> bytes:
        """Write one record now (one ``os.write``); fsync when the batch is full or old enough. Returns the line
        written (UTF-8 JSON + newline)."""
        if self._closed:
            raise JournalError(f"{self.path}: journal already closed")
        if not isinstance(record.get("request_key"), str):
            raise JournalError(f"{self.path}: record without a request_key")
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        if self._sync_error is not None:
            raise JournalWriteError.of(self.path, self._sync_error) from None
        fd = self._fd if self._fd is not None else self._open()
        view = memoryview(line)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as exc:
            if len(view) < len(line):  # a part of the line went out: end it, so the next record starts afresh
                with contextlib.suppress(OSError):
                    os.write(fd, b"\n")
            raise JournalWriteError.of(self.path, exc) from None
        self.written += 1
        with self._cond:
            self._unsynced += 1
            if self._unsynced >= self.sync_every:
                self._cond.notify()
        return line

    def extend(self, records: Iterable[dict]) -> None:
        for r in records:
            self.append(r)

    def sync(self) -> None:
        """fsync what has been written, now (in the caller's thread). Raises :class:`JournalWriteError`."""
        if self._sync_error is not None:
            raise JournalWriteError.of(self.path, self._sync_error) from None
        with self._cond:
            pending, self._unsynced = self._unsynced, 0
            self._last_sync = time.monotonic()
        if self._fd is not None and pending:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise JournalWriteError.of(self.path, exc) from None

    def close(self) -> None:
        """Stop the syncer thread, fsync what is left, close the file."""
        self._closed = True
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._syncer.join()
        if self._fd is not None:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "JournalWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except JournalWriteError:
            if exc_type is None:  # leaving on an error already: that one is reported, not the closing one
                raise


def held_dir(journal_dir: str | os.PathLike, dataset: str | None = None) -> Path:
    """Where :func:`save_held` puts the paid replies a journal could not take:
    ``<temp>/eagle3-held-<uid>/<12 hex digits of the journal folder's absolute path>/<dataset>`` (``<temp>``: the
    system's temp directory, ``tempfile.gettempdir()``). The rerun of the same build finds them there."""
    import tempfile

    digest = hashlib.sha256(str(Path(journal_dir).resolve()).encode()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / f"eagle3-held-{os.getuid()}" / digest
    return root if dataset is None else root / dataset


def _private_dirs(path: Path) -> None:
    """Create ``path`` and the folders above it up to ``eagle3-held-<uid>``, each mode 0700. Raises OSError when
    that folder belongs to another user (another user pre-created it to read the replies)."""
    top = next(p for p in (path, *path.parents) if p.name.startswith("eagle3-held-"))
    for p in (top, *reversed([q for q in path.parents if top in q.parents]), path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o700)
    st = os.stat(top, follow_symlinks=False)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(errno.EACCES, f"{top} belongs to another user or is readable by others")


def save_held(
    records: list[dict], journal_dir: str | os.PathLike, dataset: str, shard: str
) -> tuple[Path | None, bool]:
    """Write paid ``records`` that the journal could not take when they arrived: appended to the shard's journal
    if it can be written now, else to ``<held_dir>/<shard>-<pid>.jsonl`` (:func:`held_dir`; readable by the owner
    only), which the rerun reads and moves into the journal (:func:`adopt_held`).

    Returns ``(path, in_journal)``: where they are (None if nowhere could take them) and whether that is the
    journal itself."""
    if not records:
        return None, True
    try:
        with JournalWriter(journal_dir, dataset, shard) as jw:
            for rec in records:
                jw.append(rec)
        return jw.path, True
    except (JournalWriteError, OSError):
        pass
    folder = held_dir(journal_dir, dataset)
    path = folder / f"{shard}-{os.getpid()}.jsonl"
    try:
        _private_dirs(folder)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return path, False
    except OSError:
        return None, False


def adopt_held(journal_dir: str | os.PathLike, dataset: str) -> int:
    """Move the files :func:`save_held` wrote for ``dataset`` into ``<journal_dir>/<dataset>/`` as
    ``held-<name>.jsonl`` (copied, fsync-ed, then removed; claimed by a rename first, so two shard jobs never both
    take one). A file the journal's disk still can't take stays where it is (and is read from there).
    Returns the number of records moved."""
    folder = held_dir(journal_dir, dataset)
    moved = 0
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        claim = path.with_suffix(f".adopting-{os.getpid()}")
        try:
            os.rename(path, claim)
        except OSError:
            continue  # another job took it
        dest = Path(journal_dir) / dataset / f"held-{path.name}"
        for i in range(1, 1000):
            if not dest.exists():
                break
            dest = dest.with_name(f"held-{path.stem}-{i}.jsonl")
        part = dest.with_name(dest.name + ".part")  # not *.jsonl: never read half-written
        data = claim.read_bytes()
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(part, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(part, dest)
        except OSError as exc:
            with contextlib.suppress(OSError):
                part.unlink()
            os.rename(claim, path)
            logger.warning("%s: kept in %s (the journal folder can't take it yet: %s)", path.name, folder, exc)
            continue
        claim.unlink()
        n = data.count(b"\n")
        moved += n
        logger.warning(
            "%d paid repl%s a full disk kept from the journal found in %s: moved into %s (not bought again)",
            n,
            "ies" if n != 1 else "y",
            path,
            dest,
            extra={"tally": False},
        )
    return moved
