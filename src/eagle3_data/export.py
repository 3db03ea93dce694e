"""Export stage: one merged shard (the shuffled order) -> the per-sample files trainers read.

The hidden states live in one file per merge selection (``results/hidden_states/<dataset>/<shard>.safetensors``,
written by the extract stage); a merged shard's ``source`` column names, for each row, the selection holding
its states. Export walks the merged shard in order and reads each sample's rows from its selection's file
(memory-mapped: a sample costs its own bytes), so the merged, shuffled set is an index over the extracted
states and a reshuffle never re-extracts anything.

Layouts (each file written to a temporary name and renamed; file names use the GLOBAL sample index, i.e.
``start_index`` + the sample's row in the merged shard, so shards export independently into one directory):

``specforge`` (SpecForge offline EAGLE-3 trainer, ``OfflineEagle3Dataset``):
    ``<out_dir>/rows_{g}-{g+group_size}/data_{i}.ckpt`` written with ``torch.save`` holding
    ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``aux_hidden_state`` [1, T, A*H] and ``hidden_state``
    [1, T, H] (post-norm final state) in the extract dtype. SpecForge finds ``*.ckpt`` recursively, so
    ``<out_dir>`` is its ``--train-hidden-states-path``. Needs ``final_norm == "post"`` (SpecForge applies the
    target lm_head to ``hidden_state`` directly).

``speculators`` (vllm-project/speculators offline data, ``ArrowDataset`` + ``FileTransfer``):
    ``<out_dir>/hidden_states/hs_{i}.safetensors`` holding ``token_ids`` [T] int64 and ``hidden_states``
    [T, A+1, H] (the A auxiliary layers then the final state; the trainer reads ``[:, :-1].flatten(1)`` and
    ``[:, -1]``). speculators takes ``loss_mask`` from its own arrow dataset, not from this file: each shard
    also writes ``<out_dir>/samples_{start}.parquet`` (``index``, ``sample_id``, ``dataset``, ``input_ids``,
    ``loss_mask``, ``seq_len``) to build it from. Needs ``final_norm == "pre"`` (speculators applies the
    target's norm before its lm_head); pass ``allow_norm_mismatch=True`` to export anyway.

Held-out set (``merge.heldout`` > 0): the merge's held-out file (``results/merged/heldout.parquet``, MERGED rows
indexing the same hidden-states files through ``source``) is exported the same way, indices from 0, by rule
``export_heldout`` into ``results/export/heldout/<layout>/``: beside the training directories, never under
them, since SpecForge collects ``*.ckpt`` recursively under its training path (its evaluation path is
``--eval-hidden-states-path``). Call with ``heldout=True``: the set's size for pruning is the manifest's
``heldout.samples``.

Storage savers are undone on export (fp8 auxiliary states dequantised to the extract dtype; final-state rows
not stored are written as zeros: they are never read by the loss, see ``extract.layout``).

Staleness: with ``merge_manifest``, every hidden-states file read must carry the manifest's digest of its
selection (the workflow reruns an extract job when that digest changes; a file computed for another
selection, e.g. after ``--rerun-triggers mtime`` skipped the rerun, is refused by name). The trainers read
every file in ``<out_dir>``, so a file an earlier export left there (the merged set shrank, a shard's start
moved, ``group_size`` changed) would be trained on: each shard's job removes the files of its own indices
that are not where this export puts them, and the last shard's job every file past the set's end
(:func:`prune_stale`; shards own disjoint index ranges, so jobs running at once never remove each other's).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .extract.layout import StatesFile
from .io import atomic_path, write_json, write_parquet

if TYPE_CHECKING:
    from .settings import ExportSettings

log = logging.getLogger("eagle3_data.export")

LAYOUTS = ("specforge", "speculators")
REQUIRED_NORM = {"specforge": "post", "speculators": "pre"}


def specforge_path(out_dir, index: int, group_size: int) -> Path:
    """Where SpecForge's ``prepare_hidden_states.py`` puts sample ``index``: ``rows_{g}-{g+size}/data_{i}.ckpt``."""
    g = (index // group_size) * group_size
    return Path(out_dir) / f"rows_{g}-{g + group_size}" / f"data_{index}.ckpt"


def speculators_path(out_dir, index: int) -> Path:
    """Where speculators' ``FileTransfer`` looks for sample ``index``: ``hidden_states/hs_{i}.safetensors``."""
    return Path(out_dir) / "hidden_states" / f"hs_{index}.safetensors"


class StatesIndex:
    """The hidden-states files of a merged set, opened on first use: ``get(source, sample_id)`` -> the sample's
    tensors (``StatesFile.sample``). ``states_dir/<source>.safetensors`` holds selection ``source``.

    With ``selections`` (the merge manifest's ``selections`` mapping) each file's ``selection_digest`` must
    equal the manifest's, else ValueError naming the file (stale states)."""

    def __init__(self, states_dir, selections: dict | None = None):
        self.dir = Path(states_dir)
        self.selections = selections
        self.files: dict[str, StatesFile] = {}

    def file(self, source: str) -> StatesFile:
        f = self.files.get(source)
        if f is None:
            path = self.dir / f"{source}.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"export: no hidden states for selection {source!r}: {path} is missing")
            f = StatesFile(path)
            if self.selections is not None:
                want = (self.selections.get(source) or {}).get("digest")
                got = f.meta.get("selection_digest")
                if want != got:
                    raise ValueError(
                        f"export: {path} holds the states of another selection (digest {got!r}, the merge says "
                        f"{want!r}): re-extract it (snakemake --forcerun {path}); the extract rule reruns by itself "
                        "unless --rerun-triggers leaves out params"
                    )
            self.files[source] = f
        return f

    def get(self, source: str, sample_id: str) -> tuple[dict, StatesFile]:
        f = self.file(source)
        j = f.index.get(sample_id)
        if j is None:
            raise KeyError(f"export: sample {sample_id!r} is not in {f.path}")
        return f.sample(j), f

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def export(
    merged_path,
    out_dir,
    *,
    settings: "ExportSettings",
    layout: str,
    states_dir,
    merge_manifest=None,
    start_index: int = 0,
    manifest_path=None,
    heldout: bool = False,
    provenance=None,
) -> dict:
    """Write the samples of one merged shard, in its order, in a trainer's per-sample layout (module docstring).

    Args:
        merged_path: a MERGED parquet shard (``sample_id``, ``dataset``, ``input_ids``, ``source``).
        out_dir: the layout's root directory (shared by all shards).
        settings: :class:`~eagle3_data.settings.ExportSettings` (the ``export`` section): ``group_size``
            (SpecForge's ``--file-group-size``: files per ``rows_*`` directory) and ``allow_norm_mismatch``
            (export even when the files' ``final_norm`` is not what the trainer expects).
        layout: ``specforge`` | ``speculators``.
        states_dir: directory of the hidden-states files (``<states_dir>/<source>.safetensors``).
        merge_manifest: the merge manifest (path or dict), to refuse stale hidden-states files.
        start_index: global index of this shard's first sample (samples of the merged shards before it;
            :func:`start_indices` computes it from the merge manifest).
        manifest_path: optional JSON written last (atomically): layout, set (``train`` | ``heldout``), source,
            start/end index, files, tokens, removed_stale (files of an earlier export removed,
            :func:`prune_stale`; only with ``merge_manifest``), seconds. Snakemake uses it as the rule's output.
        heldout: ``merged_path`` is the held-out set (one file, ``start_index`` 0; the set's size for
            :func:`prune_stale` is the manifest's ``heldout.samples``, not the training shards' total).
        provenance: the merged set's provenance table (``results/merged/provenance.parquet``,
            :mod:`eagle3_data.provenance`): the speculators side table ``samples_*.parquet`` gets its columns
            (:data:`eagle3_data.provenance.SIDE_COLUMNS`: source file and row, target fingerprint, backend, engine,
            model, provider, sampling, chat-template hash, request key, generation id, cost, attempts) per sample.

    Returns: the manifest dict.

    Raises: ValueError (unknown layout, wrong final-norm convention, a stale or foreign hidden-states file, a
        sample whose stored ids differ from the merged row's), FileNotFoundError / KeyError (a selection's file
        or a sample missing).
    """
    import torch

    group_size, allow_norm_mismatch = settings.group_size, settings.allow_norm_mismatch

    if layout not in LAYOUTS:
        raise ValueError(f"export layout must be one of {LAYOUTS}, got {layout!r}")
    if start_index < 0 or group_size < 1:
        raise ValueError(f"export: start_index must be >= 0 and group_size >= 1, got {start_index}, {group_size}")
    t0 = time.perf_counter()
    table = pq.read_table(merged_path, columns=["sample_id", "dataset", "input_ids", "loss_mask", "source"])
    sample_ids = table.column("sample_id").to_pylist()
    datasets = table.column("dataset").to_pylist()
    sources = table.column("source").to_pylist()
    ids_col = table.column("input_ids").combine_chunks()
    offs = ids_col.offsets.to_numpy()
    flat_ids = ids_col.values.to_numpy(zero_copy_only=False)
    selections = None
    if merge_manifest is not None:
        m = json.loads(Path(merge_manifest).read_text()) if not isinstance(merge_manifest, dict) else merge_manifest
        selections = m.get("selections") or {}
    index = StatesIndex(states_dir, selections)
    out_dir = Path(out_dir)
    n = len(sample_ids)
    files, tokens, norms, spec_rows = [], 0, set(), {"ids": [], "mask": []}
    try:
        for j in range(n):
            if sources[j] is None:
                raise ValueError(f"{merged_path}: row {j} ({sample_ids[j]!r}) has no source selection")
            t, sf = index.get(sources[j], sample_ids[j])
            norm = sf.meta.get("final_norm", "post")
            if norm not in norms:
                norms.add(norm)
                if norm != REQUIRED_NORM[layout] and not allow_norm_mismatch:
                    raise ValueError(
                        f"{sf.path}: final hidden state is {norm}-norm but {layout} expects "
                        f"{REQUIRED_NORM[layout]}-norm; extract with extract.final_norm: {REQUIRED_NORM[layout]} "
                        "(or pass allow_norm_mismatch)"
                    )
            want = flat_ids[offs[j]:offs[j + 1]]
            if not np.array_equal(t["input_ids"].numpy(), want):
                raise ValueError(f"{sf.path}: sample {sample_ids[j]!r} holds other token ids than {merged_path} row {j}")
            idx = start_index + j
            L = len(want)
            tokens += L
            if layout == "specforge":
                path = specforge_path(out_dir, idx, group_size)
                record = {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
                          "aux_hidden_state": t["aux_hidden_states"].unsqueeze(0),
                          "hidden_state": t["hidden_states"].unsqueeze(0)}
                # through a file object: torch.save names the archive inside after a path's file name, which
                # is a random temporary name here; "archive" keeps two exports of the same states byte-identical
                with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                    torch.save(record, fh)
            else:
                from safetensors.torch import save_file

                H = int(sf.meta["hidden_size"])
                A = len(json.loads(sf.meta["layers"]))
                path = speculators_path(out_dir, idx)
                stacked = torch.cat([t["aux_hidden_states"].reshape(L, A, H), t["hidden_states"].unsqueeze(1)],
                                    dim=1).contiguous()
                with atomic_path(path) as tmp:
                    save_file({"token_ids": t["input_ids"], "hidden_states": stacked}, str(tmp),
                              metadata={"sample_id": sample_ids[j], "source": str(sf.path)})
                spec_rows["ids"].append(t["input_ids"].tolist())
                spec_rows["mask"].append(t["loss_mask"].tolist())
            files.append(str(path))
    finally:
        index.close()
    if layout == "speculators" and n:  # (an empty shard shares its start with the next one: it writes none)
        table = pa.table({
            "index": pa.array(range(start_index, start_index + n), pa.int64()),
            "sample_id": pa.array(sample_ids, pa.string()),
            "dataset": pa.array(datasets, pa.string()),
            "input_ids": pa.array(spec_rows["ids"], pa.list_(pa.int64())),
            "loss_mask": pa.array(spec_rows["mask"], pa.list_(pa.int64())),
            "seq_len": pa.array([len(x) for x in spec_rows["ids"]], pa.int64()),
        })
        if provenance is not None:
            table = _with_provenance(table, provenance, "heldout" if heldout else "train", merged_path)
        write_parquet(table, out_dir / f"samples_{start_index:09d}.parquet")
    removed = []
    if merge_manifest is not None:
        if heldout:
            total = int((m.get("heldout") or {}).get("samples", n))
        else:
            total = sum(int(sh["samples"]) for sh in m.get("shards") or [])
        removed = prune_stale(out_dir, layout, start=start_index, end=start_index + n, total=total,
                              group_size=group_size)
        if removed:
            log.info("removed %d file(s) of an earlier export that this one does not write (e.g. %s)",
                     len(removed), removed[0])
    manifest = {
        "layout": layout,
        "set": "heldout" if heldout else "train",
        "source": str(merged_path),
        "out_dir": str(out_dir),
        "start_index": start_index,
        "end_index": start_index + n,
        "num_samples": n,
        "num_tokens": tokens,
        "final_norm": sorted(norms)[0] if len(norms) == 1 else sorted(norms),
        "files": files,
        "removed_stale": len(removed),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if manifest_path is not None:
        write_json(manifest, manifest_path)
    log.info("exported %d samples (%d tokens) of %s as %s into %s", n, tokens, merged_path, layout, out_dir)
    return manifest


def _with_provenance(table: pa.Table, provenance, set_name: str, merged_path) -> pa.Table:
    """``table`` (a shard's side table: ``index``, ``sample_id``, ...) with the provenance columns of its rows
    (:data:`eagle3_data.provenance.SIDE_COLUMNS`, matched by ``index`` in ``set_name``). Raises ValueError when the
    provenance table names other samples at those indices (it is of another merge)."""
    from .provenance import SIDE_COLUMNS

    idx = table.column("index").to_pylist()
    prov = pq.read_table(provenance, columns=["set", "index", "sample_id", *SIDE_COLUMNS],
                         filters=[("set", "=", set_name), ("index", ">=", idx[0]), ("index", "<=", idx[-1])])
    prov = prov.sort_by("index")
    if prov.column("index").to_pylist() != idx or prov.column("sample_id").to_pylist() != table.column(
            "sample_id").to_pylist():
        raise ValueError(f"export: {provenance} does not describe the rows of {merged_path} (another merge's?): "
                         "rerun rule provenance")
    for name in SIDE_COLUMNS:
        table = table.append_column(prov.schema.field(name), prov.column(name))
    return table


_INDEX = {"specforge": re.compile(r"^data_(\d+)\.ckpt$"), "speculators": re.compile(r"^hs_(\d+)\.safetensors$")}
_GROUP = re.compile(r"^rows_(\d+)-(\d+)$")
_SAMPLES = re.compile(r"^samples_(\d+)\.parquet$")


def prune_stale(out_dir, layout: str, *, start: int, end: int, total: int, group_size: int) -> list[str]:
    """Remove the files of an earlier export in ``out_dir`` that this export does not write, among those this
    shard owns: sample indices in ``[start, end)`` (its rows) and, for the shard that ends the set
    (``end >= total``), every index from ``total`` on. A sample file is stale when its index is owned and it is not
    at the path this export gives it (SpecForge: another ``rows_*`` grouping; any layout: an index past the set's
    end); a speculators ``samples_{s}.parquet`` is stale when ``s`` is owned and is not this shard's ``start``.
    Only the ``rows_*`` directories whose range meets the owned indices are listed. Returns the removed paths."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    total = max(total, end)  # never what this shard itself writes
    last = end >= total

    def owned(i: int) -> bool:
        return start <= i < end or (last and i >= total)

    removed = []

    def rm(p: Path) -> None:
        p.unlink(missing_ok=True)  # (two empty last shards may both own the indices past the end)
        removed.append(str(p))

    top = list(os.scandir(out_dir))
    if layout == "specforge":
        for d in top:
            m = _GROUP.match(d.name)
            if not (m and d.is_dir()):
                continue
            lo, hi = int(m.group(1)), int(m.group(2))
            if not (lo < end and hi > start) and not (last and hi > total):
                continue
            for f in os.scandir(d.path):
                k = _INDEX["specforge"].match(f.name)
                if k and owned(i := int(k.group(1))) and (
                        i >= total or Path(f.path) != specforge_path(out_dir, i, group_size)):
                    rm(Path(f.path))
    else:
        if last and (out_dir / "hidden_states").is_dir():
            for f in os.scandir(out_dir / "hidden_states"):
                k = _INDEX["speculators"].match(f.name)
                if k and int(k.group(1)) >= total:
                    rm(Path(f.path))
        for f in top:
            m = _SAMPLES.match(f.name)
            if m and owned(s := int(m.group(1))) and not (s == start and start < end):
                rm(Path(f.path))
    return removed


def start_indices(merge_manifest) -> list[int]:
    """Global index of the first sample of each merged shard, from the merge manifest (path or dict)."""
    m = json.loads(Path(merge_manifest).read_text()) if not isinstance(merge_manifest, dict) else merge_manifest
    out, acc = [], 0
    for s in m["shards"]:
        out.append(acc)
        acc += int(s["samples"])
    return out


#: the files of a speculators data directory that ``datasets.Dataset.save_to_disk(num_shards=1)`` writes
SPECULATORS_DATASET_FILES = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")


def write_speculators_dataset(out_dir, *, token_frequencies=None) -> dict:
    """Make ``out_dir`` (a speculators export) a data path speculators trains on as it is.

    speculators' ``ArrowDataset`` (speculators/train/data.py) loads its rows with ``datasets.load_from_disk(data
    path)`` and the states of row ``i`` from ``<data path>/hidden_states/hs_{i}.safetensors``. This writes that
    dataset from the ``samples_*.parquet`` files of every exported shard, in global index order: ``input_ids`` and
    ``loss_mask`` (int64 lists: speculators compares them with ``torch.equal`` against the files' int64
    ``token_ids``), ``seq_len`` (int64), torch format, one arrow file (:data:`SPECULATORS_DATASET_FILES`, each
    written to a temporary name and renamed). With ``token_frequencies`` (the vocab stage's
    ``token_frequencies.parquet``: ``token_id``, ``count`` over supervised tokens) it also writes
    ``token_freq.pt`` ({token id: count}), which speculators' training reads from the data path to build its draft
    vocabulary (speculators/train/cli.py).

    Returns ``{samples, tokens, files}``. Raises ValueError when the shards' indices are not ``0..N-1`` without
    gap or repeat (a shard's export is missing or stale), naming the first missing index.
    """
    import datasets
    import torch

    out_dir = Path(out_dir)
    parts = sorted(out_dir.glob("samples_*.parquet"), key=lambda p: int(_SAMPLES.match(p.name).group(1)))
    tables = [pq.read_table(p, columns=["index", "input_ids", "loss_mask", "seq_len"]) for p in parts]
    table = pa.concat_tables(tables) if tables else pa.table(
        {"index": pa.array([], pa.int64()), "input_ids": pa.array([], pa.list_(pa.int64())),
         "loss_mask": pa.array([], pa.list_(pa.int64())), "seq_len": pa.array([], pa.int64())})
    index = table.column("index").to_numpy()
    if not np.array_equal(index, np.arange(len(index))):
        gap = next(i for i, v in enumerate(np.append(index, -1)) if v != i)
        raise ValueError(f"export: {out_dir} has no sample {gap} in its samples_*.parquet files (a shard's export "
                         "is missing): rerun the export")
    table = table.select(["input_ids", "loss_mask", "seq_len"]).cast(pa.schema(
        [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())]))
    ds = datasets.Dataset(table)
    ds.set_format("torch")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".dataset-", dir=out_dir) as tmp:
        ds.save_to_disk(tmp, num_shards=1)
        for name in SPECULATORS_DATASET_FILES:
            os.replace(Path(tmp) / name, out_dir / name)
    files = [str(out_dir / n) for n in SPECULATORS_DATASET_FILES]
    if token_frequencies is not None:
        freq = pq.read_table(token_frequencies, columns=["token_id", "count"]).to_pydict()
        with atomic_path(out_dir / "token_freq.pt") as tmp, open(tmp, "wb") as fh:
            torch.save(dict(zip(freq["token_id"], freq["count"])), fh)
        files.append(str(out_dir / "token_freq.pt"))
    return {"samples": len(index), "tokens": int(pc.sum(table.column("seq_len")).as_py() or 0), "files": files}
