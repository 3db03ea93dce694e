"""The run's console is this distribution's Snakemake logger plugin (``snakemake_logger_plugin_eagle3``), turned on
by the workflow profile: Snakemake finds it, it writes exactly what Snakemake's own console handler writes (colours
included), to the ``sys.stderr`` of the moment (so a live table's redirect takes Snakemake's messages: nothing of
Snakemake's is re-pointed), it can be drained so the run's last screen comes after Snakemake's last messages, and it
keeps Snakemake's account of the run's jobs for the view's stages.

These go through Snakemake's public Python API (``SnakemakeApi`` with ``OutputSettings``, as the ``snakemake``
command does), so a Snakemake release that changes how logger plugins are found, fed or formatted fails here."""

from __future__ import annotations

import io
import re
import logging
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, run_snakemake

ROOT = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _records():
    """What Snakemake logs in a run, one of each kind the console shows (its messages and ``extra`` fields, as
    snakemake/jobs.py, workflow.py and scheduling/job_scheduler.py log them)."""
    from snakemake_interface_logger_plugins.common import LogEvent

    job = dict(
        jobid=3,
        rule_name="generate",
        rule_msg=None,
        input=["results/chat/prompts/000.parquet"],
        output=["results/chat/responses/000.parquet"],
        log=["logs/generate/chat/000.log"],
        benchmark=None,
        wildcards={"ds": "chat", "shard": "000"},
        reason="Missing output files: results/chat/responses/000.parquet",
        resources={"_cores": 0, "generate_jobs": 1, "tmpdir": "/tmp"},
        priority=0,
        threads=0,
        shellcmd=None,
        is_checkpoint=False,
        is_handover=False,
        local=False,
        indent=False,
    )
    return [
        (logging.INFO, "Building DAG of jobs...", {}),
        (
            logging.INFO,
            "Job stats:\njob  count\n---  -----\ngenerate 2",
            {"event": LogEvent.RUN_INFO, "stats": {"generate": 2}},
        ),
        (logging.INFO, None, {"event": LogEvent.JOB_INFO, **job}),
        (logging.INFO, None, {"event": LogEvent.JOB_INFO, **job, "jobid": 4}),
        (logging.INFO, "Execute 1 jobs...", {"event": LogEvent.JOB_STARTED, "jobs": [3]}),
        (logging.INFO, "echo hi", {"event": LogEvent.SHELLCMD, "shellcmd": "echo hi", "indent": False}),
        (logging.INFO, "Finished jobid: 3 (Rule: generate)", {"event": LogEvent.JOB_FINISHED, "job_id": 3}),
        (logging.INFO, None, {"event": LogEvent.PROGRESS, "done": 1, "total": 2}),
        (logging.WARNING, "a warning", {}),
        (
            logging.ERROR,
            "Error in rule generate, jobid: 4",
            {
                "event": LogEvent.JOB_ERROR,
                "jobid": 4,
                "rule_name": "generate",
                "rule_msg": None,
                "input": [],
                "output": ["results/chat/responses/001.parquet"],
                "log": ["logs/generate/chat/001.log"],
                "conda_env": None,
                "shellcmd": None,
                "aux": {},
                "indent": False,
            },
        ),
        (logging.ERROR, "Exiting because a job execution failed. Look below for error messages", {}),
        (logging.DEBUG, "a debug line (left out without --verbose)", {}),
    ]


def _plugin_settings(name: str = "eagle3"):
    """The plugin's settings as the ``snakemake`` command makes them from its arguments (it has none)."""
    import argparse

    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry

    return LoggerPluginRegistry().get_plugin(name).get_settings(argparse.Namespace())


def _console_output(monkeypatch, stream, loggers, **settings) -> str:
    """Everything Snakemake's console writes to ``stream`` (as sys.stderr) for :func:`_records`, with the logger
    plugins ``loggers`` (none: Snakemake's own console handler)."""
    from snakemake.api import SnakemakeApi
    from snakemake.logging import logger
    from snakemake.settings.types import OutputSettings

    monkeypatch.setattr(sys, "stderr", stream)
    out = OutputSettings(log_handler_settings={name: _plugin_settings(name) for name in loggers}, **settings)
    with SnakemakeApi(out):
        for level, msg, extra in _records():
            logger.log(level, msg, extra=extra)
    return re.sub(r"\[\w{3} \w{3} +\d+ [\d:]+ \d{4}\]", "[time]", stream.getvalue())


def test_snakemake_finds_the_plugin_and_the_workflow_profile_turns_it_on():
    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry

    assert LoggerPluginRegistry().is_installed("eagle3")
    prof = yaml.safe_load((ROOT / "profiles" / "default" / "config.yaml").read_text())
    assert prof["logger"] == ["eagle3"]


@pytest.mark.parametrize("terminal", [False, True])
@pytest.mark.parametrize("printshellcmds", [False, True])
def test_it_writes_what_snakemakes_own_console_handler_writes(monkeypatch, terminal, printshellcmds):
    monkeypatch.setenv("TERM", "xterm")
    new = _Terminal if terminal else io.StringIO
    theirs = _console_output(monkeypatch, new(), [], printshellcmds=printshellcmds)
    ours = _console_output(monkeypatch, new(), ["eagle3"], printshellcmds=printshellcmds)
    assert "Building DAG of jobs..." in theirs and "rule generate:" in theirs and "1 of 2 steps (50%) done" in theirs
    assert ("\x1b[3" in theirs) == terminal
    assert ours == theirs


