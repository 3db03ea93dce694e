"""Export stage: one extract file (a merged shard's hidden states) -> the per-sample files trainers read.

Layouts (each file written to a temporary name and renamed; file names use the GLOBAL sample index, i.e.
``start_index`` + the sample's row in the shard, so shards export independently into one directory):

``specforge`` (SpecForge offline EAGLE-3 trainer, ``OfflineEagle3Dataset``):
    ``<out_dir>/rows_{g}-{g+group_size}/data_{i}.ckpt`` written with ``torch.save`` holding
    ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``aux_hidden_state`` [1, T, A*H] and ``hidden_state``
    [1, T, H] (post-norm final state) in the extract dtype. SpecForge finds ``*.ckpt`` recursively, so
    ``<out_dir>`` is its ``--train-hidden-states-path``. Needs ``final_norm == "post"`` (SpecForge applies the
    target lm_head to ``hidden_state`` directly).

``speculators`` (vllm-project/speculators offline data, ``ArrowDataset`` + ``FileTransfer``; section 2(f)):
    ``<out_dir>/hidden_states/hs_{i}.safetensors`` holding ``token_ids`` [T] int64 and ``hidden_states``
    [T, A+1, H] (the A auxiliary layers then the final state; the trainer reads ``[:, :-1].flatten(1)`` and
    ``[:, -1]``). speculators takes ``loss_mask`` from its own arrow dataset, not from this file: each shard
    also writes ``<out_dir>/samples_{start}.parquet`` (``index``, ``sample_id``, ``dataset``, ``input_ids``,
    ``loss_mask``, ``seq_len``) to build it from. Needs ``final_norm == "pre"`` (speculators applies the
    target's norm before its lm_head); pass ``allow_norm_mismatch=True`` to export anyway.

Storage savers are undone on export (fp8 auxiliary states dequantised to the extract dtype; final-state rows
not stored are written as zeros: they are never read by the loss, see ``extract.supervised_final_mask``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pyarrow as pa

from .extract import load_states
from .io import atomic_path, write_json, write_parquet

log = logging.getLogger("eagle3_data.export")

LAYOUTS = ("specforge", "speculators")
REQUIRED_NORM = {"specforge": "post", "speculators": "pre"}


def specforge_path(out_dir, index: int, group_size: int = 2000) -> Path:
    """Where SpecForge's ``prepare_hidden_states.py`` puts sample ``index``: ``rows_{g}-{g+size}/data_{i}.ckpt``."""
    g = (index // group_size) * group_size
    return Path(out_dir) / f"rows_{g}-{g + group_size}" / f"data_{index}.ckpt"


def speculators_path(out_dir, index: int) -> Path:
    """Where speculators' ``FileTransfer`` looks for sample ``index``: ``hidden_states/hs_{i}.safetensors``."""
    return Path(out_dir) / "hidden_states" / f"hs_{index}.safetensors"


def export(
    hidden_path,
    out_dir,
    *,
    layout: str,
    start_index: int = 0,
    group_size: int = 2000,
    manifest_path=None,
    allow_norm_mismatch: bool = False,
) -> dict:
    """Write the samples of one extract file in a trainer's per-sample layout (module docstring).

    Args:
        hidden_path: an extract safetensors file (``eagle3_data.extract`` layout, any storage saver).
        out_dir: the layout's root directory (shared by all shards).
        layout: ``specforge`` | ``speculators``.
        start_index: global index of this shard's first sample (samples of the merged shards before it;
            :func:`start_indices` computes it from the merge manifest).
        group_size: SpecForge's ``--file-group-size`` (files per ``rows_*`` directory).
        manifest_path: optional JSON written last (atomically): layout, source, start/end index, files,
            tokens, seconds. Snakemake uses it as the rule's output.
        allow_norm_mismatch: export even when the file's ``final_norm`` is not what the trainer expects.

    Returns: the manifest dict.

    Raises: ValueError (unknown layout, wrong final-norm convention, not an eagle3-data file).
    """
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"export layout must be one of {LAYOUTS}, got {layout!r}")
    if start_index < 0 or group_size < 1:
        raise ValueError(f"export: start_index must be >= 0 and group_size >= 1, got {start_index}, {group_size}")
    t0 = time.perf_counter()
    t, meta = load_states(hidden_path)
    if not meta.get("format", "").startswith("eagle3-data/hidden-states"):
        raise ValueError(f"{hidden_path}: not an eagle3-data hidden-states file (format={meta.get('format')!r})")
    norm = meta.get("final_norm", "post")
    if norm != REQUIRED_NORM[layout] and not allow_norm_mismatch:
        raise ValueError(
            f"{hidden_path}: final hidden state is {norm}-norm but {layout} expects {REQUIRED_NORM[layout]}-norm; "
            f"extract with extract.final_norm: {REQUIRED_NORM[layout]} (or pass allow_norm_mismatch)"
        )
    H = int(meta["hidden_size"])
    A = len(json.loads(meta["layers"]))
    off = t["sample_offsets"].tolist()
    n = len(off) - 1
    sample_ids = json.loads(meta["sample_ids"])
    datasets = json.loads(meta["datasets"])
    out_dir = Path(out_dir)
    files = []
    for j in range(n):
        s, e = off[j], off[j + 1]
        idx = start_index + j
        ids = t["input_ids"][s:e].clone()
        mask = t["loss_mask"][s:e].clone()
        aux = t["aux_hidden_states"][s:e].clone()
        fin = t["hidden_states"][s:e].clone()
        if layout == "specforge":
            path = specforge_path(out_dir, idx, group_size)
            record = {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": aux.unsqueeze(0),
                      "hidden_state": fin.unsqueeze(0)}
            with atomic_path(path) as tmp:
                torch.save(record, tmp)
        else:
            from safetensors.torch import save_file

            path = speculators_path(out_dir, idx)
            stacked = torch.cat([aux.reshape(e - s, A, H), fin.unsqueeze(1)], dim=1).contiguous()
            with atomic_path(path) as tmp:
                save_file({"token_ids": ids, "hidden_states": stacked}, str(tmp),
                          metadata={"sample_id": sample_ids[j], "source": str(hidden_path)})
        files.append(str(path))
    if layout == "speculators":
        table = pa.table({
            "index": pa.array(range(start_index, start_index + n), pa.int64()),
            "sample_id": pa.array(sample_ids, pa.string()),
            "dataset": pa.array(datasets, pa.string()),
            "input_ids": pa.array([t["input_ids"][off[j]:off[j + 1]].tolist() for j in range(n)], pa.list_(pa.int64())),
            "loss_mask": pa.array([t["loss_mask"][off[j]:off[j + 1]].tolist() for j in range(n)], pa.list_(pa.int64())),
            "seq_len": pa.array([off[j + 1] - off[j] for j in range(n)], pa.int64()),
        })
        write_parquet(table, out_dir / f"samples_{start_index:09d}.parquet")
    manifest = {
        "layout": layout,
        "source": str(hidden_path),
        "out_dir": str(out_dir),
        "start_index": start_index,
        "end_index": start_index + n,
        "num_samples": n,
        "num_tokens": int(off[-1]),
        "final_norm": norm,
        "aux_format_in_source": meta.get("aux_format", "same"),
        "final_states_in_source": meta.get("final_states", "all"),
        "files": files,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if manifest_path is not None:
        write_json(manifest, manifest_path)
    log.info("exported %d samples (%d tokens) of %s as %s into %s", n, manifest["num_tokens"], hidden_path,
             layout, out_dir)
    return manifest


def start_indices(merge_manifest) -> list[int]:
    """Global index of the first sample of each merged shard, from the merge manifest (path or dict)."""
    m = json.loads(Path(merge_manifest).read_text()) if not isinstance(merge_manifest, dict) else merge_manifest
    out, acc = [], 0
    for s in m["shards"]:
        out.append(acc)
        acc += int(s["samples"])
    return out
