"""The run-wide view of the stages after generation: one row per stage with jobs in the run (tokenize, validate,
merge, plan, extract, export), each with its own rate and ETA, or none.

What a row counts comes from two places:

- Snakemake's own account of the run's jobs (:class:`JobTally`), which the run's console (the eagle3 logger plugin,
  ``snakemake_logger_plugin_eagle3``) keeps from the records Snakemake logs: the jobs of each rule in the run (its
  ``Job stats``), each job's start, end and failure. A stage's jobs are its rules' (``validate`` and
  ``validate_pretokenized``, ``export``, ``export_heldout`` and ``export_dataset``, ...);
- the extract jobs' progress snapshots (``<run dir>/progress/extract.<dataset>.<shard>.json``,
  :mod:`eagle3_data.runtime.tokenprogress`): tokens of the job's selection, those reused from stored states, those
  forwarded so far, and the device the job runs on.

A stage's row (:meth:`StageView.rows`): its jobs done of the run's, failed ones, and

- extract: tokens done (reused + forwarded) of the run's jobs' tokens (their selections'; a job not started yet
  counts as the mean started one), forwarded tokens/s over the last minute (model loads and file writes included),
  the devices of the running jobs, and an ETA: the tokens left at that rate;
- the other stages: jobs per minute since the stage's first job started, and an ETA: the jobs left at that rate.

No ETA (``-``) while none of the stage's jobs runs (its next jobs wait on an earlier stage) or before one ended
(extract: before a token was forwarded); ``done`` once every job of the stage in the run ended well.
"""

from __future__ import annotations

import os
import threading
import time

#: the stages after generation, in the order a run meets them; a rule belongs to the first whose name it is or
#: starts with (followed by ``_``)
STAGES = ("tokenize", "validate", "merge", "plan", "extract", "export")


def stage_of(rule: str) -> str | None:
    """The stage of a rule (:data:`STAGES`), or None (a rule the view does not show)."""
    for stage in STAGES:
        if rule == stage or rule.startswith(stage + "_"):
            return stage
    return None


class JobTally:
    """The jobs of a run per rule, from Snakemake's log records (the eagle3 logger plugin calls these as Snakemake
    logs them; thread-safe). Times are unix seconds (``at``: now by default)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.planned: dict[str, int] = {}  # rule -> jobs in the run (Snakemake's job stats)
        self.rule_of: dict[int, str] = {}  # job id -> rule
        self.started: dict[int, float] = {}  # job id -> when
        self.finished: dict[int, float] = {}
        self.failed: dict[int, float] = {}

    def run_info(self, stats: dict) -> None:
        """Snakemake's job stats (rule -> jobs in the run, and ``total``)."""
        with self._lock:
            self.planned = {str(k): int(v) for k, v in (stats or {}).items() if k != "total"}

    def job_started(self, jobid: int, rule: str, at: float | None = None) -> None:
        with self._lock:
            self.rule_of[int(jobid)] = str(rule)
            self.started.setdefault(int(jobid), time.time() if at is None else at)
            self.failed.pop(int(jobid), None)  # a retry (--retries): running again

    def job_finished(self, jobid: int, at: float | None = None) -> None:
        with self._lock:
            self.finished[int(jobid)] = time.time() if at is None else at

    def job_failed(self, jobid: int, rule: str | None = None, at: float | None = None) -> None:
        with self._lock:
            if rule:
                self.rule_of.setdefault(int(jobid), str(rule))
            self.failed[int(jobid)] = time.time() if at is None else at

    def rules(self, names=None) -> dict[str, dict]:
        """Rule -> ``{planned, started, finished, failed, running, first_start, last_end}`` (jobs; unix s or None),
        for the rules with jobs in the run (``names``: only those)."""
        with self._lock:
            ids_of: dict[str, list[int]] = {rule: [] for rule in self.planned}
            for j, rule in self.rule_of.items():
                ids_of.setdefault(rule, []).append(j)
            out: dict[str, dict] = {}
            for rule in sorted(ids_of if names is None else set(ids_of) & set(names)):
                ids = ids_of[rule]
                started = [self.started[j] for j in ids if j in self.started]
                ended = [j for j in ids if j in self.finished or j in self.failed]
                ends = [self.finished.get(j) or self.failed[j] for j in ended]
                out[rule] = {
                    "planned": max(self.planned.get(rule, 0), len(ids)),
                    "started": len(started),
                    "finished": sum(1 for j in ids if j in self.finished),
                    "failed": sum(1 for j in ids if j in self.failed and j not in self.finished),
                    "running": max(0, len(started) - len(ended)),
                    "first_start": min(started, default=None),
                    "last_end": max(ends, default=None),
                }
            return out

    def stages(self) -> dict[str, dict]:
        """:meth:`rules` summed per stage (:func:`stage_of`), in :data:`STAGES` order; stages without jobs left
        out."""
        out: dict[str, dict] = {}
        for rule, r in self.rules().items():
            stage = stage_of(rule)
            if stage is None or not r["planned"]:
                continue
            s = out.setdefault(stage, {"planned": 0, "started": 0, "finished": 0, "failed": 0, "running": 0})
            for k in ("planned", "started", "finished", "failed", "running"):
                s[k] += r[k]
            for k, pick in (("first_start", min), ("last_end", max)):
                vals = [v for v in (s.get(k), r[k]) if v is not None]
                s[k] = pick(vals) if vals else None
        return {st: out[st] for st in STAGES if st in out}

    def open_jobs(self, rules) -> int:
        """Jobs of ``rules`` in the run that have not ended (started or not)."""
        return sum(max(0, r["planned"] - r["finished"] - r["failed"]) for r in self.rules(rules).values())


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return True
    return True


