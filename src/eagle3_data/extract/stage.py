"""The extract stage: one merge selection (the kept samples of one validated dataset shard) -> one
hidden-states file, forwarding only the samples whose states are not already on disk.

Why per validated shard: merge shuffles across every dataset, so any change rewrites every merged shard;
the selection of one validated shard changes only when its own samples, the dedup/cap decisions about them
or ``merge.max_len`` do. Extracting per selection (and letting the merged, shuffled set be an index over
these files, read by the exports) makes the GPU work follow the change: the workflow re-runs a selection's
job only when the merge's digest of that selection changes (rule ``extract``'s ``params``), and the job
itself forwards only the samples it cannot reuse.

Reuse: before forwarding, the job opens the previous states of the same selection (``reuse_path``: a hard
link the job keeps under ``cache/hidden_states/`` because Snakemake deletes a job's outputs before rerunning
it; or ``out_path`` itself when run by hand) and copies, byte for byte, the rows of every sample whose ids and
loss mask are the same or a prefix of a stored sample's (a truncation by a lower ``merge.max_len``: in a
causal model a position's states depend on the tokens up to it only), provided the file was computed with
the same :func:`settings_digest` (backend, target checkpoint, layers, dtype, final norm, storage savers) and,
with ``final_norm: both``, the same final-norm formula as this job's first batch shows (:mod:`.norm`; the
check runs on every job that forwards, before its file's header is written, since a norm no formula reproduces
adds the post-norm rows as a tensor). The hard link shares the file's disk blocks: it costs no space while the
output exists.

Devices: with a CUDA device (``device`` ``auto`` on a GPU machine, or ``cuda``), the stage first takes
``gpus`` distinct devices with :func:`eagle3_data.devices.gpu_devices` (file locks), which sets
``CUDA_VISIBLE_DEVICES`` before torch touches CUDA; the transformers backend spreads more than one device with
``device_map="auto"``, the SGLang backend runs one tensor-parallel rank per device. No device is taken and no
model is loaded when every sample is reused.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config.schema import schema_node
from ..files import write_json
from ..runtime.tokenprogress import TokenProgress
from .layout import (
    ROWS_FORMAT,
    HiddenStateWriter,
    StatesFile,
    TokenShard,
    reusable,
)
from .forward import Forward
from .model import LAYER_CONVENTION, model_dims, model_fingerprint, resolve_drafter_layers
from .vision import image_digests, selection_images

if TYPE_CHECKING:
    from ..settings import ExtractSettings

log = logging.getLogger("eagle3_data.extract")


def settings_digest(
    *,
    backend: str,
    fingerprint: str,
    layers: list[int],
    dtype: str,
    final_norm: str,
    final_states: str,
    aux_format: str,
    final_format: str = "same",
) -> str:
    """Digest of everything a file's values depend on besides the token ids: two files with the same digest
    hold interchangeable rows for equal ids. Batch size, devices and attention path are not in it: they
    change the arithmetic's rounding, not what is computed. ``layers``: the stored (union) layers, in column
    order. ``final_format`` counts only when not ``same`` and the format named is the rows' encoding
    (``layout.ROWS_FORMAT``), so files written before either existed keep their digest."""
    key = {
        "format": ROWS_FORMAT,
        "backend": backend,
        "target": fingerprint,
        "layers": list(layers),
        "dtype": dtype,
        "final_norm": final_norm,
        "final_states": final_states,
        "aux_format": aux_format,
    }
    if final_format != "same":
        key["final_format"] = final_format
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _open_reusable(paths, settings: str) -> StatesFile | None:
    """The first of ``paths`` that is a readable states file computed with ``settings``, else None."""
    for p in paths:
        if p is None or not Path(p).is_file():
            continue
        try:
            src = StatesFile(p)
        except (ValueError, OSError, KeyError) as exc:
            log.warning("not reusing %s: %s", p, exc)
            continue
        if src.same_settings(settings):
            return src
        log.info(
            "not reusing %s: computed with other settings (state_settings %s, now %s)",
            p,
            src.meta.get("state_settings"),
            settings,
        )
        src.close()
    return None


def keep_link(out_path, link_path) -> bool:
    """Point ``link_path`` at ``out_path``'s data with a hard link (atomically replacing an older link).

    Returns False (and removes an older link, so no stale copy holds disk space) when the filesystem cannot
    link the two paths (different filesystems, or no hard links); reuse is then off for this selection."""
    link_path = Path(link_path)
    link_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = link_path.parent / f".{link_path.name}.{os.getpid()}.link"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(out_path, tmp)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP):
            raise
        log.warning(
            "cannot keep a hard link of %s at %s (%s): a rerun of this selection will forward every "
            "sample again; put cache_dir on the same filesystem as results/",
            out_path,
            link_path,
            exc.strerror,
        )
        with contextlib.suppress(FileNotFoundError):
            link_path.unlink()
        return False
    os.replace(tmp, link_path)
    return True


def extract_states(
    selection_path,
    out_path,
    *,
    settings: "ExtractSettings",
    reuse_path=None,
    selection_digest: str = "",
    summary_path=None,
    model=None,
    capture=None,
    overlap: bool = True,
    images_path=None,
) -> dict:
    """Write the hidden states of the samples of ``selection_path`` to ``out_path``, reusing stored rows.

    Args:
        selection_path: a MERGED-schema parquet (``sample_id``, ``dataset``, ``input_ids`` list<int32>, ``loss_mask``
            list<int8>): a merge selection, or any merged shard (the states keep its row order).
        out_path: the safetensors file (``extract.layout``), written under a temporary name, renamed when complete.
        settings: :class:`~eagle3_data.settings.ExtractSettings` (the ``extract`` section and the target), fields:
        model_path: local directory of the target (config + weights); never downloaded.
        drafters, layers, dflash_layers: the drafters whose layers are captured (``eagle3`` | ``dflash`` |
            ``dspark``), EAGLE-3's auxiliary layers (0-based decoder layers whose OUTPUT is stored; ``None`` ->
            ``model.default_layers``) and DFlash's / DSpark's (``model.resolve_drafter_layers``): the union is
            stored once, the metadata's ``drafter_layers`` says which each reads.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` (compute and stored); device: ``auto`` (cuda if the machine
            has a GPU, else cpu), ``cpu``, ``cuda``, ``cuda:N``.
        batch_tokens: tokens per forward (padded ones in the padded layout, real ones when packed and for SGLang).
        attention: transformers backend: batch layout and attention kernel, ``auto`` (packed on every device;
            padded for a model packing cannot express) | ``padded`` | ``packed`` | ``packed-varlen`` | ``packed-flex`` | ``packed-loop``
            (``transformers_backend`` module docstring). Not in :func:`settings_digest`: it changes rounding, not
            what is computed. The SGLang backend always packs.
        backend: ``transformers`` | ``sglang`` (GPU only, tensor parallel over the ``gpus`` devices held;
            post-norm final states only).
        gpus_per_job: devices this job holds on CUDA (the rule's ``resources: gpu``), see :func:`.forward.device_context`.
        gpu_lock_dir: lock directory for :func:`eagle3_data.devices.gpu_devices` (default there).
        final_states: ``all`` | ``supervised`` (final states only where the loss reads them).
        aux_format, final_format: ``same`` (``dtype``) | ``fp8_e4m3`` (per-token scales; per layer for aux).
        final_norm: ``both`` (the norm's input, its weight and epsilon, and the formula the first forwarded batch
            shows it computes: :mod:`.norm`; if none does, its output too) | ``post`` (its output; SpecForge,
            Model-Optimizer) | ``pre`` (its input; vLLM / speculators, which apply the norm themselves).
        trust_remote_code: load the target with its own code (Kimi).
        (``cache_dir``: where the script puts ``reuse_path``.)
        reuse_path: where the job keeps a hard link of its last output (module docstring); its rows (and
            those of an existing ``out_path``) are reused when their settings and ids match.
        selection_digest: the merge's digest of this selection, stored in the metadata so that consumers can
            tell a stale file.
        summary_path: optional JSON written with the returned dict.
        model: a ``(model, decoder)`` pair from ``transformers_backend.load_target`` to use instead of loading
            (tests; then no device is assigned).
        capture: SGLang backend only: a stand-in for the loaded SGLang target (tests on CPU),
            ``capture(id_lists) -> (aux [T, A*H], final [T, H])`` packed over the batch, aux blocks in ascending
            layer order (what SGLang returns; see ``sglang_backend.SglangBackend``).
        overlap: copy the states to the host and write them in a writer thread while the next batch is
            forwarded (``writeback`` module); ``False``: in order, in this thread (same bytes).
        images_path: the selection's validated file: its rows with images (column ``images``) are forwarded one
            at a time through the target's vision tower and reused only for the same pictures (:mod:`.vision`).

    Returns: dict with ``path, num_samples, num_tokens, forwarded_samples, forwarded_tokens, reused_samples,
        reused_tokens, image_rows`` (rows with images), ``layers, drafter_layers, hidden_size, dtype, device,
        devices, batches, seconds,
        model_seconds, tokens_per_s`` (forwarded tokens per second of model time), ``bytes, final_rows,
        final_states, aux_format, final_format, final_norm, norm_formula`` (``final_norm: both``, else None),
        ``backend, attention`` (``padded``, ``packed:<kernel>``, or the SGLang backend's ``packed``) and
        ``timing``: seconds of ``forward_s`` (the captures: CUDA event time on a GPU), ``copy_s``, ``write_s``,
        ``wait_s``, ``drain_s`` (the part of ``wait_s`` after the last forward; ``writeback.Writeback.stats``) and
        ``flush_s`` (the file's flush, fsync and rename).

    Raises: FileNotFoundError (model dir / selection), ValueError (bad layers, drafters, dtype, saver option,
        backend, empty sample, ids out of the vocabulary, more GPUs than the machine has), RuntimeError (a captured
        length differs from the input length: no file is written), TimeoutError (no free GPUs).
    """
    s = settings
    check_settings(s)
    t0 = time.perf_counter()
    shard = TokenShard(selection_path)
    dims = model_dims(s.model_path)
    chosen, per_drafter = resolve_drafter_layers(s.drafters, s.layers, s.dflash_layers, dims["num_layers"])
    vocab = dims["vocab_size"]
    if vocab and shard.T and (shard.ids.min() < 0 or shard.ids.max() >= vocab):
        raise ValueError(f"{selection_path}: token ids outside the target's vocabulary [0, {vocab})")
    layout = _Layout(shard, dims, chosen, per_drafter, model_fingerprint(s.model_path))
    digest, images = layout.digest(s), selection_images(images_path, shard.sample_ids)
    src = _open_reusable([reuse_path, out_path], digest)
    try:
        reuse = _reusable_rows(shard, src, images)
        metadata = layout.metadata(s, digest, selection_path, selection_digest, images)
        job = _Job(shard, layout, s, reuse, src, _new_run(), images)
        with contextlib.ExitStack() as stack:
            fwd = job.forward(model, capture, stack)
            writer = job.write(out_path, metadata, fwd, overlap)
    finally:
        if src is not None:
            src.close()
    if reuse_path is not None:
        keep_link(out_path, reuse_path)
    summary = job.summary(out_path, selection_path, selection_digest, writer, time.perf_counter() - t0)
    if summary_path is not None:
        write_json(summary, summary_path)
    return summary


def _enum(key: str) -> tuple:
    """The allowed values of ``extract.<key>`` (the schema's ``enum``: defined there only)."""
    return tuple(schema_node(f"extract.{key}")["enum"])


def check_settings(s: "ExtractSettings") -> None:
    """Refuse settings the schema would (a config is validated before any job runs; this guards the Python API):
    each enum-valued key one of the schema's values (``fused``: checked by :func:`.fused.fuse_elementwise`), ``batch_tokens`` at least 1, and the SGLang backend only with
    ``final_norm: post``. Raises ValueError naming the key, its allowed values and the value given."""
    for key in ("final_states", "final_norm", "aux_format", "final_format", "dtype", "backend", "attention"):
        allowed, value = _enum(key), getattr(s, key)
        if value not in allowed:
            raise ValueError(f"extract {key} must be one of {allowed}, got {value!r}")
    if s.batch_tokens < 1:
        raise ValueError(f"extract batch_tokens must be >= 1, got {s.batch_tokens}")
    if s.backend == "sglang" and s.final_norm != "post":
        raise ValueError("extract backend sglang stores post-norm final states only: set extract.final_norm: post")


def _reusable_rows(shard: TokenShard, src: StatesFile | None, images: dict[int, str] | None = None) -> dict[int, int]:
    """Row of ``src`` (a stored file with this job's settings) for each sample of ``shard`` it holds as computed
    now (the same ids and loss mask; a row with images: stored for the same images, its metadata's ``images``)."""
    reuse: dict[int, int] = {}
    if src is not None:
        stored = json.loads(src.meta.get("images") or "{}")
        for i, sid in enumerate(shard.sample_ids):
            j = src.index.get(sid)
            if images and i in images and stored.get(sid) != image_digests(images[i]):
                continue
            if j is not None and reusable(src, j, shard.sample_ids_of(i), shard.mask_of(i)):
                reuse[i] = j
    return reuse


def _new_run() -> dict:
    """What the forward side fills in (devices, batches, model time, attention path, fused kernels, timing)."""
    return {
        "device": "none",
        "devices": [],
        "batches": 0,
        "model_seconds": 0.0,
        "attention": "none",
        "fused": {"norms": 0, "mlps": 0, "skipped": []},
        "timing": {"forward_s": 0.0, "copy_s": 0.0, "write_s": 0.0, "wait_s": 0.0, "drain_s": 0.0},
    }


class _Layout:
    """What one job stores: the selection, the target's dimensions and fingerprint, the layers captured."""

    def __init__(self, shard: TokenShard, dims: dict, chosen: list, per_drafter: dict, fingerprint: str):
        self.shard, self.dims, self.chosen, self.per_drafter, self.fingerprint = (
            shard,
            dims,
            chosen,
            per_drafter,
            fingerprint,
        )

    @property
    def hidden_size(self) -> int:
        return self.dims["hidden_size"]

    def digest(self, s: "ExtractSettings") -> str:
        """The settings digest a reused row must match (:func:`settings_digest`)."""
        return settings_digest(
            backend=s.backend,
            fingerprint=self.fingerprint,
            layers=self.chosen,
            dtype=s.dtype,
            final_norm=s.final_norm,
            final_states=s.final_states,
            aux_format=s.aux_format,
            final_format=s.final_format,
        )

    def metadata(self, s: "ExtractSettings", digest: str, selection_path, selection_digest, images=None) -> dict:
        """The file's metadata (the final norm's record is added once known); with image rows (``images``: row
        index -> its ``images`` JSON) their pictures' digests by sample id (``images``: what a reuse compares)."""
        shard = self.shard
        extra = {"images": json.dumps({shard.sample_ids[i]: image_digests(v) for i, v in images.items()})}
        return {
            **(extra if images else {}),
            "backend": s.backend,
            "model_path": str(s.model_path),
            "model_name": Path(str(s.model_path)).name,
            "model_type": self.dims["model_type"],
            "model_fingerprint": self.fingerprint,
            "num_layers": str(self.dims["num_layers"]),
            "layers": json.dumps(self.chosen),
            "drafter_layers": json.dumps(self.per_drafter),
            "layer_convention": LAYER_CONVENTION,
            "final_norm": s.final_norm,
            "sample_ids": json.dumps(shard.sample_ids),
            "datasets": json.dumps(shard.datasets),
            "source": str(selection_path),
            "selection_digest": str(selection_digest or ""),
            "state_settings": digest,
        }


class _Job:
    """One extract job's steps once the layout is known: the forward side (and the final norm's check), the
    written file, the summary."""

    def __init__(self, shard, layout: _Layout, s: "ExtractSettings", reuse: dict, src, run: dict, images=None):
        self.shard, self.layout, self.s, self.reuse, self.src, self.run = shard, layout, s, reuse, src, run
        self.images = images or {}
        self.todo = [i for i in range(shard.n) if i not in reuse]
        self.norm = None  # final_norm both: {weight, eps, formula, check}

    def forward(self, model, capture, stack) -> "Forward | None":
        """The forward side for the samples not reused (None: every sample is reused), its batches planned; with
        ``final_norm: both`` the first batch's norm check (a stored file whose norm computes another formula is
        not reused)."""
        s, shard, src = self.s, self.shard, self.src
        if not self.todo:
            if s.final_norm == "both" and src is not None:  # (an empty selection has no rows to derive)
                self.norm = _norm_of(src)
            return None
        fwd = Forward(
            shard,
            self.run,
            s,
            layers=self.layout.chosen,
            hidden_size=self.layout.hidden_size,
            model=model,
            capture=capture,
            stack=stack,
            images=self.images,
        )
        fwd.plan(self.todo)
        if s.final_norm == "both":
            self.norm = fwd.first_batch_norm_check()
            if src is not None and self.reuse and not _same_norm(src, self.norm):
                log.warning(
                    "not reusing %s: its final norm was found to compute %s, this job's first batch %s; "
                    "forwarding every sample",
                    src.path,
                    src.meta.get("norm_formula"),
                    self.norm["formula"],
                )
                self.reuse, self.todo = {}, list(range(shard.n))
                fwd.plan(self.todo)
        return fwd

    @property
    def forwarded_tokens(self) -> int:
        return sum(self.shard.lengths[i] for i in self.todo)

    def write(self, out_path, metadata: dict, fwd, overlap: bool) -> HiddenStateWriter:
        """Write the file: the reused rows copied, the others forwarded."""
        s, shard, norm = self.s, self.shard, self.norm
        if norm is not None:
            metadata.update(
                norm_formula=norm["formula"],
                norm_eps=repr(norm["eps"]),
                norm_check=json.dumps(norm["check"], sort_keys=True),
            )
        log.info(
            "extract %s: %d samples / %d tokens; reusing %d samples, forwarding %d samples / %d tokens",
            metadata["source"],
            shard.n,
            shard.T,
            len(self.reuse),
            len(self.todo),
            self.forwarded_tokens,
        )
        writer = HiddenStateWriter(
            out_path,
            shard,
            hidden_size=self.layout.hidden_size,
            num_aux=len(self.layout.chosen),
            dtype=s.dtype,
            final_states=s.final_states,
            aux_format=s.aux_format,
            final_format=s.final_format,
            metadata=metadata,
            norm_weight=None if norm is None else norm["weight"],
            store_post=norm is not None and norm["formula"] == "none",
        )
        # the run-wide view's snapshots (inside a workflow run): tokens done of the selection's, the device
        progress = TokenProgress.for_output(out_path, tokens=shard.T, reused=shard.T - self.forwarded_tokens)
        with writer:
            for i, j in self.reuse.items():
                writer.copy(i, self.src, j)
            if fwd is not None:
                fwd.run(writer, overlap=overlap, out_name=Path(out_path).name, progress=progress)
            t_flush = time.perf_counter()
        self.run["timing"]["flush_s"] = time.perf_counter() - t_flush
        if progress is not None:
            progress.update(self.forwarded_tokens, final=True)
        return writer

    def summary(self, out_path, selection_path, selection_digest, writer, seconds: float) -> dict:
        """The job's summary (see :func:`extract_states`)."""
        s, shard, run, fwd_tokens = self.s, self.shard, self.run, self.forwarded_tokens
        model_s = run["model_seconds"]
        return {
            "path": str(out_path),
            "source": str(selection_path),
            "num_samples": shard.n,
            "num_tokens": shard.T,
            "forwarded_samples": len(self.todo),
            "forwarded_tokens": fwd_tokens,
            "reused_samples": len(self.reuse),
            "reused_tokens": shard.T - fwd_tokens,
            "image_rows": len(self.images),
            "layers": self.layout.chosen,
            "drafter_layers": self.layout.per_drafter,
            "hidden_size": self.layout.hidden_size,
            "dtype": s.dtype,
            "device": run["device"],
            "devices": list(run["devices"]),
            "batches": run["batches"],
            "seconds": round(seconds, 3),
            "model_seconds": round(model_s, 3),
            "tokens_per_s": round(fwd_tokens / model_s, 1) if model_s > 0 else None,
            "bytes": os.path.getsize(out_path),
            "final_rows": writer.S,
            "final_states": s.final_states,
            "aux_format": s.aux_format,
            "final_format": s.final_format,
            "final_norm": s.final_norm,
            "norm_formula": None if self.norm is None else self.norm["formula"],
            "backend": s.backend,
            "attention": run["attention"],
            "fused": run["fused"],
            "timing": {k: round(v, 4) for k, v in run["timing"].items()},
            "selection_digest": str(selection_digest or ""),
        }


def _norm_of(src: StatesFile) -> dict:
    """The final-norm record of a ``final_norm: both`` file (for a job that forwards nothing)."""
    import torch

    return {
        "weight": torch.from_numpy(np.array(src.rows("final_norm_weight", np.float32))),
        "eps": float(src.meta["norm_eps"]),
        "formula": src.meta["norm_formula"],
        "check": json.loads(src.meta.get("norm_check", "{}")),
    }


def _same_norm(src: StatesFile, norm: dict) -> bool:
    """Whether ``src``'s rows can sit beside rows written with ``norm``: the same formula (so the same tensors)."""
    return src.meta.get("norm_formula") == norm["formula"]
