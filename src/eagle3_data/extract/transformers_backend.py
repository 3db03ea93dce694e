"""Hugging Face transformers extraction backend (CPU and GPU; the backend the tests run).

The target runs one forward pass per batch (no KV cache, no logits: only the decoder is called) and forward
hooks capture the OUTPUT of the chosen decoder layers (auxiliary states, see ``model.LAYER_CONVENTION``) and
the final state: the final norm's output (``final_norm="post"``, = HF ``hidden_states[-1]``; SpecForge,
Model-Optimizer) or its input (``"pre"``, the last decoder layer's output; vLLM's ``extract_hidden_states``
for speculators, whose trainer applies the norm itself).

Batches are padded: right padding with an attention mask, so real positions never attend to padding (the
padding is computed but never stored).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .batching import padded_batches
from .layout import DTYPES
from .model import resolve_layers


def pick_device(device: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU (respecting ``CUDA_VISIBLE_DEVICES``), else ``"cpu"``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_target(model_path, *, dtype: str = "float32", device: str = "auto", device_map=None,
                trust_remote_code: bool = False):
    """Load the target from a local directory (``AutoModelForCausalLM``, eval mode) onto ``device``.

    ``device_map`` (e.g. ``"auto"``) spreads the layers over every visible GPU instead (accelerate).
    Returns ``(model, decoder)`` where ``decoder`` is the base model holding ``layers`` and ``norm``.
    Raises FileNotFoundError (no directory), ValueError (bad dtype; a model without ``layers``/``norm``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"extract dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"target model directory not found: {path}")
    kwargs = {"dtype": getattr(torch, dtype), "local_files_only": True, "trust_remote_code": trust_remote_code}
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


class Capture:
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
            one model across calls).

    Attributes: ``name`` ("transformers"), ``num_layers``, ``hidden_size``, ``vocab_size``, ``layers``
    (resolved), ``model_type``, ``model_name``, ``device``.
    """

    name = "transformers"

    def __init__(self, model_path, *, layers=None, dtype: str = "float32", device: str = "auto",
                 final_norm: str = "post", device_map=None, loaded=None, trust_remote_code: bool = False):
        import torch

        if loaded is None:
            loaded = load_target(model_path, dtype=dtype, device=device, device_map=device_map,
                                 trust_remote_code=trust_remote_code)
        self.model, self.decoder = loaded
        cfg = self.model.config
        self.num_layers = len(self.decoder.layers)
        self.hidden_size = int(getattr(cfg, "hidden_size", None) or self.decoder.norm.weight.shape[-1])
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or 0)
        self.model_type = str(getattr(cfg, "model_type", ""))
        self.model_name = str(getattr(cfg, "_name_or_path", "") or Path(model_path).name)
        self.layers = resolve_layers(layers, self.num_layers)
        self.tdtype = getattr(torch, dtype)
        self.device = self.model.get_input_embeddings().weight.device
        self._cap = Capture(self.decoder, self.layers, final_norm)

    def batches(self, lengths: list[int], batch_tokens: int) -> list[list[int]]:
        """Padded batches within ``batch_tokens`` padded tokens (``batching.padded_batches``)."""
        return padded_batches(lengths, batch_tokens)

    def capture(self, id_lists: list[np.ndarray]) -> list[tuple]:
        """One padded forward over ``id_lists`` (1-D int arrays); returns, per sample, ``(aux [n, A*H],
        final [n, H])`` torch tensors in the compute dtype on the model's device (padding cut off).

        Raises RuntimeError when a hook did not fire or a captured shape differs from the input's."""
        import torch

        lengths = [len(x) for x in id_lists]
        longest = max(lengths)
        ids = torch.zeros((len(id_lists), longest), dtype=torch.long)
        att = torch.zeros((len(id_lists), longest), dtype=torch.long)
        for r, x in enumerate(id_lists):
            ids[r, : lengths[r]] = torch.from_numpy(np.asarray(x, dtype=np.int64))
            att[r, : lengths[r]] = 1
        self._cap.out.clear()
        with torch.inference_mode():
            self.decoder(input_ids=ids.to(self.device), attention_mask=att.to(self.device), use_cache=False)
            got = [self._cap.out.get(j) for j in self.layers] + [self._cap.out.get("final")]
            if any(g is None for g in got):
                raise RuntimeError(f"a forward hook did not fire (layers {self.layers})")
            for g in got:
                if tuple(g.shape[:2]) != (len(id_lists), longest):
                    raise RuntimeError(f"captured shape {tuple(g.shape)} != input {(len(id_lists), longest)}")
            aux = torch.cat([g.to(got[-1].device) for g in got[:-1]], dim=-1).to(self.tdtype)
            fin = got[-1].to(self.tdtype)
        self._cap.out.clear()
        return [(aux[r, : lengths[r]], fin[r, : lengths[r]]) for r in range(len(id_lists))]

    def close(self) -> None:
        """Remove the hooks (the model stays loaded for whoever passed it in)."""
        self._cap.remove()
