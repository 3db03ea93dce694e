"""OpenAI-compatible chat-completions client: request bodies, response parsing, retries, backend pool.

Backends (config ``backends:``): ``type`` openai (any OpenAI-compatible server: vLLM, ``transformers
serve``), openrouter, or sglang; ``base_url`` (``.../v1``), ``model``, ``api_key_env`` (the *name* of an
environment variable, or null), ``max_concurrency``, ``timeout_s``, optional ``requests_per_minute`` and
``tokens_per_minute`` (aiolimiter buckets; the token limit is charged *before* sending with the request's
estimated prompt tokens (body bytes / 4, or the prompt ids for native) + ``max_tokens``, as OpenAI-style TPM
limits count ``max_tokens`` up front). Backend request settings (not part of the request key):
``extra_body`` (merged into every body, e.g. SGLang ``chat_template_kwargs``/``separate_reasoning``),
``provider`` (OpenRouter routing: order, only, ignore, allow_fallbacks, quantizations, require_parameters,
data_collection ...) and ``reasoning`` (effort | max_tokens, exclude, enabled) put into the body,
``headers`` (non-secret; ``Authorization`` refused). ``native_generate: true`` (type sglang) sends
``POST {root}/generate`` with the target-rendered ``input_ids`` and keeps the exact ``output_ids``
(:func:`build_native_body`, :func:`parse_native_response`). ``cost_lookup: true`` (type openrouter) looks the
cost up by generation id when ``usage.cost`` is missing (:meth:`Backend.lookup_cost`; first retry after
``cost_lookup_delay_s``).

Failure policy (OpenRouter's and SGLang's documented error codes):
- retried with exponential backoff and jitter (tenacity), a bounded number of times: 429 (``Retry-After``
  honoured), 408/409/425/5xx, timeouts, connection errors/resets, malformed JSON, and errors inside an HTTP
  200 body (top-level ``error``, ``choices[].error``, ``finish_reason == "error"``, no choices, empty reply);
- 401, 402, 403 (except OpenRouter's moderation 403, which fails only its sample) raise
  :class:`FatalBackendError`: the job stops at once;
- other 4xx fail the sample without retry (reason ``http_<code>``).
Messages never contain the API key: it is only ever placed in the ``Authorization`` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..errors import ExpectedFailure
from ..schemas import INT32_END, is_token_ids

logger = logging.getLogger("eagle3_data.backends")

BACKEND_TYPES = ("openai", "openrouter", "sglang")
RETRYABLE_STATUS = {408, 409, 425, 429}
FATAL_STATUS = {401, 402, 403}
POOL_SHARD = 32  # connections per httpx client (see Backend.__init__)


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


class SampleError(Exception):
    """A permanent failure of one request (e.g. HTTP 400, moderation); not retried."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message


