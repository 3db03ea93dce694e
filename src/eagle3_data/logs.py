"""Logging setup for stage scripts: one log file per job (``snakemake.log[0]``) plus stderr."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path


def setup_logging(
    log_path: str | None = None, level: int = logging.INFO, console_level: int | None = None
) -> logging.Logger:
    """Send the ``eagle3_data`` logger's records to ``log_path`` (if given) and stderr; return it.

    The log holds every attempt of the job: the earlier ones first (kept in :func:`attempts_path`, since Snakemake
    deletes a job's log before it runs it), then a line opening this one (:data:`ATTEMPT_RE`), then its records.

    ``console_level``: the least level that reaches stderr (default: ``level``), e.g. WARNING for a generate job of
    a workflow run, whose progress the run-wide view shows (:mod:`eagle3_data.runtime.runview`).

    Also installs a ``sys.excepthook`` so an uncaught error (with its traceback) lands in the job's log file.
    """
    logger = logging.getLogger("eagle3_data")
    logger.setLevel(level)
    logger.handlers.clear()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        _open_attempt(log_path)
        handlers += [logging.FileHandler(log_path, mode="a"), logging.FileHandler(attempts_path(log_path), mode="a")]
    if console_level is not None and log_path:
        handlers[0].setLevel(console_level)
    for h in handlers:
        h.setFormatter(fmt)
        logger.addHandler(h)
    logger.propagate = False

    def log_uncaught(exc_type, exc, tb):
        # the job's log file names the error (file, line, field) as well as the terminal
        logger.error("%s: %s", exc_type.__name__, exc, exc_info=(exc_type, exc, tb))

    sys.excepthook = log_uncaught
    return logger


#: the level of a stage's result line that a run's console shows even under the live view, which leaves out a
#: job's INFO records (eagle3_data.runtime.joboutput): e.g. the extraction plan's one-line summary
NOTICE = 25
logging.addLevelName(NOTICE, "NOTICE")

#: the line that opens an attempt of a job in its log: ``===== <ISO time> pid <pid>: attempt <n> of this job``
ATTEMPT_RE = re.compile(r"^===== \S+ pid \d+: attempt (\d+) of this job( \(earlier ones above\))? =====$")


def attempts_path(log_path: str | os.PathLike) -> Path:
    """Where a job's log keeps every attempt: a hidden file beside it, ``.<name>.attempts``. Snakemake deletes a
    job's log before the job runs (``Job.remove_existing_output`` in snakemake/jobs.py), so the log alone would
    hold the last attempt only."""
    p = Path(log_path)
    return p.with_name(f".{p.name}.attempts")


def _open_attempt(log_path: str | os.PathLike) -> None:
    """Start ``log_path`` with the job's earlier attempts (from :func:`attempts_path`) and a header line for
    this one (:data:`ATTEMPT_RE`), and append the header to the attempts file."""
    import datetime

    log, keep = Path(log_path), attempts_path(log_path)
    try:
        earlier = keep.read_text(errors="replace")
    except FileNotFoundError:
        earlier = ""
    n = 1 + sum(1 for ln in earlier.splitlines() if ATTEMPT_RE.match(ln))
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    header = f"===== {stamp} pid {os.getpid()}: attempt {n} of this job{' (earlier ones above)' if n > 1 else ''} ====="
    log.parent.mkdir(parents=True, exist_ok=True)
    current = log.read_text(errors="replace") if log.exists() else ""
    # Snakemake emptied the log: put the earlier attempts back; else (a direct call) it already holds them
    log.write_text((current or earlier) + header + "\n")
    with open(keep, "a") as fh:
        if current and not earlier:  # a log written before the attempts file existed: keep it too
            fh.write(current)
        fh.write(header + "\n")


def last_attempt(lines: list[str]) -> list[str]:
    """The lines of a job log's last attempt (after the last :data:`ATTEMPT_RE` header; all when none)."""
    last = max((i for i, ln in enumerate(lines) if ATTEMPT_RE.match(ln)), default=-1)
    return lines[last + 1 :]


#: a log file a message names (kept whole when the message is clipped)
_LOG_PATH_RE = re.compile(r"\S+\.log\b")


def clip_line(text: str, limit: int = 400) -> str:
    """``text`` in at most about ``limit`` characters for a console line: whole when it fits, else its start and
    its end joined by `` ... `` at word boundaries, the end from the first log file it names (``*.log``) on, so
    neither a word nor the log path is cut."""
    if len(text) <= limit:
        return text
    m = _LOG_PATH_RE.search(text, len(text) // 3)
    start = m.start() if m else len(text) - limit // 3
    tail = text[start:] if m else text[start:].split(" ", 1)[-1]
    room = max(limit - len(tail) - 5, limit // 3)
    head = text[:room].rsplit(" ", 1)[0] if " " in text[:room] else text[:room]
    return f"{head.rstrip()} ... {tail.lstrip()}"


class WarningTally(logging.Handler):
    """Counts the warnings (and errors) that reach it by reason, into ``counts``: a record's ``reason`` (``extra=
    {"reason": ...}``), else ``"other"``; a record with ``tally=False`` is left out (counted elsewhere: a failed
    sample is in the job's ``failed`` counts). A generate job's counts go to the run-wide view
    (:mod:`eagle3_data.runtime.runview`), which shows them per reason instead of a console line per warning; the text of
    each warning stays in the job's log file."""

    def __init__(self, counts: dict | None = None):
        super().__init__(logging.WARNING)
        self.counts = {} if counts is None else counts

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "tally", True) is False:
            return
        reason = str(getattr(record, "reason", None) or "other")
        self.counts[reason] = self.counts.get(reason, 0) + 1


def tally_warnings(counts: dict | None = None, logger_name: str = "eagle3_data"):
    """A context manager: while it is open, the warnings of ``logger_name`` (and its children) are counted by
    :class:`WarningTally` into ``counts`` (a new dict by default), which it yields."""
    import contextlib

    @contextlib.contextmanager
    def _cm():
        h = WarningTally(counts)
        lg = logging.getLogger(logger_name)
        lg.addHandler(h)
        try:
            yield h.counts
        finally:
            lg.removeHandler(h)

    return _cm()
