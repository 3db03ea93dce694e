"""Extract stage (transformers backend): merged shard -> target hidden states in one safetensors file.

For every sample of a merged shard the target model runs one forward pass (no KV cache, no logits) and
forward hooks capture

- the **auxiliary hidden states**: the OUTPUT of 0-based decoder layers ``layers`` (SpecForge / SGLang /
  Model-Optimizer convention, = Hugging Face ``output_hidden_states[i + 1]``; the same physical layers
  as EAGLE's / vLLM's "input of layer i+1"), concatenated along the feature axis in ``layers`` order;
- the **final hidden state**: the output of the model's final norm (post-norm, = HF ``hidden_states[-1]``,
  what SpecForge and Model-Optimizer store).

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

Metadata (all strings): ``format`` ("eagle3-data/hidden-states/v1"), ``model_path``, ``model_name``,
``model_type``, ``num_layers``, ``hidden_size``, ``layers`` (JSON list), ``layer_convention``,
``final_norm`` ("post"), ``dtype``, ``num_samples``, ``num_tokens``, ``sample_ids`` (JSON list),
``datasets`` (JSON list, per sample), ``source`` (merged shard path), ``backend`` ("transformers").
"""

from __future__ import annotations

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


def load_target(model_path, *, dtype: str = "float32", device: str = "auto"):
    """Load the target from a local directory (``AutoModelForCausalLM``, eval mode) onto ``device``.

    Returns ``(model, decoder)`` where ``decoder`` is the base model holding ``layers`` and ``norm``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"extract dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"target model directory not found: {path}")
    dev = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), local_files_only=True)
    model.to(dev).eval()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ValueError(
            f"{path}: {type(decoder).__name__} has no `layers`/`norm`; the transformers extraction backend "
            "needs a decoder-only model with model.layers and model.norm"
        )
    return model, decoder


class _Capture:
    """Forward hooks on the chosen decoder layers and the final norm; stores their outputs per forward."""

    def __init__(self, decoder, layers: list[int]):
        self.layers = layers
        self.out: dict = {}
        self.handles = []
        for i in layers:
            self.handles.append(decoder.layers[i].register_forward_hook(self._hook(i)))
        self.handles.append(decoder.norm.register_forward_hook(self._hook("final")))

    def _hook(self, key):
        def fn(module, args, output):
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
        device: ``auto`` (cuda if available else cpu), ``cpu``, ``cuda``, ``cuda:N``.
        batch_tokens: padded-token budget per forward (``len(batch) * longest``).
        model: optional ``(model, decoder)`` from :func:`load_target` to reuse across shards.

    Returns: dict with ``path, num_samples, num_tokens, layers, hidden_size, dtype, device, seconds,
        tokens_per_s, bytes``.

    Raises: FileNotFoundError (model dir / shard), ValueError (bad layers, dtype, empty sample, ids out
        of the vocabulary), RuntimeError (a captured length differs from the input length).
    """
    import torch

    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    t0 = time.perf_counter()
    table = pq.read_table(merged_path, columns=["sample_id", "dataset", "input_ids", "loss_mask"])
    sample_ids = table.column("sample_id").to_pylist()
    datasets = table.column("dataset").to_pylist()
    ids_col = table.column("input_ids").combine_chunks()
    mask_col = table.column("loss_mask").combine_chunks()
    offsets = ids_col.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    flat_ids = ids_col.values.to_numpy(zero_copy_only=False).astype(np.int32)
    flat_mask = mask_col.values.to_numpy(zero_copy_only=False).astype(np.int8)
    if not np.array_equal(mask_col.offsets.to_numpy() - mask_col.offsets.to_numpy()[0], offsets):
        raise ValueError(f"{merged_path}: loss_mask and input_ids lengths differ in some row")
    n = len(sample_ids)
    T = int(offsets[-1]) if n else 0
    lengths = np.diff(offsets).tolist()
    if n and min(lengths) < 1:
        bad = sample_ids[lengths.index(min(lengths))]
        raise ValueError(f"{merged_path}: sample {bad!r} has no tokens")

    model, decoder = model or load_target(model_path, dtype=dtype, device=device)
    dev = next(model.parameters()).device
    cfg = model.config
    L = len(decoder.layers)
    H = int(getattr(cfg, "hidden_size", None) or decoder.norm.weight.shape[-1])
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if vocab and T and (flat_ids.min() < 0 or flat_ids.max() >= vocab):
        raise ValueError(f"{merged_path}: token ids outside the target's vocabulary [0, {vocab})")
    chosen = resolve_layers(layers, L)
    A = len(chosen)
    tdtype = getattr(torch, dtype)
    elt = torch.tensor([], dtype=tdtype).element_size()

    metadata = {
        "format": FORMAT,
        "backend": "transformers",
        "model_path": str(model_path),
        "model_name": str(getattr(cfg, "_name_or_path", "") or Path(model_path).name),
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_layers": str(L),
        "hidden_size": str(H),
        "layers": json.dumps(chosen),
        "layer_convention": LAYER_CONVENTION,
        "final_norm": "post",
        "dtype": dtype,
        "num_samples": str(n),
        "num_tokens": str(T),
        "sample_ids": json.dumps(sample_ids),
        "datasets": json.dumps(datasets),
        "source": str(merged_path),
    }
    tensors = [
        ("sample_offsets", "I64", [n + 1], (n + 1) * 8),
        ("aux_hidden_states", DTYPES[dtype], [T, A * H], T * A * H * elt),
        ("hidden_states", DTYPES[dtype], [T, H], T * H * elt),
        ("input_ids", "I32", [T], T * 4),
        ("loss_mask", "I8", [T], T),
    ]
    batches = pack_batches(lengths, batch_tokens)
    cap = _Capture(decoder, chosen)
    done_tokens = 0
    t_model = time.perf_counter()
    try:
        with atomic_path(out_path) as tmp:
            with open(tmp, "wb") as fh:
                pos = _write_header(fh, tensors, metadata)
            size = os.path.getsize(tmp)
            mm = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(size,)) if size else None

            def view(name, np_dtype, shape):
                start = pos[name]
                count = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
                return mm[start:start + count].view(np_dtype).reshape(shape)

            if mm is not None:
                view("sample_offsets", np.int64, (n + 1,))[:] = offsets
                if T:
                    view("input_ids", np.int32, (T,))[:] = flat_ids
                    view("loss_mask", np.int8, (T,))[:] = flat_mask
            raw = np.dtype(f"u{elt}")  # store float bits as unsigned ints (numpy has no bfloat16)
            aux_out = view("aux_hidden_states", raw, (T, A * H)) if T else None
            fin_out = view("hidden_states", raw, (T, H)) if T else None
            last_log = time.perf_counter()
            with torch.inference_mode():
                for b, idx in enumerate(batches):
                    longest = max(lengths[i] for i in idx)
                    ids = torch.zeros((len(idx), longest), dtype=torch.long)
                    att = torch.zeros((len(idx), longest), dtype=torch.long)
                    for r, i in enumerate(idx):
                        s, e = offsets[i], offsets[i + 1]
                        ids[r, : e - s] = torch.from_numpy(flat_ids[s:e].astype(np.int64))
                        att[r, : e - s] = 1
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
                    aux = torch.cat(got[:-1], dim=-1).to(tdtype)
                    fin = got[-1].to(tdtype)
                    aux_u = aux.contiguous().view(getattr(torch, f"int{8 * elt}")).cpu().numpy().view(raw)
                    fin_u = fin.contiguous().view(getattr(torch, f"int{8 * elt}")).cpu().numpy().view(raw)
                    for r, i in enumerate(idx):
                        s, e = offsets[i], offsets[i + 1]
                        aux_out[s:e] = aux_u[r, : e - s]
                        fin_out[s:e] = fin_u[r, : e - s]
                        done_tokens += e - s
                    now = time.perf_counter()
                    if now - last_log > 30 or b == len(batches) - 1:
                        el = now - t_model
                        log.info("extract %s: batch %d/%d, %d/%d tokens, %.0f tokens/s", Path(out_path).name,
                                 b + 1, len(batches), done_tokens, T, done_tokens / max(el, 1e-9))
                        last_log = now
            if mm is not None:
                mm.flush()
                del aux_out, fin_out, mm
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
        "batches": len(batches),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(T / model_s, 1) if model_s > 0 else None,
        "bytes": os.path.getsize(out_path),
    }


def read_hidden_states(path) -> tuple[dict, dict]:
    """Read an extract file: ``(tensors {name: torch.Tensor}, metadata {key: str})``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta
