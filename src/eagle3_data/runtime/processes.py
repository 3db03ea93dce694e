"""Processes named so that a reused pid never passes for them: a pid with its start time (:func:`process_start`),
on a host (:class:`Owner`). Used by the workflow run (:mod:`.run`) and the launched servers
(:mod:`eagle3_data.backends.server`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None if there
    is no such process: with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields and fields[0] == "Z":  # a zombie has exited
        return None
    return fields[19] if len(fields) > 19 else None


@dataclass(frozen=True)
class Owner:
    """The process a run (or a server) lives for: ``host``, ``pid`` and its ``start`` time (see
    :func:`process_start`)."""

    host: str
    pid: int
    start: str

    @classmethod
    def me(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()) or "0")

    @classmethod
    def parse(cls, text: str) -> "Owner | None":
        """``"host:pid:start"`` -> Owner (None if malformed)."""
        try:
            host, pid, start = text.rsplit(":", 2)
            return cls(host, int(pid), start)
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.start}"

    def local(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """True if this process still runs (on this host; a process on another host counts as alive)."""
        if not self.local():
            return True
        return process_start(self.pid) == self.start
