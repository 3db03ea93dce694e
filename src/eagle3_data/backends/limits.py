"""Request slots shared by the generate jobs on a machine: a backend's ``max_concurrency`` holds across all of them.

Every shard of every dataset on a backend can be in flight at once; what bounds them together is the backend's
limit, not one job's share of it. How the limit is shared depends on where the jobs run (:func:`job_limit`):

- ``host`` (the jobs of a workflow run on one machine, :mod:`eagle3_data.runtime.run`): one counting semaphore per backend
  and machine, a System V semaphore set made with the backend's ``max_concurrency`` (:class:`HostSlots`) and
  named by the backend's identity (:func:`backend_identity`: its base URL, model and API key variable), not by
  the run: every run of the user on the machine, in one workdir or several, shares it, so runs together never
  exceed the limit. It is recorded under :func:`limits_dir` (``$EAGLE3_LIMITS_DIR``, else
  ``<tmp>/eagle3-data-<uid>/limits``). A job takes a slot for each request it sends (``semop -1``, never
  blocking; a job that finds none marks itself waiting and polls) and, when the request ends, keeps the slot for
  its own next request while it has requests waiting and holds no more than its fair share (``limit / jobs``) or
  nobody else waits; otherwise it gives the slot back. A waiter that gets a slot wakes the next one, so the slots
  other jobs give back are taken by every waiter. So the slots follow the demand: the backend stays at its limit
  until the last tail, and every job gets its share while others run. Every operation is ``SEM_UNDO``: the kernel
  returns the slots of a job that dies, however it dies, so a killed run leaves nothing that holds slots; the last
  job out removes the set, and nothing else does (a run's start or end never touches them, so the jobs a killed
  ``snakemake`` left running go on within the limit).
- ``split`` (a cluster job: the Snakefile sets ``EAGLE3_CONCURRENCY=split`` in jobs a cluster executor runs): the
  limit is split evenly over the generate jobs that use the backend (the shards of every dataset naming it), so
  that all of them may run at once, on any nodes, without exceeding it together.
- ``job`` (the Python API outside a run): the job alone has the whole limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

logger = logging.getLogger("eagle3_data.backends")

_IPC_CREAT, _IPC_EXCL, _IPC_NOWAIT, _SEM_UNDO = 0o1000, 0o2000, 0o4000, 0x1000
_IPC_RMID, _GETVAL, _SETVAL = 0, 12, 16
SEM_MAX = 32767  # SEMVMX: the largest value a System V semaphore holds
LIMITS_DIR_ENV = "EAGLE3_LIMITS_DIR"


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
    """``limit`` request slots of one backend, shared by every process of this user on this machine: a System V
    semaphore set found through its key (derived from ``path``: see :func:`sem_key`), set up under a ``flock`` of
    ``path``'s ``.lock`` file by the first job that needs it; ``path`` itself (a small JSON file) records the set's
    key, id, limit and what it is for, for people. Its four values: the free slots, the jobs using the slots
    (:meth:`register`), the jobs waiting for a slot (:meth:`starving`), the limit the set was made with.

    A process is registered from construction until ``register(False)``; the last one out removes the set (under the
    lock, so nobody attaches meanwhile); a set whose users all died (SIGKILL: the kernel undoes their counts) is
    taken over by the next job. Where a set is in use with another limit (another config of the same backend),
    the limit already in force stays, with a warning. ``try_take()`` takes a slot if one is free (never blocks);
    ``give()`` returns slots. Every operation is ``SEM_UNDO``: what a process that exits without undoing it took or
    counted is undone by the kernel. A set removed under a process (``ipcrm``, an older release's end of run) is
    attached again, with the slots this process holds taken from the new set (those it cannot take are owed:
    the next ones it gives back stay taken), so its requests never fail for it.

    Raises ValueError for ``limit`` outside ``1..32767`` (SEMVMX); OSError if the lock file can't be made or the
    kernel refuses a semaphore set (``semget``: the system's limit on sets).
    """

    NSEMS = 4  # free slots, registered jobs, starving jobs, the limit

    def __init__(self, path: str | os.PathLike, limit: int, *, name: str | None = None, about: dict | None = None):
        if not 1 <= int(limit) <= SEM_MAX:
            raise ValueError(f"max_concurrency {limit} can't be shared through a semaphore (1..{SEM_MAX})")
        self.path = Path(path)
        self.asked = int(limit)
        self.limit = int(limit)
        self.name = name or self.path.stem
        self.about = dict(about or {})
        self.key = sem_key(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._registered = False
        self._starving = False
        self._held = 0  # slots this process took and has not given back
        self._owed = 0  # slots it could not take again from a set made anew under it
        self.semid = -1
        self._lock_depth = 0
        self.register(True)

    @contextlib.contextmanager
    def _locked(self):
        """The set's ``flock`` (re-entrant in this process: a second ``flock`` of the file would wait on the first)."""
        if self._lock_depth:
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_depth = 1
            yield
        finally:
            self._lock_depth = 0
            os.close(fd)

    def _attach(self) -> None:
        """Find or make the set (under the lock); set ``semid`` and ``limit``. A set nobody uses is (re)set to this
        job's limit."""
        c = _c()
        semid = c.semget(self.key, self.NSEMS, 0o600)
        if semid < 0:
            semid = c.semget(self.key, self.NSEMS, _IPC_CREAT | _IPC_EXCL | 0o600)
            if semid < 0:
                err = ctypes.get_errno()
                raise OSError(
                    err, f"semget for the request slots of backend {self.name} (key {self.key:#x}): {os.strerror(err)}"
                )
        users, limit = c.semctl(semid, 1, _GETVAL), c.semctl(semid, 3, _GETVAL)
        if users <= 0 or limit < 1:  # new, or left by jobs that are all gone: this job's limit from now on
            for num, value in ((0, self.asked), (2, 0), (3, self.asked)):
                c.semctl(semid, num, _SETVAL, ctypes.c_int(value))
            limit = self.asked
        elif limit != self.asked:
            logger.warning(
                "backend %s: max_concurrency is %d in this config, but %d already holds on this machine "
                "(jobs of another config of the same backend are running); using %d",
                self.name,
                self.asked,
                limit,
                limit,
            )
        self.semid, self.limit = semid, limit
        rec = {"key": self.key, "semid": semid, "limit": limit, **self.about}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, self.path)

    def _op(self, op: int, flags: int, num: int = 0) -> bool:
        """``semop``; a set removed under this process is attached again and the operation retried."""
        for _ in range(3):
            try:
                return _semop(self.semid, op, flags, num)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EIDRM):
                    raise
            self._reattach()
        return _semop(self.semid, op, flags, num)

    def _reattach(self) -> None:
        logger.warning(
            "backend %s: the machine's request slots were removed under this job; attaching again", self.name
        )
        with self._locked():
            self._attach()
            _semop(self.semid, 1, _SEM_UNDO | _IPC_NOWAIT, num=1)
            self._registered = True
            if self._starving:
                _semop(self.semid, 1, _SEM_UNDO | _IPC_NOWAIT, num=2)
            held, self._held = self._held, 0
            while held and _semop(self.semid, -1, _IPC_NOWAIT | _SEM_UNDO):
                self._held += 1
                held -= 1
            self._owed += held

    def _get(self, num: int) -> int:
        v = _c().semctl(self.semid, num, _GETVAL)
        if v < 0 and self._registered:
            self._reattach()
            v = _c().semctl(self.semid, num, _GETVAL)
        return v

    def try_take(self) -> bool:
        """Take one slot if one is free now; True if taken."""
        if self._op(-1, _IPC_NOWAIT | _SEM_UNDO):
            self._held += 1
            return True
        return False

    def give(self, n: int = 1) -> None:
        """Return ``n`` slots (those owed to a set made anew stay taken)."""
        paid = min(n, self._owed)
        self._owed -= paid
        n -= paid
        if n > 0:
            self._op(n, _SEM_UNDO)
            self._held = max(0, self._held - n)

    def free(self) -> int:
        """Slots free right now over all processes (-1 if the semaphore set is gone)."""
        return _c().semctl(self.semid, 0, _GETVAL)

    def users(self) -> int:
        """Processes registered on the slots now (-1 if the set is gone)."""
        return _c().semctl(self.semid, 1, _GETVAL)

    def register(self, on: bool = True) -> None:
        """Count this process among the jobs using the slots (``on``: attaches to the set, making it if need be)
        or not any more (``off``: gives back what it holds; the last one out removes the set)."""
        if on == self._registered:
            return
        with self._locked():
            if on:
                self._attach()
                _semop(self.semid, 1, _SEM_UNDO | _IPC_NOWAIT, num=1)
                self._registered = True
                return
            if self._starving:
                self.starving(False)
            if self._held:
                self.give(self._held)
            self._owed = 0
            try:
                _semop(self.semid, -1, _SEM_UNDO | _IPC_NOWAIT, num=1)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EIDRM):
                    raise
            self._registered = False
            if _c().semctl(self.semid, 1, _GETVAL) == 0 and _c().semctl(self.semid, 0, _IPC_RMID) == 0:
                with contextlib.suppress(OSError):
                    self.path.unlink()

    def starving(self, on: bool | None = None) -> int:
        """Mark this process as waiting for a slot (``on``) or not; return how many OTHER processes wait."""
        if on is not None and on != self._starving:
            self._op(1 if on else -1, _SEM_UNDO | _IPC_NOWAIT, num=2)
            self._starving = on
        return max(0, self._get(2) - (1 if self._starving else 0))

    def fair_share(self) -> int:
        """``ceil(limit / jobs using the slots)``: what a job may keep while others wait."""
        return math.ceil(self.limit / max(1, self._get(1)))

    @staticmethod
    def remove_all(folder: str | os.PathLike) -> int:
        """Remove the semaphore sets recorded under ``folder`` whatever uses them (tests' clean-up; a run never
        calls it); return how many."""
        n = 0
        for p in Path(folder).glob("*.sem") if Path(folder).is_dir() else []:
            semid = _c().semget(sem_key(p), HostSlots.NSEMS, 0o600)
            if semid >= 0 and _c().semctl(semid, 0, _IPC_RMID) == 0:
                n += 1
        return n


