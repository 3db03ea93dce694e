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

  An :class:`ExpectedFailure` is then logged as ONE ``ERROR`` line (message + hint) to the job's log file and
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


def run_stage(main: Callable[[], T], *, log: logging.Logger | None = None,
              interrupted: Callable[[], ExpectedFailure] | None = None) -> T:
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
    except Exception as exc:  # a bug: keep the traceback, once (the excepthook would print it again)
        log.error("%s: %s", type(exc).__name__, exc, exc_info=True)
        sys.excepthook = lambda *a: None
        raise
