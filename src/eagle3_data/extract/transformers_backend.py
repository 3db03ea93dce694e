"""Hugging Face transformers extraction backend (CPU and GPU; the backend the tests run).

The target runs one forward pass per batch (no KV cache, no logits: only the decoder is called) and forward
hooks capture the OUTPUT of the chosen decoder layers (auxiliary states, see ``model.LAYER_CONVENTION``) and
the final state: the final norm's output (``final_norm="post"``, = HF ``hidden_states[-1]``; SpecForge,
Model-Optimizer) or its input (``"pre"``, the last decoder layer's output; vLLM's ``extract_hidden_states``
for speculators, whose trainer applies the norm itself).

Two batch layouts (``attention``, the ``extract.attention`` config key):

- ``padded``: rows right-padded to the batch's longest sample, with an attention mask, so real positions never
  attend to padding (the padding is computed, never stored). Works for every model transformers loads.
- ``packed``: the batch's samples concatenated into ONE row, position ids restarting at 0 for each sample and a
  block-diagonal causal mask (a token attends to the tokens of its own sample up to itself), so no padding is
  computed at all. The attention runs through a function registered in transformers' ``AttentionInterface``
  (:data:`ATTENTION_NAME`) with one of three kernels:

  * ``varlen``: PyTorch's built-in FlashAttention-2 variable-length kernel (``aten::_flash_attention_forward``
    with cumulative sequence offsets, the kernel behind ``torch.nn.attention.varlen``); CUDA, bf16/fp16;
  * ``flex``: FlexAttention (``torch.nn.attention.flex_attention``, compiled on CUDA) with a document
    ``BlockMask`` built from the sample boundaries (:func:`document_block_mask`): blocks outside every sample's
    causal triangle are skipped, so the cost is the sum of the samples' own attention;
  * ``loop``: ``scaled_dot_product_attention`` once per sample (``is_causal``); any device, exact.

  ``packed`` picks ``varlen`` on CUDA in bf16/fp16, ``flex`` on CUDA otherwise, ``loop`` on CPU;
  ``packed-varlen`` / ``packed-flex`` / ``packed-loop`` force one. ``auto`` is ``packed`` on every device (on
  CPU ``loop``: no padding computed, each sample's attention through the fused causal CPU kernel without a mask;
  measured faster than ``padded`` at every ``batch_tokens`` from 1,024 to 8,192 on the model of
  ``benchmarks/extract.py``; ``flex`` runs eagerly there, materialising tokens x tokens scores). The packed
  path needs a model whose attention layers call transformers' ``AttentionInterface`` and know their sample
  only from ``position_ids``, all with full causal attention (Llama, Qwen3, Mistral without a sliding window,
  ...; :func:`packed_unsupported`): ``auto`` falls back to padded for any other model, an explicit ``packed``
  raises. Every packed forward also checks that each decoder layer ran the packed attention exactly once, else
  it raises (its states would mix samples).

On CPU the backend also makes glibc keep freed tensor memory for reuse (:func:`keep_freed_host_memory`): by
default every tensor of a batch's activations over glibc's moving mmap threshold is a fresh mapping whose pages
fault in on first touch (costly in a VM), and the heap top is returned to the kernel at each free.

Both layouts give the same states (up to floating-point rounding; tests/workflow/test_extract_packed.py checks packed ==
padded == one sample at a time in fp32 on CPU, tests/gpu/test_extract_gpu.py every kernel in bf16 on a GPU).
"""

from __future__ import annotations

import contextvars
import logging
from pathlib import Path

import numpy as np

from .batching import packed_batches, padded_batches
from .layout import DTYPES
from .model import resolve_layers

log = logging.getLogger("eagle3_data.extract")

#: ``extract.attention`` values (module docstring)
ATTENTION_MODES = ("auto", "padded", "packed", "packed-varlen", "packed-flex", "packed-loop")
#: the name the packed attention function is registered under in transformers' ``AttentionInterface``
ATTENTION_NAME = "eagle3_data_packed"
#: FlexAttention block size (tokens) of :func:`document_block_mask`
FLEX_BLOCK = 128