@dataclass
class BackendConfig:
    """One entry of config ``backends:`` (``launch`` is handled by :mod:`.server`)."""

    name: str
    type: str
    base_url: str
    model: str
    api_key_env: str | None = None
    max_concurrency: int = 8
    timeout_s: float = 300.0
    requests_per_minute: float | None = None
    launch: dict | None = None
    headers: dict = field(default_factory=dict)  # extra non-secret headers (e.g. X-Title)
    tokens_per_minute: float | None = None
    extra_body: dict = field(default_factory=dict)  # merged into every request body (backend setting)
    provider: dict | None = None  # OpenRouter provider routing
    reasoning: dict | None = None  # OpenRouter / SGLang reasoning settings
    native_generate: bool = False  # SGLang: POST {root}/generate with input_ids (exact output_ids)
    cost_lookup: bool = False  # OpenRouter: GET /generation?id= when usage.cost is missing
    cost_lookup_delay_s: float = 1.0  # first wait before a cost lookup retry (doubles, 5 tries)
    down_after_s: float = 30.0  # refused connections / only 5xx for this long: the backend is out for the job

    @classmethod
    def from_dict(cls, name: str, cfg: dict) -> "BackendConfig":
        missing = [k for k in ("type", "base_url", "model") if not cfg.get(k)]
        if missing:
            raise ValueError(f"backend {name!r}: missing config keys {missing}")
        if cfg["type"] not in BACKEND_TYPES:
            raise ValueError(f"backend {name!r}: type {cfg['type']!r} is not one of {BACKEND_TYPES}")
        conc = int(cfg.get("max_concurrency") or 8)
        if conc < 1:
            raise ValueError(f"backend {name!r}: max_concurrency must be >= 1, got {conc}")
        for k in ("extra_body", "headers", "provider", "reasoning"):
            if cfg.get(k) is not None and not isinstance(cfg[k], dict):
                raise ValueError(f"backend {name!r}: {k} must be a mapping, got {type(cfg[k]).__name__}")
        if cfg.get("provider") and cfg["type"] != "openrouter":
            raise ValueError(f"backend {name!r}: provider routing is an OpenRouter setting (type openrouter), "
                             f"not for type {cfg['type']!r}")
        if cfg.get("reasoning") and cfg["type"] not in ("openrouter", "sglang"):
            raise ValueError(f"backend {name!r}: reasoning settings need type openrouter or sglang")
        if cfg.get("native_generate") and cfg["type"] != "sglang":
            raise ValueError(f"backend {name!r}: native_generate needs type sglang, got {cfg['type']!r}")
        if cfg.get("cost_lookup") and cfg["type"] != "openrouter":
            raise ValueError(f"backend {name!r}: cost_lookup needs type openrouter, got {cfg['type']!r}")
        bad_headers = [h for h in (cfg.get("headers") or {}) if str(h).lower() in ("authorization", "x-api-key")]
        if bad_headers:
            raise ValueError(f"backend {name!r}: headers must not carry credentials ({bad_headers}); "
                             "name the key's environment variable in api_key_env")
        return cls(
            name=name,
            type=cfg["type"],
            base_url=str(cfg["base_url"]).rstrip("/"),
            model=str(cfg["model"]),
            api_key_env=cfg.get("api_key_env") or None,
            max_concurrency=conc,
            timeout_s=float(cfg.get("timeout_s") or 300.0),
            requests_per_minute=cfg.get("requests_per_minute"),
            launch=cfg.get("launch"),
            headers={str(k): str(v) for k, v in (cfg.get("headers") or {}).items()},
            tokens_per_minute=cfg.get("tokens_per_minute"),
            extra_body=dict(cfg.get("extra_body") or {}),
            provider=dict(cfg["provider"]) if cfg.get("provider") else None,
            reasoning=dict(cfg["reasoning"]) if cfg.get("reasoning") else None,
            native_generate=bool(cfg.get("native_generate", False)),
            cost_lookup=bool(cfg.get("cost_lookup", False)),
            cost_lookup_delay_s=float(cfg.get("cost_lookup_delay_s", 1.0)),
            down_after_s=float(cfg.get("down_after_s") or 30.0),
        )

    @property
    def root_url(self) -> str:
        """``base_url`` without a trailing ``/v1`` (SGLang's native endpoints live at the server root)."""
        return self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url

    def api_key(self) -> str | None:
        """The key from the environment variable ``api_key_env``; error names the variable, not a value."""
        if not self.api_key_env:
            return None
        key = (os.environ.get(self.api_key_env) or "").strip()  # a key pasted with its newline still works
        if not key:
            raise FatalBackendError(
                f"backend {self.name!r}: environment variable {self.api_key_env} (api_key_env) is not set or empty",
                hint=f"export {self.api_key_env}=<your key> and rerun the same command")
        if not all("!" <= ch <= "~" for ch in key):
            raise FatalBackendError(
                f"backend {self.name!r}: environment variable {self.api_key_env} (api_key_env) holds characters an "
                "HTTP header can't carry (whitespace inside the key, non-ASCII or control characters)",
                hint=f"set {self.api_key_env} to the key alone and rerun the same command")
        return key

    def scrub(self, text: str) -> str:
        """``text`` (from a server: error messages end up in logs and in failed rows) with this backend's API key
        replaced by ``[api key]`` (a server may echo the Authorization header) and unpaired surrogates by ``?``."""
        key = (os.environ.get(self.api_key_env) or "").strip() if self.api_key_env else ""
        if key:  # whatever its length: a local server's `--api-key abc` as well
            text = text.replace(key, "[api key]")
        return text.encode("utf-8", "replace").decode("utf-8")


#: the assistant-message field each backend type reads earlier turns' reasoning from (OpenRouter: ``reasoning``;
#: SGLang, vLLM, Moonshot and DeepSeek-style APIs: ``reasoning_content``)
HISTORY_REASONING_FIELD = {"openrouter": "reasoning", "sglang": "reasoning_content", "openai": "reasoning_content"}


def history_reasoning(backend_type: str, messages: list, thinking: bool) -> list:
    """Assistant history messages with their reasoning in the field backend type ``backend_type`` reads
    (:data:`HISTORY_REASONING_FIELD`; the prompt messages keep it under ``reasoning_content``, the field the chat
    templates read).

    ``thinking`` (the target reasons after this prompt): an assistant tool-call message without reasoning (a
    dataset turn: sources carry no reasoning) gets an empty one. Moonshot-style APIs answer HTTP 400 "thinking is
    enabled but reasoning_content is missing in assistant tool call message" otherwise, and an empty reasoning is
    what the Kimi, Qwen3 and GLM templates render for a turn without one (``<think></think>``), so the prompt the
    server renders is unchanged. Returns ``messages`` itself when nothing changes.
    """
    field_name = HISTORY_REASONING_FIELD.get(backend_type, "reasoning_content")
    out, changed = [], False
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            r = m.get("reasoning_content")
            if r is None and thinking and m.get("tool_calls"):
                r = ""
            if r is not None and (field_name != "reasoning_content" or "reasoning_content" not in m):
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
                m[field_name] = r
                changed = True
        out.append(m)
    return out if changed else messages


