"""How a backend request fails, and how long to wait before retrying it.

Failure policy (OpenRouter's and SGLang's documented error codes):
- retried with exponential backoff and jitter (tenacity), a bounded number of times: 429 (``Retry-After``
  honoured), 408/409/425/5xx, timeouts, connection errors/resets, malformed JSON, and errors inside an HTTP
  200 body (top-level ``error``, ``choices[].error``, ``finish_reason == "error"``, no choices, empty reply):
  :class:`RetryableError`;
- 401, 402, 403 (except OpenRouter's moderation 403, which fails only its sample) raise
  :class:`FatalBackendError`: the job stops at once;
- other 4xx fail the sample without retry (:class:`SampleError`, reason ``http_<code>``).

A sample whose retries ran out on a :class:`RetryableError` failed *without a paid reply* (:func:`unpaid_reason`):
nothing was journaled for it, so a rerun sends it again; a :class:`SampleError` (a 4xx answer) and a paid reject
(:mod:`eagle3_data.backends.paid`) are final.
"""

from __future__ import annotations

import random

from ..errors import ExpectedFailure


class FatalBackendError(ExpectedFailure):
    """Credentials rejected (401/403), credits exhausted (402), a missing key variable, or every backend down:
    stop the whole job, keep the journal."""


class BackendDown(FatalBackendError):
    """Every backend of the job refused connections or answered only 5xx for ``down_after_s``."""


class RetryableError(Exception):
    """A transient failure; ``reason`` is a short code (``http_429``, ``timeout``, ``error_in_body`` ...)."""

    def __init__(self, reason: str, message: str = "", retry_after: float | None = None, backend_fault: bool = False):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        # connection refused / 5xx: counts toward taking the backend out of rotation for a while
        self.backend_fault = backend_fault


#: reasons of :class:`RetryableError` (besides ``http_408/409/425/429`` and ``http_5xx``): a sample failing with one
#: of them got no reply that was paid for and kept (:func:`unpaid_reason`)
UNPAID_REASONS = frozenset(
    {
        "timeout",
        "connection_error",
        "http_error",
        "error_in_body",
        "no_choices",
        "empty_response",
        "not_api_reply",
        "malformed_json",
        "aborted",
    }
)


def unpaid_reason(reason: str | None) -> bool:
    """Whether a failed sample's ``reason`` (``"http_429"``, ``"timeout"`` ...) is one a retry may fix and that
    left no paid reply in the journal: a rerun sends the sample again. ``"http_400"``, ``"moderation"`` and paid
    rejects (``"invalid_utf8"`` ...) are final (False)."""
    if not reason:
        return False
    if reason.startswith("http_") and reason[5:].isdigit():
        code = int(reason[5:])
        return code in (408, 409, 425, 429) or code >= 500
    return reason in UNPAID_REASONS


class SampleError(Exception):
    """A permanent failure of one request (e.g. HTTP 400, moderation); not retried."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message


def retry_wait(initial_s: float, max_s: float):
    """A tenacity ``wait`` callable: the server's ``Retry-After`` when given (capped at ``max_s``, plus up to
    10% jitter), else full-jitter exponential backoff ``uniform(0, min(max_s, initial_s * 2**n))``."""
    import tenacity

    expo = tenacity.wait_random_exponential(multiplier=initial_s, max=max_s)

    def wait(retry_state) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        ra = getattr(exc, "retry_after", None)
        if ra is not None:
            return min(max_s, ra) * (1 + 0.1 * random.random())
        return max(initial_s / 4, expo(retry_state))

    return wait
