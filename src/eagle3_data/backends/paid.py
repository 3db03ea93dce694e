"""Replies that were paid for: kept, or refused with a named reason and journaled once, never bought again.

A 200 reply is billed whatever it holds. What can't be used becomes a *paid reject*: the sample fails with its
reason (a failed RESPONSES row, rejected by tokenize under that reason), and a small record of it (request key,
reason, billed tokens and cost, model; never the reply's text) is journaled, so a rerun does not pay for it again
and the budgets count it. ``snakemake --forcerun generate`` does not re-buy it either: delete its journal line to.

- :func:`decode_json` -- a body that is valid JSON but holds bytes that are not UTF-8 is decoded with
  U+FFFD replacements instead of being retried as malformed (the reply was paid for); its sample is then a paid
  reject ``invalid_utf8`` (a replaced character is not what the model produced, so its token ids can't be
  reconstructed);
- :func:`undecodable_reply` -- a 200 body that starts as the API's JSON object and is cut off: a paid reject
  ``undecodable_reply``, its raw text kept in the journal record (``raw_reply``), never retried (a provider that
  bills it would bill each retry); a body that is no JSON object at all (an HTML page from a proxy, an empty body)
  carries no usage and was not billed: retried as the unpaid failure ``not_api_reply`` (:func:`not_api_reply`);
- a reply whose text holds an unpaired surrogate (``"\\udfff"``): billed, not storable as UTF-8: the paid reject
  ``invalid_unicode`` (:func:`eagle3_data.backends.chat.parse_response`);
- :func:`client_error` -- an error code in a 200 body that no retry can fix (4xx other than 408/409/425/429);
- :func:`check_reply` -- a reply far larger than its billed completion tokens (``reply_too_large``), a reply
  quoting a configured API key in any field (``api_key_in_reply``), a reply naming another model than the one asked for
  (counted and warned; ``other_model`` when ``generation.reject_other_models`` is true);
- :func:`configured_keys` / :func:`scrub` -- every configured key (the values of every backend's
  ``api_key_env``, whatever their length) replaced by ``[api key]`` in text bound for logs and rows; a key shorter
  than :data:`MIN_KEY_CHARS` is refused before any request (:func:`short_key_problem`), so that a key found in
  any string field of a reply (its text, model, provider, id, finish reason, system fingerprint, ...) or in a
  prompt is one and not an ordinary word.
"""

from __future__ import annotations

import json
import os
import re

#: retrying these may help (timeout, conflict, too early, rate limit); every other 4xx can't be fixed by a retry
RETRYABLE_4XX = {408, 409, 425, 429}
#: a reply's text (content + reasoning + tool calls) may hold at most this many UTF-8 bytes per billed completion
#: token, plus :data:`SIZE_SLACK_BYTES` (a token is a few bytes; the longest tokens of real vocabularies are < 100)
MAX_BYTES_PER_TOKEN = 64
SIZE_SLACK_BYTES = 16384
#: the shortest API key accepted (config check and job start): a shorter one could be an ordinary word of a reply
#: ("test", "beta"), so replies could not be checked for it; a key this long is looked for as a plain substring
MIN_KEY_CHARS = 16


class PaidReject(Exception):
    """A paid reply that can't be kept: ``reason`` (a short code), ``message``, ``fields`` (the parsed reply's
    RESPONSES fields: billed tokens, cost, model, provider; the texts are dropped before it is journaled)."""

    def __init__(self, reason: str, message: str, fields: dict):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.fields = fields


def decode_json(content: bytes) -> tuple[object, int]:
    """``(parsed JSON, number of undecodable bytes replaced)`` of a reply body.

    Raises ValueError when the body is not JSON even with replacements (a cut-off body: :func:`undecodable_reply`)."""
    from . import codec

    try:
        return codec.loads(content), 0  # orjson: the fast path; it refuses bytes that are not UTF-8 too
    except ValueError:
        try:
            content.decode("utf-8")
        except UnicodeDecodeError:
            text = content.decode("utf-8", "replace")
            return json.loads(text), text.count("\ufffd") - content.decode("utf-8", "ignore").count("\ufffd")
        raise


#: characters of an undecodable 200 body kept in its reject record (``raw_reply``; the rest is counted, not kept)
RAW_REPLY_CHARS = 65536