def test_it_writes_to_the_stderr_of_the_moment(monkeypatch):
    """A live table swaps sys.stderr for rich's stand-in: Snakemake's next messages go there, with no handler of
    Snakemake's re-pointed."""
    from snakemake.api import SnakemakeApi
    from snakemake.logging import logger
    from snakemake.settings.types import OutputSettings

    from eagle3_data.runtime import runview

    first, later = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    with SnakemakeApi(OutputSettings(log_handler_settings={"eagle3": _plugin_settings()})):
        assert runview.console_is_ours()
        [handler] = [h for h in runview._console]  # noqa: SLF001 (the test's look inside)
        logger.info("before")
        assert handler.drain()
        monkeypatch.setattr(sys, "stderr", later)
        logger.info("after")
        assert handler.drain()
        assert first.getvalue() == "before\n" and later.getvalue() == "after\n"
    assert not runview.console_is_ours()  # Snakemake closed it at the end


def test_drain_returns_once_every_earlier_message_is_written(monkeypatch):
    from snakemake.api import SnakemakeApi
    from snakemake.logging import logger
    from snakemake.settings.types import OutputSettings
    from snakemake.settings.enums import Quietness

    from eagle3_data.runtime import runview

    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    # --quiet all: Snakemake's filter holds every message back, not the drain's marker
    for quiet in (None, {Quietness.ALL}):
        out.seek(0)
        out.truncate()
        with SnakemakeApi(OutputSettings(log_handler_settings={"eagle3": _plugin_settings()}, quiet=quiet)):
            [handler] = list(runview._console)  # noqa: SLF001
            for i in range(2000):
                logger.info(f"line {i}")
            assert handler.drain(timeout_s=10)
            assert out.getvalue() == ("".join(f"line {i}\n" for i in range(2000)) if quiet is None else "")


def test_the_view_draws_a_live_table_only_on_its_own_console(monkeypatch, tmp_path):
    """On a terminal the run-wide view is a live table only when Snakemake's console is the plugin; with Snakemake's
    own handler (which holds the terminal's stream and would write through the table) it prints plain lines."""
    from eagle3_data.runtime import runview

    config = {
        "datasets": {"chat": {"source": {"format": "sharegpt", "path": "x.json"}, "shards": 1}},
        "backends": {"fake": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}},
        "generation": {"backends": ["fake"]},
    }
    monkeypatch.delenv("EAGLE3_LIVE_VIEW", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    seen = []

    class Printer:
        def __init__(self, view, interval_s, stream, live):
            seen.append(live)
            self.stopping = type("E", (), {"set": lambda self: None})()

        def start(self):
            pass

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(runview, "_Printer", Printer)
    for ours in (False, True):
        if ours:
            runview.attach_console("the plugin's handler")
        try:
            runview.start(config, tmp_path, stream=_Terminal())
            runview._printer.clear()  # noqa: SLF001
        finally:
            runview.detach_console("the plugin's handler")
    assert seen == [False, True]


def test_it_keeps_snakemakes_account_of_the_runs_jobs_whatever_it_shows(monkeypatch):
    """The run-wide view's stages come from the plugin's tally of Snakemake's records (job stats, each job's start,
    end, failure), kept also for the records Snakemake's filter holds back (--quiet all)."""
    from snakemake.api import SnakemakeApi
    from snakemake.logging import logger
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import OutputSettings

    from eagle3_data.runtime import runview

    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    with SnakemakeApi(OutputSettings(log_handler_settings={"eagle3": _plugin_settings()}, quiet={Quietness.ALL})):
        [handler] = list(runview._console)  # noqa: SLF001
        assert runview.job_tally() is handler.jobs
        for level, msg, extra in _records():
            logger.log(level, msg, extra=extra)
        assert handler.drain()
        rules = handler.jobs.rules()
    assert out.getvalue() == ""
    g = rules["generate"]
    assert (g["planned"], g["started"], g["finished"], g["failed"], g["running"]) == (2, 2, 1, 1, 0), rules
    assert list(rules) == ["generate"]


def test_a_dry_runs_job_table_is_written_once(monkeypatch, tmp_path):
    """Snakemake logs a dry run's job stats before the jobs and again after them (snakemake/workflow.py): its own
    console writes the table twice, this one once; the real dry run of the demo too."""
    stats = _records()[1]
    monkeypatch.setattr(sys.modules[__name__], "_records", lambda: [stats, (logging.INFO, "Reasons: ...", {}), stats])
    theirs = _console_output(monkeypatch, io.StringIO(), [])
    ours = _console_output(monkeypatch, io.StringIO(), ["eagle3"])
    assert theirs.count("Job stats:") == 2 and ours.count("Job stats:") == 1 and "Reasons: ..." in ours
    wd = copy_workflow(tmp_path)
    proc = run_snakemake(wd, "-n")
    out = proc.stdout + proc.stderr
    assert out.count("Job stats:") == 1 and "This was a dry-run" in out, out[-2000:]
    assert out.index("Job stats:") < out.index("rule normalize_sharegpt_demo:")  # before the jobs, as Snakemake
