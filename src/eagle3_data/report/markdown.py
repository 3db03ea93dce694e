"""The reports' Markdown tables (``tabulate``) and HTML pages (``markdown-it-py``), and the report page's front."""

from __future__ import annotations

import html
import re
from pathlib import Path

from ..formatting import format_usd, human_tokens
from ..files import write_text


_MARKDOWN = None
PAGE_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 1rem 1.25rem; }
h1 { font-size: 1.3rem; margin: 0 0 .75rem; } h2 { font-size: 1.1rem; margin: 1.5rem 0 .5rem; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin-bottom: 1rem; }
th, td { border: 1px solid #d0d7de; padding: .25rem .6rem; white-space: nowrap; }
th { background: #f6f8fa; position: sticky; top: 0; }
tbody tr:nth-child(even) { background: #f9fafb; }
code { font-size: 90%; background: #f6f8fa; padding: 0 .2rem; border-radius: 3px; }
"""
#: the report page's front (report/workflow.rst shows it): tally, cost and rejects as one HTML fragment
FRONT_PAGE = "front.html"
FRONT_STEMS = ("tally", "cost", "rejects")
#: the front's style. The tables' own look, then the page's layout around them: Snakemake's report shows the
#: description in a box 32rem wide (``prose max-w-lg``) beside the rule graph, in a pane that centres its content
#: vertically (``items-center``). The tables are wider than that box, so the graph was drawn over their right
#: columns, and a description taller (or wider) than the window lost its top (or left) edge outside the pane's
#: scroll range. The rules below (``:has()``: they apply only to the page that holds this fragment) let the box be
#: as wide as its tables (its paragraphs keep a readable width), wrap the graph below the description when both
#: don't fit side by side, and start the pane at its top left. tests/workflow/test_report_page.py measures the
#: result in headless Chromium.
FRONT_CSS = (
    ".eagle3-front table{border-collapse:collapse;margin:0.5em 0 1.5em;width:auto}"
    ".eagle3-front th,.eagle3-front td{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    ".eagle3-front td:first-child,.eagle3-front th:first-child{text-align:left}"
    ".prose:has(.eagle3-front){max-width:none}"
    ".prose:has(.eagle3-front) p{max-width:48rem}"
    "div.flex:has(>div>.prose .eagle3-front){flex-wrap:wrap}"
    "div.overflow-auto:has(.eagle3-front){align-items:flex-start;justify-content:flex-start}"
)


def front_page_fragment(out_dir) -> str:
    """The HTML fragment (no ``<html>``/``<body>``) of ``out_dir``'s tally, cost and rejects Markdown tables,
    each under its title, for the front of ``snakemake --report``'s page. Raises ``FileNotFoundError`` when
    one of the three ``.md`` files is missing."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    parts = []
    for stem in FRONT_STEMS:
        text = (Path(out_dir) / f"{stem}.md").read_text()
        parts.append(md.render(re.sub(r"(?m)^# ", "### ", text)))
    return f'<style>{FRONT_CSS}</style>\n<div class="eagle3-front">\n' + "".join(parts) + "</div>\n"


def markdown_page(md: str, title: str) -> str:
    """A self-contained HTML page (no external resource) of the Markdown text ``md`` (CommonMark + pipe
    tables, rendered by ``markdown-it-py``; raw HTML in ``md`` is escaped), titled ``title``."""
    global _MARKDOWN
    if _MARKDOWN is None:
        from markdown_it import MarkdownIt

        _MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
        f"<style>{PAGE_CSS}</style>\n</head>\n<body>\n{_MARKDOWN.render(md)}</body>\n</html>\n"
    )


def write_markdown(md: str, md_path, html_path=None, *, title: str) -> None:
    """Write Markdown ``md`` to ``md_path`` and, when ``html_path`` is given, :func:`markdown_page` of it there
    (each atomically)."""
    write_text(md, md_path)
    if html_path is not None:
        write_text(markdown_page(md, title), html_path)


def format_tally(rows: list[dict]) -> str:
    """Markdown table of :func:`tally` rows (dataset, samples, tokens, source), with prompt,
    completion, rejects and cost; totals in bold. The source names the backends, except for a dataset trained on
    its own answers (``Original answers``: no backend answered)."""
    out = [
        dict(r, source=r["source"] + (f" ({r['backends']})" if r.get("backends") and r["kind"] != "original" else ""))
        for r in rows
    ]
    cols = [
        ("dataset", "Dataset", "text"),
        ("samples", "Samples", ""),
        ("prompt_tokens", "Prompt tokens", "tok"),
        ("completion_tokens", "Completion tokens", "tok"),
        ("total_tokens", "Tokens", "tok"),
        ("source", "Source", "text"),
        ("rejected", "Rejected", ""),
        ("cost_usd", "Cost $", "usd"),
    ]
    return markdown_table(out, cols, bold=lambda r: r["kind"] == "total")


def format_rejects(rejects: list[dict]) -> str:
    """Markdown table of rejects by dataset, stage and reason, with an example detail (``"none"`` when there are
    none)."""
    if not rejects:
        return "none"
    rows = [dict(r, example=" ".join(str(r.get("example") or "").split())) for r in rejects]
    cols = [
        ("dataset", "Dataset", "text"),
        ("stage", "Stage", "text"),
        ("reason", "Reason", "text"),
        ("count", "Count", ""),
        ("example", "Example", "text"),
    ]
    return markdown_table(rows, cols)


def fmt(v, kind: str = "") -> str:
    if v is None:
        return ""
    if kind == "usd":
        return format_usd(v)
    if kind == "tok":
        return human_tokens(int(v))
    if kind == "pct":
        return f"{100 * v:+.2f}%"
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]], *, bold=lambda r: False) -> str:
    """Markdown (pipe) table of ``rows`` by ``tabulate``; ``columns`` = (key, header, kind) with kind ``""``
    (plain), ``"tok"`` (:func:`human_tokens`), ``"usd"`` (:func:`format_usd`), ``"pct"`` (a ratio as a signed
    percentage), ``"text"`` (left-aligned; the others are right-aligned); ``bold(row)`` marks summary rows."""
    from tabulate import tabulate

    body = []
    for r in rows:
        cells = [fmt(r.get(key), kind).replace("|", "\\|") for key, _, kind in columns]
        body.append([f"**{c}**" if c else "" for c in cells] if bold(r) else cells)
    return tabulate(
        body,
        headers=[h for _, h, _ in columns],
        tablefmt="pipe",
        disable_numparse=True,
        colalign=["left" if k == "text" else "right" for _, _, k in columns],
    )


