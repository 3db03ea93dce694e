"""Rule provenance: where every merged row came from (``results/merged/provenance.parquet``) and what built the set
(``results/reports/provenance.json``).

One row per row of the merged set (the training shards in order, then the held-out file), :data:`PROVENANCE`:

- ``set`` (``train`` | ``heldout``), ``merged_file`` and ``row`` (0-based) in it, ``index``: the row's index in its
  set, i.e. the number in the exported file names (SpecForge ``data_{index}.ckpt``, speculators
  ``hs_{index}.safetensors``; the held-out set counts from 0 in ``results/export/heldout/``);
- ``sample_id``, ``dataset``; ``source_path``, ``source_format`` and ``source_row`` (0-based record of the source
  file, blank JSONL lines not counted: the JSONL line is ``source_row + 1`` when the file has no blank line; null
  for a pre-tokenized dataset, whose rows carry no source row);
- ``target_fingerprint`` (:func:`eagle3_data.extract.model.model_fingerprint` of ``target.path``: ``config.json``
  and the weight files' names, sizes and ends) and ``chat_template_sha256`` (the target's chat template text, as
  tokenize rendered the prompts with);
- from the reply (the RESPONSES row the sample was tokenized from): ``backend``, ``engine`` (the backend's
  ``type``: ``openai``, ``openrouter``, ``sglang``, ...), ``engine_version`` (the server's ``system_fingerprint``
  when it sent one), ``model`` and ``provider`` as the reply named them, ``request_key`` (the journal record's key:
  ``<cache_dir>/journal/<dataset>/*.jsonl``), ``generation_id``, ``cost_usd``, ``attempts``, ``completed_at``;
- ``sampling``: JSON of the request's sampling settings (``temperature``, ``top_p``, ``max_tokens``, the dataset's
  ``extra_body`` and the backend's own ``extra_body``); null for ``answers: original`` rows (backend ``original``,
  nothing sent) and pre-tokenized rows.

A merged ``sample_id`` is the responses row's, or ``<sample_id>@<turn>`` where a shard holds several turns of one
sample (``generation.mode: all``), as tokenize names it.

``provenance.json``: the config's digest (sha256 of its JSON, keys sorted), the versions of the packages that
shape the data, the repository's commit (``git rev-parse HEAD``; null outside a git checkout, with ``dirty``
saying whether tracked files differ from it), the target, per dataset its source and sampling, the decontaminate
settings in force with each benchmark file's sha256, and the row counts. It is written when the rule runs: a
commit made since, that changed nothing the build reran, is not in it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from . import sql
from .files import write_json, write_parquet

log = logging.getLogger("eagle3_data.provenance")

PROVENANCE = pa.schema(
    [
        ("set", pa.string()),
        ("merged_file", pa.string()),
        ("row", pa.int64()),
        ("index", pa.int64()),
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source_path", pa.string()),
        ("source_format", pa.string()),
        ("source_row", pa.int64()),
        ("target_fingerprint", pa.string()),
        ("chat_template_sha256", pa.string()),
        ("backend", pa.string()),
        ("engine", pa.string()),
        ("engine_version", pa.string()),
        ("model", pa.string()),
        ("provider", pa.string()),
        ("sampling", pa.string()),
        ("request_key", pa.string()),
        ("generation_id", pa.string()),
        ("cost_usd", pa.float64()),
        ("attempts", pa.int32()),
        ("completed_at", pa.float64()),
    ]
)

#: the provenance columns a trainer's side table gets (export: speculators' samples_*.parquet)
SIDE_COLUMNS = [n for n in PROVENANCE.names if n not in ("set", "merged_file", "row", "index", "sample_id", "dataset")]

#: the distributions whose versions shape the data (provenance.json)
PACKAGES = (
    "eagle3-data",
    "snakemake",
    "transformers",
    "tokenizers",
    "torch",
    "safetensors",
    "pyarrow",
    "duckdb",
    "datasketch",
    "datasets",
    "jinja2",
    "numpy",
)


def chat_template_sha256(model_path) -> str | None:
    """sha256 of the target's chat template text: ``chat_template.jinja`` in ``model_path``, else
    ``tokenizer_config.json``'s ``chat_template`` (a named list: its JSON); None without one."""
    d = Path(model_path)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return hashlib.sha256(jinja.read_bytes()).hexdigest()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        try:
            tpl = json.loads(cfg.read_text()).get("chat_template")
        except ValueError:
            tpl = None
        if tpl:
            text = tpl if isinstance(tpl, str) else json.dumps(tpl, sort_keys=True)
            return hashlib.sha256(text.encode()).hexdigest()
    return None


