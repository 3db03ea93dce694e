"""Sources already in OpenAI ``messages`` form (``[{role, content, tool_calls?, tool_call_id?, name?}]``).

* ``openai_messages`` — generic: ``messages`` (list, or JSON text of one) + optional ``tools``; id from the
  ``id_field`` option (default ``id``). Role ``developer`` -> system; other roles than
  system/user/assistant/tool -> ``unknown_role``.
* ``ultrachat`` — HuggingFaceH4/ultrachat_200k: ``prompt`` + ``prompt_id`` (64-hex sha256, used as sample_id)
  + ``messages`` (user/assistant, no system). An empty ``messages`` with a non-empty ``prompt`` becomes
  ``[{user: prompt}]``.
* ``mixture_of_thoughts`` — open-r1/Mixture-of-Thoughts: ``messages`` with assistant content
  ``<think>…</think>\\n\\n{answer}``; no id (content hash).
* ``swe_smith`` — SWE-bench/SWE-smith-trajectories: ``messages`` as JSON text with ``tool_calls`` and
  ``role: tool`` messages; id ``traj_id``.

Assistant content always loses a leading ``<think>…</think>`` block (option ``strip_think``, default true):
prompts carry no source-model reasoning; ``reasoning_content``/``reasoning`` fields are dropped likewise.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Adapter,
    RowReject,
    Sample,
    check_conversation,
    maybe_json,
    normalize_tool_calls,
    normalize_tools,
    strip_think,
    resolve_image,
    text_of,
)

ROLE_ALIASES = {"developer": "system"}


class OpenAIMessages(Adapter):
    name = "openai_messages"
    required_key = "messages"
    expected = "an OpenAI-messages record with a `messages` list of {role, content}"
    option_defaults: dict[str, Any] = {
        "id_field": "id",  # top-level id; missing/empty -> content hash
        "messages_field": "messages",
        "tools_field": "tools",
        "strip_think": True,
        "image_dir": None,  # set: user messages may hold image_url parts, their url a path relative to it
    }

    def _shape_problem_of_value(self, key: str, value: Any) -> str | None:
        if isinstance(value, str):  # JSON text (SWE-smith); parsed per row
            return None
        return super()._shape_problem_of_value(key, value)

    def sample_id(self, record: dict) -> str | None:
        field = self.options["id_field"]
        sid = record.get(field) if field else None
        return str(sid) if sid not in (None, "") else None

    def raw_messages(self, record: dict) -> Any:
        return maybe_json(record[self.options["messages_field"]], "`messages`")

    def convert(self, record: dict) -> Sample:
        sid = self.sample_id(record)
        try:
            raw = self.raw_messages(record)
            if not isinstance(raw, (list, tuple)):
                raise RowReject("malformed_record", f"`messages` is a {type(raw).__name__}, not a list")
            messages = [self._message(i, m) for i, m in enumerate(raw)]
            tools_field = self.options["tools_field"]
            tools = normalize_tools(record.get(tools_field)) if tools_field else None
            check_conversation(messages)
        except RowReject as rej:
            rej.sample_id = sid
            raise
        return Sample(sid, messages, tools)

    def _message(self, i: int, m: Any) -> dict:
        where = f"message {i}"
        if not isinstance(m, dict):
            raise RowReject("malformed_message", f"{where} is a {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise RowReject("malformed_message", f"{where} has no `role` string")
        role = ROLE_ALIASES.get(role, role)
        raw = m.get("content")
        if self.options["image_dir"] is not None and role == "user" and isinstance(raw, list):
            return {"role": role, "content": self._parts(raw, where)}
        content = text_of(raw, where)
        if role == "assistant" and self.options["strip_think"] and "<think>" in content:
            content = strip_think(content)
        out: dict = {"role": role, "content": content}
        if m.get("tool_calls"):
            out["tool_calls"] = normalize_tool_calls(m["tool_calls"], where)
        if m.get("tool_call_id") is not None:
            out["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str) and m["name"]:
            out["name"] = m["name"]
        return out

    def _parts(self, raw: list, where: str) -> list[dict] | str:
        """A user message's content parts with its images read from ``image_dir`` (text alone: a string)."""
        out: list[dict] = []
        for part in raw:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
                out.append(resolve_image(url, self.options["image_dir"], None))
            else:
                text = text_of([part], where)
                if text:
                    out.append({"type": "text", "text": text})
        return out if any(p["type"] == "image_url" for p in out) else "".join(p["text"] for p in out)


class UltraChat(OpenAIMessages):
    name = "ultrachat"
    expected = "an UltraChat record with `prompt_id`, `prompt` and a `messages` list of {role, content}"
    option_defaults = {**OpenAIMessages.option_defaults, "id_field": "prompt_id"}

    def raw_messages(self, record: dict) -> Any:
        raw = super().raw_messages(record)
        prompt = record.get("prompt")
        if (
            (raw is None or (isinstance(raw, (list, tuple)) and len(raw) == 0))
            and isinstance(prompt, str)
            and prompt.strip()
        ):
            return [{"role": "user", "content": prompt}]
        return raw


class MixtureOfThoughts(OpenAIMessages):
    name = "mixture_of_thoughts"
    expected = "a Mixture-of-Thoughts record with a `messages` list of {role, content}"
    option_defaults = {**OpenAIMessages.option_defaults, "id_field": None}


class SWESmith(OpenAIMessages):
    name = "swe_smith"
    expected = "a SWE-smith trajectory with `messages` (JSON text or list of {role, content, tool_calls?})"
    option_defaults = {**OpenAIMessages.option_defaults, "id_field": "traj_id"}
