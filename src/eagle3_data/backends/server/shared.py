"""Workflow-scoped servers: one per launched backend for a whole run (registry, leases, the supervisor process
that stops it at the run's end or when idle); see :mod:`eagle3_data.backends.server`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .process import ServerLaunchError, popen, prepared, ready_url, stop_group, log_tail, wait_ready, server_env

logger = logging.getLogger("eagle3_data.server")

DEFAULT_IDLE_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------------------------------------------
# workflow-scoped servers: registry, leases, supervisor


@dataclass
class SharedServer:
    """A workflow-scoped server a job is attached to: ``port``, ``devices`` (its ``CUDA_VISIBLE_DEVICES``),
    whether this job ``started`` it, its supervisor's ``pid`` and ``log_path``."""

    name: str
    port: int
    devices: list[str]
    started: bool
    pid: int
    log_path: Path


def registry_key(name: str, launch: dict, model: str) -> str:
    """``<backend>-<hash of launch + model>``: a changed launch config means another server."""
    h = hashlib.blake2b(json.dumps([launch, model], sort_keys=True, default=str).encode(), digest_size=4).hexdigest()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{safe}-{h}"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _pid_alive(pid: int | None, start: str | None = None) -> bool:
    from ...runtime.processes import process_start

    if not pid:
        return False
    s = process_start(int(pid))
    return s is not None and (start is None or s == start)


