"""Logging setup for stage scripts: one log file per job (``snakemake.log[0]``) plus stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(log_path: str | None = None, level: int = logging.INFO,
                  console_level: int | None = None) -> logging.Logger:
    """Send the ``eagle3_data`` logger's records to ``log_path`` (if given; appended below a line opening this
    attempt, so a rerun keeps the earlier attempts' lines) and stderr; return it.

    ``console_level``: the least level that reaches stderr (default: ``level``), e.g. WARNING for a generate job of
    a workflow run, whose progress the run-wide view shows (:mod:`eagle3_data.runview`).

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
