"""Expected failures: one short message saying what happened and what to do next, printed once, no traceback.

A failure the user can act on (a bad config value, a missing API key variable, a dead backend, credits or a
budget exhausted, Ctrl-C) is an :class:`ExpectedFailure`: its ``message`` says what happened (naming the file, key,
backend or URL), its ``hint`` what to do next. Everything else is a bug and keeps its traceback.

How a stage uses it:

- raise it (or a subclass) where the failure is recognised::

      raise ExpectedFailure(f"backend {name!r} ({url}) refused every connection for 30 s",
                            hint="start the server or fix its base_url, then rerun the same command")

- run the stage's script body through :func:`run_stage` (``scripts/<stage>.py``)::

      from eagle3_data.errors import run_stage
      run_stage(lambda: generate(...), log=log)

  An :class:`ExpectedFailure` (and an ``OSError`` of a full, read-only or unwritable disk: :func:`disk_error`) is
  then logged as ONE ``ERROR`` line (message + hint) to the job's log file and
  stderr, and the process exits with ``exit_code`` (1; 130 for an interrupt) without a traceback. A
  ``KeyboardInterrupt`` becomes :class:`Interrupted`; under a workflow run (``EAGLE3_RUN_DIR`` set, see
  :mod:`.run`) an interrupt is written to the log file only, because the run prints one message for the whole run
  when it ends. Any other exception is logged with its traceback (once) and re-raised.

- code that is not a job (the Snakefile, a CLI) calls :func:`format_failure` to get the same text.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, TypeVar

T = TypeVar("T")

logger = logging.getLogger("eagle3_data")


class ExpectedFailure(Exception):
    """A failure the user can act on: reported as one message plus what to do next, without a traceback.

    Args:
        message: what happened; names the file, config key, backend, URL or variable concerned (never a secret).
        hint: what to do next (e.g. ``"export OPENROUTER_API_KEY=... and rerun the same command"``), or None.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return format_failure(self)


class Interrupted(ExpectedFailure):
    """Ctrl-C (SIGINT) or SIGTERM: the work done so far is kept; rerunning resumes."""

    exit_code = 130


class DiskError(ExpectedFailure):
    """An output could not be written: the disk is full, read-only or not ours (``message`` names the path)."""


#: errno -> what it means for a file being written
DISK_ERRNOS = {
    28: "the disk is full",
    122: "the disk quota is used up",
    30: "the file system is read-only",
    13: "no permission to write there",
    1: "no permission to write there",
    27: "the file is too large",
    5: "an I/O error (a failing disk?)",
}


#: the errnos only a write can raise (a read of an input never does): what :func:`disk_error` blames on ``path``
WRITE_ERRNOS = frozenset({28, 122, 30, 27})


def disk_error(exc: BaseException, path=None) -> DiskError | None:
    """A one-line :class:`DiskError` for ``exc`` when it is an ``OSError`` of :data:`DISK_ERRNOS` (also one that
    gives its errno only in its text, as pyarrow's do), naming ``path`` (only for :data:`WRITE_ERRNOS`, which
    only writing it can have caused; else the file the system names, else none); with ``path``, also another
    library's error whose text is such an errno's (DuckDB's ``IO Error: ... No space left on device``); None for
    any other exception."""
    import re

    if isinstance(exc, OSError):
        code = exc.errno
        if code is None:
            m = re.search(r"\[Errno (\d+)\]", str(exc))
            code = int(m.group(1)) if m else None
    elif path is not None and isinstance(exc, Exception) and not isinstance(exc, ExpectedFailure):
        # a library's own error (DuckDB's IOException) saying so; an expected failure already says what it is
        code = next((c for c in sorted(WRITE_ERRNOS) if os.strerror(c) in str(exc)), None)
    else:
        return None
    if code not in DISK_ERRNOS:
        return None
    if path is not None and code not in WRITE_ERRNOS:
        return None
    where = path if path is not None else exc.filename
    what = f"cannot write {where}" if where is not None else "cannot write the job's output"
    return DiskError(
        f"{what}: {DISK_ERRNOS[code]} ([Errno {code}] {os.strerror(code)})",
        hint="free space there (or make it writable), then rerun the same command",
    )


def format_failure(exc: ExpectedFailure) -> str:
    """``message`` and, when there is one, ``hint`` as one line: ``"<message>. <hint>"`` (no doubled period)."""
    msg = exc.message.rstrip()
    if not exc.hint:
        return msg
    sep = " " if msg.endswith((".", "!", "?", ":")) else ". "
    hint = exc.hint.strip()
    return f"{msg}{sep}{hint[:1].upper()}{hint[1:]}"


def in_workflow_run() -> bool:
    """True inside a job of a workflow run whose end-of-run hook reports interrupts (``EAGLE3_RUN_DIR`` set)."""
    return bool(os.environ.get("EAGLE3_RUN_DIR"))


def _file_only(log: logging.Logger) -> list[logging.Handler]:
    """The stream handlers of ``log`` that write to the terminal (removed while an interrupt is logged)."""
    return [h for h in log.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def log_to_file(log: logging.Logger, level: int, msg: str, *args) -> None:
    """Log a record to ``log``'s files only when inside a workflow run (the terminal gets the run's one message),
    else normally."""
    quiet = _file_only(log) if in_workflow_run() else []
    for h in quiet:
        log.removeHandler(h)
    try:
        log.log(level, msg, *args)
    finally:
        for h in quiet:
            log.addHandler(h)


def report_failure(exc: ExpectedFailure, log: logging.Logger | None = None) -> None:
    """Log ``exc`` as one ERROR line (no traceback). An :class:`Interrupted` inside a workflow run goes to the log
    file only: the run prints one message for all its jobs when it ends."""
    log = log or logger
    if not log.handlers:  # no logging set up (a plain script): stderr
        print(f"error: {format_failure(exc)}", file=sys.stderr)
    elif isinstance(exc, Interrupted):
        log_to_file(log, logging.ERROR, "%s", format_failure(exc))
    else:
        log.error("%s", format_failure(exc))


def run_stage(
    main: Callable[[], T],
    *,
    log: logging.Logger | None = None,
    interrupted: Callable[[], ExpectedFailure] | None = None,
) -> T:
    """Run a stage's body; turn expected failures into one logged line and an exit code (see module docstring).

    Args:
        main: the stage's work (no arguments); its return value is returned.
        log: the job's logger (``logs.setup_logging``); default the ``eagle3_data`` logger.
        interrupted: builds the :class:`Interrupted` reported for a ``KeyboardInterrupt`` that ``main`` let
            through (default: "interrupted; rerun the same command to resume").

    Raises:
        SystemExit: with the failure's ``exit_code`` after an expected failure or an interrupt.
        Exception: any other error, after it was logged once with its traceback.
    """
    log = log or logger
    try:
        return main()
    except ExpectedFailure as exc:
        report_failure(exc, log)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        exc = interrupted() if interrupted else Interrupted("interrupted", hint="rerun the same command to resume")
        report_failure(exc, log)
        raise SystemExit(exc.exit_code) from None
    except OSError as exc:  # a full or read-only disk under an output: one line; any other: a bug
        failure = disk_error(exc)
        if failure is None:
            log.error("%s: %s", type(exc).__name__, exc, exc_info=True)
            sys.excepthook = lambda *a: None
            raise
        report_failure(failure, log)
        raise SystemExit(failure.exit_code) from None
    except Exception as exc:  # a bug: keep the traceback, once (the excepthook would print it again)
        log.error("%s: %s", type(exc).__name__, exc, exc_info=True)
        sys.excepthook = lambda *a: None
        raise