def format_cost(rows: list[dict]) -> str:
    """Markdown table of ``cost.sql`` rows; dataset subtotals and the total in bold."""
    cols = [
        ("dataset", "Dataset", "text"),
        ("backend", "Backend", "text"),
        ("provider", "Provider", "text"),
        ("responses_ok", "OK", ""),
        ("responses_failed", "Failed", ""),
        ("prompt_tokens", "Prompt tokens", "tok"),
        ("completion_tokens", "Completion tokens", "tok"),
        ("total_tokens", "Tokens", "tok"),
        ("cost_usd", "Cost $", "usd"),
        ("usd_per_m_completion_tokens", "$/M completion", "usd"),
        ("usd_per_m_tokens", "$/M tokens", "usd"),
    ]
    return markdown_table(rows, cols, bold=lambda r: r["level"] != "detail")


def format_audit(rows: list[dict]) -> str:
    """Markdown table of ``audit.sql`` rows; dataset subtotals and the total in bold. Relative gaps in percent."""
    cols = [
        ("dataset", "Dataset", "text"),
        ("ids_source", "Ids", "text"),
        ("samples", "Samples", ""),
        ("completion_tokens", "Completion (ours)", "tok"),
        ("billed_completion_tokens", "Completion (billed)", "tok"),
        ("completion_rel", "Completion gap", "pct"),
        ("completion_equal_samples", "Equal", ""),
        ("prompt_tokens", "Prompt (ours)", "tok"),
        ("billed_prompt_tokens", "Prompt (billed)", "tok"),
        ("prompt_rel", "Prompt gap", "pct"),
        ("prompt_equal_samples", "Equal", ""),
        ("prompt_diff_median", "Median prompt diff", ""),
        ("prompt_diff_min", "Min", ""),
        ("prompt_diff_max", "Max", ""),
    ]
    return markdown_table(rows, cols, bold=lambda r: r["level"] != "detail")


def format_throughput(rows: list[dict], bucket_s: int = 60) -> str:
    """Markdown table of ``throughput.sql`` rows (``"none"`` without responses)."""
    if not rows:
        return "none (no response has a completion time)"
    cols = [
        ("bucket_start_utc", "Start (UTC)", "text"),
        ("minutes_from_start", "Minute", ""),
        ("responses_ok", "Responses", ""),
        ("completion_tokens_per_min", "Completion tokens/min", ""),
        ("cost_usd", "Cost $", "usd"),
        ("cumulative_completion_tokens", "Cum. completion tokens", "tok"),
        ("cumulative_cost_usd", "Cum. cost $", "usd"),
        ("cumulative_mean_completion_tokens", "Mean completion so far", ""),
    ]
    out = [dict(r, bucket_start_utc=str(r["bucket_start_utc"])[:19]) for r in rows]
    return markdown_table(out, cols)


def format_limits(rows: list[dict]) -> str:
    """Markdown table of ``limits.sql`` rows (``"none"`` without generated datasets)."""
    if not rows:
        return "none (no generated dataset)"
    cols = [
        ("dataset", "Dataset", "text"),
        ("ended_by", "Ended by", "text"),
        ("evidence", "Evidence", "text"),
        ("samples_ok", "Samples", ""),
        ("not_sent", "Not sent", ""),
        ("max_samples", "Max samples", ""),
        ("completion_tokens", "Completion tokens", ""),
        ("budget_completion_tokens", "Token budget", ""),
        ("cost_usd", "Cost $", "usd"),
        ("budget_usd", "Budget $", "usd"),
        ("other_model_replies", "Other model", ""),
    ]
    return markdown_table(rows, cols)
