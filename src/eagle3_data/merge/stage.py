"""The merge stage's job: the plan (DuckDB, ``sql/merge_plan.sql``), the merged shards, selections and held-out
set written and checked, and the manifest (the stage is described in :mod:`eagle3_data.merge`)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pyarrow.parquet as pq

from .. import sql
from ..files import write_json
from .keys import add_image_keys, row_keys

if TYPE_CHECKING:
    from ..settings import MergeSettings

from .write import (
    log_merged,
    merge_manifest,
    refuse_empty,
    selections_manifest,
    write_outputs,
)

log = logging.getLogger("eagle3_data.merge")

OVERFLOW_MODES = ("truncate", "drop")
_TURN = re.compile(r"@[0-9]+$")


def _paths(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [str(Path(p)) for p in paths]


def source_key(path) -> str:
    """The selection key of a validated file: ``<dataset>/<shard>`` for the workflow's
    ``results/<dataset>/validated/<shard>.parquet``, else the path without its suffix."""
    p = Path(path)
    if p.parent.name == "validated" and p.parent.parent.name:
        return f"{p.parent.parent.name}/{p.stem}"
    return str(p.with_suffix(""))


def base_id(sample_id: str) -> str:
    """The conversation a row belongs to: ``sample_id`` without a trailing ``@<turn>`` (``"a@3"`` -> ``"a"``,
    ``"a@b"`` and ``"a"`` unchanged)."""
    return _TURN.sub("", sample_id)


def heldout_draw(seed, sample_id: str, prompt_key: str | None = None) -> float:
    """The held-out draw of a row, in [0, 1): ``int(md5(f"{seed}\\x1fheldout\\x1f{key}")[:8], 16) / 2**32`` with
    ``key`` the row's ``prompt_key`` (its PROMPTS row's: :func:`eagle3_data.normalize.prompt_key`, the normalized
    user text), else (a pre-tokenized row, no prompts) its :func:`base_id` (``sql/merge_plan.sql`` computes the
    same). A row is held out when its draw is below ``merge.heldout``."""
    key = prompt_key if prompt_key is not None else base_id(sample_id)
    digest = hashlib.md5(f"{seed}\x1fheldout\x1f{key}".encode()).hexdigest()
    return int(digest[:8], 16) / 2**32


def memory_limit_of(memory_mb: int) -> str:
    """DuckDB's memory limit for a merge job of ``memory_mb`` MB: three quarters of it (the rest for the parquet
    writers and Python), at least 256 MB; e.g. ``4000 -> "3000MB"``."""
    return f"{max(256, int(memory_mb * 0.75))}MB"


@dataclass(frozen=True)
class MergeResources:
    """A merge job's resources (the job's, not the data's: nothing here changes a merged row).

    ``memory_limit``: DuckDB's memory limit (e.g. ``"3000MB"``; ``None``: :func:`memory_limit_of`
    ``settings.memory_mb``). ``threads``: DuckDB's threads and the threads computing the row keys (``None``:
    ``settings.threads``; 0: one per CPU); the selections are written in one more thread, alongside the merged
    shards. ``temp_dir``: DuckDB's spill directory (``None``: a temporary directory next to the first output).
    ``batch_rows``: rows per streamed record batch (and per batch read from a validated file)."""

    memory_limit: str | None = None
    threads: int | None = None
    temp_dir: str | os.PathLike | None = None
    batch_rows: int = 1024


def merge(
    validated_paths,
    out_paths,
    manifest_path,
    *,
    settings: "MergeSettings",
    selections=None,
    sources=None,
    heldout_path=None,
    prompt_paths=(),
    resources: MergeResources | None = None,
    check: bool = True,
) -> dict:
    """Merge VALIDATED parquet files into ``len(out_paths)`` MERGED shards balanced by token count, and write
    each input file's selection (its kept rows, in its own row order) for extraction.

    Args:
        validated_paths: VALIDATED parquet files (``schemas.VALIDATED``; ``input_ids`` list<int32>,
            ``loss_mask`` list<int8>), any number, any order.
        out_paths: merged shard paths, one per shard (K = len). Each gets ``schemas.MERGED`` rows
            (``num_tokens`` and ``num_supervised`` after truncation, ``truncated`` flag, ``source``: the key of
            the validated file the row came from), written to a temporary name and renamed; a shard with no
            rows is still written (empty table).
        manifest_path: JSON manifest: ``shards`` (path, samples, tokens, supervised_tokens, truncated,
            datasets {name: samples}), ``heldout`` (the held-out set, the same keys + ``fraction`` and
            ``rule``; path None when not written), ``selections`` ({source: path, samples, tokens, digest}),
            ``totals`` (the training shards'), ``datasets`` (per dataset: input samples/tokens, ``kept``
            (training), ``heldout`` / ``heldout_tokens``, dropped counts by reason), ``inputs`` (files),
            ``settings``.
        settings: :class:`~eagle3_data.settings.MergeSettings` (the ``merge`` section; what each key does:
            :func:`_job`).
        selections: one output path per validated file (same order), or ``None`` for none: the file's kept
            rows (``schemas.MERGED``), truncated like the merged shards, in the validated file's row order.
            Extraction forwards one selection per job; its ``digest`` in the manifest changes only when the
            kept samples of that file, their ids or masks, or their truncation change.
        sources: one key per validated file (same order; default :func:`source_key`): the ``source`` column
            and the manifest's ``selections`` keys.
        heldout_path: the held-out set's MERGED file (its rows in shuffle-key order; written empty when
            ``settings.heldout`` is 0), or ``None`` (then ``settings.heldout`` must be 0).
        prompt_paths: PROMPTS parquet files (``schemas.PROMPTS``) of the merged datasets: the held-out draw of a row
            goes by its prompt's ``prompt_key`` (:func:`heldout_draw`), so copies of one prompt text under other ids
            or in other datasets fall on the same side; a row without one (none given, a pre-tokenized dataset) is
            drawn by its :func:`base_id`.
        resources: the job's :class:`MergeResources` (DuckDB's memory, threads and spill directory, the batch size);
            ``None``: ``MergeResources()``, i.e. the settings' ``memory_mb`` and ``threads``.
        check: run :func:`check_merged_batch` (the MERGED contract, with arrow compute) on every batch of
            the merged shards (the selections hold the same rows in another order and are not checked again).

    Returns: the manifest dict.

    Raises:
        ValueError: bad arguments (``heldout`` outside [0, 1), or > 0 without ``heldout_path``), no input files,
            no training sample left, or one ``(dataset, sample_id)`` with two different ``input_ids`` (the
            message names the id and the files).
        schemas.SchemaError: a merged batch breaks the MERGED contract.
    """
    job = _job(validated_paths, out_paths, settings, selections, sources, heldout_path, resources or MergeResources())
    job = dataclasses.replace(job, prompt_files=_paths(prompt_paths) if job.heldout else [])
    t0 = time.perf_counter()
    timing: dict = {}
    with contextlib.ExitStack() as stack:
        con = _connect(job, stack)
        phases, (stats, drops, sel_stats) = _plan(con, job, t0)
        write_outputs(con, job, stack, check, timing, stats, sel_stats)
    manifest = merge_manifest(job, stats, drops)
    manifest["selections"] = selections_manifest(job, sel_stats)
    manifest["timing_s"] = {
        **phases,
        **{k_: round(v, 3) for k_, v in timing.items()},
        "total": round(time.perf_counter() - t0, 3),
    }
    refuse_empty(manifest, job)
    write_json(manifest, manifest_path)
    log_merged(manifest, job)
    return manifest


@dataclass(frozen=True)
class _Job:
    """A merge's arguments, checked and resolved by :func:`_job`."""

    files: list[str]
    outs: list[str]
    sel_outs: list[str] | None
    keys: list[str]
    heldout_path: str | None
    datasets: list[str] | None
    max_samples: dict
    max_len: int
    overflow: str
    seed: object
    heldout: float
    memory_limit: str
    threads: int | None
    temp_dir: str | os.PathLike | None
    batch_rows: int
    prompt_files: list[str] = dataclasses.field(default_factory=list)

    @property
    def groups(self) -> list[str]:
        """The writer's groups: the K training shards, then (group K) the held-out file."""
        return self.outs + ([self.heldout_path] if self.heldout_path is not None else [])


