"""The workflow run: state shared by the jobs of one ``snakemake`` invocation on one machine, and its end.

The Snakefile calls :func:`begin` when it is parsed in the main ``snakemake`` process: the run is named after that
process (host, pid, start time) and its directory ``<cache_dir>/runs/<host>/<pid>-<start>/`` is passed to every job
through the environment (``EAGLE3_RUN_DIR``, ``EAGLE3_RUN_OWNER``), never through rule ``params`` (so nothing
reruns because of it). Jobs keep there what the run shares:

- ``servers/``: the registry of launched servers (:func:`eagle3_data.backends.server.shared_server`): one per
  launched backend for the whole run, attached to by every generate job that needs it.

A backend's request slots are not the run's: they are shared by every run and job on the machine
(:mod:`eagle3_data.backends.limits`), and neither a run's start nor its end touches them.

The Snakefile's ``onsuccess`` / ``onerror`` hooks call :func:`end`: it stops the run's servers, prints one line
for an interrupted run (Ctrl-C, SIGTERM) saying how to resume, and removes the run directory. Snakemake calls
``onerror`` after Ctrl-C and SIGTERM too; if the ``snakemake`` process itself is killed (SIGKILL), each server's
supervisor sees its owner gone and stops the server within a second. A job on another host than the main process
(a cluster job) is not part of the machine-local run: :func:`current` returns None there, and the job starts its
own server and splits the request limit (see :mod:`eagle3_data.backends.limits`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .processes import Owner, process_start  # noqa: F401 (process_start: part of this module's API)

RUN_DIR_ENV = "EAGLE3_RUN_DIR"
RUN_OWNER_ENV = "EAGLE3_RUN_OWNER"

_signals: dict[str, bool] = {}  # main process: which interrupt ended the run ("SIGINT" / "SIGTERM")
_started: list[float] = []  # main process: time.monotonic() when the run began


@dataclass(frozen=True)
class Run:
    """A workflow run as seen from one of its jobs: its directory and the process it lives for."""

    dir: Path
    owner: Owner

    @property
    def servers_dir(self) -> Path:
        return self.dir / "servers"


def current(env: dict | None = None) -> Run | None:
    """The run this process belongs to, from ``EAGLE3_RUN_DIR`` / ``EAGLE3_RUN_OWNER``; None outside a workflow run,
    or on another host than the run's main process (a cluster job)."""
    env = os.environ if env is None else env
    d, o = env.get(RUN_DIR_ENV), env.get(RUN_OWNER_ENV)
    owner = Owner.parse(o) if o else None
    if not d or owner is None or not owner.local():
        return None
    return Run(Path(d), owner)


def begin(cache_dir: str | os.PathLike, *, main_process: bool = True) -> Run | None:
    """Name the run after this (the main ``snakemake``) process and export it to the jobs; record Ctrl-C.

    Called by the Snakefile at parse time. In a job process (``main_process`` False: a cluster job or a spawned
    job re-parsing the Snakefile), an inherited run is kept as it is and nothing is installed. Creates nothing on
    disk (a dry run leaves no trace); the directory appears when a job needs it.
    """
    if not main_process:
        return current()
    owner = Owner.me()
    _started[:] = [time.monotonic()]
    run = Run(Path(cache_dir).resolve() / "runs" / owner.host / f"{owner.pid}-{owner.start}", owner)
    os.environ[RUN_DIR_ENV] = str(run.dir)
    os.environ[RUN_OWNER_ENV] = str(owner)
    _chain_signal(signal.SIGINT, "SIGINT")
    return run


def elapsed() -> float | None:
    """Seconds since :func:`begin` in this (the main ``snakemake``) process; None if it was not called."""
    return time.monotonic() - _started[0] if _started else None


def _chain_signal(sig: int, name: str) -> None:
    """Record that ``sig`` arrived, then do what was done before (raise KeyboardInterrupt, snakemake's handler)."""
    try:
        prev = signal.getsignal(sig)
    except ValueError:
        return
    if getattr(prev, "_eagle3_chained", False):
        return

    def handler(signum, frame):
        _signals[name] = True
        if callable(prev):
            return prev(signum, frame)
        if prev == signal.SIG_IGN:
            return None
        raise KeyboardInterrupt

    handler._eagle3_chained = True  # type: ignore[attr-defined]
    with contextlib.suppress(ValueError):  # not the main thread: nothing recorded, nothing changed
        signal.signal(sig, handler)


