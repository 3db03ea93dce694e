"""Prompts -> requests: the PROMPTS rows of a shard (:class:`Sample`), the turns to regenerate, the request key.

Request key = ``files.content_hash(dataset, sample_id, turn, target_name, prompt messages, tools, sampling)`` with
sampling = ``{max_tokens, temperature, top_p, extra_body}``: independent of the backend, so a response from
OpenRouter satisfies the same request later routed to SGLang.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import pyarrow.parquet as pq

from ..files import content_hash
from ..images import key_messages

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "extra_body")
PROMPT_ROLES = ("user", "tool")


@dataclass
class Sample:
    """One prompt row. ``messages_json``/``tools_json`` stay the JSON text of the PROMPTS cells (validated when
    read): a shard's prompts held as text take a fraction of the memory of parsed dicts; ``messages``/``tools``
    parse on access."""

    sample_id: str
    messages_json: str
    tools_json: str | None
    turns: list[int]  # assistant indices to regenerate, in order (len(messages) = append a new turn)
    source_row: int = -1

    @property
    def messages(self) -> list:
        return json.loads(self.messages_json)

    @property
    def tools(self) -> list | None:
        return json.loads(self.tools_json) if self.tools_json else None


def assistant_turns(messages: list, mode: str) -> list[int]:
    """Indices of the assistant turns to regenerate (``mode`` last|all); ``[]`` if nothing can be asked.

    No assistant message: ``[len(messages)]`` when the last message is a user/tool message (a fresh turn),
    else ``[]``. A turn whose prompt would be empty is skipped.
    """
    idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    if not idx:
        if messages and messages[-1].get("role") in PROMPT_ROLES:
            return [len(messages)]
        return []
    if mode == "last":
        return [idx[-1]]
    if mode == "all":
        return idx
    raise ValueError(f"generation.mode must be 'last' or 'all', got {mode!r}")


def assistant_message(rec: dict) -> dict:
    """The regenerated assistant message put into the history of later turns (mode ``all``); its reasoning goes
    back under ``reasoning_content`` (the field chat templates read; the request body moves it to the field the
    backend reads, :func:`backends.chat.history_reasoning`)."""
    msg: dict = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning"):
        msg["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        msg["tool_calls"] = json.loads(rec["tool_calls"])
    return msg


def sampling_params(generation) -> dict:
    """The sampling part of a request key: ``generation``'s (a :class:`eagle3_data.settings.GenerationSettings`)
    :data:`SAMPLING_KEYS`, ``extra_body`` ``{}`` when unset."""
    return {k: getattr(generation, k) if k != "extra_body" else (getattr(generation, k) or {}) for k in SAMPLING_KEYS}


def request_key(
    dataset: str, sample_id: str, turn: int, target_name: str, messages: list, tools, sampling: dict
) -> str:
    """Backend-independent key of one request (see module docstring); an image counts by its digest, not its path
    (:func:`eagle3_data.images.key_messages`)."""
    messages = key_messages(messages)
    return content_hash(dataset, sample_id, int(turn), target_name, messages, tools, sampling, length=16)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def shard_share(cap: int, num_shards: int, shard: str) -> int:
    """Shard ``shard``'s part of a dataset's ``max_samples``: ``cap // n``, plus one for the first ``cap % n``
    shards, so the parts add up to ``cap`` exactly (shard names are their index, ``"000"``...; a name that is
    not a number gets ``ceil(cap / n)``)."""
    n = max(1, num_shards)
    if not shard.isdigit():
        return math.ceil(cap / n)
    return cap // n + (1 if int(shard) < cap % n else 0)


def _parse_json_cell(text, what: str, row: int, path) -> object:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} row {row}: column {what!r} is not valid JSON ({exc})") from None


def prompt_bytes(messages: str | None, tools: str | None, max_bytes: int | None) -> int | None:
    """The UTF-8 size of a prompt's ``messages`` and ``tools`` texts when it is above ``max_bytes``, else None
    (no bound: None; a text of at most ``max_bytes / 4`` characters is not encoded to be measured)."""
    if max_bytes is None:
        return None
    texts = [t for t in (messages, tools) if t]
    if sum(len(t) for t in texts) * 4 <= max_bytes:
        return None
    n = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return n if n > max_bytes else None


def read_prompts(prompts_path, mode: str, *, max_bytes: int | None = None, keys=()) -> tuple[list[Sample], list[dict]]:
    """Read a PROMPTS parquet; return (samples, bad rows as dicts with sample_id, row, detail and ``reason``:
    ``bad_prompt`` (unusable messages/tools), ``prompt_too_large`` (more than ``max_bytes`` UTF-8 bytes of messages
    and tools: never sent, ``generation.max_prompt_bytes`` raises the bound), ``api_key_in_prompt`` (its messages
    or tools hold one of ``keys``, the configured API keys: never sent, its text not copied))."""
    from ..backends.paid import key_in_text

    # ParquetFile, not pq.read_table: the latter loads pyarrow.dataset (~50 MB RSS) for a file read once
    table = pq.ParquetFile(prompts_path).read(use_threads=False)
    missing = {"sample_id", "messages"} - set(table.column_names)
    if missing:
        raise ValueError(f"{prompts_path}: not a PROMPTS parquet, missing columns {sorted(missing)}")
    cols = table.to_pydict()
    n = table.num_rows
    tools_col = cols.get("tools") or [None] * n
    rows_col = cols.get("source_row") or list(range(n))
    samples, bad, seen = [], [], set()
    for i in range(n):
        sid = cols["sample_id"][i]
        if not sid:
            raise ValueError(f"{prompts_path} row {i}: null/empty sample_id")
        if sid in seen:
            bad.append({"sample_id": sid, "row": i, "detail": "duplicate sample_id in prompts", "dup": True})
            continue
        seen.add(sid)
        size = prompt_bytes(cols["messages"][i], tools_col[i], max_bytes)
        if size is not None:
            bad.append(
                {
                    "sample_id": sid,
                    "row": i,
                    "reason": "prompt_too_large",
                    "detail": (
                        f"{prompts_path} row {i}: {size:,} bytes of messages and tools > generation.max_prompt_bytes "
                        f"{max_bytes:,}: not sent (raise generation.max_prompt_bytes to send it)"
                    ),
                }
            )
            continue
        if keys and any(key_in_text(t, keys) for t in (cols["messages"][i], tools_col[i]) if t):
            bad.append(
                {
                    "sample_id": sid,
                    "row": i,
                    "reason": "api_key_in_prompt",
                    "detail": (
                        f"{prompts_path} row {i}: the prompt quotes a configured API key: not sent (its text is not copied "
                        "here; remove the key from the source)"
                    ),
                }
            )
            continue
        try:
            messages = _parse_json_cell(cols["messages"][i], "messages", i, prompts_path)
            tools = _parse_json_cell(tools_col[i], "tools", i, prompts_path)
            for what, text, value in (("messages", cols["messages"][i], messages), ("tools", tools_col[i], tools)):
                if text and _SURROGATE_ESCAPE.search(text):  # a \udXXX escape: a valid pair, or a broken emoji?
                    try:
                        json.dumps(value, ensure_ascii=False).encode("utf-8")
                    except UnicodeEncodeError:
                        raise ValueError(
                            f"{prompts_path} row {i}: {what} hold an unpaired surrogate (a \\udXXX "
                            "escape, e.g. a broken emoji): not valid Unicode, can't be sent"
                        ) from None
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise ValueError(f"{prompts_path} row {i}: messages must be a JSON list of objects with 'role'")
            if tools is not None and not isinstance(tools, list):
                raise ValueError(f"{prompts_path} row {i}: tools must be a JSON list or null")
            turns = assistant_turns(messages, mode)
            if not turns:
                raise ValueError(
                    f"{prompts_path} row {i}: no assistant turn to regenerate and the last message "
                    "is not a user/tool message"
                )
        except ValueError as exc:
            bad.append(
                {"sample_id": sid, "row": i, "detail": str(exc), "raw": cols["messages"][i], "tools": tools_col[i]}
            )
            continue
        samples.append(
            Sample(
                sid,
                cols["messages"][i],
                tools_col[i] if tools else None,
                turns,
                int(rows_col[i] if rows_col[i] is not None else i),
            )
        )
    return samples, bad
