"""SGLang's native dialect (``POST {root}/generate``, a backend with ``native_generate: true``): the prompt is sent as
token ids rendered with the target's chat template, and the reply's exact ``output_ids`` are kept; reasoning and
content are decoded from them (:func:`..templates.split_output_ids`)."""

from __future__ import annotations

import time
from typing import Any

from ..templates import TemplateError, prompt_think_state, split_output_ids
from . import codec
from ..images import image_parts
from .errors import RetryableError, SampleError
from .fields import as_count, as_token_ids
from .request import Payload, Request
from .definition import BackendConfig


def url(backend: BackendConfig) -> str:
    """Where the request goes: ``/generate`` at the server root (``base_url`` without ``/v1``)."""
    return backend.root_url + "/generate"


def prompt_ids(request: Request) -> tuple[list[int], str]:
    """The prompt's token ids from the target's chat template and their think state
    (:func:`..templates.prompt_think_state`), rendered once per request (kept in ``request.rendered``).

    Raises :class:`SampleError`: no target tokenizer (reason ``no_target``), or the template can't render the
    prompt (the :class:`..templates.TemplateError`'s reason)."""
    if "native" not in request.rendered:
        if request.target is None:
            raise SampleError("no_target", "native_generate needs the target tokenizer (GenerateSettings.target)")
        try:
            ids = request.target.prompt_ids(request.messages, request.tools)
        except TemplateError as exc:
            raise SampleError(exc.reason, str(exc)[:300]) from None
        request.rendered["native"] = (ids, prompt_think_state(request.target, ids))
    return request.rendered["native"]


def encode(backend: BackendConfig, request: Request) -> Payload:
    """The request's ``/generate`` body as JSON bytes (:func:`build_native_body`); ``est_tokens``: prompt ids +
    ``max_tokens``. Raises :class:`SampleError` (see :func:`prompt_ids`; ``image_prompt_native``: a prompt with
    images, which ``/generate`` would get as placeholder ids without their pixels: send it through the chat
    dialect)."""
    if image_parts(request.messages):
        raise SampleError("image_prompt_native", "a prompt with images: the native /generate path sends ids only")
    ids, think = prompt_ids(request)
    body = codec.dumps(build_native_body(backend, ids, request.sampling))
    return Payload(body, len(ids) + int(request.sampling.get("max_tokens") or 0), request.target, think)


def parse(backend: BackendConfig, content: bytes, latency_s: float, payload: Payload) -> dict:
    """RESPONSES fields of a 200 reply (:func:`parse_native_response`)."""
    return parse_native_response(backend, content, latency_s, payload.target, payload.think_state)


#: ``generation.extra_body`` keys that are SGLang sampling parameters (moved into ``sampling_params`` natively)
NATIVE_SAMPLING_KEYS = frozenset(
    {
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "seed",
        "sampling_seed",
    }
)


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


def parse_native_response(
    backend: BackendConfig, content: bytes, latency_s: float, target, think_state: str = "none"
) -> dict:
    """Parse an SGLang ``/generate`` body (``{"text", "output_ids", "meta_info": {"finish_reason": {"type":
    stop|length|abort, ...}, "prompt_tokens", "completion_tokens"}}``) into RESPONSES fields.

    ``output_ids`` are stored as returned (the completion, with or without the stop id); reasoning/content are
    decoded from them with the target tokenizer (:func:`..templates.split_output_ids`). ``finish_reason`` is ``stop`` or
    ``length``; ``abort`` and a missing/malformed ``output_ids`` raise :class:`RetryableError`.
    """
    try:
        data = codec.loads(content)
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
    ids = as_token_ids(data.get("output_ids"))
    if ids is None:
        raise RetryableError(
            "empty_response", "no output_ids (non-empty list of ids in [0, 2**31)) in the /generate reply"
        )
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
        "prompt_tokens": as_count(meta.get("prompt_tokens")),
        "completion_tokens": as_count(meta.get("completion_tokens")) or len(ids),
        "reasoning_tokens": rtok,
        "cost_usd": None,
        "backend": backend.name,
        "provider": backend.name,
        "model": backend.model,
        "latency_s": float(latency_s),
        "output_ids": ids,
        "completed_at": time.time(),
    }
