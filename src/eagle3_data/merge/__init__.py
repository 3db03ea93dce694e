"""Merge stage: validated dataset shards -> deduplicated, length-capped, shuffled merged shards, one selection
per validated shard, and a manifest.

Out of core: numpy computes each validated row's keys (md5 of ``input_ids`` and ``loss_mask`` as DuckDB writes
them as VARCHAR, lengths, supervised counts: :func:`.keys.row_keys`, the values of ``sql/merge_row_keys.sql``), DuckDB
plans the merge over those keys, ids and hashes (``sql/merge_plan.sql``), then streams the kept rows in shard
order (``sql/merge_rows.sql``, an external sort that spills to disk past ``memory_limit``) into one parquet
writer per merged shard while a second thread writes each selection straight from its validated file (the kept
rows of ``sql/merge_selection_plan.sql``, in file order: the rows of ``sql/merge_selection_rows.sql``). Python
never holds more than a record batch of token ids per thread.

Selections are what extraction forwards: one job per validated shard, re-run only when the manifest's digest
of its selection (``sql/merge_selections.sql``) changes, so adding a dataset or retrying a request costs the
GPU only the samples it changed, while the shuffle stays global. The merged shards are the shuffled order
(the exports follow it); their ``source`` column says which selection, hence which hidden-states file, holds
each row.

Determinism: a sample's place depends only on ``(seed, dataset, sample_id)`` (shuffle key
``md5(seed, dataset, sample_id)``) and dedup keeps the first of equal ``input_ids`` in
``(dataset, sample_id)`` order, so the merged shards hold the same rows in the same order whatever the number
or order of the input files (only ``source`` names them).

Held-out set (``merge.heldout`` = f in [0, 1), 0: off): among the rows that survive dedup, the supervision and
the length rules, a row is held out when :func:`heldout_draw` of ``(seed, base_id)`` is below f, i.e.
``int(md5(f"{seed}\\x1fheldout\\x1f{base_id}").hexdigest()[:8], 16) / 2**32 < f`` with ``base_id`` the
``sample_id`` without a trailing ``@<turn>`` (:func:`base_id`; generation mode ``all`` writes one row per turn:
a conversation's turns go together). The draw depends on nothing else: not the dataset (two datasets built from
the same source, e.g. regenerated replies and the original answers, hold out the same prompts), not the other
rows, the shard counts or the input files (adding data moves no sample in or out). Held-out rows are never in
the merged shards; they are written, in the same shuffle-key order, to their own MERGED file (``heldout_path``),
and ``max_samples`` caps count training rows only. They stay in the selections (extraction covers both sets, and
a change of f alone leaves every selection's digest as it was, unless a ``max_samples`` cap then admits other
training rows).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import schemas, sql
from ..files import atomic_path, write_json
from .keys import row_sums, row_keys

if TYPE_CHECKING:
    from ..settings import MergeSettings

log = logging.getLogger("eagle3_data.merge")

OVERFLOW_MODES = ("truncate", "drop")
#: the held-out rule, as the manifest states it
HELDOUT_RULE = (
    "held out when int(md5(f'{seed}\\x1fheldout\\x1f{base_id}')[:8], 16) / 2**32 < heldout; base_id = "
    "sample_id without a trailing @<turn>; decided among rows no dedup / supervision / length rule drops; "
    "max_samples caps count training rows only"
)
_TURN = re.compile(r"@[0-9]+$")
#: MERGED columns written with dictionary encoding (every one but the token ids)
_DICT_COLUMNS = [n for n in schemas.MERGED.names if n != "input_ids"]


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


def heldout_draw(seed, sample_id: str) -> float:
    """The held-out draw of a row, in [0, 1): ``int(md5(f"{seed}\\x1fheldout\\x1f{base_id}")[:8], 16) / 2**32``
    (``sql/merge_plan.sql`` computes the same). A row is held out when its draw is below ``merge.heldout``."""
    digest = hashlib.md5(f"{seed}\x1fheldout\x1f{base_id(sample_id)}".encode()).hexdigest()
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
    t0 = time.perf_counter()
    timing: dict = {}
    with contextlib.ExitStack() as stack:
        con = _connect(job, stack)
        phases, (stats, drops, sel_stats) = _plan(con, job, t0)
        _write_outputs(con, job, stack, check, timing, stats, sel_stats)
    manifest = _manifest(job, stats, drops)
    manifest["selections"] = _selections_manifest(job, sel_stats)
    manifest["timing_s"] = {
        **phases,
        **{k_: round(v, 3) for k_, v in timing.items()},
        "total": round(time.perf_counter() - t0, 3),
    }
    _refuse_empty(manifest, job)
    write_json(manifest, manifest_path)
    _log_merged(manifest, job)
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
    con.execute("CREATE TEMP TABLE merge_sources (filename VARCHAR, source VARCHAR, idx BIGINT)")
    con.executemany(
        "INSERT INTO merge_sources VALUES (?, ?, ?)",
        [[f, key, i] for i, (f, key) in enumerate(zip(job.files, job.keys))],
    )
    return con


def _plan(con, job: _Job, t0: float) -> tuple[dict, tuple[list, list, list]]:
    """Compute the row keys (:func:`.keys.row_keys`), plan the merge (``sql/merge_plan.sql``; ``ValueError`` on a
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


def _write_outputs(con, job: _Job, stack: contextlib.ExitStack, check: bool, timing: dict, stats, sel_stats) -> None:
    """Stream rows in (shard, shuffle_key) order into one writer per merged shard and, at the same time in a
    second thread, each selection straight from its validated file (kept rows in file order); the files are
    renamed into place only when both are complete and their row counts are the plan's, when ``stack`` closes
    (on an error none of this run's files is left). ``timing`` gets :func:`_write_groups`' parts, ``shards`` and
    ``selections``."""
    commit = stack.enter_context(contextlib.ExitStack())
    stop = threading.Event()
    sel_job = None
    sel_outs = job.sel_outs
    pool = stack.enter_context(ThreadPoolExecutor(1)) if sel_outs is not None else None
    if sel_outs is not None:
        plan = con.sql(sql.load("merge_selection_plan")).to_arrow_table()
        plan = {name: plan.column(name).to_numpy() for name in plan.column_names}

        def write_selections() -> dict[int, int]:
            t1 = time.perf_counter()
            batches = _selection_batches(job.files, job.keys, plan, job.max_len, job.batch_rows, stop)
            # not re-checked: a selection's rows are the merged rows checked in the other thread (same
            # plan, same values, only another order); its row count is compared with the plan below
            out = _write_groups(batches, sel_outs, False, timing, "selections", commit=commit)
            timing["selections"] = time.perf_counter() - t1
            return out

        sel_job = pool.submit(write_selections)
    try:
        t1 = time.perf_counter()
        reader = con.sql(sql.load("merge_rows")).to_arrow_reader(job.batch_rows)
        written = _write_groups(reader, job.groups, check, timing, "shards", commit=commit)
        timing["shards"] = time.perf_counter() - t1
    except BaseException:
        stop.set()
        if sel_job is not None:
            with contextlib.suppress(BaseException):
                sel_job.result()
        raise
    if sel_job is not None:
        sel_written = sel_job.result()
        for idx, key, n, _tok, _dig in sel_stats:
            if sel_written[idx] != n:
                raise RuntimeError(f"merge: selection {sel_outs[idx]} has {sel_written[idx]} rows, plan says {n}")
    _check_written(job.groups, stats, written)  # before the files are renamed into place


def _selections_manifest(job: _Job, sel_stats) -> dict:
    """The manifest's ``selections``: {source key: path (None without selection files), input, samples, tokens,
    digest}, from ``merge_selections.sql``."""
    return {
        key: {
            "path": job.sel_outs[idx] if job.sel_outs is not None else None,
            "input": job.files[idx],
            "samples": n,
            "tokens": tok,
            "digest": dig,
        }
        for idx, key, n, tok, dig in sel_stats
    }


def _refuse_empty(manifest: dict, job: _Job) -> None:
    """An empty merged set is a configuration error, not a result: remove the files written and raise
    ``ValueError`` naming the settings that dropped every sample."""
    tot = manifest["totals"]
    if tot["samples"] == 0 and tot.get("input_samples", 0) > 0:
        for p in job.groups + (job.sel_outs or []):
            Path(p).unlink(missing_ok=True)
        raise ValueError(
            f"merge: no sample left of {tot['input_samples']} (dropped {tot['dropped']}, held out "
            f"{manifest['heldout']['samples']}) with merge.max_len={job.max_len}, merge.overflow={job.overflow!r}, "
            f"merge.datasets={job.datasets}, merge.max_samples={job.max_samples}, merge.heldout={job.heldout}"
        )


def _log_merged(manifest: dict, job: _Job) -> None:
    """Log what the merge wrote (and, when on, the held-out set)."""
    tot = manifest["totals"]
    log.info(
        "merged %d samples (%d tokens, %d supervised) from %d files into %d shards in %.1fs; dropped %s",
        tot["samples"],
        tot["tokens"],
        tot["supervised_tokens"],
        len(job.files),
        len(job.outs),
        manifest["timing_s"]["total"],
        tot["dropped"],
    )
    if job.heldout:
        h = manifest["heldout"]
        log.info(
            "held out %d samples (%d tokens; merge.heldout = %s) in %s",
            h["samples"],
            h["tokens"],
            job.heldout,
            job.heldout_path,
        )


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


def _write_groups(
    reader,
    outs: list[str],
    check: bool,
    timing: dict | None = None,
    name: str = "",
    commit: contextlib.ExitStack | None = None,
) -> dict[int, int]:
    """Write a stream of MERGED rows carrying a ``shard`` column (non-decreasing) into one parquet file per
    group: ``outs[shard]``. ``reader``: record batches (an arrow reader or any iterable). Every file is written
    (an empty table for a group without rows), each under a temporary name renamed when complete, or, with
    ``commit``, when ``commit`` closes without an error (on an error its temporary files are removed); on an
    error none of the unfinished files is left. Returns rows
    written per group. ``timing`` (if given) gets ``<name>_read`` (seconds waiting for DuckDB's batches),
    ``<name>_check`` (:func:`check_merged_batch`) and ``<name>_write`` (casts and parquet writes)."""
    timing = {} if timing is None else timing
    t_read = t_check = t_write = 0.0
    clock = time.perf_counter
    written = {i: 0 for i in range(len(outs))}
    state: dict = {"shard": None, "stack": None, "writer": None}

    def open_shard(i: int) -> None:
        s = contextlib.ExitStack()
        tmp = (commit if commit is not None else s).enter_context(atomic_path(outs[i]))
        # input_ids plain-encoded (zstd only): a dictionary of token ids costs more write time than it saves
        state.update(
            shard=i,
            stack=s,
            writer=pq.ParquetWriter(tmp, schemas.MERGED, compression="zstd", use_dictionary=_DICT_COLUMNS),
        )

    def close_shard() -> None:
        if state["writer"] is not None:
            state["writer"].close()
            state["stack"].close()  # renames the temporary file into place
        state.update(shard=None, stack=None, writer=None)

    def abort() -> None:
        if state["writer"] is not None:
            with contextlib.suppress(Exception):
                state["writer"].close()
            with contextlib.suppress(BaseException):
                err = RuntimeError("merge aborted")
                state["stack"].__exit__(RuntimeError, err, None)
        state.update(shard=None, stack=None, writer=None)

    def write_empty(j: int) -> None:
        if commit is None:
            schemas.write_checked(schemas.empty(schemas.MERGED), "merged", outs[j])
        else:
            schemas.write_checked(schemas.empty(schemas.MERGED), "merged", commit.enter_context(atomic_path(outs[j])))

    next_empty = 0
    try:
        it = iter(reader)
        while True:
            c0 = clock()
            batch = next(it, None)
            t_read += clock() - c0
            if batch is None:
                break
            shard_col = batch.column("shard").to_pylist()
            tbl = pa.Table.from_batches([batch]).drop_columns(["shard"])
            start = 0
            while start < len(shard_col):
                i = shard_col[start]
                end = start
                while end < len(shard_col) and shard_col[end] == i:
                    end += 1
                if state["shard"] != i:
                    close_shard()
                    for j in range(next_empty, i):  # groups that got no rows
                        write_empty(j)
                    next_empty = i + 1
                    open_shard(i)
                c0 = clock()
                part = tbl.slice(start, end - start).cast(schemas.MERGED)
                if check:
                    c1 = clock()
                    check_merged_batch(part, outs[i], first_row=written[i])
                    t_check += clock() - c1
                state["writer"].write_table(part)
                t_write += clock() - c0
                written[i] += part.num_rows
                start = end
        close_shard()
        for j in range(next_empty, len(outs)):
            write_empty(j)
    except BaseException:
        abort()
        raise
    timing.update({f"{name}_read": t_read, f"{name}_check": t_check, f"{name}_write": t_write - t_check})
    return written


def check_merged_batch(table: pa.Table, path="<memory>", first_row: int = 0) -> pa.Table:
    """Check a batch of merged rows against the MERGED contract with arrow compute (no pandas); return it.

    The same rules as ``schema_models.MergedModel`` (which converts to pandas and is ~10x slower on token lists),
    plus ``num_supervised == sum(loss_mask)``: schema equal to ``schemas.MERGED``; no null ``sample_id``,
    ``dataset``, ids, masks, counts or flags; ``sample_id`` unique per ``dataset`` in the batch; ``input_ids``
    non-empty with every id >= 0; ``loss_mask`` values 0/1; both lists ``num_tokens`` long; ``num_tokens`` > 0;
    ``num_supervised`` > 0.

    Raises ``schemas.SchemaError`` naming ``path``, the row (``first_row`` + index in the batch), its
    ``sample_id`` and the rule broken (up to 5 rows).
    """
    if not table.schema.equals(schemas.MERGED, check_metadata=False):
        return schemas.check(table, "merged", str(path))  # names missing / extra / mistyped columns
    n = table.num_rows
    if n == 0:
        return table
    bad: list[tuple[int, str]] = []

    def flag(mask, rule: str) -> None:
        arr = np.asarray(mask, dtype=bool)
        for r in np.flatnonzero(arr)[:5]:
            bad.append((int(r), rule))

    for name in (
        "sample_id",
        "dataset",
        "input_ids",
        "loss_mask",
        "num_tokens",
        "num_supervised",
        "truncated",
    ):  # source may be null
        col = table.column(name)
        if col.null_count:
            flag(pc.is_null(col).to_numpy(zero_copy_only=False), f"{name} is null")
    # a merged row is (dataset, sample_id): datasets built from one source may share ids
    sid = pc.binary_join_element_wise(
        table.column("dataset").combine_chunks(), table.column("sample_id").combine_chunks(), "\x00"
    )
    if pc.count_distinct(sid, mode="only_valid").as_py() != n - sid.null_count:
        counts = pc.value_counts(sid)
        dups = {v["values"] for v in counts.to_pylist() if v["counts"] > 1}
        flag([x in dups for x in sid.to_pylist()], "sample_id repeated within its dataset in the batch")
    ntok = table.column("num_tokens").combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
    nsup = table.column("num_supervised").combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
    flag(ntok <= 0, "num_tokens must be > 0")
    flag(nsup <= 0, "num_supervised must be > 0")
    sums = {}
    for name, low, high in (("input_ids", 0, None), ("loss_mask", 0, 1)):
        lists = table.column(name).combine_chunks()
        off = lists.offsets.to_numpy()
        vals = lists.values.to_numpy(zero_copy_only=False)[off[0] : off[-1]]  # int32 ids / int8 mask, no copy
        rel = off - off[0]
        lens = np.diff(rel)
        flag(lens != ntok, f"{name} length differs from num_tokens")
        if len(vals) and (vals.min() < low or (high is not None and vals.max() > high)):
            outside = (vals < low) if high is None else ((vals < low) | (vals > high))
            row_of = np.searchsorted(rel, np.flatnonzero(outside), side="right") - 1
            hit = np.zeros(n, dtype=bool)
            hit[row_of] = True
            flag(hit, f"{name} has values outside [{low}, {'inf' if high is None else high}]")
        if name == "loss_mask":
            sums[name] = row_sums(vals, rel.astype(np.int64, copy=False))
    flag(sums["loss_mask"] != nsup, "num_supervised differs from sum(loss_mask)")
    if bad:
        bad.sort()
        ids = sid.to_pylist()
        lines = [f"  row {first_row + r} (sample_id {ids[r]!r}): {rule}" for r, rule in bad[:5]]
        raise schemas.SchemaError(f"{path}: merged rows fail the MERGED contract:\n" + "\n".join(lines))
    return table


def _check_written(outs, stats, written) -> None:
    """Raise ``RuntimeError`` when a merged shard got another number of rows than the plan's ``stats`` say."""
    planned = {i: 0 for i in range(len(outs))}
    for shard, _ds, n, *_ in stats:
        planned[shard] += n
    for i, n in planned.items():
        if n != written[i]:
            raise RuntimeError(f"merge: shard {outs[i]} has {written[i]} rows written, plan says {n}")


def _selection_batches(
    files: list[str], keys: list[str], plan: dict, max_len: int, batch_rows: int, stop: threading.Event
):
    """Record batches of each selection's rows (MERGED columns + ``shard`` = the file's index), file after file,
    read straight from the validated files: the kept rows (``plan``: ``sql/merge_selection_plan.sql`` as numpy
    arrays idx, file_row_number, out_tokens, out_supervised, truncated) in file row order, ``input_ids`` and
    ``loss_mask`` cut to ``max_len`` where truncated: the rows of ``sql/merge_selection_rows.sql``. Raises
    ``RuntimeError`` once ``stop`` is set (the merged shards failed)."""
    idx = plan["idx"]
    bounds = np.searchsorted(idx, np.arange(len(files) + 1))
    cols = ["sample_id", "dataset", "input_ids", "loss_mask"]
    for i, path in enumerate(files):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if lo == hi:
            continue
        rows = plan["file_row_number"][lo:hi]
        first = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=cols, use_threads=False):
            if stop.is_set():
                raise RuntimeError("merge: selections stopped (the merged shards failed)")
            a, b = np.searchsorted(rows, [first, first + batch.num_rows])
            n_batch, first = batch.num_rows, first + batch.num_rows
            if a == b:
                continue
            pos = rows[a:b] - (first - n_batch)
            if b - a < n_batch:
                batch = batch.take(pa.array(pos))
            trunc = plan["truncated"][lo + a : lo + b]
            ids, mask = batch.column("input_ids"), batch.column("loss_mask")
            if trunc.any():
                flag = pa.array(trunc)
                ids = pc.if_else(flag, pc.list_slice(ids, 0, max_len), ids)
                mask = pc.if_else(flag, pc.list_slice(mask, 0, max_len), mask)
            n = b - a
            yield pa.RecordBatch.from_arrays(
                [
                    batch.column("sample_id"),
                    batch.column("dataset"),
                    ids,
                    mask,
                    pa.array(plan["out_tokens"][lo + a : lo + b], pa.int64()),
                    pa.array(plan["out_supervised"][lo + a : lo + b], pa.int64()),
                    pa.array(trunc, pa.bool_()),
                    pa.array([keys[i]] * n, pa.string()),
                    pa.array(np.full(n, i, np.int64)),
                ],
                names=[*schemas.MERGED.names, "shard"],
            )


