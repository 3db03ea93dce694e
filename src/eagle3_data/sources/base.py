"""Shared pieces of the source-format adapters: errors, the adapter interface, message checks.

An adapter turns one raw record of a public dataset into a :class:`Sample` (OpenAI chat ``messages`` +
``tools``, or ``input_ids`` + ``loss_mask`` for pre-tokenized sources), or raises :class:`RowReject` with a
reason code from :data:`REJECT_REASONS` when the row cannot be used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ExpectedFailure
from ..images import IMAGE_REJECTS, ImageProblem, content_text, image_part, image_parts

# Reason codes written to ``results/<ds>/rejected/normalize.parquet`` (column ``reason``), stage "normalize".
REJECT_REASONS: dict[str, str] = {
    "malformed_record": "record is not an object, or lacks the format's required top-level field "
    "(only after the first 10 records; earlier it is a SourceFormatError)",
    "empty_conversation": "the record holds no messages",
    "malformed_message": "a message/turn is not an object, lacks its role or text, has non-text content, "
    "or a tool call without a function name",
    "unknown_role": "a role string the format does not define (e.g. ShareGPT `from: narrator`)",
    "starts_with_assistant": "the first non-system turn is an assistant turn (e.g. a ShareGPT `_1` split chunk)",
    "misplaced_system": "a system message after the first user/assistant turn",
    "no_user_turn": "no user message at all (e.g. a trajectory holding only its system element)",
    "empty_user_message": "a user message whose text is empty or whitespace",
    "duplicate_id": "the sample_id was already taken by an earlier row of the same source (later row rejected)",
    "duplicate_prompt": "the same prompt (system, user and tool messages and tools; the assistant turns are not "
    "compared) as an earlier row of the same source, under another id (later row rejected; "
    "datasets.<name>.source.duplicate_prompts: keep keeps it)",
    "malformed_tools": "the `tools` field is not a list of tool definitions (or JSON text of one)",
    "malformed_tool_arguments": "a tool call's arguments are neither JSON nor a Python literal of an object "
    "(glaive `<functioncall>`)",
    "nested_too_deep": "a record nested deeper than Python can walk or write as JSON (~1,000 levels)",
    # pre-tokenized rows
    "empty_input_ids": "pre-tokenized row with no input_ids",
    "length_mismatch": "pre-tokenized row whose loss_mask length differs from its input_ids length",
    "non_integer_id": "pre-tokenized input_ids holding a non-integer value (float, string, bool, null)",
    "id_out_of_range": "pre-tokenized input_ids value below 0 or above the int32 range",
    "invalid_mask_value": "pre-tokenized loss_mask value other than 0/1 (true/false accepted)",
    # image prompts (eagle3_data.images)
    **IMAGE_REJECTS,
}

# A record missing the format's required key among the first this-many records means "wrong format" (fail fast).
FORMAT_PROBE_RECORDS = 10

ROLES = ("system", "user", "assistant", "tool")


class SourceFormatError(ExpectedFailure, ValueError):
    """The source file is not the named format (or not valid JSON/parquet): reported as one line (no traceback).

    The message names the file, the line (JSONL, 1-based) or the record index (0-based), and what was expected.
    """


class RowReject(Exception):
    """One record cannot be used; ``reason`` is a code from :data:`REJECT_REASONS`, ``detail`` free text."""

    def __init__(self, reason: str, detail: str = "", sample_id: str | None = None):
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason code {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.sample_id = sample_id


@dataclass
class Sample:
    """One usable record.

    ``sample_id``: the source's own id, or None (normalize then uses ``files.content_hash`` of the messages/ids).
    ``messages``: OpenAI chat messages (role system/user/assistant/tool; ``content`` always a str;
    ``tool_calls`` / ``tool_call_id`` / ``name`` only where present). ``tools``: OpenAI tool definitions or None.
    ``input_ids`` / ``loss_mask``: only for pre-tokenized sources (then ``messages`` is None).
    """

    sample_id: str | None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    notes: list[str] = field(default_factory=list)  # repairs applied, e.g. "merged_consecutive_turns"


class Adapter:
    """Interface of one source format.

    ``output``: ``"prompts"`` (PROMPTS rows) or ``"tokens"`` (TOKENS rows, pre-tokenized sources).
    ``required_key``: top-level field every record of the format has; used to detect a wrong format.
    ``expected``: words for error messages (what a record of this format looks like).
    ``option_defaults``: accepted ``options`` keys with their defaults (unknown keys are a ValueError).
    """

    name: ClassVar[str] = ""
    output: ClassVar[str] = "prompts"
    required_key: ClassVar[str] = ""
    expected: ClassVar[str] = ""
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, options: dict | None = None):
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            raise ValueError(
                f"source format {self.name!r}: unknown option(s) {unknown}; accepted: {sorted(self.option_defaults)}"
            )
        self.options = {**self.option_defaults, **options}

    def shape_problem(self, record: Any) -> str | None:
        """None if ``record`` looks like this format at the top level, else a description of what it is."""
        if not isinstance(record, dict):
            return f"got a {type(record).__name__}, not an object"
        key = self.options.get("messages_field") or self.required_key
        if key not in record:
            return f"got keys {sorted(record)[:12]}"
        return self._shape_problem_of_value(key, record[key])

    def _shape_problem_of_value(self, key: str, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"`{key}` is a {type(value).__name__}, not a list"
        return None

    def convert(self, record: dict) -> Sample:  # pragma: no cover - interface
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------
# helpers shared by the chat adapters

_THINK_RE = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


def strip_think(text: str) -> str:
    """Drop a leading ``<think>…</think>`` reasoning block (and the whitespace after it) from ``text``.

    Mixture-of-Thoughts / OpenThoughts3 assistant content is ``<think>\\n…\\n</think>\\n\\n{answer}``; a prompt's
    history keeps only the answer (chat templates render history reasoning as empty anyway). An unclosed
    ``<think>`` (truncated trace) leaves an empty answer.
    """
    stripped = _THINK_RE.sub("", text, count=1)
    if stripped == text and text.lstrip().startswith("<think>") and "</think>" not in text:
        return ""
    return stripped


def text_of(content: Any, where: str) -> str:
    """The text of an OpenAI ``content`` (str, None or a list of ``{type: text, text}`` parts).

    Raises RowReject(malformed_message) for non-text parts or other types.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowReject("malformed_message", f"{where}: non-text content part ({kind})")
        return "".join(parts)
    raise RowReject("malformed_message", f"{where}: content is a {type(content).__name__}")


