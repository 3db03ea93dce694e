"""Reply normalisation before tokenizing: ids, tool calls and their arguments, finish reasons, Kimi call ids,
think blocks returned inside the content, thinking on/off and the messages a request sends.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from .formats import CompletionFormat, FORMATS, TemplateError


def normalize_ids(out: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` or a tokenizer call returned, as ``list[int]``.

    transformers 5 may return a ``BatchEncoding``/dict (``len()`` of it is the number of keys, not tokens: the
    bug NVIDIA Model-Optimizer PR #2172 fixed), a torch/numpy tensor of shape ``(n,)`` or ``(1, n)``, a nested
    ``[[...]]`` list or a plain list. Raises :class:`TemplateError` on a batch of more than one sequence or on an
    object with no ids.
    """
    if hasattr(out, "keys"):
        if "input_ids" not in out:
            raise TemplateError(f"chat template output has no input_ids (keys {list(out.keys())})")
        out = out["input_ids"]
    if hasattr(out, "ids") and not isinstance(out, (list, tuple)):  # tokenizers.Encoding
        out = out.ids
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, int):
        return [out]
    out = list(out)
    if (
        out
        and isinstance(out[0], (list, tuple))
        or (out and hasattr(out[0], "tolist") and not isinstance(out[0], int) and getattr(out[0], "ndim", 0) > 0)
    ):
        if len(out) != 1:
            raise TemplateError(f"expected one sequence from the chat template, got a batch of {len(out)}")
        inner = out[0]
        out = inner.tolist() if hasattr(inner, "tolist") else list(inner)
    return [int(x) for x in out]


KIMI_CALL_ID = re.compile(r"^functions\.[^:\s]+:\d+$")


def args_text(args: Any) -> str:
    """Tool-call arguments as the target wrote them: a string as-is, anything else as JSON (``tojson``)."""
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False)


def args_mapping(args: Any) -> dict:
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            val = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise TemplateError(f"tool-call arguments are not JSON: {args[:80]!r}", "bad_tool_call") from exc
        if isinstance(val, dict):
            return val
    raise TemplateError(f"tool-call arguments must be a JSON object, got {str(args)[:80]!r}", "bad_tool_call")


def count_tool_calls(messages: Sequence[dict]) -> int:
    """Number of tool calls in earlier assistant messages (Kimi numbers call ids ``functions.{name}:{index}``
    with this global index; SGLang's kimi_k2 parser does the same)."""
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


#: The closed set of finish reasons every response is normalised to (:func:`normalize_finish_reason`).
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")

#: Finish-reason spellings of the APIs this project talks to (OpenAI / OpenRouter ``finish_reason``, OpenRouter
#: ``native_finish_reason`` of Anthropic and Google providers, SGLang, vLLM, ``transformers serve``), lower-cased.
FINISH_ALIASES = {
    "stop": "stop",
    "eos": "stop",
    "eos_token": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "finish_reason_stop": "stop",
    "length": "length",
    "max_tokens": "length",
    "max_output_tokens": "length",
    "max_new_tokens": "length",
    "model_length": "length",
    "max_length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "tool_use": "tool_calls",
    "content_filter": "content_filter",
    "safety": "content_filter",
    "recitation": "content_filter",
    "prohibited_content": "content_filter",
    "blocklist": "content_filter",
    "spii": "content_filter",
    "refusal": "content_filter",
    "image_safety": "content_filter",
}


def normalize_finish_reason(
    raw: Any,
    billed_completion_tokens: int | None = None,
    max_tokens: int | None = None,
    *,
    emitted_end_of_turn: bool = False,
) -> str:
    """The finish reason of a response as one of :data:`FINISH_REASONS`.

    ``raw`` is the backend's string (any case; spellings in :data:`FINISH_ALIASES`) or None. A billed completion
    count at (or above) the request's ``max_tokens`` means the reply was cut, whatever the string says (providers
    report ``stop``, ``MAX_TOKENS`` or nothing for a reply that ran out of tokens), unless the backend's exact ids
    end in the target's end-of-turn token (``emitted_end_of_turn``: the target stopped by itself on its last
    allowed token). ``content_filter`` wins over everything (the provider cut or replaced the text).

    Raises :class:`TemplateError` with reason ``unknown_finish_reason`` for a value outside the aliases (named in
    the message, e.g. ``abort``) and for a null finish reason that no count or end-of-turn id explains.
    """
    key = raw.strip().lower() if isinstance(raw, str) and raw.strip() else None
    kind = FINISH_ALIASES.get(key) if key is not None else None
    if key is not None and kind is None:
        raise TemplateError(
            f"unknown finish_reason {raw!r} (known: {sorted(set(FINISH_ALIASES))})", "unknown_finish_reason"
        )
    if kind == "content_filter":
        return kind
    at_max = (
        billed_completion_tokens is not None
        and max_tokens is not None
        and int(max_tokens) > 0
        and int(billed_completion_tokens) >= int(max_tokens)
    )
    if at_max and not emitted_end_of_turn:
        return "length"
    if kind is None:
        if emitted_end_of_turn:
            return "stop"
        raise TemplateError(
            "finish_reason is null and the billed completion count "
            f"({billed_completion_tokens}) is below max_tokens ({max_tokens}): whether the reply is "
            "complete is unknown",
            "unknown_finish_reason",
        )
    return kind


