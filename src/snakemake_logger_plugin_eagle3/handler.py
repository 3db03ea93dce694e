"""The eagle3 logger plugin's handler: Snakemake's console for a workflow run (see the package docstring)."""

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
        from eagle3_data.runtime import runview
        from eagle3_data.runtime.stageview import JobTally

        self._lock = threading.Lock()
        self._after_job_info = False
        self._stats_shown: str | None = None  # the job stats table last written
        self.nocolor = bool(getattr(self.common_settings, "nocolor", False)) or not _can_color(self.stream())
        self.jobs = JobTally()  # Snakemake's account of the run's jobs (the run-wide view's stages)
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

    def handle(self, record):
        """Count the record's job event (:meth:`count`), then write it if Snakemake's filter lets it through."""
        self.count(record)
        return super().handle(record)

    def count(self, record) -> None:
        """Keep the job events of a record in :attr:`jobs`: the run's job stats, a job's start (its rule), its
        end, its failure."""
        event = getattr(record, "event", None)
        try:
            if event == LogEvent.RUN_INFO and isinstance(getattr(record, "stats", None), dict):
                self.jobs.run_info(record.stats)
            elif event == LogEvent.JOB_INFO and getattr(record, "jobid", None) is not None:
                self.jobs.job_started(record.jobid, getattr(record, "rule_name", None) or "?")
            elif event == LogEvent.JOB_FINISHED and getattr(record, "job_id", None) is not None:
                self.jobs.job_finished(record.job_id)
            elif event == LogEvent.JOB_ERROR and getattr(record, "jobid", None) is not None:
                self.jobs.job_failed(record.jobid, getattr(record, "rule_name", None))
        except (TypeError, ValueError):  # a record of another shape: the console writes it all the same
            pass

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
                if event == LogEvent.RUN_INFO and isinstance(getattr(record, "stats", None), dict):
                    # a dry run's job stats come twice (snakemake/workflow.py: before the jobs and after them):
                    # the same table is written once
                    if text == self._stats_shown:
                        return
                    self._stats_shown = text
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
