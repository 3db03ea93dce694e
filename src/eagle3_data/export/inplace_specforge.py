"""SpecForge reads the extracted states in place: its ref manifest points at ``results/hidden_states/``, and a
feature store of this package serves each ref from there (no ``data_{i}.ckpt`` copy).

SpecForge 0.2.0's disaggregated offline run (``specforge/training/disaggregated.py``) splits ingest from training:
a producer ``put()``s each feature file into a feature store (``specforge/runtime/data_plane/disagg_ingest.py``,
``ingest_offline_features``: the tensors are copied) and writes a tensor-free JSON manifest of ``SampleRef``s
(``write_ref_manifest``); the trainer waits for ``<manifest>.done``, reads the refs (``read_ref_manifest``) and
fetches each sample with ``store.get(ref)`` through its ``FeatureDataLoader`` and the EAGLE-3 offline normalizer.
The ``specforge_inplace`` layout is that manifest without the copy:

- the export writes the side tables ``samples_{start}.parquet`` (``index``, ``sample_id``, ``source``, ...) and
  ``inplace.json`` (where the states files are: :mod:`.inplace_states`), from the merge alone;
- rule ``export_refs`` writes ``manifest.json`` (:data:`MANIFEST`) in SpecForge's format (``schema_version``,
  ``refs``: one ``SampleRef`` per sample in the merged order, :func:`ref_dicts`) and ``manifest.json.done``;
- :class:`InPlaceFeatureStore` (a SpecForge ``FeatureStore``) serves ``get(ref)`` from the sample's selection's
  states file: ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``aux_hidden_state`` [1, T, A*H] and
  ``hidden_state`` [1, T, H] (post-norm), the tensors the ``specforge`` export writes, bit for bit.

SpecForge picks its store among two backends (``deployment.disaggregated.backend``: ``shared_dir``, ``mooncake``),
with no registry, so train with this module's launcher (:func:`install`): ``python -m
eagle3_data.export.inplace_specforge train --config run.yaml deployment.mode=disaggregated
deployment.disaggregated.control_dir=results/export/specforge_inplace deployment.disaggregated.backend=shared_dir
training.role=consumer ...`` (the rest as ``specforge train``): a manifest beside this package's ``inplace.json`` is
read through :class:`InPlaceFeatureStore`.

Training before extraction ends: the manifest lists every merged sample once the merge is done, and SpecForge's
offline trainer reads it once. A sample whose states file is not there yet waits in ``get()`` up to ``wait_s``
seconds (the launcher: ``EAGLE3_DATA_WAIT_S``, default 0: raise KeyError at once, as SpecForge's stores do for a
sample not available), looking again every :data:`~.inplace_states.RECHECK_S` seconds; each file is served from the
moment its extract job renames it into place.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..files import atomic_path, write_json
from .inplace_states import INDEX_FILE, RECHECK_S, InPlaceStates, side_rows
from .layouts import grouped_record

#: the ref manifest of a ``specforge_inplace`` directory (SpecForge's ``DISAGG_MANIFEST``)
MANIFEST = "manifest.json"
#: the name of the store (its ``store_id`` and ``health()``)
BACKEND = "eagle3_data"
#: SpecForge 0.2.0's ``SampleRef`` schema version (``specforge/runtime/contracts.py``)
SCHEMA_VERSION = 1
#: the raw keys of an offline EAGLE-3 sample (``specforge/runtime/data_plane/offline_reader.py``)
FEATURE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
#: the scheme of the refs' ``feature_store_uri``: ``eagle3_data://<source>/<sample_id>`` (both URL-quoted)
URI_SCHEME = "eagle3_data://"


def ref_dicts(out_dir, run_id: str = "eagle3_data") -> list[dict]:
    """The ``SampleRef`` of every sample of the in-place directory ``out_dir``, as SpecForge's ``ref_to_dict``
    writes them, in global index order: ``sample_id`` ``{run_id}:{index:08d}`` (SpecForge's own form),
    ``feature_store_uri`` ``eagle3_data://<source>/<sample id>``, the four raw keys, no feature specs (as SpecForge's
    ``OfflineManifestReader`` by default), ``num_tokens``, and ``metadata``: ``format`` ``offline_eagle3``,
    ``target_repr`` ``hidden_state``, ``file_index`` (the global index), ``source`` and ``sample`` (the merged set's
    sample id). Raises ValueError when the side tables' indices are not ``0..N-1`` (a shard's export is missing)."""
    rows = side_rows(out_dir, ["index", "sample_id", "source", "seq_len"])
    refs = []
    for i, sid, src, n in ((r["index"], r["sample_id"], r["source"], r["seq_len"]) for r in rows):
        refs.append(
            {
                "sample_id": f"{run_id}:{i:08d}",
                "run_id": run_id,
                "source_task_id": None,
                "feature_store_uri": f"{URI_SCHEME}{quote(src, safe='')}/{quote(sid, safe='')}",
                "feature_keys": {k: k for k in FEATURE_KEYS},
                "feature_specs": {},
                "strategy": "eagle3",
                "schema_version": SCHEMA_VERSION,
                "target_model_version": "unknown",
                "draft_weight_version": None,
                "tokenizer_version": "unknown",
                "num_tokens": int(n),
                "estimated_bytes": 0,
                "metadata": {
                    "format": "offline_eagle3",
                    "target_repr": "hidden_state",
                    "schema_version": SCHEMA_VERSION,
                    "file_index": i,
                    "source": src,
                    "sample": sid,
                },
            }
        )
    return refs


def write_ref_manifest(out_dir, run_id: str = "eagle3_data") -> dict:
    """Write ``<out_dir>/manifest.json`` (``{"schema_version", "refs": ref_dicts(out_dir)}``, SpecForge's
    ``write_ref_manifest`` format) and then ``manifest.json.done`` (what SpecForge's trainer waits for), each
    atomically. Returns ``{samples, tokens, files}``; raises as :func:`ref_dicts`."""
    out_dir = Path(out_dir)
    refs = ref_dicts(out_dir, run_id)
    path = out_dir / MANIFEST
    write_json({"schema_version": SCHEMA_VERSION, "refs": refs}, path)
    done = Path(f"{path}.done")
    with atomic_path(done) as tmp:
        Path(tmp).write_text("")
    return {"samples": len(refs), "tokens": sum(r["num_tokens"] for r in refs), "files": [str(path), str(done)]}


def _store_base():
    try:
        from specforge.runtime.data_plane.feature_store import FeatureStore
    except ImportError as exc:  # pragma: no cover - the trainers extra installs it
        raise ImportError(f"{exc}: SpecForge 0.2.0 reads the specforge_inplace layout (pip install specforge)") from exc
    return FeatureStore


class InPlaceFeatureStore(_store_base()):
    """A read-only SpecForge ``FeatureStore`` over the in-place directory ``data_path`` (``manifest.json``'s folder).

    ``get(ref)`` returns the ref's ``{name: tensor}`` (the raw keys above) and a ``FeatureHandle``; it raises KeyError
    for a ref of another scheme, or when the sample's states file is not there after ``wait_s`` seconds, and
    ValueError when the file holds other token ids than the ref's count or no EAGLE-3 layers. ``put`` raises
    (nothing is copied in); ``release`` drops the lease only (the files are the build's)."""

    def __init__(self, data_path, *, wait_s: float = 0.0, recheck_s: float = RECHECK_S):
        self.states = InPlaceStates(data_path, recheck_s)
        self.wait_s = float(wait_s)
        self.store_id = f"{BACKEND}:{self.states.data_path}"
        self._leases: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._count = 0

    def put(self, tensors, *, sample_id: str, metadata: dict):
        raise TypeError(f"{type(self).__name__} is read-only: it serves the states the build extracted")

    def _file(self, source: str):
        deadline = time.monotonic() + self.wait_s
        while (f := self.states.file(source)) is None and time.monotonic() < deadline:
            time.sleep(min(self.states.recheck_s, max(deadline - time.monotonic(), 0.0)))
        return f

    def get(self, sample_ref, *, device="cpu", names=None):
        from specforge.runtime.contracts import FeatureHandle

        uri, meta = sample_ref.feature_store_uri, sample_ref.metadata
        if not uri.startswith(URI_SCHEME) or "source" not in meta or "sample" not in meta:
            raise KeyError(
                f"{self.store_id}: ref {sample_ref.sample_id} ({uri}) is not of a specforge_inplace manifest"
            )
        source, sid = meta["source"], meta["sample"]
        f = self._file(source)
        if f is None:
            raise KeyError(
                f"sample {sample_ref.sample_id} not available in store {self.store_id}: "
                f"{self.states.states_dir / (source + '.safetensors')} is not extracted yet (waited {self.wait_s:g} s)"
            )
        t = self.states.sample(f, sid, f"ref {sample_ref.sample_id}")
        if sample_ref.num_tokens and len(t["input_ids"]) != sample_ref.num_tokens:
            raise ValueError(
                f"{f.path}: sample {sid!r} holds {len(t['input_ids'])} tokens, its ref {sample_ref.num_tokens}"
            )
        record = grouped_record("specforge", t, sid)
        out = {}
        for n in names or list(sample_ref.feature_keys):
            out[n] = record[sample_ref.feature_keys.get(n, n)]
        if str(device) != "cpu":
            out = {k: v.to(device) for k, v in out.items()}
        with self._lock:
            self._count += 1
            handle = FeatureHandle(sample_id=sample_ref.sample_id, generation=0, lease_token=f"{sid}:{self._count}")
            self._leases[handle.lease_token] = handle
        return out, handle

    def release(self, handle, *, reason: str = "consumed") -> None:
        with self._lock:
            self._leases.pop(handle.lease_token, None)

    def abort(self, sample_id: str, *, reason: str = "aborted") -> None:
        """Nothing to free: the states files are the build's."""

    def health(self) -> dict:
        with self._lock:
            leases = len(self._leases)
        return {"store_id": self.store_id, "backend": BACKEND, "active_leases": leases, "resident_bytes": 0}


def install() -> None:
    """Make SpecForge 0.2.0's disaggregated trainer read a ``specforge_inplace`` manifest through
    :class:`InPlaceFeatureStore`. Its store factory (``specforge/training/disaggregated.py``, ``_offline_store``)
    knows two backends and no registry; after this, a manifest (``DISAGG_MANIFEST``, set by SpecForge from
    ``deployment.disaggregated.control_dir``) whose folder holds this package's ``inplace.json`` is served by the
    in-place store (waiting ``EAGLE3_DATA_WAIT_S`` seconds, default 0, for a states file), and any other by
    SpecForge's own backend. Idempotent."""
    import specforge.training.disaggregated as disagg

    own = getattr(disagg._offline_store, "__wrapped__", disagg._offline_store)

    def _offline_store(cfg, *, retain_on_release: bool = False):
        folder = Path(os.environ.get("DISAGG_MANIFEST") or ".").parent
        if not (folder / INDEX_FILE).is_file():
            return own(cfg, retain_on_release=retain_on_release)
        return InPlaceFeatureStore(folder, wait_s=float(os.environ.get("EAGLE3_DATA_WAIT_S") or 0))

    _offline_store.__wrapped__ = own
    disagg._offline_store = _offline_store


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3_data.export.inplace_specforge <specforge arguments>``: SpecForge's own command line
    (``specforge``) with the in-place store installed (:func:`install`). Returns its exit code.

    SpecForge starts the workers of a several-process run as ``python -m specforge.cli``, processes without the
    store: such a run is refused (SystemExit with a message) naming the command that starts them under ``torchrun``
    instead, where SpecForge runs in each worker's own process."""
    import specforge.launch_plan as launch_plan
    from specforge.cli import main as specforge_main

    install()

    def refuse(plan, *args, **kwargs):
        raise SystemExit(
            "this run starts its workers as `python -m specforge.cli`, which would not read the states in place: "
            "start them with torchrun, e.g. `torchrun --nproc-per-node 8 -m eagle3_data.export.inplace_specforge "
            "train --config ...` (deployment.trainer.nproc_per_node = --nproc-per-node)"
        )

    launch_plan.run_commands = refuse
    return specforge_main(argv)


if __name__ == "__main__":
    from eagle3_data.export.inplace_specforge import main as _main

    raise SystemExit(_main())
