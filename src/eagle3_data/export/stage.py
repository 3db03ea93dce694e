"""Export stage: one merged shard (the shuffled order) -> the per-sample files trainers read.

The hidden states live in one file per merge selection (``results/hidden_states/<dataset>/<shard>.safetensors``,
written by the extract stage); a merged shard's ``source`` column names, for each row, the selection holding
its states. Export walks the merged shard in order and reads each sample's rows from its selection's file
(memory-mapped: a sample costs its own bytes), so the merged, shuffled set is an index over the extracted
states and a reshuffle never re-extracts anything. Each layout takes the layers of its drafter from the stored
union (the file's ``drafter_layers``) and the final-state form its trainer reads (``extract.final_norm: both``
serves both forms; :meth:`~eagle3_data.extract.StatesFile.final_rows`). T = a sample's tokens, H = hidden size,
A = EAGLE-3's auxiliary layers (3), F = DFlash's target layers (5 by default).

Layouts (:data:`CONTRACTS`; each file written to a temporary name and renamed; file names use the GLOBAL sample
index, i.e. ``start_index`` + the sample's row in the merged shard, so shards export independently into one
directory; ``g`` = the index rounded down to a multiple of ``group_size``):

``specforge`` (SpecForge 0.2.0 offline EAGLE-3: ``OfflineManifestReader`` + ``normalize_offline_sample``):
    ``<out_dir>/rows_{g}-{g+group_size}/data_{i}.ckpt`` written with ``torch.save`` holding
    ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``aux_hidden_state`` [1, T, A*H] and ``hidden_state``
    [1, T, H] (post-norm final state) in the extract dtype. SpecForge finds ``*.ckpt`` recursively, so
    ``<out_dir>`` is its ``--train-hidden-states-path``.

``specforge_dflash`` (SpecForge 0.2.0 DFlash, ``specforge/algorithms/common/dflash_family_data.py``:
``build_offline_reader`` keys ``input_ids``, ``loss_mask``, ``hidden_states``, ``normalize_offline_sample``):
    the same paths, holding ``input_ids`` [T] int64, ``loss_mask`` [T] int64 and ``hidden_states`` [1, T, F*H]
    (the DFlash layers' outputs, concatenated in the draft config's ``target_layer_ids`` order). SpecForge refuses
    a sample without two consecutive supervised tokens (``has_consecutive_supervised_tokens``, raised as a
    ValueError mid-training); export writes no file for such a sample and counts and names it (the manifest's
    ``skipped``, the log).

``specforge_dspark`` (SpecForge 0.2.0 DSpark: ``build_dspark_offline_reader``, ``normalize_dspark_offline_sample``):
    as ``specforge_dflash`` plus ``target_last_hidden_states`` [1, T, H], the post-norm final state (SpecForge
    applies the target's ``lm_head`` to it with no norm: ``specforge/algorithms/common/dflash_family_model.py``,
    ``_dspark_objective_chunk_terms``).

``speculators`` (vllm-project/speculators 0.9.0 offline data, ``ArrowDataset`` + ``FileTransfer``):
    ``<out_dir>/hidden_states/hs_{i}.safetensors`` holding ``token_ids`` [T] int64 and ``hidden_states``
    [T, A+1, H] (the A auxiliary layers then the final state, pre-norm: speculators applies the target's norm
    before its lm_head; the trainer reads ``[:, :-1].flatten(1)`` and ``[:, -1]``). speculators takes ``loss_mask``
    from its own arrow dataset, not from this file: each shard also writes ``<out_dir>/samples_{start}.parquet``
    (``index``, ``sample_id``, ``dataset``, ``input_ids``, ``loss_mask``, ``seq_len``) to build it from
    (:func:`write_speculators_dataset`).

``speculators_fp8`` (speculators' FP8 connector files: hs_connectors 0.9.0 ``FP8Transfer``,
``hs_connectors/fp8_utils.py``; train with ``--hidden-states-backend fp8``):
    as ``speculators`` with ``hidden_states`` [T, A+1, H] float8_e4m3fn and ``hidden_states_scales`` [T, 1, 1]
    float32, one scale per token over every layer (``amax / 448``, at least 1e-12, as its quantizer); value =
    ``fp8 * scale``. 4*H + 12 bytes per token: half the bfloat16 file.

``speculators_inplace`` (speculators 0.9.0 through this package's hs-connectors backend, :mod:`.inplace`; train with
``--hidden-states-backend eagle3_data``): no states copied. ``<out_dir>/samples_{start}.parquet`` as ``speculators``
plus ``source`` (the selection whose states file holds each sample), and ``<out_dir>/inplace.json`` (where the
states files are, the final-state form, the merge's digest of each selection). It reads no states file, so it is
written once the merge is done; the trainer reads each sample from ``results/hidden_states/`` when it asks for it.

``specforge_inplace`` (SpecForge 0.2.0's disaggregated offline trainer through this package's feature store,
:mod:`.inplace_specforge`): no states copied. ``<out_dir>/samples_{start}.parquet`` and ``inplace.json`` as
``speculators_inplace`` (final state post-norm), and, once every shard is exported, SpecForge's ref manifest
``<out_dir>/manifest.json`` (rule ``export_refs``); the store serves each ref the tensors of a ``specforge`` file.

``modelopt_inplace`` (Model-Optimizer 0.47's ``StreamingDataset`` subclassed, :mod:`.inplace_modelopt`): no states
copied. ``<out_dir>/samples_{start}.parquet`` and ``inplace.json`` as ``speculators_inplace`` (final state
post-norm); the dataset's ``_fetch`` reads each sample's states from ``results/hidden_states/``.

``modelopt`` (NVIDIA Model-Optimizer offline EAGLE-3 data: the dump of
``examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py``, read by
``OfflineSupervisedDataset`` in ``modelopt/torch/speculative/eagle/utils.py`` from every ``*.pt`` under
``--offline-data-path``, ``examples/speculative_decoding/eagle_utils.py``):
    ``<out_dir>/rows_{g}-{g+group_size}/{i}.pt`` written with ``torch.save`` holding ``input_ids`` [T] int64,
    ``hidden_states`` [T, H] (post-norm final state: HF ``hidden_states[-1]``), ``aux_hidden_states`` [T, A*H]
    (layer k's output = HF ``hidden_states[k + 1]``), ``loss_mask`` [T] int64 (1 on the supervised tokens: read
    with ``answer_only_loss``) and ``conversation_id`` (the sample id). The dumper names a file after its
    conversation id; here the global index names it (sample ids may hold characters a file name cannot), which the
    reader never reads.

Held-out set (``merge.heldout`` > 0): the merge's held-out file (``results/merged/heldout.parquet``, MERGED rows
indexing the same hidden-states files through ``source``) is exported the same way, indices from 0, by rule
``export_heldout`` into ``results/export/heldout/<layout>/``: beside the training directories, never under
them, since SpecForge collects ``*.ckpt`` recursively under its training path (its evaluation path is
``--eval-hidden-states-path``). Export it as ``MergedShard(path, heldout=True)``: the set's size for pruning is the
manifest's ``heldout.samples``.

Storage savers are undone on export (fp8 states dequantised to the extract dtype; final-state rows not stored
are written as zeros: they are never read by the loss, see ``extract.layout``); ``speculators_fp8`` quantises
again, per token.

Staleness: with ``merge_manifest``, every hidden-states file read must carry the manifest's digest of its
selection (the workflow reruns an extract job when that digest changes; a file computed for another
selection, e.g. after ``--rerun-triggers mtime`` skipped the rerun, is refused by name). The trainers read
every file in ``<out_dir>``, so a file an earlier export left there (the merged set shrank, a shard's start
moved, ``group_size`` changed, a sample now skipped) would be trained on: each shard's job removes the files of
its own indices that are not where this export puts them, and the last shard's job every file past the set's
end (:func:`prune_stale`; shards own disjoint index ranges, so jobs running at once never remove each other's).
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

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..files import atomic_path, write_json

from .layouts import CONTRACTS, INPLACE_FILES, SPECULATORS_DATASET_FILES, sample_path
from .writer import MergedShard, SampleWriter, ShardRows, StatesIndex, read_side_tables, write_side_table

if TYPE_CHECKING:
    from ..settings import ExportSettings

log = logging.getLogger("eagle3_data.export")


def export(
    shard,
    out_dir,
    *,
    settings: "ExportSettings",
    layout: str,
    states_dir,
    merge_manifest=None,
    manifest_path=None,
    final_form: str | None = None,
    provenance=None,
) -> dict:
    """Write the samples of one merged shard, in its order, in a trainer's per-sample layout (module docstring).

    Args:
        shard: the :class:`MergedShard` to export (its path, start index and set), or a MERGED parquet path
            (``MergedShard(path)``: a training shard starting at index 0).
        out_dir: the layout's root directory (shared by all shards).
        settings: :class:`~eagle3_data.settings.ExportSettings` (the ``export`` section): ``group_size``
            (SpecForge's ``--file-group-size``: files per ``rows_*`` directory).
        layout: one of :data:`LAYOUTS`.
        states_dir: directory of the hidden-states files (``<states_dir>/<source>.safetensors``).
        merge_manifest: the merge manifest (path or dict), to refuse stale hidden-states files.
        manifest_path: optional JSON written last (atomically): layout, set (``train`` | ``heldout``), source,
            start/end index, files, tokens, bytes (of the files written), the target and its layers the files
            hold, in the trainer's own numbering (``target``, ``target_layers``: :meth:`SampleWriter.manifest`),
            final_norm, final_state, skipped (``{reason: [sample ids]}``),
            removed_stale (files of an earlier export removed, :func:`prune_stale`; only with
            ``merge_manifest``), seconds. Snakemake uses it as the rule's output.
        final_form: write this final-state form instead of the layout's (tests that build a broken export).
        provenance: the merged set's provenance table (``results/merged/provenance.parquet``,
            :mod:`eagle3_data.provenance`): the speculators side table ``samples_*.parquet`` gets its columns
            (:data:`eagle3_data.provenance.SIDE_COLUMNS`: source file and row, target fingerprint, backend, engine,
            model, provider, sampling, chat-template hash, request key, generation id, cost, attempts) per sample.

    Returns: the manifest dict.

    Raises: ValueError (unknown layout; states without the drafter's layers or the final-state form the layout
        reads, naming ``extract.drafters`` / ``extract.final_norm``; a stale or foreign hidden-states file; a
        sample whose stored ids differ from the merged row's), FileNotFoundError / KeyError (a selection's file or
        a sample missing).
    """
    shard = shard if isinstance(shard, MergedShard) else MergedShard(shard)
    writer = SampleWriter(layout, out_dir, settings.group_size, shard, final_form)
    t0 = time.perf_counter()
    rows = ShardRows.read(shard.path)
    merged = _read_manifest(merge_manifest)
    index = StatesIndex(states_dir, None if merged is None else (merged.get("selections") or {}))
    try:
        for j in range(rows.n):
            writer.write(rows, j, index)
    finally:
        index.close()
    in_place = writer.contract["files"] in INPLACE_FILES
    if (in_place or writer.contract["files"] == "speculators") and writer.spec_rows["ids"]:
        # (an empty shard shares its start with the next one: it writes none)
        side = write_side_table(writer.spec_rows, writer.out_dir, shard, provenance)
        if in_place:  # what the data directory holds: its side tables only
            writer.nbytes += os.path.getsize(side)
    if in_place:
        write_inplace_index(writer.out_dir, layout, states_dir, merged, writer.final)
    _log_skipped(layout, shard.path, writer.skipped)
    removed = [] if merged is None else _prune_earlier(writer, rows, merged)
    manifest = writer.manifest(rows.n, removed, time.perf_counter() - t0)
    if manifest_path is not None:
        write_json(manifest, manifest_path)
    log.info(
        "exported %d samples (%d tokens, %d bytes) of %s as %s into %s",
        len(writer.files),
        writer.tokens,
        writer.nbytes,
        shard.path,
        layout,
        writer.out_dir,
    )
    return manifest


def write_inplace_index(out_dir, layout: str, states_dir, merged: dict | None, final: str) -> Path:
    """``<out_dir>/inplace.json`` of an in-place layout (:mod:`.inplace`): ``layout``, ``final`` (the final-state
    form served), ``states_dir`` (relative to ``out_dir``: the results tree can move as a whole) and ``selections``
    (``{source: {"digest"}}`` of the merge manifest ``merged``, so a states file of another selection is not
    served). Every shard's job writes the same file (atomically)."""
    path = Path(out_dir) / "inplace.json"
    selections = {k: {"digest": v.get("digest")} for k, v in ((merged or {}).get("selections") or {}).items()}
    rel = os.path.relpath(Path(states_dir).resolve(), Path(out_dir).resolve())
    info = {"layout": layout, "final": final, "states_dir": rel}
    write_json({**info, "selections": selections}, path)
    return path