_PACK: contextvars.ContextVar = contextvars.ContextVar("eagle3_data_pack", default=None)
_compiled_flex = None


def resolve_attention(attention: str, device_type: str, dtype: str, head_dim: int | None = None) -> tuple[str, str]:
    """``(layout, kernel)`` for ``extract.attention`` on a device type (``cpu`` | ``cuda``) and compute dtype:
    ``("padded", "")`` or ``("packed", "varlen" | "flex" | "loop")`` (module docstring). Raises ValueError for
    an unknown mode, or a kernel the device cannot run (``varlen`` off CUDA, or in float32)."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"extract attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "padded":
        return "padded", ""
    if attention.startswith("packed-"):
        kernel = attention.split("-", 1)[1]
        if kernel == "varlen" and (device_type != "cuda" or dtype == "float32"):
            raise ValueError(
                f"extract attention packed-varlen needs CUDA and bfloat16/float16 (here {device_type}, "
                f"{dtype}); use packed-flex or packed-loop"
            )
        return "packed", kernel
    if device_type != "cuda":
        return "packed", "loop"
    if dtype != "float32" and (head_dim is None or head_dim <= 256) and _flash_available():
        return "packed", "varlen"
    return "packed", "flex"


def packed_unsupported(model) -> str:
    """Why ``model`` cannot run the packed layout ("" when it can): its attention does not go through
    transformers' ``AttentionInterface`` (custom or remote code), or some layers are not plain causal attention
    (sliding windows, chunked or linear attention), which the block-diagonal causal packing does not express."""
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route its attention through transformers' AttentionInterface"
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if t != "full_attention"})
    if other:
        return f"its layers include {other} (only full causal attention can be packed)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"it uses sliding-window attention (sliding_window={cfg.sliding_window})"
    return ""


#: glibc ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: bytes: allocations up to this come from the heap (glibc's largest mmap threshold on 64-bit systems)
HOST_MMAP_THRESHOLD = 32 << 20
#: bytes of free memory at the heap's top that glibc keeps before returning it to the kernel
HOST_TRIM_THRESHOLD = 1 << 30
_host_memory_kept = False


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc (process-wide, once) serve allocations up to :data:`HOST_MMAP_THRESHOLD` bytes from
    its heap and keep up to :data:`HOST_TRIM_THRESHOLD` bytes of freed memory there, so the activations of one
    CPU forward reuse the pages of the previous one instead of mapping, faulting in and unmapping fresh ones
    (``mallopt`` ``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD``; the process's resident memory then stays at its
    peak). Returns True when set (now or before), False where the C library has no working ``mallopt`` (not
    glibc: nothing changes). Never raises."""
    global _host_memory_kept
    if _host_memory_kept:
        return True
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _host_memory_kept = (
        mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD) == 1
    )
    return _host_memory_kept


def _flash_available() -> bool:
    import torch

    check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(check()) if check is not None else True


class _DocumentIds:
    """Per device, ONE buffer of per-token sample ids and ONE ``mask_mod`` reading it, reused by every packed
    forward (refilled, grown when a row is longer): the compiled FlexAttention then sees the same function each
    time, so a new batch does not recompile it (a fresh closure per batch could, up to dynamo's recompile limit,
    after which flex falls back to its eager path that materialises tokens x tokens scores)."""

    _by_device: dict = {}

    def __init__(self, device, size: int):
        import torch

        self.buf = torch.full((size,), -1, dtype=torch.int32, device=device)
        buf = self.buf

        def mask_mod(b, h, q_idx, kv_idx):
            return (buf[q_idx] == buf[kv_idx]) & (q_idx >= kv_idx)

        self.mask_mod = mask_mod

    @classmethod
    def fill(cls, doc: np.ndarray, device, size: int):
        """The holder for ``device`` with ``doc`` (int ids, len <= size) at the start and -1 up to ``size``."""
        import torch

        key = str(device)
        ids = cls._by_device.get(key)
        if ids is None or ids.buf.numel() < size:
            ids = cls._by_device[key] = cls(device, max(size, 2 * (ids.buf.numel() if ids else 0)))
        ids.buf[: len(doc)].copy_(torch.from_numpy(doc.astype(np.int32)))
        ids.buf[len(doc) : size].fill_(-1)
        return ids