def maybe_json(value: Any, what: str, reason: str = "malformed_message") -> Any:
    """``value`` parsed if it is JSON text (SWE-smith stores ``messages`` as a string), else unchanged."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowReject(reason, f"{what} is a string but not valid JSON ({exc.msg} at char {exc.pos})") from None
    return value


def normalize_tool_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI ``tool_calls`` with ``function.arguments`` as JSON text (dict arguments are dumped)."""
    calls = maybe_json(calls, f"{where} tool_calls")
    if not isinstance(calls, (list, tuple)):
        raise RowReject("malformed_message", f"{where}: tool_calls is a {type(calls).__name__}, not a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowReject("malformed_message", f"{where}: tool_calls[{j}] has no function name")
        args = fn.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        item = {"type": call.get("type") or "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            item = {"id": str(call["id"]), **item}
        out.append(item)
    return out


def normalize_tools(tools: Any) -> list[dict] | None:
    """OpenAI tool definitions (list, or JSON text of one) -> list, or None when absent/empty."""
    tools = maybe_json(tools, "tools", reason="malformed_tools")
    if tools is None or (isinstance(tools, (list, tuple)) and len(tools) == 0):
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise RowReject(
            "malformed_tools", f"tools is a {type(tools).__name__} of non-objects, expected a list of objects"
        )
    out = []
    for t in tools:
        # bare function specs {name, description, parameters} -> {type: function, function: spec}
        out.append(
            t if "function" in t or t.get("type") not in (None, "function") else {"type": "function", "function": t}
        )
    return out


def merge_consecutive(messages: list[dict]) -> tuple[list[dict], int]:
    """Join consecutive plain user or plain assistant turns (no tool calls) with a blank line.

    ShareGPT scrapes hold such runs (a reply split over two bubbles). Returns (messages, number of merges).
    """
    out: list[dict] = []
    merges = 0
    for m in messages:
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev["role"] == m["role"]
            and m["role"] in ("user", "assistant")
            and set(prev) == {"role", "content"}
            and set(m) == {"role", "content"}
        ):
            prev["content"] = f"{prev['content']}\n\n{m['content']}" if prev["content"] else m["content"]
            merges += 1
        else:
            out.append(dict(m))
    return out, merges


def check_conversation(messages: list[dict]) -> None:
    """Structural checks every prompt conversation must pass; raises RowReject.

    ``messages`` have already been mapped to OpenAI roles. Order of checks (first failing wins):
    empty_conversation, unknown_role, misplaced_system, starts_with_assistant (first non-system turn is an
    assistant or tool), no_user_turn, empty_user_message.
    """
    if not messages:
        raise RowReject("empty_conversation", "no messages")
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise RowReject("unknown_role", f"message {i} has role {m['role']!r}")
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is not None:
        late = [i for i, m in enumerate(messages[first:], start=first) if m["role"] == "system"]
        if late:
            raise RowReject("misplaced_system", f"system message at index {late[0]} after turn {first}")
        if messages[first]["role"] != "user":
            raise RowReject(
                "starts_with_assistant", f"first non-system message (index {first}) is {messages[first]['role']!r}"
            )
    else:
        raise RowReject("no_user_turn", f"{len(messages)} message(s), all system")
    for i, m in enumerate(messages):
        if m["role"] == "user" and not content_text(m["content"]).strip() and not image_parts([m]):
            raise RowReject("empty_user_message", f"user message at index {i} is empty")


def resolve_image(name: Any, image_dir, sid: str | None) -> dict:
    """The content part of image ``name`` read from ``image_dir``; RowReject with the image's reason."""
    if image_dir is None:
        raise RowReject("image_missing", f"image {name!r}: no image folder (set source.options.image_dir)", sid)
    if not isinstance(name, str) or not name:
        raise RowReject("image_missing", f"image {name!r} is not a file name", sid)
    try:
        return image_part(name, image_dir)
    except ImageProblem as p:
        raise RowReject(p.reason, p.detail, sid) from None
