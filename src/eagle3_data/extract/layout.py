"""The hidden-states file: its layout, its writer and its readers. No model code here.

One file holds the states of the samples of one token shard (a merge selection: the kept samples of one
validated dataset shard, truncated to ``merge.max_len``), concatenated without padding. T = tokens in the
file, N = samples, H = hidden size, A = number of auxiliary layers:

======================  ==========  =====================================================
tensor                  shape       dtype
======================  ==========  =====================================================
``input_ids``           [T]         int32
``loss_mask``           [T]         int8 (0/1)
``aux_hidden_states``   [T, A*H]    ``dtype`` (layer j at columns ``j*H:(j+1)*H``)
``hidden_states``       [T, H]      ``dtype`` (final state; ``final_norm`` says post- or pre-norm)
``sample_offsets``      [N+1]       int64; sample n = rows ``offsets[n]:offsets[n+1]``
======================  ==========  =====================================================

Storage savers (optional, recorded in the metadata; :func:`load_states` and :meth:`StatesFile.sample` undo
both):

- ``final_states="supervised"``: ``hidden_states`` holds only the rows where ``final_mask`` is 1, i.e. the
  positions a draft-model loss can read a target distribution from: every supervised position ``p``
  (``loss_mask[p] == 1``) and the position right after one inside the same sample (``loss_mask[p-1] == 1``).
  That covers both shift conventions in use (SpecForge with PR #895: teacher row ``p`` for mask ``p``;
  SpecForge main / EAGLE ``dataprepare``: teacher row ``p+1`` for mask ``p``). Extra tensor ``final_mask``
  [T] int8; ``hidden_states`` becomes [S, H] with S = ``final_mask.sum()``. Readers that need [T, H] get
  zeros at the other rows (never read by the loss).
- ``aux_format="fp8_e4m3"``: ``aux_hidden_states`` stored as ``F8_E4M3`` [T, A*H] with ``aux_scales``
  [T, A] float32, one scale per token and layer (``amax / 448``); value = ``fp8.float() * scale``.

Metadata (all strings): ``format``, ``backend``, ``model_path``, ``model_name``, ``model_type``,
``model_fingerprint``, ``num_layers``, ``hidden_size``, ``layers`` (JSON list), ``layer_convention``,
``final_norm`` ("post" | "pre"), ``dtype``, ``final_states``, ``aux_format``, ``num_samples``,
``num_tokens``, ``sample_ids`` and ``datasets`` (JSON lists, per sample), ``source`` (the token shard),
``selection_digest`` (the merge's digest of that selection: what a consumer checks to know the file is not
stale) and ``state_settings`` (digest of everything the values depend on: what the stage checks before it
reuses a sample's rows).

The file is a plain safetensors file (any safetensors reader opens it). :class:`HiddenStateWriter` lays it
out as it is computed: the header first (sizes are known from the token shard), then each sample's rows at
their final offsets through a memory map, so memory stays bounded by one batch; the file is written under a
temporary name and renamed when complete (a crash leaves no file a rerun would take as done).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ..io import atomic_path

FORMAT = "eagle3-data/hidden-states/v2"
#: formats the readers accept (v1: one file per merged shard, no selection/settings digests)
READABLE_FORMATS = ("eagle3-data/hidden-states/v1", FORMAT)
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_CODE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "I8": 1}
FINAL_STATES = ("all", "supervised")
FINAL_NORMS = ("post", "pre")
AUX_FORMATS = ("same", "fp8_e4m3")
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
        self.ids = ids_col.values.to_numpy(zero_copy_only=False)[lo:lo + self.T].astype(np.int32)
        self.mask = mask_col.values.to_numpy(zero_copy_only=False)[lm:lm + self.T].astype(np.int8)
        self.lengths = np.diff(self.offsets).tolist()
        if self.n and min(self.lengths) < 1:
            bad = self.sample_ids[self.lengths.index(min(self.lengths))]
            raise ValueError(f"{path}: sample {bad!r} has no tokens")

    def sample_ids_of(self, i: int) -> np.ndarray:
        """Token ids of sample ``i`` ([len_i] int32 view)."""
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def mask_of(self, i: int) -> np.ndarray:
        """Loss mask of sample ``i`` ([len_i] int8 view)."""
        return self.mask[self.offsets[i]:self.offsets[i + 1]]


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
    tensors = {k: (v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1])
               for k, v in header.items()}
    return tensors, meta, size


class HiddenStateWriter:
    """Writes one hidden-states file (module docstring layout) sample by sample, straight to its final offsets.

    Use as a context manager: the header is written from the known sizes on entry, :meth:`write` puts one
    sample's computed rows in place through a memory map, :meth:`copy` puts rows reused from an earlier file
    in place byte for byte, and the temporary file is renamed onto ``out_path`` only when the block ends
    without error and every sample was written (a crash leaves no file). :meth:`write` applies the storage
    savers (``final_states``, ``aux_format``).
    """

    def __init__(self, out_path, shard: TokenShard, *, hidden_size: int, num_aux: int, dtype: str,
                 final_states: str, aux_format: str, metadata: dict):
        import torch

        self.out_path, self.shard = out_path, shard
        self.H, self.A = int(hidden_size), int(num_aux)
        self.dtype, self.final_states, self.aux_format = dtype, final_states, aux_format
        self.tdtype = getattr(torch, dtype)
        self.elt = torch.tensor([], dtype=self.tdtype).element_size()
        self.ibits = getattr(torch, f"int{8 * self.elt}")
        self.raw = np.dtype(f"u{self.elt}")  # float bits as unsigned ints (numpy has no bfloat16)
        self.fp8 = aux_format == "fp8_e4m3"
        T, n, H, A = shard.T, shard.n, self.H, self.A
        if final_states == "supervised":
            self.fmask = supervised_final_mask(shard.mask, shard.offsets)
            self.frow = np.concatenate([[0], np.cumsum(self.fmask, dtype=np.int64)])
        else:
            self.fmask = self.frow = None
        self.S = int(self.frow[-1]) if self.fmask is not None else T
        self.metadata = {k: str(v) for k, v in metadata.items()}
        self.metadata.update(format=FORMAT, final_states=final_states, aux_format=aux_format, dtype=dtype,
                             num_samples=str(n), num_tokens=str(T), hidden_size=str(H))
        elt = self.elt
        tensors = [("sample_offsets", "I64", [n + 1], (n + 1) * 8)]
        if self.fp8:
            tensors += [("aux_hidden_states", "F8_E4M3", [T, A * H], T * A * H), ("aux_scales", "F32", [T, A], T * A * 4)]
        else:
            tensors += [("aux_hidden_states", DTYPES[dtype], [T, A * H], T * A * H * elt)]
        tensors += [("hidden_states", DTYPES[dtype], [self.S, H], self.S * H * elt),
                    ("input_ids", "I32", [T], T * 4), ("loss_mask", "I8", [T], T)]
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
            sh, T = self.shard, self.shard.T

            def view(name, np_dtype, shape):
                start = pos[name]
                count = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
                return self._mm[start:start + count].view(np_dtype).reshape(shape)

            if self._mm is not None:
                view("sample_offsets", np.int64, (sh.n + 1,))[:] = sh.offsets
            self.aux_out = self.scale_out = self.fin_out = None
            if T:
                view("input_ids", np.int32, (T,))[:] = sh.ids
                view("loss_mask", np.int8, (T,))[:] = sh.mask
                if self.fmask is not None:
                    view("final_mask", np.int8, (T,))[:] = self.fmask
                self.aux_out = view("aux_hidden_states", np.uint8 if self.fp8 else self.raw, (T, self.A * self.H))
                if self.fp8:
                    self.scale_out = view("aux_scales", np.float32, (T, self.A))
            if self.S:
                self.fin_out = view("hidden_states", self.raw, (self.S, self.H))
        except BaseException as exc:
            self._atomic.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

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

    def prepare(self, aux, final) -> list:
        """One sample's computed states as the tensors the file stores, on their own device (so a GPU does the
        casts and the fp8 quantisation): ``[aux bits [n, A*H], final bits [n, H]]`` (the file dtype's bits as
        signed ints of its width), or with ``aux_format=fp8_e4m3`` ``[fp8 bits [n, A*H] uint8, scales [n, A]
        float32, final bits [n, H]]``. ``aux`` [n, A*H] / ``final`` [n, H]: torch tensors of any float dtype.
        What :meth:`put` takes, once on the host."""
        import torch

        fin = final.to(self.tdtype).contiguous().view(self.ibits)
        if self.fp8:
            q, sc = quantize_fp8(aux, self.A)
            return [q.contiguous().view(torch.uint8), sc.contiguous(), fin]
        return [aux.to(self.tdtype).contiguous().view(self.ibits), fin]

    def put(self, i: int, parts: list) -> None:
        """Store sample ``i`` from :meth:`prepare`'s tensors as host numpy arrays (same shapes and bits).
        Raises RuntimeError when a shape differs from the sample's."""
        s, e = self._span(i)
        aux, fin = parts[0], parts[-1]
        self.check_shapes(i, aux.shape, fin.shape)
        if self.fp8:
            self.aux_out[s:e] = aux.view(np.uint8)
            self.scale_out[s:e] = parts[1]
        else:
            self.aux_out[s:e] = aux.view(self.raw)
        fin = fin.view(self.raw)
        if self.fmask is None:
            self.fin_out[s:e] = fin
        elif self.frow[e] > self.frow[s]:
            self.fin_out[self.frow[s]:self.frow[e]] = fin[self.fmask[s:e].astype(bool)]
        self.done[i] = True

    def write(self, i: int, aux, final) -> None:
        """Store sample ``i`` computed: ``aux`` [len_i, A*H] and ``final`` [len_i, H] torch tensors (any float
        dtype, any device; cast to the file dtype), in the calling thread (:meth:`prepare`, a blocking copy to
        the host, :meth:`put`). Raises RuntimeError when a shape differs from the sample's (a capture must have
        exactly its input's length)."""
        self.check_shapes(i, aux.shape, final.shape)
        self.put(i, [t.cpu().numpy() for t in self.prepare(aux, final)])

    def copy(self, i: int, src: "StatesFile", j: int) -> None:
        """Store sample ``i`` from sample ``j`` of ``src``, byte for byte: the first ``len_i`` rows of ``j``
        (its prefix when sample ``i`` is a truncation of ``j``; a causal model's states at a position depend on
        the tokens up to it only). The caller checks that ``src`` has the same layout settings
        (:meth:`StatesFile.same_settings`) and that ids and loss mask agree on those rows (:func:`reusable`).
        """
        s, e = self._span(i)
        n = e - s
        ss = int(src.offsets[j])
        self.aux_out[s:e] = src.rows("aux_hidden_states")[ss:ss + n]
        if self.fp8:
            self.scale_out[s:e] = src.rows("aux_scales", np.float32)[ss:ss + n]
        if self.fmask is None:
            self.fin_out[s:e] = src.rows("hidden_states")[ss:ss + n]
        else:
            k = int(self.frow[e] - self.frow[s])
            if k:
                fs = int(src.frow[ss])
                self.fin_out[self.frow[s]:self.frow[e]] = src.rows("hidden_states")[fs:fs + k]
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
            err = RuntimeError(f"{self.shard.path}: {self.written} of {self.shard.n} samples written "
                               f"(missing e.g. {missing})")
        if self._mm is not None:
            if exc_type is None and err is None:
                self._mm.flush()
            self.aux_out = self.scale_out = self.fin_out = None
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
    prefix counts of ``final_mask``, or None when every final row is stored).

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

    def sample(self, j: int, dtype=None) -> dict:
        """Sample ``j``'s tensors with the savers undone: ``input_ids`` [n] int64, ``loss_mask`` [n] int64,
        ``aux_hidden_states`` [n, A*H] and ``hidden_states`` [n, H] in ``dtype`` (default: the file's dtype;
        rows not stored under ``final_states=supervised`` are zeros)."""
        import torch

        s, e = int(self.offsets[j]), int(self.offsets[j + 1])
        fdtype = getattr(torch, self.meta.get("dtype", "float32"))
        out_dtype = dtype or fdtype
        aux_raw = np.array(self.rows("aux_hidden_states")[s:e])
        if self.meta.get("aux_format", "same") == "fp8_e4m3":
            q = torch.from_numpy(aux_raw).view(torch.float8_e4m3fn)
            aux = dequantize_fp8(q, torch.from_numpy(np.array(self.rows("aux_scales", np.float32)[s:e])), out_dtype)
        else:
            aux = _as_float(aux_raw, fdtype).to(out_dtype)
        H = int(self.meta["hidden_size"])
        if self.frow is None:
            fin = _as_float(np.array(self.rows("hidden_states")[s:e]), fdtype).to(out_dtype)
        else:
            fin = torch.zeros((e - s, H), dtype=out_dtype)
            k0, k1 = int(self.frow[s]), int(self.frow[e])
            if k1 > k0:
                keep = torch.from_numpy(np.array(self.rows("final_mask", np.int8)[s:e])).bool()
                fin[keep] = _as_float(np.array(self.rows("hidden_states")[k0:k1]), fdtype).to(out_dtype)
        return {"input_ids": torch.from_numpy(np.array(self.ids[s:e])).long(),
                "loss_mask": torch.from_numpy(np.array(self.mask[s:e])).long(),
                "aux_hidden_states": aux, "hidden_states": fin}

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
    return torch.from_numpy(raw.view(np.dtype(f"i{raw.dtype.itemsize}"))).view(ibits).view(tdtype)