def not_api_reply(content: bytes) -> str:
    """The message of a 200 body that is not the API's JSON object (an HTML error page from a proxy, an empty
    body): its size and first 60 characters (the page is not kept)."""
    why = "no reply and no usage: not billed, so it is retried"
    if not content.strip():
        return f"the HTTP 200 body is empty ({len(content):,} bytes): {why}"
    head = " ".join(content[:200].decode("utf-8", "replace").split())[:60]
    return f"the HTTP 200 body is not the API's JSON ({len(content):,} bytes, starting {head!r}): {why}"


def undecodable_reply(backend, content: bytes, exc: Exception, latency_s: float) -> "PaidReject":
    """The :class:`PaidReject` ``undecodable_reply`` of a 200 body that is not JSON (cut off, or another format):
    billed by a provider that bills it, so it is journaled once with the start of its raw text (``raw_reply``,
    at most :data:`RAW_REPLY_CHARS` characters, keys scrubbed) and never bought again."""
    import time

    raw = content[: RAW_REPLY_CHARS * 4].decode("utf-8", "replace")[:RAW_REPLY_CHARS]
    return PaidReject(
        "undecodable_reply",
        f"the HTTP 200 reply is not JSON ({len(content):,} bytes: {str(exc)[:120]}"
        "; cut off?): paid for, its raw text journaled, not bought again",
        {
            "backend": backend.name,
            "provider": backend.name,
            "model": backend.model,
            "latency_s": float(latency_s),
            "completed_at": time.time(),
            "raw_reply": raw,
        },
    )


def client_error(code) -> int | None:
    """The HTTP-like ``code`` of an error in a 200 body when it is a client error no retry can fix (4xx other than
    :data:`RETRYABLE_4XX`), else None (``"422"`` or ``422`` -> 422)."""
    try:
        c = int(code)
    except (TypeError, ValueError):
        return None
    return c if 400 <= c < 500 and c not in RETRYABLE_4XX else None


def configured_keys(backends: dict | None, environ=None) -> list[str]:
    """The values of every ``api_key_env`` of ``backends`` (config ``backends:``) that is set, longest first."""
    env = os.environ if environ is None else environ
    keys = {
        (env.get(b.get("api_key_env")) or "").strip()
        for b in (backends or {}).values()
        if isinstance(b, dict) and b.get("api_key_env")
    }
    return sorted((k for k in keys if k), key=len, reverse=True)


def scrub(text: str, keys) -> str:
    """``text`` with every key of ``keys`` replaced by ``[api key]`` (any length)."""
    for k in keys:
        if k:
            text = text.replace(k, "[api key]")
    return text


def key_in_text(text: str, keys) -> bool:
    """True if a key of ``keys`` (at least :data:`MIN_KEY_CHARS` characters: shorter ones are refused before any
    request, :func:`short_key_problem`) occurs in ``text``."""
    return any(len(k) >= MIN_KEY_CHARS and k in text for k in keys)


def short_key_problem(var: str, key: str) -> str | None:
    """Why the key in variable ``var`` can't be used (shorter than :data:`MIN_KEY_CHARS` characters), or None."""
    if len(key) >= MIN_KEY_CHARS:
        return None
    return (
        f"the key in {var} is {len(key)} character{'s' if len(key) != 1 else ''}; a key shorter than {MIN_KEY_CHARS} could be an ordinary word "
        "of a reply, so replies could not be checked for it (a reply saying 'test' would be refused, or a key "
        "echoed would be stored): use a longer key (a local server: start it with e.g. `--api-key "
        "$(python -c 'import secrets; print(secrets.token_hex(16))')`)"
    )


#: what a reply's model may add to the name asked for and still be that model: a version or a date
#: (``-2024-08-06``, ``-20241022``, ``-0905``, ``-v2``, ``@001``, ``-v1.5``), nothing else (``-mini`` is another)
_VERSION_SUFFIX = re.compile(r"[-_.:@]v?\d+(?:[-_.]\d+)*")
#: OpenRouter's routing variants of an id (``vendor/model:free``): the reply names the model without them
_ROUTING_VARIANT = re.compile(r":(free|beta|extended|thinking|online|nitro|floor|exacto)$")


