"""Report plots (matplotlib, Agg, PNG) over the stage parquet files, for ``results/reports/``.

Plots (file: what; data from the named query in ``sql/``):

- ``lengths.png``: prompt and completion length distributions per dataset (``lengths.sql``: tokens per
  validated sample, prompt = loss mask 0, completion = loss mask 1);
- ``completion_vs_time.png``: completion length of every response against its completion time, with each
  dataset's running mean completion length (``timeline.sql``). Short completions finish first, so the running
  mean climbs as the long requests come in (a budget reached early keeps the short ones, e.g. a SWE-agent
  dataset with long trajectories);
- ``cost_over_time.png``: cumulative dollars per dataset and in total, and completion tokens per minute
  (``timeline.sql``);
- ``rejects.png``: rejected samples by reason, stacked by stage (``rejects_by_reason.sql``).

Every function draws on its own ``matplotlib.figure.Figure`` (no pyplot state, Agg canvas) and writes its PNG
atomically. An empty input still gives a PNG that says there is no data.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from ..files import atomic_path
from . import PLOT_STEMS, open_report_db, query

log = logging.getLogger("eagle3_data.report.plots")

PLOT_FILES = [f"{stem}.png" for stem in PLOT_STEMS]
DPI = 100
#: throughput bin lengths (seconds): the smallest giving at most MAX_BINS bars
BINS_S = [1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400]
MAX_BINS = 300


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, bbox_inches="tight")
    return path


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _colors(names: list[str]) -> dict[str, tuple]:
    cmap = colormaps["tab10"]
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def plot_lengths(rows: list[dict], path) -> Path:
    """Box plots (log scale) of prompt and completion tokens per dataset (:func:`lengths_figure`); write PNG
    ``path``."""
    return _save(lengths_figure(rows), path)


def lengths_figure(rows: list[dict]) -> Figure:
    """The figure of ``lengths.png``: box plots (log scale) of prompt and completion tokens per dataset, side by
    side under one title; constrained layout, so the title, the panels' titles and the labels never overlap.

    ``rows``: dicts with ``dataset``, ``prompt_tokens``, ``completion_tokens`` (one per sample, as
    ``lengths.sql`` returns). Each dataset's label gives its sample count and median lengths.
    """
    by: dict[str, tuple[list, list]] = {}
    for r in rows:
        p, c = by.setdefault(r["dataset"], ([], []))
        p.append(int(r["prompt_tokens"]))
        c.append(int(r["completion_tokens"]))
    names = sorted(by)
    fig = Figure(figsize=(11, max(3.0, 0.45 * len(names) + 1.8)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    fig.suptitle("Length distributions per dataset (validated samples)")
    if not names:
        for ax in axes:
            _no_data(ax, "no validated samples")
        return fig
    for ax, idx, title in (
        (axes[0], 0, "Prompt tokens (loss mask 0)"),
        (axes[1], 1, "Completion tokens (loss mask 1)"),
    ):
        data = [np.maximum(np.asarray(by[n][idx]), 1) for n in names]
        ax.boxplot(
            data, orientation="horizontal", showfliers=True, widths=0.6, flierprops={"markersize": 2, "alpha": 0.4}
        )
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("tokens per sample (log)")
        ax.grid(axis="x", alpha=0.3)
        for i, d in enumerate(data, start=1):
            ax.annotate(
                f"median {int(np.median(d)):,}", (float(np.median(d)), i + 0.33), fontsize=7, ha="center", color="0.3"
            )
    axes[0].set_yticks(range(1, len(names) + 1), [f"{n} (n={len(by[n][0]):,})" for n in names])
    return fig


def _running_mean(values: np.ndarray) -> np.ndarray:
    return np.cumsum(values) / np.arange(1, len(values) + 1) if len(values) else values


def plot_completion_vs_time(rows: list[dict], path) -> Path:
    """Scatter of completion tokens against completion time (minutes from the first response), one colour per
    dataset, with each dataset's running mean completion length; write PNG ``path``.

    ``rows``: dicts with ``dataset``, ``status``, ``minutes_from_start``, ``completion_tokens`` in completion
    order (``timeline.sql``); only ``ok`` responses are drawn.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    fig = Figure(figsize=(11, 5.5))
    ax = fig.subplots()
    if not ok:
        _no_data(ax, "no completed responses")
        return _save(fig, path)
    names = sorted({r["dataset"] for r in ok})
    colors = _colors(names)
    for n in names:
        t = np.array([r["minutes_from_start"] for r in ok if r["dataset"] == n], dtype=float)
        c = np.array([r["completion_tokens"] for r in ok if r["dataset"] == n], dtype=float)
        ax.scatter(t, c, s=max(3.0, min(16.0, 20000 / len(ok))), alpha=0.45, color=colors[n], linewidths=0)
        m = _running_mean(c)
        ax.plot(
            t, m, color=colors[n], linewidth=2, label=f"{n}: mean {m[0]:,.0f} -> {m[-1]:,.0f} tokens (n={len(c):,})"
        )
    ax.set_xlabel("completion time (minutes from the first response)")
    ax.set_ylabel("completion tokens (dots); running mean (lines)")
    ax.set_yscale("symlog", linthresh=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Completion length against completion time (running mean per dataset)")
    return _save(fig, path)


def plot_cost_over_time(rows: list[dict], path) -> Path:
    """Two panels against minutes from the first response: cumulative dollars per dataset and in total, and
    completion tokens per minute (all datasets); write PNG ``path``.

    ``rows``: as for :func:`plot_completion_vs_time` plus ``cost_usd`` (failed responses count in dollars).
    """
    fig = Figure(figsize=(11, 7), layout="constrained")  # the suptitle above the panels, not on them
    ax_cost, ax_tpm = fig.subplots(2, 1, sharex=True)
    if not rows:
        _no_data(ax_cost, "no responses with a completion time")
        _no_data(ax_tpm, "")
        return _save(fig, path)
    t = np.array([r["minutes_from_start"] for r in rows], dtype=float)
    cost = np.array([r["cost_usd"] for r in rows], dtype=float)
    names = sorted({r["dataset"] for r in rows})
    colors = _colors(names)
    for n in names:
        sel = np.array([r["dataset"] == n for r in rows])
        ax_cost.step(t[sel], np.cumsum(cost[sel]), where="post", color=colors[n], label=n)
    ax_cost.step(t, np.cumsum(cost), where="post", color="black", linewidth=2, label=f"total ${cost.sum():,.2f}")
    ax_cost.set_ylabel("cumulative cost (USD)")
    ax_cost.grid(alpha=0.3)
    ax_cost.legend(fontsize=8, loc="upper left")
    if cost.sum() == 0:
        ax_cost.text(
            0.5,
            0.75,
            "no cost reported (local backends)",
            ha="center",
            va="center",
            transform=ax_cost.transAxes,
            color="0.4",
        )
    ok = np.array([r["status"] == "ok" for r in rows])
    tok = np.array([r["completion_tokens"] for r in rows], dtype=float) * ok
    bin_s = next((b for b in BINS_S if t.max() * 60 / b <= MAX_BINS), BINS_S[-1])
    idx = np.floor(t * 60 / bin_s).astype(int)
    per_min = np.bincount(idx, weights=tok) * 60 / bin_s
    ax_tpm.bar((np.arange(len(per_min)) + 0.5) * bin_s / 60, per_min, width=bin_s / 60, color="tab:blue", alpha=0.7)
    ax_tpm.set_title(f"completion tokens per minute, in {bin_s:g} s bins", fontsize=9)
    ax_tpm.set_ylabel("completion tokens per minute")
    ax_tpm.set_xlabel("minutes from the first response")
    ax_tpm.grid(alpha=0.3)
    fig.suptitle(f"Cost and throughput over time ({int(ok.sum()):,} responses, {int(tok.sum()):,} completion tokens)")
    return _save(fig, path)


def plot_rejects(rows: list[dict], path) -> Path:
    """Horizontal bars of rejected samples by reason (all datasets), stacked by stage; write PNG ``path``.

    ``rows``: dicts with ``dataset``, ``stage``, ``reason``, ``count`` (``rejects_by_reason.sql``).
    """
    totals: dict[str, int] = {}
    by_stage: dict[tuple[str, str], int] = {}
    for r in rows:
        totals[r["reason"]] = totals.get(r["reason"], 0) + int(r["count"])
        key = (r["stage"], r["reason"])
        by_stage[key] = by_stage.get(key, 0) + int(r["count"])
    reasons = sorted(totals, key=lambda k: (totals[k], k))
    fig = Figure(figsize=(10, max(3.0, 0.35 * len(reasons) + 1.5)))
    ax = fig.subplots()
    if not reasons:
        _no_data(ax, "no rejected samples")
        return _save(fig, path)
    stages = sorted({s for s, _ in by_stage})
    colors = _colors(stages)
    left = np.zeros(len(reasons))
    for s in stages:
        w = np.array([by_stage.get((s, r), 0) for r in reasons], dtype=float)
        ax.barh(reasons, w, left=left, color=colors[s], label=s)
        left += w
    for i, r in enumerate(reasons):
        ax.annotate(f"{totals[r]:,}", (left[i], i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlabel("rejected samples")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(title="stage", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"Rejects by reason ({sum(totals.values()):,} samples)")
    return _save(fig, path)


def write_plots(
    validated_paths,
    rejected_paths,
    responses_paths,
    out_dir,
) -> dict[str, Path]:
    """Draw every report plot (:data:`PLOT_FILES`) into ``out_dir``; return ``{file name: path}``.

    Inputs as for :func:`eagle3_data.report.write_reports` (VALIDATED, REJECTS, RESPONSES parquet files).
    Raises ``FileNotFoundError`` naming missing input files.
    """
    out_dir = Path(out_dir)
    with contextlib.closing(open_report_db(validated_paths, rejected_paths, responses_paths, summary_paths=[])) as con:
        lengths = query(con, "lengths")
        timeline = query(con, "timeline")
        rejects = query(con, "rejects_by_reason")
    out = {
        "lengths.png": plot_lengths(lengths, out_dir / "lengths.png"),
        "completion_vs_time.png": plot_completion_vs_time(timeline, out_dir / "completion_vs_time.png"),
        "cost_over_time.png": plot_cost_over_time(timeline, out_dir / "cost_over_time.png"),
        "rejects.png": plot_rejects(rejects, out_dir / "rejects.png"),
    }
    log.info("plots: %s written to %s", ", ".join(out), out_dir)
    return out
