"""The HTTP session of one backend (httpx) and how an HTTP exchange maps to the failure kinds of :mod:`.errors`.

Every request has a deadline for the whole exchange (``timeout_s``); transport failures become
:class:`.errors.RetryableError` (``timeout``, ``connection_error``, ``http_error``); a non-200 status is judged by
:func:`check_status`. Error texts go through :meth:`.settings.BackendConfig.scrub` before they reach logs or rows.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import httpx

from .errors import FatalBackendError, RetryableError, SampleError
from .settings import BackendConfig

RETRYABLE_STATUS = {408, 409, 425, 429}
FATAL_STATUS = {401, 402, 403}
POOL_SHARD = 32  # connections per httpx client (see HttpSession)


def _retry_after(resp: httpx.Response) -> float | None:
    raw = resp.headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, parsedate_to_datetime(raw).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def _error_text(resp: httpx.Response, limit: int = 1000) -> str:
    """The error a non-200 body carries: ``error.message`` plus OpenRouter's ``error.metadata.provider_name`` and
    ``error.metadata.raw`` (the provider's own words, often the only useful part), FastAPI's ``detail``, or the
    body itself; at most ``limit`` characters (scrub the key before it goes anywhere: :meth:`BackendConfig.scrub`)."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip()[:limit] or f"HTTP {resp.status_code} with an empty body"
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        parts = [str(err.get("message") or json.dumps(err, ensure_ascii=False))]
        meta = err.get("metadata") if isinstance(err.get("metadata"), dict) else {}
        if meta.get("provider_name"):
            parts.append(f"provider {meta['provider_name']}")
        raw = meta.get("raw")
        if raw:
            parts.append(f"raw: {raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)}")
        return "; ".join(parts)[:limit]
    if err:
        return str(err)[:limit]
    if isinstance(data, dict) and data.get("detail"):
        d = data["detail"]
        return (d if isinstance(d, str) else json.dumps(d, ensure_ascii=False))[:limit]
    return json.dumps(data, ensure_ascii=False)[:limit]


def _is_moderation(resp: httpx.Response) -> bool:
    try:
        err = resp.json().get("error") or {}
        meta = err.get("metadata") or {}
        return "flagged_input" in meta or "reasons" in meta or "moderation" in str(err.get("message", "")).lower()
    except (ValueError, AttributeError):
        return False


def check_status(backend: BackendConfig, resp: httpx.Response) -> None:
    """Raise the right error for a non-200 response (see module docstring)."""
    code = resp.status_code
    if code == 200:
        return
    text = backend.scrub(_error_text(resp))
    if code in FATAL_STATUS:
        if code == 403 and _is_moderation(resp):
            raise SampleError("moderation", text)
        what = {401: "credentials rejected", 402: "insufficient credits", 403: "forbidden"}[code]
        todo = {401: f"check the key in {backend.api_key_env or 'the api_key_env variable'}",
                402: "add credits or raise the key's limit", 403: "check the key's permissions and the model name"}
        raise FatalBackendError(f"backend {backend.name!r} ({backend.base_url}) answered HTTP {code} ({what}): {text}",
                                hint=f"{todo[code]}, then rerun the same command")
    if code in RETRYABLE_STATUS or code >= 500:
        raise RetryableError(f"http_{code}", text, retry_after=_retry_after(resp), backend_fault=code >= 500)
    raise SampleError(f"http_{code}", text)



def cause_text(exc: BaseException) -> str:
    """An httpx error's text with the operating system's reason when there is one ("All connection attempts
    failed" -> "... (Connection refused)")."""
    text = str(exc) or type(exc).__name__
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            reason = os.strerror(e.errno)
            return text if reason in text else f"{text} ({reason})"
        e = e.__cause__ or e.__context__
    return text


_SSL_CONTEXT = None


def _ssl_context():
    """The process's shared client SSL context (certifi CA bundle, httpx defaults)."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = httpx.create_ssl_context()
    return _SSL_CONTEXT



class HttpSession:
    """The HTTP connections of one backend for one job: httpx clients with at most ``cap`` connections in all,
    the backend's headers (``Authorization: Bearer <key>`` from ``api_key_env``, raising
    :class:`.errors.FatalBackendError` when it is missing) and timeouts. ``transport``: an httpx transport to use
    instead of the network (tests: ``httpx.MockTransport``)."""

    def __init__(self, cfg: BackendConfig, cap: int, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = cfg
        key = cfg.api_key()
        headers = {"Content-Type": "application/json", **cfg.headers}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # httpcore's pool scans every connection for every queued request and, for each idle connection, builds
        # a list of all connections (O(n^2) per pool event): at 2,000 connections in one pool the client spends
        # most of its CPU there and falls behind. Sharding the connections over several clients of at most
        # POOL_SHARD connections keeps each scan small; a request takes the least-loaded shard, and since the
        # backend never has more than max_concurrency requests in flight, a shard with a free connection always
        # exists (no request ever queues inside httpx). Keep-alive outlives the longest idle gap.
        n = cap
        k = max(1, math.ceil(n / POOL_SHARD))
        caps = [n // k + (1 if i < n % k else 0) for i in range(k)]
        # one SSL context for all shards: httpx builds a new one (loading the CA bundle, ~1 MB) per client otherwise
        ctx = _ssl_context()
        self.clients = [
            httpx.AsyncClient(
                base_url=cfg.base_url,
                headers=headers,
                verify=ctx,
                timeout=httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s)),
                limits=httpx.Limits(max_connections=c, max_keepalive_connections=c,
                                    keepalive_expiry=max(60.0, cfg.timeout_s)),
                trust_env=False,
                transport=transport,
            )
            for c in caps
        ]
        self._load = [0] * k

    async def post(self, url: str, body: bytes) -> httpx.Response:
        """POST ``body`` to ``url`` (relative to ``base_url``, or absolute) within ``timeout_s`` for the whole
        exchange. Raises :class:`.errors.RetryableError` (``timeout``, ``connection_error``: a refused connection
        is a backend fault, ``http_error``)."""
        i = self._load.index(min(self._load))
        self._load[i] += 1
        try:
            # httpx's timeouts are per read: a reply trickling a byte at a time would never end without a
            # deadline for the whole request
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self.clients[i].post(url, content=body)
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise RetryableError("timeout", f"{type(exc).__name__} (timeout_s {self.cfg.timeout_s:g})") from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                httpx.NetworkError) as exc:
            raise RetryableError("connection_error", f"{type(exc).__name__}: {cause_text(exc)[:200]}",
                                 backend_fault=isinstance(exc, httpx.ConnectError)) from None
        except httpx.HTTPError as exc:  # a body that fails to decode (Content-Encoding), another protocol error
            raise RetryableError("http_error", f"{type(exc).__name__}: {str(exc)[:200]}") from None
        finally:
            self._load[i] -= 1

    async def get(self, url: str, params: dict | None = None) -> httpx.Response:
        """GET ``url`` (no deadline or error mapping: the caller's); raises what httpx raises."""
        return await self.clients[0].get(url, params=params)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
