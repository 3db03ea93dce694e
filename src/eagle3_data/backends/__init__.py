"""Generation backends: OpenAI-compatible HTTP client (:mod:`.client`) and local server launcher (:mod:`.server`)."""

from .client import (
    Backend,
    BackendConfig,
    BackendPool,
    FatalBackendError,
    RetryableError,
    SampleError,
    build_body,
    parse_response,
)
from .server import LocalServer, ServerLaunchError, free_port, launch_server

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
