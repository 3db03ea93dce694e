"""Local inference servers the build launches (``transformers serve``, SGLang, vLLM, ...) for generate jobs.

Config (a backend's ``launch:``): ``command`` (a string with ``{model}`` and ``{port}`` placeholders, split with
``shlex``, run without a shell), ``port`` (``auto`` = a free loopback port, or an int), ``ready_path`` (GET until
HTTP 200, e.g. ``/health``), ``ready_timeout_s``, ``env`` (extra environment variables), ``stop_grace_s``
(SIGTERM -> SIGKILL delay, default 20), and:

- ``python``: the environment the server runs in, so that a GPU stack never has to be installed in the CPU
  environment of the workflow: a Python interpreter (``/opt/envs/sglang/bin/python``) or an environment directory
  (a venv or conda prefix, ``.venv-sglang``; its ``bin/python`` is used). ``python``/``python3`` at the start
  of ``command`` becomes that interpreter, any other program is looked up in its ``bin/`` first, and that
  ``bin/`` leads the server's ``PATH``. Default: the workflow's own interpreter (right for ``transformers serve``);
- ``gpus``: devices the server needs (``--tp 8`` -> 8). They are taken from this machine's per-GPU lock pool
  (:mod:`eagle3_data.devices`, the pool extraction uses) for the server's whole life and given to it as
  ``CUDA_VISIBLE_DEVICES``, so a server, another server and an extraction job never share a device;
- ``idle_timeout_s`` (default 300): a workflow-scoped server no job has used for this long is stopped (it frees
  its GPUs for extraction); the next job that needs it starts it again.

Two lifetimes:

- :func:`shared_server` (inside a workflow run, :mod:`eagle3_data.run`): ONE server per launched backend for the
  whole run. A registry under the run directory (``servers/<backend>-<hash>.json`` + a lock file) lets concurrent
  generate jobs attach to the server instead of starting another; a job holds a shared lease (``flock``) while it
  uses it. The server is run by a small supervisor process that stops it when the run ends (the Snakefile's
  ``onsuccess``/``onerror`` call :func:`stop_run_servers`), when the ``snakemake`` process is gone (even after
  SIGKILL: the supervisor polls it), or after ``idle_timeout_s`` without a lease; the server gets SIGTERM if its
  supervisor dies (``PR_SET_PDEATHSIG``).
- :func:`launch_server` (outside a run: the Python API, a cluster job on its own node): the server lives for one
  ``with`` block of the calling process.

The server runs in its own process group (so its workers are stopped with it), with stdout+stderr in a log file.
The command must bind 127.0.0.1: a command that asks for ``0.0.0.0``/``::`` is refused. Example for SGLang::

    command: python -m sglang.launch_server --model-path {model} --host 127.0.0.1 --port {port} --tp 8
    python: .venv-sglang              # the venv of envs/sglang-gpu.txt (docs/environments.md)
    gpus: 8

and for vLLM (with the backend's ``return_token_ids: true``; vLLM binds every interface unless ``--host`` is
given, so a vLLM command without it is refused; ``/health`` answers 200 once the model is loaded)::

    command: vllm serve {model} --host 127.0.0.1 --port {port} --tensor-parallel-size 8
    python: .venv-vllm                # the venv of envs/vllm-gpu.txt (docs/environments.md)
    gpus: 8
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from ..errors import ExpectedFailure

logger = logging.getLogger("eagle3_data.server")

DEFAULT_IDLE_TIMEOUT_S = 300.0


class ServerLaunchError(ExpectedFailure):
    """The server exited or did not become ready; the message has the command and its log's last lines."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, hint or "fix the backend's launch: settings (command, python, gpus) and rerun "
                                          "the same command")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path: Path, n: int = 12, offset: int = 0) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-n:])


# ---------------------------------------------------------------------------------------------------------------
# the command and its environment


