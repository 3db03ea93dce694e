"""The report database: an in-memory DuckDB connection with views over the stage parquet files
(``sql/report_views.sql``), the named queries of ``sql/`` run on it, and CSV output by DuckDB ``COPY``."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from pathlib import Path
from urllib.parse import urlparse

import duckdb

from .. import schemas, sql
from ..config.lookup import shards_of
from ..files import atomic_path


SUMMARY_COLUMNS = {
    "dataset": "VARCHAR",
    "shard": "VARCHAR",
    "stopped_by": "VARCHAR",
    "samples": "BIGINT",
    "ok": "BIGINT",
    "failed_total": "BIGINT",
    "not_sent": "BIGINT",
    "over_max_samples": "BIGINT",
    "other_model_replies": "BIGINT",
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
            out[m.group(1)] = stmt[m.start() :]
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


_DUCKDB_TYPES = {
    "int64": "BIGINT",
    "int32": "INTEGER",
    "int8": "TINYINT",
    "double": "DOUBLE",
    "string": "VARCHAR",
    "bool": "BOOLEAN",
}


def _add_missing_columns(con, name: str, schema) -> None:
    """Files written before a column joined the stage's schema (e.g. ``billed_prompt_tokens``) lack it: view
    ``name`` gets it as NULL so every query runs on an older build's files too."""
    have = {r[0] for r in con.execute(f"DESCRIBE {name}").fetchall()}
    add = [
        f"NULL::{_DUCKDB_TYPES[str(f.type)]} AS {f.name}"
        for f in schema
        if f.name not in have and str(f.type) in _DUCKDB_TYPES
    ]
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
        rows.append(
            (
                name,
                shards_of(dcfg),
                gen.get("max_samples"),
                gen.get("budget_completion_tokens"),
                gen.get("budget_usd"),
            )
        )
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
        con.execute(
            "CREATE OR REPLACE TEMP TABLE dataset_limits (dataset VARCHAR, shards BIGINT, max_samples BIGINT,"
            " budget_completion_tokens BIGINT, budget_usd DOUBLE)"
        )
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


def materialize(con, table: str, name: str, **variables) -> list[dict]:
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
