"""The hidden-states file: its layout, its writer and its readers. No model code here.

One file holds the states of the samples of one token shard (a merge selection: the kept samples of one
validated dataset shard, truncated to ``merge.max_len``), concatenated without padding. T = tokens in the
file, N = samples, H = hidden size, U = number of auxiliary layers stored (the union of every requested drafter's
layers, ``layers``):

========================  ==========  =====================================================
tensor                    shape       dtype
========================  ==========  =====================================================
``input_ids``             [T]         int32
``loss_mask``             [T]         int8 (0/1)
``aux_hidden_states``     [T, U*H]    ``dtype`` (layer ``layers[j]`` at columns ``j*H:(j+1)*H``)
``hidden_states``         [T, H]      ``dtype`` (final state; ``final_norm`` says which, below)
``sample_offsets``        [N+1]       int64; sample n = rows ``offsets[n]:offsets[n+1]``
``final_norm_weight``     [H]         float32; only with ``final_norm: both``
``hidden_states_post``    [T, H]      as ``hidden_states``; only with ``final_norm: both`` and ``norm_formula: none``
========================  ==========  =====================================================

The final state (``final_norm``): ``post`` = the final norm's output (HF ``hidden_states[-1]``; SpecForge,
Model-Optimizer), ``pre`` = its input (vLLM / speculators, which apply the norm themselves), ``both`` = its input,
with the norm's weight (``final_norm_weight``), ``norm_eps`` and the formula measured on the first batch
(``norm_formula``, :mod:`.norm`), so readers derive the post-norm rows; when no formula reproduced the model's
norm (``norm_formula: none``) the post-norm rows are stored too (``hidden_states_post``). :meth:`StatesFile.sample`
and :func:`load_states` return either form (``final="post"`` / ``"pre"``).

Storage savers (optional, recorded in the metadata; the readers undo them):

- ``final_states="supervised"``: ``hidden_states`` holds only the rows where ``final_mask`` is 1, i.e. the
  positions a draft-model loss can read a target distribution from: every supervised position ``p``
  (``loss_mask[p] == 1``) and the position right after one inside the same sample (``loss_mask[p-1] == 1``).
  That covers both shift conventions in use (SpecForge with PR #895: teacher row ``p`` for mask ``p``;
  SpecForge main / EAGLE ``dataprepare``: teacher row ``p+1`` for mask ``p``). Extra tensor ``final_mask``
  [T] int8; ``hidden_states`` (and ``hidden_states_post``) become [S, H] with S = ``final_mask.sum()``. Readers
  that need [T, H] get zeros at the other rows (never read by the loss).
- ``aux_format="fp8_e4m3"``: ``aux_hidden_states`` stored as ``F8_E4M3`` [T, U*H] with ``aux_scales``
  [T, U] float32, one scale per token and layer (``amax / 448``); value = ``fp8.float() * scale``.
- ``final_format="fp8_e4m3"``: ``hidden_states`` (and ``hidden_states_post``) stored as ``F8_E4M3`` [S, H]
  with ``final_scales`` (``final_post_scales``) [S] float32, one scale per row. With both savers the EAGLE-3
  states of an 8B target (H = 4,096, three layers) take 16,405 bytes per token (speculators' FP8 files: 16,396).

Metadata (all strings): ``format``, ``backend``, ``model_path``, ``model_name``, ``model_type``,
``model_fingerprint``, ``num_layers``, ``hidden_size``, ``layers`` (JSON list: the stored columns' layers),
``drafter_layers`` (JSON ``{drafter: [layer, ...]}``: the layers each drafter reads, picked from ``layers`` by the
exports; files before v3: ``{"eagle3": layers}``), ``layer_convention``, ``final_norm`` ("post" | "pre" |
"both"), and with ``both`` ``norm_formula``, ``norm_eps``, ``norm_check`` (JSON: the first batch's
comparison, :func:`.norm.check_formulas`), ``dtype``, ``final_states``, ``aux_format``, ``final_format``,
``num_samples``, ``num_tokens``, ``sample_ids`` and ``datasets`` (JSON lists, per sample), ``source`` (the token
shard), ``selection_digest`` (the merge's digest of that selection: what a consumer checks to know the file is
not stale) and ``state_settings`` (digest of everything the values depend on: what the stage checks before it
reuses a sample's rows).

Formats: v3 (this one) added the drafter layers, ``final_norm: both`` and ``final_format``; v1 and v2 files read
as before (their rows are the same bytes: a v2 file's rows are reused by a v3 job with the same settings).

The file is a plain safetensors file (any safetensors reader opens it). :class:`HiddenStateWriter` lays it
out as it is computed: the header first (sizes are known from the token shard), then each sample's rows at
their final offsets through a memory map, so memory stays bounded by one batch; the file is written under a
temporary name and renamed when complete (a crash leaves no file a rerun would take as done).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pyarrow.parquet as pq

from ..files import atomic_path

FORMAT = "eagle3-data/hidden-states/v3"
#: the encoding of a file's rows, in :func:`~.stage.settings_digest`: unchanged since v2, so the rows of a v2 file
#: computed with the same settings are reused by a v3 job
ROWS_FORMAT = "eagle3-data/hidden-states/v2"
#: formats the readers accept (v1: one file per merged shard, no selection/settings digests; v2: no drafter layers,
#: no ``final_norm: both``, no ``final_format``)
READABLE_FORMATS = ("eagle3-data/hidden-states/v1", "eagle3-data/hidden-states/v2", FORMAT)
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_CODE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "I8": 1}
FINAL_STATES = ("all", "supervised")
FINAL_NORMS = ("post", "pre", "both")
AUX_FORMATS = ("same", "fp8_e4m3")
FINAL_FORMATS = ("same", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class TokenShard:
    """The token ids, loss masks and sample boundaries of a MERGED-schema parquet file, flattened: a merge
    selection (what one extraction job forwards) or a merged shard.

    Attributes: ``path``, ``sample_ids``, ``datasets`` (lists of N str), ``offsets`` [N+1] int64,
    ``ids`` [T] int32, ``mask`` [T] int8, ``lengths`` (list of N ints), ``n``, ``T``.
    Raises ValueError when a row's ``loss_mask`` and ``input_ids`` lengths differ or a sample is empty.
    """

    def __init__(self, path):
        table = pq.read_table(path, columns=["sample_id", "dataset", "input_ids", "loss_mask"])
        self.path = str(path)
        self.sample_ids = table.column("sample_id").to_pylist()
        self.datasets = table.column("dataset").to_pylist()
        ids_col = table.column("input_ids").combine_chunks()
        mask_col = table.column("loss_mask").combine_chunks()
        offsets = ids_col.offsets.to_numpy().astype(np.int64)
        self.offsets = offsets - offsets[0]
        moff = mask_col.offsets.to_numpy().astype(np.int64)
        if not np.array_equal(moff - moff[0], self.offsets):
            raise ValueError(f"{path}: loss_mask and input_ids lengths differ in some row")
        self.n = len(self.sample_ids)
        self.T = int(self.offsets[-1]) if self.n else 0
        lo, lm = int(offsets[0]), int(moff[0])
        self.ids = ids_col.values.to_numpy(zero_copy_only=False)[lo : lo + self.T].astype(np.int32)
        self.mask = mask_col.values.to_numpy(zero_copy_only=False)[lm : lm + self.T].astype(np.int8)
        self.lengths = np.diff(self.offsets).tolist()
        if self.n and min(self.lengths) < 1:
            bad = self.sample_ids[self.lengths.index(min(self.lengths))]
            raise ValueError(f"{path}: sample {bad!r} has no tokens")

    def sample_ids_of(self, i: int) -> np.ndarray:
        """Token ids of sample ``i`` ([len_i] int32 view)."""
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def mask_of(self, i: int) -> np.ndarray:
        """Loss mask of sample ``i`` ([len_i] int8 view)."""
        return self.mask[self.offsets[i] : self.offsets[i + 1]]


def supervised_final_mask(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Rows whose final hidden state a draft-model loss can read: ``mask[p] | mask[p-1]`` within a sample.

    Args: ``loss_mask`` [T] 0/1 (all samples concatenated), ``offsets`` [N+1] sample boundaries.
    Returns: [T] int8 0/1. See the module docstring for the two shift conventions this covers.
    """
    m = np.asarray(loss_mask).astype(bool)
    prev = np.zeros_like(m)
    prev[1:] = m[:-1]
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    starts = starts[starts < len(m)]
    prev[starts] = False  # the position after a sample's last token belongs to the next sample
    return (m | prev).astype(np.int8)