def _job(validated_paths, out_paths, settings, selections, sources, heldout_path, resources: MergeResources) -> _Job:
    """Check and resolve :func:`merge`'s arguments; raise ``ValueError`` / ``FileNotFoundError`` on bad ones.

    The settings (:class:`~eagle3_data.settings.MergeSettings`, the ``merge`` section):
    ``datasets``: names to keep (``None`` = all); a name with no rows in the inputs is logged and listed in the
    manifest under ``missing_datasets``.
    ``max_samples``: ``{dataset: n}`` caps; the first n of the dataset's training rows in the seeded shuffle order
    are kept (after dedup, the max_len rule and the held-out draw, so a cap yields n usable training samples when
    there are n; held-out rows are not capped).
    ``max_len``: token cap per sample (>= 1).
    ``overflow``: ``"truncate"`` (cut ``input_ids`` and ``loss_mask`` to max_len; drop the sample if no supervised
    token remains) or ``"drop"`` (drop samples longer than max_len).
    ``seed``: shuffle seed (int or str; part of the shuffle key and of the held-out draw).
    ``heldout``: the held-out share f in [0, 1) (module docstring; 0: off).
    ``memory_mb``, ``threads``: DuckDB's budget when ``resources`` leaves ``memory_limit`` / ``threads`` unset.
    """
    datasets, max_samples, max_len = settings.datasets, settings.max_samples, settings.max_len
    overflow, seed, heldout = settings.overflow, settings.seed, settings.heldout
    memory_limit = resources.memory_limit
    if memory_limit is None:
        memory_limit = memory_limit_of(settings.memory_mb)
    threads = settings.threads if resources.threads is None else resources.threads
    files = _paths(validated_paths)
    outs = _paths(out_paths)
    if not files:
        raise ValueError("merge: no validated input files")
    if not outs:
        raise ValueError("merge: out_paths is empty; need at least one merged shard")
    if len(set(outs)) != len(outs):
        raise ValueError(f"merge: out_paths has duplicates: {outs}")
    if len(set(files)) != len(files):
        raise ValueError(f"merge: validated_paths has duplicates: {sorted(f for f in files if files.count(f) > 1)[:3]}")
    sel_outs = _paths(selections) if selections is not None else None
    if sel_outs is not None and len(sel_outs) != len(files):
        raise ValueError(f"merge: {len(sel_outs)} selection paths for {len(files)} validated files")
    keys = [str(k) for k in sources] if sources is not None else [source_key(f) for f in files]
    if len(keys) != len(files) or len(set(keys)) != len(keys):
        raise ValueError(f"merge: need one distinct source key per validated file, got {keys[:5]}...")
    heldout = 0.0 if heldout is None else heldout
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)) or not 0 <= heldout < 1:
        raise ValueError(f"merge: merge.heldout must be a number in [0, 1), got {heldout!r}")
    heldout = float(heldout)
    if heldout > 0 and heldout_path is None:
        raise ValueError(f"merge: merge.heldout={heldout} needs a held-out output file (heldout_path)")
    if heldout_path is not None:
        heldout_path = _paths(heldout_path)[0]
        if heldout_path in outs:
            raise ValueError(f"merge: heldout_path {heldout_path} is also a merged shard path")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"merge: overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"merge: max_len must be a positive int, got {max_len!r}")
    max_samples = dict(max_samples or {})
    for name, cap in max_samples.items():
        if cap is None or int(cap) < 0:
            raise ValueError(f"merge: max_samples[{name!r}] must be a non-negative int, got {cap!r}")
    if datasets is not None:
        datasets = sorted({str(d) for d in datasets})
    missing_files = [f for f in files if not Path(f).is_file()]
    if missing_files:
        raise FileNotFoundError(f"merge: validated input files not found: {missing_files[:5]}")
    return _Job(
        files=files,
        outs=outs,
        sel_outs=sel_outs,
        keys=keys,
        heldout_path=heldout_path,
        datasets=datasets,
        max_samples=max_samples,
        max_len=max_len,
        overflow=overflow,
        seed=seed,
        heldout=heldout,
        memory_limit=memory_limit,
        threads=threads,
        temp_dir=resources.temp_dir,
        batch_rows=resources.batch_rows,
    )


