"""glaiveai/glaive-function-calling-v2: ``{"system": str, "chat": str}`` per record (a JSON array file).

``system``: ``SYSTEM: You are a helpful assistant with access to the following functions. Use them if
required -`` followed by pretty-printed JSON function specs ``{name, description, parameters}`` -> the text
before the first spec becomes the system message, the specs become OpenAI ``tools``
(``{type: function, function: spec}``). ``chat``: turns ``USER:`` / ``ASSISTANT:`` / ``FUNCTION RESPONSE:``
separated by blank lines, assistant turns ending in `` <|endoftext|>``. A call
``<functioncall> {"name": "fn", "arguments": '{...}'}`` (arguments single-quoted, so not JSON) becomes an
assistant ``tool_calls`` entry with id ``call_<k>`` (k counts calls in the record; arguments written as a Python
literal, ``'{'unit': 'cm'}'``, are converted to JSON, others that are not JSON rejected
``malformed_tool_arguments``: :func:`json_arguments`); a FUNCTION RESPONSE
becomes ``{role: tool, tool_call_id: <the preceding call's id>, name: fn}``. Turn parsing after anyscale
``fc_utils``. No id: content hash.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import Adapter, RowReject, Sample, check_conversation

_TURN_RE = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?")
_CALL_RE = re.compile(r"<functioncall>\s*(\{.*\})\s*$", re.DOTALL)
_CALL_PARTS_RE = re.compile(r"\"name\"\s*:\s*\"([^\"]+)\"\s*,\s*\"arguments\"\s*:\s*'(.*)'\s*\}\s*$", re.DOTALL)
_ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}


def parse_glaive_system(system: str) -> tuple[str, list[dict]]:
    """(system text, tools) from a glaive ``system`` string; raises RowReject(malformed_tools) on bad specs."""
    text = re.sub(r"^\s*SYSTEM:\s*", "", system or "")
    start = text.find("{")
    if start < 0:
        return text.strip(), []
    head, rest = text[:start].strip(), text[start:]
    decoder = json.JSONDecoder()
    tools, pos = [], 0
    while True:
        while pos < len(rest) and rest[pos].isspace():
            pos += 1
        if pos >= len(rest):
            break
        try:
            spec, pos = decoder.raw_decode(rest, pos)
        except json.JSONDecodeError as exc:
            raise RowReject(
                "malformed_tools", f"function spec {len(tools)} in `system` is not JSON ({exc.msg})"
            ) from None
        if not isinstance(spec, dict) or "name" not in spec:
            raise RowReject("malformed_tools", f"function spec {len(tools)} in `system` has no name")
        tools.append({"type": "function", "function": spec})
    return head, tools


def _parse_call(text: str, k: int) -> tuple[str, dict] | None:
    m = _CALL_RE.search(text)
    if not m:
        return None
    content = text[: m.start()].strip()
    blob = m.group(1)
    parts = _CALL_PARTS_RE.search(blob)
    if parts:
        name, args = parts.group(1), parts.group(2)
    else:
        try:
            obj = json.loads(blob)
        except json.JSONDecodeError:
            raise RowReject("malformed_message", f"unparseable <functioncall> {blob[:80]!r}") from None
        name, args = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str):
            raise RowReject("malformed_message", f"<functioncall> without a name: {blob[:80]!r}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
    call = {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json_arguments(args)}}
    return content, call


def json_arguments(args: str) -> str:
    """A call's ``arguments`` as JSON text: JSON as it is; a Python literal (``{'unit': 'cm'}``, ``True``,
    ``None``: what some glaive rows hold) converted to JSON; anything else raises
    ``RowReject("malformed_tool_arguments")`` (a target would be trained to emit it)."""
    import ast

    try:
        json.loads(args)
        return args
    except (json.JSONDecodeError, RecursionError):
        pass
    try:
        value = ast.literal_eval(args.strip())
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise RowReject(
            "malformed_tool_arguments",
            f"<functioncall> arguments are neither JSON nor a Python literal of an object: {args[:80]!r}",
        ) from None


class Glaive(Adapter):
    name = "glaive"
    required_key = "chat"
    expected = "a glaive function-calling record with `system` and `chat` strings"
    option_defaults: dict[str, Any] = {}

    def _shape_problem_of_value(self, key: str, value: Any) -> str | None:
        return None if isinstance(value, str) else f"`{key}` is a {type(value).__name__}, not a string"

    def convert(self, record: dict) -> Sample:
        system, tools = parse_glaive_system(record.get("system") or "")
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        pieces = _TURN_RE.split(record["chat"])
        # pieces = [before, ROLE, text, ROLE, text, ...]
        calls = 0
        last_call: dict | None = None
        for tag, raw in zip(pieces[1::2], pieces[2::2]):
            text = raw.replace("<|endoftext|>", "").strip()
            role = _ROLES[tag]
            if role == "assistant":
                parsed = _parse_call(text, calls)
                if parsed:
                    content, call = parsed
                    calls += 1
                    last_call = call
                    messages.append({"role": "assistant", "content": content, "tool_calls": [call]})
                    continue
            if role == "tool":
                if last_call is None:
                    raise RowReject("malformed_message", "FUNCTION RESPONSE without a preceding <functioncall>")
                messages.append(
                    {
                        "role": "tool",
                        "content": text,
                        "tool_call_id": last_call["id"],
                        "name": last_call["function"]["name"],
                    }
                )
                continue
            messages.append({"role": role, "content": text})
        check_conversation(messages)
        return Sample(None, messages, tools or None)
