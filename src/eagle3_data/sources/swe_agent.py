"""SWE-agent trajectories in the nebius/SWE-agent-trajectories layout.

Columns: ``instance_id``, ``model_name``, ``target`` (resolved), ``trajectory`` = list of
``{role: system|user|ai, text, mask, system_prompt, cutoff_date}``, ``exit_status``, ``generated_patch``
(+ ``eval_logs``). Mapping: the ``system`` element -> one system message (its ``text``, else its
``system_prompt``); ``user`` -> user (issue text / observations); ``ai`` -> assistant (DISCUSSION + one
fenced command). No OpenAI tool calls: commands stay inside the assistant text (SWE-agent ACI), ``tools`` null.

sample_id = ``{instance_id}:{model_name}:{hash8}`` where hash8 is the first 8 hex chars of
``files.content_hash`` of the trajectory's (role, text) pairs: the dataset holds several trajectories per
(instance, model), so instance + model alone is not unique; an exact repeat of a trajectory is a
``duplicate_id``.
"""

from __future__ import annotations

from typing import Any

from ..files import content_hash
from .base import Adapter, RowReject, Sample, check_conversation

NEBIUS_ROLES = {"system": "system", "user": "user", "ai": "assistant", "assistant": "assistant"}


class NebiusSWEAgent(Adapter):
    name = "nebius_swe_agent"
    required_key = "trajectory"
    expected = "a nebius SWE-agent record with `instance_id`, `model_name` and a `trajectory` list of {role, text}"
    option_defaults: dict[str, Any] = {}

    def convert(self, record: dict) -> Sample:
        pairs = []
        messages: list[dict] = []
        for i, el in enumerate(record["trajectory"]):
            if not isinstance(el, dict):
                raise RowReject("malformed_message", f"trajectory[{i}] is a {type(el).__name__}")
            who = el.get("role")
            if not isinstance(who, str):
                raise RowReject("malformed_message", f"trajectory[{i}] has no `role` string")
            role = NEBIUS_ROLES.get(who)
            if role is None:
                raise RowReject("unknown_role", f"trajectory[{i}] has role {who!r}")
            text = el.get("text")
            if role == "system" and not (isinstance(text, str) and text.strip()):
                text = el.get("system_prompt")
            if not isinstance(text, str):
                raise RowReject("malformed_message", f"trajectory[{i}] ({who}) has no `text` string")
            pairs.append((who, text))
            messages.append({"role": role, "content": text})
        instance = record.get("instance_id") or "unknown"
        model = record.get("model_name") or "unknown"
        sid = f"{instance}:{model}:{content_hash(pairs)[:8]}"
        try:
            check_conversation(messages)
        except RowReject as rej:
            rej.sample_id = sid
            raise
        return Sample(sid, messages)
