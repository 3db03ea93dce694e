"""Report stage: DuckDB tallies over the stage parquet files (the seed-style per-dataset table, rejects).

The queries live in ``sql/report_views.sql``, ``sql/tally.sql`` and ``sql/rejects_by_reason.sql`` so a
user can run them by hand in the ``duckdb`` CLI (see each file's header).
"""

from __future__ import annotations

import contextlib
import csv
import io
import ipaddress
import logging
import os
from pathlib import Path
from urllib.parse import urlparse

import duckdb

from . import schemas, sql
from .io import write_text

log = logging.getLogger("eagle3_data.report")

TALLY_COLUMNS = [
    "dataset", "kind", "samples", "prompt_tokens", "completion_tokens", "total_tokens", "source", "backends",
    "rejected", "responses_ok", "responses_failed", "cost_usd",
]
REJECT_COLUMNS = ["dataset", "stage", "reason", "count"]


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


def _register(con, name: str, files: list[str], schema) -> None:
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"report: {name} files not found: {missing[:5]}")
    if files:
        sql.set_variables(con, **{f"{name}_files": files})
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM read_parquet(getvariable('{name}_files'), "
            "union_by_name = true)"
        )
    else:
        con.register(f"_{name}_empty", schemas.empty(schema))
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM _{name}_empty")


def tally(
    validated_paths,
    rejected_paths,
    responses_paths,
    out_dir,
    *,
    datasets_config: dict | None = None,
    backends: dict | None = None,
) -> list[dict]:
    """Per-dataset tally of the build; writes ``out_dir/tally.md``, ``tally.csv`` and ``rejects.csv``.

    Args:
        validated_paths: VALIDATED parquet files (the samples and tokens counted).
        rejected_paths: REJECTS parquet files of any stage (counted per dataset, stage and reason).
        responses_paths: RESPONSES parquet files (responses ok/failed and ``cost_usd`` per dataset).
        out_dir: directory for the three files (each written atomically).
        datasets_config: the config's ``datasets`` mapping; every dataset in it gets a row (zeros when it has
            no data) and one whose ``source.format`` is ``pretokenized`` is listed with the pre-tokenized ones.
        backends: the config's ``backends`` mapping (name -> ``type``, ``base_url``, ``launch``) used to tell
            local from remote (:func:`backend_location`).

    Returns: the table rows (dicts with :data:`TALLY_COLUMNS`): generated datasets, then ``Total generated``,
        then pre-tokenized datasets, ``Total pre-tokenized``, then ``Grand total`` (``kind`` is
        ``generated`` / ``pretokenized`` / ``total``). Token counts: ``completion_tokens`` = supervised
        tokens (loss mask 1), ``prompt_tokens`` = the rest, ``total_tokens`` = their sum.
    """
    datasets_config = datasets_config or {}
    backends = backends or {}
    out_dir = Path(out_dir)
    with contextlib.closing(duckdb.connect()) as con:
        _register(con, "validated", _paths(validated_paths), schemas.VALIDATED)
        _register(con, "rejected", _paths(rejected_paths), schemas.REJECTS)
        _register(con, "responses", _paths(responses_paths), schemas.RESPONSES)
        kinds = [(name, backend_location(cfg)) for name, cfg in sorted(backends.items())]
        con.execute("CREATE OR REPLACE TEMP TABLE backend_kinds (backend VARCHAR, location VARCHAR)")
        if kinds:
            con.executemany("INSERT INTO backend_kinds VALUES (?, ?)", kinds)
        res = con.sql(sql.load("tally"))
        cols = res.columns
        found = {r[0]: dict(zip(cols, r)) for r in res.fetchall()}
        rejects = [dict(zip(REJECT_COLUMNS, r)) for r in con.sql(sql.load("rejects_by_reason")).fetchall()]

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
    rows.append(total("Total generated", generated))
    rows += pretok
    rows.append(total("Total pre-tokenized", pretok))
    rows.append(total("Grand total", generated + pretok))

    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(_csv(rows, TALLY_COLUMNS), out_dir / "tally.csv")
    write_text(_csv(rejects, REJECT_COLUMNS), out_dir / "rejects.csv")
    md = "# Tally\n\n" + format_tally(rows) + "\n\n## Rejects by reason\n\n" + format_rejects(rejects) + "\n"
    write_text(md, out_dir / "tally.md")
    g = rows[-1]
    log.info("tally: %d samples, %d tokens (%d supervised), %d rejected, $%.2f", g["samples"], g["total_tokens"],
             g["completion_tokens"], g["rejected"], g["cost_usd"])
    return rows


def _csv(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def human_tokens(n: int) -> str:
    """``17,012,345 -> "17.0M"``; below a million the exact count with thousands separators."""
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"


def format_tally(rows: list[dict]) -> str:
    """Markdown table of :func:`tally` rows (seed style: dataset, samples, tokens, source), with prompt,
    completion, rejects and cost; totals in bold."""
    head = ["Dataset", "Samples", "Prompt tokens", "Completion tokens", "Tokens", "Source", "Rejected", "Cost $"]
    align = ["---", "--:", "--:", "--:", "--:", "---", "--:", "--:"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        cells = [
            r["dataset"], f"{r['samples']:,}", human_tokens(r["prompt_tokens"]),
            human_tokens(r["completion_tokens"]), human_tokens(r["total_tokens"]),
            r["source"] + (f" ({r['backends']})" if r.get("backends") else ""),
            f"{r['rejected']:,}", f"{r['cost_usd']:.2f}",
        ]
        if r["kind"] == "total":
            cells = [f"**{c}**" if c else "" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_rejects(rejects: list[dict]) -> str:
    """Markdown table of rejects by dataset, stage and reason (``"none"`` when there are none)."""
    if not rejects:
        return "none"
    lines = ["| Dataset | Stage | Reason | Count |", "|---|---|---|--:|"]
    lines += [f"| {r['dataset']} | {r['stage']} | {r['reason']} | {r['count']:,} |" for r in rejects]
    return "\n".join(lines)
