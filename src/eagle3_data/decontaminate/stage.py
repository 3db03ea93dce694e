"""Rules ``minhash`` and ``decontaminate``: a prompts shard -> its MinHash signatures; a prompts shard -> the
prompts kept (PROMPTS rows, same order) + its rejects (stage ``decontaminate``).

A prompt's text here is its user and system messages (``content``), one text per message; the assistant turns of
the source (answers, which generate replaces or which answers: original trains on) are not compared.

Rejects (REJECTS rows, ``source_row`` kept):

- ``benchmark_overlap``: :class:`.overlap.OverlapIndex` matched a benchmark item; detail ``<benchmark> <item id>
  (<rule>[: N shared])``, e.g. ``humaneval HumanEval/0 (13-gram: 41 shared)``;
- ``near_duplicate``: the prompt nearly duplicates (:mod:`.near_dup`) a prompt of a dataset listed before its own
  in the config (with ``near_duplicates.within_dataset``, or of an earlier source row of its own dataset) (pre-tokenized datasets have no prompts and take no part; another ``answers`` mode of the same
  source, :func:`eagle3_data.config.lookup.two_modes_of_one_source`, is not compared); the first such prompt in that order
  (datasets in config order, then source row) is named: detail ``near-duplicate of <dataset>/<sample_id>
  (estimated Jaccard 0.93 >= 0.8)``. The prompt it duplicates is kept by this rule whatever becomes of it later,
  so which of a pair is dropped depends only on the config's dataset order, never on a shard count or on which
  job ran first. A prompt that overlaps a benchmark is rejected for that, not as a near-duplicate.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import schemas
from ..files import write_parquet
from .benchmarks import read_benchmark
from .near_dup import SIGNATURES, NearDuplicateFinder, shingles, signatures
from .overlap import OverlapIndex

if TYPE_CHECKING:
    from ..settings import DecontaminateSettings

log = logging.getLogger("eagle3_data.decontaminate")

STAGE = "decontaminate"
REASONS = ("benchmark_overlap", "near_duplicate")


def prompt_texts(messages_json: str | None) -> list[str]:
    """The texts a prompt is checked by: the ``content`` of its user and system messages, in order."""
    try:
        messages = json.loads(messages_json or "[]")
    except ValueError:
        return []
    return [
        m["content"]
        for m in messages
        if isinstance(m, dict)
        and m.get("role") in ("user", "system")
        and isinstance(m.get("content"), str)
        and m["content"].strip()
    ]


def minhash(prompts_path, out_path, *, settings: "DecontaminateSettings", log_: logging.Logger | None = None) -> dict:
    """Rule minhash: the MinHash signature of every prompt of a PROMPTS shard (:data:`.near_dup.SIGNATURES`, same
    row order; null for a prompt without a word), written atomically. Returns ``{rows, signed, seconds}``."""
    lg = log_ or log
    t0 = time.perf_counter()
    nd = settings.near_duplicates
    table = pq.read_table(prompts_path, columns=["sample_id", "source_row", "messages"])
    sets = [shingles(prompt_texts(m), int(nd["shingle"])) for m in table.column("messages").to_pylist()]
    sigs = signatures(sets, int(nd["num_perm"]), int(nd["seed"]))
    out = pa.table(
        {
            "sample_id": table.column("sample_id"),
            "source_row": table.column("source_row"),
            "signature": pa.array([None if s is None else s.tolist() for s in sigs], pa.list_(pa.uint32())),
        },
        schema=SIGNATURES,
    )
    write_parquet(out, out_path)
    summary = {
        "rows": table.num_rows,
        "signed": sum(s is not None for s in sigs),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    lg.info("minhash %s: %s", prompts_path, summary)
    return summary


def _signature_rows(paths: Sequence, with_rows: bool = False) -> list:
    """``(sample_id, signature)`` of every row of the signature files ``paths``, in source-row order (with
    ``with_rows``: ``(rows, source rows)``)."""
    parts = [pq.read_table(p) for p in paths]
    if not parts:
        return ([], []) if with_rows else []
    t = pa.concat_tables(parts)
    src = np.asarray(t.column("source_row").to_numpy(zero_copy_only=False))
    order = np.argsort(src, kind="stable")
    ids = t.column("sample_id").to_pylist()
    sigs = t.column("signature").to_pylist()
    rows = [(ids[i], None if sigs[i] is None else np.asarray(sigs[i], dtype=np.uint32)) for i in order]
    return (rows, [int(src[i]) for i in order]) if with_rows else rows


def _near_duplicates(
    nd: dict, dataset: str, ids: list, rows_src: list, signatures_path, earlier: Mapping[str, Sequence], prompts_path
) -> NearDuplicateFinder:
    """The shard's signatures (``signatures_path``, checked against the prompts' ``ids``) looked up in the earlier
    datasets' (``earlier``, in order), then, with ``within_dataset``, in its own dataset's earlier source rows."""
    own_table = pq.read_table(signatures_path)
    if own_table.column("sample_id").to_pylist() != ids:
        raise ValueError(
            f"decontaminate: {signatures_path} is not the signature file of {prompts_path} "
            "(other sample ids): rerun rule minhash"
        )
    sigs = [None if s is None else np.asarray(s, dtype=np.uint32) for s in own_table.column("signature").to_pylist()]
    finder = NearDuplicateFinder(
        sigs, threshold=float(nd["threshold"]), num_perm=int(nd["num_perm"]), seed=int(nd["seed"])
    )
    for ds, paths in earlier.items():
        if ds != dataset:
            finder.check(ds, _signature_rows(paths))
    if dataset in earlier and nd.get("within_dataset"):  # its own rows last: only an earlier source row counts
        rows, places = _signature_rows(earlier[dataset], with_rows=True)
        finder.check(dataset, rows, before=rows_src, positions=places)
    return finder


def decontaminate(
    prompts_path,
    out_path,
    rejects_path,
    *,
    settings: "DecontaminateSettings",
    dataset: str,
    benchmark_files: Sequence = (),
    signatures_path=None,
    earlier: Mapping[str, Sequence] | None = None,
    log_: logging.Logger | None = None,
) -> dict:
    """Drop a PROMPTS shard's benchmark overlaps and near-duplicates of earlier datasets' prompts (module docstring).

    ``benchmark_files``: one file per ``settings.benchmarks`` entry, same order (the rule's inputs; default: each
    entry's :func:`.benchmarks.benchmark_path`). With ``settings.near_duplicates.enabled``: ``signatures_path`` is
    this shard's signature file (rule minhash) and ``earlier`` maps each dataset before ``dataset`` (config order,
    in that order) to its signature files; with ``near_duplicates.within_dataset``, ``earlier`` also maps ``dataset``
    itself to the signature files of its every shard (this one's included), and a prompt nearly duplicating one of
    an earlier source row of its own dataset is rejected too. Writes the kept rows to ``out_path`` (PROMPTS, same order) and the
    rejects to ``rejects_path`` (REJECTS, stage ``decontaminate``), both checked and atomic. Returns ``{rows, kept,
    benchmark_overlap: {benchmark: n}, near_duplicate: {dataset: n}, seconds}``.
    """
    lg = log_ or log
    t0 = time.perf_counter()
    table = pq.read_table(prompts_path)
    schemas.check(table.slice(0, 0), "prompts", str(prompts_path))
    ids = table.column("sample_id").to_pylist()
    rows_src = table.column("source_row").to_pylist()
    texts = [prompt_texts(m) for m in table.column("messages").to_pylist()]
    reasons: dict[int, tuple[str, str]] = {}
    by_bench: Counter = Counter()
    by_dataset: Counter = Counter()

    if settings.benchmarks:
        files = list(benchmark_files) or [None] * len(settings.benchmarks)
        if len(files) != len(settings.benchmarks):
            raise ValueError(f"decontaminate: {len(files)} benchmark files for {len(settings.benchmarks)} benchmarks")
        items = [it for entry, f in zip(settings.benchmarks, files) for it in read_benchmark(entry, f)]
        index = OverlapIndex(items, settings.ngram, settings.min_shared_ngrams)
        for i, ts in enumerate(texts):
            m = index.match(ts)
            if m is not None:
                reasons[i] = ("benchmark_overlap", m.detail())
                by_bench[m.item.benchmark] += 1
        lg.info(
            "decontaminate %s: %d benchmark items (%s); %d prompt(s) overlap",
            prompts_path,
            len(index),
            ", ".join(e["name"] for e in settings.benchmarks),
            len(reasons),
        )

    nd = settings.near_duplicates
    if nd.get("enabled") and earlier:
        finder = _near_duplicates(nd, dataset, ids, rows_src, signatures_path, earlier, prompts_path)
        for i, (ds, sid, j) in sorted(finder.matches.items()):
            if i in reasons:
                continue
            reasons[i] = (
                "near_duplicate",
                f"near-duplicate of {ds}/{sid} (estimated Jaccard {j:.2f} >= {float(nd['threshold']):g})",
            )
            by_dataset[ds] += 1

    keep = np.ones(table.num_rows, dtype=bool)
    rejects = []
    for i, (reason, detail) in sorted(reasons.items()):
        keep[i] = False
        rejects.append(
            {
                "sample_id": ids[i],
                "dataset": dataset,
                "stage": STAGE,
                "reason": reason,
                "detail": detail[:2000],
                "source_row": rows_src[i],
            }
        )
    kept = table.filter(pa.array(keep)) if rejects else table
    schemas.write_checked(kept.cast(schemas.PROMPTS), "prompts", out_path)
    schemas.write_checked(schemas.from_rows(rejects, schemas.REJECTS), "rejects", rejects_path)
    summary = {
        "rows": table.num_rows,
        "kept": kept.num_rows,
        "benchmark_overlap": dict(sorted(by_bench.items())),
        "near_duplicate": dict(sorted(by_dataset.items())),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    lg.info("decontaminate %s: done: %s", prompts_path, summary)
    return summary


def benchmark_inputs(settings: "DecontaminateSettings") -> list[str]:
    """The benchmark files of ``settings`` (the decontaminate rule's inputs), in the config's order."""
    from .benchmarks import benchmark_path

    return [str(benchmark_path(e)) for e in settings.benchmarks]