def document_block_mask(lengths: list[int], device, block: int = FLEX_BLOCK):
    """FlexAttention ``BlockMask`` of a packed row of samples of ``lengths`` tokens: causal within each sample,
    nothing across samples. Built from the sample boundaries at block granularity (``BlockMask.from_kv_blocks``:
    per query block, the key blocks it must compute with the mask and those it may compute without), so nothing
    of size tokens x tokens is ever materialised. Raises ValueError for an empty list or a length < 1."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    if not lengths or min(lengths) < 1:
        raise ValueError(f"document_block_mask: lengths must be >= 1, got {lengths[:5]}...")
    T = int(sum(lengths))
    nb = -(-T // block)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    rows = np.arange(nb)
    q_first, q_last = rows * block, np.minimum(rows * block + block, T) - 1
    lo = starts[doc[q_first]] // block  # first key block of the sample of the block's first query
    cols = rows[None, :]
    needed = (cols >= lo[:, None]) & (cols <= rows[:, None])
    # a key block before the query block whose first token shares the sample of the query block's last token:
    # every (query, key) pair of the two blocks is in one sample and causal, so no mask is evaluated
    full = needed & (cols < rows[:, None]) & (doc[cols * block] == doc[q_last][:, None])
    partial = needed & ~full

    def blocks(sel):
        num = torch.from_numpy(sel.sum(1).astype(np.int32))[None, None]
        idx = torch.from_numpy(np.argsort(~sel, axis=1, kind="stable").astype(np.int32))[None, None]
        return num.to(device), idx.to(device)

    ids = _DocumentIds.fill(doc, device, nb * block)  # the positions past T (the last block's tail): -1
    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=ids.mask_mod, seq_lengths=(T, T)
    )


class _Pack:
    """The sample boundaries of the packed forward in progress, read by :func:`packed_attention`."""

    def __init__(self, lengths: list[int], kernel: str):
        self.lengths, self.kernel = lengths, kernel
        self.bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()
        self.calls = 0
        self._cu: dict = {}  # per device (layers spread over GPUs): the cumulative offsets / the block mask
        self._block_mask: dict = {}

    def attend(self, query, key, value, scaling):
        """``query`` [1, Hq, T, D], ``key``/``value`` [1, Hkv, T, D] -> [1, T, Hq, D]."""
        import torch
        import torch.nn.functional as F

        gqa = query.shape[1] != key.shape[1]
        if self.kernel == "varlen":
            q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
            dv = v.shape[-1]
            if dv < q.shape[-1]:  # e.g. multi-head latent attention: FlashAttention wants one head size
                v = F.pad(v, (0, q.shape[-1] - dv))
            cu = self._cu.get(q.device)
            if cu is None:
                cu = self._cu[q.device] = torch.tensor(self.bounds, dtype=torch.int32).to(q.device)
            m = max(self.lengths)
            out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True, False, scale=scaling)[0]
            return out[..., :dv].unsqueeze(0)
        if self.kernel == "flex":
            mask = self._block_mask.get(query.device)
            if mask is None:  # one per forward (and device), shared by the layers
                mask = self._block_mask[query.device] = document_block_mask(self.lengths, query.device)
            out = _flex()(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
            return out.transpose(1, 2)
        outs = [
            F.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=gqa
            )
            for s, e in zip(self.bounds[:-1], self.bounds[1:])
        ]
        return torch.cat(outs, dim=2).transpose(1, 2)


def _flex():
    """FlexAttention: compiled on CUDA (once per process; shapes become dynamic after the first recompile),
    eager elsewhere (correct, but it materialises the scores: tests only)."""
    global _compiled_flex
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if not torch.cuda.is_available():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as :data:`ATTENTION_NAME` (transformers' ``AttentionInterface``
    signature): block-diagonal causal attention over the packed forward in progress. Returns
    ``([1, T, Hq, D], None)``. Raises RuntimeError outside a packed forward, NotImplementedError for a layer with
    a sliding window, logit soft-capping or attention sinks (not expressed by the packing)."""
    pack = _PACK.get()
    if pack is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} called outside a packed extraction forward")
    if (
        getattr(module, "sliding_window", None)
        or kwargs.get("sliding_window")
        or kwargs.get("softcap")
        or kwargs.get("s_aux") is not None
    ):
        raise NotImplementedError(
            f"{type(module).__name__}: sliding-window / soft-capped / sink attention is not "
            "supported by the packed extraction path; use extract.attention: padded"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    pack.calls += 1
    return pack.attend(query, key, value, scaling), None


def _register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)


