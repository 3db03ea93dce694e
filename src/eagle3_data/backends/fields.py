"""Values of a backend's reply, checked one by one: what the journal (UTF-8 JSON) and the RESPONSES parquet can
hold, else None (or a retry, for text that is not valid Unicode)."""

from __future__ import annotations

import math

from ..schemas import INT32_END, is_token_ids
from .errors import RetryableError


def as_count(v) -> int | None:
    """A usage count: an int in [0, INT32_END), else None (null, bool, text, NaN/inf, negative, absurd: a count past
    int32 is no real token count, and sums of real ones never overflow int64)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if 0 <= n < INT32_END else None


def as_cost(v) -> float | None:
    """``usage.cost``: a finite float >= 0, else None (never NaN: it would not survive JSON -> arrow)."""
    try:
        c = None if v is None or isinstance(v, bool) else float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return c if c is not None and math.isfinite(c) and c >= 0 else None


def as_text(field: str, v) -> str | None:
    """A text field of a reply: the string, or None if not a string. A string that is not valid Unicode (an
    unpaired surrogate from a ``\\ud800`` escape) can be neither journaled as UTF-8 nor tokenized: raises
    :class:`RetryableError` ``invalid_unicode`` naming the field and the character (the chat parser makes the billed
    reply a paid reject of that name, :func:`eagle3_data.backends.chat.parse_response`)."""
    if not isinstance(v, str):
        return None
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RetryableError("invalid_unicode", f"{field} has an unpaired surrogate at character {exc.start}") from None
    return v


def parts_text(v):
    """A message field as text: a string as is; a list of content parts (``[{"type": "text", "text": ...}]``, as
    some providers send) joined; anything else unchanged (then dropped by :func:`as_text`)."""
    if isinstance(v, list):
        parts = [p["text"] for p in v if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts) if parts else None
    return v


def as_token_ids(v) -> list[int] | None:
    """Token ids as returned (a non-empty :func:`schemas.is_token_ids` list), else None."""
    return v if v and is_token_ids(v) else None