def _connect(job: _Job, stack: contextlib.ExitStack) -> duckdb.DuckDBPyConnection:
    """The output directories made, a DuckDB connection (closed with ``stack``) with the job's memory, threads,
    spill directory (a temporary one, removed with ``stack``, unless ``job.temp_dir``), the SQL variables of the
    merge queries and the table ``merge_sources`` (filename, source key, index of each validated file)."""
    for o in job.groups + (job.sel_outs or []):
        Path(o).parent.mkdir(parents=True, exist_ok=True)
    spill = job.temp_dir or stack.enter_context(
        tempfile.TemporaryDirectory(prefix=".merge-spill-", dir=Path(job.outs[0]).parent)
    )
    con = stack.enter_context(contextlib.closing(duckdb.connect()))
    con.execute(f"SET memory_limit = '{job.memory_limit}'")
    con.execute("SET temp_directory = ?", [str(spill)])
    if job.threads:
        con.execute(f"SET threads = {int(job.threads)}")
    sql.set_variables(con, validated_files=job.files, datasets=job.datasets)
    sql.set_variables(con, max_samples={k_: int(v) for k_, v in job.max_samples.items()})
    con.execute("SET VARIABLE max_len = ?::BIGINT", [job.max_len])
    con.execute("SET VARIABLE num_shards = ?::BIGINT", [len(job.outs)])
    con.execute("SET VARIABLE overflow = ?::VARCHAR", [job.overflow])
    con.execute("SET VARIABLE seed = ?::VARCHAR", [str(job.seed)])
    con.execute("SET VARIABLE heldout = ?::DOUBLE", [job.heldout])
    _prompt_keys(con, job.prompt_files)
    con.execute("CREATE TEMP TABLE merge_sources (filename VARCHAR, source VARCHAR, idx BIGINT)")
    con.executemany(
        "INSERT INTO merge_sources VALUES (?, ?, ?)",
        [[f, key, i] for i, (f, key) in enumerate(zip(job.files, job.keys))],
    )
    return con


