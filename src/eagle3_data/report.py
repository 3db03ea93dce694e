"""Report stage: DuckDB reports over the stage parquet files, as Markdown and CSV under ``results/reports/``.

Reports (file stem: what, named query in ``sql/``):

- ``tally``: the per-dataset table: samples, prompt/completion/total tokens, source
  (local/remote/mixed), pre-tokenized datasets listed apart, totals (``tally.sql``);
- ``rejects``: rejected samples by dataset, stage and reason (``rejects_by_reason.sql``);
- ``cost``: responses, billed tokens and dollars by dataset, backend and provider, $ per million tokens
  (``cost.sql``);
- ``throughput``: completion tokens per minute, cost and the running mean completion length over the
  responses' ``completed_at`` (``throughput.sql``);
- ``limits``: which limit ended each generated dataset, from generate's per-shard summary JSON when present
  (``limits.sql``);
- ``audit``: billed against the target's own token counts per dataset and ids source: completion tokens, and
  the prompt as the target template renders it vs the billed prompt (a gap = the server saw another prompt)
  (``audit.sql``).

Every query reads the views of ``sql/report_views.sql``, so a user can run it by hand in the ``duckdb`` CLI
(see each file's header). :func:`write_reports` writes them all; :func:`tally` only the first two.

Each report is written three ways: CSV (every column, exact values: DuckDB ``COPY``), Markdown (the readable
columns, formatted: ``tabulate``) and HTML (that Markdown rendered by ``markdown-it-py`` into a small
self-contained page, which ``snakemake --report`` shows in its page; a CSV would only be a download there).
"""

from __future__ import annotations

import contextlib
import html
import ipaddress
import logging
import os
import re
from pathlib import Path
from urllib.parse import urlparse

import duckdb
import pyarrow as pa

from . import schemas, sql
from .formatting import format_clock, format_duration, format_usd, human_tokens
from .io import atomic_path, write_text

log = logging.getLogger("eagle3_data.report")

TALLY_COLUMNS = [
    "dataset", "kind", "samples", "prompt_tokens", "completion_tokens", "total_tokens", "source", "backends",
    "rejected", "responses_ok", "responses_failed", "cost_usd",
]
REJECT_COLUMNS = ["dataset", "stage", "reason", "count", "example"]
COST_COLUMNS = [
    "dataset", "backend", "provider", "level", "responses_ok", "responses_failed", "prompt_tokens",
    "completion_tokens", "total_tokens", "cost_usd", "usd_per_m_completion_tokens", "usd_per_m_tokens",
]
THROUGHPUT_COLUMNS = [
    "bucket_start_utc", "minutes_from_start", "responses_ok", "responses_failed", "completion_tokens",
    "completion_tokens_per_min", "cost_usd", "cumulative_completion_tokens", "cumulative_cost_usd",
    "mean_completion_tokens", "cumulative_mean_completion_tokens",
]
LIMIT_COLUMNS = [
    "dataset", "ended_by", "evidence", "shards", "shards_reported", "samples_ok", "responses_failed", "not_sent",
    "over_max_samples", "max_samples", "completion_tokens", "budget_completion_tokens", "cost_usd", "budget_usd",
]
AUDIT_COLUMNS = [
    "dataset", "ids_source", "level", "samples", "completion_billed_samples", "completion_tokens",
    "billed_completion_tokens", "completion_rel", "completion_equal_samples", "prompt_billed_samples",
    "prompt_tokens", "billed_prompt_tokens", "prompt_rel", "prompt_equal_samples", "prompt_diff_median",
    "prompt_diff_min", "prompt_diff_max",
]
#: every output of rule report, the one list (rules/report.smk makes the rule's outputs from it): (rule output
#: name, file name under results/reports/, caption file under report/ or None, report category, labels); a file
#: with a caption is flagged with Snakemake's report() and shown on the `snakemake --report` page
REPORT_STEMS = ("tally", "rejects", "cost", "throughput", "limits", "audit")
PLOT_STEMS = {"lengths": ("lengths", "lengths"), "completion_vs_time": ("completion_vs_time", "completion vs time"),
              "cost_over_time": ("cost_over_time", "cost over time"), "rejects": ("rejects_plot", "rejects")}
