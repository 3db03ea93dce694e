"""The OpenAI chat-completions dialect (``POST {base_url}/chat/completions``): request bodies and reply parsing.

A backend of any type speaks it unless it has ``native_generate`` (:mod:`.native`). :func:`encode` and
:func:`parse` are what :class:`.pool.Backend` calls; :func:`build_body` and :func:`parse_response` do the work.
"""

from __future__ import annotations

import json
import time
from typing import Any

from . import codec
from .errors import FatalBackendError, RetryableError, SampleError
from .fields import as_cost, as_count, as_text, as_token_ids, parts_text
from .request import Payload, Request
from .definition import BackendConfig
from ..images import ImageProblem, request_messages


def url(backend: BackendConfig) -> str:
    """Where the request goes, relative to ``base_url``."""
    return "/chat/completions"


def encode(backend: BackendConfig, request: Request) -> Payload:
    """The request's body as UTF-8 JSON bytes; ``est_tokens`` (charged to ``tokens_per_minute``): body bytes / 4 +
    ``max_tokens``."""
    body = codec.dumps(
        build_body(backend, request.messages, request.tools, request.sampling, thinking=request.thinking)
    )
    return Payload(body, len(body) // 4 + int(request.sampling.get("max_tokens") or 0))


def parse(backend: BackendConfig, content: bytes, latency_s: float, payload: Payload) -> dict:
    """RESPONSES fields of a 200 reply (:func:`parse_response`)."""
    return parse_response(backend, content, latency_s)


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


def build_body(
    backend: BackendConfig, messages: list, tools: list | None, sampling: dict, *, thinking: bool = False
) -> dict:
    """Chat-completions request body: model, messages, tools, max_tokens, temperature, top_p, + extra fields.

    An image part (:mod:`eagle3_data.images`) goes as a ``data:`` URL of its file (:class:`SampleError`
    ``image_missing`` when the file is gone or changed). Assistant history reasoning goes in the field the backend
    reads (:func:`history_reasoning`; ``thinking``: the target reasons after this prompt, so tool-call turns without
    reasoning get an empty one).

    ``sampling`` keys: ``max_tokens``, ``temperature``, ``top_p`` (None values are left out) and
    ``extra_body`` (the dataset's ``generation.extra_body``: part of the request key).
    Merge order (later wins): sampling fields < backend ``extra_body`` (e.g. SGLang ``chat_template_kwargs``,
    ``separate_reasoning``) < backend ``provider`` / ``reasoning`` (OpenRouter routing and reasoning; SGLang
    accepts ``reasoning`` too) < ``sampling["extra_body"]``; ``stream`` is always false. A backend with
    ``return_token_ids`` (vLLM >= 0.10.2) gets ``"return_token_ids": true`` last (nothing overrides it; a backend
    without it gets no such key: its bodies are byte for byte what they were). Backend settings are not part of
    the request key (a response is the same request whichever backend served it).
    """
    try:
        messages = request_messages(messages)
    except ImageProblem as exc:
        raise SampleError(exc.reason, exc.detail) from None
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
    if backend.return_token_ids:
        body["return_token_ids"] = True
    return body


def body_error(backend: BackendConfig, err, where: str) -> None:
    """Raise for an ``error`` inside a 200 body (``where``: ``""`` for the top level, ``"choices[0]."`` ...):
    :class:`FatalBackendError` for a 401/402 code, :class:`SampleError` ``http_<code>`` for a client error no
    retry can fix (:func:`eagle3_data.backends.paid.client_error`), else :class:`RetryableError` ``error_in_body``."""
    from .paid import client_error

    code = err.get("code") if isinstance(err, dict) else None
    msg = str((err.get("message") if isinstance(err, dict) else str(err)) or err)
    at = f" ({where}error)" if where else ""
    if code in (401, 402) or str(code) in ("401", "402"):
        raise FatalBackendError(
            f"backend {backend.name!r} ({backend.base_url}): error {code} inside a 200 body{at}: {msg[:300]}",
            hint="check the key and its credits, then rerun the same command",
        )
    if client_error(code):
        raise SampleError(f"http_{client_error(code)}", f"error {code} inside a 200 body{at}: {msg[:300]}")
    raise RetryableError("error_in_body", msg[:300])


def parse_response(backend: BackendConfig, content: bytes, latency_s: float) -> dict:
    """Parse a 200 chat-completions body into RESPONSES fields.

    Returns keys: reasoning, content, tool_calls (JSON text or None), finish_reason, prompt_tokens,
    completion_tokens, reasoning_tokens, cost_usd (``usage.cost``, OpenRouter credits = USD), backend,
    provider (OpenRouter top-level ``provider``, else the backend name), model, latency_s, output_ids
    (``choices[0].token_ids`` / ``output_ids`` when the server returns them), prompt_ids (vLLM's top-level
    ``prompt_token_ids`` with ``return_token_ids``, else None), completed_at, generation_id (the body's ``id``),
    system_fingerprint (the body's ``system_fingerprint``: the server's engine build, when it reports one).
    Raises :class:`RetryableError` for an unusable reply shape and errors inside the body, :class:`SampleError`
    ``http_<code>`` for a client error in the body (top level or any ``choices[i].error``) that no retry can fix
    (:func:`eagle3_data.backends.paid.client_error`), :class:`eagle3_data.backends.paid.PaidReject` ``undecodable_reply`` for a body
    that starts as the API's JSON object and is cut off (billed, so journaled raw once and never bought again) and
    ``invalid_unicode`` for a reply whose text holds an unpaired surrogate (``"\\udfff"``: billed, not storable),
    :class:`RetryableError` ``not_api_reply`` for a body that is not a JSON object at all (an HTML error page, an
    empty body: no usage, not billed, so retried as an unpaid failure).
    A valid JSON body holding bytes that are not UTF-8 is decoded with replacements (it was paid for): the count
    of replaced bytes is returned under ``_bad_bytes`` (the caller makes the sample a paid reject).
    """
    from .paid import decode_json, not_api_reply, undecodable_reply

    if content.lstrip()[:1] != b"{":  # an HTML page, an empty body: not the API's reply, no usage, not billed
        raise RetryableError("not_api_reply", not_api_reply(content))
    try:
        data, bad_bytes = decode_json(content)
    except ValueError as exc:  # the API's JSON cut off: billed all the same, never bought again
        raise undecodable_reply(backend, content, exc, latency_s) from None
    if not isinstance(data, dict):
        raise RetryableError("malformed_json", "body is not a JSON object")
    err = data.get("error")
    if err:
        body_error(backend, err, "")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RetryableError("no_choices", "response has no choices")
    for i, c in enumerate(choices):  # a client error in any choice fails at once, as at the top level
        if isinstance(c, dict) and c.get("error"):
            body_error(backend, c["error"], f"choices[{i}].")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish == "error":
        raise RetryableError("error_in_body", "finish_reason is 'error'")
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise RetryableError("malformed_json", "choices[0].message missing")
    content_text = parts_text(msg.get("content"))
    reasoning = parts_text(msg.get("reasoning"))
    if reasoning is None:
        reasoning = parts_text(msg.get("reasoning_content"))
    tool_calls = msg.get("tool_calls") or None
    if tool_calls is not None and not (isinstance(tool_calls, list) and all(isinstance(t, dict) for t in tool_calls)):
        raise RetryableError("malformed_json", f"tool_calls is not a list of objects: {str(tool_calls)[:100]}")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    completion_tokens = as_count(usage.get("completion_tokens"))
    if not content_text and not reasoning and not tool_calls and not completion_tokens:
        raise RetryableError("empty_response", "no content, reasoning or tool calls")
    details = usage.get("completion_tokens_details")
    details = details if isinstance(details, dict) else {}
    reasoning_tokens = as_count(details.get("reasoning_tokens"))
    if reasoning_tokens is None:
        reasoning_tokens = as_count(usage.get("reasoning_tokens"))  # SGLang: top-level
    provider = data.get("provider") if backend.type == "openrouter" else None
    bad_text: list[str] = []  # the fields holding text that is not valid Unicode (the reply is billed all the same)

    def text(field: str, v):
        try:
            return as_text(field, v)
        except RetryableError as exc:
            bad_text.append(exc.message)
            return None

    # every value is checked to be what the journal (UTF-8 JSON) and the RESPONSES parquet can hold
    fields = {
        "reasoning": text("reasoning", reasoning),
        "content": text("content", content_text),
        "tool_calls": text("tool_calls", json.dumps(tool_calls, ensure_ascii=False)) if tool_calls else None,
        "finish_reason": text("finish_reason", finish),
        "prompt_tokens": as_count(usage.get("prompt_tokens")),
        "completion_tokens": completion_tokens,
        "reasoning_tokens": reasoning_tokens,
        "cost_usd": as_cost(usage.get("cost")),
        "backend": backend.name,
        "provider": text("provider", str(provider)) if provider else backend.name,
        "model": text("model", str(data.get("model") or backend.model)),
        "latency_s": float(latency_s),
        "output_ids": as_token_ids(choice.get("token_ids") or choice.get("output_ids")),
        "prompt_ids": as_token_ids(data.get("prompt_token_ids")),
        "completed_at": time.time(),
        "generation_id": text("generation_id", str(data["id"])) if data.get("id") else None,
        "system_fingerprint": (
            text("system_fingerprint", str(data["system_fingerprint"])) if data.get("system_fingerprint") else None
        ),
        **({"_bad_bytes": bad_bytes} if bad_bytes else {}),
    }
    if bad_text:  # billed: journaled once as a named reject, never bought again on a retry or a rerun
        from .paid import PaidReject

        raise PaidReject("invalid_unicode", "; ".join(bad_text) + " (paid for: journaled, not bought again)", fields)
    return fields