def _prompt_keys(con, files: list[str]) -> None:
    """Table ``prompt_keys`` (dataset, sample_id, prompt_key) of the PROMPTS ``files``, the held-out draw's keys
    (a file written before ``prompt_key`` existed gives none: its rows are drawn by base id, and a warning says to
    rerun normalize)."""
    con.execute("CREATE TEMP TABLE prompt_keys (dataset VARCHAR, sample_id VARCHAR, prompt_key VARCHAR)")
    have = [f for f in files if "prompt_key" in pq.read_schema(f).names]
    if len(have) < len(files):
        log.warning(
            "merge: %d PROMPTS file(s) without prompt_key (e.g. %s, written by an older normalize): their rows are "
            "held out by sample id, not by prompt text; rerun normalize (snakemake --forcerun normalize) to fix",
            len(files) - len(have),
            next(f for f in files if f not in have),
        )
    if have:
        con.execute(
            "INSERT INTO prompt_keys SELECT dataset, sample_id, prompt_key FROM read_parquet(?) "
            "WHERE prompt_key IS NOT NULL",
            [have],
        )


def _plan(con, job: _Job, t0: float) -> tuple[dict, tuple[list, list, list]]:
    """Compute the row keys (:func:`.keys.row_keys`, image rows' keys folded in by :func:`.keys.add_image_keys`), plan the merge (``sql/merge_plan.sql``; ``ValueError`` on a
    ``(dataset, sample_id)`` with two different ``input_ids``) and read its statistics. Returns the phases'
    timing (``plan``, ``plan_row_keys``, ``stats``: seconds, ``plan`` and ``plan_row_keys`` since ``t0``) and the
    results of ``merge_stats``, ``merge_drops`` and ``merge_selections``."""
    row_keys(
        con,
        job.files,
        max_len=job.max_len,
        datasets=job.datasets,
        threads=job.threads or None,
        batch_rows=job.batch_rows,
    )
    add_image_keys(con, job.files, job.datasets)
    t_keys = time.perf_counter() - t0
    con.execute(sql.load("merge_plan"))
    conflicts = con.sql(sql.load("merge_conflicts")).fetchall()
    if conflicts:
        lines = [f"  {ds}/{sid}: {n} versions in {fl}" for ds, sid, n, fl in conflicts]
        raise ValueError("merge: the same (dataset, sample_id) occurs with different input_ids:\n" + "\n".join(lines))
    t_plan = time.perf_counter() - t0
    stats = con.sql(sql.load("merge_stats")).fetchall()
    drops = con.sql(sql.load("merge_drops")).fetchall()
    sel_stats = con.sql(sql.load("merge_selections")).fetchall()
    t_stats = time.perf_counter() - t0 - t_plan
    phases = {"plan": round(t_plan, 3), "plan_row_keys": round(t_keys, 3), "stats": round(t_stats, 3)}
    return phases, (stats, drops, sel_stats)


def remove_leftover_heldout(path, export_dir=None) -> bool:
    """With the held-out set off: remove the held-out file ``path`` an earlier merge wrote (its rows are training
    rows now) and warn when ``export_dir`` (the held-out exports) still exists. Returns whether a file was
    removed."""
    p = Path(path)
    removed = p.is_file()
    if removed:
        p.unlink()
        log.warning(
            "merge.heldout is 0: removed %s, left by an earlier merge (its samples are training samples now)", p
        )
    if export_dir is not None and Path(export_dir).is_dir():
        log.warning(
            "merge.heldout is 0: %s holds an earlier held-out export whose samples are now trained on; delete it",
            export_dir,
        )
    return removed