def same_model(asked: str | None, replied: str | None) -> bool:
    """Whether a reply's ``model`` names the model asked for: the same id, or the id with a version or date suffix
    added (``openai/gpt-4o`` -> ``openai/gpt-4o-2024-08-06``), case-insensitive; the vendor prefix may be left out
    on either side, an OpenRouter routing variant (``:free``) of the asked id is ignored; unknown counts as the
    same. A shorter or other name (``vendor/model`` for ``vendor/model-x``, ``gpt-4o-mini`` for ``gpt-4o``) is
    another model."""
    if not asked or not replied:
        return True
    a = _ROUTING_VARIANT.sub("", asked.strip().lower())
    r = replied.strip().lower()
    if a == r:
        return True
    a_vendor, _, a_name = a.rpartition("/")
    r_vendor, _, r_name = r.rpartition("/")
    if a_vendor and r_vendor and a_vendor != r_vendor:
        return False
    return r_name == a_name or (r_name.startswith(a_name) and bool(_VERSION_SUFFIX.fullmatch(r_name[len(a_name) :])))


def text_bytes(fields: dict) -> int:
    """UTF-8 bytes of a reply's content, reasoning and tool calls."""
    return sum(len((fields.get(k) or "").encode("utf-8", "replace")) for k in ("content", "reasoning", "tool_calls"))


def check_reply(
    fields: dict, *, asked_model: str | None, keys=(), reject_other_models: bool = False, bad_bytes: int = 0
) -> str | None:
    """Raise :class:`PaidReject` for a reply that can't be kept (see the module docstring); return a warning
    (``"other_model: ..."``) for a reply from another model that is kept, else None.

    ``fields``: the parsed reply (RESPONSES fields); ``keys``: :func:`configured_keys`; ``bad_bytes``: bytes
    :func:`decode_json` replaced."""
    if bad_bytes:
        raise PaidReject(
            "invalid_utf8",
            f"the reply held {bad_bytes} byte(s) that are not UTF-8 (replaced by U+FFFD: not the model's text)",
            fields,
        )
    n = text_bytes(fields)
    billed = fields.get("completion_tokens")
    if billed is not None and n > MAX_BYTES_PER_TOKEN * int(billed) + SIZE_SLACK_BYTES:
        raise PaidReject(
            "reply_too_large",
            f"{n:,} bytes of text for {int(billed):,} billed completion tokens "
            f"(more than {MAX_BYTES_PER_TOKEN} bytes a token)",
            fields,
        )
    hit = [k for k, v in fields.items() if keys and isinstance(v, str) and key_in_text(v, keys)]
    if hit:
        raise PaidReject(
            "api_key_in_reply",
            f"the reply's {', '.join(hit)} quote{'s' if len(hit) == 1 else ''} a configured API key (not stored)",
            fields,
        )
    model = fields.get("model")
    if not same_model(asked_model, model):
        what = f"the reply names model {model!r}, not {asked_model!r} (a provider fallback?)"
        if reject_other_models:
            raise PaidReject("other_model", what + "; generation.reject_other_models is true", fields)
        return f"other_model: {what}"
    return None


#: the fields of a reply a paid reject's journal record keeps (no text: never the reply's content, a key, 10 MB)
REJECT_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_usd",
    "backend",
    "provider",
    "model",
    "latency_s",
    "completed_at",
    "finish_reason",
    "generation_id",
    "attempts",
)


#: of :data:`REJECT_FIELDS`, the strings (a provider's own words: scrubbed of the keys, cut to 200 characters)
REJECT_TEXT_FIELDS = ("model", "provider", "backend", "finish_reason", "generation_id")


def reject_record(exc: PaidReject, base: dict, keys=()) -> dict:
    """The journal record of a paid reject: ``base`` (request_key, sample_id, dataset, turn, messages, tools) with
    ``status`` ``failed``, ``error`` ``"<reason>: <message>"`` and :data:`REJECT_FIELDS` of the reply."""
    rec = {**base, **{k: exc.fields.get(k) for k in REJECT_FIELDS}}
    rec.update(
        status="failed",
        error=scrub(f"{exc.reason}: {exc.message}", keys)[:2000],
        reasoning=None,
        content=None,
        tool_calls=None,
        output_ids=None,
        prompt_ids=None,
    )
    for k in REJECT_TEXT_FIELDS:  # every text field kept: scrubbed
        if isinstance(rec.get(k), str):
            rec[k] = scrub(rec[k], keys)[:200]
    if exc.fields.get("raw_reply"):  # an undecodable reply's text: kept (scrubbed), in no RESPONSES column
        rec["raw_reply"] = scrub(exc.fields["raw_reply"], keys)
    return rec
