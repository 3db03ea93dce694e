"""Prompt shards in the normalize stage's output shape (the generate stage's input), for generate tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_prompts(path: Path, convs: list[list[dict]], tools=None, ids=None) -> Path:
    """A prompts shard of dataset ``ds`` at ``path``: one row per conversation of ``convs`` (a message list or its
    JSON text), with ``tools`` on every row and ids ``ids`` (default ``s0000``, ``s0001``, ...)."""
    from eagle3_data import schemas
    from eagle3_data.files import write_parquet

    rows = []
    for i, msgs in enumerate(convs):
        rows.append(
            dict(
                sample_id=ids[i] if ids else f"s{i:04d}",
                dataset="ds",
                messages=msgs if isinstance(msgs, str) else json.dumps(msgs),
                tools=json.dumps(tools) if tools else None,
                source_format="test",
                source_row=i,
            )
        )
    write_parquet(schemas.from_rows(rows, schemas.PROMPTS), path)
    return path


def simple_convs(n: int, start: int = 0) -> list[list[dict]]:
    """``n`` one-question conversations (numbered from ``start``), each with the dataset's original answer."""
    return [
        [{"role": "user", "content": f"question number {i}"}, {"role": "assistant", "content": "original"}]
        for i in range(start, start + n)
    ]
