"""Logging setup for stage scripts: one log file per job (``snakemake.log[0]``) plus stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(
    log_path: str | None = None, level: int = logging.INFO, console_level: int | None = None
) -> logging.Logger:
    """Send the ``eagle3_data`` logger's records to ``log_path`` (if given; appended below a line opening this
    attempt, so a rerun keeps the earlier attempts' lines) and stderr; return it.

    ``console_level``: the least level that reaches stderr (default: ``level``), e.g. WARNING for a generate job of
    a workflow run, whose progress the run-wide view shows (:mod:`eagle3_data.runtime.runview`).

    Also installs a ``sys.excepthook`` so an uncaught error (with its traceback) lands in the job's log file.
    """
    logger = logging.getLogger("eagle3_data")
    logger.setLevel(level)
    logger.handlers.clear()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:  # appended: a rerun's attempt goes below the earlier ones (an outage's history is kept)
        handlers.append(logging.FileHandler(log_path, mode="a"))
    if console_level is not None and log_path:
        handlers[0].setLevel(console_level)
    for h in handlers:
        h.setFormatter(fmt)
        logger.addHandler(h)
    logger.propagate = False
    if log_path:
        import datetime
        import os

        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        with open(log_path, "a") as fh:
            fh.write(f"===== {stamp} pid {os.getpid()}: a new attempt (earlier ones above) =====\n")

    def log_uncaught(exc_type, exc, tb):
        # the job's log file names the error (file, line, field) as well as the terminal
        logger.error("%s: %s", exc_type.__name__, exc, exc_info=(exc_type, exc, tb))

    sys.excepthook = log_uncaught
    return logger


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
