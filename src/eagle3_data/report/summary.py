"""The run's last lines (Snakefile ``onsuccess`` / ``onerror``): a table per dataset of what the run left under
``results/``, and what the forecast pilot paid for."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..config.lookup import answers_of, shards_of
from ..logs import clip_line, last_attempt
from ..formatting import format_clock, format_usd
from .markdown import fmt


RUN_SUMMARY_COLUMNS = [
    ("dataset", "Dataset", "text"),
    ("shards", "Shards", "text"),
    ("samples", "Samples", ""),
    ("ok", "OK", ""),
    ("failed", "Failed", ""),
    ("not_sent", "Not sent", ""),
    ("rejected", "Rejected", ""),
    ("kept", "Kept", ""),
    ("left", "Left", ""),
    ("cost_usd", "Cost $", "usd"),
    ("time", "Time", "text"),
    ("ended_by", "Ended by", "text"),
]

#: the budgets a shard's summary (and its job's snapshot) gives its share and spend of: (config key, summary key of
#: the share, summary key of the spend)
_BUDGETS = (
    ("budget_completion_tokens", "budget_completion_tokens", "total_completion_tokens"),
    ("budget_usd", "budget_usd", "total_cost_usd"),
)


def _rows_in(paths) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _validated_current(results: Path, ds: str, shard: str) -> bool:
    """Whether ``<ds>/validated/<shard>.parquet`` and ``<ds>/rejected/<shard>.parquet`` were made from the shard's
    current responses: both exist and neither is older than the tokens or the responses file before it (a run that
    regenerated a shard and stopped, or failed, before validating it leaves the earlier run's files behind)."""
    chain = [
        _mtime(results / ds / "responses" / f"{shard}.parquet") or _mtime(results / ds / "responses" / f"{shard}.json"),
        _mtime(results / ds / "tokens" / f"{shard}.parquet"),
    ]
    ends = [_mtime(results / ds / name / f"{shard}.parquet") for name in ("validated", "rejected")]
    if None in ends or chain[0] is None:
        return False
    return all(t is None or e + 1e-3 >= t for e in ends for t in chain)


def run_summary_rows(
    datasets_config: dict, results_dir="results", run_dir=None, *, decontaminated: bool = False
) -> list[dict]:
    """One row per dataset of the config, from what the run left under ``results_dir``, and a ``Total`` row.

    Only this config's files are read: the shards ``000`` .. ``shards - 1`` of each dataset (files an earlier
    config with more shards left behind are not counted). Per generated shard: generate's summary
    ``<ds>/responses/<shard>.json`` when the shard finished, else (a failed or stopped job) the last snapshot its
    job wrote to the run directory ``run_dir`` (:mod:`eagle3_data.runtime.runview`: what it had journaled and paid for).
    A shard's ``<ds>/rejected/<shard>.parquet`` and ``<ds>/validated/<shard>.parquet`` are counted (from parquet
    metadata) only when they are current: its generate finished and they are not older than its responses and
    tokens (:func:`_validated_current`; a stopped or failed run leaves an earlier run's files behind). The
    samples of a shard the run did not take through validate are ``left``: the same command finishes them (their
    replies are journaled). So every row adds up: samples = kept + rejected + not_sent + left.
    ``decontaminated``: the decontaminate stage is on; its rejects ``<ds>/rejected/decontaminate/<shard>.parquet``
    count as rejects of the source rows, as normalize's do (the prompts it drops never reach generate).

    A dataset with ``answers: original`` counts its rule original_answers shards the same way (their summaries
    have generate's keys), with no cost (None) and ended_by ``original answers`` (``original answers
    (max_samples)`` when its cap left samples out).

    Returns dicts with dataset, kind (``generated`` / ``original`` / ``pretokenized`` / ``total``), shards
    (``"1/2"``: shards whose generate finished (a current summary), of the dataset's ``shards``; ``"-"`` for a
    pre-tokenized dataset), samples (the source rows: the prompts considered by generate, finished or not, plus
    the rows normalize rejected; a pre-tokenized dataset: its rows, kept + rejected), ok (samples with every
    response), failed (samples with a failed response or an unusable prompt), not_sent (samples a budget or a
    stop kept from being sent), rejected (rows of every stage's current rejects), kept (current validated rows),
    left (samples of shards not through validate: a rerun finishes them), cost_usd (dollars of the dataset's
    journaled responses, earlier runs' included), wall_s (the longest shard's generate time: the shards run at
    once; None without a summary), time (wall_s as ``m:ss``), ended_by (the shards' distinct ``stopped_by``;
    ``stopped`` for a shard that did not finish, ``failed, not paid`` for one whose samples failed without a paid
    reply), rerun_unpaid / kept_unpaid (failed samples without a paid reply: of shards whose job failed, so the
    same command reruns them / recorded as failed with ``generation.unpaid_failures: keep``), overshoot (None, or
    when a budget ended the dataset and its shards spent more than their shares of it: ``{"key", "budget",
    "spent", "in_flight"}``, in_flight the requests that were in flight when it was reached)."""
    import json

    from ..runtime.runview import read_snapshots

    results = Path(results_dir)
    snaps = read_snapshots(run_dir) if run_dir is not None else {}
    rows = []
    for ds, dcfg in (datasets_config or {}).items():
        dcfg = dcfg or {}
        pre = ((dcfg.get("source") or {}).get("format")) == "pretokenized"
        orig = not pre and answers_of(dcfg) == "original"
        n_shards = shards_of(dcfg)
        names = [f"{i:03d}" for i in range(n_shards)]
        sums = []
        finished = 0
        kept = rejected = left = 0
        for shard in names:
            p = results / ds / "responses" / f"{shard}.json"
            s = None
            if p.is_file():
                with contextlib.suppress(OSError, ValueError):
                    s = json.loads(p.read_text())
            done = s is not None
            snap = snaps.get((ds, shard))
            if snap is not None and (s is None or float(snap.get("updated_at") or 0) > p.stat().st_mtime + 1):
                # this run's job did not finish (or finished without writing its summary): what it journaled
                done = False
                s = {
                    "samples": snap.get("total"),
                    "ok": snap.get("ok"),
                    "failed_total": snap.get("failed"),
                    "other_model_replies": snap.get("other_model"),
                    "rerun_unpaid": snap.get("unpaid") or 0,
                    "not_sent": int(snap.get("total") or 0) - int(snap.get("done") or 0),
                    "total_cost_usd": snap.get("spent_usd"),
                    "wall_s": snap.get("elapsed_s"),
                    "total_completion_tokens": snap.get("spent_tokens"),
                    "budget_completion_tokens": snap.get("budget_tokens"),
                    "budget_usd": snap.get("budget_usd"),
                    "budget_in_flight": snap.get("budget_in_flight"),
                    "stopped_by": "stopped" if not snap.get("final") or not p.is_file() else None,
                }
                if snap.get("final") and snap.get("unpaid"):
                    s["stopped_by"] = "failed, not paid"
            if s is None:
                continue  # not started: its samples are unknown (and its earlier files not this run's)
            sums.append(s)
            finished += done
            if done and not pre and _validated_current(results, ds, shard):
                kept += _rows_in([results / ds / "validated" / f"{shard}.parquet"])
                rejected += _rows_in([results / ds / "rejected" / f"{shard}.parquet"])
            else:  # generated (maybe) but not validated: the rerun of the same command finishes it
                left += max(0, int(s.get("samples") or 0) - int(s.get("not_sent") or 0))
        # the source rows normalize (and decontaminate) rejected are samples of the dataset too, before generate
        before = [results / ds / "rejected" / "normalize.parquet"]
        if decontaminated and not pre:
            before += [results / ds / "rejected" / "decontaminate" / f"{s}.parquet" for s in names]
        source_rejects = _rows_in([p for p in before if p.is_file()])
        rejected += source_rejects
        if pre:  # a pre-tokenized dataset: its validate shards, whatever their number
            kept = _rows_in([p for p in (results / ds / "validated" / f"{s}.parquet" for s in names) if p.is_file()])
            rejected = source_rejects + _rows_in(
                [p for p in (results / ds / "rejected" / f"{s}.parquet" for s in names) if p.is_file()]
            )
            left = 0
        walls = [float(s.get("wall_s") or 0.0) for s in sums]
        ended = sorted({str(s.get("stopped_by")) for s in sums if s.get("stopped_by")})
        if orig and sums:  # the source's own answers: no budget, no stop; only a sample cap
            ended = ["original answers" + (" (max_samples)" if "max_samples" in ended else "")]
        row = {
            "dataset": ds,
            "kind": "pretokenized" if pre else "original" if orig else "generated",
            "shards": "-" if pre else f"{finished}/{n_shards}",
            "samples": kept + rejected if pre else source_rejects + sum(int(s.get("samples") or 0) for s in sums),
            "ok": None if pre else sum(int(s.get("ok") or 0) for s in sums),
            "failed": None if pre else sum(int(s.get("failed_total") or 0) for s in sums),
            "not_sent": None if pre else sum(int(s.get("not_sent") or 0) for s in sums),
            "rejected": rejected,
            "kept": kept,
            "left": None if pre else left,
            "cost_usd": None if pre or orig else sum(float(s.get("total_cost_usd") or 0.0) for s in sums),
            "wall_s": max(walls) if walls else None,
            "ended_by": "pre-tokenized" if pre else ", ".join(ended),
            "other_model": None if pre else sum(int(s.get("other_model_replies") or 0) for s in sums),
            # of failed: samples that got no paid reply; a rerun sends them (rerun_unpaid: their jobs failed, so
            # the same command reruns them; kept_unpaid: recorded as failed rows, generation.unpaid_failures: keep)
            "rerun_unpaid": None if pre else sum(int(s.get("rerun_unpaid") or 0) for s in sums),
            "kept_unpaid": None if pre else sum(int(s.get("failed_unpaid") or 0) for s in sums),
            "overshoot": None if pre or orig else _overshoot(sums, ended),
        }
        row["time"] = format_clock(row["wall_s"]) if row["wall_s"] is not None else ""
        rows.append(row)
    total = {"dataset": "Total", "kind": "total", "shards": "", "ended_by": "", "time": "", "wall_s": None}
    for key in ("samples", "ok", "failed", "not_sent", "rejected", "kept", "left", "cost_usd"):
        vals = [r[key] for r in rows if r[key] is not None]
        total[key] = sum(vals) if vals else None
    rows.append(total)
    return rows


def _overshoot(sums: list[dict], ended: list[str]) -> dict | None:
    """How far the shards of a dataset that a budget ended spent past their shares of it (see
    :func:`run_summary_rows`), or None."""
    for key, share_key, spent_key in _BUDGETS:
        if key not in ended:
            continue
        shares = [s.get(share_key) for s in sums]
        if not sums or any(v is None for v in shares):
            continue  # a summary written before the shares were recorded
        budget = sum(float(v) for v in shares)
        spent = sum(float(s.get(spent_key) or 0.0) for s in sums)
        if spent > budget * (1 + 1e-9):
            return {
                "key": key,
                "budget": budget,
                "spent": spent,
                "in_flight": sum(int(s.get("budget_in_flight") or 0) for s in sums),
            }
    return None


def pilot_spend(datasets_config: dict, results_dir="results") -> dict | None:
    """What the forecast pilot (``snakemake forecast``) paid for, from its summaries
    ``<results_dir>/forecast/pilot/<ds>/<shard>.json`` of this config's shards: ``{"requests": new responses,
    "cost_usd": their dollars}``; None when there are none."""
    import json

    requests, cost, found = 0, 0.0, False
    for ds, dcfg in (datasets_config or {}).items():
        for i in range(shards_of(dcfg)):
            p = Path(results_dir) / "forecast" / "pilot" / ds / f"{i:03d}.json"
            with contextlib.suppress(OSError, ValueError):
                s = json.loads(p.read_text())
                found = True
                requests += int(s.get("ok") or 0) - int(s.get("from_journal") or 0)
                cost += float(s.get("cost_usd") or 0.0)
    return {"requests": max(0, requests), "cost_usd": cost} if found else None


#: how a job's one-line failure looks in its log (errors.report_failure through logs.setup_logging's format)
_ERROR_MARK = " ERROR eagle3_data: "


def failure_causes(logs_dir="logs", since: float | None = None, limit: int = 6) -> list[str]:
    """Why the jobs of a failed run failed: the one-line error of each job log under ``logs_dir`` written since
    ``since`` (unix time), from its last attempt, as ``"<log>: <message>"`` (at most 400 characters; interrupts
    left out: the run says those itself); at most ``limit`` of them, then a line counting the rest."""
    import re

    found = []
    root = Path(logs_dir)
    for log in sorted(root.rglob("*.log")) if root.is_dir() else []:
        try:
            mtime = log.stat().st_mtime
            if since is not None and mtime < since:
                continue
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        errors = [ln.split(_ERROR_MARK, 1)[1] for ln in last_attempt(lines) if _ERROR_MARK in ln]
        errors = [e for e in errors if not re.match(r"(\[[^\]]*\] )?interrupted\b", e)]
        if errors:
            found.append((mtime, f"{log}: {clip_line(errors[-1])}"))
    found.sort()
    out = [text for _, text in found[:limit]]
    if len(found) > limit:
        out.append(f"... and {len(found) - limit} more job(s): their logs, under {root}/")
    return out


def run_summary(
    datasets_config: dict,
    results_dir="results",
    *,
    run_s: float | None = None,
    ok: bool = True,
    tally_path=None,
    run_dir=None,
    logs_dir="logs",
    decontaminated: bool = False,
) -> str:
    """The run's last lines (Snakefile ``onsuccess`` / ``onerror``): a table of :func:`run_summary_rows` and where
    the full reports are.

    ``run_s``: the run's wall time (the Total row's time); ``ok``: False after a failed run (the title says what
    the table covers); ``tally_path``: the tally file to point to, when it exists; ``run_dir``: the run's
    directory (snapshots of the shards that did not finish, :func:`run_summary_rows`); ``logs_dir``: after a failed
    run, the one-line error of each job that failed in it (:func:`failure_causes`) is shown under the table."""
    from tabulate import tabulate

    rows = run_summary_rows(datasets_config, results_dir, run_dir, decontaminated=decontaminated)
    if run_s is not None:
        rows[-1]["time"] = format_clock(run_s)
    body = [[fmt(r.get(key), kind) for key, _, kind in RUN_SUMMARY_COLUMNS] for r in rows]
    table = tabulate(
        body,
        headers=[h for _, h, _ in RUN_SUMMARY_COLUMNS],
        tablefmt="simple",
        disable_numparse=True,
        colalign=["left" if k == "text" else "right" for _, _, k in RUN_SUMMARY_COLUMNS],
    )
    lines = [
        "Run summary" if ok else "Run summary (the run failed; what it had finished):",
        table,
        "Samples: source rows (= Kept + Rejected + Not sent + Left). Shards: generate finished. OK/Failed/Not "
        "sent: samples at generate (not sent: kept back by a budget or a stop). Rejected: every stage, "
        "normalize's"
        + (" and decontaminate's" if decontaminated else "")
        + " included. Kept: validated. Left: not validated yet (their replies are journaled; the same "
        "command finishes them). Cost: journaled responses. Time: the longest generate shard"
        + ("; Total: the run." if run_s is not None else "."),
    ]
    over = [(r["dataset"], r["overshoot"]) for r in rows[:-1] if r.get("overshoot")]
    if over:

        def said(ds: str, o: dict) -> str:
            spent = (
                f"${format_usd(o['spent'])} of ${format_usd(o['budget'])}"
                if o["key"] == "budget_usd"
                else f"{o['spent']:,.0f} of {o['budget']:,.0f} completion tokens"
            )
            pct = 100 * (o["spent"] / o["budget"] - 1) if o["budget"] else 0.0
            return f"{ds} {o['key']} {spent} (+{pct:.1f}%, {o['in_flight']:,} in flight)"

        lines.append(
            "Budget overshoot (the replies in flight when it was reached; each at most max_tokens): "
            + "; ".join(said(ds, o) for ds, o in over)
            + "."
        )
    original = [r["dataset"] for r in rows[:-1] if r["kind"] == "original"]
    if original:
        lines.append(f"Original answers (answers: original; no request sent, no cost): {', '.join(original)}.")
    unpaid = [f"{r['dataset']} {r['rerun_unpaid']:,}" for r in rows[:-1] if r.get("rerun_unpaid")]
    if unpaid:
        lines.append(
            f"Failed, not paid: rerun the same command to retry them (only they are sent; nothing journaled "
            f"is paid again): {', '.join(unpaid)}."
        )
    kept = [f"{r['dataset']} {r['kept_unpaid']:,}" for r in rows[:-1] if r.get("kept_unpaid")]
    if kept:
        lines.append(
            f"Failed, not paid, recorded as failed (generation.unpaid_failures: keep): `snakemake "
            f"--forcerun generate` retries them: {', '.join(kept)}."
        )
    other = [f"{r['dataset']} {r['other_model']:,}" for r in rows[:-1] if r.get("other_model")]
    if other:
        lines.append(
            f"Replies naming another model than asked (kept; generation.reject_other_models: true refuses "
            f"them): {', '.join(other)}."
        )
    pilot = pilot_spend(datasets_config, results_dir)
    if pilot is not None:
        lines.append(
            f"Forecast pilot: {pilot['requests']:,} responses paid for, ${format_usd(pilot['cost_usd'])} "
            "(journaled: the build does not pay for them again; counted in Cost once generate reads them)."
        )
    if not ok:
        import time

        causes = failure_causes(logs_dir, None if run_s is None else time.time() - run_s - 1)
        if causes:
            lines.append("Why (each failed job's error; its log has the details):")
            lines += [f"  {c}" for c in causes]
    if tally_path is not None and Path(tally_path).exists():
        lines.append(
            f"Tokens, rejects by reason, cost by backend: {tally_path} (all reports: {Path(tally_path).parent}/)"
        )
    return "\n".join(lines)