def config_digest(config: dict) -> str:
    """sha256 of the config's JSON (keys sorted)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def package_versions(names: Sequence[str] = PACKAGES) -> dict:
    """``{distribution: version or None}`` of ``names``, and ``python``."""
    out = {"python": sys.version.split()[0]}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def repository_commit(cwd=".") -> dict:
    """``{"commit", "dirty"}`` of the git checkout at ``cwd`` (``git rev-parse HEAD``; dirty: tracked files differ
    from it); both None outside a git checkout or without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        diff = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return {"commit": head.stdout.strip(), "dirty": bool(diff.stdout.strip()) if diff.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _sampling(generation: dict, backend: dict) -> str:
    return json.dumps(
        {
            "temperature": generation.get("temperature"),
            "top_p": generation.get("top_p"),
            "max_tokens": generation.get("max_tokens"),
            "extra_body": generation.get("extra_body") or {},
            "backend_extra_body": (backend or {}).get("extra_body") or {},
        },
        sort_keys=True,
    )


@dataclass(frozen=True)
class MergedFiles:
    """The files :func:`build_provenance` traces: the merged set and the shards its rows were tokenized from.

    ``merged``: the training shards in order; ``heldout``: the held-out file or None. ``responses`` / ``prompts``:
    the RESPONSES and PROMPTS shards of the merged datasets (those with prompts).
    """

    merged: Sequence
    heldout: str | os.PathLike | None = None
    responses: Sequence = ()
    prompts: Sequence = ()


def build_provenance(
    files: MergedFiles,
    out_path,
    *,
    datasets: dict,
    backends: dict,
    target_path,
    json_path=None,
    config: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """Write the provenance table of the merged set (module docstring) to ``out_path`` and, with ``json_path``,
    ``provenance.json``.

    ``files``: the merged set and its RESPONSES / PROMPTS shards (:class:`MergedFiles`).
    ``datasets``: per dataset ``{"source_path", "source_format", "generation": {...}}`` (the dataset's generation
    settings; None for ``answers: original`` and pre-tokenized ones); ``backends``: per backend its config
    (``type``, ``model``, ``extra_body``). ``config``: the whole config (its digest); ``extra``: more keys for the
    JSON (e.g. the decontaminate settings). Returns the JSON dict.
    """
    from .extract.model import model_fingerprint

    fingerprint = model_fingerprint(target_path) if Path(target_path).exists() else None
    template_sha = chat_template_sha256(target_path)
    table = _provenance_table(files, datasets, backends, fingerprint, template_sha).cast(PROVENANCE)
    write_parquet(table, out_path)
    counts = {s: 0 for s in ("train", "heldout")}
    for s in table.column("set").to_pylist():
        counts[s] += 1
    untraced = table.filter(
        pc.and_(pc.is_null(table.column("request_key")), pc.is_valid(table.column("source_row")))
    ).num_rows
    doc = {
        "written_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config_sha256": config_digest(config) if config is not None else None,
        "packages": package_versions(),
        "repository": repository_commit(),
        "target": {"path": str(target_path), "fingerprint": fingerprint, "chat_template_sha256": template_sha},
        "datasets": {
            ds: {
                "source_path": d.get("source_path"),
                "source_format": d.get("source_format"),
                "sampling": json.loads(_sampling(d["generation"], {})) if d.get("generation") else None,
            }
            for ds, d in datasets.items()
        },
        "backends": {b: {"type": c.get("type"), "model": c.get("model")} for b, c in backends.items()},
        "rows": {**counts, "without_reply": untraced},
        "table": str(out_path),
        **(extra or {}),
    }
    if json_path is not None:
        write_json(doc, json_path)
    log.info("provenance of %d merged rows (%s) -> %s", table.num_rows, counts, out_path)
    return doc


def _provenance_table(
    files: MergedFiles, datasets: dict, backends: dict, fingerprint: str | None, template_sha: str | None
) -> pa.Table:
    """The provenance rows (uncast) of ``files``: the merged rows joined in DuckDB to their replies, prompts,
    dataset sources and sampling settings."""
    import duckdb

    sets = [("train", str(p)) for p in files.merged] + ([("heldout", str(files.heldout))] if files.heldout else [])
    con = duckdb.connect()
    try:
        sql.set_variables(
            con,
            merged_files=[p for _, p in sets],
            responses_files=[str(p) for p in files.responses],
            prompts_files=[str(p) for p in files.prompts],
        )
        con.execute("CREATE TEMP TABLE merged_files (set_name VARCHAR, path VARCHAR, pos BIGINT)")
        con.executemany("INSERT INTO merged_files VALUES (?, ?, ?)", [[s, p, i] for i, (s, p) in enumerate(sets)])
        _config_tables(con, datasets, backends)
        con.execute("""CREATE TEMP TABLE merged AS
            SELECT f.set_name, m.filename AS merged_file, m.file_row_number AS row, f.pos, m.sample_id, m.dataset
            FROM read_parquet(getvariable('merged_files'), filename = true, file_row_number = true) m
            JOIN merged_files f ON f.path = m.filename""")
        _source_tables(con, files)
        con.execute("SET VARIABLE fingerprint = ?::VARCHAR", [fingerprint])
        con.execute("SET VARIABLE template_sha = ?::VARCHAR", [template_sha])
        return con.sql("""
            SELECT m.set_name AS "set", m.merged_file, m.row,
                (row_number() OVER (PARTITION BY m.set_name ORDER BY m.pos, m.row) - 1)::BIGINT AS "index",
                m.sample_id, m.dataset, d.source_path, coalesce(p.source_format, d.source_format) AS source_format,
                p.source_row, getvariable('fingerprint') AS target_fingerprint,
                getvariable('template_sha') AS chat_template_sha256,
                r.backend, s.engine, r.system_fingerprint AS engine_version, r.model, r.provider, s.sampling,
                r.request_key, r.generation_id, r.cost_usd, r.attempts::INTEGER AS attempts, r.completed_at
            FROM merged m
            LEFT JOIN resp r ON r.dataset = m.dataset AND r.merged_id = m.sample_id AND r.status = 'ok'
            LEFT JOIN prm p ON p.dataset = m.dataset AND p.sample_id = r.sample_id
            LEFT JOIN ds_info d ON d.dataset = m.dataset
            LEFT JOIN sampling s ON s.dataset = m.dataset AND s.backend = r.backend
            ORDER BY m.pos, m.row""").to_arrow_table()
    finally:
        con.close()


def _config_tables(con, datasets: dict, backends: dict) -> None:
    """Temp tables ``ds_info`` (each dataset's source) and ``sampling`` (each dataset and backend's engine and
    sampling JSON) on ``con``."""
    con.execute("CREATE TEMP TABLE ds_info (dataset VARCHAR, source_path VARCHAR, source_format VARCHAR)")
    con.executemany(
        "INSERT INTO ds_info VALUES (?, ?, ?)",
        [[ds, d.get("source_path"), d.get("source_format")] for ds, d in datasets.items()],
    )
    con.execute("CREATE TEMP TABLE sampling (dataset VARCHAR, backend VARCHAR, engine VARCHAR, sampling VARCHAR)")
    rows = [
        [ds, b, (backends.get(b) or {}).get("type"), _sampling(d["generation"], backends.get(b))]
        for ds, d in datasets.items()
        if d.get("generation")
        for b in backends
    ]
    if rows:  # none when no dataset is generated (every answer original or pre-tokenized)
        con.executemany("INSERT INTO sampling VALUES (?, ?, ?, ?)", rows)


def _source_tables(con, files: MergedFiles) -> None:
    """Temp tables ``resp`` (the RESPONSES rows, each with its merged id) and ``prm`` (the PROMPTS rows' source
    rows) on ``con``; empty ones when there are no such shards."""
    if files.responses:
        con.execute("""CREATE TEMP TABLE resp AS
            SELECT *, CASE WHEN count(*) OVER (PARTITION BY filename, sample_id) = 1 THEN sample_id
                           ELSE sample_id || '@' || turn END AS merged_id
            FROM read_parquet(getvariable('responses_files'), filename = true, union_by_name = true)""")
        for col, typ in (("attempts", "INTEGER"), ("system_fingerprint", "VARCHAR"), ("generation_id", "VARCHAR")):
            if col not in [r[0] for r in con.execute("DESCRIBE resp").fetchall()]:  # responses of before
                con.execute(f"ALTER TABLE resp ADD COLUMN {col} {typ}")
    else:
        con.execute("""CREATE TEMP TABLE resp (dataset VARCHAR, sample_id VARCHAR, merged_id VARCHAR,
            backend VARCHAR, model VARCHAR, provider VARCHAR, request_key VARCHAR, generation_id VARCHAR,
            cost_usd DOUBLE, attempts INTEGER, completed_at DOUBLE, system_fingerprint VARCHAR, status VARCHAR)""")
    if files.prompts:
        con.execute("""CREATE TEMP TABLE prm AS SELECT dataset, sample_id, source_row, source_format
            FROM read_parquet(getvariable('prompts_files'))""")
    else:
        con.execute(
            "CREATE TEMP TABLE prm (dataset VARCHAR, sample_id VARCHAR, source_row BIGINT, source_format VARCHAR)"
        )