def _manifest(job: _Job, stats, drops) -> dict:
    """The manifest dict of ``job`` from the SQL results: ``stats`` (merge_stats.sql; shard ``len(job.outs)`` is
    the held-out set) and ``drops`` (merge_drops.sql)."""
    outs, files, datasets, max_samples = job.outs, job.files, job.datasets, job.max_samples
    max_len, overflow, seed, heldout, heldout_path = job.max_len, job.overflow, job.seed, job.heldout, job.heldout_path
    shards = [
        {"path": p, "samples": 0, "tokens": 0, "supervised_tokens": 0, "truncated": 0, "datasets": {}} for p in outs
    ]
    held = {
        "path": heldout_path,
        "fraction": heldout,
        "rule": HELDOUT_RULE,
        "samples": 0,
        "tokens": 0,
        "supervised_tokens": 0,
        "truncated": 0,
        "datasets": {},
    }
    held_tokens: dict = {}
    for shard, ds, n, tok, sup, trunc in stats:
        s = shards[shard] if shard < len(outs) else held
        s["samples"] += n
        s["tokens"] += tok
        s["supervised_tokens"] += sup
        s["truncated"] += trunc
        s["datasets"][ds] = n
        if shard >= len(outs):
            held_tokens[ds] = tok
    per_ds: dict = {}
    for ds, decision, n, tok in drops:
        d = per_ds.setdefault(
            ds, {"input_samples": 0, "input_tokens": 0, "kept": 0, "heldout": 0, "heldout_tokens": 0, "dropped": {}}
        )
        d["input_samples"] += n
        d["input_tokens"] += tok
        if decision == "kept":
            d["kept"] = n
        elif decision == "heldout":
            d["heldout"] = n
            d["heldout_tokens"] = held_tokens.get(ds, 0)
        else:
            d["dropped"][decision] = n
    dropped: dict = {}
    for d in per_ds.values():
        for reason, n in d["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    missing = sorted(set(datasets or []) - set(per_ds))
    if missing:
        log.warning("merge: datasets selected but absent from the inputs: %s", missing)
    unknown_caps = sorted(set(max_samples) - set(per_ds))
    if unknown_caps:
        log.warning("merge: max_samples names datasets absent from the inputs: %s", unknown_caps)
    return {
        "shards": shards,
        "heldout": held,
        "totals": {
            "samples": sum(s["samples"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "supervised_tokens": sum(s["supervised_tokens"] for s in shards),
            "truncated": sum(s["truncated"] for s in shards),
            "input_samples": sum(d["input_samples"] for d in per_ds.values()),
            "dropped": dropped,
        },
        "datasets": per_ds,
        "missing_datasets": missing,
        "inputs": sorted(files),
        "settings": {
            "datasets": datasets,
            "max_samples": max_samples,
            "max_len": max_len,
            "overflow": overflow,
            "seed": str(seed),
            "num_shards": len(outs),
            "shuffle": "order by md5(seed, dataset, sample_id); shards = contiguous token-balanced ranges",
            "dedup": "equal input_ids: keep the first in (dataset, sample_id) order",
            "heldout": heldout,
        },
    }
