"""The samples of one merged shard written in one layout (:class:`SampleWriter`), their states read from the
extracted files (:class:`StatesIndex`), and the manifest of what was written."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..extract.layout import StatesFile
from ..files import atomic_path, write_parquet

from .layouts import (
    CONTRACTS,
    INPLACE_FILES,
    LAYOUTS,
    configured_layer_ids,
    drafter_of,
    has_consecutive_supervised,
    quantize_per_token_fp8,
    sample_path,
    grouped_record,
    speculators_tensors,
)

log = logging.getLogger("eagle3_data.export")


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


@dataclass(frozen=True)
class ShardRows:
    """The columns of a merged shard that export reads: ids, datasets and source selections per row, and the
    token ids as one flat array with its offsets."""

    path: object
    sample_ids: list
    datasets: list
    sources: list
    offsets: np.ndarray
    flat_ids: np.ndarray
    flat_mask: np.ndarray

    @classmethod
    def read(cls, path) -> "ShardRows":
        table = pq.read_table(path, columns=["sample_id", "dataset", "input_ids", "loss_mask", "source"])
        ids_col = table.column("input_ids").combine_chunks()
        mask_col = table.column("loss_mask").combine_chunks()
        return cls(
            path=path,
            sample_ids=table.column("sample_id").to_pylist(),
            datasets=table.column("dataset").to_pylist(),
            sources=table.column("source").to_pylist(),
            offsets=ids_col.offsets.to_numpy(),
            flat_ids=ids_col.values.to_numpy(zero_copy_only=False),
            flat_mask=mask_col.values.to_numpy(zero_copy_only=False),  # (the same lengths as the ids)
        )

    @property
    def n(self) -> int:
        return len(self.sample_ids)

    def ids(self, j: int) -> np.ndarray:
        """Row ``j``'s token ids."""
        return self.flat_ids[self.offsets[j] : self.offsets[j + 1]]

    def mask(self, j: int) -> np.ndarray:
        """Row ``j``'s loss mask."""
        return self.flat_mask[self.offsets[j] : self.offsets[j + 1]]


class SampleWriter:
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
        self.targets: set = set()  # (model_path, layer_convention) of the states files read

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
            self.targets.add((sf.meta.get("model_path"), sf.meta.get("layer_convention")))
        return self.layers_of[sf.path]

    def write(self, rows: ShardRows, j: int, index: StatesIndex) -> None:
        """Write row ``j`` of the shard (or skip it: the DFlash family without two consecutive supervised tokens),
        its states read from ``index`` and checked against the row's token ids."""
        sid = rows.sample_ids[j]
        if rows.sources[j] is None:
            raise ValueError(f"{rows.path}: row {j} ({sid!r}) has no source selection")
        if self.contract["files"] in INPLACE_FILES:  # no states read or copied: the trainer reads them in place
            self.tokens += len(rows.ids(j))
            self.spec_rows["ids"].append((self.shard.start_index + j, sid, rows.datasets[j], rows.ids(j).tolist()))
            self.spec_rows["mask"].append(rows.mask(j).tolist())
            self.spec_rows.setdefault("source", []).append(rows.sources[j])
            return
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
                self.torch.save(grouped_record(self.layout, t, sid), fh)
        else:
            self._write_speculators(path, t, sid, sf, idx, rows.datasets[j])
        self.nbytes += os.path.getsize(path)
        self.files.append(str(path))

    def _write_speculators(self, path: Path, t: dict, sid: str, sf: StatesFile, idx: int, dataset: str) -> None:
        """One speculators file (``hidden_states`` [T, A+1, H], fp8 + scales for ``speculators_fp8``) and the
        sample's side-table row."""
        from safetensors.torch import save_file

        tensors = speculators_tensors(t)
        stacked = tensors["hidden_states"]
        if self.layout == "speculators_fp8":
            q, scales = quantize_per_token_fp8(stacked)
            tensors = {"token_ids": t["input_ids"], "hidden_states": q, "hidden_states_scales": scales}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"sample_id": sid, "source": str(sf.path)})
        self.spec_rows["ids"].append((idx, sid, dataset, t["input_ids"].tolist()))
        self.spec_rows["mask"].append(t["loss_mask"].tolist())

    def manifest(self, n: int, removed: list, seconds: float) -> dict:
        """The export manifest of a shard of ``n`` rows (``removed``: the stale files :func:`prune_stale`
        removed). It says what the files hold: ``target`` (the target's path, as extracted), ``target_layers``
        (``layers``: the 0-based decoder layers whose outputs are stored, in the stored order; ``convention``: the
        extraction's words for them; ``configured``: the ids the layout's trainer is configured with,
        :func:`.layouts.configured_layer_ids`), ``final_norm`` and ``final_state``. Raises ValueError when the
        states files read disagree on the target or the layers (states of two builds mixed)."""
        start, norms = self.shard.start_index, self.norms
        layer_sets = {tuple(v) for v in self.layers_of.values()}
        if len(layer_sets) > 1 or len(self.targets) > 1:
            raise ValueError(
                f"export {self.layout}: the states files of {self.shard.path} are of other targets or layers "
                f"({sorted(self.targets)}, layers {sorted(layer_sets)}): re-extract them with one config"
            )
        layers = list(next(iter(layer_sets), ()))
        target, convention = next(iter(self.targets), (None, None))
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
            "target": target,
            "target_layers": {
                "layers": layers,
                "convention": convention,
                "configured": configured_layer_ids(self.layout, layers),
                "configured_as": CONTRACTS[self.layout]["ids"],
            },
            "final_norm": sorted(norms)[0] if len(norms) == 1 else sorted(norms),
            "final_state": self.final,
            "skipped": self.skipped,
            "files": self.files,
            "removed_stale": len(removed),
            "seconds": round(seconds, 3),
        }


