"""ShareGPT-style sources: ``conversations`` of ``{from, value}`` turns.

* ``sharegpt`` — anon8231489123/ShareGPT_Vicuna_unfiltered (``{"id": "QWJ2cIt_0", "conversations": [...]}``)
  and LLaMA-Factory-style sharegpt files (optional top-level ``system``). Role map after SpecForge
  ``prepare_data.py``: human/user -> user; gpt/chatgpt/bing/bard/assistant/model -> assistant; system -> system;
  anything else -> reject ``unknown_role`` (extend with the ``role_map`` option). Consecutive plain turns of one
  role are joined (option ``merge_consecutive``).
* ``openthoughts`` — open-thoughts/OpenThoughts-114k (``system`` + ``conversations`` of from user/assistant,
  assistant values in ``<|begin_of_thought|>…<|end_of_solution|>`` markers) and OpenThoughts3-1.2M (from
  human/gpt, assistant ``<think>…</think>`` + answer). The Sky-T1 system prompt is dropped unless
  ``keep_system``; assistant history keeps only the solution text.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Adapter, RowReject, Sample, check_conversation, merge_consecutive, strip_think

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


class ShareGPT(Adapter):
    name = "sharegpt"
    required_key = "conversations"
    expected = "a ShareGPT record with a `conversations` list of {from, value}"
    option_defaults: dict[str, Any] = {
        "id_field": "id",  # top-level id; missing/empty -> content hash
        "role_map": {},  # extra/overriding `from` -> OpenAI role entries, e.g. {"narrator": "system"}
        "merge_consecutive": True,  # join runs of plain user (or assistant) turns with a blank line
        "keep_system": True,  # keep `system` turns / the top-level `system` field
        "strip_reasoning": False,  # drop <think>… / <|begin_of_thought|>… from assistant values
    }

    def _roles(self) -> dict[str, str]:
        return {**SHAREGPT_ROLES, **{str(k).lower(): v for k, v in (self.options["role_map"] or {}).items()}}

    def _assistant_text(self, text: str) -> str:
        return strip_reasoning(text) if self.options["strip_reasoning"] else text

    def convert(self, record: dict) -> Sample:
        roles = self._roles()
        sid = record.get(self.options["id_field"]) if self.options["id_field"] else None
        sid = str(sid) if sid not in (None, "") else None
        messages: list[dict] = []
        system = record.get("system")
        if isinstance(system, str) and system.strip() and self.options["keep_system"]:
            messages.append({"role": "system", "content": system})
        for i, turn in enumerate(record["conversations"]):
            if not isinstance(turn, dict):
                raise RowReject("malformed_message", f"turn {i} is a {type(turn).__name__}", sid)
            who = turn.get("from", turn.get("role"))
            text = turn.get("value", turn.get("content"))
            if not isinstance(who, str):
                raise RowReject("malformed_message", f"turn {i} has no `from` string", sid)
            if not isinstance(text, str):
                raise RowReject("malformed_message", f"turn {i} ({who}) has no `value` string", sid)
            role = roles.get(who.strip().lower())
            if role is None:
                raise RowReject("unknown_role", f"turn {i} has from={who!r}", sid)
            if role == "system" and not self.options["keep_system"]:
                continue
            if role == "assistant":
                text = self._assistant_text(text)
            messages.append({"role": role, "content": text})
        sample = Sample(sid, messages)
        if self.options["merge_consecutive"]:
            sample.messages, merges = merge_consecutive(messages)
            if merges:
                sample.notes.append("merged_consecutive_turns")
        try:
            check_conversation(sample.messages)
        except RowReject as rej:
            rej.sample_id = sid
            raise
        return sample


_SOLUTION_RE = re.compile(r"<\|begin_of_solution\|>(.*?)(?:<\|end_of_solution\|>|$)", re.DOTALL)
_THOUGHT_RE = re.compile(r"<\|begin_of_thought\|>.*?(?:<\|end_of_thought\|>|$)\s*", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """Assistant text without its reasoning trace: ``<think>…</think>`` (OpenThoughts3, R1 style) or the
    OpenThoughts-114k ``<|begin_of_thought|>…<|end_of_thought|>`` block; from a
    ``<|begin_of_solution|>…<|end_of_solution|>`` block only the solution is kept."""
    m = _SOLUTION_RE.search(text)
    if m:
        return m.group(1).strip()
    text = _THOUGHT_RE.sub("", text, count=1)
    return strip_think(text).strip() if "<think>" in text else text


class OpenThoughts(ShareGPT):
    name = "openthoughts"
    expected = "an OpenThoughts record with a `conversations` list of {from, value} (and `system`)"
    option_defaults = {**ShareGPT.option_defaults, "id_field": None, "keep_system": False, "strip_reasoning": True}
