"""A launched server's process: its command (``launch.command`` with ``{model}``/``{port}``, ``launch.python``'s
environment, the loopback-only check, vLLM's ``--host``), its environment, the ready check (GET ``ready_path`` until
200), stopping its process group, and :func:`launch_server` (one ``with`` block's own server). The package
docstring (:mod:`eagle3_data.backends.server`) describes the config."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from ...errors import ExpectedFailure

logger = logging.getLogger("eagle3_data.server")


class ServerLaunchError(ExpectedFailure):
    """The server exited or did not become ready; the message has the command and its log's last lines."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(
            message, hint or "fix the backend's launch: settings (command, python, gpus) and rerun the same command"
        )


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


def log_tail(path: Path, n: int = 12, offset: int = 0) -> str:
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
        raise ServerLaunchError(
            f"launch.python: {spec} is a directory without bin/python",
            hint="point it at the environment's interpreter or its prefix (the directory "
            "holding bin/python), e.g. the venv created from envs/sglang-gpu.txt",
        )
    if p.is_file() and os.access(p, os.X_OK):
        return str(p.absolute()), p.absolute().parent
    raise ServerLaunchError(
        f"launch.python: {spec} does not exist",
        hint="create the server's environment first (docs/environments.md), or leave "
        "launch.python out to use the workflow's own interpreter",
    )


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
        raise ValueError(
            "launch command starts vLLM without --host: vLLM listens on every interface unless told; "
            "add --host 127.0.0.1"
        )
    return argv


def is_vllm(argv: list[str]) -> bool:
    """The command starts a vLLM server: ``vllm serve ...`` or ``python -m vllm.entrypoints.openai.api_server``."""
    prog = os.path.basename(argv[0]) if argv else ""
    return (prog == "vllm" and argv[1:2] == ["serve"]) or "vllm.entrypoints.openai.api_server" in argv


#: the math libraries' thread counts, which Snakemake sets to a job's ``threads`` (``snakemake/shell.py``)
THREAD_COUNT_VARS = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def server_env(launch: dict, base: dict | None = None) -> dict:
    """The server's environment: ``base`` (default this process's), with ``launch.python``'s ``bin/`` first on
    ``PATH`` (and ``VIRTUAL_ENV``/``CONDA_PREFIX`` for it, when it is another environment), then ``launch.env``.
    A thread count of ``0`` is dropped: Snakemake sets it from the generate rule's ``threads: 0`` (an HTTP client
    takes no core), and the server it starts must use its library's default (every core), not an invalid value
    (libgomp: "Invalid value for environment variable OMP_NUM_THREADS")."""
    env = dict(os.environ if base is None else base)
    for var in THREAD_COUNT_VARS:
        if env.get(var, "").strip() == "0":
            del env[var]
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


def ready_url(launch: dict, port: int) -> str:
    ready_path = launch.get("ready_path") or "/health"
    return f"http://127.0.0.1:{port}{ready_path if ready_path.startswith('/') else '/' + ready_path}"


def popen(argv: list[str], env: dict, logf) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=_set_pdeathsig,
    )


def wait_ready(
    proc: subprocess.Popen,
    url: str,
    timeout: float,
    *,
    name: str,
    argv: list[str],
    log_path: Path,
    offset: int = 0,
    stop=None,
) -> float:
    """Poll ``url`` until HTTP 200; return the seconds it took. Raises :class:`ServerLaunchError` (with the log's
    last lines from ``offset``) when the process exits first or ``timeout`` passes; ``stop()`` true aborts."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise ServerLaunchError(
                    f"local server {name} exited with code {proc.returncode} before it was ready "
                    f"(command: {shlex.join(argv)}); last lines of {log_path}:\n{log_tail(log_path, offset=offset)}"
                )
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise ServerLaunchError(
                    f"local server {name} not ready at {url} after {timeout:.0f} s (command: {shlex.join(argv)}); "
                    f"last lines of {log_path}:\n{log_tail(log_path, offset=offset)}",
                    hint="raise launch.ready_timeout_s if the model needs longer to load, else fix launch.command",
                )
            if stop is not None and stop():
                raise ServerLaunchError(f"local server {name}: stopped while starting")
            time.sleep(0.2)


def stop_group(proc: subprocess.Popen, grace: float) -> int | None:
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

    def __init__(
        self,
        command: list[str],
        port: int,
        log_path: Path,
        proc: subprocess.Popen,
        grace_s: float,
        devices: list[str] | None = None,
    ):
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
        return stop_group(self.proc, self.grace_s)


def _port(launch: dict) -> int:
    port_cfg = launch.get("port", "auto")
    return free_port() if port_cfg in (None, "auto") else int(port_cfg)


def prepared(launch: dict, model: str, name: str) -> tuple[int, list[str]]:
    port = _port(launch)
    try:
        return port, _format_command(launch, model, port)
    except ServerLaunchError as exc:
        raise ServerLaunchError(f"backend {name!r}: {exc.message}", exc.hint) from None
    except ValueError as exc:
        raise ValueError(f"backend {name!r}: {exc}") from None


@contextlib.contextmanager
def launch_server(
    launch: dict, model: str, log_path: str | os.PathLike, *, name: str = "server"
) -> Iterator[LocalServer]:
    """Start the ``launch`` command for this ``with`` block: wait until ``ready_path`` answers 200, yield, always
    stop it.

    ``log_path`` receives the server's stdout and stderr (one file per launch). With ``launch.gpus`` the devices are
    held (:func:`eagle3_data.devices.gpu_devices`) for the block and passed as ``CUDA_VISIBLE_DEVICES``. Raises
    :class:`ServerLaunchError` (with the log tail) if the process exits early or is not ready within
    ``ready_timeout_s``; the process group is stopped on every exit path, exceptions and KeyboardInterrupt included.
    """
    from ...devices import gpu_devices

    port, argv = prepared(launch, model, name)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = ready_url(launch, port)
    grace = float(launch.get("stop_grace_s") or 20)
    env = server_env(launch)
    with gpu_devices(
        int(launch.get("gpus") or 0), env=env, timeout_s=float(launch.get("ready_timeout_s") or 300)
    ) as devs:
        logger.info(
            "starting local server %s on 127.0.0.1:%d (log: %s%s): %s",
            name,
            port,
            log_path,
            f"; GPUs {','.join(devs)}" if devs else "",
            shlex.join(argv),
        )
        with open(log_path, "wb") as logf:  # one log per launch: an error excerpt never shows an older run
            proc = popen(argv, env, logf)
        server = LocalServer(argv, port, log_path, proc, grace, devs)
        try:
            took = wait_ready(
                proc, url, float(launch.get("ready_timeout_s") or 300), name=name, argv=argv, log_path=log_path
            )
            logger.info("local server %s ready in %.1f s (pid %d)", name, took, proc.pid)
            yield server
        finally:
            server.stop()
