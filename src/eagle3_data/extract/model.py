"""What extraction needs to know about the target before loading it: sizes, layer convention, identity.

Read from the target's ``config.json`` only (no torch, no weights), so the plan, the stage's reuse check and
the backends agree on the same numbers without importing each other.

Layer convention (written into every hidden-states file as ``layer_convention``): auxiliary layer ``i`` is
the OUTPUT of 0-based decoder layer ``i`` (SpecForge / SGLang / Model-Optimizer convention; = Hugging Face
``output_hidden_states[i + 1]``; the same physical tensor as EAGLE's / vLLM's "input of layer i+1").
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

LAYER_CONVENTION = "output of 0-based decoder layer i (= HF output_hidden_states[i+1])"

#: weight files whose names and sizes identify a checkpoint (with config.json) in :func:`model_fingerprint`
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_config(model_path) -> tuple[dict, str]:
    """``(config dict, where)`` from ``<model_path>/config.json``, a path to a JSON file, or a dict.

    Raises FileNotFoundError naming the file."""
    if isinstance(model_path, dict):
        return model_path, "<config dict>"
    path = Path(model_path)
    path = path / "config.json" if path.is_dir() or not path.suffix else path
    if not path.is_file():
        raise FileNotFoundError(f"target config not found: {path}")
    return json.loads(path.read_text()), str(path)


def model_dims(model_path) -> dict:
    """``{num_layers, hidden_size, vocab_size, model_type}`` from the target's ``config.json`` (or a dict).

    Looks in ``text_config`` / ``language_config`` too (multimodal wrappers such as Kimi-K2.5, whose
    ``model_type`` is the wrapper's and whose language model sits in ``text_config``). ``vocab_size`` is
    0 when the config has none. Raises FileNotFoundError / KeyError naming the file and the missing key.
    """
    cfg, where = model_config(model_path)
    for sub in (cfg, cfg.get("text_config") or {}, cfg.get("language_config") or {}):
        if "num_hidden_layers" in sub and "hidden_size" in sub:
            return {"num_layers": int(sub["num_hidden_layers"]), "hidden_size": int(sub["hidden_size"]),
                    "vocab_size": int(sub.get("vocab_size") or cfg.get("vocab_size") or 0),
                    "model_type": str(sub.get("model_type", cfg.get("model_type", "")))}
    raise KeyError(f"{where} has no num_hidden_layers/hidden_size (also looked in text_config, language_config)")


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default auxiliary layers for a target with ``num_layers`` decoder layers.

    ``sorted({1, max(0, L//2-1), max(0, L-4)})`` clamped to ``<= L-1`` (Model-Optimizer
    ``default_eagle_aux_layer_ids``; SpecForge ``resolve_eagle_capture_layers`` gives the same three for
    L >= 8). Indices are 0-based decoder layers whose OUTPUT is captured. Raises ValueError for L < 1.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    L = num_layers
    return sorted({min(L - 1, x) for x in (1, max(0, L // 2 - 1), max(0, L - 4))})


def resolve_layers(layers, num_layers: int) -> list[int]:
    """``layers`` checked against the model (``None`` -> :func:`default_layers`), order kept.

    Raises ValueError for a non-int, an index outside ``[0, num_layers-1]``, a repeated index or an empty list.
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


def _head_tail(path: Path, n: int = 1 << 20) -> bytes:
    """SHA-256 of the first and last ``n`` bytes of a file."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as fh:
        h.update(fh.read(n))
        if size > n:
            fh.seek(max(n, size - n))
            h.update(fh.read(n))
    return h.digest()


def model_fingerprint(model_path) -> str:
    """A short hex digest identifying the target checkpoint: ``config.json``'s bytes plus, for every weight file
    (:data:`WEIGHT_SUFFIXES`) in the directory, its name, size and a hash of its first and last MiB.

    Whole weights are not hashed (terabytes for large targets); a safetensors file starts with its header and
    the first tensor's values and ends with the last tensor's, so another checkpoint of the same architecture
    (a fine-tune) changes the digest while copying or re-downloading the same weights does not (file times are
    not used: two builds of the same target give the same digest). A dict config (tests) is fingerprinted by
    its JSON alone.
    """
    h = hashlib.sha256()
    if isinstance(model_path, dict):
        h.update(json.dumps(model_path, sort_keys=True).encode())
        return h.hexdigest()[:16]
    path = Path(model_path)
    cfg = path / "config.json" if path.is_dir() else path
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES):
                h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
                h.update(_head_tail(f))
    return h.hexdigest()[:16]
