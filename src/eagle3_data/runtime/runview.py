"""The run-wide view: one line per backend for all the shards of a workflow run's generation, and one per stage
after it (:mod:`eagle3_data.runtime.stageview`), every few seconds.

Each generate job of a run writes a small snapshot of its counters (:func:`snapshot`) to
``<run dir>/progress/generate.<dataset>.<shard>.json`` (atomic rename) every progress interval and when it ends,
also when it fails or is stopped; an extract job writes its own (:mod:`eagle3_data.runtime.tokenprogress`). The
main ``snakemake`` process (Snakefile ``onstart``, :func:`start`) reads them every ``interval_s`` and prints, per
backend (the shards that generate through it; a dataset with several backends in priority order counts under the
first), then per stage with jobs in the run::

    generate openrouter: 1,234/5,000 samples, 12/16 shards | in flight 96/100 | 1,520 tok/s | $3.21 of $50.00 | warnings: http_503 12, timeout 3 | ETA 41:02
    tokenize: 10/16 jobs | 4.0 jobs/min | ETA 1:30
    extract: 2/16 jobs | 1,843,200/14,745,600 tokens | 3,120 tok/s | on cuda:0 (NVIDIA H100 80GB HBM3) | ETA 1:08:55

On a terminal, ``rich`` live tables (``generation``, ``stages``) redrawn in place at the bottom, with Snakemake's
own messages (and anything else the main process prints) scrolling above them: Snakemake's console is then this
distribution's logger plugin (``snakemake_logger_plugin_eagle3``, turned on by the workflow profile's
``logger: [eagle3]``), which writes to the ``sys.stderr`` of the moment, rich's redirect while the tables are up,
and keeps Snakemake's account of the run's jobs (:class:`eagle3_data.runtime.stageview.JobTally`). The jobs,
which inherit the terminal, write to a pipe instead while the tables are up (:mod:`eagle3_data.runtime.joboutput`):
a job's warnings and one-line error go above the tables, its INFO lines only to its log file; nothing is drawn
inside the tables. With another console (``--logger`` naming another plugin, no workflow profile) the view prints
plain lines, without the stages' job counts. In logs, CI and other non-terminals, plain lines, printed when they
change. ``EAGLE3_LIVE_VIEW=0`` asks for the plain lines on a terminal too.

Generation's ``ETA`` is the remaining samples at this run's own samples/s over the last minute: samples answered by
the journal (a resume) or refused before any request are left out of the rate; none (``-``) while no generate job
runs, and ``done`` once every generate job of the run ended (a shard whose responses were already there is not
the run's). ``warnings`` counts the jobs' warnings by reason (failed samples by their failure reason, budget stops,
a backend taken out, ...): a generate job of a run prints none to the console, its log has their text. A backend
that its jobs see down (every attempt for a few seconds refused or answered 5xx:
:meth:`eagle3_data.backends.pool.Backend.trouble`), or that answered nothing for ``stall_s`` while work is left,
shows ``DOWN: <why>`` instead of an ETA that would only grow, for as long as it lasts. A backend a 429 storm slowed
down (:meth:`eagle3_data.backends.pool.Backend.slowed`) shows ``SLOWED: rate limited (HTTP 429): 1 of 64 in flight,
paused until 12:03:41; back to 64 after 63 more replies`` beside its ETA. The per-shard lines and
summaries go to the shard logs (``logs/generate/<ds>/<shard>.log``) and files.

The snapshots are also what the run's last screen counts for a shard that did not finish (failed or stopped):
what its job had journaled (:func:`read_snapshots`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

from .snapshots import PROGRESS_DIR, read_snapshots, snapshot_path, write_snapshot  # noqa: F401 (its API)
from .stageview import StageView, clock


def snapshot(
    state,
    dataset: str,
    shard: str,
    *,
    backends=(),
    down: dict | None = None,
    slowed: dict | None = None,
    final: bool = False,
) -> dict:
    """The counters of one generate job (``state``: ``generate._State``) as a JSON-able dict.

    Keys: dataset, shard, backends (names, priority order), total, done (samples with an outcome), ok, failed,
    not_sent, in_flight, new_ok (responses this job received and journaled), from_journal (requests of this
    config answered by the journal), journaled (both: this config's responses that will not be requested
    again), completion_tokens, cost_usd (dollars of this job's new, journaled responses), spent_usd (with the
    journal's), retries, sent, last_error, elapsed_s (of the request phase),
    unpaid (samples of ``failed`` that got no paid reply: a rerun sends them), failed_by (reason -> failed samples),
    warnings (reason -> the job's other warnings, :class:`eagle3_data.logs.WarningTally`), budget_tokens and
    spent_tokens (the completion-token budget's share and spend), budget_in_flight (the replies that could still arrive
    when the spend reached a budget: its overshoot's bound), down (backend -> why it is out or failing now),
    slowed (backend -> why this job sends it fewer requests than its cap, and until when: a 429 storm),
    last_done_at (unix s of the last finished request), updated_at (unix s), final (the job ended),
    pid."""
    now = time.time()
    return {
        "dataset": dataset,
        "shard": shard,
        "backends": list(backends),
        "total": state.total,
        "done": state.done - state.not_sent,
        "ok": state.ok,
        "failed": sum(state.failed.values()),
        "not_sent": state.not_sent,
        "in_flight": state.in_flight,
        "new_ok": state.new_ok,
        "from_journal": state.from_journal,
        "journaled": state.new_ok + state.from_journal,
        "instant": state.instant,
        "completion_tokens": state.completion_tokens,
        "cost_usd": round(state.cost_usd, 8),
        "spent_usd": round(state.spent_usd(), 8),
        "budget_usd": state.budget_usd,
        "retries": state.retries,
        "sent": state.sent,
        "last_error": (state.last_error or "")[:200] or None,
        "down": dict(down or {}),
        "slowed": dict(slowed or {}),
        "elapsed_s": round(time.monotonic() - state.t0, 3),
        "last_done_at": state.last_done_at,
        "updated_at": now,
        "final": bool(final),
        "pid": os.getpid(),
        "kind": "generate",
        "other_model": getattr(state, "other_model", 0),
        "unpaid": sum(getattr(state, "unpaid", {}).values()),
        "failed_by": dict(state.failed),
        "warnings": dict(getattr(state, "warnings", None) or {}),
        "budget_tokens": getattr(state, "budget_tokens", None),
        "spent_tokens": state.spent_tokens() if hasattr(state, "spent_tokens") else None,
        "budget_in_flight": getattr(state, "budget_in_flight", None),
    }


def _usd(v: float) -> str:
    return f"${v:,.4f}" if v < 100 else f"${v:,.2f}"


def warnings_text(counts: dict, most: int = 3) -> str:
    """``{"timeout": 3, "http_503": 12}`` -> ``"http_503 12, timeout 3"`` (the ``most`` commonest, then ``+N more``
    reasons); ``""`` for none."""
    items = sorted(((k, int(v)) for k, v in (counts or {}).items() if v), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{k} {v:,}" for k, v in items[:most])
    if len(items) > most:
        text += f", +{len(items) - most} more"
    return text


class RunView:
    """Aggregates the run's snapshots per backend (see the module docstring).

    Args:
        config: the workflow config (dataset shard counts, backends' ``max_concurrency``, budgets).
        run_dir: the run directory whose ``progress/`` the jobs write.
        stall_s: a backend with work left and no finished request for this long shows as down.
        window_s: the samples/s of the ETA is measured over this window.
        tally: Snakemake's account of the run's jobs (:class:`eagle3_data.runtime.stageview.JobTally`), or a
            callable returning it or None; default :func:`job_tally` (the eagle3 console's, if it is the console).
    """

    def __init__(self, config: dict, run_dir, *, stall_s: float = 120.0, window_s: float = 60.0, tally=None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.stall_s = float(stall_s)
        self.window_s = float(window_s)
        self.history: dict[str, list[tuple[float, int, int]]] = {}  # backend -> (t, done, completion tokens)
        self._tally = job_tally if tally is None else tally
        self.stages = StageView(self.run_dir, self._tally, window_s=window_s)

    def tally(self):
        return self._tally() if callable(self._tally) else self._tally

    def _groups(self) -> dict[str, list[dict]]:
        from .. import config as cfg

        snaps = read_snapshots(self.run_dir)
        pilots = read_snapshots(self.run_dir, "pilot")  # `snakemake forecast`: its pilot jobs
        groups: dict[str, list[dict]] = {}
        for ds in cfg.generated_datasets(self.config):
            names = list(cfg.backends_config(self.config, ds))
            label = names[0] if names else "?"
            for shard in cfg.shard_names(self.config, ds):
                groups.setdefault(label, []).append(
                    snaps.get((ds, shard)) or pilots.get((ds, shard)) or {"dataset": ds, "shard": shard}
                )
        return groups

    def rows(self, now: float | None = None) -> list[dict]:
        """One dict per backend with started shards: backend, shards, started, finished, done, total, in_flight,
        limit, tok_s, spent_usd, budget_usd, eta_s (None: unknown), down (why, or None), warnings (reason -> count:
        failed samples by reason, replies naming another model, the jobs' other warnings).

        The ETA's rate is this run's: samples done without a request (answered by the journal on a resume, an
        unusable prompt: ``instant``) are counted in ``done`` but not in the samples/s; no ETA while none of the
        backend's jobs runs. ``shards``: the backend's shards in the run: once every generate job of the run ended
        (:meth:`tally`), a shard without a snapshot is none of the run's (its responses were there)."""
        now = time.time() if now is None else now
        tally = self.tally()
        open_jobs = tally.open_jobs(("generate", "forecast_pilot")) if tally is not None else None
        out = []
        for label, snaps in self._groups().items():
            started = [s for s in snaps if "total" in s]
            if not started:
                continue
            unstarted = 0 if open_jobs == 0 else len(snaps) - len(started)
            done = sum(s["done"] for s in started)
            total = sum(s["total"] for s in started)
            tokens = sum(s["completion_tokens"] for s in started)
            # this run's requests only: a resume's journaled samples arrive at once and are no rate
            requested = sum(s["done"] - int(s.get("instant") or 0) for s in started)
            hist = self.history.setdefault(label, [])
            hist.append((now, requested, tokens))
            while len(hist) > 2 and hist[1][0] <= now - self.window_s:
                hist.pop(0)
            t0, d0, k0 = hist[0]
            span = now - t0
            rate = (requested - d0) / span if span > 0 else 0.0
            tok_s = (tokens - k0) / span if span > 0 else 0.0
            if span <= 0:  # the first look: the jobs' own mean rates
                el = max((s["elapsed_s"] for s in started), default=0.0)
                rate = requested / el if el > 0 else 0.0
                tok_s = tokens / el if el > 0 else 0.0
            # shards not started yet: their samples are unknown until they start; counted as the mean started shard
            left = total - done + unstarted * (total / len(started))
            # one reason per backend: that of the shard that wrote last (the shards see the same backend)
            why_by: dict[str, tuple[float, str]] = {}
            for s in started:
                for b, why in (s.get("down") or {}).items():
                    if b not in why_by or float(s.get("updated_at") or 0) > why_by[b][0]:
                        why_by[b] = (float(s.get("updated_at") or 0), why)
            downs = [f"{b}: {why}" for b, (_, why) in sorted(why_by.items())]
            slow_by: dict[str, tuple[float, str]] = {}  # the same, of a backend slowed by a 429 storm
            for s in started:
                if s.get("final"):
                    continue
                for b, why in (s.get("slowed") or {}).items():
                    if b not in slow_by or float(s.get("updated_at") or 0) > slow_by[b][0]:
                        slow_by[b] = (float(s.get("updated_at") or 0), why)
            slows = [f"{b}: {why}" for b, (_, why) in sorted(slow_by.items())]
            last = max((s.get("last_done_at") or 0.0 for s in started), default=0.0)
            first = min((s["updated_at"] - s["elapsed_s"] for s in started), default=now)
            active = [s for s in started if not s.get("final")]
            if not downs and active and left > 0 and now - max(last, first) >= self.stall_s:
                err = next((s["last_error"] for s in active if s.get("last_error")), None)
                downs = [f"no reply for {now - max(last, first):.0f} s" + (f" (last error: {err})" if err else "")]
            limit = ((self.config.get("backends") or {}).get(label) or {}).get("max_concurrency")
            budgets = [s.get("budget_usd") for s in started]
            budget = None
            if all(b is not None for b in budgets):  # each shard's share: the dataset budget over its shards
                budget = sum(budgets) + unstarted * (sum(budgets) / len(budgets))
            out.append(
                {
                    "stage": "forecast pilot" if all(s.get("kind") == "pilot" for s in started) else "generate",
                    "backend": label,
                    "shards": len(started) + unstarted,
                    "started": len(started),
                    "finished": sum(1 for s in started if s.get("final")),
                    "done": done,
                    "total": total,
                    "in_flight": sum(s["in_flight"] for s in active),
                    "limit": limit,
                    "tok_s": tok_s,
                    "spent_usd": sum(s["spent_usd"] for s in started),
                    "budget_usd": budget,
                    "eta_s": None if downs or rate <= 0 or not active else left / rate,
                    "down": "; ".join(downs) or None,
                    "slowed": "; ".join(slows) or None,
                    "warnings": self._warnings(started),
                }
            )
        return out

    @staticmethod
    def _warnings(snaps: list[dict]) -> dict:
        out: dict[str, int] = {}
        for s in snaps:
            counts = dict(s.get("failed_by") or {})
            if s.get("other_model"):
                counts["other_model"] = int(s["other_model"])
            for k, v in (s.get("warnings") or {}).items():
                counts[k] = counts.get(k, 0) + int(v)
            for k, v in counts.items():
                out[k] = out.get(k, 0) + int(v)
        return out

    @staticmethod
    def line(r: dict) -> str:
        """A row of :meth:`rows` as one short line."""
        parts = [
            f"{r.get('stage', 'generate')} {r['backend']}: {r['done']:,}/{r['total']:,} samples, "
            f"{r['started']}/{r['shards']} shards"
        ]
        parts.append(f"in flight {r['in_flight']}" + (f"/{r['limit']}" if r["limit"] else ""))
        parts.append(f"{r['tok_s']:,.0f} tok/s")
        parts.append(_usd(r["spent_usd"]) + (f" of {_usd(r['budget_usd'])}" if r["budget_usd"] is not None else ""))
        if r.get("warnings"):
            parts.append(f"warnings: {warnings_text(r['warnings'])}")
        if r["down"]:
            parts.append(f"DOWN: {r['down']}"[:160])
        elif r.get("slowed"):
            parts.append(f"SLOWED: {r['slowed']}"[:200])
            parts.append(f"ETA {clock(r['eta_s'])}" if r["eta_s"] is not None else "ETA -")
        elif r["started"] == r["finished"] == r["shards"]:
            parts.append("done")
        else:
            parts.append(f"ETA {clock(r['eta_s'])}" if r["eta_s"] is not None else "ETA -")
        return " | ".join(parts)

    def lines(self, now: float | None = None) -> list[str]:
        """The run's lines: one per backend (:meth:`line`), then one per stage (:meth:`StageView.line`)."""
        return [self.line(r) for r in self.rows(now)] + [self.stages.line(r) for r in self.stages.rows(now)]

    def table(self, now: float | None = None):
        """The rows as ``rich`` tables, ``generation`` and ``stages``, each where it has rows (the live view on a
        terminal)."""
        from rich.console import Group

        rows, stages = self.rows(now), self.stages.rows(now)
        return Group(
            *([self._generation_table(rows)] if rows else []), *([self.stages.table(stages)] if stages else [])
        )

    def _generation_table(self, rows: list[dict]):
        from rich.table import Table

        t = Table(title="generation", box=None, pad_edge=False)
        for h in ("backend", "samples", "shards", "in flight", "tok/s", "spent", "warnings", "ETA"):
            t.add_column(h, justify="left" if h in ("backend", "warnings", "ETA") else "right")
        for r in rows:
            eta = (
                f"DOWN: {r['down']}"[:120]
                if r["down"]
                else "done"
                if r["finished"] == r["shards"]
                else clock(r["eta_s"])
                if r["eta_s"] is not None
                else "-"
            )
            if r.get("slowed") and not r["down"]:  # a 429 storm: why fewer are in flight, and until when
                eta = f"{eta} (SLOWED: {r['slowed']})"[:160]
            t.add_row(
                r["backend"],
                f"{r['done']:,}/{r['total']:,}",
                f"{r['started']}/{r['shards']}",
                f"{r['in_flight']}" + (f"/{r['limit']}" if r["limit"] else ""),
                f"{r['tok_s']:,.0f}",
                _usd(r["spent_usd"]) + (f" of {_usd(r['budget_usd'])}" if r["budget_usd"] is not None else ""),
                warnings_text(r.get("warnings") or {}) or "-",
                eta,
            )
        return t


class _Printer(threading.Thread):
    """Prints the view every ``interval_s``: plain lines when they change, or (``live``) ``rich`` live tables
    redrawn in place, with the jobs' terminal output through :class:`~eagle3_data.runtime.joboutput.JobOutput`."""

    def __init__(self, view: RunView, interval_s: float, stream, live: bool):
        super().__init__(name="eagle3-run-view", daemon=True)
        self.view, self.interval_s, self.stream, self.live = view, interval_s, stream, live
        self.stopping = threading.Event()
        self.display = None  # the rich Live, while the tables are up
        self.jobs = None  # the jobs' terminal output (JobOutput)

    def start(self) -> None:
        """Put the tables up (live) before the thread starts: in the calling thread, so that every job started
        after :func:`start` writes to the pipe, not through the tables."""
        if self.live:
            try:
                self._begin_live()
            except Exception:  # no table, then: plain lines, the terminal as it was
                self._end_live()
                self.live = False
        super().start()

    def run(self) -> None:
        if self.live:
            try:
                while not self.stopping.wait(self.interval_s):
                    with contextlib.suppress(Exception):
                        self.display.update(self.view.table())
            finally:
                self._end_live()
            return
        last: list[str] = []
        while True:
            stopping = self.stopping.wait(self.interval_s)
            with contextlib.suppress(Exception):
                lines = self.view.lines()
                if lines and lines != last:  # one write: Snakemake's threads write to the same stream
                    self.stream.write("\n".join(lines) + "\n")
                    self.stream.flush()
                last = lines
            if stopping:  # the run ended: its last state was printed once more (if it changed)
                return

    def _begin_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        from .joboutput import JobOutput

        self.jobs = JobOutput(self._show)
        self.jobs.start()  # the jobs' stdout / stderr: a pipe, shown above the tables (its module docstring)
        console = Console(file=self.jobs.terminal or self.stream)
        if self.jobs.terminal is not None and not os.isatty(0) and "COLUMNS" not in os.environ:
            # rich asks the standard descriptors for the terminal's size; stdout and stderr are the pipe now
            with contextlib.suppress(OSError):
                console.size = os.get_terminal_size(self.jobs.terminal.fileno())
        # rich puts whatever is written to sys.stdout / sys.stderr above the tables; Snakemake's messages among it:
        # its console is the eagle3 logger plugin, which writes to sys.stderr as it is at each message
        # (snakemake_logger_plugin_eagle3; without it start() draws no table)
        self.display = Live(
            self.view.table(),
            console=console,
            refresh_per_second=1,
            transient=False,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self.display.start()

    def _end_live(self) -> None:
        """The jobs' lines written so far, the tables' last state, then the terminal as it was."""
        if self.jobs is not None:
            with contextlib.suppress(Exception):
                self.jobs.drain()
        if self.display is not None:
            with contextlib.suppress(Exception):
                self.display.update(self.view.table(), refresh=True)
            with contextlib.suppress(Exception):
                self.display.stop()
        if self.jobs is not None:
            with contextlib.suppress(Exception):
                self.jobs.stop()

    def _show(self, line: str) -> None:
        """One line of the jobs' output: above the tables while they are up, else on the terminal."""
        display = self.display
        if display is not None and display.is_started:
            from rich.text import Text

            display.console.print(Text.from_ansi(line))
        else:
            out = (self.jobs.terminal if self.jobs is not None else None) or sys.stderr
            out.write(line + "\n")
            out.flush()


#: Snakemake's console when it is this distribution's logger plugin (``snakemake_logger_plugin_eagle3.LogHandler``,
#: turned on by the workflow profile): it writes Snakemake's messages to ``sys.stderr`` as it is at each message, so
#: a live table's redirect takes them too. Without it a live table would be overwritten by Snakemake's console
#: handler, which holds the terminal's stream: start() prints plain lines then.
_console: list = []


def attach_console(handler) -> None:
    """The eagle3 logger plugin's handler: Snakemake made it the run's console (it calls this when it is made)."""
    if handler not in _console:
        _console.append(handler)


def detach_console(handler) -> None:
    """The handler is closed (Snakemake's logging shut down)."""
    if handler in _console:
        _console.remove(handler)


def console_is_ours() -> bool:
    """Whether Snakemake's console is the eagle3 logger plugin (:func:`attach_console`)."""
    return bool(_console)


_printer: list[_Printer] = []


def start(config: dict, run_dir, *, interval_s: float = 5.0, stream=None, live: bool | None = None) -> None:
    """Print the run-wide view from a background thread of the main ``snakemake`` process until :func:`stop`.

    ``live``: redraw the tables in place (default: when ``stream`` is a terminal and Snakemake's console is the eagle3
    logger plugin, :func:`console_is_ours`, unless ``EAGLE3_LIVE_VIEW=0`` or ``TERM=dumb``); plain lines otherwise,
    printed when they change. Nothing is printed for a run without generated datasets."""
    from .. import config as cfg

    if _printer or not cfg.generated_datasets(config):
        return
    stream = stream or sys.stderr
    if live is None:
        live = (
            bool(getattr(stream, "isatty", lambda: False)())
            and os.environ.get("EAGLE3_LIVE_VIEW") != "0"
            and os.environ.get("TERM") != "dumb"
            and console_is_ours()
        )
    p = _Printer(RunView(config, run_dir), interval_s, stream, live)
    _printer.append(p)
    p.start()


def stop() -> None:
    """Stop the thread of :func:`start` (Snakefile ``onsuccess`` / ``onerror``), once the console wrote what
    Snakemake logged before (its logger plugin writes from a queue: the view's last state and the run's last screen
    come after Snakemake's last messages)."""
    for handler in list(_console):
        with contextlib.suppress(Exception):
            handler.drain()
    while _printer:
        p = _printer.pop()
        p.stopping.set()
        p.join(timeout=10)  # a live one writes the jobs' last lines and the tables' last state, then returns


def job_tally():
    """Snakemake's account of the run's jobs (:class:`eagle3_data.runtime.stageview.JobTally`), kept by the eagle3
    logger plugin when it is the console; None otherwise."""
    for handler in _console:
        tally = getattr(handler, "jobs", None)
        if tally is not None:
            return tally
    return None