RULE_OUTPUTS: list[tuple[str, str, str | None, str | None, dict | None]] = [
    *[(f"{stem}_{ext}", f"{stem}.{ext}", *((f"{stem}.rst", "1. Tables", {"table": stem}) if ext == "html"
                                           else (None, None, None)))
      for stem in REPORT_STEMS for ext in ("md", "csv", "html")],
    *[(f"{stem}_png", f"{stem}.png", f"{caption}.rst", "2. Plots", {"plot": label})
      for stem, (caption, label) in PLOT_STEMS.items()],
    ("front", "front.html", None, None, None),  # tally, cost, rejects on the report page's front (report/workflow.rst)
]
#: every file :func:`write_reports` writes into its ``out_dir`` (the plots are :func:`.plots.write_plots`'s)
REPORT_FILES = [file for _, file, *_ in RULE_OUTPUTS if not file.endswith(".png")]
#: bucket lengths (seconds) the Markdown throughput table may use; the smallest giving <= MAX_MD_BUCKETS rows
MD_BUCKETS_S = [60, 300, 600, 900, 1800, 3600, 7200, 4 * 3600, 6 * 3600, 12 * 3600, 86400]
MAX_MD_BUCKETS = 240
SUMMARY_COLUMNS = {
    "dataset": "VARCHAR", "shard": "VARCHAR", "stopped_by": "VARCHAR", "samples": "BIGINT", "ok": "BIGINT",
    "failed_total": "BIGINT", "not_sent": "BIGINT", "over_max_samples": "BIGINT", "other_model_replies": "BIGINT",
    "filename": "VARCHAR",
}


def backend_location(cfg: dict | None) -> str:
    """``"local"`` or ``"remote"`` for a backend config (``type``, ``base_url``, ``launch``), else ``"unknown"``.

    Local: the build launches it (``launch`` set), or its ``base_url`` host is loopback, private, link-local,
    ``localhost``, ``*.local`` or a bare host name (a cluster node). Remote: ``type: openrouter`` or any other
    host.
    """
    if not cfg:
        return "unknown"
    if cfg.get("launch"):
        return "local"
    if cfg.get("type") == "openrouter":
        return "remote"
    url = str(cfg.get("base_url") or "")
    host = urlparse(url if "//" in url else f"//{url}").hostname or ""
    if not host:
        return "unknown"
    if host == "localhost" or host.endswith(".local") or "." not in host and ":" not in host:
        return "local"
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        return "local" if (ip.is_loopback or ip.is_private or ip.is_link_local) else "remote"
    return "remote"


def _source_label(pretokenized: bool, locations: list[str]) -> str:
    if pretokenized:
        return "Pre-tokenized"
    locs = set(locations)
    if not locs:
        return ""
    if locs == {"local"}:
        return "Local"
    if locs == {"remote"}:
        return "Remote"
    if locs == {"unknown"}:
        return "Unknown"
    return "Mixed"


def _paths(paths) -> list[str]:
    if paths is None:
        return []
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [str(p) for p in paths]


def _view_statements() -> dict[str, str]:
    """The ``CREATE ... VIEW <name>`` statements of ``report_views.sql``, by view name."""
    out = {}
    for stmt in re.split(r";\s*(?:\n|$)", sql.load("report_views")):
        m = re.search(r"CREATE OR REPLACE TEMP VIEW (\w+) AS", stmt)
        if m:
            out[m.group(1)] = stmt[m.start():]
    return out


def _register(con, name: str, files: list[str], schema, *, statements: dict[str, str] | None = None) -> None:
    """View ``name`` over ``files`` (``report_views.sql``'s statement), or an empty table of ``schema``
    (a pyarrow schema, or a ``{column: duckdb type}`` dict) when there are none."""
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"report: {name} files not found: {missing[:5]}")
    if files:
        var = {"shard_summaries": "summary_files"}.get(name, f"{name}_files")
        sql.set_variables(con, **{var: files})
        con.execute((statements or _view_statements())[name])
        if not isinstance(schema, dict):
            _add_missing_columns(con, name, schema)
    elif isinstance(schema, dict):
        cols = ", ".join(f"NULL::{t} AS {c}" for c, t in schema.items())
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT {cols} WHERE false")
    else:
        con.register(f"_{name}_empty", schemas.empty(schema))
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM _{name}_empty")


_DUCKDB_TYPES = {"int64": "BIGINT", "int32": "INTEGER", "int8": "TINYINT", "double": "DOUBLE", "string": "VARCHAR",
                 "bool": "BOOLEAN"}


def _add_missing_columns(con, name: str, schema) -> None:
    """Files written before a column joined the stage's schema (e.g. ``billed_prompt_tokens``) lack it: view
    ``name`` gets it as NULL so every query runs on an older build's files too."""
    have = {r[0] for r in con.execute(f"DESCRIBE {name}").fetchall()}
    add = [f"NULL::{_DUCKDB_TYPES[str(f.type)]} AS {f.name}" for f in schema
           if f.name not in have and str(f.type) in _DUCKDB_TYPES]
    if add:
        con.execute(f"ALTER VIEW {name} RENAME TO _{name}_files")
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT *, {', '.join(add)} FROM _{name}_files")


def _limits_of(datasets_config: dict, generation: dict | None) -> list[tuple]:
    """``dataset_limits`` rows: (dataset, shards, max_samples, budget_completion_tokens, budget_usd)."""
    rows = []
    for name, dcfg in sorted(datasets_config.items()):
        dcfg = dcfg or {}
        if ((dcfg.get("source") or {}).get("format")) == "pretokenized":
            continue
        gen = (generation or {}).get(name)
        if gen is None:
            gen = dcfg.get("generation") or {}
        rows.append((name, int(dcfg.get("shards", 1)), gen.get("max_samples"), gen.get("budget_completion_tokens"),
                     gen.get("budget_usd")))
    return rows


