"""Merge stage: validated dataset shards -> deduplicated, length-capped, shuffled merged shards + manifest.

Out of core: DuckDB plans the merge over the validated parquet files reading only ids, lengths and hashes
(``sql/merge_plan.sql``), then streams the kept rows in shard order (``sql/merge_rows.sql``, an external
sort that spills to disk past ``memory_limit``) into one parquet writer per merged shard. Python never
holds more than one record batch of token ids.

Determinism: a sample's place depends only on ``(seed, dataset, sample_id)`` (shuffle key
``md5(seed, dataset, sample_id)``) and dedup keeps the first of equal ``input_ids`` in
``(dataset, sample_id)`` order, so the merged shards are byte-for-byte the same whatever the number, names
or order of the input files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from . import schemas, sql
from .io import atomic_path, write_json

log = logging.getLogger("eagle3_data.merge")

OVERFLOW_MODES = ("truncate", "drop")


def _paths(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [str(Path(p)) for p in paths]


def merge(
    validated_paths,
    out_paths,
    manifest_path,
    *,
    datasets=None,
    max_samples=None,
    max_len: int,
    overflow: str = "truncate",
    seed: int | str = 0,
    memory_limit: str = "2GB",
    threads: int | None = None,
    temp_dir: str | os.PathLike | None = None,
    batch_rows: int = 1024,
    check: bool = True,
) -> dict:
    """Merge VALIDATED parquet files into ``len(out_paths)`` MERGED shards balanced by token count.

    Args:
        validated_paths: VALIDATED parquet files (``schemas.VALIDATED``; ``input_ids`` list<int32>,
            ``loss_mask`` list<int8>), any number, any order.
        out_paths: merged shard paths, one per shard (K = len). Each gets ``schemas.MERGED`` rows
            (``num_tokens`` and ``num_supervised`` after truncation, ``truncated`` flag), written to a
            temporary name and renamed; a shard with no rows is still written (empty table).
        manifest_path: JSON manifest: ``shards`` (path, samples, tokens, supervised_tokens, truncated,
            datasets {name: samples}), ``totals``, ``datasets`` (per dataset: input samples/tokens and
            kept/dropped counts by reason), ``inputs`` (files), ``settings``.
        datasets: names to keep (``None`` = all). A name with no rows in the inputs is logged and listed
            in the manifest under ``missing_datasets``.
        max_samples: ``{dataset: n}`` caps; the first n of the dataset in the seeded shuffle order are kept
            (after dedup and the max_len rule, so a cap yields n usable samples when there are n).
        max_len: token cap per sample (>= 1).
        overflow: ``"truncate"`` (cut ``input_ids`` and ``loss_mask`` to max_len; drop the sample if no
            supervised token remains) or ``"drop"`` (drop samples longer than max_len).
        seed: shuffle seed (int or str; part of the shuffle key).
        memory_limit, threads, temp_dir: DuckDB settings (spill directory defaults to a temporary
            directory next to the first output).
        batch_rows: rows per streamed record batch.
        check: run ``schemas.check`` (arrow schema + pandera values) on every batch written.

    Returns: the manifest dict.

    Raises:
        ValueError: bad arguments, no input files, or one ``(dataset, sample_id)`` with two different
            ``input_ids`` (the message names the id and the files).
        schemas.SchemaError: a merged batch breaks the MERGED contract.
    """
    files = _paths(validated_paths)
    outs = _paths(out_paths)
    if not files:
        raise ValueError("merge: no validated input files")
    if not outs:
        raise ValueError("merge: out_paths is empty; need at least one merged shard")
    if len(set(outs)) != len(outs):
        raise ValueError(f"merge: out_paths has duplicates: {outs}")
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

    t0 = time.perf_counter()
    k = len(outs)
    with contextlib.ExitStack() as stack:
        for o in outs:
            Path(o).parent.mkdir(parents=True, exist_ok=True)
        spill = temp_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix=".merge-spill-", dir=Path(outs[0]).parent)
        )
        con = stack.enter_context(contextlib.closing(duckdb.connect()))
        con.execute(f"SET memory_limit = '{memory_limit}'")
        con.execute("SET temp_directory = ?", [str(spill)])
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        sql.set_variables(con, validated_files=files, datasets=datasets)
        sql.set_variables(con, max_samples={k_: int(v) for k_, v in max_samples.items()})
        con.execute("SET VARIABLE max_len = ?::BIGINT", [max_len])
        con.execute("SET VARIABLE num_shards = ?::BIGINT", [k])
        con.execute("SET VARIABLE overflow = ?::VARCHAR", [overflow])
        con.execute("SET VARIABLE seed = ?::VARCHAR", [str(seed)])

        con.execute(sql.load("merge_plan"))
        conflicts = con.sql(sql.load("merge_conflicts")).fetchall()
        if conflicts:
            lines = [f"  {ds}/{sid}: {n} versions in {fl}" for ds, sid, n, fl in conflicts]
            raise ValueError(
                "merge: the same (dataset, sample_id) occurs with different input_ids:\n" + "\n".join(lines)
            )
        t_plan = time.perf_counter() - t0

        stats = con.sql(sql.load("merge_stats")).fetchall()
        drops = con.sql(sql.load("merge_drops")).fetchall()

        # Stream rows in (shard, shuffle_key) order into one writer per shard.
        reader = con.sql(sql.load("merge_rows")).to_arrow_reader(batch_rows)
        written = {i: 0 for i in range(k)}
        state: dict = {"shard": None, "stack": None, "writer": None}

        def open_shard(i: int) -> None:
            s = contextlib.ExitStack()
            tmp = s.enter_context(atomic_path(outs[i]))
            state.update(shard=i, stack=s, writer=pq.ParquetWriter(tmp, schemas.MERGED, compression="zstd"))

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

        next_empty = 0
        try:
            for batch in reader:
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
                        for j in range(next_empty, i):  # shards that got no rows
                            schemas.write_checked(schemas.empty(schemas.MERGED), "merged", outs[j])
                        next_empty = i + 1
                        open_shard(i)
                    part = tbl.slice(start, end - start).cast(schemas.MERGED)
                    if check:
                        schemas.check(part, "merged", outs[i])
                    state["writer"].write_table(part)
                    written[i] += part.num_rows
                    start = end
            close_shard()
            for j in range(next_empty, k):
                schemas.write_checked(schemas.empty(schemas.MERGED), "merged", outs[j])
        except BaseException:
            abort()
            raise

    manifest = _manifest(outs, files, stats, drops, written, datasets, max_samples, max_len, overflow, seed)
    manifest["timing_s"] = {"plan": round(t_plan, 3), "total": round(time.perf_counter() - t0, 3)}
    write_json(manifest, manifest_path)
    tot = manifest["totals"]
    log.info(
        "merged %d samples (%d tokens, %d supervised) from %d files into %d shards in %.1fs; dropped %s",
        tot["samples"], tot["tokens"], tot["supervised_tokens"], len(files), k,
        manifest["timing_s"]["total"], tot["dropped"],
    )
    return manifest


def _manifest(outs, files, stats, drops, written, datasets, max_samples, max_len, overflow, seed) -> dict:
    shards = [
        {"path": p, "samples": 0, "tokens": 0, "supervised_tokens": 0, "truncated": 0, "datasets": {}}
        for p in outs
    ]
    for shard, ds, n, tok, sup, trunc in stats:
        s = shards[shard]
        s["samples"] += n
        s["tokens"] += tok
        s["supervised_tokens"] += sup
        s["truncated"] += trunc
        s["datasets"][ds] = n
    for i, s in enumerate(shards):
        if s["samples"] != written[i]:
            raise RuntimeError(f"merge: shard {outs[i]} has {written[i]} rows written, plan says {s['samples']}")
    per_ds: dict = {}
    for ds, decision, n, tok in drops:
        d = per_ds.setdefault(ds, {"input_samples": 0, "input_tokens": 0, "kept": 0, "dropped": {}})
        d["input_samples"] += n
        d["input_tokens"] += tok
        if decision == "kept":
            d["kept"] = n
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
        },
    }