def _read_manifest(merge_manifest) -> dict | None:
    """The merge manifest as a dict (``merge_manifest``: a path, a dict or None)."""
    if merge_manifest is None:
        return None
    return json.loads(Path(merge_manifest).read_text()) if not isinstance(merge_manifest, dict) else merge_manifest


def _log_skipped(layout: str, merged_path, skipped: dict) -> None:
    """Warn about the samples not written, per reason."""
    for reason, sids in skipped.items():
        log.warning(
            "export %s: %d sample(s) of %s not written (%s: SpecForge's DFlash family refuses a sample "
            "without two consecutive supervised tokens), e.g. %s",
            layout,
            len(sids),
            merged_path,
            reason,
            sids[:3],
        )


def _prune_earlier(writer: SampleWriter, rows: ShardRows, merged: dict) -> list[str]:
    """Remove the files of an earlier export this one does not write (:func:`prune_stale`), within the set's size
    the merge manifest ``merged`` gives (the held-out set's or the training shards'). Returns the removed paths."""
    start, n = writer.shard.start_index, rows.n
    skipped_ids = {s for v in writer.skipped.values() for s in v}
    skip_idx = {start + j for j in range(n) if rows.sample_ids[j] in skipped_ids}
    if writer.shard.heldout:
        total = int((merged.get("heldout") or {}).get("samples", n))
    else:
        total = sum(int(sh["samples"]) for sh in merged.get("shards") or [])
    removed = prune_stale(
        writer.out_dir,
        writer.layout,
        start=start,
        end=start + n,
        total=total,
        group_size=writer.group_size,
        skip=skip_idx,
    )
    if removed:
        log.info(
            "removed %d file(s) of an earlier export that this one does not write (e.g. %s)",
            len(removed),
            removed[0],
        )
    return removed