def on_start(cache_dir: str | os.PathLike) -> None:
    """Snakefile ``onstart``: record SIGTERM too (snakemake's own handler is installed by then) and remove the
    directories of earlier runs on this host whose ``snakemake`` process is gone (their servers stopped
    themselves). Request slots are left alone: they are the machine's, not a run's (:mod:`.backends.limits`)."""
    _chain_signal(signal.SIGTERM, "SIGTERM")
    root = Path(cache_dir) / "runs" / socket.gethostname()
    me = current()
    for d in root.glob("*-*") if root.is_dir() else []:
        pid, _, start = d.name.partition("-")
        if not pid.isdigit() or (me is not None and d.resolve() == me.dir.resolve()):
            continue
        if not Owner(socket.gethostname(), int(pid), start).alive():
            from .backends.server import stop_run_servers

            stop_run_servers(d)
            shutil.rmtree(d, ignore_errors=True)


def widen_local_workers(workflow, waiting_jobs: int) -> int | None:
    """Give Snakemake's local executor a worker for each of ``waiting_jobs`` jobs that wait without a core.

    The local executor runs each job in a thread of a pool of ``--cores`` + 5 workers (``snakemake/executors/
    local.py``: "Zero thread jobs do not need a thread, but they occupy additional workers"), so at most 5 jobs
    without threads run beside the CPU jobs, whatever resource allows more. A generate job takes no core but waits
    minutes on its longest requests (a 30K-token reasoning reply): with 5 at a time, the shards in their tails hold
    the workers while their backend's limit idles. Called from ``onstart`` (after the scheduler is made, before its
    first job), this replaces the executor's empty pool with one of ``--cores`` + 5 + ``waiting_jobs`` workers (the
    ``generate_jobs`` resource), so every shard can be in flight at once. Returns the new worker count, or None
    where nothing was changed (a cluster executor; a Snakemake whose executor has no such pool, which this names
    in a warning).
    """
    import concurrent.futures

    executor = getattr(getattr(workflow, "scheduler", None), "_executor", None)
    pool, workers = getattr(executor, "pool", None), getattr(executor, "workers", None)
    if getattr(workflow, "non_local_exec", False) or executor is None:
        return None
    if not isinstance(pool, concurrent.futures.ThreadPoolExecutor) or not isinstance(workers, int):
        print(f"Warning: Snakemake's local executor has no worker pool to widen ({type(executor).__name__}); "
              "at most --cores + 5 generate jobs run at once.", file=sys.stderr)
        return None
    cores = workflow.resource_settings.cores
    want = (cores if isinstance(cores, int) else 0) + 5 + max(0, int(waiting_jobs))
    if want > workers:
        executor.pool = concurrent.futures.ThreadPoolExecutor(max_workers=want)
        executor.workers = want
        pool.shutdown(wait=False)
    return max(want, workers)


def journaled_responses(journal_dir: str | os.PathLike) -> int:
    """Responses in the journals under ``journal_dir`` (complete lines of ``*.jsonl``; counted, not parsed)."""
    n = 0
    for p in Path(journal_dir).glob("*/*.jsonl"):
        with contextlib.suppress(OSError), open(p, "rb") as fh:
            while chunk := fh.read(1 << 20):
                n += chunk.count(b"\n")
    return n


def interrupt_message(journal_dir: str | os.PathLike, signame: str = "SIGINT") -> str:
    """The one line printed when a run is interrupted: what happened and how to resume."""
    what = "Interrupted (Ctrl-C)" if signame == "SIGINT" else f"Stopped ({signame})"
    n = journaled_responses(journal_dir)
    return (f"{what}. Rerun the same command to resume; {n:,} response{'s' if n != 1 else ''} are journaled in "
            f"{journal_dir}/ and will not be requested again.")


def end(cache_dir: str | os.PathLike, *, ok: bool, out=None) -> None:
    """Snakefile ``onsuccess`` / ``onerror``: stop the run's launched servers (waiting until they are gone), print
    one line if the run was interrupted, remove the run directory."""
    out = out or sys.stderr
    run = current()
    if run is not None and run.dir.exists():
        from .backends.server import stop_run_servers

        t0 = time.monotonic()
        stopped = stop_run_servers(run.dir)
        if stopped and ok:  # after a failure the run prints only what went wrong
            print(f"Stopped the launched server(s) {', '.join(stopped)} ({time.monotonic() - t0:.0f} s).", file=out)
        shutil.rmtree(run.dir, ignore_errors=True)
        for d in (run.dir.parent, run.dir.parent.parent):  # runs/<host>/, runs/: removed when empty
            with contextlib.suppress(OSError):
                d.rmdir()
    if not ok:
        sig = "SIGINT" if _signals.get("SIGINT") else "SIGTERM" if _signals.get("SIGTERM") else None
        if sig:
            print(interrupt_message(Path(cache_dir) / "journal", sig), file=out)
