"""The JSON codec of the request path: orjson (a fraction of the standard library's CPU per request body and
reply), falling back to :mod:`json` wherever orjson refuses what the standard library accepts, so that what is
sent and how a reply is judged stay as before."""

from __future__ import annotations

import json

import orjson


def dumps(obj) -> bytes:
    """``obj`` as compact UTF-8 JSON bytes (non-ASCII characters as themselves). Where orjson refuses a value (an
    integer past 64 bits, a non-string key) the standard library encodes it (``ensure_ascii=False``). Raises
    ``TypeError`` / ``ValueError`` for what neither can encode (a string with an unpaired surrogate)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False).encode()


def loads(data: bytes | str):
    """Parse a JSON document. Where orjson refuses one the standard library reads (``NaN``, an escaped unpaired
    surrogate such as ``"\\ud800"``, an integer past 64 bits) the standard library parses it: such values are then
    judged field by field (:mod:`.fields`). Raises ``ValueError`` for a document that is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