def rewrite_kimi_tool_call_ids(messages: Sequence[dict]) -> list[dict]:
    """History tool-call ids in Kimi's own ``functions.<name>:<index>`` form (``index``: the call's position among
    every tool call of the conversation, counted from 0, as Kimi and SGLang's kimi_k2 tool parser number them).

    Kimi's templates print a history call's ``id`` verbatim, so an OpenAI-style id (``call_0``, ``toolu_...``)
    leaves the prompt without the called function's name. Ids already in Kimi form are kept; every other id is
    rewritten, and so is the ``tool_call_id`` of the tool messages answering it (a tool message without one gets
    the id of the next call not yet answered). Returns a new list (changed messages copied, the input untouched).
    """
    out: list[dict] = []
    mapping: dict[str, str] = {}
    pending: list[str] = []
    index = 0
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            changed = False
            for call in m["tool_calls"]:
                old = call.get("id")
                name = str((call.get("function") or {}).get("name", ""))
                new = old if isinstance(old, str) and KIMI_CALL_ID.match(old) else f"functions.{name}:{index}"
                index += 1
                if new != old:
                    call = {**call, "id": new}
                    changed = True
                if old is not None:
                    mapping[str(old)] = new
                pending.append(new)
                calls.append(call)
            out.append({**m, "tool_calls": calls} if changed else m)
            continue
        if role == "tool":
            tid = m.get("tool_call_id")
            new = mapping.get(str(tid)) if tid is not None else (pending[0] if pending else None)
            if new is not None and new in pending:
                pending.remove(new)
            if new is not None and new != tid:
                m = {**m, "tool_call_id": new}
        out.append(m)
    return out


def split_reasoning_from_content(fmt: CompletionFormat, content: str | None) -> tuple[str, str] | None:
    """``(reasoning, content)`` from a reply whose think block came back inside ``content`` (a server without a
    reasoning parser, or ``separate_reasoning: false``), or None when ``content`` holds no end-of-reasoning marker.

    The split is the one the target family's own template applies to such a message and SGLang's reasoning
    parsers apply to raw output: the reasoning is the text before the first ``</think>`` (after an opening
    ``<think>`` when present: the K2.5/R1/Qwen3-2507 prompts already hold it), the content the text after it.
    Whitespace is returned as written: the family's layout rebuilds its canonical separators. Text before the
    opening marker other than whitespace is not a think block: None (validation then rejects the marker).
    """
    close, open_ = fmt.think_close, fmt.think_open
    if not fmt.reasoning or not close or not content or close not in content:
        return None
    pre, post = content.split(close, 1)
    if open_ and open_ in pre:
        before, pre = pre.split(open_, 1)
        if before.strip():
            return None
    if open_ and open_ in pre:
        return None
    return pre, post


def empty_think_block(reasoning: str | None, content: str | None, tool_calls: list | None) -> bool:
    """True when a reply on a thinking prompt really holds an empty (or whitespace-only) think block: its reasoning
    is a string (``""``, ``"\\n\\n"``: the server's parser found the markers with nothing between them, or the
    block came back inside the content) and an answer or tool call follows. Such a reply is kept exact (Qwen3:
    ``<think>\\n\\n</think>\\n\\n``); a reasoning of None (hidden, e.g. OpenRouter ``reasoning.exclude``) is not."""
    return reasoning is not None and not reasoning.strip() and bool((content or "").strip() or tool_calls)


def thinking_enabled(template: str | None, chat_template_kwargs: dict | None = None) -> bool:
    """True when target family ``template`` reasons after a generation prompt rendered with
    ``chat_template_kwargs``: a reasoning family whose ``thinking`` / ``enable_thinking`` is not false (SGLang's
    rule for the kimi_k2, qwen3 and glm45 reasoning parsers); ``deepseek-v3.1`` only when one of them is true (its
    template's default is off, SGLang's deepseek-v3 rule). Unknown families: False."""
    fmt = FORMATS.get(template or "")
    kw = chat_template_kwargs or {}
    if fmt is not None and fmt.think_in_prompt:  # DeepSeek-V3.1: off unless asked for (SGLang's deepseek-v3 rule)
        return bool(kw.get("thinking") or kw.get("enable_thinking"))
    return bool(fmt and fmt.reasoning) and kw.get("thinking") is not False and kw.get("enable_thinking") is not False


def request_messages(messages: Sequence[dict], template: str | None) -> list[dict]:
    """The prompt messages of a request to a target of family ``template``, as sent and as later rendered by the
    tokenize stage: Kimi families get their history tool-call ids rewritten (:func:`rewrite_kimi_tool_call_ids`),
    so the prompt the server sees names every called function; other families unchanged."""
    fmt = FORMATS.get(template or "")
    if fmt is not None and fmt.tool_format == "kimi":
        return rewrite_kimi_tool_call_ids(messages)
    return list(messages)