def quantize_fp8(x, num_layers: int):
    """Per-token, per-layer fp8 e4m3 quantisation of ``x`` [..., A*H] -> ``(q [..., A*H] float8_e4m3fn,
    scales [..., A] float32)`` with ``scale = amax / 448`` (all-zero rows get scale 1)."""
    import torch

    *lead, width = x.shape
    xf = x.float().reshape(*lead, num_layers, width // num_layers)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, width), scale


def dequantize_fp8(q, scales, dtype=None):
    """Inverse of :func:`quantize_fp8`: ``q`` [T, A*H] fp8, ``scales`` [T, A] -> [T, A*H] in ``dtype``
    (default float32)."""
    import torch

    T, width = q.shape
    A = scales.shape[-1]
    out = q.float().reshape(T, A, width // A) * scales.float().unsqueeze(-1)
    return out.reshape(T, width).to(dtype or torch.float32)


def _write_header(fh, tensors: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> dict:
    """Write a safetensors header for ``(name, dtype_code, shape, nbytes)`` laid out in order; return
    ``{name: absolute_byte_offset}`` of each tensor's data in the file."""
    header: dict = {"__metadata__": metadata}
    pos = 0
    for name, code, shape, nbytes in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    fh.write(struct.pack("<Q", len(blob)))
    fh.write(blob)
    base = 8 + len(blob)
    offsets = {name: base + header[name]["data_offsets"][0] for name, *_ in tensors}
    fh.truncate(base + pos)
    return offsets


def _read_header(path) -> tuple[dict, dict, int]:
    """``(tensors {name: (code, shape, start, end)} with absolute offsets, metadata, file size)``.
    Raises ValueError naming the file when it is not a safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n} past the end)")
        header = json.loads(fh.read(n))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    tensors = {
        k: (v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1]) for k, v in header.items()
    }
    return tensors, meta, size


class HiddenStateWriter:
    """Writes one hidden-states file (module docstring layout) sample by sample, straight to its final offsets.

    Use as a context manager: the header is written from the known sizes on entry, :meth:`write` puts one
    sample's computed rows in place through a memory map, :meth:`copy` puts rows reused from an earlier file
    in place byte for byte, and the temporary file is renamed onto ``out_path`` only when the block ends
    without error and every sample was written (a crash leaves no file). :meth:`write` applies the storage
    savers (``final_states``, ``aux_format``, ``final_format``).

    ``norm_weight`` ([H] float tensor or array; ``final_norm: both``) is stored as ``final_norm_weight``;
    ``store_post`` adds ``hidden_states_post`` (then :meth:`write` takes the post-norm rows too).
    """

    def __init__(
        self,
        out_path,
        shard: TokenShard,
        *,
        hidden_size: int,
        num_aux: int,
        dtype: str,
        final_states: str,
        aux_format: str,
        metadata: dict,
        final_format: str = "same",
        norm_weight=None,
        store_post: bool = False,
    ):
        import torch

        self.out_path, self.shard = out_path, shard
        self.H, self.A = int(hidden_size), int(num_aux)
        self.dtype, self.final_states, self.aux_format = dtype, final_states, aux_format
        self.final_format, self.store_post = final_format, bool(store_post)
        self.tdtype = getattr(torch, dtype)
        self.elt = torch.tensor([], dtype=self.tdtype).element_size()
        self.ibits = getattr(torch, f"int{8 * self.elt}")
        self.raw = np.dtype(f"u{self.elt}")  # float bits as unsigned ints (numpy has no bfloat16)
        self.fp8 = aux_format == "fp8_e4m3"
        self.ffp8 = final_format == "fp8_e4m3"
        self.norm_weight = (
            None
            if norm_weight is None
            else np.asarray(
                norm_weight.float().cpu() if hasattr(norm_weight, "float") else norm_weight, dtype=np.float32
            )
        )
        T, n, H, A = shard.T, shard.n, self.H, self.A
        if final_states == "supervised":
            self.fmask = supervised_final_mask(shard.mask, shard.offsets)
            self.frow = np.concatenate([[0], np.cumsum(self.fmask, dtype=np.int64)])
        else:
            self.fmask = self.frow = None
        self.S = int(self.frow[-1]) if self.fmask is not None else T
        self.metadata = {k: str(v) for k, v in metadata.items()}
        self.metadata.update(
            format=FORMAT,
            final_states=final_states,
            aux_format=aux_format,
            dtype=dtype,
            final_format=final_format,
            num_samples=str(n),
            num_tokens=str(T),
            hidden_size=str(H),
        )
        elt, S = self.elt, self.S
        tensors = [("sample_offsets", "I64", [n + 1], (n + 1) * 8)]
        if self.fp8:
            tensors += [
                ("aux_hidden_states", "F8_E4M3", [T, A * H], T * A * H),
                ("aux_scales", "F32", [T, A], T * A * 4),
            ]
        else:
            tensors += [("aux_hidden_states", DTYPES[dtype], [T, A * H], T * A * H * elt)]
        for name, scales in (("hidden_states", "final_scales"),) + (
            (("hidden_states_post", "final_post_scales"),) if self.store_post else ()
        ):
            if self.ffp8:
                tensors += [(name, "F8_E4M3", [S, H], S * H), (scales, "F32", [S], S * 4)]
            else:
                tensors += [(name, DTYPES[dtype], [S, H], S * H * elt)]
        if self.norm_weight is not None:
            if self.norm_weight.shape != (H,):
                raise ValueError(f"final norm weight has shape {self.norm_weight.shape}, expected ({H},)")
            tensors.append(("final_norm_weight", "F32", [H], H * 4))
        tensors += [("input_ids", "I32", [T], T * 4), ("loss_mask", "I8", [T], T)]
        if self.fmask is not None:
            tensors.append(("final_mask", "I8", [T], T))
        self.tensors = tensors
        self.done = np.zeros(n, dtype=bool)

    def __enter__(self):
        self._atomic = atomic_path(self.out_path)
        tmp = self._atomic.__enter__()
        self._tmp, self._sync_fd = tmp, None
        try:
            with open(tmp, "wb") as fh:
                pos = _write_header(fh, self.tensors, self.metadata)
            size = os.path.getsize(tmp)
            self._mm = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(size,)) if size else None
            sh, T, S = self.shard, self.shard.T, self.S

            def view(name, np_dtype, shape):
                start = pos[name]
                count = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
                return self._mm[start : start + count].view(np_dtype).reshape(shape)

            if self._mm is not None:
                view("sample_offsets", np.int64, (sh.n + 1,))[:] = sh.offsets
            if self.norm_weight is not None:
                view("final_norm_weight", np.float32, (self.H,))[:] = self.norm_weight
            self.aux_out = self.scale_out = None
            self.fin_out = {}  # tensor name -> (rows view, scales view or None)
            if T:
                view("input_ids", np.int32, (T,))[:] = sh.ids
                view("loss_mask", np.int8, (T,))[:] = sh.mask
                if self.fmask is not None:
                    view("final_mask", np.int8, (T,))[:] = self.fmask
                self.aux_out = view("aux_hidden_states", np.uint8 if self.fp8 else self.raw, (T, self.A * self.H))
                if self.fp8:
                    self.scale_out = view("aux_scales", np.float32, (T, self.A))
            if S:
                for name, scales in self._final_tensors():
                    rows = view(name, np.uint8 if self.ffp8 else self.raw, (S, self.H))
                    self.fin_out[name] = (rows, view(scales, np.float32, (S,)) if self.ffp8 else None)
        except BaseException as exc:
            self._atomic.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _final_tensors(self) -> list[tuple[str, str]]:
        """``(rows tensor, scales tensor)`` names of the stored final states: the main one, then the post-norm one."""
        out = [("hidden_states", "final_scales")]
        if self.store_post:
            out.append(("hidden_states_post", "final_post_scales"))
        return out

    def _span(self, i: int) -> tuple[int, int]:
        return int(self.shard.offsets[i]), int(self.shard.offsets[i + 1])

    def check_shapes(self, i: int, aux_shape, fin_shape) -> None:
        """Raise RuntimeError unless sample ``i`` captured ``aux`` [len_i, A*H] and ``final`` [len_i, H]."""
        s, e = self._span(i)
        n = e - s
        if tuple(aux_shape) != (n, self.A * self.H) or tuple(fin_shape) != (n, self.H):
            raise RuntimeError(
                f"{self.shard.path}: sample {self.shard.sample_ids[i]!r} captured aux {tuple(aux_shape)} / final "
                f"{tuple(fin_shape)}, expected ({n}, {self.A * self.H}) / ({n}, {self.H}) (capture length must "
                "equal input length)"
            )

    def _prepare_final(self, final) -> list:
        import torch

        if self.ffp8:
            q, sc = quantize_fp8(final, 1)
            return [q.contiguous().view(torch.uint8), sc.reshape(-1).contiguous()]
        return [final.to(self.tdtype).contiguous().view(self.ibits)]

    def prepare(self, aux, final, post=None) -> list:
        """One sample's computed states as the tensors the file stores, on their own device (so a GPU does the
        casts and the fp8 quantisation), in this order: auxiliary bits [n, A*H] (the file dtype's bits as signed
        ints of its width; with ``aux_format=fp8_e4m3`` fp8 bits as uint8, then scales [n, A] float32), final bits
        [n, H] (with ``final_format=fp8_e4m3`` fp8 bits, then scales [n] float32), and with ``store_post`` the
        post-norm rows ``post`` [n, H] the same way. ``aux`` [n, A*H] / ``final`` / ``post`` [n, H]: torch
        tensors of any float dtype. What :meth:`put` takes, once on the host. Raises ValueError when ``post``
        is given without ``store_post`` or missing with it."""
        import torch

        if (post is not None) != self.store_post:
            raise ValueError(
                f"{self.shard.path}: post-norm rows {'given' if post is not None else 'missing'} for a "
                f"file that {'stores' if self.store_post else 'does not store'} them"
            )
        if self.fp8:
            q, sc = quantize_fp8(aux, self.A)
            parts = [q.contiguous().view(torch.uint8), sc.contiguous()]
        else:
            parts = [aux.to(self.tdtype).contiguous().view(self.ibits)]
        parts += self._prepare_final(final)
        if post is not None:
            parts += self._prepare_final(post)
        return parts

    def put(self, i: int, parts: list) -> None:
        """Store sample ``i`` from :meth:`prepare`'s tensors as host numpy arrays (same shapes and bits).
        Raises RuntimeError when a shape differs from the sample's."""
        s, e = self._span(i)
        k = 2 if self.fp8 else 1
        aux = parts[0]
        step = 2 if self.ffp8 else 1
        finals = [parts[k + j * step : k + (j + 1) * step] for j in range(len(self._final_tensors()))]
        self.check_shapes(i, aux.shape, finals[0][0].shape)
        if self.fp8:
            self.aux_out[s:e] = aux.view(np.uint8)
            self.scale_out[s:e] = parts[1]
        else:
            self.aux_out[s:e] = aux.view(self.raw)
        if self.fmask is not None:
            keep = self.fmask[s:e].astype(bool)
            r0, r1 = int(self.frow[s]), int(self.frow[e])
        for (name, _), part in zip(self._final_tensors(), finals):
            if not self.S:
                break
            rows_out, scales_out = self.fin_out[name]
            rows = part[0].view(np.uint8 if self.ffp8 else self.raw)
            if self.fmask is None:
                rows_out[s:e] = rows
                if scales_out is not None:
                    scales_out[s:e] = part[1]
            elif r1 > r0:
                rows_out[r0:r1] = rows[keep]
                if scales_out is not None:
                    scales_out[r0:r1] = part[1][keep]
        self.done[i] = True

    def write(self, i: int, aux, final, post=None) -> None:
        """Store sample ``i`` computed: ``aux`` [len_i, A*H] and ``final`` [len_i, H] torch tensors (any float
        dtype, any device; cast to the file dtype; ``post`` [len_i, H]: the post-norm rows, with ``store_post``),
        in the calling thread (:meth:`prepare`, a blocking copy to the host, :meth:`put`). Raises RuntimeError
        when a shape differs from the sample's (a capture must have exactly its input's length)."""
        self.check_shapes(i, aux.shape, final.shape)
        self.put(i, [t.cpu().numpy() for t in self.prepare(aux, final, post)])

    def copy(self, i: int, src: "StatesFile", j: int) -> None:
        """Store sample ``i`` from sample ``j`` of ``src``, byte for byte: the first ``len_i`` rows of ``j``
        (its prefix when sample ``i`` is a truncation of ``j``; a causal model's states at a position depend on
        the tokens up to it only). The caller checks that ``src`` has the same layout settings
        (:meth:`StatesFile.same_settings`; and, for ``final_norm: both``, whether it stores the post-norm rows)
        and that ids and loss mask agree on those rows (:func:`reusable`).
        """
        s, e = self._span(i)
        n = e - s
        ss = int(src.offsets[j])
        self.aux_out[s:e] = src.rows("aux_hidden_states")[ss : ss + n]
        if self.fp8:
            self.scale_out[s:e] = src.rows("aux_scales", np.float32)[ss : ss + n]
        if self.fmask is None:
            r0, r1, f0 = s, e, ss
        else:
            r0, r1 = int(self.frow[s]), int(self.frow[e])
            f0 = int(src.frow[ss])
        if r1 > r0:
            for name, scales in self._final_tensors():
                rows_out, scales_out = self.fin_out[name]
                rows_out[r0:r1] = src.rows(name)[f0 : f0 + r1 - r0]
                if scales_out is not None:
                    scales_out[r0:r1] = src.rows(scales, np.float32)[f0 : f0 + r1 - r0]
        self.done[i] = True

    def sync(self) -> None:
        """Write the rows stored so far to disk (``fsync`` of the temporary file; releases the GIL), so the
        flush when the block ends has little left. The writeback thread calls it while the next batch is
        forwarded."""
        if self._sync_fd is None:
            self._sync_fd = os.open(self._tmp, os.O_RDONLY)
        os.fsync(self._sync_fd)

    @property
    def written(self) -> int:
        return int(self.done.sum())

    def __exit__(self, exc_type, exc, tb):
        if getattr(self, "_sync_fd", None) is not None:
            os.close(self._sync_fd)
            self._sync_fd = None
        err = None
        if exc_type is None and not self.done.all():
            missing = [self.shard.sample_ids[k] for k in np.flatnonzero(~self.done)[:3]]
            err = RuntimeError(
                f"{self.shard.path}: {self.written} of {self.shard.n} samples written (missing e.g. {missing})"
            )
        if self._mm is not None:
            if exc_type is None and err is None:
                self._mm.flush()
            self.aux_out = self.scale_out = None
            self.fin_out = {}
            self._mm = None
        if exc_type is None and err is None:
            self._atomic.__exit__(None, None, None)  # fsync + rename into place
            return False
        if err is not None:
            self._atomic.__exit__(RuntimeError, err, None)  # removes the temporary file
            raise err
        self._atomic.__exit__(exc_type, exc, tb)
        return False


class StatesFile:
    """Read access to one hidden-states file without loading it: sample lookup by id, raw rows for copying,
    and per-sample tensors with the storage savers undone. Memory-mapped, so reading a few samples of a
    multi-GB file costs their bytes only.

    Attributes: ``path``, ``meta`` (metadata dict), ``sample_ids``, ``datasets``, ``offsets`` [N+1] int64,
    ``ids`` [T] int32, ``mask`` [T] int8, ``index`` ({sample_id: row in the file}), ``frow`` ([T+1] int64
    prefix counts of ``final_mask``, or None when every final row is stored), ``layers`` (the stored auxiliary
    layers, column order), ``drafter_layers`` ({drafter: layers}), ``final_forms`` (the final states it serves:
    ``{"post"}``, ``{"pre"}`` or both).

    Raises ValueError naming the file when it is not a hidden-states file of a readable format.
    """

    def __init__(self, path):
        self.path = str(path)
        self.tensors, self.meta, size = _read_header(path)
        fmt = self.meta.get("format", "")
        if fmt not in READABLE_FORMATS:
            raise ValueError(f"{path}: not an eagle3-data hidden-states file (format={fmt!r})")
        self._mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)) if size else np.zeros(0, np.uint8)
        self.sample_ids = json.loads(self.meta.get("sample_ids", "[]"))
        self.datasets = json.loads(self.meta.get("datasets", "[]"))
        self.offsets = np.asarray(self.rows("sample_offsets", np.int64)).astype(np.int64)
        self.ids = self.rows("input_ids", np.int32)
        self.mask = self.rows("loss_mask", np.int8)
        self.index = {sid: j for j, sid in enumerate(self.sample_ids)}
        if "final_mask" in self.tensors:
            fm = self.rows("final_mask", np.int8)
            self.frow = np.concatenate([[0], np.cumsum(fm, dtype=np.int64)])
        else:
            self.frow = None
        self.layers = json.loads(self.meta.get("layers", "[]"))
        self.drafter_layers = (
            json.loads(self.meta["drafter_layers"]) if "drafter_layers" in self.meta else {"eagle3": list(self.layers)}
        )
        norm = self.meta.get("final_norm", "post")
        self.final_forms = {"post", "pre"} if norm == "both" else {norm}

    def rows(self, name: str, np_dtype=None) -> np.ndarray:
        """Tensor ``name`` as a read-only memory-mapped numpy array: ``np_dtype`` if given, else float/fp8
        rows as raw unsigned bytes of their width ([rows, cols] of ``u1``/``u2``/``u4``)."""
        code, shape, start, end = self.tensors[name]
        dt = np.dtype(np_dtype) if np_dtype is not None else np.dtype(f"u{_CODE_BYTES[code]}")
        arr = self._mm[start:end].view(dt)
        return arr.reshape(shape)

    def same_settings(self, state_settings: str) -> bool:
        """Whether this file's values were computed with ``state_settings`` (digest; see stage.settings_digest)."""
        return self.meta.get("state_settings") == state_settings

    def layer_index(self, layers) -> list[int]:
        """Column block (0-based, of ``layers``) of each of ``layers`` in the stored auxiliary states. Raises
        ValueError naming the file and the missing layers."""
        missing = [x for x in layers if x not in self.layers]
        if missing:
            raise ValueError(
                f"{self.path}: auxiliary layers {missing} are not stored (it holds {self.layers}); "
                "add the drafter that reads them to extract.drafters"
            )
        return [self.layers.index(x) for x in layers]

    def final_rows(self, s: int, e: int, final: str | None = None, dtype=None):
        """The final states of rows ``s:e`` as a [e - s, H] tensor in ``dtype`` (default: the file's dtype): the
        form ``final`` (``"post"`` | ``"pre"``; None: as stored), rows not stored under ``final_states=supervised``
        zeros. Raises ValueError naming the file and ``extract.final_norm`` when it cannot serve ``final``."""
        import torch

        fdtype = getattr(torch, self.meta.get("dtype", "float32"))
        out_dtype = dtype or fdtype
        norm = self.meta.get("final_norm", "post")
        if final is not None and final not in self.final_forms:
            raise ValueError(
                f"{self.path}: holds {norm}-norm final states, not {final}-norm; extract with "
                f"extract.final_norm: both (or {final})"
            )
        name, derive = "hidden_states", False
        if norm == "both" and final == "post":
            if "hidden_states_post" in self.tensors:
                name = "hidden_states_post"
            else:
                derive = True
        H = int(self.meta["hidden_size"])
        if self.frow is None:
            k0, k1, keep = s, e, None
        else:
            k0, k1 = int(self.frow[s]), int(self.frow[e])
            keep = torch.from_numpy(np.array(self.rows("final_mask", np.int8)[s:e])).bool()
        if self.meta.get("final_format", "same") == "fp8_e4m3":
            scales_name = "final_post_scales" if name == "hidden_states_post" else "final_scales"
            q = torch.from_numpy(np.array(self.rows(name)[k0:k1])).view(torch.float8_e4m3fn)
            sc = torch.from_numpy(np.array(self.rows(scales_name, np.float32)[k0:k1]))
            got = dequantize_fp8(q, sc[:, None], fdtype)
        else:
            got = _as_float(np.array(self.rows(name)[k0:k1]), fdtype)
        if derive and k1 > k0:
            from .norm import apply_norm

            weight = torch.from_numpy(np.array(self.rows("final_norm_weight", np.float32)))
            got = apply_norm(got, weight, float(self.meta["norm_eps"]), self.meta["norm_formula"], fdtype)
        got = got.to(out_dtype)
        if keep is None:
            return got
        fin = torch.zeros((e - s, H), dtype=out_dtype)
        if k1 > k0:
            fin[keep] = got
        return fin

    def sample(self, j: int, dtype=None, *, final: str | None = None, layers=None) -> dict:
        """Sample ``j``'s tensors with the savers undone: ``input_ids`` [n] int64, ``loss_mask`` [n] int64,
        ``aux_hidden_states`` [n, A*H] and ``hidden_states`` [n, H] in ``dtype`` (default: the file's dtype).
        ``final``: ``"post"`` or ``"pre"`` for that form of the final state (None: as stored; see
        :meth:`final_rows`); ``layers``: the auxiliary layers to return, in that order (None: every stored one, A =
        U). Raises ValueError (naming the setting) when the file cannot serve ``final`` or ``layers``."""
        import torch

        s, e = int(self.offsets[j]), int(self.offsets[j + 1])
        fdtype = getattr(torch, self.meta.get("dtype", "float32"))
        out_dtype = dtype or fdtype
        H = int(self.meta["hidden_size"])
        U = len(self.layers) or self.tensors["aux_hidden_states"][1][1] // H
        idx = list(range(U)) if layers is None else self.layer_index(layers)
        aux_raw = np.array(self.rows("aux_hidden_states")[s:e].reshape(e - s, U, H)[:, idx])
        if self.meta.get("aux_format", "same") == "fp8_e4m3":
            q = torch.from_numpy(aux_raw.reshape(e - s, -1)).view(torch.float8_e4m3fn)
            sc = np.array(self.rows("aux_scales", np.float32)[s:e][:, idx])
            aux = dequantize_fp8(q, torch.from_numpy(sc), out_dtype)
        else:
            aux = _as_float(aux_raw.reshape(e - s, -1), fdtype).to(out_dtype)
        return {
            "input_ids": torch.from_numpy(np.array(self.ids[s:e])).long(),
            "loss_mask": torch.from_numpy(np.array(self.mask[s:e])).long(),
            "aux_hidden_states": aux,
            "hidden_states": self.final_rows(s, e, final, out_dtype),
        }

    def close(self) -> None:
        self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _as_float(raw: np.ndarray, tdtype):
    """Raw float bits (unsigned ints of the dtype's width) -> a torch tensor of ``tdtype``."""
    import torch

    ibits = getattr(torch, f"int{8 * raw.dtype.itemsize}")
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.dtype(f"i{raw.dtype.itemsize}"))).view(ibits).view(tdtype)