def sem_key(path: str | os.PathLike) -> int:
    """The System V key of the slots recorded at ``path``: 31 bits of SHA-256 of the user id and the resolved path
    (a limits directory of its own, as tests use, has sets of its own). Never ``IPC_PRIVATE`` (0)."""
    h = hashlib.sha256(f"eagle3-data:{os.getuid()}:{Path(path).resolve()}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF or 1


def limits_dir(env: dict | None = None) -> Path:
    """Where this machine's request slots are recorded: ``$EAGLE3_LIMITS_DIR``, else
    ``<tmp>/eagle3-data-<uid>/limits`` (one per user: every run and workdir of the user on this machine shares it)."""
    env = os.environ if env is None else env
    d = env.get(LIMITS_DIR_ENV)
    return Path(d) if d else Path(tempfile.gettempdir()) / f"eagle3-data-{os.getuid()}" / "limits"


def backend_identity(cfg) -> str:
    """What names a backend on this machine, whatever config or workdir it comes from: a hash (16 hex digits) of its
    base URL (without a trailing ``/``), model and API key variable name (the name, never the key)."""
    text = "\n".join([str(cfg.base_url).rstrip("/"), str(cfg.model), str(cfg.api_key_env or "")])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def jobs_using(config: dict, backend: str) -> int:
    """Generate jobs that use ``backend``: the shards of every generated dataset whose backends name it."""
    from ..config import dataset_shards, generated_datasets, generation_config

    return sum(
        dataset_shards(config, ds)
        for ds in generated_datasets(config)
        if backend in (generation_config(config, ds).get("backends") or [])
    )


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


def host_slots(cfg, env: dict | None = None) -> HostSlots:
    """This machine's shared slots of the backend ``cfg`` (a :class:`.client.BackendConfig`: its name, base URL,
    model, API key variable and ``max_concurrency``): ``<limits_dir>/<backend_identity>.sem``."""
    d = limits_dir(env)
    given = LIMITS_DIR_ENV in (os.environ if env is None else env)
    try:
        if not given:  # the default: a directory only this user reads
            d.parent.mkdir(mode=0o700, exist_ok=True)
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from .errors import FatalBackendError

        where = f"{LIMITS_DIR_ENV}={d}" if given else str(d)
        why = (
            "names a file, not a directory"
            if isinstance(exc, (FileExistsError, NotADirectoryError))
            else (exc.strerror or str(exc))
        )
        raise FatalBackendError(
            f"the shared request slots can't be kept in {where}: it {why}"
            if isinstance(exc, (FileExistsError, NotADirectoryError))
            else f"the shared request slots can't be kept in {where}: {why}",
            hint=(f"point {LIMITS_DIR_ENV} at a directory (or unset it)" if given else "make it writable")
            + ", then rerun the same command",
        ) from None
    about = {"backend": cfg.name, "base_url": cfg.base_url, "model": cfg.model, "api_key_env": cfg.api_key_env}
    return HostSlots(d / f"{backend_identity(cfg)}.sem", cfg.max_concurrency, name=cfg.name, about=about)
