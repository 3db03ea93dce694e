"""Progress of a generate job: a tqdm bar on a terminal, one plain line per interval in logs and shared consoles.

What a line says (the same text in both places)::

    [ds/000] 12/28 done  43%|####2     | [00:03<00:05,  2.70 samples/s] | in flight 5 | 120.3 tok/s |
        $0.0012 of $0.0100 budget_usd (budget in ~00:21) | ok 12, failed 0, journal 0 | retries 0, requests 14

``done`` counts samples with an outcome (ok or failed); a sample a budget kept from being sent is not done, so a
budget stop ends below 100% and the final line says ``stopped by budget_usd: 16 of 28 samples not sent``.
The bar and ETA are tqdm's (:meth:`tqdm.tqdm.format_meter`), its rate that of the samples that needed a request
(``initial``: bad prompts and samples answered by the journal take no time); ``budget in`` is the time left until
the budget at this run's spend rate.

Where it goes (:class:`JobProgress`):

- a terminal of its own (stderr is a tty and the job is not one of a workflow run's jobs): a tqdm bar redrawn in
  place (log records are written above it, :func:`tqdm.contrib.logging.logging_redirect_tqdm`), and one plain line
  per interval to the job's log files;
- otherwise (a log file, a pipe): one plain log line per interval, never carriage-return fragments;
- inside a workflow run: the plain lines go to the job's log file only, and the job's counters to a snapshot in
  the run directory every interval and when the request phase ends (:mod:`eagle3_data.runtime.runview`), from which the
  main ``snakemake`` process prints one run-wide line per backend.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from tqdm import tqdm

from ..errors import in_workflow_run

BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} done {percentage:3.0f}%|{bar:10}| [{elapsed}<{remaining}, {rate_noinv_fmt}]"
UNIT = " samples"


def _usd(v: float) -> str:
    return f"${v:,.4f}" if v < 100 else f"${v:,.2f}"


def budget_text(key: str, value: float) -> str:
    """``budget_usd`` 1.5 -> ``"$1.5000"``, ``budget_completion_tokens`` 1000 -> ``"1,000 completion tokens"``."""
    return _usd(value) if key == "budget_usd" else f"{value:,.0f} completion tokens"


def postfix(state) -> str:
    """The counters after the bar: in flight, completion tokens/s, dollars (of the budget), completion tokens of
    their budget, the time left until a budget at this run's spend rate, outcomes, retries and HTTP requests.

    ``state``: the job's ``generate.JobState`` (``in_flight``, ``completion_tokens``, ``cost_usd``, ``t0``,
    ``spent_usd()``, ``spent_tokens()``, ``budget_usd``, ``budget_tokens``, ``ok``, ``failed``, ``from_journal``,
    ``retries``, ``sent``)."""
    el = max(1e-9, time.monotonic() - state.t0)
    parts = [f"in flight {state.in_flight}", f"{state.completion_tokens / el:,.1f} tok/s"]
    left = []  # seconds until each budget at this run's spend rate
    if state.budget_usd is not None:
        parts.append(f"{_usd(state.spent_usd())} of {_usd(state.budget_usd)} budget_usd")
        if state.cost_usd > 0:
            left.append(max(0.0, state.budget_usd - state.spent_usd()) / (state.cost_usd / el))
    else:
        parts.append(f"{_usd(state.spent_usd())} spent")
    if state.budget_tokens is not None:
        parts.append(f"{state.spent_tokens():,} of {state.budget_tokens:,.0f} budget_completion_tokens")
        if state.completion_tokens > 0:
            left.append(max(0.0, state.budget_tokens - state.spent_tokens()) / (state.completion_tokens / el))
    if left and state.done < state.total:  # samples are left to send
        parts[-1] += f" (budget in ~{tqdm.format_interval(min(left))})"
    parts.append(f"ok {state.ok}, failed {sum(state.failed.values())}, journal {state.from_journal}")
    parts.append(f"retries {state.retries}, requests {state.sent}")
    return " | ".join(parts)


def done(state) -> int:
    """Samples with an outcome (ok or failed); samples a budget kept from being sent are not done."""
    return state.done - state.not_sent


def line(state, tag: str, *, ascii: bool = True) -> str:
    """One progress line (see the module docstring)."""
    meter = tqdm.format_meter(
        done(state),
        state.total,
        time.monotonic() - state.t0,
        prefix=tag,
        unit=UNIT,
        initial=state.instant,
        ascii=ascii,
        bar_format=BAR_FORMAT,
    )
    return f"{meter} | {postfix(state)}"


def final_line(state, tag: str) -> str:
    """The job's last progress line: :func:`line`, plus ``stopped by <budget>: N of M samples not sent`` when a
    budget kept samples from being sent."""
    text = line(state, tag)
    if state.not_sent:
        text += (
            f" | stopped by {state.stopped_by or 'a budget'}: {state.not_sent:,} of {state.total:,} samples not sent"
        )
    return text


def budget_stop_message(state, key: str, value, source: str, num_shards: int = 1) -> str:
    """What a budget stop says: which budget (``key``, where the config sets it: ``source``), its value (and this
    shard's share), what was spent and how many samples were not sent.

    ``value``: the dataset's budget from the config (None if unknown); ``num_shards``: shards it is split over."""
    share = state.budget_usd if key == "budget_usd" else state.budget_tokens
    spent = state.spent_usd() if key == "budget_usd" else state.spent_tokens()
    what = f"{source} = {budget_text(key, float(value))}" if value is not None else source
    if num_shards > 1 and share is not None:
        what += f", this shard's share {budget_text(key, share)} of {num_shards} shards"
    return (
        f"stopped by {key} ({what}): {budget_text(key, spent)} spent; {state.not_sent:,} of {state.total:,} "
        "samples not sent (no row for them; a rerun with a larger budget sends them, journaled responses are "
        "not paid for again)"
    )


def _chain(log: logging.Logger) -> list[logging.Logger]:
    """``log`` and the ancestors its records reach."""
    out, lg = [], log
    while lg is not None:
        out.append(lg)
        lg = lg.parent if lg.propagate else None
    return out


def _terminal_handlers(log: logging.Logger) -> list[logging.Handler]:
    return [h for h in log.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def log_to_files(log: logging.Logger, level: int, msg: str, *args) -> None:
    """Log a record through ``log`` to the file handlers only of it and its ancestors (the terminal shows the
    bar)."""
    quiet = [(lg, h) for lg in _chain(log) for h in _terminal_handlers(lg)]
    for lg, h in quiet:
        lg.removeHandler(h)
    try:
        log.log(level, msg, *args)
    finally:
        for lg, h in quiet:
            lg.addHandler(h)


class _Bar(tqdm):
    """A tqdm bar whose rate (hence ETA) leaves out the samples done without a request (``state.instant``), as
    :func:`line` does."""

    def __init__(self, *args, state=None, **kwargs):
        self.state = state
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        d = super().format_dict
        if self.state is not None:
            d["initial"] = self.state.instant
            d["counters"] = postfix(self.state)  # not tqdm's postfix, which it opens with ", "
        return d


class JobProgress:
    """The progress display of one generate job (see the module docstring).

    Args:
        state: the job's ``generate.JobState`` (read, never written).
        tag: ``"[dataset/shard]"``, the start of every line.
        interval: seconds between plain lines (config-free: ``generate(progress_interval_s=...)``).
        log: the logger the lines go to (the package logger: the job's log file and stderr).
        stream: where a bar is drawn (default ``sys.stderr``).
        live: draw a bar in place: default when ``stream`` is a tty and the job is not inside a workflow run
            (snakemake's console is shared by several jobs, so there each job writes plain lines).
    """

    #: seconds between redraws of a live bar
    redraw_s = 0.5

    def __init__(self, state, tag: str, interval: float, log: logging.Logger, *, stream=None, live: bool | None = None):
        self.state = state
        self.tag = tag
        self.interval = max(0.05, float(interval))
        self.log = log
        self.stream = stream or sys.stderr
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty()) and not in_workflow_run()
        self.live = live
        self.bar: _Bar | None = None
        inner = tag.strip("[]")
        self.dataset, _, self.shard = inner.rpartition("/")
        self.backends: list[str] = []  # set by the job: its backends in priority order
        self.pool = None  # set by the job while its requests run: the backends' down state in the snapshot
        self.kind = "generate"  # "pilot" for the forecast's pilot (its snapshot is not a generate shard's)
        from ..runtime import run as run_mod

        run = run_mod.current()
        self.run_dir = run.dir if run is not None else None

    def snapshot(self, final: bool = False) -> None:
        """Write the job's counters to the run directory (inside a workflow run; see :mod:`.runview`)."""
        if self.run_dir is None or not self.dataset:
            return
        from ..runtime import runview

        down = {}  # the backends out for good or failing every attempt now (Backend.trouble)
        slowed = {}  # those this job sends fewer requests than its cap after a 429 storm (Backend.slowed)
        for b in getattr(self.pool, "backends", None) or []:
            why = b.trouble() if hasattr(b, "trouble") else getattr(b, "down", None)
            if why:
                down[getattr(b, "name", "?")] = str(why)[:200]
            elif hasattr(b, "slowed") and b.slowed():
                slowed[b.name] = b.slowed()[:200]
        snap = runview.snapshot(
            self.state, self.dataset, self.shard, backends=self.backends, down=down, slowed=slowed, final=final
        )
        snap["kind"] = self.kind
        runview.write_snapshot(self.run_dir, snap)

    def start(self) -> None:
        """On a terminal, open the bar."""
        if self.live:
            self.bar = _Bar(
                total=self.state.total,
                initial=done(self.state),
                desc=self.tag,
                unit=UNIT,
                file=self.stream,
                bar_format=BAR_FORMAT + " | {counters}",
                mininterval=self.redraw_s,
                dynamic_ncols=True,
                leave=True,
                state=self.state,
            )

    def tick(self) -> None:
        """Redraw the bar (on a terminal)."""
        if self.bar is not None:
            self.bar.n = done(self.state)
            self.bar.refresh()

    def log_line(self) -> None:
        """The interval's plain line: to the log files only when a bar shows it on the terminal."""
        text = line(self.state, self.tag)
        if self.bar is not None or self.run_dir is not None:  # a bar, or the run-wide view shows it
            log_to_files(self.log, logging.INFO, "%s", text)
        else:
            self.log.info("%s", text)

    async def run(self) -> None:
        """Until cancelled: redraw the bar every :attr:`redraw_s` and log a plain line every ``interval``."""
        import asyncio

        next_line = time.monotonic() + self.interval
        while True:
            await asyncio.sleep(min(self.redraw_s, self.interval) if self.bar is not None else self.interval)
            self.tick()
            if time.monotonic() >= next_line - 1e-3:
                self.log_line()
                self.snapshot()
                next_line = time.monotonic() + self.interval

    def close(self) -> None:
        """Draw the bar a last time and leave it on the terminal."""
        if self.bar is not None:
            self.tick()
            self.bar.close()
            self.bar = None

    @contextlib.contextmanager
    def session(self):
        """While the requests run: the bar open and log records written above it (a terminal), else nothing."""
        self.start()
        self.snapshot()
        if self.bar is None:
            try:
                yield self
            finally:
                self.snapshot()
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        try:
            with logging_redirect_tqdm(loggers=[lg for lg in _chain(self.log) if lg.handlers] or [self.log]):
                yield self
        finally:
            self.close()
            self.snapshot()
