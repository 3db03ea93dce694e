"""Start and stop a local inference server for a generate job (``transformers serve``, SGLang, vLLM, ...).

Config (a backend's ``launch:``): ``command`` (a string with ``{model}`` and ``{port}`` placeholders, split
with ``shlex``, run without a shell), ``port`` (``auto`` = a free loopback port, or an int), ``ready_path``
(GET until HTTP 200, e.g. ``/health``), ``ready_timeout_s``, ``env`` (extra environment variables),
``stop_grace_s`` (SIGTERM -> SIGKILL delay, default 20).

The server runs in its own process group (so its workers are stopped with it), with stdout+stderr in a log
file, and gets SIGTERM if this process dies (Linux ``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the job
leaves no orphan. The command must bind 127.0.0.1; :func:`launch_server` refuses a command that asks for
``0.0.0.0``/``::``. Example for SGLang::

    command: python -m sglang.launch_server --model-path {model} --host 127.0.0.1 --port {port} --tp 8
"""

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

logger = logging.getLogger("eagle3_data.server")


class ServerLaunchError(RuntimeError):
    """The server exited or did not become ready; the message has the command and its log's last lines."""


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


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-n:])


class LocalServer:
    """A started server process. Use :func:`launch_server` (a context manager) rather than this directly."""

    def __init__(self, command: list[str], port: int, log_path: Path, proc: subprocess.Popen, grace_s: float):
        self.command = command
        self.port = port
        self.log_path = log_path
        self.proc = proc
        self.grace_s = grace_s

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the process group, wait ``grace_s``, then SIGKILL it; return the exit code."""
        if self.proc.poll() is None:
            logger.info("stopping local server pid %d (port %d)", self.proc.pid, self.port)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("local server pid %d ignored SIGTERM for %.0f s; killing", self.proc.pid, self.grace_s)
        # kill whatever is left in the group (workers that outlived the leader, or a leader that hung)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode


def _format_command(launch: dict, model: str, port: int) -> list[str]:
    cmd = launch.get("command")
    if not cmd:
        raise ValueError("launch: missing 'command'")
    if isinstance(cmd, str):
        argv = shlex.split(cmd)
    else:
        argv = [str(a) for a in cmd]
    argv = [a.replace("{model}", str(model)).replace("{port}", str(port)) for a in argv]
    if argv and os.sep not in argv[0]:
        # prefer the running interpreter's environment (a venv's `transformers`, `python`) over PATH
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        else:
            found = shutil.which(argv[0], path=os.pathsep.join([os.path.dirname(sys.executable),
                                                                 os.environ.get("PATH", "")]))
            if not found:
                raise ServerLaunchError(f"launch command {argv[0]!r} not found next to {sys.executable} or on PATH")
            argv[0] = found
    for i, a in enumerate(argv):
        host = None
        if a in ("--host", "--bind") and i + 1 < len(argv):
            host = argv[i + 1]
        elif a.startswith("--host="):
            host = a.split("=", 1)[1]
        if host is not None and host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"launch command binds {host!r}: a local server must listen on 127.0.0.1 only")
    return argv


@contextlib.contextmanager
def launch_server(launch: dict, model: str, log_path: str | os.PathLike, *, name: str = "server") -> Iterator[LocalServer]:
    """Start the ``launch`` command, wait until ``ready_path`` answers 200, yield, always stop it.

    ``log_path`` receives the server's stdout and stderr (appended). Raises :class:`ServerLaunchError`
    (with the log tail) if the process exits early or is not ready within ``ready_timeout_s``; the process
    group is stopped on every exit path, exceptions and KeyboardInterrupt included.
    """
    port_cfg = launch.get("port", "auto")
    port = free_port() if port_cfg in (None, "auto") else int(port_cfg)
    try:
        argv = _format_command(launch, model, port)
    except (ServerLaunchError, ValueError) as exc:
        raise type(exc)(f"backend {name!r}: {exc}") from None
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (launch.get("env") or {}).items()})
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready_path = launch.get("ready_path") or "/health"
    ready_timeout = float(launch.get("ready_timeout_s") or 300)
    grace = float(launch.get("stop_grace_s") or 20)
    url = f"http://127.0.0.1:{port}{ready_path if ready_path.startswith('/') else '/' + ready_path}"
    logger.info("starting local server %s on 127.0.0.1:%d (log: %s): %s", name, port, log_path, shlex.join(argv))
    with open(log_path, "wb") as logf:  # one log per launch: an error excerpt never shows an older run
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,
        )
    server = LocalServer(argv, port, log_path, proc, grace)
    try:
        t0 = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    raise ServerLaunchError(
                        f"local server {name} exited with code {proc.returncode} before it was ready.\n"
                        f"command: {shlex.join(argv)}\nlast lines of {log_path}:\n{_tail(log_path)}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > ready_timeout:
                    raise ServerLaunchError(
                        f"local server {name} not ready at {url} after {ready_timeout:.0f} s.\n"
                        f"command: {shlex.join(argv)}\nlast lines of {log_path}:\n{_tail(log_path)}"
                    )
                time.sleep(0.2)
        logger.info("local server %s ready in %.1f s (pid %d)", name, time.monotonic() - t0, proc.pid)
        yield server
    finally:
        server.stop()
