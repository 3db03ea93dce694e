"""What the request runner hands a backend, whatever its dialect: a :class:`Request`, encoded by the backend's
dialect into a :class:`Payload` (:meth:`.pool.Backend.encode`) that :meth:`.pool.Backend.send` posts and parses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    """One request of a job: the prompt ``messages`` (as keyed), ``tools`` (list or None), ``sampling`` (the request
    key's ``{max_tokens, temperature, top_p, extra_body}``), ``thinking`` (the target reasons after this prompt) and
    ``target`` (the target's ``templates.TargetTokens``, needed by native backends; None otherwise). ``rendered``:
    what a dialect renders once per request and reuses on retries (native prompt ids)."""

    messages: list
    tools: list | None
    sampling: dict
    thinking: bool = False
    target: Any = None
    rendered: dict = field(default_factory=dict)


@dataclass
class Payload:
    """A request encoded for one dialect: ``body`` (JSON bytes), ``est_tokens`` (estimated prompt + ``max_tokens``,
    charged to ``tokens_per_minute``), and what parsing the reply needs (native: ``target`` and the prompt's
    ``think_state``)."""

    body: bytes
    est_tokens: int = 1
    target: Any = None
    think_state: str = "none"
