"""The progress snapshots of a run's jobs: small JSON files under ``<run dir>/progress/``, one per job, each
rewritten whole (a temporary file renamed over it) as the job goes; the run-wide view
(:mod:`eagle3_data.runtime.runview`) reads them."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

PROGRESS_DIR = "progress"


def snapshot_path(run_dir: str | os.PathLike, dataset: str, shard: str, kind: str = "generate") -> Path:
    """``<run_dir>/progress/<kind>.<dataset>.<shard>.json`` (kind ``generate``, ``pilot`` for the forecast's, or
    ``extract``)."""
    return Path(run_dir) / PROGRESS_DIR / f"{kind}.{dataset}.{shard}.json"


def write_snapshot(run_dir, snap: dict) -> None:
    """Write ``snap`` to its :func:`snapshot_path` (temp file + rename; errors ignored: the view is best effort)."""
    path = snapshot_path(run_dir, snap["dataset"], snap["shard"], snap.get("kind") or "generate")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(snap))
        os.replace(tmp, path)


def read_snapshots(run_dir, kind: str = "generate") -> dict[tuple[str, str], dict]:
    """``(dataset, shard)`` -> the latest snapshot of each job of the run of that ``kind`` (unreadable files left
    out)."""
    out = {}
    folder = Path(run_dir) / PROGRESS_DIR
    for p in sorted(folder.glob(f"{kind}.*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            s = json.loads(p.read_text())
            out[(s["dataset"], s["shard"])] = s
    return out
