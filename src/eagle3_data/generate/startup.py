"""The machine's start-up gate for generate jobs: at most one job per CPU core does its start-up (imports,
reading its prompts shard and journal, opening its backends) at a time.

Snakemake starts every ready generate job at once (they claim no cores: they wait on the network). Sixteen jobs
on two cores then share the CPU while each does about a CPU-second of start-up, and the first request leaves only
when all of them are nearly through (8 s in ``benchmarks/generation_run.py``). Through the gate the first jobs
start at full speed and send while the others start; the CPU spent is the same.

A job holds one of ``slots`` lock files (``fcntl.flock``, released by the kernel when the process dies, so a
killed job never blocks another) from the top of its script until its first request asks for a slot, or until it
ends (:func:`release`). The gate never holds a job longer than ``max_wait_s``: past that it goes on ungated. The
lock files live beside the backends' request slots (:func:`eagle3_data.backends.limits.limits_dir`, i.e.
``$EAGLE3_LIMITS_DIR``, else ``<tmp>/eagle3-data-<uid>/limits``), so every run and workdir on the machine shares
them. Only the standard library is imported here: the gate is taken before the job's own imports.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

_held: int | None = None  # the fd of the slot this process holds


def cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def acquire(
    slots: int | None = None,
    *,
    directory: str | os.PathLike | None = None,
    max_wait_s: float = 30.0,
    poll_s: float = 0.02,
) -> bool:
    """Take one of ``slots`` (default: :func:`cores`) start-up slots of this machine, waiting at most
    ``max_wait_s`` seconds (then go on without one). Returns True if a slot is held. Never raises: a gate that
    cannot be made (unwritable directory) lets the job start at once."""
    global _held
    if _held is not None:
        return True
    n = int(slots or cores())
    try:
        if directory is None:
            from ..backends.limits import limits_dir

            directory = limits_dir()
        d = Path(directory) / "startup"
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    deadline = time.monotonic() + max_wait_s
    start = os.getpid() % n  # spread the first tries over the slots
    while True:
        for i in range(n):
            try:
                fd = os.open(d / f"slot-{(start + i) % n}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            _held = fd
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def release() -> None:
    """Give the start-up slot back (idempotent; the first request of the job calls it, and the job's end)."""
    global _held
    fd, _held = _held, None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def held() -> bool:
    """True while this process holds a start-up slot."""
    return _held is not None