def reusable(src: StatesFile, j: int, ids: np.ndarray, mask: np.ndarray) -> bool:
    """Whether sample ``j`` of ``src`` can supply the rows of a sample with ``ids`` and ``mask``: it is at
    least as long, and its ids and loss mask start with them (equal, or the new sample is its truncation)."""
    s, e = int(src.offsets[j]), int(src.offsets[j + 1])
    n = len(ids)
    return e - s >= n and np.array_equal(src.ids[s:s + n], ids) and np.array_equal(src.mask[s:s + n], mask)


def read_hidden_states(path) -> tuple[dict, dict]:
    """Read a whole hidden-states file: ``(tensors {name: torch.Tensor}, metadata {key: str})``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def load_states(path, dtype=None) -> tuple[dict, dict]:
    """Read a whole hidden-states file and undo the storage savers: ``(tensors, metadata)`` with

    ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``sample_offsets`` [N+1] int64,
    ``aux_hidden_states`` [T, A*H] and ``hidden_states`` [T, H] in ``dtype`` (default: the file's
    ``dtype``; fp8 auxiliary states are dequantised with their scales; rows not stored under
    ``final_states=supervised`` are zeros), and ``final_mask`` [T] bool (all True when every row is stored).
    """
    import torch

    t, meta = read_hidden_states(path)
    out_dtype = dtype or getattr(torch, meta.get("dtype", "float32"))
    T = t["input_ids"].shape[0]
    if meta.get("aux_format", "same") == "fp8_e4m3":
        aux = dequantize_fp8(t["aux_hidden_states"], t["aux_scales"], out_dtype)
    else:
        aux = t["aux_hidden_states"].to(out_dtype)
    fin = t["hidden_states"].to(out_dtype)
    if "final_mask" in t:
        fmask = t["final_mask"].bool()
        full = torch.zeros((T, fin.shape[-1]), dtype=out_dtype)
        full[fmask] = fin
        fin = full
    else:
        fmask = torch.ones(T, dtype=torch.bool)
    return {
        "input_ids": t["input_ids"].long(),
        "loss_mask": t["loss_mask"].long(),
        "sample_offsets": t["sample_offsets"].long(),
        "aux_hidden_states": aux,
        "hidden_states": fin,
        "final_mask": fmask,
    }, meta
