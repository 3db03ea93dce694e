"""Generation backends: settings (:mod:`.settings`), the API dialects (:mod:`.chat`, :mod:`.native`), the HTTP
session (:mod:`.http`), the backend pool (:mod:`.pool`), request limits (:mod:`.limits`) and launched local servers
(:mod:`.server`)."""

from .chat import build_body, parse_response
from .errors import FatalBackendError, RetryableError, SampleError
from .pool import Backend, BackendPool
from .server import LocalServer, ServerLaunchError, free_port, launch_server
from .settings import BackendConfig

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendPool",
    "FatalBackendError",
    "RetryableError",
    "SampleError",
    "build_body",
    "parse_response",
    "LocalServer",
    "ServerLaunchError",
    "free_port",
    "launch_server",
]