_INDEX = {
    "specforge": re.compile(r"^data_(\d+)\.ckpt$"),
    "modelopt": re.compile(r"^(\d+)\.pt$"),
    "speculators": re.compile(r"^hs_(\d+)\.safetensors$"),
}

_GROUP = re.compile(r"^rows_(\d+)-(\d+)$")

_SAMPLES = re.compile(r"^samples_(\d+)\.parquet$")


def prune_stale(
    out_dir, layout: str, *, start: int, end: int, total: int, group_size: int, skip=frozenset()
) -> list[str]:
    """Remove the files of an earlier export in ``out_dir`` that this export does not write, among those this
    shard owns: sample indices in ``[start, end)`` (its rows) and, for the shard that ends the set
    (``end >= total``), every index from ``total`` on. A sample file is stale when its index is owned and it is not
    at the path this export gives it (grouped layouts: another ``rows_*`` grouping, or an index in ``skip``, the
    samples this export skipped; any layout: an index past the set's end); a speculators ``samples_{s}.parquet`` is
    stale when ``s`` is owned and is not this shard's ``start``. Only the ``rows_*`` directories whose range meets
    the owned indices are listed. Returns the removed paths."""
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
    if CONTRACTS[layout]["files"] == "grouped":
        pattern = _INDEX["modelopt" if layout == "modelopt" else "specforge"]
        for d in top:
            m = _GROUP.match(d.name)
            if not (m and d.is_dir()):
                continue
            lo, hi = int(m.group(1)), int(m.group(2))
            if not (lo < end and hi > start) and not (last and hi > total):
                continue
            for f in os.scandir(d.path):
                k = pattern.match(f.name)
                if (
                    k
                    and owned(i := int(k.group(1)))
                    and (i >= total or i in skip or Path(f.path) != sample_path(layout, out_dir, i, group_size))
                ):
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
    empty = pa.table(
        {
            "index": pa.array([], pa.int64()),
            "input_ids": pa.array([], pa.list_(pa.int64())),
            "loss_mask": pa.array([], pa.list_(pa.int64())),
            "seq_len": pa.array([], pa.int64()),
        }
    )
    table = read_side_tables(out_dir, ["index", "input_ids", "loss_mask", "seq_len"], empty)
    index = table.column("index")
    table = table.select(["input_ids", "loss_mask", "seq_len"]).cast(
        pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())])
    )
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