def pick_device(device: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU (respecting ``CUDA_VISIBLE_DEVICES``), else ``"cpu"``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_target(
    model_path, *, dtype: str = "float32", device: str = "auto", device_map=None, trust_remote_code: bool = False
):
    """Load the target from a local directory (``AutoModelForCausalLM``; a vision-language model with
    ``AutoModelForImageTextToText``, :mod:`.vision`) in eval mode onto ``device``.

    ``device_map`` (e.g. ``"auto"``) spreads the layers over every visible GPU instead (accelerate).
    Returns ``(model, decoder)`` where ``decoder`` is the base model holding ``layers`` and ``norm``.
    Raises FileNotFoundError (no directory), ValueError (bad dtype; a model without ``layers``/``norm``).
    """
    import torch

    from .vision import model_class

    if dtype not in DTYPES:
        raise ValueError(f"extract dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"target model directory not found: {path}")
    kwargs = {"dtype": getattr(torch, dtype), "local_files_only": True, "trust_remote_code": trust_remote_code}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = model_class(path).from_pretrained(str(path), **kwargs)
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


class Capture:
    """Forward hooks on the chosen decoder layers and the final norm; stores their outputs per forward.

    ``final_norm="post"`` keeps the norm's output, ``"pre"`` and ``"both"`` its input (the last layer's output;
    with ``both`` the stage derives the output from it, ``extract.norm``)."""

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
            if key == "final" and self.final_norm in ("pre", "both"):
                self.out[key] = args[0]
            else:
                self.out[key] = output[0] if isinstance(output, (tuple, list)) else output

        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


class TransformersBackend:
    """The target under transformers, with hooks on the auxiliary layers and the final norm.

    Args:
        model_path: local target directory (weights + config); never downloaded.
        layers: auxiliary layers (0-based, OUTPUT of layer i), ``None`` -> EAGLE-3 defaults; order kept.
        dtype: compute dtype (``float32`` | ``bfloat16`` | ``float16``).
        device: ``cpu`` | ``cuda`` | ``cuda:N`` | ``auto``.
        final_norm: ``post`` | ``pre`` (see the module docstring).
        device_map: ``"auto"`` to spread the layers over several GPUs.
        loaded: a ``(model, decoder)`` pair from :func:`load_target` to use instead of loading (tests reuse
            one model across calls). A packed backend switches its attention implementation to
            :data:`ATTENTION_NAME` and :meth:`close` switches it back.
        attention: batch layout and kernel, one of :data:`ATTENTION_MODES` (module docstring).
        fused: ``auto`` | ``on`` | ``off``: fused elementwise kernels (:mod:`.fused`); :meth:`close` undoes them.

    Attributes: ``name`` ("transformers"), ``num_layers``, ``hidden_size``, ``vocab_size``, ``layers``
    (resolved), ``model_type``, ``model_name``, ``device``, ``layout`` ("padded" | "packed"), ``kernel``
    ("" | "varlen" | "flex" | "loop"), ``attention`` (``layout`` or ``packed:<kernel>``), ``fused``
    (:func:`.fused.fuse_elementwise`'s counts).

    Raises ValueError for an unknown ``attention`` or a kernel the device cannot run.
    """

    name = "transformers"

    def __init__(
        self,
        model_path,
        *,
        layers=None,
        dtype: str = "float32",
        device: str = "auto",
        final_norm: str = "post",
        device_map=None,
        loaded=None,
        trust_remote_code: bool = False,
        attention: str = "padded",
        fused: str = "off",
    ):
        import torch

        if loaded is None:
            loaded = load_target(
                model_path, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code
            )
        self.model, self.decoder = loaded
        cfg = self.decoder.config  # a vision-language model's: its language model's (text_config)
        self.num_layers = len(self.decoder.layers)
        self.hidden_size = int(getattr(cfg, "hidden_size", None) or self.decoder.norm.weight.shape[-1])
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or 0)
        self.model_type = str(getattr(cfg, "model_type", ""))
        self.model_name = str(getattr(cfg, "_name_or_path", "") or Path(model_path).name)
        self.layers = resolve_layers(layers, self.num_layers)
        self.tdtype = getattr(torch, dtype)
        self.device = self.model.get_input_embeddings().weight.device
        head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // max(1, getattr(cfg, "num_attention_heads", 1))
        self.layout, self.kernel = resolve_attention(attention, self.device.type, dtype, head_dim)
        why = packed_unsupported(self.model) if self.layout == "packed" else ""
        if why and attention == "auto":
            log.warning("%s: padded batches (%s)", self.model_name, why)
            self.layout, self.kernel = "padded", ""
        elif why:
            raise ValueError(f"{self.model_name}: cannot run extract.attention {attention}: {why}; use padded")
        self.attention = f"packed:{self.kernel}" if self.layout == "packed" else "padded"
        self._prev_attn = None
        if self.layout == "packed":
            _register_packed_attention()
            self._prev_attn = self.decoder.config._attn_implementation
            self._set_attn(ATTENTION_NAME)
            if self.decoder.config._attn_implementation != ATTENTION_NAME:
                self._set_attn(self._prev_attn)
                self._prev_attn = None
                why = f"{type(self.model).__name__} cannot switch its attention implementation"
                if attention != "auto":
                    raise ValueError(f"{self.model_name}: cannot run extract.attention {attention}: {why}; use padded")
                log.warning("%s: padded batches (%s)", self.model_name, why)
                self.layout, self.kernel, self.attention = "padded", "", "padded"
        if self.device.type == "cpu":
            keep_freed_host_memory()
        from .fused import fuse_elementwise

        self.fused = fuse_elementwise(self.decoder, fused)
        self._cap = Capture(self.decoder, self.layers, final_norm)

    def batches(self, lengths: list[int], batch_tokens: int) -> list[list[int]]:
        """Batches of sample indices: padded ones within ``batch_tokens`` padded tokens
        (``batching.padded_batches``), packed ones within ``batch_tokens`` real tokens
        (``batching.packed_batches``)."""
        if self.layout == "packed":
            return packed_batches(lengths, batch_tokens)
        return padded_batches(lengths, batch_tokens)

    def capture(self, id_lists: list[np.ndarray]) -> list[tuple]:
        """One forward over ``id_lists`` (1-D int arrays); returns, per sample, ``(aux [n, A*H], final [n, H])``
        torch tensors in the compute dtype on the model's device (views of the batch's tensors; no padding).

        Raises RuntimeError when a hook did not fire, a captured shape differs from the input's, or (packed)
        a decoder layer did not run the packed attention exactly once."""
        if self.layout == "packed":
            return self._capture_packed(id_lists)
        return self._capture_padded(id_lists)

    def _to_device(self, t):
        """A host tensor on the model's device; on CUDA through pinned memory, without blocking the host (so
        the host can queue this batch while the GPU still runs the previous one)."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _collect(self, shape: tuple) -> tuple:
        """The hooks' outputs of the last forward: ``(aux [..., A*H], final [..., H])`` in the compute dtype."""
        import torch

        got = [self._cap.out.get(j) for j in self.layers] + [self._cap.out.get("final")]
        if any(g is None for g in got):
            raise RuntimeError(f"a forward hook did not fire (layers {self.layers})")
        for g in got:
            if tuple(g.shape[:2]) != shape:
                raise RuntimeError(f"captured shape {tuple(g.shape)} != input {shape}")
        aux = torch.cat([g.to(got[-1].device) for g in got[:-1]], dim=-1).to(self.tdtype)
        fin = got[-1].to(self.tdtype)
        self._cap.out.clear()
        return aux, fin

    def _capture_packed(self, id_lists: list[np.ndarray]) -> list[tuple]:
        import torch

        lengths = [len(x) for x in id_lists]
        T = sum(lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in id_lists]))[None]
        pos = torch.from_numpy(np.arange(T, dtype=np.int64) - np.repeat(starts[:-1], lengths))[None]
        pack = _Pack(lengths, self.kernel)
        self._cap.out.clear()
        token = _PACK.set(pack)
        try:
            with torch.inference_mode():
                self.decoder(input_ids=self._to_device(ids), position_ids=self._to_device(pos), use_cache=False)
                aux, fin = self._collect((1, T))
        finally:
            _PACK.reset(token)
            self._cap.out.clear()
        if pack.calls != self.num_layers:
            raise RuntimeError(
                f"{self.model_name}: the packed attention ran {pack.calls} times for {self.num_layers} decoder "
                f"layers ({self.model_type} does not route every layer's attention through transformers' "
                "AttentionInterface); its states would mix samples: use extract.attention: padded"
            )
        aux, fin = aux[0], fin[0]
        return [(aux[s:e], fin[s:e]) for s, e in zip(starts[:-1].tolist(), starts[1:].tolist())]

    def _capture_padded(self, id_lists: list[np.ndarray]) -> list[tuple]:
        import torch

        lengths = [len(x) for x in id_lists]
        longest = max(lengths)
        ids = torch.zeros((len(id_lists), longest), dtype=torch.long)
        att = torch.zeros((len(id_lists), longest), dtype=torch.long)
        for r, x in enumerate(id_lists):
            ids[r, : lengths[r]] = torch.from_numpy(np.asarray(x, dtype=np.int64))
            att[r, : lengths[r]] = 1
        self._cap.out.clear()
        try:
            with torch.inference_mode():
                self.decoder(input_ids=self._to_device(ids), attention_mask=self._to_device(att), use_cache=False)
                aux, fin = self._collect((len(id_lists), longest))
        finally:
            self._cap.out.clear()
        return [(aux[r, : lengths[r]], fin[r, : lengths[r]]) for r in range(len(id_lists))]

    def close(self) -> None:
        """Remove the hooks and restore the model's attention implementation (the model stays loaded for
        whoever passed it in)."""
        self._cap.remove()
        from .fused import unfuse

        unfuse(self.decoder)
        if self._prev_attn is not None:
            self._set_attn(self._prev_attn)
            self._prev_attn = None

    def _set_attn(self, name: str) -> None:
        """Set the language model's attention implementation (a vision-language model's vision tower keeps its
        own: the packed function knows only the decoder's samples)."""
        if hasattr(self.model.config, "vision_config"):
            self.model.set_attn_implementation({"text_config": name})
        else:
            self.model.set_attn_implementation(name)

    def capture_image_row(self, ids: np.ndarray, inputs: dict) -> list[tuple]:
        """One forward of one row with images through the model's base (vision tower + language model), ``inputs``
        from :class:`.vision.ImageInputs`; returns ``[(aux [T, A*H], final [T, H])]`` as :meth:`capture` does. In
        the packed layout the row is a pack of one sample."""
        import torch

        T = len(ids)
        x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None]
        kw = {k: self._to_device(v) for k, v in inputs.items()}
        pack = _Pack([T], self.kernel) if self.layout == "packed" else None
        token = _PACK.set(pack) if pack is not None else None
        self._cap.out.clear()
        try:
            with torch.inference_mode():
                getattr(self.model, "model", self.model)(input_ids=self._to_device(x), use_cache=False, **kw)
                aux, fin = self._collect((1, T))
        finally:
            if token is not None:
                _PACK.reset(token)
            self._cap.out.clear()
        if pack is not None and pack.calls != self.num_layers:
            raise RuntimeError(f"{self.model_name}: the packed attention ran {pack.calls} times for an image row")
        return [(aux[0], fin[0])]
