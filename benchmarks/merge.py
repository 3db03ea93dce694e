"""Merge benchmark: eagle3_data.merge vs a plain pyarrow read + write of the same validated shards.

    python benchmarks/merge.py [--tokens 20000000] [--files 8] [--shards 4]
    python benchmarks/merge.py --toy      # seconds: the same code at 200k tokens (what CI runs)

Builds synthetic VALIDATED shards (lognormal lengths, mean ~2,000 tokens, 1% duplicated samples), then in
separate processes (so peak RSS is per run): (1) the baseline: read every file with pyarrow and write the
rows back out as zstd parquet in ``--shards`` files; (2) merge of all the files; (3) merge of half the files
(peak memory at two data sizes). The merge writes the merged shards AND one selection per input file (what
extraction reads), as the workflow's merge does. ``merge_breakdown_s`` splits the merge's time (its
manifest's ``timing_s``): the plan (``plan_row_keys``: numpy's per-row md5 keys, lengths and supervised counts,
then DuckDB over them), the stats, then for the merged shards and for the selections each: waiting for the
batches (``*_read``: DuckDB's joined and sorted rows for the shards, the validated files read straight for the
selections), the MERGED check (``*_check``) and the casts and zstd parquet writes (``*_write``); the selections
are written in a second thread while the merged shards stream. ``bookkeeping_parts_wall_cpu_s`` times each part of the selections' bookkeeping
alone (fourth process, see :func:`parts`). Ends with one JSON line: seconds, tokens/s, ratio merge/baseline
(target <= 1.2), peak RSS at both sizes and their ratio (target: flat, <= 1.25), and, to read a run on a shared
machine, each run's CPU seconds (all its threads) and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def make_inputs(out_dir: Path, tokens: int, files: int, seed: int = 0) -> tuple[list[Path], int, int]:
    from eagle3_data import schemas

    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    mean = 2000
    n = max(files, int(tokens / mean))
    lengths = np.clip(rng.lognormal(np.log(mean) - 0.32, 0.8, n), 8, 16000).astype(np.int64)
    lengths = np.maximum(8, (lengths * tokens / lengths.sum()).astype(np.int64))
    paths, total = [], 0
    dup_src = None
    for f, idx in enumerate(np.array_split(np.arange(n), files)):
        lens = lengths[idx]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ids = rng.integers(0, 150_000, int(offsets[-1]), dtype=np.int32)
        prompt = (lens * rng.uniform(0.2, 0.8, len(lens))).astype(np.int64)
        mask = np.ones(int(offsets[-1]), dtype=np.int8)
        starts = offsets[:-1]
        for s, p in zip(starts, prompt):  # prompt part unsupervised
            mask[s : s + p] = 0
        id_lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
        mask_lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask))
        k = len(idx)
        cols = {
            "sample_id": pa.array([f"s{j}" for j in idx]),
            "dataset": pa.array([f"ds{j % 4}" for j in idx]),
            "input_ids": id_lists,
            "loss_mask": mask_lists,
            "num_tokens": pa.array(lens, pa.int64()),
            "num_prompt_tokens": pa.array(prompt, pa.int64()),
            "num_completion_tokens": pa.array(lens - prompt, pa.int64()),
            "ids_source": pa.array(["reconstructed"] * k),
            "billed_completion_tokens": pa.array(lens - prompt, pa.int64()),
            "finish_reason": pa.array(["stop"] * k),
            "backend": pa.array(["b"] * k),
            "provider": pa.array(["p"] * k),
            "cost_usd": pa.array(np.zeros(k)),
        }
        # every VALIDATED column, in its order (columns the stage added later, e.g. billed_prompt_tokens: null)
        table = pa.table({f.name: cols.get(f.name, pa.nulls(k, f.type)) for f in schemas.VALIDATED}).cast(
            schemas.VALIDATED
        )
        if dup_src is None:
            dup_src = table.slice(0, max(1, k // 100))
        elif f == files - 1:  # 1% of samples repeated under other ids (dedup has work to do)
            d = dup_src.set_column(0, "sample_id", pa.array([f"dup{j}" for j in range(dup_src.num_rows)]))
            table = pa.concat_tables([table, d])
        p = out_dir / f"{f:03d}.parquet"
        pq.write_table(table, p, compression="zstd")
        paths.append(p)
        total += int(pc_sum(table.column("num_tokens")))
    return paths, total, n


def pc_sum(col) -> int:
    import pyarrow.compute as pc

    return pc.sum(col).as_py()


def worker(kind: str, inputs: list[str], out_dir: str, shards: int) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    if kind == "parts":
        return {"parts": parts(inputs)}
    if kind == "baseline":
        rows = 0
        tables = [pq.read_table(p) for p in inputs]
        table = pa.concat_tables(tables)
        for k, idx in enumerate(np.array_split(np.arange(table.num_rows), shards)):
            pq.write_table(table.take(pa.array(idx)), Path(out_dir) / f"{k:03d}.parquet", compression="zstd")
            rows += len(idx)
    else:
        from eagle3_data.merge import MergeResources, merge

        outs = [Path(out_dir) / f"{k:03d}.parquet" for k in range(shards)]
        sels = [Path(out_dir) / "selection" / Path(p).name for p in inputs]
        from eagle3_data.settings import MergeSettings

        # DuckDB: 2 GB and its own thread count (threads=0), as this benchmark measured before merge took settings
        man = merge(
            inputs,
            outs,
            Path(out_dir) / "manifest.json",
            selections=sels,
            settings=MergeSettings.defaults(max_len=8192, overflow="truncate", seed=0),
            resources=MergeResources(memory_limit="2GB", threads=0),
        )
        rows = man["totals"]["samples"]
        timing = man["timing_s"]
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"seconds": seconds, "cpu_s": time.process_time() - c0, "rows": rows, "peak_rss_mb": peak_kib / 1024}
    if kind != "baseline":
        out["timing_s"] = timing
    return out


def parts(inputs: list[str], max_len: int = 8192) -> dict:
    """The selections' bookkeeping, each part timed alone on the same inputs: ``{part: [wall_s, cpu_s]}``.

    DuckDB (its own thread count): the scan of both token lists (the floor every pass pays), md5 of each list
    as VARCHAR (the digests' per-row keys, the pre-numpy way), the supervised head ``list_sum(loss_mask[1:max_len])``
    on every row (the pre-numpy way), the whole ``merge_row_keys.sql`` query (the fallback); numpy: the same row
    keys (:func:`eagle3_data.merge.keys.row_keys`, what the merge runs); the selections' rows as
    ``merge_selection_rows.sql`` streams them (join + sort) vs read straight from the files (no writes in either).
    """
    import threading

    import duckdb

    from eagle3_data.merge import keys as K
    from eagle3_data.merge import write as W
    from eagle3_data import sql
    from eagle3_data.settings import MergeSettings

    def timed(fn) -> list[float]:
        w, c = time.perf_counter(), time.process_time()
        fn()
        return [round(time.perf_counter() - w, 3), round(time.process_time() - c, 3)]

    con = duckdb.connect()
    sql.set_variables(con, validated_files=inputs, datasets=None)
    con.execute("SET VARIABLE max_len = ?::BIGINT", [max_len])
    scan = "FROM read_parquet(getvariable('validated_files'))"
    out = {
        "duckdb_scan_token_lists": timed(
            lambda: con.execute(f"SELECT sum(len(input_ids)), sum(len(loss_mask)) {scan}").fetchall()
        ),
        "duckdb_md5_input_ids_varchar": timed(
            lambda: con.execute(f"SELECT max(md5(input_ids::VARCHAR)) {scan}").fetchall()
        ),
        "duckdb_md5_loss_mask_varchar": timed(
            lambda: con.execute(f"SELECT max(md5(loss_mask::VARCHAR)) {scan}").fetchall()
        ),
        "duckdb_supervised_head_every_row": timed(
            lambda: con.execute(f"SELECT sum(list_sum(loss_mask[1:getvariable('max_len')])) {scan}").fetchall()
        ),
        "duckdb_row_keys_query": timed(lambda: con.execute(sql.load("merge_row_keys"))),
        "numpy_row_keys": timed(lambda: K.row_keys(con, inputs, max_len=max_len, datasets=None, threads=None)),
    }
    # the plan, then the selections' rows both ways (read, not written)
    s = MergeSettings.defaults(max_len=max_len, overflow="truncate", seed=0)
    sql.set_variables(con, max_samples={})
    con.execute("SET VARIABLE num_shards = 4::BIGINT")
    con.execute("SET VARIABLE overflow = ?::VARCHAR", [s.overflow])
    con.execute("SET VARIABLE seed = '0'")
    con.execute(
        "CREATE TEMP TABLE merge_sources AS SELECT unnest(?::VARCHAR[]) AS filename, "
        "unnest(?::VARCHAR[]) AS source, unnest(range(?)) AS idx",
        [inputs, inputs, len(inputs)],
    )
    out["duckdb_plan_over_row_keys"] = timed(lambda: con.execute(sql.load("merge_plan")))
    out["duckdb_selection_digests"] = timed(lambda: con.execute(sql.load("merge_selections")).fetchall())

    def old_rows():
        for _ in con.sql(sql.load("merge_selection_rows")).to_arrow_reader(1024):
            pass

    def new_rows():
        plan = con.sql(sql.load("merge_selection_plan")).to_arrow_table()
        plan = {n: plan.column(n).to_numpy() for n in plan.column_names}
        for _ in W.selection_batches(inputs, inputs, plan, max_len, 1024, threading.Event()):
            pass

    out["selection_rows_duckdb_join_sort"] = timed(old_rows)
    out["selection_rows_from_files"] = timed(new_rows)
    return out


def run_worker(kind: str, inputs, out_dir: Path, shards: int) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--_worker",
        kind,
        "--_out",
        str(out_dir),
        "--shards",
        str(shards),
        "--_inputs",
        *map(str, inputs),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--toy", action="store_true", help="200k tokens in 4 files: seconds (CI runs it)")
    ap.add_argument("--_worker")
    ap.add_argument("--_out")
    ap.add_argument("--_inputs", nargs="*")
    a = ap.parse_args()
    if a._worker:
        print(json.dumps(worker(a._worker, a._inputs, a._out, a.shards)))
        return
    if a.toy:
        a.tokens, a.files, a.shards = 200_000, 4, 2
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as tmp:
        tmp = Path(tmp)
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        inputs, tokens, samples = make_inputs(tmp / "validated", a.tokens, a.files)
        gen_s = time.perf_counter() - t0
        half = inputs[: len(inputs) // 2]
        half_tokens = sum(pc_sum(pq.read_table(p, columns=["num_tokens"]).column("num_tokens")) for p in half)
        base = run_worker("baseline", inputs, tmp / "base", a.shards)
        full = run_worker("merge", inputs, tmp / "full", a.shards)
        small = run_worker("merge", half, tmp / "half", a.shards)
        book = run_worker("parts", inputs, tmp / "parts", a.shards)["parts"]
    ratio = full["seconds"] / base["seconds"]
    mem_ratio = full["peak_rss_mb"] / small["peak_rss_mb"]
    print(
        json.dumps(
            {
                "benchmark": "merge",
                "toy": a.toy,
                "input_tokens": tokens,
                "input_samples": samples,
                "files": len(inputs),
                "shards": a.shards,
                "generate_s": round(gen_s, 1),
                "baseline_pyarrow_s": round(base["seconds"], 2),
                "merge_s": round(full["seconds"], 2),
                "merge_tokens_per_s": round(tokens / full["seconds"]),
                "ratio_merge_vs_baseline": round(ratio, 2),
                "target_ratio_max": 1.2,
                "ratio_ok": ratio <= 1.2,
                "cpu_s": {"baseline": round(base["cpu_s"], 2), "merge": round(full["cpu_s"], 2)},
                "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "merge_breakdown_s": full["timing_s"],
                "bookkeeping_parts_wall_cpu_s": book,
                "peak_rss_mb": {
                    "baseline": round(base["peak_rss_mb"]),
                    "merge_half": round(small["peak_rss_mb"]),
                    "merge_full": round(full["peak_rss_mb"]),
                },
                "tokens_half_vs_full": [half_tokens, tokens],
                "merge_memory_ratio_full_vs_half": round(mem_ratio, 2),
                "target_memory_ratio_max": 1.25,
                "memory_flat": mem_ratio <= 1.25,
                "merged_samples": full["rows"],
            }
        )
    )


if __name__ == "__main__":
    main()
