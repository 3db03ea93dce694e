"""The server's render of a prompt checked against ours: a server that returns its prompt token ids (vLLM's
``return_token_ids``: ``prompt_token_ids``) rendered the chat template itself, and a template other than the one
tokenize trains on gives a draft wrong prompts (vllm-project/speculators RFC #652 and #794).

The generate job checks a shard's first replies (:data:`EARLY_REPLIES`) and stops on a mismatch, before the rest
are paid for; tokenize checks every row (reject ``server_prompt_mismatch``)."""

from __future__ import annotations

#: replies with prompt ids a generate job checks before it trusts the server's template: one mismatch among them
#: stops the job. A template difference (a system prompt, a date line, think markers) shows on every prompt, so 8
#: replies find it almost surely while costing next to nothing; later mismatches (a rare message shape) are
#: tokenize's rejects, so the check never renders the whole shard twice.
EARLY_REPLIES = 8


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where the id lists differ (the shorter one's length when one is a prefix of the
    other), or None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def mismatch_detail(target, ours: list[int], theirs: list[int]) -> str | None:
    """None when the server's prompt ids ``theirs`` equal ``ours`` (the target's render), else a one-line message
    naming the first differing position and both tokens as text (each side's token decoded alone by
    ``target.decode_batch``; ``<end>`` past a list's end) and both lengths."""
    i = first_difference(ours, theirs)
    if i is None:
        return None
    a = ours[i] if i < len(ours) else None
    b = theirs[i] if i < len(theirs) else None
    texts = target.decode_batch([[x] for x in (a, b) if x is not None])
    ta = texts.pop(0) if a is not None else None
    tb = texts.pop(0) if b is not None else None

    def show(t, x):
        return "<end>" if x is None else f"{t!r} (id {x})"

    return (
        f"the server's prompt differs from the target's chat template render at token {i}: ours {show(ta, a)}, "
        f"the server's {show(tb, b)} ({len(ours)} vs {len(theirs)} prompt tokens)"
    )