def summary_paths_for(responses_paths) -> list[str]:
    """The generate summary JSON beside each RESPONSES parquet (``<shard>.parquet`` -> ``<shard>.json``) that
    exists; missing ones are skipped (the summary is optional input)."""
    return [str(q) for q in (Path(p).with_suffix(".json") for p in _paths(responses_paths)) if q.is_file()]


def open_report_db(
    validated_paths,
    rejected_paths,
    responses_paths,
    *,
    backends: dict | None = None,
    datasets_config: dict | None = None,
    generation: dict | None = None,
    summary_paths=None,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection holding what every report query reads (``sql/report_views.sql``).

    Views ``validated``, ``rejected``, ``responses`` (over the parquet files; an empty table of the stage's
    schema when a list is empty) and ``shard_summaries`` (generate's per-shard summary JSON files; when
    ``summary_paths`` is None, the ``.json`` beside each responses file that exists); tables ``backend_kinds``
    (backend, location: :func:`backend_location` of each ``backends`` entry) and ``dataset_limits`` (dataset,
    shards, max_samples, budget_completion_tokens, budget_usd: each non-pre-tokenized dataset of
    ``datasets_config``, limits from ``generation[dataset]`` (the merged generation config) or else the
    dataset's own ``generation:``). The caller closes it. Raises ``FileNotFoundError`` naming missing files.
    """
    summary_paths = summary_paths_for(responses_paths) if summary_paths is None else _paths(summary_paths)
    statements = _view_statements()
    con = duckdb.connect()
    try:
        _register(con, "validated", _paths(validated_paths), schemas.VALIDATED, statements=statements)
        _register(con, "rejected", _paths(rejected_paths), schemas.REJECTS, statements=statements)
        _register(con, "responses", _paths(responses_paths), schemas.RESPONSES, statements=statements)
        _register(con, "shard_summaries", summary_paths, SUMMARY_COLUMNS, statements=statements)
        kinds = [(name, backend_location(cfg)) for name, cfg in sorted((backends or {}).items())]
        con.execute("CREATE OR REPLACE TEMP TABLE backend_kinds (backend VARCHAR, location VARCHAR)")
        if kinds:
            con.executemany("INSERT INTO backend_kinds VALUES (?, ?)", kinds)
        con.execute("CREATE OR REPLACE TEMP TABLE dataset_limits (dataset VARCHAR, shards BIGINT, max_samples BIGINT,"
                    " budget_completion_tokens BIGINT, budget_usd DOUBLE)")
        limits = _limits_of(datasets_config or {}, generation)
        if limits:
            con.executemany("INSERT INTO dataset_limits VALUES (?, ?, ?, ?, ?)", limits)
    except BaseException:
        con.close()
        raise
    return con


def query(con, name: str, **variables) -> list[dict]:
    """Run the named query ``sql/<name>.sql`` on ``con`` (after ``SET VARIABLE`` of ``variables``); rows as
    dicts."""
    if variables:
        sql.set_variables(con, **variables)
    res = con.sql(sql.load(name))
    cols = res.columns
    return [dict(zip(cols, r)) for r in res.fetchall()]


def tally(
    validated_paths,
    rejected_paths,
    responses_paths,
    out_dir,
    *,
    datasets_config: dict | None = None,
    backends: dict | None = None,
) -> list[dict]:
    """Per-dataset tally of the build; writes ``out_dir/tally.md``, ``tally.html``, ``tally.csv`` and
    ``rejects.csv``.

    Args:
        validated_paths: VALIDATED parquet files (the samples and tokens counted).
        rejected_paths: REJECTS parquet files of any stage (counted per dataset, stage and reason).
        responses_paths: RESPONSES parquet files (responses ok/failed and ``cost_usd`` per dataset).
        out_dir: directory for the four files (each written atomically).
        datasets_config: the config's ``datasets`` mapping; every dataset in it gets a row (zeros when it has
            no data) and one whose ``source.format`` is ``pretokenized`` is listed with the pre-tokenized ones.
        backends: the config's ``backends`` mapping (name -> ``type``, ``base_url``, ``launch``) used to tell
            local from remote (:func:`backend_location`).

    Returns: the table rows (dicts with :data:`TALLY_COLUMNS`): generated datasets, then ``Total generated``,
        then pre-tokenized datasets, ``Total pre-tokenized``, then ``Grand total`` (``kind`` is
        ``generated`` / ``pretokenized`` / ``total``); a subtotal is left out when there is no dataset of its
        kind (``Grand total`` is always the last row). Token counts: ``completion_tokens`` = supervised
        tokens (loss mask 1), ``prompt_tokens`` = the rest, ``total_tokens`` = their sum.
    """
    datasets_config = datasets_config or {}
    out_dir = Path(out_dir)
    with contextlib.closing(open_report_db(validated_paths, rejected_paths, responses_paths, backends=backends,
                                           summary_paths=[])) as con:
        rows, rejects = _tally_rows(con, datasets_config)
        _write_tally(con, rows, rejects, out_dir)
    return rows


def _tally_rows(con, datasets_config: dict) -> tuple[list[dict], list[dict]]:
    found = {r["dataset"]: r for r in query(con, "tally")}
    rejects = _materialize(con, "report_rejects", "rejects_by_reason")

    names = sorted(set(found) | set(datasets_config))
    generated, pretok = [], []
    for name in names:
        r = found.get(name) or {"samples": 0, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                                "pretokenized_samples": 0, "backends": [], "locations": [], "rejected": 0,
                                "responses_ok": 0, "responses_failed": 0, "cost_usd": 0.0}
        fmt = ((datasets_config.get(name) or {}).get("source") or {}).get("format")
        is_pre = fmt == "pretokenized" or (r["samples"] > 0 and r["pretokenized_samples"] == r["samples"])
        row = {
            "dataset": name,
            "kind": "pretokenized" if is_pre else "generated",
            "samples": int(r["samples"]),
            "prompt_tokens": int(r["prompt_tokens"]),
            "completion_tokens": int(r["completion_tokens"]),
            "total_tokens": int(r["total_tokens"]),
            "source": _source_label(is_pre, list(r["locations"])),
            "backends": ",".join(r["backends"]),
            "rejected": int(r["rejected"]),
            "responses_ok": int(r["responses_ok"]),
            "responses_failed": int(r["responses_failed"]),
            "cost_usd": float(r["cost_usd"]),
        }
        (pretok if is_pre else generated).append(row)

    def total(label: str, rows: list[dict]) -> dict:
        t = {"dataset": label, "kind": "total", "source": "", "backends": ""}
        for c in TALLY_COLUMNS:
            if c not in t:
                t[c] = sum(r[c] for r in rows)
        return t

    rows = list(generated)
    if generated:
        rows.append(total("Total generated", generated))
    rows += pretok
    if pretok:  # no all-zero subtotal when the build has no pre-tokenized dataset
        rows.append(total("Total pre-tokenized", pretok))
    rows.append(total("Grand total", generated + pretok))
    return rows, rejects


def _write_tally(con, rows: list[dict], rejects: list[dict], out_dir: Path) -> None:
    """tally.csv/.md/.html and rejects.csv (``rejects``: the ``report_rejects`` table of :func:`_materialize`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    con.register("report_tally", pa.Table.from_pylist(rows))
    write_csv(con, "report_tally", TALLY_COLUMNS, out_dir / "tally.csv")
    write_csv(con, "report_rejects", REJECT_COLUMNS, out_dir / "rejects.csv")
    md = "# Tally\n\n" + format_tally(rows) + "\n\n## Rejects by reason\n\n" + format_rejects(rejects) + "\n"
    write_markdown(md, out_dir / "tally.md", out_dir / "tally.html", title="Tally")
    g = rows[-1]
    log.info("tally: %d samples, %d tokens (%d supervised), %d rejected, $%s", g["samples"], g["total_tokens"],
             g["completion_tokens"], g["rejected"], format_usd(g["cost_usd"]))


def md_bucket_s(con) -> int:
    """Bucket length (s) for the Markdown throughput table: the smallest of :data:`MD_BUCKETS_S` giving at
    most :data:`MAX_MD_BUCKETS` rows over the responses' ``completed_at`` span."""
    span = con.execute("SELECT coalesce(max(completed_at) - min(completed_at), 0) FROM responses").fetchall()[0][0]
    for b in MD_BUCKETS_S:
        if span / b < MAX_MD_BUCKETS:
            return b
    return MD_BUCKETS_S[-1]


def write_reports(
    validated_paths,
    rejected_paths,
    responses_paths,
    out_dir,
    *,
    datasets_config: dict | None = None,
    backends: dict | None = None,
    generation: dict | None = None,
    summary_paths=None,
) -> dict[str, list[dict]]:
    """Write every report of the build into ``out_dir`` as CSV, Markdown and HTML (:data:`REPORT_FILES`).

    Args:
        validated_paths, rejected_paths, responses_paths: the stage parquet files (as for :func:`tally`).
        out_dir: directory for the files (each written atomically).
        datasets_config: the config's ``datasets`` mapping (rows for datasets with no data; pre-tokenized
            ones apart; shards per dataset for the limits report).
        backends: the config's ``backends`` mapping (local/remote source labels).
        generation: dataset -> its merged generation config (``config.generation_config``); the limits
            report shows ``max_samples``, ``budget_completion_tokens``, ``budget_usd`` from it.
        summary_paths: generate's per-shard summary JSON files; None: the ``.json`` beside each responses
            parquet where it exists.

    Returns: ``{"tally": rows, "rejects": rows, "cost": rows, "throughput": rows (60 s buckets),
        "limits": rows, "audit": rows}``, each row a dict with the columns of the CSV (:data:`TALLY_COLUMNS`,
        :data:`REJECT_COLUMNS`, :data:`COST_COLUMNS`, :data:`THROUGHPUT_COLUMNS`, :data:`LIMIT_COLUMNS`,
        :data:`AUDIT_COLUMNS`).
        Throughput times are UTC; dollars as the backends reported them (0 for local servers).

    Raises: ``FileNotFoundError`` naming missing input files.
    """
    datasets_config = datasets_config or {}
    out_dir = Path(out_dir)
    with contextlib.closing(open_report_db(
        validated_paths, rejected_paths, responses_paths, backends=backends, datasets_config=datasets_config,
        generation=generation, summary_paths=summary_paths,
    )) as con:
        rows, rejects = _tally_rows(con, datasets_config)
        cost = _materialize(con, "report_cost", "cost")
        throughput = _materialize(con, "report_throughput", "throughput", bucket_s=60)
        bucket = md_bucket_s(con)
        throughput_md = throughput if bucket == 60 else query(con, "throughput", bucket_s=bucket)
        limits = _materialize(con, "report_limits", "limits")
        audit = _materialize(con, "report_audit", "audit")
        _write_tally(con, rows, rejects, out_dir)
        for table, columns, stem in (("report_cost", COST_COLUMNS, "cost"),
                                     ("report_throughput", THROUGHPUT_COLUMNS, "throughput"),
                                     ("report_limits", LIMIT_COLUMNS, "limits"), ("report_audit", AUDIT_COLUMNS, "audit")):
            write_csv(con, table, columns, out_dir / f"{stem}.csv")
    pages = {
        "rejects": ("Rejects by dataset, stage and reason", format_rejects(rejects)),
        "cost": ("Cost and tokens by dataset, backend and provider", format_cost(cost)),
        "throughput": (f"Throughput ({format_duration(bucket)} buckets of completed_at, UTC)",
                       format_throughput(throughput_md, bucket)),
        "limits": ("Which limit ended each dataset", format_limits(limits)),
        "audit": ("Token audit: billed counts vs the target's own", format_audit(audit)),
    }
    for stem, (title, table) in pages.items():
        write_markdown(f"# {title}\n\n{table}\n", out_dir / f"{stem}.md", out_dir / f"{stem}.html", title=title)
    write_text(front_page_fragment(out_dir), out_dir / FRONT_PAGE)
    total_audit = audit[-1] if audit else {}
    if total_audit.get("prompt_billed_samples") and \
            total_audit["prompt_equal_samples"] < total_audit["prompt_billed_samples"]:
        log.warning("audit: %d of %d generated samples' rendered prompts differ in length from the billed prompt "
                    "(rendered %d vs billed %d tokens); see %s", total_audit["prompt_billed_samples"]
                    - total_audit["prompt_equal_samples"], total_audit["prompt_billed_samples"],
                    total_audit["prompt_tokens"], total_audit["billed_prompt_tokens"], out_dir / "audit.md")
    total = cost[-1] if cost else {}
    log.info("reports: %d datasets, %d responses, $%s, %d throughput buckets, written to %s",
             sum(r["kind"] != "total" for r in rows),
             (total.get("responses_ok") or 0) + (total.get("responses_failed") or 0),
             format_usd(total.get("cost_usd") or 0.0), len(throughput), out_dir)
    return {"tally": rows, "rejects": rejects, "cost": cost, "throughput": throughput, "limits": limits,
            "audit": audit}


def _materialize(con, table: str, name: str, **variables) -> list[dict]:
    """Run the named query ``sql/<name>.sql`` once into temp table ``table`` (for :func:`write_csv`); its rows
    as dicts, in the query's order."""
    if variables:
        sql.set_variables(con, **variables)
    con.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS {sql.load(name)}")
    res = con.sql(f"SELECT * FROM {table}")
    cols = res.columns
    return [dict(zip(cols, r)) for r in res.fetchall()]


def write_csv(con, source: str, columns: list[str], path) -> None:
    """``COPY`` ``columns`` of DuckDB table/view ``source`` on ``con`` to the CSV file ``path`` (header row;
    NULL = empty field; atomically)."""
    cols = ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
    with atomic_path(path) as tmp:
        target = str(tmp).replace("'", "''")
        con.execute(f"COPY (SELECT {cols} FROM {source}) TO '{target}' (FORMAT csv, HEADER true)")


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
    style = ("<style>.eagle3-front table{border-collapse:collapse;margin:0.5em 0 1.5em}"
             ".eagle3-front th,.eagle3-front td{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             ".eagle3-front td:first-child,.eagle3-front th:first-child{text-align:left}</style>")
    return f'{style}\n<div class="eagle3-front">\n' + "".join(parts) + "</div>\n"


def markdown_page(md: str, title: str) -> str:
    """A self-contained HTML page (no external resource) of the Markdown text ``md`` (CommonMark + pipe
    tables, rendered by ``markdown-it-py``; raw HTML in ``md`` is escaped), titled ``title``."""
    global _MARKDOWN
    if _MARKDOWN is None:
        from markdown_it import MarkdownIt

        _MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
            f"<style>{PAGE_CSS}</style>\n</head>\n<body>\n{_MARKDOWN.render(md)}</body>\n</html>\n")


def write_markdown(md: str, md_path, html_path=None, *, title: str) -> None:
    """Write Markdown ``md`` to ``md_path`` and, when ``html_path`` is given, :func:`markdown_page` of it there
    (each atomically)."""
    write_text(md, md_path)
    if html_path is not None:
        write_text(markdown_page(md, title), html_path)


def format_tally(rows: list[dict]) -> str:
    """Markdown table of :func:`tally` rows (dataset, samples, tokens, source), with prompt,
    completion, rejects and cost; totals in bold."""
    out = [dict(r, source=r["source"] + (f" ({r['backends']})" if r.get("backends") else "")) for r in rows]
    cols = [("dataset", "Dataset", "text"), ("samples", "Samples", ""), ("prompt_tokens", "Prompt tokens", "tok"),
            ("completion_tokens", "Completion tokens", "tok"), ("total_tokens", "Tokens", "tok"),
            ("source", "Source", "text"), ("rejected", "Rejected", ""), ("cost_usd", "Cost $", "usd")]
    return markdown_table(out, cols, bold=lambda r: r["kind"] == "total")


def format_rejects(rejects: list[dict]) -> str:
    """Markdown table of rejects by dataset, stage and reason, with an example detail (``"none"`` when there are
    none)."""
    if not rejects:
        return "none"
    rows = [dict(r, example=" ".join(str(r.get("example") or "").split())) for r in rejects]
    cols = [("dataset", "Dataset", "text"), ("stage", "Stage", "text"), ("reason", "Reason", "text"),
            ("count", "Count", ""), ("example", "Example", "text")]
    return markdown_table(rows, cols)


def _fmt(v, kind: str = "") -> str:
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
        cells = [_fmt(r.get(key), kind).replace("|", "\\|") for key, _, kind in columns]
        body.append([f"**{c}**" if c else "" for c in cells] if bold(r) else cells)
    return tabulate(body, headers=[h for _, h, _ in columns], tablefmt="pipe", disable_numparse=True,
                    colalign=["left" if k == "text" else "right" for _, _, k in columns])


def format_cost(rows: list[dict]) -> str:
    """Markdown table of ``cost.sql`` rows; dataset subtotals and the total in bold."""
    cols = [("dataset", "Dataset", "text"), ("backend", "Backend", "text"), ("provider", "Provider", "text"),
            ("responses_ok", "OK", ""), ("responses_failed", "Failed", ""), ("prompt_tokens", "Prompt tokens", "tok"),
            ("completion_tokens", "Completion tokens", "tok"), ("total_tokens", "Tokens", "tok"),
            ("cost_usd", "Cost $", "usd"), ("usd_per_m_completion_tokens", "$/M completion", "usd"),
            ("usd_per_m_tokens", "$/M tokens", "usd")]
    return markdown_table(rows, cols, bold=lambda r: r["level"] != "detail")


def format_audit(rows: list[dict]) -> str:
    """Markdown table of ``audit.sql`` rows; dataset subtotals and the total in bold. Relative gaps in percent."""
    cols = [("dataset", "Dataset", "text"), ("ids_source", "Ids", "text"), ("samples", "Samples", ""),
            ("completion_tokens", "Completion (ours)", "tok"), ("billed_completion_tokens", "Completion (billed)", "tok"),
            ("completion_rel", "Completion gap", "pct"), ("completion_equal_samples", "Equal", ""),
            ("prompt_tokens", "Prompt (ours)", "tok"), ("billed_prompt_tokens", "Prompt (billed)", "tok"),
            ("prompt_rel", "Prompt gap", "pct"), ("prompt_equal_samples", "Equal", ""),
            ("prompt_diff_median", "Median prompt diff", ""), ("prompt_diff_min", "Min", ""),
            ("prompt_diff_max", "Max", "")]
    return markdown_table(rows, cols, bold=lambda r: r["level"] != "detail")


def format_throughput(rows: list[dict], bucket_s: int = 60) -> str:
    """Markdown table of ``throughput.sql`` rows (``"none"`` without responses)."""
    if not rows:
        return "none (no response has a completion time)"
    cols = [("bucket_start_utc", "Start (UTC)", "text"), ("minutes_from_start", "Minute", ""),
            ("responses_ok", "Responses", ""), ("completion_tokens_per_min", "Completion tokens/min", ""),
            ("cost_usd", "Cost $", "usd"), ("cumulative_completion_tokens", "Cum. completion tokens", "tok"),
            ("cumulative_cost_usd", "Cum. cost $", "usd"),
            ("cumulative_mean_completion_tokens", "Mean completion so far", "")]
    out = [dict(r, bucket_start_utc=str(r["bucket_start_utc"])[:19]) for r in rows]
    return markdown_table(out, cols)


def format_limits(rows: list[dict]) -> str:
    """Markdown table of ``limits.sql`` rows (``"none"`` without generated datasets)."""
    if not rows:
        return "none (no generated dataset)"
    cols = [("dataset", "Dataset", "text"), ("ended_by", "Ended by", "text"), ("evidence", "Evidence", "text"),
            ("samples_ok", "Samples", ""), ("not_sent", "Not sent", ""), ("max_samples", "Max samples", ""),
            ("completion_tokens", "Completion tokens", ""), ("budget_completion_tokens", "Token budget", ""),
            ("cost_usd", "Cost $", "usd"), ("budget_usd", "Budget $", "usd"),
            ("other_model_replies", "Other model", "")]
    return markdown_table(rows, cols)


# ---------------------------------------------------------------------------------------------------
# the run's last lines

RUN_SUMMARY_COLUMNS = [
    ("dataset", "Dataset", "text"), ("shards", "Shards", "text"), ("samples", "Samples", ""), ("ok", "OK", ""),
    ("failed", "Failed", ""), ("not_sent", "Not sent", ""), ("rejected", "Rejected", ""), ("kept", "Kept", ""),
    ("cost_usd", "Cost $", "usd"), ("time", "Time", "text"), ("ended_by", "Ended by", "text"),
]


def _rows_in(paths) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def run_summary_rows(datasets_config: dict, results_dir="results", run_dir=None) -> list[dict]:
    """One row per dataset of the config, from what the run left under ``results_dir``, and a ``Total`` row.

    Only this config's files are read: the shards ``000`` .. ``shards - 1`` of each dataset (files an earlier
    config with more shards left behind are not counted). Per generated shard: generate's summary
    ``<ds>/responses/<shard>.json`` when the shard finished, else (a failed or stopped job) the last snapshot its
    job wrote to the run directory ``run_dir`` (:mod:`eagle3_data.runview`: what it had journaled and paid for);
    ``<ds>/rejected/<shard>.parquet`` (+ ``normalize.parquet``) and ``<ds>/validated/<shard>.parquet`` are
    counted from parquet metadata.

    Returns dicts with dataset, kind (``generated`` / ``pretokenized`` / ``total``), shards (``"1/2"``: shards
    with a summary or a snapshot, of the dataset's ``shards``; ``"-"`` for a pre-tokenized dataset), samples
    (prompts considered by generate; a pre-tokenized dataset: its rows, kept + rejected), ok (samples with every
    response), failed (samples with a failed response or an unusable prompt), not_sent (samples a budget or a
    stop kept from being sent), rejected (rows of every stage's rejects), kept (validated rows), cost_usd (dollars
    of the dataset's journaled responses, earlier runs' included), wall_s (the longest shard's generate time: the
    shards run at once; None without a summary), time (wall_s as ``m:ss``), ended_by (the shards' distinct
    ``stopped_by``; ``stopped`` for a shard that did not finish)."""
    import json

    from .runview import read_snapshots

    results = Path(results_dir)
    snaps = read_snapshots(run_dir) if run_dir is not None else {}
    rows = []
    for ds, dcfg in (datasets_config or {}).items():
        dcfg = dcfg or {}
        pre = ((dcfg.get("source") or {}).get("format")) == "pretokenized"
        n_shards = int(dcfg.get("shards", 1))
        names = [f"{i:03d}" for i in range(n_shards)]
        sums = []
        for shard in names:
            p = results / ds / "responses" / f"{shard}.json"
            s = None
            if p.is_file():
                with contextlib.suppress(OSError, ValueError):
                    s = json.loads(p.read_text())
            snap = snaps.get((ds, shard))
            if snap is not None and (s is None or float(snap.get("updated_at") or 0) > p.stat().st_mtime + 1):
                # this run's job did not finish (or finished without writing its summary): what it journaled
                s = {"samples": snap.get("total"), "ok": snap.get("ok"), "failed_total": snap.get("failed"),
                     "other_model_replies": snap.get("other_model"),
                     "not_sent": int(snap.get("total") or 0) - int(snap.get("done") or 0),
                     "total_cost_usd": snap.get("spent_usd"), "wall_s": snap.get("elapsed_s"),
                     "stopped_by": "stopped" if not snap.get("final") or not p.is_file() else None}
            if s is not None:
                sums.append(s)
        rejected_paths = [p for p in [results / ds / "rejected" / "normalize.parquet"]
                          + [results / ds / "rejected" / f"{s}.parquet" for s in names] if p.is_file()]
        rejected = _rows_in(rejected_paths)
        kept = _rows_in([p for p in (results / ds / "validated" / f"{s}.parquet" for s in names) if p.is_file()])
        walls = [float(s.get("wall_s") or 0.0) for s in sums]
        ended = sorted({str(s.get("stopped_by")) for s in sums if s.get("stopped_by")})
        row = {
            "dataset": ds, "kind": "pretokenized" if pre else "generated",
            "shards": "-" if pre else f"{len(sums)}/{n_shards}",
            "samples": kept + rejected if pre else sum(int(s.get("samples") or 0) for s in sums),
            "ok": None if pre else sum(int(s.get("ok") or 0) for s in sums),
            "failed": None if pre else sum(int(s.get("failed_total") or 0) for s in sums),
            "not_sent": None if pre else sum(int(s.get("not_sent") or 0) for s in sums),
            "rejected": rejected, "kept": kept,
            "cost_usd": None if pre else sum(float(s.get("total_cost_usd") or 0.0) for s in sums),
            "wall_s": max(walls) if walls else None,
            "ended_by": "pre-tokenized" if pre else ", ".join(ended),
            "other_model": None if pre else sum(int(s.get("other_model_replies") or 0) for s in sums),
        }
        row["time"] = format_clock(row["wall_s"]) if row["wall_s"] is not None else ""
        rows.append(row)
    total = {"dataset": "Total", "kind": "total", "shards": "", "ended_by": "", "time": "", "wall_s": None}
    for key in ("samples", "ok", "failed", "not_sent", "rejected", "kept", "cost_usd"):
        vals = [r[key] for r in rows if r[key] is not None]
        total[key] = sum(vals) if vals else None
    rows.append(total)
    return rows


def pilot_spend(datasets_config: dict, results_dir="results") -> dict | None:
    """What the forecast pilot (``snakemake forecast``) paid for, from its summaries
    ``<results_dir>/forecast/pilot/<ds>/<shard>.json`` of this config's shards: ``{"requests": new responses,
    "cost_usd": their dollars}``; None when there are none."""
    import json

    requests, cost, found = 0, 0.0, False
    for ds, dcfg in (datasets_config or {}).items():
        for i in range(int((dcfg or {}).get("shards", 1))):
            p = Path(results_dir) / "forecast" / "pilot" / ds / f"{i:03d}.json"
            with contextlib.suppress(OSError, ValueError):
                s = json.loads(p.read_text())
                found = True
                requests += int(s.get("ok") or 0) - int(s.get("from_journal") or 0)
                cost += float(s.get("cost_usd") or 0.0)
    return {"requests": max(0, requests), "cost_usd": cost} if found else None


def run_summary(datasets_config: dict, results_dir="results", *, run_s: float | None = None,
                ok: bool = True, tally_path=None, run_dir=None) -> str:
    """The run's last lines (Snakefile ``onsuccess`` / ``onerror``): a table of :func:`run_summary_rows` and where
    the full reports are.

    ``run_s``: the run's wall time (the Total row's time); ``ok``: False after a failed run (the title says what
    the table covers); ``tally_path``: the tally file to point to, when it exists; ``run_dir``: the run's
    directory (snapshots of the shards that did not finish, :func:`run_summary_rows`)."""
    from tabulate import tabulate

    rows = run_summary_rows(datasets_config, results_dir, run_dir)
    if run_s is not None:
        rows[-1]["time"] = format_clock(run_s)
    body = [[_fmt(r.get(key), kind) for key, _, kind in RUN_SUMMARY_COLUMNS] for r in rows]
    table = tabulate(body, headers=[h for _, h, _ in RUN_SUMMARY_COLUMNS], tablefmt="simple", disable_numparse=True,
                     colalign=["left" if k == "text" else "right" for _, _, k in RUN_SUMMARY_COLUMNS])
    lines = ["Run summary" if ok else "Run summary (the run failed; what it had finished):", table,
             "OK/Failed/Not sent: samples at generate (not sent: kept back by a budget or a stop). Rejected: every "
             "stage. Kept: validated. Cost: journaled responses. Time: the longest generate shard"
             + ("; Total: the run." if run_s is not None else ".")]
    other = [f"{r['dataset']} {r['other_model']:,}" for r in rows[:-1] if r.get("other_model")]
    if other:
        lines.append(f"Replies naming another model than asked (kept; generation.reject_other_models: true refuses "
                     f"them): {', '.join(other)}.")
    pilot = pilot_spend(datasets_config, results_dir)
    if pilot is not None:
        lines.append(f"Forecast pilot: {pilot['requests']:,} responses paid for, ${format_usd(pilot['cost_usd'])} "
                     "(journaled: the build does not pay for them again; counted in Cost once generate reads them).")
    if tally_path is not None and Path(tally_path).exists():
        lines.append(f"Tokens, rejects by reason, cost by backend: {tally_path} (all reports: "
                     f"{Path(tally_path).parent}/)")
    return "\n".join(lines)
