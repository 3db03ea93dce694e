"""Snakemake logger plugin ``eagle3``: the console of a workflow run, on which the run-wide view draws.

Snakemake 9 finds it by its module name (``snakemake_logger_plugin_<name>``, its logger plugin registry) and uses it
with ``--logger eagle3``; the workflow profile (``profiles/default/config.yaml``: ``logger: [eagle3]``) turns it on
for every ``snakemake`` run in the workflow's directory. It writes Snakemake's messages as Snakemake's own console
handler does (Snakemake's formatter and filter, attached by Snakemake since this handler has none of its own; the
same colours on a terminal), with one difference: each message goes to the process's ``sys.stderr`` (``sys.stdout``
for a dry run) *as it is when the message is written*, not a stream held since the start. While the run-wide view's
live table is up (:mod:`eagle3_data.runtime.runview`), rich's stand-in for ``sys.stderr`` is there, so Snakemake's
messages scroll above the table like everything else the main process prints; nothing of Snakemake's is re-pointed.

Snakemake hands records to logger plugins through a queue, in a thread of its own: the run-wide view asks the handler
to :meth:`LogHandler.drain` before it stops, so the table's last state and the run's last screen come after every
message Snakemake logged before them.

Only the main ``snakemake`` process has it: Snakemake starts no logger plugin in a job's process
(``skip_plugin_handlers`` in its subprocess and remote modes). The handler attaches itself to the run-wide view
(:func:`eagle3_data.runtime.runview.attach_console`): without it (``--logger`` naming another plugin, no workflow
profile), the view prints plain lines, never a live table.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import platform
import sys
import threading

from snakemake_interface_logger_plugins.base import LogHandlerBase
from snakemake_interface_logger_plugins.common import LogEvent

#: a record carrying this attribute (a threading.Event) is no message: the handler sets the event (see drain)
DRAIN_ATTR = "eagle3_drain"
#: Snakemake's logger (``snakemake.logging.logger``), whose queue handler feeds the plugins
SNAKEMAKE_LOGGER = "snakemake.logging"

# Snakemake's console colours (snakemake.logging.ColorizingTextHandler): a level's colour, yellow for plain info
# and run info, shell commands and job starts
_BLACK, _RED, _GREEN, _YELLOW, _BLUE, _MAGENTA, _CYAN, _WHITE = range(8)
_COLORS = {"WARNING": _YELLOW, "INFO": _GREEN, "DEBUG": _BLUE, "CRITICAL": _MAGENTA, "ERROR": _RED}
_YELLOW_INFO_EVENTS = (LogEvent.RUN_INFO, LogEvent.SHELLCMD, LogEvent.JOB_STARTED, None)
_RESET_SEQ, _COLOR_SEQ = "\033[0m", "\033[%dm"


def _can_color(stream) -> bool:
    if os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and platform.system() != "Windows"


class LogHandler(LogHandlerBase):
    """Snakemake's console for a workflow run (see the module docstring)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._after_job_info = False
        self.nocolor = bool(getattr(self.common_settings, "nocolor", False)) or not _can_color(self.stream())
        from eagle3_data.runtime import runview

        runview.attach_console(self)

    @property
    def writes_to_stream(self) -> bool:
        return True  # Snakemake then adds no console handler of its own

    @property
    def writes_to_file(self) -> bool:
        return False

    @property
    def has_filter(self) -> bool:
        return False  # Snakemake's (quiet, printshellcmds, debug-dag)

    @property
    def has_formatter(self) -> bool:
        return False  # Snakemake's

    @property
    def needs_rulegraph(self) -> bool:
        return False

    def stream(self):
        """Where a message goes now: ``sys.stdout`` for a dry run (Snakemake's ``stdout`` setting), else ``sys.stderr``,
        looked up at each message."""
        return sys.stdout if getattr(self.common_settings, "stdout", False) else sys.stderr

    def filter(self, record):
        if getattr(record, DRAIN_ATTR, None) is not None:
            return True  # no message: Snakemake's filter (e.g. --quiet all) must not hold it back
        return super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        done = getattr(record, DRAIN_ATTR, None)
        if done is not None:
            done.set()
            return
        with self._lock:
            try:
                event = getattr(record, "event", None)
                out = self.stream()
                lead = ""
                if event == LogEvent.JOB_INFO:
                    if not self._after_job_info:
                        lead = "\n"  # a blank line before a run of job infos (as Snakemake's console handler)
                    self._after_job_info = True
                else:
                    self._after_job_info = False
                text = self.format(record)
                if text is None or text in ("", "None"):
                    if lead:
                        out.write(lead)
                    return
                out.write(lead + self._decorate(record, event, text) + "\n")  # one write: other threads print too
                out.flush()
            except BrokenPipeError:
                raise
            except (KeyboardInterrupt, SystemExit):
                pass
            except Exception:
                self.handleError(record)

    def _decorate(self, record, event, text: str) -> str:
        if self.nocolor or record.levelname not in _COLORS:
            return text
        color = _COLORS["WARNING"] if record.levelno == logging.INFO and event in _YELLOW_INFO_EVENTS else None
        color = _COLORS[record.levelname] if color is None else color
        return f"{_COLOR_SEQ % (30 + color)}{text}{_RESET_SEQ}"

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait (at most ``timeout_s``) until this handler has written every record Snakemake's logger took before
        the call: a marker goes through each queue handler of Snakemake's logger (the queue its plugins are fed from)
        behind them. True once every marker came through, or at once where the logger has no queue (the records are
        written as they are logged); False on the timeout."""
        queues = [
            h for h in logging.getLogger(SNAKEMAKE_LOGGER).handlers if isinstance(h, logging.handlers.QueueHandler)
        ]
        events = []
        for q in queues:
            ev = threading.Event()
            marker = logging.LogRecord(SNAKEMAKE_LOGGER, logging.INFO, __file__, 0, "", None, None)
            setattr(marker, DRAIN_ATTR, ev)
            q.handle(marker)
            events.append(ev)
        return all(ev.wait(timeout_s) for ev in events)

    def close(self) -> None:
        from eagle3_data.runtime import runview

        runview.detach_console(self)
        super().close()
