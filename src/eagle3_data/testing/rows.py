"""Rows in the generate stage's output shape (one finished conversation each), for tokenize and validate tests."""

from __future__ import annotations

import json


def row(messages, reasoning=None, content=None, tool_calls=None, tools=None, **extra):
    """A finished generate row: the prompt ``messages`` (and ``tools``), the reply's ``reasoning``, ``content`` and
    ``tool_calls``; ``extra`` overrides any field."""
    r = {
        "sample_id": "s1",
        "dataset": "d",
        "turn": len(messages),
        "status": "ok",
        "messages": json.dumps(messages),
        "tools": json.dumps(tools) if tools else None,
        "reasoning": reasoning,
        "content": content,
        "tool_calls": json.dumps(tool_calls) if tool_calls else None,
        "finish_reason": "stop",
        "completion_tokens": None,
    }
    r.update(extra)
    return r
