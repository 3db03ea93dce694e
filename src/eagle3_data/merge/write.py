"""Writing a merge's outputs: the merged shards (each batch checked against the MERGED schema), the selections
and the held-out set, and the merge manifest."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import schemas, sql
from ..files import atomic_path
from .keys import row_sums

#: the held-out rule, as the manifest states it
HELDOUT_RULE = (
    "held out when int(md5(f'{seed}\\x1fheldout\\x1f{key}')[:8], 16) / 2**32 < heldout; key = the prompt_key "
    "of the sample's prompt (its user text, case, punctuation and spacing ignored: copies of one prompt go "
    "together), else (pre-tokenized) base_id = sample_id without a trailing @<turn>; decided among rows no "
    "dedup / supervision / length rule drops; max_samples caps count training rows only"
)
#: MERGED columns written with dictionary encoding (every one but the token ids)
DICT_COLUMNS = [n for n in schemas.MERGED.names if n != "input_ids"]

log = logging.getLogger("eagle3_data.merge")


def write_outputs(con, job, stack: contextlib.ExitStack, check: bool, timing: dict, stats, sel_stats) -> None:
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
            batches = selection_batches(job.files, job.keys, plan, job.max_len, job.batch_rows, stop)
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


def selections_manifest(job, sel_stats) -> dict:
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


def refuse_empty(manifest: dict, job) -> None:
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


def log_merged(manifest: dict, job) -> None:
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
            writer=pq.ParquetWriter(tmp, schemas.MERGED, compression="zstd", use_dictionary=DICT_COLUMNS),
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


def selection_batches(
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


def merge_manifest(job, stats, drops) -> dict:
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
