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
            return {
                "num_layers": int(sub["num_hidden_layers"]),
                "hidden_size": int(sub["hidden_size"]),
                "vocab_size": int(sub.get("vocab_size") or cfg.get("vocab_size") or 0),
                "model_type": str(sub.get("model_type", cfg.get("model_type", ""))),
            }
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


#: the drafters whose layers one extraction can capture (``extract.drafters``)
DRAFTERS = ("eagle3", "dflash", "dspark")
#: draft decoder layers of a DFlash-family drafter, hence target layers it reads, when ``extract.dflash_layers`` is
#: null: SpecForge's DFlash and DSpark configs for Qwen3-8B (``configs/qwen3-8b-dflash.json``: ``num_hidden_layers``
#: 5; ``configs/qwen3-8b-dspark.json``: ``target_layer_ids`` [1, 9, 17, 25, 33]) and Model-Optimizer's DFlash
#: default (``examples/speculative_decoding/doc/dflash.md``: 5 draft decoder layers). (SpecForge 0.2.0's
#: auto-generated draft config has 1, ``specforge/algorithms/dflash/providers.py:183``; its published drafts have 5.)
DFLASH_DRAFT_LAYERS = 5


def dflash_layer_ids(num_layers: int, num_draft_layers: int = DFLASH_DRAFT_LAYERS) -> list[int]:
    """The target layers a DFlash-family drafter with ``num_draft_layers`` decoder layers reads, as SpecForge 0.2.0
    picks them (``specforge/modeling/draft/dflash.py:271-281``, ``build_target_layer_ids``): one layer,
    ``[L // 2]``; else evenly spaced from 1 to ``L - 3``, each ``int(round(...))`` with Python's round (half to
    even: 7.5 -> 8, 20.5 -> 20). Index i is the OUTPUT of 0-based decoder layer i: SpecForge reads
    ``hidden_states[i + 1]`` (``extract_context_feature``, dflash.py:284-293, ``offset = 1``), the convention of
    :data:`LAYER_CONVENTION`. Ids may repeat on a shallow target. Raises ValueError for ``num_draft_layers`` < 1
    or an id outside ``[0, L-1]`` (a target too shallow for that many layers)."""
    L, n = int(num_layers), int(num_draft_layers)
    if n < 1:
        raise ValueError(f"extract.dflash_layers: a DFlash drafter has at least one layer, got {n}")
    if n == 1:
        ids = [L // 2]
    else:
        start, end = 1, L - 3
        ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    if min(ids) < 0 or max(ids) > L - 1:
        raise ValueError(
            f"extract.dflash_layers: {n} DFlash layers of a {L}-layer target give ids {ids} outside "
            f"[0, {L - 1}]; set extract.dflash_layers to a list of layers"
        )
    return ids


def resolve_drafter_layers(drafters, layers, dflash_layers, num_layers: int) -> tuple[list[int], dict]:
    """The layers one extraction captures for every drafter in ``drafters`` (:data:`DRAFTERS`), stored once.

    ``layers``: EAGLE-3's auxiliary layers (``extract.layers``; ``None``: :func:`default_layers`).
    ``dflash_layers``: DFlash's and DSpark's target layers (``extract.dflash_layers``): ``None`` ->
    :func:`dflash_layer_ids` with :data:`DFLASH_DRAFT_LAYERS`; an int n -> :func:`dflash_layer_ids` of n draft
    layers; a list -> those layers (checked like ``layers``, repeats allowed: SpecForge concatenates what the
    draft config names). DSpark reads the same layers as DFlash (``dflash_config.target_layer_ids``) plus the final
    state.

    Returns ``(union, per_drafter)``: ``union`` is the column order of the stored auxiliary states (EAGLE-3's layers
    in their order, then the other drafters' layers not among them, ascending), ``per_drafter`` maps each
    requested drafter to its layer list (in the drafter's own order). Raises ValueError naming the setting."""
    drafters = list(drafters or ["eagle3"])
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or not drafters:
        raise ValueError(f"extract.drafters: unknown drafter(s) {bad}; known: {list(DRAFTERS)}")
    per: dict[str, list[int]] = {}
    if "eagle3" in drafters:
        per["eagle3"] = resolve_layers(layers, num_layers)
    if {"dflash", "dspark"} & set(drafters):
        if dflash_layers is None or (
            isinstance(dflash_layers, (int, np.integer)) and not isinstance(dflash_layers, bool)
        ):
            fam = dflash_layer_ids(num_layers, DFLASH_DRAFT_LAYERS if dflash_layers is None else int(dflash_layers))
        else:
            resolve_layers(sorted(set(dflash_layers)), num_layers)  # each an int in range (repeats allowed)
            fam = [int(x) for x in dflash_layers]
        for d in ("dflash", "dspark"):
            if d in drafters:
                per[d] = list(fam)
    union: list[int] = list(per.get("eagle3", []))
    rest = sorted({x for d, ls in per.items() if d != "eagle3" for x in ls} - set(union))
    return union + rest, per


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
