"""The job's process context: its log file (and the launched servers' logs beside it), SIGTERM as an exception."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path

from .runner import Terminated


def log_file(log) -> Path | None:
    """The job log's file: ``log`` itself when a path, else the first FileHandler of a Logger (or its parents)."""
    if isinstance(log, (str, os.PathLike)):
        return Path(log)
    lg = log if isinstance(log, logging.Logger) else logging.getLogger("eagle3_data")
    while lg is not None:
        for h in lg.handlers:
            if getattr(h, "baseFilename", None):
                return Path(h.baseFilename)
        lg = lg.parent if lg.propagate else None
    return None


def server_log_path(log, journal_dir: Path, dataset: str, shard: str, backend: str) -> Path:
    p = log_file(log)
    if p is not None:
        return p.with_name(f"{p.stem}.server-{backend}.log")
    return journal_dir / dataset / f"{shard}.server-{backend}.log"


@contextlib.contextmanager
def job_logging(log):
    """Attach a file handler for ``log`` (a path) to the package logger for the job's duration."""
    if not isinstance(log, (str, os.PathLike)):
        yield
        return
    pkg = logging.getLogger("eagle3_data")
    target = os.path.abspath(log)
    if any(getattr(h, "baseFilename", None) == target for h in pkg.handlers):
        yield
        return
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(target, mode="a")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    pkg.addHandler(h)
    if pkg.level == logging.NOTSET or pkg.level > logging.INFO:
        pkg.setLevel(logging.INFO)
    try:
        yield
    finally:
        pkg.removeHandler(h)
        h.close()


@contextlib.contextmanager
def sigterm_as_exception():
    """While active (main thread only), SIGTERM raises so that ``finally`` blocks stop servers and close
    the journal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
