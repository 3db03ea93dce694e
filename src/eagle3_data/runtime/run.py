"""The workflow run: state shared by the jobs of one ``snakemake`` invocation on one machine, and its end.

The Snakefile calls :func:`begin` when it is parsed in the main ``snakemake`` process: the run is named after that
process (host, pid, start time) and its directory ``<cache_dir>/runs/<host>/<pid>-<start>/`` is passed to every job
through the environment (``EAGLE3_RUN_DIR``, ``EAGLE3_RUN_OWNER``), never through rule ``params`` (so nothing
reruns because of it). Jobs keep there what the run shares:

- ``servers/``: the registry of launched servers (:func:`eagle3_data.backends.server.shared_server`): one per
  launched backend for the whole run, attached to by every generate job that needs it.

A backend's request slots are not the run's: they are shared by every run and job on the machine
(:mod:`eagle3_data.backends.limits`), and neither a run's start nor its end touches them.

The Snakefile's ``onsuccess`` / ``onerror`` hooks call :func:`end`: it stops the run's servers, removes the run
directory and, after a failed or interrupted run, leaves one line to be the run's last words (:func:`say_last`):
for an interrupted run (Ctrl-C, SIGTERM) how to resume, for a failed one the first job's error. Snakemake ends a
failed run with its own lines after the hook (the log file, the elapsed time, ``WorkflowError: At least one job
did not complete successfully``); that line is printed when the ``snakemake`` process exits, after them, and
Snakemake's ``WorkflowError`` line is left out (a filter on its logger: the run's last screen says the run
failed, and why). Snakemake calls
``onerror`` after Ctrl-C and SIGTERM too; if the ``snakemake`` process itself is killed (SIGKILL), each server's
supervisor sees its owner gone and stops the server within a second. A job on another host than the main process
(a cluster job) is not part of the machine-local run: :func:`current` returns None there, and the job starts its
own server and splits the request limit (see :mod:`eagle3_data.backends.limits`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
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
_stop_file: list[Path] = []  # main process: the run's stop file, written when SIGINT / SIGTERM arrives
STOP_FILE = "stop"  # in the run directory: its jobs stop starting requests (see :func:`stop_reason`)
OWNER_FILE = "owner.json"  # in the run directory: the snakemake process and its working directory
_started: list[float] = []  # main process: time.monotonic() when the run began
_last_words: list[str] = []  # main process: printed when the snakemake process exits (say_last)
_said: list[bool] = []  # say_last installed its exit hook and filter
#: Snakemake's closing error after a failed run (snakemake/workflow.py, raised after the onerror hook)
SNAKEMAKE_FAILED_JOBS = "At least one job did not complete successfully"


@dataclass(frozen=True)
class Run:
    """A workflow run as seen from one of its jobs: its directory and the process it lives for."""

    dir: Path
    owner: Owner

    @property
    def servers_dir(self) -> Path:
        return self.dir / "servers"

    @property
    def stop_file(self) -> Path:
        return self.dir / STOP_FILE


def stop_reason(run: "Run | None" = None) -> str | None:
    """Why the jobs of ``run`` (default: :func:`current`) must stop starting requests, or None.

    ``"snakemake got SIGTERM"`` (or SIGINT) when the run's stop file exists (written by the main process's signal
    handler, :func:`on_start`); ``"the snakemake process <pid> is gone"`` when the run's owner no longer runs (a
    ``kill -9``: its jobs would otherwise run on, re-parented to PID 1). Two small file-system checks: cheap
    enough to poll every half second. None outside a workflow run."""
    run = current() if run is None else run
    if run is None:
        return None
    try:
        text = run.stop_file.read_text().strip()
    except FileNotFoundError:
        text = None
    except OSError:
        text = "stop"
    if text is not None:
        return f"snakemake got {text.split()[0] if text else 'a stop signal'}"
    if not run.owner.alive():
        return f"the snakemake process {run.owner.pid} is gone"
    return None


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

    Called by the Snakefile's ``onstart`` (never at parse time: a dry run or ``--lint`` changes nothing). In a job
    process (``main_process`` False: a cluster job or a spawned job re-parsing the Snakefile), an inherited run is
    kept as it is and nothing is installed. Creates nothing on disk; the directory appears when a job needs it.
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
    """Record that ``sig`` arrived, then do what was done before (raise KeyboardInterrupt, snakemake's handler).
    A SIGINT after the run began stopping (a second Ctrl-C) is said to change nothing, once, and not passed on:
    snakemake would raise KeyboardInterrupt inside its own shutdown (tracebacks, no summary, the jobs killed
    before the replies in flight were journaled)."""
    try:
        prev = signal.getsignal(sig)
    except ValueError:
        return
    if getattr(prev, "_eagle3_chained", False):
        return

    def handler(signum, frame):
        if name == "SIGINT" and _signals:  # a second Ctrl-C while the run stops: the stop goes on, no traceback
            if not _signals.get("again"):
                _signals["again"] = True
                print(
                    "Already stopping: the replies in flight are paid for and get generation.stop_grace_s to arrive "
                    "and be journaled; the run then ends with its summary (Ctrl-C again changes nothing).",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        _signals[name] = True
        for path in _stop_file:  # the run's jobs see it within a second and stop starting requests
            with contextlib.suppress(OSError):
                path.write_text(f"{name} {time.time():.3f}\n")
        if callable(prev):
            return prev(signum, frame)
        if prev == signal.SIG_IGN:
            return None
        raise KeyboardInterrupt

    handler._eagle3_chained = True  # type: ignore[attr-defined]
    with contextlib.suppress(ValueError):  # not the main thread: nothing recorded, nothing changed
        signal.signal(sig, handler)


def on_start(cache_dir: str | os.PathLike) -> None:
    """Snakefile ``onstart``: make the run directory (with ``owner.json``: pid and working directory), record
    SIGTERM too (snakemake's own handler is installed by then), have SIGINT and SIGTERM write the run's stop file
    (its jobs stop starting requests, :func:`stop_reason`), and remove the directories of earlier runs on this
    host whose ``snakemake`` process is gone (their servers stopped themselves). Request slots are left alone:
    they are the machine's, not a run's (:mod:`.backends.limits`)."""
    me = current()
    if me is not None:
        with contextlib.suppress(OSError):
            me.dir.mkdir(parents=True, exist_ok=True)
            (me.dir / OWNER_FILE).write_text(
                json.dumps({"pid": me.owner.pid, "start": me.owner.start, "workdir": os.getcwd()})
            )
            _stop_file[:] = [me.stop_file]
    _chain_signal(signal.SIGTERM, "SIGTERM")
    _chain_signal(signal.SIGINT, "SIGINT")
    root = Path(cache_dir) / "runs" / socket.gethostname()
    for d in root.glob("*-*") if root.is_dir() else []:
        pid, _, start = d.name.partition("-")
        if not pid.isdigit() or (me is not None and d.resolve() == me.dir.resolve()):
            continue
        if not Owner(socket.gethostname(), int(pid), start).alive():
            from ..backends.server import stop_run_servers

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
    where nothing was changed (a cluster executor; a Snakemake whose scheduler, executor or pool is not where this
    looks, which this names in a warning).

    Snakemake 9 has no supported setting for this: the worker count is ``--cores`` + 5 (``--max-threads``, the
    local executor's settings and resources do not change it; a group job only widens the pool for its own size)
    and the executor plugin interface would mean re-implementing the local executor. So the patch stays, pinned by
    ``tests/test_generate_runtime.py::test_jobs_without_threads_get_a_worker_per_generate_seat``: it fails the day a
    Snakemake release moves the pool (this returns None, with the warning) or stops honouring the widened one (fewer
    jobs run at once), and the day Snakemake itself gives zero-thread jobs more workers (the patch can go).
    """
    import concurrent.futures

    if getattr(workflow, "non_local_exec", False):
        return None
    executor = getattr(getattr(workflow, "scheduler", None), "_executor", None)
    pool, workers = getattr(executor, "pool", None), getattr(executor, "workers", None)
    if not isinstance(pool, concurrent.futures.ThreadPoolExecutor) or not isinstance(workers, int):
        print(
            f"Warning: Snakemake's local executor has no worker pool to widen ({type(executor).__name__}); "
            "at most --cores + 5 generate jobs run at once.",
            file=sys.stderr,
        )
        return None
    cores = workflow.resource_settings.cores
    want = (cores if isinstance(cores, int) else 0) + 5 + max(0, int(waiting_jobs))
    if want > workers:
        executor.pool = concurrent.futures.ThreadPoolExecutor(max_workers=want)
        executor.workers = want
        pool.shutdown(wait=False)
    return max(want, workers)


def journaled_responses(journal_dir: str | os.PathLike, datasets=None) -> int:
    """Responses in the journals under ``journal_dir`` (complete lines of ``*.jsonl``; counted, not parsed);
    ``datasets``: only those datasets' journals."""
    n = 0
    folders = [Path(journal_dir) / d for d in datasets] if datasets is not None else [Path(journal_dir)]
    for p in (p for f in folders for p in f.glob("*.jsonl" if datasets is not None else "*/*.jsonl")):
        with contextlib.suppress(OSError), open(p, "rb") as fh:
            while chunk := fh.read(1 << 20):
                n += chunk.count(b"\n")
    return n


def interrupt_message(journal_dir: str | os.PathLike, signame: str = "SIGINT", journaled: int | None = None) -> str:
    """The one line printed when a run is interrupted: what happened and how to resume.

    ``journaled``: this config's requests with a journaled response (the run's jobs count them by request key,
    :mod:`eagle3_data.runtime.runview`); None: every line of the journals under ``journal_dir``."""
    what = "Interrupted (Ctrl-C)" if signame == "SIGINT" else f"Stopped ({signame})"
    n = journaled_responses(journal_dir) if journaled is None else journaled
    return (
        f"{what}. Rerun the same command to resume; {n:,} response{'s' if n != 1 else ''} of this config "
        f"{'are' if n != 1 else 'is'} journaled in {journal_dir}/ and will not be requested again."
    )


def stale_lock_hint(cache_dir: str | os.PathLike, workdir: str | os.PathLike = ".") -> str | None:
    """One line when Snakemake's lock on ``workdir`` was left by a run whose ``snakemake`` process was killed
    (``kill -9``, a lost node): the lock files exist, a run of this host for this directory is recorded under
    ``<cache_dir>/runs/`` and its process is gone, and no such run is alive. None otherwise."""
    locks = Path(workdir) / ".snakemake" / "locks"
    if not locks.is_dir() or not any(locks.iterdir()):
        return None
    here = os.path.realpath(workdir)
    dead = []
    root = Path(cache_dir) / "runs" / socket.gethostname()
    for d in sorted(root.glob("*-*")) if root.is_dir() else []:
        try:
            info = json.loads((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if os.path.realpath(str(info.get("workdir", ""))) != here:
            continue
        if Owner(socket.gethostname(), int(info["pid"]), str(info["start"])).alive():
            return None  # a live run holds the lock
        dead.append(int(info["pid"]))
    if not dead:
        return None
    return (
        f"The snakemake run {dead[-1]} was killed and left its lock on this directory: run `snakemake --unlock` "
        "(with the same --configfile, if any), then the same command again to resume."
    )


#: command-line options of ``snakemake`` modes that take no lock (snakemake/workflow.py: ``lock_warn_only``, a dry
#: run, ``--nolock``) or only look at the workflow: a stale lock does not stop them, so its hint is only printed
NO_LOCK_OPTIONS = frozenset(
    {
        "--unlock",
        "--nolock",
        "-n",
        "--dry-run",
        "--dryrun",
        "--lint",
        "-S",
        "--summary",
        "-D",
        "--detailed-summary",
        "--lc",
        "--li",
        "--lp",
        "--list-changes",
        "--list-code-changes",
        "--list-input-changes",
        "--list-params-changes",
        "--lu",
        "--list-untracked",
        "--dag",
        "--rulegraph",
        "--filegraph",
        "--d3dag",
        "--delete-all-output",
        "--delete-temp-output",
        "--archive",
        "-l",
        "--list",
        "--list-rules",
        "--lt",
        "--list-target-rules",
        "--print-compilation",
        "-h",
        "--help",
        "--version",
        "-v",
    }
)


def stale_lock_stops(argv) -> bool:
    """Whether a ``snakemake`` command line (``sys.argv``) takes Snakemake's lock, so that a lock a killed run left
    (:func:`stale_lock_hint`) would stop it: anything but the modes of :data:`NO_LOCK_OPTIONS`. Such a command
    stops while the Snakefile is read, its hint the only thing it prints (Snakemake would otherwise print its
    banner and build the DAG, then end with its ``LockException``, the hint lost above them)."""
    return not any(str(a).split("=", 1)[0] in NO_LOCK_OPTIONS for a in list(argv)[1:])


def stop_summary(datasets=None) -> dict:
    """Main process: what this run's jobs journaled, from their snapshots (:mod:`eagle3_data.runtime.runview`):
    ``{"journaled": requests answered, "shards": snapshots read}``; ``datasets``: only those."""
    run = current()
    if run is None:
        return {"journaled": None, "shards": 0}
    from .runview import read_snapshots

    snaps = [s for (ds, _), s in read_snapshots(run.dir).items() if datasets is None or ds in datasets]
    return {"journaled": sum(int(s.get("journaled") or 0) for s in snaps) if snaps else None, "shards": len(snaps)}


class _DropFailedJobsError(logging.Filter):
    """Leaves out Snakemake's closing ``WorkflowError: At least one job did not complete successfully.``"""

    def filter(self, record: logging.LogRecord) -> bool:
        with contextlib.suppress(Exception):
            return SNAKEMAKE_FAILED_JOBS not in record.getMessage()
        return True


def _print_last_words(out=None) -> None:
    out = out or sys.stderr
    with contextlib.suppress(Exception):
        for text in _last_words:
            print(text, file=out)
        out.flush()
    _last_words.clear()


def say_last(text: str) -> None:
    """Main process: print ``text`` as the run's last line, when the ``snakemake`` process exits (``atexit``): after
    the lines Snakemake prints once the ``onerror`` hook returned, whose ``WorkflowError: At least one job did not
    complete successfully`` is then left out (a filter on Snakemake's logger, ``snakemake.logging``)."""
    if not _said:
        _said.append(True)
        atexit.register(_print_last_words)
        logging.getLogger("snakemake.logging").addFilter(_DropFailedJobsError())
    _last_words.append(text)


def failure_line(logs_dir="logs", since: float | None = None) -> str | None:
    """The last line of a failed run: the first failed job's one-line error (its log), and how many more the last
    screen lists; None when no job log has one (:func:`eagle3_data.report.summary.failure_causes`)."""
    from ..report.summary import failure_causes

    causes = failure_causes(logs_dir, since, limit=1)
    if not causes:
        return None
    more = " (and the others above, under Why)" if len(causes) > 1 else ""
    return f"The run failed: {causes[0]}{more}"


def end(cache_dir: str | os.PathLike, *, ok: bool, out=None, datasets=None, logs_dir="logs") -> None:
    """Snakefile ``onsuccess`` / ``onerror``: stop the run's launched servers (waiting until they are gone), remove
    the run directory and, after a failure, leave the run's last line (:func:`say_last`): for an interrupted run how
    to resume (counting the journaled responses of ``datasets``, this config's), else the first failed job's error
    (:func:`failure_line`, from the job logs under ``logs_dir``). ``out``: print that line there at once instead
    (tests)."""
    say = (lambda text: print(text, file=out)) if out is not None else say_last
    out = out or sys.stderr
    run = current()
    from .runview import stop as stop_view

    stop_view()
    counted = stop_summary(datasets) if not ok else {"journaled": None}
    if run is not None and run.dir.exists():
        from ..backends.server import stop_run_servers

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
            journaled = counted["journaled"]
            if journaled is None and datasets is not None:
                journaled = journaled_responses(Path(cache_dir) / "journal", datasets)
            say(interrupt_message(Path(cache_dir) / "journal", sig, journaled))
        else:
            took = elapsed()
            line = failure_line(logs_dir, None if took is None else time.time() - took - 1)
            if line:
                say(line)


async def watch_stop(on_stop, *, run: "Run | None" = None, interval_s: float = 0.5) -> None:
    """Until cancelled, check :func:`stop_reason` of ``run`` (default :func:`current`) every ``interval_s``; when it
    gives a reason, call ``on_stop(reason)`` once and return. Returns at once outside a workflow run.

    A generate job runs it beside its requests: it must stop starting requests when the run is stopped (a signal
    to the ``snakemake`` process, which writes the stop file) or its ``snakemake`` process is gone (``kill -9``)."""
    import asyncio

    run = current() if run is None else run
    if run is None:
        return
    while True:
        reason = stop_reason(run)
        if reason:
            on_stop(reason)
            return
        await asyncio.sleep(interval_s)