def build_body(backend: BackendConfig, messages: list, tools: list | None, sampling: dict, *,
               thinking: bool = False) -> dict:
    """Chat-completions request body: model, messages, tools, max_tokens, temperature, top_p, + extra fields.

    Assistant history reasoning goes in the field the backend reads (:func:`history_reasoning`; ``thinking``: the
    target reasons after this prompt, so tool-call turns without reasoning get an empty one).

    ``sampling`` keys: ``max_tokens``, ``temperature``, ``top_p`` (None values are left out) and
    ``extra_body`` (the dataset's ``generation.extra_body``: part of the request key).
    Merge order (later wins): sampling fields < backend ``extra_body`` (e.g. SGLang ``chat_template_kwargs``,
    ``separate_reasoning``) < backend ``provider`` / ``reasoning`` (OpenRouter routing and reasoning; SGLang
    accepts ``reasoning`` too) < ``sampling["extra_body"]``; ``stream`` is always false. Backend settings are
    not part of the request key (a response is the same request whichever backend served it).
    """
    body: dict[str, Any] = {"model": backend.model, "messages": history_reasoning(backend.type, messages, thinking)}
    if tools:
        body["tools"] = tools
    for k in ("max_tokens", "temperature", "top_p"):
        if sampling.get(k) is not None:
            body[k] = sampling[k]
    body.update(backend.extra_body)
    if backend.provider:
        body["provider"] = backend.provider
    if backend.reasoning:
        body["reasoning"] = backend.reasoning
    body.update(sampling.get("extra_body") or {})
    body["stream"] = False
    return body


#: ``generation.extra_body`` keys that are SGLang sampling parameters (moved into ``sampling_params`` natively)
NATIVE_SAMPLING_KEYS = frozenset({
    "top_k", "min_p", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_new_tokens", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n",
    "json_schema", "regex", "ebnf", "seed", "sampling_seed",
})


def build_native_body(backend: BackendConfig, input_ids: list[int], sampling: dict) -> dict:
    """SGLang native ``/generate`` body: ``{"input_ids", "sampling_params": {max_new_tokens, temperature,
    top_p, ...}}`` (SGLang's native API).

    ``max_tokens`` becomes ``max_new_tokens`` (SGLang's default is only 128, so it is always sent when set);
    ``sampling["extra_body"]`` keys that are sampling parameters (:data:`NATIVE_SAMPLING_KEYS`) go into
    ``sampling_params``, ``chat_template_kwargs`` was applied when the prompt ids were rendered, and other chat-API
    fields (``separate_reasoning``, ``reasoning`` ...) have no meaning here and are left out. Backend
    ``extra_body`` is merged at the top level (its ``sampling_params`` mapping into ``sampling_params``).
    """
    sp: dict[str, Any] = {}
    if sampling.get("max_tokens") is not None:
        sp["max_new_tokens"] = int(sampling["max_tokens"])
    for k in ("temperature", "top_p"):
        if sampling.get(k) is not None:
            sp[k] = sampling[k]
    extra = dict(backend.extra_body)
    sp.update(extra.pop("sampling_params", None) or {})
    for k, v in (sampling.get("extra_body") or {}).items():
        if k in NATIVE_SAMPLING_KEYS:
            sp[k] = v
    body: dict[str, Any] = {"input_ids": list(input_ids)}
    body.update(extra)
    body["sampling_params"] = sp
    body["stream"] = False
    return body


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