def clock(seconds: float) -> str:
    """Seconds as ``M:SS``, or ``H:MM:SS`` from an hour."""
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class StageView:
    """The stage rows of a run (see the module docstring).

    Args:
        run_dir: the run directory whose ``progress/`` the extract jobs write.
        tally: Snakemake's account of the run's jobs (:class:`JobTally`), or a callable returning it or None
            (then only extraction's row, from its snapshots).
        window_s: extraction's tokens/s is measured over this window.
    """

    def __init__(self, run_dir, tally=None, *, window_s: float = 60.0):
        self.run_dir = run_dir
        self._tally = tally
        self.window_s = float(window_s)
        self.history: list[tuple[float, int]] = []  # (t, forwarded tokens) of extraction

    def tally(self) -> JobTally | None:
        return self._tally() if callable(self._tally) else self._tally

    def rows(self, now: float | None = None) -> list[dict]:
        """One dict per stage with jobs in the run: stage, jobs (of the run), finished, failed, running, rate (per
        s: jobs, or forwarded tokens for extract), unit (``jobs`` | ``tokens``), done and total (tokens, extract
        only; else None), devices (extract: the running jobs' devices, else ""), eta_s (None: no ETA), state
        (``done`` | ``failed`` | ``running`` | ``waiting``)."""
        now = time.time() if now is None else now
        tally = self.tally()
        stages = tally.stages() if tally is not None else {}
        snaps = self._extract_snapshots()
        if snaps and "extract" not in stages:  # no account of the jobs: those that wrote a snapshot
            n, ended = len(snaps), sum(1 for s in snaps if s.get("final"))
            running = sum(1 for s in snaps if not s.get("final") and _alive(s.get("pid")))
            stages["extract"] = {"planned": n, "started": n, "finished": ended, "failed": n - ended - running}
            stages["extract"]["running"] = running
            stages = {st: stages[st] for st in STAGES if st in stages}
        out = []
        for stage, s in stages.items():
            row = {
                "stage": stage,
                "jobs": s["planned"],
                "finished": s["finished"],
                "failed": s["failed"],
                "running": s["running"],
                "rate": 0.0,
                "unit": "jobs",
                "done": None,
                "total": None,
                "devices": "",
                "eta_s": None,
            }
            if stage == "extract":
                self._extract(row, snaps, now)
            elif s["finished"] and s["running"] and s.get("first_start"):
                row["rate"] = s["finished"] / max(now - s["first_start"], 1e-9)
                row["eta_s"] = (s["planned"] - s["finished"] - s["failed"]) / row["rate"]
            ended = s["finished"] + s["failed"]
            row["state"] = (
                ("failed" if s["failed"] else "done")
                if ended >= s["planned"]
                else "running"
                if s["running"]
                else "waiting"
            )
            if row["state"] != "running":
                row["eta_s"] = None
            out.append(row)
        return out

    def _extract_snapshots(self) -> list[dict]:
        from .snapshots import read_snapshots

        return list(read_snapshots(self.run_dir, "extract").values())

    def _extract(self, row: dict, snaps: list[dict], now: float) -> None:
        """Extraction's tokens, rate, devices and ETA into ``row``."""
        row["unit"] = "tokens"
        started = [s for s in snaps if "tokens" in s]
        if not started:
            return
        active = [s for s in started if not s.get("final") and _alive(s.get("pid"))]
        forwarded = sum(int(s.get("forwarded") or 0) for s in started)
        done = sum(int(s.get("reused") or 0) for s in started) + forwarded
        total = sum(int(s["tokens"]) for s in started)
        # the jobs not started yet: as many tokens as the mean started one
        total += max(0, row["jobs"] - len(started)) * total / len(started)
        hist = self.history
        hist.append((now, forwarded))
        while len(hist) > 2 and hist[1][0] <= now - self.window_s:
            hist.pop(0)
        span = now - hist[0][0]
        rate = (forwarded - hist[0][1]) / span if span > 0 else 0.0
        if span <= 0:  # the first look: the jobs' own mean rates
            el = max((float(s.get("elapsed_s") or 0) for s in active), default=0.0)
            rate = sum(int(s.get("forwarded") or 0) for s in active) / el if el > 0 else 0.0
        devices: dict[str, int] = {}
        for s in active or started:
            label = str(s.get("device") or "")
            if label:
                devices[label] = devices.get(label, 0) + 1
        row.update(
            done=done,
            total=int(round(max(total, done))),
            rate=rate,
            devices=", ".join(f"{n}× {d}" if n > 1 else d for d, n in devices.items()),
            running=max(row["running"], len(active)),
            # an ETA while a job forwards, or (Snakemake's account) runs: loads its model, writes its file
            eta_s=(max(total, done) - done) / rate if (active or row["running"]) and rate > 0 else None,
        )

    @staticmethod
    def line(r: dict) -> str:
        """A row of :meth:`rows` as one short line."""
        jobs = f"{r['finished']}/{r['jobs']} jobs" + (f", {r['failed']} failed" if r["failed"] else "")
        parts = [f"{r['stage']}: {jobs}"]
        if r["done"] is not None:
            parts.append(f"{r['done']:,}/{r['total']:,} tokens")
            parts.append(f"{r['rate']:,.0f} tok/s")
            if r["devices"]:
                parts.append(f"on {r['devices']}"[:120])
        elif r["rate"]:
            parts.append(f"{r['rate'] * 60:,.1f} jobs/min")
        parts.append(StageView.eta_text(r))
        return " | ".join(parts)

    @staticmethod
    def eta_text(r: dict) -> str:
        if r["state"] in ("done", "failed"):
            return r["state"]
        return f"ETA {clock(r['eta_s'])}" if r["eta_s"] is not None else "ETA -"

    def table(self, rows: list[dict]):
        """The rows as a ``rich`` table (the live view on a terminal)."""
        from rich.table import Table

        t = Table(title="stages", box=None, pad_edge=False)
        for h in ("stage", "jobs", "tokens", "rate", "device", "ETA"):
            t.add_column(h, justify="right" if h in ("jobs", "tokens", "rate") else "left")
        for r in rows:
            tokens = f"{r['done']:,}/{r['total']:,}" if r["done"] is not None else "-"
            if r["done"] is not None:
                rate = f"{r['rate']:,.0f} tok/s"
            else:
                rate = f"{r['rate'] * 60:,.1f} jobs/min" if r["rate"] else "-"
            jobs = f"{r['finished']}/{r['jobs']}" + (f", {r['failed']} failed" if r["failed"] else "")
            eta = self.eta_text(r).removeprefix("ETA ")
            t.add_row(r["stage"], jobs, tokens, rate, r["devices"][:60] or "-", eta)
        return t
