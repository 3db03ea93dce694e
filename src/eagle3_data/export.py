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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .extract.layout import StatesFile
from .files import atomic_path, write_json, write_parquet

if TYPE_CHECKING:
    from .settings import ExportSettings

log = logging.getLogger("eagle3_data.export")

#: what each layout reads: ``drafters`` (the states must hold the layers of one of them: the first is the one
#: named in errors), ``final`` (the final-state form: ``post`` | ``pre`` | None: none), ``files`` (``grouped``:
#: ``rows_*/`` folders; ``speculators``: ``hidden_states/hs_{i}.safetensors`` and a data directory)
CONTRACTS = {
    "specforge": {"drafters": ("eagle3",), "final": "post", "files": "grouped"},
    "specforge_dflash": {"drafters": ("dflash", "dspark"), "final": None, "files": "grouped"},
    "specforge_dspark": {"drafters": ("dspark", "dflash"), "final": "post", "files": "grouped"},
    "speculators": {"drafters": ("eagle3",), "final": "pre", "files": "speculators"},
    "speculators_fp8": {"drafters": ("eagle3",), "final": "pre", "files": "speculators"},
    "modelopt": {"drafters": ("eagle3",), "final": "post", "files": "grouped"},
}
LAYOUTS = tuple(CONTRACTS)
#: the layouts whose directory is a speculators data path (rule export_dataset)
SPECULATORS_LAYOUTS = tuple(k for k, v in CONTRACTS.items() if v["files"] == "speculators")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def specforge_path(out_dir, index: int, group_size: int) -> Path:
    """Where SpecForge's ``prepare_hidden_states.py`` puts sample ``index``: ``rows_{g}-{g+size}/data_{i}.ckpt``."""
    g = (index // group_size) * group_size
    return Path(out_dir) / f"rows_{g}-{g + group_size}" / f"data_{index}.ckpt"


def modelopt_path(out_dir, index: int, group_size: int) -> Path:
    """Where the ``modelopt`` layout puts sample ``index``: ``rows_{g}-{g+size}/{i}.pt``."""
    g = (index // group_size) * group_size
    return Path(out_dir) / f"rows_{g}-{g + group_size}" / f"{index}.pt"


def speculators_path(out_dir, index: int) -> Path:
    """Where speculators' ``FileTransfer`` looks for sample ``index``: ``hidden_states/hs_{i}.safetensors``."""
    return Path(out_dir) / "hidden_states" / f"hs_{index}.safetensors"


def sample_path(layout: str, out_dir, index: int, group_size: int) -> Path:
    """The file of sample ``index`` in ``layout`` (module docstring)."""
    if CONTRACTS[layout]["files"] == "speculators":
        return speculators_path(out_dir, index)
    if layout == "modelopt":
        return modelopt_path(out_dir, index, group_size)
    return specforge_path(out_dir, index, group_size)


def drafter_of(layout: str, drafter_layers: dict) -> str | None:
    """The drafter whose layers ``layout`` reads among those stored (``drafter_layers``), or None."""
    return next((d for d in CONTRACTS[layout]["drafters"] if d in drafter_layers), None)


def has_consecutive_supervised(loss_mask) -> bool:
    """Whether a loss mask [T] holds two adjacent supervised positions (what SpecForge's DFlash family requires:
    ``specforge/data/loss_mask.py``, ``has_consecutive_supervised_tokens``)."""
    m = np.asarray(loss_mask).astype(bool)
    return bool((m[1:] & m[:-1]).any())


def quantize_per_token_fp8(x):
    """speculators' FP8 connector quantisation (``hs_connectors/fp8_utils.py``): ``x`` [T, ...] -> ``(fp8 [T, ...]
    float8_e4m3fn, scales [T, 1, ...] float32)``, one scale per token over every other dimension,
    ``max(amax / 448, 1e-12)``."""
    import torch

    xf = x.float()
    amax = xf.abs().amax(dim=tuple(range(1, xf.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).to(torch.float8_e4m3fn), scale


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


@dataclass(frozen=True)
class MergedShard:
    """One merged file to export and its place in its set.

    ``path``: a MERGED parquet file (``sample_id``, ``dataset``, ``input_ids``, ``loss_mask``, ``source``).
    ``start_index``: global index of its first sample (the samples of the merged shards before it;
    :func:`start_indices` computes it from the merge manifest). ``heldout``: the file is the held-out set (one
    file, ``start_index`` 0; the set's size for :func:`prune_stale` is the merge manifest's ``heldout.samples``,
    not the training shards' total)."""

    path: str | os.PathLike
    start_index: int = 0
    heldout: bool = False

    @property
    def set_name(self) -> str:
        """``heldout`` or ``train``: the manifest's ``set`` and the provenance table's."""
        return "heldout" if self.heldout else "train"


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
            start/end index, files, tokens, bytes (of the files written), skipped (``{reason: [sample ids]}``),
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
    writer = _SampleWriter(layout, out_dir, settings.group_size, shard, final_form)
    t0 = time.perf_counter()
    rows = _ShardRows.read(shard.path)
    merged = _read_manifest(merge_manifest)
    index = StatesIndex(states_dir, None if merged is None else (merged.get("selections") or {}))
    try:
        for j in range(rows.n):
            writer.write(rows, j, index)
    finally:
        index.close()
    if writer.contract["files"] == "speculators" and writer.spec_rows["ids"]:
        # (an empty shard shares its start with the next one: it writes none)
        _write_side_table(writer.spec_rows, writer.out_dir, shard, provenance)
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


def _read_manifest(merge_manifest) -> dict | None:
    """The merge manifest as a dict (``merge_manifest``: a path, a dict or None)."""
    if merge_manifest is None:
        return None
    return json.loads(Path(merge_manifest).read_text()) if not isinstance(merge_manifest, dict) else merge_manifest


@dataclass(frozen=True)
class _ShardRows:
    """The columns of a merged shard that export reads: ids, datasets and source selections per row, and the
    token ids as one flat array with its offsets."""

    path: object
    sample_ids: list
    datasets: list
    sources: list
    offsets: np.ndarray
    flat_ids: np.ndarray

    @classmethod
    def read(cls, path) -> "_ShardRows":
        table = pq.read_table(path, columns=["sample_id", "dataset", "input_ids", "loss_mask", "source"])
        ids_col = table.column("input_ids").combine_chunks()
        return cls(
            path=path,
            sample_ids=table.column("sample_id").to_pylist(),
            datasets=table.column("dataset").to_pylist(),
            sources=table.column("source").to_pylist(),
            offsets=ids_col.offsets.to_numpy(),
            flat_ids=ids_col.values.to_numpy(zero_copy_only=False),
        )

    @property
    def n(self) -> int:
        return len(self.sample_ids)

    def ids(self, j: int) -> np.ndarray:
        """Row ``j``'s token ids."""
        return self.flat_ids[self.offsets[j] : self.offsets[j + 1]]


class _SampleWriter:
    """Writes the samples of one shard in ``layout``, one at a time (:meth:`write`), and keeps what the manifest
    reports: files, tokens, bytes, the final norms read, the samples skipped and (speculators layouts) the side
    table's rows."""

    def __init__(self, layout: str, out_dir, group_size: int, shard: MergedShard, final_form: str | None):
        import torch

        self.torch = torch
        if layout not in LAYOUTS:
            raise ValueError(f"export layout must be one of {LAYOUTS}, got {layout!r}")
        if shard.start_index < 0 or group_size < 1:
            raise ValueError(
                f"export: start_index must be >= 0 and group_size >= 1, got {shard.start_index}, {group_size}"
            )
        self.layout, self.contract, self.group_size, self.shard = layout, CONTRACTS[layout], group_size, shard
        self.final = final_form or self.contract["final"]
        self.out_dir = Path(out_dir)
        self.files: list[str] = []
        self.tokens = self.nbytes = 0
        self.norms: set = set()
        self.spec_rows: dict = {"ids": [], "mask": []}
        self.skipped: dict[str, list[str]] = {}
        self.layers_of: dict[str, list] = {}  # per states file: the layers this layout reads

    def layers(self, sf: StatesFile) -> list:
        """The layers of ``sf`` this layout reads (those of its drafter; ValueError when ``sf`` has none)."""
        if sf.path not in self.layers_of:
            drafter = drafter_of(self.layout, sf.drafter_layers)
            if drafter is None:
                raise ValueError(
                    f"{sf.path}: holds the layers of {sorted(sf.drafter_layers)}, not those of "
                    f"{self.contract['drafters'][0]}, which export layout {self.layout} reads; add "
                    f"{self.contract['drafters'][0]} to extract.drafters (the extraction then captures its layers "
                    "too)"
                )
            self.layers_of[sf.path] = sf.drafter_layers[drafter]
            self.norms.add(sf.meta.get("final_norm", "post"))
        return self.layers_of[sf.path]

    def write(self, rows: _ShardRows, j: int, index: StatesIndex) -> None:
        """Write row ``j`` of the shard (or skip it: the DFlash family without two consecutive supervised tokens),
        its states read from ``index`` and checked against the row's token ids."""
        sid = rows.sample_ids[j]
        if rows.sources[j] is None:
            raise ValueError(f"{rows.path}: row {j} ({sid!r}) has no source selection")
        sf = index.file(rows.sources[j])
        layers = self.layers(sf)
        jj = sf.index.get(sid)
        if jj is None:
            raise KeyError(f"export: sample {sid!r} is not in {sf.path}")
        t = sf.sample(jj, final=self.final, layers=layers)
        want = rows.ids(j)
        if not np.array_equal(t["input_ids"].numpy(), want):
            raise ValueError(f"{sf.path}: sample {sid!r} holds other token ids than {rows.path} row {j}")
        idx = self.shard.start_index + j
        if self.layout in ("specforge_dflash", "specforge_dspark") and not has_consecutive_supervised(t["loss_mask"]):
            self.skipped.setdefault("no_consecutive_supervised_tokens", []).append(sid)
            return
        self.tokens += len(want)
        path = sample_path(self.layout, self.out_dir, idx, self.group_size)
        if self.contract["files"] == "grouped":
            # through a file object: torch.save names the archive inside after a path's file name, which
            # is a random temporary name here; "archive" keeps two exports of the same states byte-identical
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                self.torch.save(_grouped_record(self.layout, t, sid), fh)
        else:
            self._write_speculators(path, t, sid, sf, idx, rows.datasets[j])
        self.nbytes += os.path.getsize(path)
        self.files.append(str(path))

    def _write_speculators(self, path: Path, t: dict, sid: str, sf: StatesFile, idx: int, dataset: str) -> None:
        """One speculators file (``hidden_states`` [T, A+1, H], fp8 + scales for ``speculators_fp8``) and the
        sample's side-table row."""
        from safetensors.torch import save_file

        torch = self.torch
        aux, fin = t["aux_hidden_states"], t["hidden_states"]
        L, H = len(t["input_ids"]), fin.shape[-1]
        stacked = torch.cat([aux.reshape(L, -1, H), fin.unsqueeze(1)], dim=1).contiguous()
        tensors = {"token_ids": t["input_ids"], "hidden_states": stacked}
        if self.layout == "speculators_fp8":
            q, scales = quantize_per_token_fp8(stacked)
            tensors = {"token_ids": t["input_ids"], "hidden_states": q, "hidden_states_scales": scales}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"sample_id": sid, "source": str(sf.path)})
        self.spec_rows["ids"].append((idx, sid, dataset, t["input_ids"].tolist()))
        self.spec_rows["mask"].append(t["loss_mask"].tolist())

    def manifest(self, n: int, removed: list, seconds: float) -> dict:
        """The export manifest of a shard of ``n`` rows (``removed``: the stale files :func:`prune_stale`
        removed)."""
        start, norms = self.shard.start_index, self.norms
        return {
            "layout": self.layout,
            "set": self.shard.set_name,
            "source": str(self.shard.path),
            "out_dir": str(self.out_dir),
            "start_index": start,
            "end_index": start + n,
            "num_samples": n,
            "num_written": len(self.files),
            "num_tokens": self.tokens,
            "bytes": self.nbytes,
            "final_norm": sorted(norms)[0] if len(norms) == 1 else sorted(norms),
            "final_state": self.final,
            "skipped": self.skipped,
            "files": self.files,
            "removed_stale": len(removed),
            "seconds": round(seconds, 3),
        }


def _grouped_record(layout: str, t: dict, sample_id: str) -> dict:
    """What a grouped layout's ``torch.save`` file holds for sample ``t`` (module docstring)."""
    aux, fin = t["aux_hidden_states"], t["hidden_states"]
    if layout == "specforge":
        return {
            "input_ids": t["input_ids"],
            "loss_mask": t["loss_mask"],
            "aux_hidden_state": aux.unsqueeze(0),
            "hidden_state": fin.unsqueeze(0),
        }
    if layout == "modelopt":
        return {
            "input_ids": t["input_ids"],
            "hidden_states": fin,
            "aux_hidden_states": aux,
            "loss_mask": t["loss_mask"],
            "conversation_id": sample_id,
        }
    record = {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"], "hidden_states": aux.unsqueeze(0)}
    if layout == "specforge_dspark":
        record["target_last_hidden_states"] = fin.unsqueeze(0)
    return record


def _write_side_table(spec_rows: dict, out_dir: Path, shard: MergedShard, provenance) -> None:
    """The speculators side table ``samples_{start}.parquet`` of the rows written (with the provenance columns
    when ``provenance`` is given)."""
    idxs, sids, dss, ids = zip(*spec_rows["ids"])
    table = pa.table(
        {
            "index": pa.array(idxs, pa.int64()),
            "sample_id": pa.array(sids, pa.string()),
            "dataset": pa.array(dss, pa.string()),
            "input_ids": pa.array(ids, pa.list_(pa.int64())),
            "loss_mask": pa.array(spec_rows["mask"], pa.list_(pa.int64())),
            "seq_len": pa.array([len(x) for x in ids], pa.int64()),
        }
    )
    if provenance is not None:
        table = _with_provenance(table, provenance, shard.set_name, shard.path)
    write_parquet(table, out_dir / f"samples_{shard.start_index:09d}.parquet")


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


def _prune_earlier(writer: _SampleWriter, rows: _ShardRows, merged: dict) -> list[str]:
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


def _with_provenance(table: pa.Table, provenance, set_name: str, merged_path) -> pa.Table:
    """``table`` (a shard's side table: ``index``, ``sample_id``, ...) with the provenance columns of its rows
    (:data:`eagle3_data.provenance.SIDE_COLUMNS`, matched by ``index`` in ``set_name``). Raises ValueError when the
    provenance table names other samples at those indices (it is of another merge)."""
    from .provenance import SIDE_COLUMNS

    idx = table.column("index").to_pylist()
    prov = pq.read_table(
        provenance,
        columns=["set", "index", "sample_id", *SIDE_COLUMNS],
        filters=[("set", "=", set_name), ("index", ">=", idx[0]), ("index", "<=", idx[-1])],
    )
    prov = prov.filter(pc.is_in(prov.column("index"), pa.array(idx, pa.int64()))).sort_by("index")  # (skipped: none)
    if (
        prov.column("index").to_pylist() != idx
        or prov.column("sample_id").to_pylist() != table.column("sample_id").to_pylist()
    ):
        raise ValueError(
            f"export: {provenance} does not describe the rows of {merged_path} (another merge's?): "
            "rerun rule provenance"
        )
    for name in SIDE_COLUMNS:
        table = table.append_column(prov.schema.field(name), prov.column(name))
    return table


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
    table = (
        pa.concat_tables(tables)
        if tables
        else pa.table(
            {
                "index": pa.array([], pa.int64()),
                "input_ids": pa.array([], pa.list_(pa.int64())),
                "loss_mask": pa.array([], pa.list_(pa.int64())),
                "seq_len": pa.array([], pa.int64()),
            }
        )
    )
    index = table.column("index").to_numpy()
    if not np.array_equal(index, np.arange(len(index))):
        gap = next(i for i, v in enumerate(np.append(index, -1)) if v != i)
        raise ValueError(
            f"export: {out_dir} has no sample {gap} in its samples_*.parquet files (a shard's export "
            "is missing): rerun the export"
        )
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