def launch_python(launch: dict) -> tuple[str, Path | None]:
    """The interpreter a launch runs ``python`` with and the ``bin/`` directory searched first for programs.

    ``launch["python"]``: an interpreter file, or an environment directory (``<dir>/bin/python``); unset: this
    process's interpreter and its ``bin/`` (the workflow's environment). Raises :class:`ServerLaunchError` naming
    the path when it is neither.
    """
    spec = launch.get("python")
    if not spec:
        return sys.executable, Path(sys.executable).parent
    p = Path(os.path.expanduser(str(spec)))
    if p.is_dir():
        for name in ("python", "python3"):
            if (p / "bin" / name).exists():
                return str((p / "bin" / name).absolute()), (p / "bin").absolute()
        raise ServerLaunchError(f"launch.python: {spec} is a directory without bin/python",
                                hint="point it at the environment's interpreter or its prefix (the directory "
                                     "holding bin/python), e.g. the venv created from envs/sglang-gpu.txt")
    if p.is_file() and os.access(p, os.X_OK):
        return str(p.absolute()), p.absolute().parent
    raise ServerLaunchError(f"launch.python: {spec} does not exist",
                            hint="create the server's environment first (docs/environments.md), or leave "
                                 "launch.python out to use the workflow's own interpreter")


def _format_command(launch: dict, model: str, port: int) -> list[str]:
    cmd = launch.get("command")
    if not cmd:
        raise ValueError("launch: missing 'command'")
    argv = shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]
    argv = [a.replace("{model}", str(model)).replace("{port}", str(port)) for a in argv]
    if argv and os.sep not in argv[0]:
        python, bindir = launch_python(launch)
        if argv[0] in ("python", "python3"):
            argv[0] = python
        else:
            found = shutil.which(argv[0], path=os.pathsep.join([str(bindir), os.environ.get("PATH", "")]))
            if not found:
                raise ServerLaunchError(f"launch command {argv[0]!r} not found in {bindir} or on PATH")
            argv[0] = found
    for i, a in enumerate(argv):
        host = None
        if a in ("--host", "--bind") and i + 1 < len(argv):
            host = argv[i + 1]
        elif a.startswith("--host="):
            host = a.split("=", 1)[1]
        if host is not None and host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"launch command binds {host!r}: a local server must listen on 127.0.0.1 only")
    if is_vllm(argv) and not any(a in ("--host", "--bind") or a.startswith("--host=") for a in argv):
        raise ValueError("launch command starts vLLM without --host: vLLM listens on every interface unless told; "
                         "add --host 127.0.0.1")
    return argv


def is_vllm(argv: list[str]) -> bool:
    """The command starts a vLLM server: ``vllm serve ...`` or ``python -m vllm.entrypoints.openai.api_server``."""
    prog = os.path.basename(argv[0]) if argv else ""
    return (prog == "vllm" and argv[1:2] == ["serve"]) or "vllm.entrypoints.openai.api_server" in argv


def server_env(launch: dict, base: dict | None = None) -> dict:
    """The server's environment: ``base`` (default this process's), with ``launch.python``'s ``bin/`` first on
    ``PATH`` (and ``VIRTUAL_ENV``/``CONDA_PREFIX`` for it, when it is another environment), then ``launch.env``."""
    env = dict(os.environ if base is None else base)
    if launch.get("python"):
        _, bindir = launch_python(launch)
        prefix = bindir.parent
        env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
        env.pop("PYTHONHOME", None)
        env.pop("PYTHONPATH", None)  # the workflow's packages must not shadow the server's
        env.pop("VIRTUAL_ENV", None)
        env.pop("CONDA_PREFIX", None)
        if (prefix / "pyvenv.cfg").exists():
            env["VIRTUAL_ENV"] = str(prefix)
        elif (prefix / "conda-meta").is_dir():
            env["CONDA_PREFIX"] = str(prefix)
    env.update({str(k): str(v) for k, v in (launch.get("env") or {}).items()})
    return env


def _ready_url(launch: dict, port: int) -> str:
    ready_path = launch.get("ready_path") or "/health"
    return f"http://127.0.0.1:{port}{ready_path if ready_path.startswith('/') else '/' + ready_path}"


def _popen(argv: list[str], env: dict, logf) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=_set_pdeathsig)


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, *, name: str, argv: list[str], log_path: Path,
                offset: int = 0, stop=None) -> float:
    """Poll ``url`` until HTTP 200; return the seconds it took. Raises :class:`ServerLaunchError` (with the log's
    last lines from ``offset``) when the process exits first or ``timeout`` passes; ``stop()`` true aborts."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise ServerLaunchError(
                    f"local server {name} exited with code {proc.returncode} before it was ready "
                    f"(command: {shlex.join(argv)}); last lines of {log_path}:\n{_tail(log_path, offset=offset)}")
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise ServerLaunchError(
                    f"local server {name} not ready at {url} after {timeout:.0f} s (command: {shlex.join(argv)}); "
                    f"last lines of {log_path}:\n{_tail(log_path, offset=offset)}",
                    hint="raise launch.ready_timeout_s if the model needs longer to load, else fix launch.command")
            if stop is not None and stop():
                raise ServerLaunchError(f"local server {name}: stopped while starting")
            time.sleep(0.2)


def _stop_group(proc: subprocess.Popen, grace: float) -> int | None:
    """SIGTERM the process group of ``proc``, wait ``grace`` s, SIGKILL what is left; return the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            logger.warning("local server pid %d ignored SIGTERM for %.0f s; killing", proc.pid, grace)
    # kill whatever is left in the group (workers that outlived the leader, or a leader that hung)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return proc.returncode


