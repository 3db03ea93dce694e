"""Progress of a generate job (eagle3_data.generate.progress): the line's text by value, a live bar on a terminal, plain
lines elsewhere."""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import time

import pytest

from eagle3_data.generate import progress
from eagle3_data.generate import JobState


def make_state(**kw) -> JobState:
    st = JobState(total=10, budget_tokens=None, budget_usd=2.0)
    st.t0 = 990.0
    st.done, st.ok, st.failed, st.in_flight = 4, 3, {"timeout": 1}, 2
    st.completion_tokens, st.cost_usd, st.sent, st.retries = 1000, 0.5, 6, 2
    for k, v in kw.items():
        setattr(st, k, v)
    return st


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(progress.time, "monotonic", lambda: 1000.0)  # 10 s after t0


def test_line_by_value(clock):
    st = make_state()
    assert progress.line(st, "[ds/000]") == (
        "[ds/000] 4/10 done  40%|####      | [00:10<00:15,  0.40 samples/s] | in flight 2 | 100.0 tok/s | "
        "$0.5000 of $2.0000 budget_usd (budget in ~00:30) | ok 3, failed 1, journal 0 | retries 2, requests 6"
    )
    # journaled samples (instant) are left out of the rate: 2 samples in 10 s -> 0.2/s, 6 left -> 30 s
    st = make_state(
        instant=2,
        from_journal=2,
        ok=3,
        budget_usd=None,
        budget_tokens=5000.0,
        journal_completion_tokens=500,
        journal_cost_usd=0.25,
    )
    assert progress.line(st, "[ds/000]") == (
        "[ds/000] 4/10 done  40%|####      | [00:10<00:30,  0.20 samples/s] | in flight 2 | 100.0 tok/s | "
        "$0.7500 spent | 1,500 of 5,000 budget_completion_tokens (budget in ~00:35) | ok 3, failed 1, journal 2 | "
        "retries 2, requests 6"
    )


def test_budget_stop_line_and_message(clock):
    """A budget stop: ``done`` counts samples with an outcome only (not 10/10), and the text says which budget."""
    st = make_state(done=10, not_sent=6, stopped_by="budget_usd", cost_usd=2.01, budget_usd=1.0)
    text = progress.final_line(st, "[ds/001]")
    assert text.startswith("[ds/001] 4/10 done  40%")
    assert text.endswith("| stopped by budget_usd: 6 of 10 samples not sent")
    assert "$2.0100 of $1.0000 budget_usd | ok 3" in text  # nothing left to send: no "budget in"
    assert progress.budget_stop_message(st, "budget_usd", 2, "generation.budget_usd", 2) == (
        "stopped by budget_usd (generation.budget_usd = $2.0000, this shard's share $1.0000 of 2 shards): $2.0100 "
        "spent; 6 of 10 samples not sent (no row for them; a rerun with a larger budget sends them, journaled "
        "responses are not paid for again)"
    )
    st = make_state(done=10, not_sent=6, stopped_by="budget_completion_tokens", budget_tokens=900.0, budget_usd=None)
    assert progress.budget_stop_message(
        st, "budget_completion_tokens", 900, "datasets.ds.generation.budget_completion_tokens", 1
    ).startswith(
        "stopped by budget_completion_tokens (datasets.ds.generation.budget_completion_tokens = 900 completion "
        "tokens): 1,000 completion tokens spent; 6 of 10 samples not sent"
    )


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(display: progress.JobProgress, st: JobState, log: logging.Logger) -> None:
    async def main():
        task = asyncio.create_task(display.run())
        for _ in range(6):
            await asyncio.sleep(0.1)
            st.done += 1
            st.ok += 1
        log.warning("a warning while the bar shows")
        await asyncio.sleep(0.15)
        task.cancel()

    with display.session():
        asyncio.run(main())


def _logger(tmp_path, stream) -> logging.Logger:
    log = logging.getLogger("eagle3_data.test_progress")
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(stream))
    log.addHandler(logging.FileHandler(tmp_path / "job.log", mode="w"))
    return log


def test_terminal_gets_a_live_bar_and_the_log_file_plain_lines(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE3_RUN_DIR", raising=False)
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    log = _logger(tmp_path, tty)
    st = make_state(done=0, ok=0, failed={}, t0=time.monotonic())
    display = progress.JobProgress(st, "[ds/000]", 0.2, log)
    assert display.live
    _drive(display, st, log)
    out = tty.getvalue()
    assert "\r" in out  # redrawn in place
    assert "a warning while the bar shows" in out  # log records still reach the terminal
    assert "6/10 done  60%" in out.rsplit("\r", 1)[-1]  # the bar left on screen: the last count
    text = (tmp_path / "job.log").read_text()
    lines = text.splitlines()
    assert "\r" not in text and "a warning while the bar shows" in lines
    prog = [ln for ln in lines if ln.startswith("[ds/000] ")]
    assert len(prog) >= 2 and all("done" in ln and "in flight 2" in ln for ln in prog)
    assert not any(ln.startswith("[ds/000] ") and "|" in ln for ln in out.split("\n") if "\r" not in ln)


def test_a_workflow_run_console_gets_plain_lines_even_on_a_tty(tmp_path, monkeypatch):
    """Several jobs share snakemake's console: each writes whole lines, no bar redrawn with carriage returns."""
    monkeypatch.setenv("EAGLE3_RUN_DIR", str(tmp_path / "run"))
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    log = _logger(tmp_path, tty)
    st = make_state(done=0, ok=0, failed={}, t0=time.monotonic())
    display = progress.JobProgress(st, "[ds/000]", 0.2, log)
    assert not display.live
    _drive(display, st, log)
    out = tty.getvalue()
    assert "\r" not in out
    prog = [ln for ln in out.splitlines() if ln.startswith("[ds/000] ")]
    assert len(prog) >= 2 and prog == [
        ln for ln in (tmp_path / "job.log").read_text().splitlines() if ln.startswith("[ds/000] ")
    ]
