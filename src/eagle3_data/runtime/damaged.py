"""Damaged files under ``results/``: named in one line each and removed before the run plans, so it rebuilds them.

Every stage writes its outputs under a temporary name and renames them when whole (:func:`eagle3_data.files.
atomic_path`), so a crash of ours never leaves a half file. A full disk under another writer, a copy cut short,
a file system repaired after a power loss can: a parquet cut in half, a zero-byte file. Snakemake takes such a
file as built (it only compares times), and every rerun then fails in the job that reads it, with a traceback
that does not name it. :func:`remove_damaged` looks at each stage output under ``results/`` before the run plans
its jobs (the Snakefile calls it): a damaged one is named in one line and removed, and the run rebuilds it and
what depends on it (a responses shard from the journal: nothing paid for is bought again).

The checks read a few bytes per file, never a whole file: a parquet file starts and ends with ``PAR1`` and its
footer length fits the file (the Apache Parquet file format); a safetensors file's 8-byte header length and
its header's last data offset add up to the file's size (the safetensors format, huggingface/safetensors
README); a JSON file parses (JSON files over :data:`MAX_JSON_BYTES` are only checked for being non-empty).
Exports (``results/export/``, trainer layouts with a file per sample) and reports (``results/reports/``,
rebuilt every run) are not looked at.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

#: the folders under ``results/`` not looked at (trainer layouts with a file per sample; reports, rebuilt anyway)
SKIPPED = ("export", "reports")
#: a JSON output larger than this is only checked for being non-empty (stage summaries are a few KB)
MAX_JSON_BYTES = 8 << 20
SUFFIXES = (".parquet", ".json", ".safetensors")


def problem(path: str | os.PathLike) -> str | None:
    """Why the stage output ``path`` (``.parquet``, ``.json``, ``.safetensors``) is not a whole file, or None.

    Returns a short reason (``"0 bytes"``, ``"cut off: no parquet footer"``, ...). Raises OSError when the file
    can't be read at all (permissions)."""
    p = Path(path)
    size = p.stat().st_size
    if size == 0:
        return "0 bytes"
    with open(p, "rb") as fh:
        if p.suffix == ".parquet":
            if size < 12:
                return f"{size} bytes: too short for a parquet file"
            head = fh.read(4)
            fh.seek(size - 8)
            footer_len, tail = struct.unpack("<I4s", fh.read(8))
            if head != b"PAR1":
                return "not a parquet file (no PAR1 at its start)"
            if tail != b"PAR1":
                return "cut off: no parquet footer at its end"
            if footer_len + 12 > size:
                return f"cut off: its footer says {footer_len:,} bytes, the file has {size:,}"
            return None
        if p.suffix == ".safetensors":
            if size < 8:
                return f"{size} bytes: too short for a safetensors file"
            (n,) = struct.unpack("<Q", fh.read(8))
            if 8 + n > size:
                return f"cut off: its header says {n:,} bytes, the file has {size:,}"
            try:
                header = json.loads(fh.read(n))
            except ValueError:
                return "its safetensors header is not JSON"
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
            want = 8 + n + max(ends, default=0)
            if want != size:
                return f"cut off: its tensors end at byte {want:,}, the file has {size:,}"
            return None
        if p.suffix == ".json" and size <= MAX_JSON_BYTES:
            try:
                json.loads(fh.read())
            except ValueError as exc:
                return f"not JSON ({str(exc)[:80]})"
    return None


def scan(results_dir: str | os.PathLike = "results") -> list[tuple[Path, str]]:
    """``(path, reason)`` of each damaged stage output under ``results_dir`` (:func:`problem`), sorted; hidden
    files (a writer's temporary ``.<name>.XXXX.tmp``, the ``.built-by.json`` marker checked elsewhere) and the
    :data:`SKIPPED` folders are left out."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in SKIPPED]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or not name.endswith(SUFFIXES):
                continue
            path = here / name
            try:
                why = problem(path)
            except OSError as exc:
                why = f"unreadable: {exc.strerror or exc}"
            if why:
                found.append((path, why))
    return sorted(found)


def remove_damaged(results_dir: str | os.PathLike = "results", *, dry_run: bool = False) -> list[str]:
    """Remove each damaged stage output under ``results_dir`` (:func:`scan`) and return one line per file for the
    user. With ``dry_run`` nothing is removed and the lines say what a run will do."""
    lines = []
    for path, why in scan(results_dir):
        if dry_run:
            lines.append(f"{path} is damaged ({why}): a run (not -n) removes it and rebuilds it")
            continue
        try:
            path.unlink()
        except OSError as exc:
            lines.append(f"{path} is damaged ({why}) and could not be removed ({exc.strerror}): remove it, then rerun")
            continue
        lines.append(
            f"{path} is damaged ({why}): removed; this run rebuilds it (replies come from the journal: nothing "
            "paid for is bought again)"
        )
    return lines