def reusable(src: StatesFile, j: int, ids: np.ndarray, mask: np.ndarray) -> bool:
    """Whether sample ``j`` of ``src`` can supply the rows of a sample with ``ids`` and ``mask``: it is at
    least as long, and its ids and loss mask start with them (equal, or the new sample is its truncation)."""
    s, e = int(src.offsets[j]), int(src.offsets[j + 1])
    n = len(ids)
    return e - s >= n and np.array_equal(src.ids[s : s + n], ids) and np.array_equal(src.mask[s : s + n], mask)


def read_hidden_states(path) -> tuple[dict, dict]:
    """Read a whole hidden-states file: ``(tensors {name: torch.Tensor}, metadata {key: str})``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def load_states(path, dtype=None, *, final: str | None = None) -> tuple[dict, dict]:
    """Read a whole hidden-states file and undo the storage savers: ``(tensors, metadata)`` with

    ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``sample_offsets`` [N+1] int64,
    ``aux_hidden_states`` [T, U*H] and ``hidden_states`` [T, H] in ``dtype`` (default: the file's
    ``dtype``; fp8 states are dequantised with their scales; rows not stored under
    ``final_states=supervised`` are zeros; ``final``: ``"post"`` | ``"pre"`` | None as in
    :meth:`StatesFile.final_rows`), and ``final_mask`` [T] bool (all True when every row is stored).
    Raises ValueError naming the file when it cannot serve ``final``.
    """
    import torch

    with StatesFile(path) as f:
        T = int(f.offsets[-1]) if len(f.offsets) else 0
        fdtype = getattr(torch, f.meta.get("dtype", "float32"))
        out_dtype = dtype or fdtype
        H = int(f.meta["hidden_size"])
        if f.meta.get("aux_format", "same") == "fp8_e4m3":
            q = torch.from_numpy(np.array(f.rows("aux_hidden_states"))).view(torch.float8_e4m3fn)
            aux = dequantize_fp8(q, torch.from_numpy(np.array(f.rows("aux_scales", np.float32))), out_dtype)
        else:
            aux = _as_float(np.array(f.rows("aux_hidden_states")), fdtype).to(out_dtype)
        fin = f.final_rows(0, T, final, out_dtype) if T else torch.zeros((0, H), dtype=out_dtype)
        fmask = (
            torch.from_numpy(np.array(f.rows("final_mask", np.int8))).bool()
            if f.frow is not None
            else torch.ones(T, dtype=torch.bool)
        )
        out = {
            "input_ids": torch.from_numpy(np.array(f.ids)).long(),
            "loss_mask": torch.from_numpy(np.array(f.mask)).long(),
            "sample_offsets": torch.from_numpy(np.array(f.offsets)).long(),
            "aux_hidden_states": aux,
            "hidden_states": fin,
            "final_mask": fmask,
        }
        return out, dict(f.meta)