def write_side_table(spec_rows: dict, out_dir: Path, shard: MergedShard, provenance) -> Path:
    """The speculators side table ``samples_{start}.parquet`` of the rows written (with the provenance columns
    when ``provenance`` is given); returns its path."""
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
    if "source" in spec_rows:  # an in-place layout: the selection whose states file holds each sample
        table = table.append_column("source", pa.array(spec_rows["source"], pa.string()))
    if provenance is not None:
        table = with_provenance(table, provenance, shard.set_name, shard.path)
    path = out_dir / f"samples_{shard.start_index:09d}.parquet"
    write_parquet(table, path)
    return path


def read_side_tables(out_dir, columns: list[str], empty: pa.Table | None = None) -> pa.Table | None:
    """The side tables ``samples_{start}.parquet`` of the export directory ``out_dir`` (:func:`write_side_table`),
    ``columns`` of each (``index`` among them), as one table in global index order; ``empty`` when there are none.
    Raises ValueError when the indices are not ``0..N-1`` without gap or repeat (a shard's export is missing),
    naming the first missing index."""
    out_dir = Path(out_dir)
    parts = sorted(out_dir.glob("samples_*.parquet"), key=lambda p: int(p.stem.split("_")[1]))
    if not parts:
        return empty
    table = pa.concat_tables([pq.read_table(p, columns=columns) for p in parts]).sort_by("index")
    index = table.column("index").to_numpy()
    if not np.array_equal(index, np.arange(len(index))):
        gap = next(i for i, v in enumerate(np.append(index, -1)) if v != i)
        raise ValueError(
            f"export: {out_dir} has no sample {gap} in its samples_*.parquet files (a shard's export "
            "is missing): rerun the export"
        )
    return table


def with_provenance(table: pa.Table, provenance, set_name: str, merged_path) -> pa.Table:
    """``table`` (a shard's side table: ``index``, ``sample_id``, ...) with the provenance columns of its rows
    (:data:`eagle3_data.provenance.SIDE_COLUMNS`, matched by ``index`` in ``set_name``). Raises ValueError when the
    provenance table names other samples at those indices (it is of another merge)."""
    from ..provenance import SIDE_COLUMNS

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