def _int(v) -> int | None:
    """A usage count: an int in [0, INT32_END), else None (null, bool, text, NaN/inf, negative, absurd: a count past
    int32 is no real token count, and sums of real ones never overflow int64)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if 0 <= n < INT32_END else None


def _cost(v) -> float | None:
    """``usage.cost``: a finite float >= 0, else None (never NaN: it would not survive JSON -> arrow)."""
    try:
        c = None if v is None or isinstance(v, bool) else float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return c if c is not None and math.isfinite(c) and c >= 0 else None


def _text(field: str, v) -> str | None:
    """A text field of a reply: the string, or None if not a string. A string that is not valid Unicode (an
    unpaired surrogate from a ``\\ud800`` escape) can be neither journaled as UTF-8 nor tokenized: the reply is
    retried (reason ``invalid_unicode``) instead of crashing the job."""
    if not isinstance(v, str):
        return None
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RetryableError("invalid_unicode", f"{field} has an unpaired surrogate at character {exc.start}") from None
    return v


def _parts_text(v):
    """A message field as text: a string as is; a list of content parts (``[{"type": "text", "text": ...}]``, as
    some providers send) joined; anything else unchanged (then dropped by :func:`_text`)."""
    if isinstance(v, list):
        parts = [p["text"] for p in v if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts) if parts else None
    return v


def _token_ids(v) -> list[int] | None:
    """Token ids as returned (a non-empty :func:`schemas.is_token_ids` list), else None."""
    return v if v and is_token_ids(v) else None


def parse_response(backend: BackendConfig, content: bytes, latency_s: float) -> dict:
    """Parse a 200 chat-completions body into RESPONSES fields.

    Returns keys: reasoning, content, tool_calls (JSON text or None), finish_reason, prompt_tokens,
    completion_tokens, reasoning_tokens, cost_usd (``usage.cost``, OpenRouter credits = USD), backend,
    provider (OpenRouter top-level ``provider``, else the backend name), model, latency_s, output_ids
    (``choices[0].token_ids`` / ``output_ids`` when the server returns them), completed_at.
    Raises :class:`RetryableError` for malformed JSON and errors inside the body, :class:`SampleError`
    ``http_<code>`` for a client error in the body that no retry can fix (:func:`eagle3_data.paid.client_error`).
    A valid JSON body holding bytes that are not UTF-8 is decoded with replacements (it was paid for): the count
    of replaced bytes is returned under ``_bad_bytes`` (the caller makes the sample a paid reject).
    """
    from ..paid import client_error, decode_json

    try:
        data, bad_bytes = decode_json(content)
    except ValueError as exc:
        raise RetryableError("malformed_json", f"{exc} (body starts {content[:80]!r})") from None
    if not isinstance(data, dict):
        raise RetryableError("malformed_json", "body is not a JSON object")
    err = data.get("error")
    if err:
        code = err.get("code") if isinstance(err, dict) else None
        msg = (err.get("message") if isinstance(err, dict) else str(err)) or str(err)
        if code in (401, 402) or str(code) in ("401", "402"):
            raise FatalBackendError(f"backend {backend.name!r} ({backend.base_url}): error {code} inside a 200 body: "
                                    f"{msg[:300]}", hint="check the key and its credits, then rerun the same command")
        if client_error(code):
            raise SampleError(f"http_{client_error(code)}", f"error {code} inside a 200 body: {str(msg)[:300]}")
        raise RetryableError("error_in_body", str(msg)[:300])
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RetryableError("no_choices", "response has no choices")
    choice = choices[0]
    if choice.get("error"):
        cerr = choice["error"]
        raise RetryableError("error_in_body", str(cerr.get("message") if isinstance(cerr, dict) else cerr)[:300])
    finish = choice.get("finish_reason")
    if finish == "error":
        raise RetryableError("error_in_body", "finish_reason is 'error'")
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise RetryableError("malformed_json", "choices[0].message missing")
    content_text = _parts_text(msg.get("content"))
    reasoning = _parts_text(msg.get("reasoning"))
    if reasoning is None:
        reasoning = _parts_text(msg.get("reasoning_content"))
    tool_calls = msg.get("tool_calls") or None
    if tool_calls is not None and not (isinstance(tool_calls, list) and all(isinstance(t, dict) for t in tool_calls)):
        raise RetryableError("malformed_json", f"tool_calls is not a list of objects: {str(tool_calls)[:100]}")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    completion_tokens = _int(usage.get("completion_tokens"))
    if not content_text and not reasoning and not tool_calls and not completion_tokens:
        raise RetryableError("empty_response", "no content, reasoning or tool calls")
    details = usage.get("completion_tokens_details")
    details = details if isinstance(details, dict) else {}
    reasoning_tokens = _int(details.get("reasoning_tokens"))
    if reasoning_tokens is None:
        reasoning_tokens = _int(usage.get("reasoning_tokens"))  # SGLang: top-level
    provider = data.get("provider") if backend.type == "openrouter" else None
    # every value is checked to be what the journal (UTF-8 JSON) and the RESPONSES parquet can hold
    return {
        "reasoning": _text("reasoning", reasoning),
        "content": _text("content", content_text),
        "tool_calls": _text("tool_calls", json.dumps(tool_calls, ensure_ascii=False)) if tool_calls else None,
        "finish_reason": _text("finish_reason", finish),
        "prompt_tokens": _int(usage.get("prompt_tokens")),
        "completion_tokens": completion_tokens,
        "reasoning_tokens": reasoning_tokens,
        "cost_usd": _cost(usage.get("cost")),
        "backend": backend.name,
        "provider": _text("provider", str(provider)) if provider else backend.name,
        "model": _text("model", str(data.get("model") or backend.model)),
        "latency_s": float(latency_s),
        "output_ids": _token_ids(choice.get("token_ids") or choice.get("output_ids")),
        "completed_at": time.time(),
        "generation_id": _text("generation_id", str(data["id"])) if data.get("id") else None,
        **({"_bad_bytes": bad_bytes} if bad_bytes else {}),
    }


def prompt_think_state(target, prompt_ids: list[int]) -> str:
    """``"none" | "open" | "closed"``: whether the prompt ids already opened (or opened and closed) the think
    block after the last role/end-of-turn marker (id-level twin of ``TargetTokens.think_state``)."""
    if target is None or target.think_open_id is None:
        return "none"
    bound = set(target.role_marker_ids) | set(target.end_ids)
    o = c = -1
    for i in range(len(prompt_ids) - 1, -1, -1):
        t = prompt_ids[i]
        if t in bound:
            break
        if t == target.think_open_id and o < 0:
            o = i
        elif t == target.think_close_id and c < 0:
            c = i
    if o < 0:
        return "none"
    return "closed" if c > o else "open"


def split_output_ids(target, output_ids: list[int], state: str = "none") -> tuple[str | None, str]:
    """Split a completion's ids into ``(reasoning, content)`` text at the target's ``</think>`` id.

    Trailing end-of-turn ids are not text. For a reasoning target: the ids between ``<think>`` (or the prompt's
    open think block, ``state == "open"``) and ``</think>`` are the reasoning, the ids after it the content; no
    ``</think>`` in the output means everything is reasoning when the block was opened (truncated thinking), else
    everything is content. A non-reasoning target: all content, reasoning None. Decoded with special tokens kept
    and no space clean-up, so the tokenize stage's ``exact`` check sees the same text.
    """
    ids = list(output_ids)
    while ids and ids[-1] in target.end_ids:
        ids.pop()
    close, open_ = target.think_close_id, target.think_open_id
    r_ids: list[int] | None = None
    if target.fmt.reasoning and close is not None:
        if close in ids:
            j = ids.index(close)
            pre, ids = ids[:j], ids[j + 1:]
            r_ids = pre[pre.index(open_) + 1:] if open_ in pre else pre
        elif open_ in ids[:2] or state == "open":
            r_ids = ids[ids.index(open_) + 1:] if open_ in ids[:2] else ids
            ids = []
    if r_ids is None:
        return None, target.decode_batch([ids])[0] if ids else ""
    r, c = target.decode_batch([r_ids, ids])
    return r, c


def parse_native_response(backend: BackendConfig, content: bytes, latency_s: float, target,
                          think_state: str = "none") -> dict:
    """Parse an SGLang ``/generate`` body (``{"text", "output_ids", "meta_info": {"finish_reason": {"type":
    stop|length|abort, ...}, "prompt_tokens", "completion_tokens"}}``) into RESPONSES fields.

    ``output_ids`` are stored as returned (the completion, with or without the stop id); reasoning/content are
    decoded from them with the target tokenizer (:func:`split_output_ids`). ``finish_reason`` is ``stop`` or
    ``length``; ``abort`` and a missing/malformed ``output_ids`` raise :class:`RetryableError`.
    """
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise RetryableError("malformed_json", f"{exc} (body starts {content[:80]!r})") from None
    if isinstance(data, list) and len(data) == 1:  # batch of one
        data = data[0]
    if not isinstance(data, dict):
        raise RetryableError("malformed_json", "body is not a JSON object")
    if data.get("error"):
        err = data["error"]
        raise RetryableError("error_in_body", str(err.get("message") if isinstance(err, dict) else err)[:300])
    meta = data.get("meta_info") if isinstance(data.get("meta_info"), dict) else {}
    fr = meta.get("finish_reason")
    ftype = fr.get("type") if isinstance(fr, dict) else fr
    if ftype == "abort":
        msg = fr.get("message") if isinstance(fr, dict) else None
        raise RetryableError("aborted", str(msg or "request aborted by the server")[:300])
    ids = _token_ids(data.get("output_ids"))
    if ids is None:
        raise RetryableError("empty_response", "no output_ids (non-empty list of ids in [0, 2**31)) in the "
                                               "/generate reply")
    finish = "length" if ftype == "length" else "stop"
    state = think_state
    reasoning, text = split_output_ids(target, ids, state)
    rtok = None
    if reasoning is not None and target.think_close_id in ids:
        rtok = ids.index(target.think_close_id) + 1
    return {
        "reasoning": reasoning,
        "content": text,
        "tool_calls": None,
        "finish_reason": finish,
        "prompt_tokens": _int(meta.get("prompt_tokens")),
        "completion_tokens": _int(meta.get("completion_tokens")) or len(ids),
        "reasoning_tokens": rtok,
        "cost_usd": None,
        "backend": backend.name,
        "provider": backend.name,
        "model": backend.model,
        "latency_s": float(latency_s),
        "output_ids": ids,
        "completed_at": time.time(),
    }


def _cause_text(exc: BaseException) -> str:
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


class Backend:
    """A live backend: config + httpx.AsyncClient (pool sized to this job's cap) + in-flight count.

    Concurrency: at most ``cap`` requests in flight from this job (default ``max_concurrency``); with ``slots`` (a
    :class:`.limits.HostSlots` shared by the jobs of a run on this machine) each request also holds one of the
    backend's ``max_concurrency`` slots, so the limit holds over all jobs together (see :class:`BackendPool`).
    Rate limits (``requests_per_minute``, ``tokens_per_minute``): this job sends at ``rate_share`` of them
    (1 / the jobs that use the backend, in a workflow run), so the jobs together stay under them.

    Health: ``eject_after`` consecutive backend faults (connection refused, 5xx) take it out of rotation for
    ``eject_s`` seconds; its requests go to the other backends meanwhile. A backend whose every attempt ended in such
    a fault for ``cfg.down_after_s`` seconds (no success in between) is *down*: out for the rest of the job, and when
    every backend of the job is down the job stops (:class:`BackendDown`, naming the backend, its URL and the last
    error).
    """

    def __init__(self, cfg: BackendConfig, *, eject_after: int = 20, eject_s: float = 30.0, cap: int | None = None,
                 slots=None, rate_share: float = 1.0):
        self.cfg = cfg
        self.name = cfg.name
        self.in_flight = 0
        self.cap = int(cap or cfg.max_concurrency)
        self.slots = slots  # HostSlots or None
        if slots is not None:
            slots.register()
        self.held = 0  # host slots this job holds (in use: in_flight of them; the rest kept for waiting requests)
        self.host_blocked = False  # the last try found this job under its cap but no host slot free
        self.eject_after = eject_after
        self.eject_s = min(eject_s, max(1.0, cfg.down_after_s / 3))  # ejections never hide a dead backend for long
        self.consecutive_faults = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.fault_since: float | None = None  # first backend fault since the last success
        self.fault_count = 0
        self.last_error: str | None = None
        self.down: str | None = None  # why the backend is out for good
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
        n = self.cap
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
            )
            for c in caps
        ]
        self._load = [0] * k
        self.client = self.clients[0]
        self.limiter = None
        self.token_limiter = None
        # this job's share of the backend's rate limits (1 / the jobs that use it: together they never pass them)
        self.rpm = float(cfg.requests_per_minute) * rate_share if cfg.requests_per_minute else None
        self.tpm = float(cfg.tokens_per_minute) * rate_share if cfg.tokens_per_minute else None
        if self.rpm or self.tpm:
            from aiolimiter import AsyncLimiter

            if self.rpm:
                self.limiter = AsyncLimiter(self.rpm, 60.0)
            if self.tpm:
                self.token_limiter = AsyncLimiter(self.tpm, 60.0)
        self.cost_lookups = 0
        self.cost_lookup_misses = 0

    def available(self, now: float) -> bool:
        """True if a request may be sent now (takes a host slot for it when slots are shared: the caller then
        counts it in ``in_flight``)."""
        if self.down or self.in_flight >= self.cap or now < self.ejected_until:
            return False
        if self.slots is None or self.held > self.in_flight:
            return True
        if self.held >= self.slots.fair_share():
            # holding its share, this job is nobody's reason to yield: a mark left from an earlier wait would make
            # every job at its share yield to every other one while slots lie free
            self.slots.starving(False)
            if self.slots.starving():
                self.host_blocked = False  # yielding to a job that waits: our own released slots wake us
                return False
        if self.slots.try_take():
            self.held += 1
            self.host_blocked = False
            self.slots.starving(False)
            return True
        self.host_blocked = True
        self.slots.starving(True)
        return False

    def put_back(self, keep: bool) -> None:
        """A request ended: keep its host slot for a waiting request of this job (``keep``) unless this job holds more
        than its fair share while another job waits; return the slots held beyond those in use otherwise."""
        if self.slots is None or self.held <= self.in_flight:
            return
        spare = self.held - self.in_flight
        if keep:
            over = self.held - self.slots.fair_share()
            if over <= 0 or not self.slots.starving():
                return
            spare = min(spare, over)
        else:
            self.slots.starving(False)
        self.slots.give(spare)
        self.held -= spare

    def record(self, ok: bool, backend_fault: bool = False, error: str | None = None) -> None:
        """Count a request's outcome. ``backend_fault`` (refused connection, 5xx) with ``error`` (reason: text)
        counts toward an ejection and toward being down (see the class docstring)."""
        if ok:
            self.consecutive_faults = 0
            self.fault_since = None
            self.fault_count = 0
            return
        if backend_fault:
            now = time.monotonic()
            self.last_error = error or self.last_error
            if self.fault_since is None:
                self.fault_since = now
            self.fault_count += 1
            self.consecutive_faults += 1
            if self.check_down(now):
                return
            if self.consecutive_faults >= self.eject_after:
                self.ejected_until = time.monotonic() + self.eject_s
                self.ejections += 1
                self.consecutive_faults = 0
                logger.warning(
                    "backend %s: %d consecutive failures, out of rotation for %.0f s",
                    self.name, self.eject_after, self.eject_s,
                )

    def check_down(self, now: float) -> bool:
        """Whether the backend is down: every attempt (at least 3) since ``fault_since`` ended in a backend fault and
        ``down_after_s`` have passed since the first (checked at each fault and by :meth:`BackendPool.watch`)."""
        if not self.down and self.fault_since is not None and self.fault_count >= 3 \
                and now - self.fault_since >= self.cfg.down_after_s:
            err = self.last_error or ""
            what = ("refused connections" if err.startswith("connection_error")
                    else "answered only HTTP 5xx" if err.startswith("http_5") else "failed")
            self.down = (f"{what} for {now - self.fault_since:.0f} s ({self.fault_count} attempts, none succeeded; "
                         f"backends.{self.name}.down_after_s is {self.cfg.down_after_s:g})")
        return bool(self.down)

    async def _limits(self, est_tokens: int) -> None:
        if self.limiter is not None:
            await self.limiter.acquire()
        if self.token_limiter is not None:
            # charged up front (estimated prompt + max_tokens), as OpenAI-style TPM limits count max_tokens
            await self.token_limiter.acquire(min(float(max(1, est_tokens)), self.tpm))

    async def post_chat(self, body: bytes, est_tokens: int = 1) -> dict:
        """POST one chat completion; return parsed fields or raise Retryable/Sample/FatalBackendError.

        ``est_tokens``: the request's estimated prompt + max_tokens, charged to ``tokens_per_minute``."""
        await self._limits(est_tokens)
        t0 = time.monotonic()
        try:
            resp = await self._post("/chat/completions", body)
            check_status(self.cfg, resp)
            return parse_response(self.cfg, resp.content, time.monotonic() - t0)
        except (RetryableError, SampleError, FatalBackendError) as exc:
            raise self._scrubbed(exc) from None

    async def post_native(self, body: bytes, target, think_state: str, est_tokens: int = 1) -> dict:
        """POST one SGLang ``/generate`` request (at the server root); return parsed fields (see
        :func:`parse_native_response`) or raise Retryable/Sample/FatalBackendError."""
        await self._limits(est_tokens)
        t0 = time.monotonic()
        try:
            resp = await self._post(self.cfg.root_url + "/generate", body)
            check_status(self.cfg, resp)
            return parse_native_response(self.cfg, resp.content, time.monotonic() - t0, target, think_state)
        except (RetryableError, SampleError, FatalBackendError) as exc:
            raise self._scrubbed(exc) from None

    def _scrubbed(self, exc: Exception) -> Exception:
        """``exc`` with its message scrubbed (:meth:`BackendConfig.scrub`): it reaches logs and failed rows."""
        if isinstance(exc, (RetryableError, SampleError)):
            exc.message = self.cfg.scrub(exc.message)
            exc.args = (f"{exc.reason}: {exc.message}" if exc.message else exc.reason,)
        elif isinstance(exc, ExpectedFailure):
            exc.message = self.cfg.scrub(exc.message)
            exc.args = (exc.message,)
        else:
            exc.args = tuple(self.cfg.scrub(str(a)) for a in exc.args)
        return exc

    async def lookup_cost(self, generation_id: str, attempts: int = 5) -> float | None:
        """OpenRouter ``GET {base_url}/generation?id=...`` -> ``data.total_cost`` (USD), or None.

        Stats appear only after accounting finishes, so a 404 is retried after ``cost_lookup_delay_s`` (doubling,
        ``attempts`` tries); any other failure gives None (the response is kept without a cost)."""
        delay = self.cfg.cost_lookup_delay_s
        self.cost_lookups += 1
        for n in range(attempts):
            try:
                async with asyncio.timeout(self.cfg.timeout_s):  # a whole-request deadline, as in _post
                    resp = await self.clients[0].get("/generation", params={"id": generation_id})
            except (httpx.HTTPError, TimeoutError) as exc:
                logger.debug("backend %s: cost lookup %s failed: %s", self.name, generation_id, type(exc).__name__)
                resp = None
            if resp is not None and resp.status_code == 200:
                try:
                    data = resp.json().get("data")
                    cost = _cost(data.get("total_cost")) if isinstance(data, dict) else None
                    if cost is not None:
                        return cost
                    break  # no usable cost in the stats
                except (ValueError, AttributeError, TypeError):
                    break
            if resp is not None and resp.status_code not in (404, 429) and resp.status_code < 500:
                break
            if n + 1 < attempts:
                await asyncio.sleep(delay * 2**n)
        self.cost_lookup_misses += 1
        return None

    async def _post(self, url: str, body: bytes) -> httpx.Response:
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
            raise RetryableError("connection_error", f"{type(exc).__name__}: {_cause_text(exc)[:200]}",
                                 backend_fault=isinstance(exc, httpx.ConnectError)) from None
        except httpx.HTTPError as exc:  # a body that fails to decode (Content-Encoding), another protocol error
            raise RetryableError("http_error", f"{type(exc).__name__}: {str(exc)[:200]}") from None
        finally:
            self._load[i] -= 1

    async def aclose(self) -> None:
        if self.slots is not None:
            self.slots.give(self.held)
            self.held = 0
            self.slots.starving(False)
            self.slots.register(False)
        for c in self.clients:
            await c.aclose()


class BackendPool:
    """Backends in priority order: a request takes the first backend with a free slot (overflow goes on).

    ``async with pool.slot() as backend:`` waits until some backend in rotation has capacity. With host slots
    (:class:`.limits.HostSlots`), a request that ends hands its slot to a request of this job waiting for one, else
    gives it back to the other jobs; while requests wait only because other jobs hold every slot, one of them polls
    for a freed slot every ``poll_s`` (doubling to ``poll_max_s``). Raises :class:`BackendDown` when every backend
    is down.
    """

    def __init__(self, backends: list[Backend], *, poll_s: float = 0.02, poll_max_s: float = 0.25):
        if not backends:
            raise ValueError("BackendPool needs at least one backend")
        self.backends = backends
        self._cond = asyncio.Condition()
        self._waiting = 0
        self._poller: asyncio.Task | None = None
        self.poll_s, self.poll_max_s = poll_s, poll_max_s
        self._poll = poll_s

    @property
    def capacity(self) -> int:
        return sum(b.cap for b in self.backends)

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends)

    def check_down(self) -> None:
        """Raise :class:`BackendDown` if every backend is down (naming each, its URL and its last error)."""
        if all(b.down for b in self.backends):
            raise BackendDown("; ".join(f"backend {b.name!r} ({b.cfg.base_url}) {b.down}; last error: {b.last_error}"
                                        for b in self.backends))

    async def watch(self, interval_s: float = 1.0) -> None:
        """Every ``interval_s``: mark backends down whose faults have lasted ``down_after_s`` (even while no request
        is being tried: all backing off or the backend ejected), wake the waiters, and raise :class:`BackendDown`
        when every backend is down (run it beside the requests; cancel it when they are done)."""
        logged: set[str] = set()
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            changed = [b for b in self.backends if not b.down and b.check_down(now)]
            if changed:
                async with self._cond:
                    self._cond.notify_all()
            self.check_down()
            for b in self.backends:  # (when all are down, BackendDown above says it all)
                if b.down and b.name not in logged:
                    logged.add(b.name)
                    logger.warning("backend %s (%s) is out for this job: it %s; last error: %s; its requests go to "
                                   "the other backends", b.name, b.cfg.base_url, b.down, b.last_error)

    async def acquire(self, avoid: Backend | None = None) -> Backend:
        """The first backend in priority order with a free slot. ``avoid`` (the backend whose fault ended a
        request's last attempt) is skipped, waiting for another one's slot, while another backend is in rotation
        (not ejected); it is used only when it is the only one left."""
        me = asyncio.current_task()
        async with self._cond:
            self._waiting += 1
            try:
                while True:
                    self.check_down()
                    now = time.monotonic()
                    choices = self.backends
                    if avoid is not None and any(b is not avoid and not b.down and now >= b.ejected_until
                                                 for b in self.backends):
                        choices = [b for b in self.backends if b is not avoid]
                    for b in choices:
                        if b.available(now):
                            b.in_flight += 1
                            self._poll = self.poll_s
                            if self._waiting > 1:
                                # the next waiter tries too: host slots that other jobs gave back are taken by as
                                # many waiters as need them, not one per release of this job's own (a job that got
                                # few slots at the start would otherwise stay at that count while slots lie free)
                                self._cond.notify(1)
                            return b
                    # all busy or ejected: wake on release, when the earliest ejection ends, or (one waiter) to poll
                    # for a host slot another job gave back
                    wake = [b.ejected_until - now for b in self.backends if b.ejected_until > now and not b.down]
                    if any(b.host_blocked and not b.down for b in choices) and self._poller in (None, me):
                        self._poller = me
                        wake.append(self._poll)
                        self._poll = min(self.poll_max_s, self._poll * 2)
                    timeout = max(0.01, min(wake)) if wake else None
                    try:  # asyncio.timeout, not wait_for: the wait (and its lock) stays in this task when cancelled
                        async with asyncio.timeout(timeout):
                            await self._cond.wait()
                    except TimeoutError:
                        pass
            finally:
                self._waiting -= 1
                if not self._waiting:  # nobody here waits for a slot any more (they took one, maybe elsewhere)
                    for b in self.backends:
                        if b.slots is not None:
                            b.slots.starving(False)
                if self._poller is me:
                    self._poller = None
                    self._cond.notify(1)  # another waiter takes over the polling

    async def release(self, b: Backend) -> None:
        async with self._cond:
            b.in_flight -= 1
            b.put_back(keep=self._waiting > 0)
            self._cond.notify(1)

    def slot(self, avoid: Backend | None = None) -> "_Slot":
        return _Slot(self, avoid)

    async def aclose(self) -> None:
        for b in self.backends:
            await b.aclose()


class _Slot:
    """``async with pool.slot() as backend``: a backend slot held for the block (one small object per request)."""

    __slots__ = ("avoid", "backend", "pool")

    def __init__(self, pool: BackendPool, avoid: Backend | None = None):
        self.pool = pool
        self.avoid = avoid
        self.backend: Backend | None = None

    async def __aenter__(self) -> Backend:
        self.backend = await self.pool.acquire(self.avoid)
        return self.backend

    async def __aexit__(self, *exc) -> None:
        await self.pool.release(self.backend)


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
