"""What the jobs of a run print while the run-wide view's live table is on the terminal.

A job of a local run is a child process of the main ``snakemake`` process: it inherits that process's stdout and
stderr, the terminal itself. What it writes there reaches the terminal directly, past the ``rich`` live table the
main process redraws in place, so its lines end up inside the table (``ETA 2:1000:39:46 INFO ...``), and the next
redraw leaves parts of them behind. While the table is up, :class:`JobOutput` points the main process's stdout and
stderr file descriptors that are terminals (those a job started from then on inherits) to a pipe, and writes the
table through its own copy of the terminal. A thread reads the pipe and shows, above the table, what a newcomer
needs from it (:class:`LineFilter`):

- a job's log record at NOTICE (a stage's result line, ``logs.NOTICE``: the plan's summary) or above (the one-line
  error of a job that failed; ``logs.setup_logging``'s ``HH:MM:SS LEVEL name: message`` form), with the lines
  written with it (a bug's traceback);
- any other line (an error printed before the job's log was set up, a library's message), carriage-return redraws
  (progress bars) reduced to their last state;

and leaves out a job's INFO and DEBUG records: its log file (``logs/<rule>/...``) has them. When the table stops,
the descriptors are the terminal again; a job still running keeps the pipe, and its lines are shown as they come.
Should the main process itself be killed (``kill -9``), the pipe has no reader left: what a job still running
writes to its console is lost (its log file has its records).

Only the main process's descriptors 1 and 2 change; its Python streams (``sys.stdout`` and ``sys.stderr``, which
``rich`` stands in for while the table is up) and the terminal's input are left as they are.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import sys
import threading
from collections.abc import Callable

#: the start of a job's log record (eagle3_data.logs.setup_logging: "%(asctime)s %(levelname)s %(name)s: ...")
RECORD = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|NOTICE|WARNING|ERROR|CRITICAL) [\w.\-]+: ")
#: the records left out of the console (their job's log file has them)
QUIET_LEVELS = ("DEBUG", "INFO")


class LineFilter:
    """Splits what the jobs write (bytes, in pieces as they come) into lines and keeps those for the console.

    A line that starts a log record is kept when its level is WARNING or above; a line that does not (a
    traceback's, a message's second line) goes with the record before it in the same piece (one ``write`` of a
    job), and is kept on its own otherwise. A line's carriage-return redraws are reduced to the last; blank lines
    are dropped."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[str]:
        """The complete lines of ``data`` (with what an earlier piece left unfinished) that the console shows."""
        *lines, self._partial = (self._partial + data).split(b"\n")
        return self._keep(lines)

    def flush(self) -> list[str]:
        """The unfinished last line, if the console shows it (the writers are gone)."""
        rest, self._partial = self._partial, b""
        return self._keep([rest]) if rest else []

    @staticmethod
    def _keep(lines: list[bytes]) -> list[str]:
        out, record_shown = [], None  # the last record of this piece: shown or not (None: none yet)
        for raw in lines:
            text = raw.decode("utf-8", "replace").rstrip("\r").rsplit("\r", 1)[-1].rstrip()
            m = RECORD.match(text)
            if m:
                record_shown = m.group(1) not in QUIET_LEVELS
            if text.strip() and (record_shown is None or record_shown):
                out.append(text)
        return out


class JobOutput:
    """While started, the process's stdout / stderr descriptors that are terminals point to a pipe, whose lines
    :class:`LineFilter` keeps and ``show`` (a callable taking one line, str, no newline) writes.

    ``terminal`` is a text stream on a copy of the terminal (not inherited by the jobs), for the live table;
    None when neither descriptor is a terminal (then nothing changes)."""

    def __init__(self, show: Callable[[str], None]):
        self.show = show
        self.terminal = None
        self._saved: dict[int, int] = {}
        self._read_fd: int | None = None
        self._filter = LineFilter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Point the descriptors to the pipe; False (nothing changed) when neither is a terminal."""
        fds = [fd for fd in (1, 2) if _isatty(fd)]
        if not fds:
            return False
        for stream in (sys.stdout, sys.stderr):  # what the process wrote before goes to the terminal first
            with contextlib.suppress(Exception):
                stream.flush()
        self.terminal = open(os.dup(fds[-1]), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._saved = {fd: os.dup(fd) for fd in fds}
        read_fd, write_fd = os.pipe()
        for fd in fds:
            os.dup2(write_fd, fd)  # inheritable: the jobs started from now on write here
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        self._read_fd = read_fd
        self._thread = threading.Thread(target=self._read_loop, name="eagle3-job-output", daemon=True)
        self._thread.start()
        return True

    def _read_loop(self) -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                select.select([self._read_fd], [], [], 0.2)
            if not self._pump():
                return

    def _pump(self) -> bool:
        """Show what the pipe holds now; False once every writer closed it."""
        with self._lock:
            while True:
                try:
                    data = os.read(self._read_fd, 65536)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                lines = self._filter.feed(data) if data else self._filter.flush()
                for line in lines:
                    with contextlib.suppress(Exception):
                        self.show(line)
                if not data:
                    with contextlib.suppress(OSError):
                        os.close(self._read_fd)
                    return False

    def drain(self) -> None:
        """Show what the jobs wrote up to now (before the table's last state and the run's last screen)."""
        if self._read_fd is not None:
            self._pump()

    def stop(self) -> None:
        """The descriptors are the terminal again (what is left in the pipe shown first); a job still running
        keeps writing to the pipe, and the thread shows its lines with ``show`` until it ends."""
        if not self._saved:
            return
        self.drain()
        for fd, saved in self._saved.items():
            with contextlib.suppress(OSError):
                os.dup2(saved, fd)
                os.close(saved)
        self._saved = {}


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
