"""Extract stage (transformers backend): merged shard -> target hidden states in one safetensors file.

For every sample of a merged shard the target model runs one forward pass (no KV cache, no logits) and
forward hooks capture

- the **auxiliary hidden states**: the OUTPUT of 0-based decoder layers ``layers`` (SpecForge / SGLang /
  Model-Optimizer convention, = Hugging Face ``output_hidden_states[i + 1]``; the same physical layers
  as EAGLE's / vLLM's "input of layer i+1"), concatenated along the feature axis in ``layers`` order;
- the **final hidden state**: by default the output of the model's final norm (post-norm, = HF
  ``hidden_states[-1]``, what SpecForge and Model-Optimizer store); ``final_norm="pre"`` stores the norm's
  input instead (the last decoder layer's output, = HF ``hidden_states[-2]`` before the norm; what vLLM's
  ``extract_hidden_states`` gives speculators, whose trainer applies the norm itself).

Default layers (``layers=None``): EAGLE-3's ``[1, L//2 - 1, L - 4]`` for L decoder layers, each clamped to
``>= 0`` and de-duplicated in sorted order, as Model-Optimizer's ``default_eagle_aux_layer_ids`` does
(``sorted({1, max(0, L//2-1), max(0, L-4)})``); so L >= 8 gives three layers, L = 6 gives ``[1, 2]``,
L = 1 gives ``[0, 1]`` clamped to ``[0]``. Pass ``layers`` explicitly to get exactly three on tiny models.

Samples are sorted by length and packed into batches whose padded size stays under ``batch_tokens``
(right padding + attention mask, so real positions never see padding); padding is stripped before
anything is stored. The output is laid out on disk as it is computed (the safetensors header is written
first from the known token count, then each batch's rows go to their final offsets through a memory map),
so memory stays bounded by one batch whatever the shard size. The file is written under a temporary name
and renamed when complete: a crash never leaves a file that a rerun would skip.

File layout (T = tokens in the shard, N = samples, H = hidden size, A = len(layers)):

======================  ==========  =====================================================
tensor                  shape       dtype
======================  ==========  =====================================================
``input_ids``           [T]         int32
``loss_mask``           [T]         int8 (0/1)
``aux_hidden_states``   [T, A*H]    ``dtype`` (layer j at columns ``j*H:(j+1)*H``)
``hidden_states``       [T, H]      ``dtype`` (post-norm final state)
``sample_offsets``      [N+1]       int64; sample n = rows ``offsets[n]:offsets[n+1]``
======================  ==========  =====================================================

Storage savers (optional, recorded in the metadata; :func:`load_states` undoes both):

- ``final_states="supervised"``: ``hidden_states`` holds only the rows where ``final_mask`` is 1, i.e. the
  positions a draft-model loss can read a target distribution from: every supervised position ``p``
  (``loss_mask[p] == 1``) and the position right after one inside the same sample (``loss_mask[p-1] == 1``).
  That covers both shift conventions in use (SpecForge with PR #895: teacher row ``p`` for mask ``p``;
  SpecForge main / EAGLE ``dataprepare``: teacher row ``p+1`` for mask ``p``). Extra tensor ``final_mask``
  [T] int8; ``hidden_states`` becomes [S, H] with S = ``final_mask.sum()``. Readers that need [T, H] get
  zeros at the other rows (never read by the loss).
- ``aux_format="fp8_e4m3"``: ``aux_hidden_states`` stored as ``F8_E4M3`` [T, A*H] with ``aux_scales``
  [T, A] float32, one scale per token and layer (``amax / 448``); value = ``fp8.float() * scale``.

Metadata (all strings): ``format`` ("eagle3-data/hidden-states/v1"), ``model_path``, ``model_name``,
``model_type``, ``num_layers``, ``hidden_size``, ``layers`` (JSON list), ``layer_convention``,
``final_norm`` ("post" | "pre"), ``dtype``, ``num_samples``, ``num_tokens``, ``sample_ids`` (JSON list),
``datasets`` (JSON list, per sample), ``source`` (merged shard path), ``backend`` ("transformers"),
``final_states`` ("all" | "supervised"), ``aux_format`` ("same" | "fp8_e4m3").

Devices: with a CUDA device (``device`` ``auto`` on a GPU machine, or ``cuda``), :func:`extract` first takes
``gpus`` distinct devices with :func:`eagle3_data.devices.gpu_devices` (file locks), which sets
``CUDA_VISIBLE_DEVICES`` before torch touches CUDA; more than one device loads the model with
``device_map="auto"`` (layers spread over the devices).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from .io import atomic_path

log = logging.getLogger("eagle3_data.extract")

FORMAT = "eagle3-data/hidden-states/v1"
LAYER_CONVENTION = "output of 0-based decoder layer i (= HF output_hidden_states[i+1])"
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
FINAL_STATES = ("all", "supervised")
FINAL_NORMS = ("post", "pre")
AUX_FORMATS = ("same", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default auxiliary layers for a target with ``num_layers`` decoder layers.

    ``sorted({1, max(0, L//2-1), max(0, L-4)})`` clamped to ``<= L-1`` (Model-Optimizer
    ``default_eagle_aux_layer_ids``; SpecForge ``resolve_eagle_capture_layers`` gives the same three for
    L >= 8). Indices are 0-based decoder layers whose OUTPUT is captured.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    L = num_layers
    return sorted({min(L - 1, x) for x in (1, max(0, L // 2 - 1), max(0, L - 4))})


def resolve_layers(layers, num_layers: int) -> list[int]:
    """``layers`` checked against the model (``None`` -> :func:`default_layers`).

    Raises ValueError for a non-int, an index outside ``[0, num_layers-1]`` or a repeated index.
    """
    if layers is None:
        return default_layers(num_layers)
    out = []
    for x in layers:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"extract layers must be ints, got {x!r} in {layers!r}")
        if not 0 <= int(x) < num_layers:
            raise ValueError(
                f"extract layer {x} is outside the target's decoder layers [0, {num_layers - 1}] "
                f"(convention: {LAYER_CONVENTION})"
            )
        out.append(int(x))
    if len(set(out)) != len(out):
        raise ValueError(f"extract layers repeat an index: {out}")
    if not out:
        raise ValueError("extract layers is an empty list")
    return out


def pack_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices into batches of similar length whose padded size ``len(batch) * max_len`` stays
    within ``batch_tokens`` (a sample longer than the budget goes alone). Longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = lengths[i]
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
            new_max = n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def pick_device(device: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU (respecting ``CUDA_VISIBLE_DEVICES``), else ``"cpu"``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_target(model_path, *, dtype: str = "float32", device: str = "auto", device_map=None):
    """Load the target from a local directory (``AutoModelForCausalLM``, eval mode) onto ``device``.

    ``device_map`` (e.g. ``"auto"``) spreads the layers over every visible GPU instead (accelerate).
    Returns ``(model, decoder)`` where ``decoder`` is the base model holding ``layers`` and ``norm``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"extract dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"target model directory not found: {path}")
    kwargs = {"dtype": getattr(torch, dtype), "local_files_only": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if device_map is None:
        model.to(pick_device(device))
    model.eval()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ValueError(
            f"{path}: {type(decoder).__name__} has no `layers`/`norm`; the transformers extraction backend "
            "needs a decoder-only model with model.layers and model.norm"
        )
    return model, decoder


@contextlib.contextmanager
def device_context(device: str = "auto", gpus: int = 1, lock_dir=None):
    """Resolve ``device`` and, for CUDA, hold ``gpus`` distinct devices for the block (file locks).

    Yields ``(device, device_ids)``: ``device`` is ``"cpu"`` or ``"cuda"`` (``cuda:N`` passed through
    unlocked: the caller chose the device), ``device_ids`` the ``CUDA_VISIBLE_DEVICES`` entries held
    (``[]`` on CPU). ``auto`` means cuda when the machine has a GPU (:func:`devices.visible_pool`, which
    asks ``nvidia-smi`` without initialising CUDA) and torch is a CUDA build, else cpu. If torch already initialised CUDA in this
    process the devices cannot be changed any more: a warning is logged and the current ones are used.
    """
    from . import devices

    if device == "cpu" or (device.startswith("cuda:")):
        yield device, []
        return
    if device not in ("auto", "cuda"):
        raise ValueError(f"extract device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch

    pool, _ = devices.visible_pool()
    if device == "auto" and (not pool or torch.version.cuda is None):  # no GPU, or a CPU-only torch build
        yield "cpu", []
        return
    if devices.cuda_initialized():
        log.warning("CUDA is already initialised in this process; cannot assign devices, using the current ones")
        yield "cuda", []
        return
    with devices.gpu_devices(gpus, lock_dir=lock_dir) as ids:
        yield "cuda", ids


class _Capture:
    """Forward hooks on the chosen decoder layers and the final norm; stores their outputs per forward.

    ``final_norm="post"`` keeps the norm's output, ``"pre"`` its input (the last layer's output)."""

    def __init__(self, decoder, layers: list[int], final_norm: str = "post"):
        self.layers = layers
        self.final_norm = final_norm
        self.out: dict = {}
        self.handles = []
        for i in layers:
            self.handles.append(decoder.layers[i].register_forward_hook(self._hook(i)))
        self.handles.append(decoder.norm.register_forward_hook(self._hook("final")))

    def _hook(self, key):
        def fn(module, args, output):
            if key == "final" and self.final_norm == "pre":
                self.out[key] = args[0]
            else:
                self.out[key] = output[0] if isinstance(output, (tuple, list)) else output

        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


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


def extract(
    merged_path,
    out_path,
    *,
    model_path,
    layers=None,
    dtype: str = "float32",
    device: str = "auto",
    batch_tokens: int = 8192,
    model=None,
    gpus: int = 1,
    lock_dir=None,
    final_states: str = "all",
    aux_format: str = "same",
    final_norm: str = "post",
    backend: str = "transformers",
) -> dict:
    """Run the target over one merged shard and write its hidden states to ``out_path`` (safetensors).

    Args:
        merged_path: a MERGED parquet shard (``sample_id``, ``dataset``, ``input_ids`` list<int32>,
            ``loss_mask`` list<int8>).
        out_path: the safetensors file (layout in the module docstring); written to a temporary name in
            the same directory and renamed when complete.
        model_path: local directory of the target (weights + config); never downloaded.
        layers: 0-based decoder layers whose OUTPUT is stored as auxiliary hidden states, in this order;
            ``None`` -> :func:`default_layers`.
        dtype: ``float32`` | ``bfloat16`` | ``float16``: the compute dtype of the model and the stored dtype.
        device: ``auto`` (cuda if the machine has a GPU, else cpu), ``cpu``, ``cuda``, ``cuda:N``.
        batch_tokens: padded-token budget per forward (``len(batch) * longest``).
        model: optional ``(model, decoder)`` from :func:`load_target` to reuse across shards (then no
            device is assigned: the model is where it is).
        gpus: devices this job holds on CUDA (the rule's ``resources: gpu``), see :func:`device_context`.
        lock_dir: lock directory for :func:`eagle3_data.devices.gpu_devices` (default there).
        final_states: ``all`` | ``supervised`` (store final states only where the loss reads them).
        aux_format: ``same`` (``dtype``) | ``fp8_e4m3`` (per-token, per-layer scales).
        final_norm: ``post`` (output of the final norm; SpecForge, Model-Optimizer) | ``pre`` (its input, the
            last decoder layer's output; vLLM / speculators, which apply the norm themselves).
        backend: ``transformers`` (this module) | ``sglang`` (:mod:`eagle3_data.extract_sglang`, GPU only,
            tensor parallel over the ``gpus`` devices held; post-norm final states only).

    Returns: dict with ``path, num_samples, num_tokens, layers, hidden_size, dtype, device, devices,
        batches, seconds, model_seconds, tokens_per_s, bytes, final_rows, final_states, aux_format``.

    Raises: FileNotFoundError (model dir / shard), ValueError (bad layers, dtype, saver option, empty
        sample, ids out of the vocabulary, more GPUs than the machine has), RuntimeError (a captured length
        differs from the input length), TimeoutError (no free GPUs).
    """
    if final_states not in FINAL_STATES:
        raise ValueError(f"extract final_states must be one of {FINAL_STATES}, got {final_states!r}")
    if final_norm not in FINAL_NORMS:
        raise ValueError(f"extract final_norm must be one of {FINAL_NORMS}, got {final_norm!r}")
    if aux_format not in AUX_FORMATS:
        raise ValueError(f"extract aux_format must be one of {AUX_FORMATS}, got {aux_format!r}")
    if dtype not in DTYPES:
        raise ValueError(f"extract dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if backend == "sglang":
        from .extract_sglang import extract_sglang

        if final_norm != "post":
            raise ValueError("extract backend sglang stores post-norm final states only (final_norm: post)")
        with device_context("cuda" if device == "auto" else device, gpus, lock_dir) as (dev, ids):
            return extract_sglang(merged_path, out_path, model_path=model_path, layers=layers, dtype=dtype,
                                  batch_tokens=batch_tokens, tp_size=max(1, len(ids) or gpus),
                                  final_states=final_states, aux_format=aux_format)
    if backend != "transformers":
        raise ValueError(f"extract backend must be transformers or sglang, got {backend!r}")
    kw = dict(model_path=model_path, layers=layers, dtype=dtype, batch_tokens=batch_tokens,
              final_states=final_states, aux_format=aux_format, final_norm=final_norm)
    if model is not None:
        return _extract(merged_path, out_path, model=model, device_ids=[], **kw)
    with device_context(device, gpus, lock_dir) as (dev, ids):
        device_map = "auto" if dev == "cuda" and len(ids) > 1 else None
        loaded = load_target(model_path, dtype=dtype, device=dev, device_map=device_map)
        return _extract(merged_path, out_path, model=loaded, device_ids=ids, **kw)


class MergedShard:
    """A MERGED shard's token ids, loss masks and sample boundaries, flattened (what extraction needs).

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
        if not np.array_equal(mask_col.offsets.to_numpy() - mask_col.offsets.to_numpy()[0], self.offsets):
            raise ValueError(f"{path}: loss_mask and input_ids lengths differ in some row")
        self.n = len(self.sample_ids)
        self.T = int(self.offsets[-1]) if self.n else 0
        lo, lm = int(ids_col.offsets[0].as_py()) if self.n else 0, int(mask_col.offsets[0].as_py()) if self.n else 0
        self.ids = ids_col.values.to_numpy(zero_copy_only=False)[lo:lo + self.T].astype(np.int32)
        self.mask = mask_col.values.to_numpy(zero_copy_only=False)[lm:lm + self.T].astype(np.int8)
        self.lengths = np.diff(self.offsets).tolist()
        if self.n and min(self.lengths) < 1:
            bad = self.sample_ids[self.lengths.index(min(self.lengths))]
            raise ValueError(f"{path}: sample {bad!r} has no tokens")

    def sample_ids_of(self, i: int) -> np.ndarray:
        """Token ids of sample ``i`` (int32 view)."""
        return self.ids[self.offsets[i]:self.offsets[i + 1]]


class HiddenStateWriter:
    """Writes one extract file (module docstring layout) sample by sample, straight to its final offsets.

    Use as a context manager: the header is written from the known sizes on entry, each
    :meth:`write` puts one sample's rows in place through a memory map (so memory stays bounded by one
    batch), and the temporary file is renamed onto ``out_path`` only when the block ends without error
    (a crash leaves no file). :meth:`write` applies the storage savers (``final_states``, ``aux_format``).
    """

    def __init__(self, out_path, shard: MergedShard, *, hidden_size: int, num_aux: int, dtype: str,
                 final_states: str, aux_format: str, metadata: dict):
        import torch

        self.out_path, self.shard = out_path, shard
        self.H, self.A = int(hidden_size), int(num_aux)
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
        self.metadata.update(final_states=final_states, aux_format=aux_format, dtype=dtype, num_samples=str(n),
                             num_tokens=str(T), hidden_size=str(H))
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
        self.written = 0

    def __enter__(self):
        self._atomic = atomic_path(self.out_path)
        tmp = self._atomic.__enter__()
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

    def write(self, i: int, aux, final) -> None:
        """Store sample ``i``: ``aux`` [len_i, A*H] and ``final`` [len_i, H] torch tensors (any float dtype,
        any device; cast to the file dtype). Raises RuntimeError when a length differs from the sample's."""
        import torch

        s, e = int(self.shard.offsets[i]), int(self.shard.offsets[i + 1])
        n = e - s
        if tuple(aux.shape) != (n, self.A * self.H) or tuple(final.shape) != (n, self.H):
            raise RuntimeError(
                f"{self.shard.path}: sample {self.shard.sample_ids[i]!r} captured aux {tuple(aux.shape)} / final "
                f"{tuple(final.shape)}, expected ({n}, {self.A * self.H}) / ({n}, {self.H}) (capture length must "
                "equal input length)"
            )
        if self.fp8:
            q, sc = quantize_fp8(aux, self.A)
            self.aux_out[s:e] = q.contiguous().view(torch.uint8).cpu().numpy()
            self.scale_out[s:e] = sc.cpu().numpy()
        else:
            self.aux_out[s:e] = aux.to(self.tdtype).contiguous().view(self.ibits).cpu().numpy().view(self.raw)
        fin = final.to(self.tdtype).contiguous().view(self.ibits).cpu().numpy().view(self.raw)
        if self.fmask is None:
            self.fin_out[s:e] = fin
        elif self.frow[e] > self.frow[s]:
            self.fin_out[self.frow[s]:self.frow[e]] = fin[self.fmask[s:e].astype(bool)]
        self.written += 1

    def __exit__(self, exc_type, exc, tb):
        err = None
        if exc_type is None and self.written != self.shard.n:
            err = RuntimeError(f"{self.shard.path}: {self.written} of {self.shard.n} samples written")
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


def _extract(merged_path, out_path, *, model_path, layers, dtype, batch_tokens, model, device_ids,
             final_states, aux_format, final_norm) -> dict:
    import torch

    t0 = time.perf_counter()
    shard = MergedShard(merged_path)
    n, T, lengths = shard.n, shard.T, shard.lengths

    model, decoder = model
    dev = model.get_input_embeddings().weight.device
    cfg = model.config
    L = len(decoder.layers)
    H = int(getattr(cfg, "hidden_size", None) or decoder.norm.weight.shape[-1])
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if vocab and T and (shard.ids.min() < 0 or shard.ids.max() >= vocab):
        raise ValueError(f"{merged_path}: token ids outside the target's vocabulary [0, {vocab})")
    chosen = resolve_layers(layers, L)
    tdtype = getattr(torch, dtype)

    metadata = {
        "format": FORMAT,
        "backend": "transformers",
        "model_path": str(model_path),
        "model_name": str(getattr(cfg, "_name_or_path", "") or Path(model_path).name),
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_layers": str(L),
        "layers": json.dumps(chosen),
        "layer_convention": LAYER_CONVENTION,
        "final_norm": final_norm,
        "sample_ids": json.dumps(shard.sample_ids),
        "datasets": json.dumps(shard.datasets),
        "source": str(merged_path),
    }
    batches = pack_batches(lengths, batch_tokens)
    cap = _Capture(decoder, chosen, final_norm)
    done_tokens = 0
    t_model = time.perf_counter()
    writer = HiddenStateWriter(out_path, shard, hidden_size=H, num_aux=len(chosen), dtype=dtype,
                               final_states=final_states, aux_format=aux_format, metadata=metadata)
    try:
        with writer, torch.inference_mode():
            last_log = time.perf_counter()
            for b, idx in enumerate(batches):
                longest = max(lengths[i] for i in idx)
                ids = torch.zeros((len(idx), longest), dtype=torch.long)
                att = torch.zeros((len(idx), longest), dtype=torch.long)
                for r, i in enumerate(idx):
                    ids[r, : lengths[i]] = torch.from_numpy(shard.sample_ids_of(i).astype(np.int64))
                    att[r, : lengths[i]] = 1
                cap.out.clear()
                decoder(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False)
                got = [cap.out.get(j) for j in chosen] + [cap.out.get("final")]
                if any(g is None for g in got):
                    raise RuntimeError(f"{merged_path}: a forward hook did not fire (layers {chosen})")
                for g in got:
                    if tuple(g.shape[:2]) != (len(idx), longest):
                        raise RuntimeError(
                            f"{merged_path}: captured shape {tuple(g.shape)} != input {(len(idx), longest)}"
                        )
                aux = torch.cat([g.to(got[-1].device) for g in got[:-1]], dim=-1).to(tdtype).cpu()
                fin = got[-1].to(tdtype).cpu()
                for r, i in enumerate(idx):
                    writer.write(i, aux[r, : lengths[i]], fin[r, : lengths[i]])
                    done_tokens += lengths[i]
                now = time.perf_counter()
                if now - last_log > 30 or b == len(batches) - 1:
                    el = now - t_model
                    log.info("extract %s: batch %d/%d, %d/%d tokens, %.0f tokens/s", Path(out_path).name,
                             b + 1, len(batches), done_tokens, T, done_tokens / max(el, 1e-9))
                    last_log = now
    finally:
        cap.remove()
    seconds = time.perf_counter() - t0
    model_s = time.perf_counter() - t_model
    return {
        "path": str(out_path),
        "num_samples": n,
        "num_tokens": T,
        "layers": chosen,
        "hidden_size": H,
        "dtype": dtype,
        "device": str(dev),
        "devices": list(device_ids),
        "batches": len(batches),
        "seconds": round(seconds, 3),
        "model_seconds": round(model_s, 3),
        "tokens_per_s": round(T / model_s, 1) if model_s > 0 else None,
        "bytes": os.path.getsize(out_path),
        "final_rows": writer.S,
        "final_states": final_states,
        "aux_format": aux_format,
        "final_norm": final_norm,
    }


def read_hidden_states(path) -> tuple[dict, dict]:
    """Read an extract file: ``(tensors {name: torch.Tensor}, metadata {key: str})``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


def load_states(path, dtype=None) -> tuple[dict, dict]:
    """Read an extract file and undo the storage savers: ``(tensors, metadata)`` with

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
