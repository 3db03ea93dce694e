"""The trainer layouts an export writes: what each reads (:data:`CONTRACTS`), where each sample goes, and the
record of the grouped layouts (SpecForge, Model-Optimizer); the format of each is in :mod:`eagle3_data.export`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: what each layout reads: ``drafters`` (the states must hold the layers of one of them: the first is the one
#: named in errors), ``final`` (the final-state form: ``post`` | ``pre`` | None: none), ``files`` (``grouped``:
#: ``rows_*/`` folders; ``speculators``: ``hidden_states/hs_{i}.safetensors`` and a data directory; ``inplace``: a
#: speculators data directory whose states are read from the extracted files, :mod:`.inplace`; ``refs``: a SpecForge
#: ref manifest whose states are read from the extracted files, :mod:`.inplace_specforge`; ``stream``: side tables
#: whose states Model-Optimizer's streaming dataset reads from the extracted files, :mod:`.inplace_modelopt`), ``ids``
#: (how the trainer's config numbers the target layers: ``layer``, the 0-based decoder layer whose output it reads,
#: as SpecForge and Model-Optimizer do; ``hidden_states_index``, the index into the target's ``hidden_states``
#: tuple, whose entry 0 is the embeddings: layer + 1, as speculators' ``target_layer_ids`` do)
CONTRACTS = {
    "specforge": {"drafters": ("eagle3",), "final": "post", "files": "grouped", "ids": "layer"},
    "specforge_dflash": {"drafters": ("dflash", "dspark"), "final": None, "files": "grouped", "ids": "layer"},
    "specforge_dspark": {"drafters": ("dspark", "dflash"), "final": "post", "files": "grouped", "ids": "layer"},
    "speculators": {"drafters": ("eagle3",), "final": "pre", "files": "speculators", "ids": "hidden_states_index"},
    "speculators_fp8": {"drafters": ("eagle3",), "final": "pre", "files": "speculators", "ids": "hidden_states_index"},
    "speculators_inplace": {"drafters": ("eagle3",), "final": "pre", "files": "inplace", "ids": "hidden_states_index"},
    "specforge_inplace": {"drafters": ("eagle3",), "final": "post", "files": "refs", "ids": "layer"},
    "modelopt": {"drafters": ("eagle3",), "final": "post", "files": "grouped", "ids": "layer"},
    "modelopt_inplace": {"drafters": ("eagle3",), "final": "post", "files": "stream", "ids": "layer"},
}

LAYOUTS = tuple(CONTRACTS)

#: the layouts whose directory is a speculators data path (rule export_dataset)
SPECULATORS_LAYOUTS = tuple(k for k, v in CONTRACTS.items() if v["files"] in ("speculators", "inplace"))
#: the layouts that copy no states: a data directory whose trainer reads results/hidden_states/ in place
INPLACE_FILES = ("inplace", "refs", "stream")
INPLACE_LAYOUTS = tuple(k for k, v in CONTRACTS.items() if v["files"] in INPLACE_FILES)
#: the layouts whose directory holds a SpecForge ref manifest (rule export_refs)
REFS_LAYOUTS = tuple(k for k, v in CONTRACTS.items() if v["files"] == "refs")

FP8_MAX = 448.0  # largest finite float8_e4m3fn

#: the files of a speculators data directory that ``datasets.Dataset.save_to_disk(num_shards=1)`` writes
SPECULATORS_DATASET_FILES = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")


def specforge_path(out_dir, index: int, group_size: int) -> Path:
    """Where SpecForge's ``prepare_hidden_states.py`` puts sample ``index``: ``rows_{g}-{g+size}/data_{i}.ckpt``."""
    g = (index // group_size) * group_size
    return Path(out_dir) / f"rows_{g}-{g + group_size}" / f"data_{index}.ckpt"


def modelopt_path(out_dir, index: int, group_size: int) -> Path:
    """Where the ``modelopt`` layout puts sample ``index``: ``rows_{g}-{g+size}/{i}.pt``."""
    g = (index // group_size) * group_size
    return Path(out_dir) / f"rows_{g}-{g + group_size}" / f"{index}.pt"


def speculators_path(out_dir, index: int) -> Path:
    """Where speculators' ``FileTransfer`` looks for sample ``index``: ``hidden_states/hs_{i}.safetensors``."""
    return Path(out_dir) / "hidden_states" / f"hs_{index}.safetensors"


def sample_path(layout: str, out_dir, index: int, group_size: int) -> Path:
    """The file of sample ``index`` in ``layout`` (module docstring)."""
    if CONTRACTS[layout]["files"] == "speculators":
        return speculators_path(out_dir, index)
    if layout == "modelopt":
        return modelopt_path(out_dir, index, group_size)
    return specforge_path(out_dir, index, group_size)


def drafter_of(layout: str, drafter_layers: dict) -> str | None:
    """The drafter whose layers ``layout`` reads among those stored (``drafter_layers``), or None."""
    return next((d for d in CONTRACTS[layout]["drafters"] if d in drafter_layers), None)


def has_consecutive_supervised(loss_mask) -> bool:
    """Whether a loss mask [T] holds two adjacent supervised positions (what SpecForge's DFlash family requires:
    ``specforge/data/loss_mask.py``, ``has_consecutive_supervised_tokens``)."""
    m = np.asarray(loss_mask).astype(bool)
    return bool((m[1:] & m[:-1]).any())


def quantize_per_token_fp8(x):
    """speculators' FP8 connector quantisation (``hs_connectors/fp8_utils.py``): ``x`` [T, ...] -> ``(fp8 [T, ...]
    float8_e4m3fn, scales [T, 1, ...] float32)``, one scale per token over every other dimension,
    ``max(amax / 448, 1e-12)``."""
    import torch

    xf = x.float()
    amax = xf.abs().amax(dim=tuple(range(1, xf.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).to(torch.float8_e4m3fn), scale


def speculators_tensors(t: dict) -> dict:
    """What speculators reads of sample ``t`` (``StatesFile.sample``'s tensors, final state pre-norm):
    ``token_ids`` [T] int64 and ``hidden_states`` [T, A+1, H] (the A auxiliary layers, then the final state), in
    the sample's dtype (hs_connectors' ``FileTransfer`` format)."""
    import torch

    aux, fin = t["aux_hidden_states"], t["hidden_states"]
    T, H = len(t["input_ids"]), fin.shape[-1]
    return {
        "token_ids": t["input_ids"],
        "hidden_states": torch.cat([aux.reshape(T, -1, H), fin.unsqueeze(1)], dim=1).contiguous(),
    }


def grouped_record(layout: str, t: dict, sample_id: str) -> dict:
    """What a grouped layout's ``torch.save`` file holds for sample ``t`` (module docstring)."""
    aux, fin = t["aux_hidden_states"], t["hidden_states"]
    if layout in ("specforge", "specforge_inplace"):
        return {
            "input_ids": t["input_ids"],
            "loss_mask": t["loss_mask"],
            "aux_hidden_state": aux.unsqueeze(0),
            "hidden_state": fin.unsqueeze(0),
        }
    if layout == "modelopt":
        return {
            "input_ids": t["input_ids"],
            "hidden_states": fin,
            "aux_hidden_states": aux,
            "loss_mask": t["loss_mask"],
            "conversation_id": sample_id,
        }
    record = {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"], "hidden_states": aux.unsqueeze(0)}
    if layout == "specforge_dspark":
        record["target_last_hidden_states"] = fin.unsqueeze(0)
    return record


def configured_layer_ids(layout: str, layers) -> list[int]:
    """The target layer ids ``layout``'s trainer is configured with for states of the 0-based decoder ``layers``
    (whose outputs the extraction stored): the same ids, or each + 1 where the trainer counts ``hidden_states``
    entries (:data:`CONTRACTS` ``ids``; speculators' ``target_layer_ids``, speculators/models/utils.py)."""
    shift = 1 if CONTRACTS[layout]["ids"] == "hidden_states_index" else 0
    return [int(x) + shift for x in layers]