@contextlib.contextmanager
def _flock(path: Path, kind: int, *, blocking: bool = True) -> Iterator[bool]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, kind | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def shared_server(
    launch: dict, model: str, *, name: str, run, log_path: str | os.PathLike, wait_log_s: float = 10.0
) -> Iterator[SharedServer]:
    """Attach to the run's server for this backend, starting it if it is not running; yield it while holding a lease.

    Concurrent callers (generate jobs) serialise on the registry lock: the first starts the server (through a
    supervisor process, :func:`supervise`) and waits until it is ready, the others then attach to it. The lease
    (a shared ``flock``, dropped by the kernel when the job dies) tells the supervisor the server is in use.

    Raises :class:`ServerLaunchError` when the server fails to start (the supervisor's reason, with the log tail).
    """
    reg = Path(run.servers_dir)
    reg.mkdir(parents=True, exist_ok=True)
    key = registry_key(name, launch, model)
    entry_path, lock_path, lease_path = reg / f"{key}.json", reg / f"{key}.lock", reg / f"{key}.lease"
    log_path = Path(log_path)
    started = False
    t_wait = time.monotonic()
    logged = False
    while True:
        stopping = False
        with _flock(lock_path, fcntl.LOCK_EX):
            if time.monotonic() - t_wait > wait_log_s and not logged:
                logged = True
                logger.info("backend %s: waited %.0f s for the server registry", name, time.monotonic() - t_wait)
            entry = _read_json(entry_path)
            if (
                entry
                and entry.get("state") == "stopping"
                and _pid_alive(entry.get("supervisor_pid"), entry.get("supervisor_start"))
            ):
                stopping = True  # being stopped (idle): wait, without the lock, for it to be gone, then start anew
            elif not (
                entry
                and entry.get("state") in ("starting", "ready")
                and _pid_alive(entry.get("supervisor_pid"), entry.get("supervisor_start"))
            ):
                port, argv = prepared(launch, model, name)
                log_path.parent.mkdir(parents=True, exist_ok=True)
                # the environment goes to the supervisor's process, not into the spec file (it may hold API keys)
                spec = {
                    "name": name,
                    "argv": argv,
                    "port": port,
                    "url": ready_url(launch, port),
                    "ready_timeout_s": float(launch.get("ready_timeout_s") or 300),
                    "stop_grace_s": float(launch.get("stop_grace_s") or 20),
                    "gpus": int(launch.get("gpus") or 0),
                    "idle_timeout_s": float(launch.get("idle_timeout_s") or DEFAULT_IDLE_TIMEOUT_S),
                    "owner": str(run.owner),
                    "entry": str(entry_path),
                    "lock": str(lock_path),
                    "lease": str(lease_path),
                    "log": str(log_path.absolute()),
                }
                spec_path = reg / f"{key}.spec.json"
                _write_json(spec_path, spec)
                entry_path.unlink(missing_ok=True)
                logger.info(
                    "starting local server %s on 127.0.0.1:%d for this run (log: %s): %s",
                    name,
                    port,
                    log_path,
                    shlex.join(argv),
                )
                with open(log_path, "ab") as logf:
                    sup = subprocess.Popen(
                        [sys.executable, "-c", _SUPERVISOR, "supervise", str(spec_path)],
                        stdin=subprocess.DEVNULL,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=server_env(launch),
                    )
                started = True
                entry = None
                while True:  # wait for the supervisor's verdict, holding the lock: other jobs attach afterwards
                    entry = _read_json(entry_path)
                    if entry and entry.get("supervisor_pid") == sup.pid and entry.get("state") in ("ready", "failed"):
                        break
                    if sup.poll() is not None:
                        entry = _read_json(entry_path) or {}
                        if entry.get("state") != "ready":
                            entry = {
                                "state": "failed",
                                "error": entry.get("error")
                                or (
                                    f"local server {name}: its supervisor exited with code {sup.returncode}; last "
                                    f"lines of {log_path}:\n{log_tail(log_path)}"
                                ),
                            }
                        break
                    time.sleep(0.2)
                if entry.get("state") != "ready":
                    raise ServerLaunchError(entry.get("error") or f"local server {name} did not start")
                logger.info(
                    "local server %s ready in %.1f s (pid %s%s)",
                    name,
                    entry.get("ready_s", 0.0),
                    entry.get("server_pid"),
                    f", GPUs {','.join(entry['devices'])}" if entry.get("devices") else "",
                )
            else:
                while entry.get("state") == "starting":  # its starter died while waiting: wait here instead
                    time.sleep(0.2)
                    entry = _read_json(entry_path) or {"state": "failed"}
                    if not _pid_alive(entry.get("supervisor_pid"), entry.get("supervisor_start")):
                        entry = {"state": "failed", "error": f"local server {name}: its supervisor is gone"}
                if entry.get("state") != "ready":
                    raise ServerLaunchError(entry.get("error") or f"local server {name} did not start")
                logger.info(
                    "backend %s: attached to the run's local server on port %d (pid %s)",
                    name,
                    entry["port"],
                    entry.get("server_pid"),
                )
            if not stopping:
                lease = os.open(lease_path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(lease, fcntl.LOCK_SH)
                break
        time.sleep(0.2)
    try:
        yield SharedServer(
            name,
            int(entry["port"]),
            list(entry.get("devices") or []),
            started,
            int(entry["supervisor_pid"]),
            Path(entry.get("log") or log_path),
        )
    finally:
        os.close(lease)


_SUPERVISOR = "import sys; from eagle3_data.backends.server import main; sys.exit(main())"


def stop_run_servers(run_dir: str | os.PathLike, timeout_s: float = 60.0) -> list[str]:
    """Stop every server of a run (SIGTERM to each supervisor, which stops its server group) and wait until they
    are gone; return the backend names stopped. Used by the end-of-run hook."""
    reg = Path(run_dir) / "servers"
    stopped, waiting = [], []
    for p in sorted(reg.glob("*.json")) if reg.is_dir() else []:
        if p.name.endswith(".spec.json"):
            continue
        e = _read_json(p) or {}
        pid, start = e.get("supervisor_pid"), e.get("supervisor_start")
        if _pid_alive(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGTERM)
            waiting.append((e, p))
    t0 = time.monotonic()
    for e, p in waiting:
        grace = float(e.get("stop_grace_s") or 20)
        while _pid_alive(e.get("supervisor_pid"), e.get("supervisor_start")) and time.monotonic() - t0 < max(
            timeout_s, grace + 15
        ):
            time.sleep(0.1)
        if _pid_alive(e.get("supervisor_pid"), e.get("supervisor_start")):  # a wedged supervisor: kill both groups
            for pid in (e.get("server_pid"), e.get("supervisor_pid")):
                with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                    os.killpg(int(pid), signal.SIGKILL)
        stopped.append(e.get("name") or p.stem)
    return stopped


def supervise(spec_path: str | os.PathLike, poll_s: float = 0.5) -> int:
    """The supervisor of one workflow-scoped server (``main(["supervise", SPEC])``, run by :func:`shared_server`).

    The server gets this process's environment (prepared by :func:`shared_server` with :func:`server_env`). Holds
    the server's GPUs (device locks), starts it, writes the registry entry (``starting`` -> ``ready`` or
    ``failed`` with the reason), then stops the server when: it receives SIGTERM/SIGINT (end of run), the run's
    ``snakemake`` process is gone, no job has held a lease for ``idle_timeout_s``, or the server exits by itself.
    Returns the exit code (0 after a normal stop)."""
    from ...devices import gpu_devices
    from ...runtime.processes import Owner, process_start

    spec = json.loads(Path(spec_path).read_text())
    name, entry_path = spec["name"], Path(spec["entry"])
    owner = Owner.parse(spec["owner"])
    stop = {"why": None}

    def on_signal(signum, frame):
        stop["why"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    me = {
        "name": name,
        "supervisor_pid": os.getpid(),
        "supervisor_start": process_start(os.getpid()),
        "port": spec["port"],
        "log": spec["log"],
        "stop_grace_s": spec["stop_grace_s"],
    }

    def entry(**kw) -> None:
        me.update(kw)
        _write_json(entry_path, me)

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} eagle3-data supervisor of {name}] {msg}", flush=True)

    entry(state="starting")
    log_offset = Path(spec["log"]).stat().st_size if Path(spec["log"]).exists() else 0
    env = dict(os.environ)
    proc = None
    code = 0
    try:
        with gpu_devices(spec["gpus"], env=env, timeout_s=spec["ready_timeout_s"]) as devs:
            try:  # the server is stopped before its GPUs' locks go: an extraction job waiting on them never
                # starts while the server still holds device memory (its shutdown, the stop grace)
                say(f"starting{' on GPUs ' + ','.join(devs) if devs else ''}: {shlex.join(spec['argv'])}")
                proc = popen(spec["argv"], env, sys.stdout)
                entry(server_pid=proc.pid, devices=devs)
                try:
                    took = wait_ready(
                        proc,
                        spec["url"],
                        spec["ready_timeout_s"],
                        name=name,
                        argv=spec["argv"],
                        log_path=Path(spec["log"]),
                        offset=log_offset,
                        stop=lambda: stop["why"],
                    )
                except ServerLaunchError as exc:
                    entry(state="failed", error=exc.message)
                    say(f"failed: {exc.message.splitlines()[0]}")
                    return 1
                entry(state="ready", ready_s=round(took, 1))
                say(f"ready in {took:.1f} s on port {spec['port']} (pid {proc.pid})")
                idle_since = None
                while stop["why"] is None:
                    time.sleep(poll_s)
                    if proc.poll() is not None:
                        stop["why"] = f"the server exited with code {proc.returncode}"
                        code = 1
                    elif owner is not None and not owner.alive():
                        stop["why"] = "the workflow run ended (its snakemake process is gone)"
                    else:
                        idle_since = _idle_check(spec, idle_since)
                        if idle_since is not None and time.monotonic() - idle_since >= spec["idle_timeout_s"]:
                            if _mark_stopping(spec, entry):
                                stop["why"] = f"no job used it for {spec['idle_timeout_s']:.0f} s"
                            else:
                                idle_since = None  # a job attached in the meantime
                with _flock(Path(spec["lock"]), fcntl.LOCK_EX):  # no job attaches to a server being stopped
                    entry(state="stopping")
                say(f"stopping: {stop['why']}")
            finally:
                if proc is not None:
                    stop_group(proc, spec["stop_grace_s"])
    except Exception as exc:  # noqa: BLE001 - the GPUs did not become free, the command can't run: tell the job
        entry(state="failed", error=f"local server {name}: {type(exc).__name__}: {exc}")
        say(f"failed: {type(exc).__name__}: {exc}")
        return 1
    finally:  # (a started server was stopped above, inside its GPUs' locks)
        with _flock(Path(spec["lock"]), fcntl.LOCK_EX):
            cur = _read_json(entry_path)
            if cur and cur.get("supervisor_pid") == os.getpid():
                if cur.get("state") == "failed":
                    entry(state="failed")  # keep the reason for the job waiting on it
                else:
                    entry_path.unlink(missing_ok=True)
    say("stopped")
    return code


def _mark_stopping(spec: dict, entry) -> bool:
    """Under the registry lock: if still no job holds a lease, write the entry's state ``stopping`` (jobs then
    wait for the supervisor to go and start a new server, never attaching to this one) and return True; False
    when a job attached since the idle check."""
    with _flock(Path(spec["lock"]), fcntl.LOCK_EX):
        with _flock(Path(spec["lease"]), fcntl.LOCK_EX, blocking=False) as free:
            if not free:
                return False
        entry(state="stopping")
        return True


def _idle_check(spec: dict, idle_since: float | None) -> float | None:
    """``idle_since`` updated: None while some job holds a lease (or is attaching), else when idleness began."""
    with _flock(Path(spec["lock"]), fcntl.LOCK_EX, blocking=False) as got:
        if not got:  # a job is attaching right now
            return None
        with _flock(Path(spec["lease"]), fcntl.LOCK_EX, blocking=False) as free:
            if not free:
                return None
    return idle_since if idle_since is not None else time.monotonic()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "supervise":
        return supervise(args[1])
    print("usage: python -m eagle3_data.backends.server supervise SPEC.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
