"""File helpers shared by every stage: atomic writes, parquet I/O, sample ids and shard assignment.

Every stage output is written to a temporary name in the same directory and renamed into place, so a crash
never leaves a truncated file that a rerun would take as done.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, lock: bool = True) -> Iterator[Path]:
    """Yield a temporary path (``.<name>.XXXX.tmp``) next to ``path``; rename it onto ``path`` only if the block
    succeeds.

    The temporary file lives in the same directory (same filesystem) so ``os.replace`` is atomic.
    On an exception the temporary file is removed and ``path`` is left untouched. The writer holds an exclusive
    ``flock`` on its temporary file while the block runs, and first removes the temporary files of ``path`` that
    dead writers left (:func:`remove_stale_partials`: a job killed with ``kill -9`` or SIGBUS runs no cleanup), so
    a rerun that writes ``path`` leaves none behind. A full, read-only or unwritable disk raises
    :class:`..errors.DiskError`, one line naming ``path``. (``lock``: kept for callers; always on.)
    """
    from .errors import disk_error

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise (disk_error(exc, path) or exc) from None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the OS when the process dies
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs get the usual umask permissions
        os.replace(tmp_path, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        failure = disk_error(exc, path)
        if failure is not None:
            raise failure from None
        raise
    finally:
        os.close(fd)


def remove_stale_partials(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary files (``.<name>.*.tmp``) that dead writers of ``path`` left (a job killed with
    ``kill -9`` never runs its cleanup); a file whose writer still holds its lock (``atomic_path(lock=True)``,
    e.g. another job writing the same output) is left alone. Returns the removed paths."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live writer
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


def write_parquet(table: pa.Table, path: str | os.PathLike) -> None:
    """Write ``table`` to ``path`` atomically (zstd-compressed parquet)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_json(obj, path: str | os.PathLike) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_text(text: str, path: str | os.PathLike) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_parquet(paths: str | os.PathLike | list) -> pa.Table:
    """Read one or several parquet files into one table (schemas must agree)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    tables = [pq.read_table(p) for p in paths]
    if not tables:
        raise ValueError("read_parquet: no input files")
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def content_hash(*parts: object, length: int = 16) -> str:
    """Hex digest (blake2b, ``length`` bytes -> 2*length hex chars) of the JSON of ``parts``.

    Used for sample ids of sources without their own id and for request keys; stable across runs,
    machines and Python versions (canonical JSON with sorted keys).
    """
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=length).hexdigest()


def shard_of(sample_id: str, num_shards: int) -> int:
    """Shard index in ``[0, num_shards)`` of a sample, from a hash of its ``sample_id``.

    Depends only on the id, so adding samples to a source never moves existing samples between shards.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards


def shard_name(index: int) -> str:
    """File stem of shard ``index``: zero-padded to 3 digits (``000``, ``001``, ...)."""
    return f"{index:03d}"
