"""The HTTP session of one backend (httpx) and how an HTTP exchange maps to the failure kinds of :mod:`.errors`.

Every request has a deadline for the whole exchange (``timeout_s``); transport failures become
:class:`.errors.RetryableError` (``timeout``, ``connection_error``, ``http_error``); a non-200 status is judged by
:func:`check_status`. Error texts go through :meth:`.settings.BackendConfig.scrub` before they reach logs or rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx

from .errors import FatalBackendError, RetryableError, SampleError
from .definition import BackendConfig

RETRYABLE_STATUS = {408, 409, 425, 429}
FATAL_STATUS = {401, 402, 403}


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
        todo = {
            401: f"check the key in {backend.api_key_env or 'the api_key_env variable'}",
            402: "add credits or raise the key's limit",
            403: "check the key's permissions and the model name",
        }
        raise FatalBackendError(
            f"backend {backend.name!r} ({backend.base_url}) answered HTTP {code} ({what}): {text}",
            hint=f"{todo[code]}, then rerun the same command",
        )
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


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport over one aiohttp ``ClientSession``: httpx's API (requests, responses, exceptions) with
    aiohttp's HTTP/1.1 connection pool underneath, which costs a fraction of httpcore's CPU per request at
    thousands of connections (``benchmarks/generation_client.py``).

    ``max_connections`` connections at most (kept alive ``keepalive_s``), TLS with ``ssl_context``. The reply is
    read whole (the stage never streams). aiohttp's failures become httpx's: a refused or failed connect
    ``httpx.ConnectError``, a connection closed or reset mid-exchange ``httpx.RemoteProtocolError`` /
    ``httpx.ReadError``, httpx's connect/read timeouts ``httpx.ConnectTimeout`` / ``httpx.ReadTimeout``. The
    response body is handed to httpx as received (``Content-Encoding`` decoded by httpx, as with its own
    transport)."""

    def __init__(self, *, max_connections: int, keepalive_s: float = 60.0, ssl_context=None):
        self.max_connections = int(max_connections)
        self.keepalive_s = float(keepalive_s)
        self.ssl_context = ssl_context
        self._session = None

    def _open(self):
        import aiohttp

        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=0,
            keepalive_timeout=self.keepalive_s,
            ssl=self.ssl_context if self.ssl_context is not None else True,
        )
        # no cookies, no proxies from the environment, no default headers (httpx sets them): a plain pool
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp

        session = self._session or self._open()
        t = request.extensions.get("timeout") or {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))
        try:
            async with session.request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=request.content or None,
                allow_redirects=False,
                timeout=timeout,
            ) as resp:
                content = await resp.read()
                status, headers = resp.status, resp.raw_headers
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timeout", request=request) from exc
        except (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, TimeoutError) as exc:
            raise httpx.ReadTimeout(str(exc) or "read timeout", request=request) from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise httpx.RemoteProtocolError(
                str(exc) or "Server disconnected without sending a response.", request=request
            ) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except (aiohttp.ClientOSError, aiohttp.ClientConnectionError, OSError) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
        return httpx.Response(
            status, headers=headers, content=content, request=request, extensions={"http_version": b"HTTP/1.1"}
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpSession:
    """The HTTP connections of one backend for one job: one connection pool of at most ``cap`` connections
    (:class:`AiohttpTransport`, or ``transport``: any httpx transport, e.g. ``httpx.MockTransport`` in tests), the
    backend's headers (``Authorization: Bearer <key>`` from ``api_key_env``, raising
    :class:`.errors.FatalBackendError` when it is missing) and timeouts.

    :meth:`post` hands an ``httpx.Request`` built from prepared parts (the base URL and headers parsed once) to the
    transport directly: the per-request work of ``httpx.AsyncClient`` (URL merging, cookies, auth and redirect
    flows) is skipped on the hot path; :meth:`get` goes through an ``httpx.AsyncClient`` on the same transport."""

    def __init__(self, cfg: BackendConfig, cap: int, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = cfg
        key = cfg.api_key()
        headers = {"Content-Type": "application/json", **cfg.headers}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s))
        keepalive = max(60.0, cfg.timeout_s)  # keep-alive outlives the longest idle gap
        if transport is None:
            # one SSL context per process: httpx builds a new one (loading the CA bundle, ~1 MB) per client otherwise
            transport = AiohttpTransport(max_connections=cap, keepalive_s=keepalive, ssl_context=_ssl_context())
        self.transport = transport
        self.client = httpx.AsyncClient(
            base_url=cfg.base_url, headers=headers, timeout=timeout, trust_env=False, transport=transport
        )
        self._headers = self.client.headers  # httpx's defaults (Host comes from the URL) + the backend's
        self._timeout = timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

    def _url(self, url: str) -> httpx.URL:
        """``url`` as httpx's client resolves it: relative to ``base_url`` (``/chat/completions``), or absolute."""
        u = self._urls.get(url)
        if u is None:
            u = httpx.URL(url)
            if u.is_relative_url:
                u = httpx.URL(self.cfg.base_url.rstrip("/") + "/" + url.lstrip("/"))
            self._urls[url] = u
        return u

    async def post(self, url: str, body: bytes) -> httpx.Response:
        """POST ``body`` to ``url`` (relative to ``base_url``, or absolute) within ``timeout_s`` for the whole
        exchange; return the response, read. Raises :class:`.errors.RetryableError` (``timeout``,
        ``connection_error``: a refused connection is a backend fault, ``http_error``)."""
        request = httpx.Request(
            "POST", self._url(url), headers=self._headers, content=body, extensions={"timeout": self._timeout}
        )
        try:
            # httpx's timeouts are per read: a reply trickling a byte at a time would never end without a
            # deadline for the whole request
            async with asyncio.timeout(self.cfg.timeout_s):
                resp = await self.transport.handle_async_request(request)
                try:
                    await resp.aread()
                finally:
                    await resp.aclose()
                return resp
        except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:  # never reached the server: nothing to bill
            raise RetryableError("connection_error", f"{type(exc).__name__}: no connection in time") from None
        except (httpx.TimeoutException, TimeoutError):
            raise RetryableError(
                "timeout",
                f"no complete reply within backends.{self.cfg.name}.timeout_s = {self.cfg.timeout_s:g} s: the "
                "attempt was abandoned (the provider may bill it); raise timeout_s if its replies are that slow",
            ) from None
        except (
            httpx.ConnectError,
            httpx.RemoteProtocolError,
            httpx.ReadError,
            httpx.WriteError,
            httpx.NetworkError,
        ) as exc:
            raise RetryableError(
                "connection_error",
                f"{type(exc).__name__}: {cause_text(exc)[:200]}",
                backend_fault=isinstance(exc, httpx.ConnectError),
            ) from None
        except httpx.HTTPError as exc:  # a body that fails to decode (Content-Encoding), another protocol error
            raise RetryableError("http_error", f"{type(exc).__name__}: {str(exc)[:200]}") from None

    async def get(self, url: str, params: dict | None = None) -> httpx.Response:
        """GET ``url`` (no deadline or error mapping: the caller's); raises what httpx raises."""
        return await self.client.get(url, params=params)

    async def aclose(self) -> None:
        await self.client.aclose()  # closes the transport too
