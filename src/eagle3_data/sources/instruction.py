"""Single-turn instruction/response pairs: Magicoder (OSS-Instruct ``problem``/``solution``, Evol-Instruct
``instruction``/``response``), nvidia/OpenCodeInstruct (``id``, ``input``/``output``), and similar.

Field names are options; when ``prompt_field``/``response_field`` are null the first present of
:data:`PROMPT_FIELDS` / :data:`RESPONSE_FIELDS` is used. Messages: [system (``system_field``, if set and
non-empty)], user = prompt, assistant = response (when present and non-empty).
"""

from __future__ import annotations

from typing import Any

from .base import Adapter, RowReject, Sample, check_conversation

PROMPT_FIELDS = ("instruction", "problem", "input", "prompt", "question")
RESPONSE_FIELDS = ("response", "solution", "output", "answer", "completion")


class InstructionResponse(Adapter):
    name = "instruction_response"
    expected = f"an instruction/response record with one of the fields {list(PROMPT_FIELDS)}"
    option_defaults: dict[str, Any] = {
        "prompt_field": None,
        "response_field": None,
        "id_field": "id",
        "system_field": None,
    }

    def _field(self, record: dict, option: str, candidates: tuple[str, ...]) -> str | None:
        if self.options[option]:
            return self.options[option] if self.options[option] in record else None
        return next((k for k in candidates if k in record), None)

    def shape_problem(self, record: Any) -> str | None:
        if not isinstance(record, dict):
            return f"got a {type(record).__name__}, not an object"
        if self._field(record, "prompt_field", PROMPT_FIELDS) is None:
            want = self.options["prompt_field"] or list(PROMPT_FIELDS)
            return f"no prompt field {want}; got keys {sorted(record)[:12]}"
        return None

    def convert(self, record: dict) -> Sample:
        fid = self.options["id_field"]
        sid = record.get(fid) if fid else None
        sid = str(sid) if sid not in (None, "") else None
        prompt = record[self._field(record, "prompt_field", PROMPT_FIELDS)]
        rfield = self._field(record, "response_field", RESPONSE_FIELDS)
        response = record.get(rfield) if rfield else None
        messages: list[dict] = []
        sfield = self.options["system_field"]
        if sfield and isinstance(record.get(sfield), str) and record[sfield].strip():
            messages.append({"role": "system", "content": record[sfield]})
        if not isinstance(prompt, str):
            raise RowReject("malformed_message", f"prompt is a {type(prompt).__name__}, not a string", sid)
        messages.append({"role": "user", "content": prompt})
        if isinstance(response, str) and response.strip():
            messages.append({"role": "assistant", "content": response})
        try:
            check_conversation(messages)
        except RowReject as rej:
            rej.sample_id = sid
            raise
        return Sample(sid, messages)
