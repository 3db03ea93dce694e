"""GPU assignment for concurrent local jobs: file locks per device, ``CUDA_VISIBLE_DEVICES`` set before CUDA.

Snakemake's ``resources: gpu=<n>`` only counts devices (``--resources gpu=8`` keeps at most 8 busy); it does
not say WHICH devices a job may use and does not set ``CUDA_VISIBLE_DEVICES``. :func:`gpu_devices` does:
each device ``i`` of the machine has a lock file ``<lock_dir>/<host>.gpu<i>.lock``; a job takes an exclusive
``fcntl.flock`` on ``n`` free ones (all or none, so two jobs never deadlock holding half each), sets
``CUDA_VISIBLE_DEVICES`` to them, and releases them when the block ends or the process dies (the kernel drops
``flock`` locks of a dead process, so a killed job never leaves a device taken).

It must run before torch initialises CUDA in the process (the CUDA runtime reads ``CUDA_VISIBLE_DEVICES``
once, at its first call): enter it before ``torch.cuda.is_available()``, model loading or any ``.cuda()``.

Device pool, in order of precedence:

1. ``SLURM_JOB_ID`` and ``CUDA_VISIBLE_DEVICES`` both set: the scheduler already gave this job its devices;
   they are used as they are (no locks), after checking there are at least ``n``.
2. ``CUDA_VISIBLE_DEVICES`` set (a user restricting a machine): the pool is that list.
3. ``EAGLE3_NUM_GPUS`` set (tests, or a machine without ``nvidia-smi``): devices ``0..N-1``.
4. ``nvidia-smi -L`` lines: devices ``0..N-1``; no ``nvidia-smi`` -> no devices.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("eagle3_data.devices")

DEFAULT_LOCK_DIR = "/tmp/eagle3-data-gpu-locks"


def visible_pool(env: dict | None = None) -> tuple[list[str], str]:
    """The devices this process may choose from and where that list came from.

    Returns ``(ids, source)``; ``ids`` are the strings to put in ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs),
    ``source`` is one of ``slurm``, ``CUDA_VISIBLE_DEVICES``, ``EAGLE3_NUM_GPUS``, ``nvidia-smi``, ``none``.
    Raises ValueError when ``EAGLE3_NUM_GPUS`` is not a non-negative integer.
    """
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids = [x.strip() for x in cvd.split(",") if x.strip() and x.strip() != "-1"]
        return ids, ("slurm" if env.get("SLURM_JOB_ID") else "CUDA_VISIBLE_DEVICES")
    if env.get("EAGLE3_NUM_GPUS") is not None:
        raw = env["EAGLE3_NUM_GPUS"]
        if not raw.strip().isdigit():
            raise ValueError(f"EAGLE3_NUM_GPUS must be a non-negative integer, got {raw!r}")
        return [str(i) for i in range(int(raw))], "EAGLE3_NUM_GPUS"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        if n:
            return [str(i) for i in range(n)], "nvidia-smi"
    return [], "none"


def _lock_name(device: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in device)
    return f"{socket.gethostname()}.gpu{safe}.lock"


def _try_lock(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode())
    return fd


def _release(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def gpu_devices(
    n: int,
    *,
    lock_dir: str | os.PathLike | None = None,
    timeout_s: float | None = 3600.0,
    poll_s: float = 0.5,
    env: dict | None = None,
    set_env: bool = True,
) -> Iterator[list[str]]:
    """Hold ``n`` distinct GPUs of this machine for the block; yield their ids.

    Args:
        n: devices needed (the rule's ``resources: gpu``); ``0`` yields ``[]`` and changes nothing.
        lock_dir: directory of the lock files (created; must be on a LOCAL filesystem shared by the jobs of
            one machine). Default ``$EAGLE3_GPU_LOCK_DIR`` or ``/tmp/eagle3-data-gpu-locks``. File names
            carry the host name, so a directory shared between nodes does not make them collide.
        timeout_s: give up after this long waiting for ``n`` free devices (``None``: wait forever). With
            Snakemake's ``--resources gpu=<pool size>`` the wait is normally zero; it only happens when
            something outside this workflow holds the locks.
        poll_s: first retry delay (doubles up to 5 s).
        env: the environment to read and (with ``set_env``) update; default ``os.environ``.
        set_env: set ``env["CUDA_VISIBLE_DEVICES"]`` to the held ids during the block (restored after).

    Raises:
        ValueError: ``n`` is negative or larger than the pool (names the pool and where it came from).
        TimeoutError: ``n`` devices did not become free within ``timeout_s``.
    """
    env = os.environ if env is None else env
    if n < 0:
        raise ValueError(f"gpu_devices: n must be >= 0, got {n}")
    if n == 0:
        yield []
        return
    pool, source = visible_pool(env)
    if n > len(pool):
        raise ValueError(
            f"gpu_devices: this job needs {n} GPU(s) but the pool has {len(pool)} ({source}: {pool}); "
            "lower extract.gpus_per_job or run where more devices are visible"
        )
    if source == "slurm":  # the scheduler already isolated this job's devices
        with _visible(env, pool[:n], set_env):
            yield pool[:n]
        return

    ldir = Path(lock_dir or env.get("EAGLE3_GPU_LOCK_DIR") or DEFAULT_LOCK_DIR)
    ldir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(ldir, 0o1777)  # shared by the users of one machine, like /tmp
    start = time.monotonic()
    delay = poll_s
    waited_logged = False
    # Start the scan at a per-process offset so concurrent jobs try different devices first.
    offset = os.getpid() % len(pool)
    order = pool[offset:] + pool[:offset]
    while True:
        held: list[tuple[str, int]] = []
        for dev in order:
            fd = _try_lock(ldir / _lock_name(dev))
            if fd is not None:
                held.append((dev, fd))
                if len(held) == n:
                    break
        if len(held) == n:
            break
        _release([fd for _, fd in held])  # all or none: never hold some while waiting for the rest
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(
                f"gpu_devices: {n} of {len(pool)} GPU(s) did not become free within {timeout_s:.0f}s "
                f"(locks in {ldir}; a lock file names the pid holding it)"
            )
        if not waited_logged:
            log.info("waiting for %d free GPU(s) of %s (locks in %s)", n, pool, ldir)
            waited_logged = True
        # jittered: two jobs that want most of the devices take a part each, give it back and would otherwise retry
        # in step (the same doubling from the same start) for as long as both wait
        time.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(delay * 2, 5.0)
    chosen = sorted((d for d, _ in held), key=lambda d: pool.index(d))
    fds = [fd for _, fd in held]
    log.info("holding GPU(s) %s (%s pool %s)", chosen, source, pool)
    try:
        with _visible(env, chosen, set_env):
            yield chosen
    finally:
        _release(fds)


@contextlib.contextmanager
def _visible(env: dict, devices: list[str], set_env: bool):
    """``env["CUDA_VISIBLE_DEVICES"] = devices`` for the block (if ``set_env``), then the previous value back."""
    if not set_env:
        yield
        return
    old = env.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    try:
        yield
    finally:
        if old is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = old


def cuda_initialized() -> bool:
    """Whether torch has already initialised CUDA in this process (then ``CUDA_VISIBLE_DEVICES`` is fixed)."""
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())
