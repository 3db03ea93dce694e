"""Think-block state at the id level: whether the prompt already opened or closed the think block, and the split
of a target's output ids into reasoning and answer (the native backend's reply).
"""

from __future__ import annotations


def prompt_think_state(target, prompt_ids: list[int]) -> str:
    """``"none" | "open" | "closed"``: whether the prompt ids already opened (or opened and closed) the think
    block after the last role/end-of-turn marker (the id-level twin of :meth:`TargetTokens.think_state`;
    ``target`` a :class:`TargetTokens` or None)."""
    if target is None or target.think_open_id is None:
        return "none"
    bound = set(target.role_marker_ids) | set(target.end_ids)
    o = c = -1
    for i in range(len(prompt_ids) - 1, -1, -1):
        t = prompt_ids[i]
        if t in bound:
            break
        if t == target.think_open_id and o < 0:
            o = i
        elif t == target.think_close_id and c < 0:
            c = i
    if o < 0:
        return "none"
    return "closed" if c > o else "open"


def split_output_ids(target, output_ids: list[int], state: str = "none") -> tuple[str | None, str]:
    """Split a completion's ids into ``(reasoning, content)`` text at the target's ``</think>`` id.

    Trailing end-of-turn ids are not text. For a reasoning target: the ids between ``<think>`` (or the prompt's
    open think block, ``state == "open"``) and ``</think>`` are the reasoning, the ids after it the content; no
    ``</think>`` in the output means everything is reasoning when the block was opened (truncated thinking), else
    everything is content. A non-reasoning target: all content, reasoning None. Decoded with special tokens kept
    and no space clean-up, so the tokenize stage's ``exact`` check sees the same text.
    """
    ids = list(output_ids)
    while ids and ids[-1] in target.end_ids:
        ids.pop()
    close, open_ = target.think_close_id, target.think_open_id
    r_ids: list[int] | None = None
    if target.fmt.reasoning and close is not None:
        if close in ids:
            j = ids.index(close)
            pre, ids = ids[:j], ids[j + 1 :]
            r_ids = pre[pre.index(open_) + 1 :] if open_ in pre else pre
        elif open_ in ids[:2] or state == "open":
            r_ids = ids[ids.index(open_) + 1 :] if open_ in ids[:2] else ids
            ids = []
    if r_ids is None:
        return None, target.decode_batch([ids])[0] if ids else ""
    r, c = target.decode_batch([r_ids, ids])
    return r, c