class LocalServer:
    """A started server process. Use :func:`launch_server` (a context manager) rather than this directly."""

    def __init__(self, command: list[str], port: int, log_path: Path, proc: subprocess.Popen, grace_s: float,
                 devices: list[str] | None = None):
        self.command = command
        self.port = port
        self.log_path = log_path
        self.proc = proc
        self.grace_s = grace_s
        self.devices = devices or []
        self.started = True

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the process group, wait ``grace_s``, then SIGKILL it; return the exit code."""
        if self.proc.poll() is None:
            logger.info("stopping local server pid %d (port %d)", self.proc.pid, self.port)
        return _stop_group(self.proc, self.grace_s)


def _port(launch: dict) -> int:
    port_cfg = launch.get("port", "auto")
    return free_port() if port_cfg in (None, "auto") else int(port_cfg)


def _prepared(launch: dict, model: str, name: str) -> tuple[int, list[str]]:
    port = _port(launch)
    try:
        return port, _format_command(launch, model, port)
    except ServerLaunchError as exc:
        raise ServerLaunchError(f"backend {name!r}: {exc.message}", exc.hint) from None
    except ValueError as exc:
        raise ValueError(f"backend {name!r}: {exc}") from None


@contextlib.contextmanager
def launch_server(launch: dict, model: str, log_path: str | os.PathLike, *, name: str = "server") -> Iterator[LocalServer]:
    """Start the ``launch`` command for this ``with`` block: wait until ``ready_path`` answers 200, yield, always
    stop it.

    ``log_path`` receives the server's stdout and stderr (one file per launch). With ``launch.gpus`` the devices are
    held (:func:`eagle3_data.devices.gpu_devices`) for the block and passed as ``CUDA_VISIBLE_DEVICES``. Raises
    :class:`ServerLaunchError` (with the log tail) if the process exits early or is not ready within
    ``ready_timeout_s``; the process group is stopped on every exit path, exceptions and KeyboardInterrupt included.
    """
    from ..devices import gpu_devices

    port, argv = _prepared(launch, model, name)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = _ready_url(launch, port)
    grace = float(launch.get("stop_grace_s") or 20)
    env = server_env(launch)
    with gpu_devices(int(launch.get("gpus") or 0), env=env, timeout_s=float(launch.get("ready_timeout_s") or 300)) as devs:
        logger.info("starting local server %s on 127.0.0.1:%d (log: %s%s): %s", name, port, log_path,
                    f"; GPUs {','.join(devs)}" if devs else "", shlex.join(argv))
        with open(log_path, "wb") as logf:  # one log per launch: an error excerpt never shows an older run
            proc = _popen(argv, env, logf)
        server = LocalServer(argv, port, log_path, proc, grace, devs)
        try:
            took = _wait_ready(proc, url, float(launch.get("ready_timeout_s") or 300), name=name, argv=argv,
                               log_path=log_path)
            logger.info("local server %s ready in %.1f s (pid %d)", name, took, proc.pid)
            yield server
        finally:
            server.stop()


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
    from ..processes import process_start

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
def shared_server(launch: dict, model: str, *, name: str, run, log_path: str | os.PathLike,
                  wait_log_s: float = 10.0) -> Iterator[SharedServer]:
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
            if entry and entry.get("state") == "stopping" and _pid_alive(entry.get("supervisor_pid"),
                                                                         entry.get("supervisor_start")):
                stopping = True  # being stopped (idle): wait, without the lock, for it to be gone, then start anew
            elif not (entry and entry.get("state") in ("starting", "ready")
                      and _pid_alive(entry.get("supervisor_pid"), entry.get("supervisor_start"))):
                port, argv = _prepared(launch, model, name)
                log_path.parent.mkdir(parents=True, exist_ok=True)
                # the environment goes to the supervisor's process, not into the spec file (it may hold API keys)
                spec = {"name": name, "argv": argv, "port": port, "url": _ready_url(launch, port),
                        "ready_timeout_s": float(launch.get("ready_timeout_s") or 300),
                        "stop_grace_s": float(launch.get("stop_grace_s") or 20),
                        "gpus": int(launch.get("gpus") or 0),
                        "idle_timeout_s": float(launch.get("idle_timeout_s") or DEFAULT_IDLE_TIMEOUT_S),
                        "owner": str(run.owner), "entry": str(entry_path), "lock": str(lock_path),
                        "lease": str(lease_path), "log": str(log_path.absolute())}
                spec_path = reg / f"{key}.spec.json"
                _write_json(spec_path, spec)
                entry_path.unlink(missing_ok=True)
                logger.info("starting local server %s on 127.0.0.1:%d for this run (log: %s): %s", name, port,
                            log_path, shlex.join(argv))
                with open(log_path, "ab") as logf:
                    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, "supervise", str(spec_path)],
                                           stdin=subprocess.DEVNULL, stdout=logf,
                                           stderr=subprocess.STDOUT, start_new_session=True, env=server_env(launch))
                started = True
                entry = None
                while True:  # wait for the supervisor's verdict, holding the lock: other jobs attach afterwards
                    entry = _read_json(entry_path)
                    if entry and entry.get("supervisor_pid") == sup.pid and entry.get("state") in ("ready",
                                                                                                     "failed"):
                        break
                    if sup.poll() is not None:
                        entry = _read_json(entry_path) or {}
                        if entry.get("state") != "ready":
                            entry = {"state": "failed", "error": entry.get("error") or (
                                f"local server {name}: its supervisor exited with code {sup.returncode}; last "
                                f"lines of {log_path}:\n{_tail(log_path)}")}
                        break
                    time.sleep(0.2)
                if entry.get("state") != "ready":
                    raise ServerLaunchError(entry.get("error") or f"local server {name} did not start")
                logger.info("local server %s ready in %.1f s (pid %s%s)", name, entry.get("ready_s", 0.0),
                            entry.get("server_pid"),
                            f", GPUs {','.join(entry['devices'])}" if entry.get("devices") else "")
            else:
                while entry.get("state") == "starting":  # its starter died while waiting: wait here instead
                    time.sleep(0.2)
                    entry = _read_json(entry_path) or {"state": "failed"}
                    if not _pid_alive(entry.get("supervisor_pid"), entry.get("supervisor_start")):
                        entry = {"state": "failed", "error": f"local server {name}: its supervisor is gone"}
                if entry.get("state") != "ready":
                    raise ServerLaunchError(entry.get("error") or f"local server {name} did not start")
                logger.info("backend %s: attached to the run's local server on port %d (pid %s)", name,
                            entry["port"], entry.get("server_pid"))
            if not stopping:
                lease = os.open(lease_path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(lease, fcntl.LOCK_SH)
                break
        time.sleep(0.2)
    try:
        yield SharedServer(name, int(entry["port"]), list(entry.get("devices") or []), started,
                           int(entry["supervisor_pid"]), Path(entry.get("log") or log_path))
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
        while _pid_alive(e.get("supervisor_pid"), e.get("supervisor_start")) and time.monotonic() - t0 < max(timeout_s, grace + 15):
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
    from ..devices import gpu_devices
    from ..processes import Owner, process_start

    spec = json.loads(Path(spec_path).read_text())
    name, entry_path = spec["name"], Path(spec["entry"])
    owner = Owner.parse(spec["owner"])
    stop = {"why": None}

    def on_signal(signum, frame):
        stop["why"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    me = {"name": name, "supervisor_pid": os.getpid(), "supervisor_start": process_start(os.getpid()),
          "port": spec["port"], "log": spec["log"], "stop_grace_s": spec["stop_grace_s"]}

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
                proc = _popen(spec["argv"], env, sys.stdout)
                entry(server_pid=proc.pid, devices=devs)
                try:
                    took = _wait_ready(proc, spec["url"], spec["ready_timeout_s"], name=name, argv=spec["argv"],
                                       log_path=Path(spec["log"]), offset=log_offset, stop=lambda: stop["why"])
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
                    _stop_group(proc, spec["stop_grace_s"])
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
