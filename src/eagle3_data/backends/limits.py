"""Request slots shared by the generate jobs of a run: a backend's ``max_concurrency`` holds across all of them.

Every shard of every dataset on a backend can be in flight at once; what bounds them together is the backend's
limit, not one job's share of it. How the limit is shared depends on where the jobs run (:func:`job_limit`):

- ``host`` (the jobs of a workflow run on one machine, :mod:`eagle3_data.run`): one counting semaphore per backend
  and run, a System V semaphore created with the backend's ``max_concurrency`` (:class:`HostSlots`). A job takes
  a slot for each request it sends (``semop -1``, never blocking; a job that finds none marks itself waiting and
  polls) and, when the request ends, keeps the slot for its own next request while it has requests waiting and
  holds no more than its fair share (``limit / jobs``) or nobody else waits; otherwise it gives the slot back. A
  waiter that gets a slot wakes the next one, so the slots other jobs give back are taken by every waiter. So
  the slots follow the demand: the backend stays at its limit until the last tail, and every job gets its share
  while others run. Every operation is ``SEM_UNDO``: the kernel returns the slots of a job that dies, however it
  dies. The end of the run removes the semaphores.
- ``split`` (a cluster job: the Snakefile sets ``EAGLE3_CONCURRENCY=split`` in jobs a cluster executor runs): the
  limit is split evenly over the generate jobs that use the backend (the shards of every dataset naming it), so
  that all of them may run at once, on any nodes, without exceeding it together.
- ``job`` (the Python API outside a run): the job alone has the whole limit.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import math
import os
from pathlib import Path

logger = logging.getLogger("eagle3_data.backends")

_IPC_CREAT, _IPC_NOWAIT, _SEM_UNDO = 0o1000, 0o4000, 0x1000
_IPC_RMID, _GETVAL, _SETVAL = 0, 12, 16
SEM_MAX = 32767  # SEMVMX: the largest value a System V semaphore holds


class _SemBuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _semop(semid: int, op: int, flags: int, num: int = 0) -> bool:
    b = _SemBuf(num, op, flags)
    if _c().semop(semid, ctypes.byref(b), 1) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EINTR):
        return False
    raise OSError(err, f"semop on semaphore {semid}: {os.strerror(err)}")


class HostSlots:
    """``limit`` request slots of one backend, shared by the processes of one machine: a System V semaphore set whose
    id is kept in ``path`` (a small JSON file, written under a ``flock`` by the first job that needs it). Its three
    values: the free slots, the jobs using the slots (:meth:`register`), the jobs waiting for a slot
    (:meth:`starving`).

    ``try_take()`` takes a slot if one is free (never blocks); ``give()`` returns slots. Every operation is
    ``SEM_UNDO``: what a process that exits without undoing it took or counted is undone by the kernel.

    Raises ValueError for ``limit`` outside ``1..32767`` (SEMVMX).
    """

    NSEMS = 3  # free slots, registered jobs, starving jobs

    def __init__(self, path: str | os.PathLike, limit: int):
        if not 1 <= int(limit) <= SEM_MAX:
            raise ValueError(f"max_concurrency {limit} can't be shared through a semaphore (1..{SEM_MAX})")
        self.path = Path(path)
        self.limit = int(limit)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._registered = False
        self._starving = False
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.semid = self._attach()
        finally:
            os.close(fd)

    def _attach(self) -> int:
        try:
            rec = json.loads(self.path.read_text())
            semid = int(rec["semid"])
            if _c().semctl(semid, self.NSEMS - 1, _GETVAL) >= 0 and int(rec["limit"]) == self.limit:
                return semid
        except (OSError, ValueError, KeyError, TypeError):
            pass
        semid = _c().semget(0, self.NSEMS, _IPC_CREAT | 0o600)  # IPC_PRIVATE: a new set, found through the file
        if semid < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"semget: {os.strerror(err)}")
        _c().semctl(semid, 0, _SETVAL, ctypes.c_int(self.limit))
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"semid": semid, "limit": self.limit}))
        os.replace(tmp, self.path)
        return semid

    def try_take(self) -> bool:
        """Take one slot if one is free now; True if taken."""
        return _semop(self.semid, -1, _IPC_NOWAIT | _SEM_UNDO)

    def give(self, n: int = 1) -> None:
        """Return ``n`` slots."""
        if n > 0:
            _semop(self.semid, n, _SEM_UNDO)

    def free(self) -> int:
        """Slots free right now over all processes (-1 if the semaphore is gone)."""
        return _c().semctl(self.semid, 0, _GETVAL)

    def register(self, on: bool = True) -> None:
        """Count this process among the jobs using the slots (``on``) or not any more."""
        if on != self._registered:
            _semop(self.semid, 1 if on else -1, _SEM_UNDO | _IPC_NOWAIT, num=1)
            self._registered = on

    def starving(self, on: bool | None = None) -> int:
        """Mark this process as waiting for a slot (``on``) or not; return how many OTHER processes wait."""
        if on is not None and on != self._starving:
            _semop(self.semid, 1 if on else -1, _SEM_UNDO | _IPC_NOWAIT, num=2)
            self._starving = on
        return max(0, _c().semctl(self.semid, 2, _GETVAL) - (1 if self._starving else 0))

    def fair_share(self) -> int:
        """``ceil(limit / jobs using the slots)``: what a job may keep while others wait."""
        return math.ceil(self.limit / max(1, _c().semctl(self.semid, 1, _GETVAL)))

    @staticmethod
    def remove_all(folder: str | os.PathLike) -> int:
        """Remove the semaphores recorded under ``folder`` (end of run); return how many."""
        n = 0
        for p in Path(folder).glob("*.sem") if Path(folder).is_dir() else []:
            try:
                semid = int(json.loads(p.read_text())["semid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if _c().semctl(semid, 0, _IPC_RMID) == 0:
                n += 1
        return n


def jobs_using(config: dict, backend: str) -> int:
    """Generate jobs that use ``backend``: the shards of every generated dataset whose backends name it."""
    from ..config import generated_datasets, generation_config

    return sum(int(config["datasets"][ds].get("shards", 1)) for ds in generated_datasets(config)
               if backend in (generation_config(config, ds).get("backends") or []))


def sharing_mode(run, env: dict | None = None) -> str:
    """``host`` inside a workflow run on the run's machine, else ``job``; ``EAGLE3_CONCURRENCY=split`` (which the
    Snakefile sets in cluster jobs) or ``job`` overrides (see the module docstring)."""
    env = os.environ if env is None else env
    forced = (env.get("EAGLE3_CONCURRENCY") or "").strip().lower()
    if forced in ("split", "job"):
        return forced
    return "host" if run is not None else "job"


def job_limit(max_concurrency: int, mode: str, n_jobs: int = 1) -> int:
    """This job's own cap on requests in flight to a backend: the whole limit (``host``: the semaphore bounds the
    jobs together; ``job``), or ``ceil(limit / n_jobs)`` (``split``)."""
    if mode == "split":
        return max(1, math.ceil(int(max_concurrency) / max(1, int(n_jobs))))
    return int(max_concurrency)


def host_slots(run, backend: str, limit: int) -> HostSlots:
    """The run's shared slots of ``backend`` on this machine."""
    import socket

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in backend)
    return HostSlots(Path(run.limits_dir) / f"{socket.gethostname()}.{safe}.sem", limit)
