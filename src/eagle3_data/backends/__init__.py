"""Generation backends: definitions (:mod:`.definition`), the API dialects (:mod:`.chat`, :mod:`.native`), the HTTP
session (:mod:`.transport`), the backend pool (:mod:`.pool`), request limits (:mod:`.limits`) and launched local servers
(:mod:`.server`).

The names below are imported on first use (PEP 562): a job that sends nothing, or a module that needs only
:mod:`.limits` or :mod:`.definition`, does not pay for httpx, aiohttp or the server launcher.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "Backend": "pool",
    "BackendPool": "pool",
    "BackendConfig": "definition",
    "FatalBackendError": "errors",
    "RetryableError": "errors",
    "SampleError": "errors",
    "build_body": "chat",
    "parse_response": "chat",
    "LocalServer": "server",
    "ServerLaunchError": "server",
    "free_port": "server",
    "launch_server": "server",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
