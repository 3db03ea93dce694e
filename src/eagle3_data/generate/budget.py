"""The job's running state: counts, spend, and the budgets that stop new requests.

Budgets (per dataset in config; a shard job gets ``1/num_shards`` of each): ``budget_completion_tokens`` and
``budget_usd`` stop *new* requests once spent + (in flight x mean per completed request) reaches the budget, so the
overshoot is at most what was in flight: the replies of the requests in flight when it was reached, each at most
``max_tokens`` completion tokens (:meth:`JobState.budget_reached`; ``budget_in_flight`` counts them, and the run's
last screen says by how much a budget was overshot, :func:`eagle3_data.report.run_summary`).

A reply's cost is the provider's ``usage.cost`` (OpenRouter; or its cost lookup), else the backend's
``price_per_m`` times the reply's usage, else ``price_per_m`` times our own count of its tokens
(:func:`reply_cost`). A dollar budget no backend can cost is refused before anything is sent
(:func:`uncosted_backends`, checked with the config).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field

logger = logging.getLogger("eagle3_data.generate")


class BudgetStop(Exception):
    """A budget forbids sending this new request."""


@dataclass
class JobState:
    total: int
    budget_tokens: float | None
    budget_usd: float | None
    done: int = 0
    from_journal: int = 0
    ok: int = 0
    sent: int = 0  # HTTP requests made (attempts)
    retries: int = 0
    in_flight: int = 0
    not_sent: int = 0
    instant: int = 0  # samples done without a request (bad prompts, answered by the journal): not in the rate
    failed: dict = field(default_factory=dict)
    # of ``failed``: samples whose retries ran out without a paid reply (reason -> n; nothing journaled: a rerun
    # sends them again, backends.errors.unpaid_reason)
    unpaid: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0  # this run's new responses
    journal_completion_tokens: int = 0
    cost_usd: float = 0.0
    journal_cost_usd: float = 0.0
    new_ok: int = 0
    stopped_by: str | None = None
    warned_unknown_cost: bool = False
    other_model: int = 0  # replies naming another model than asked (kept unless reject_other_models)
    by_backend: dict = field(default_factory=dict)
    retry_reasons: dict = field(default_factory=dict)
    # attempts abandoned at the backend's timeout_s, by backend: the server had them, so a provider may bill them
    timed_out: dict = field(default_factory=dict)
    last_error: str | None = None  # "<reason>: <text> (backend <name>)" of the last failed request
    last_unpaid: str | None = None  # the same, of the last sample that failed without a paid reply
    logged_errors: dict = field(default_factory=dict)  # reason -> failures logged with their text so far
    # the job's warnings by reason (eagle3_data.logs.tally_warnings): the run-wide view counts them, the log has them
    warnings: dict = field(default_factory=dict)
    # the replies that could still arrive when the spend first reached a budget: the requests then in flight and
    # the reply that reached it (note_spend); no request starts after it, so they are all its overshoot can be
    budget_in_flight: int | None = None
    t0: float = field(default_factory=time.monotonic)
    first_sent_at: float | None = None  # unix time this run's first request asked for a slot
    last_done_at: float | None = None  # unix time its last attempt ended

    def spent_tokens(self) -> int:
        return self.completion_tokens + self.journal_completion_tokens

    def spent_usd(self) -> float:
        return self.cost_usd + self.journal_cost_usd

    def note_spend(self) -> None:
        """Call after a reply's spend was added: when the spend first reaches a budget, record in
        ``budget_in_flight`` the requests still in flight plus this reply's (the most the budget can be overshot
        by: from now on :meth:`budget_reached` refuses every request)."""
        if self.budget_in_flight is not None:
            return
        if (self.budget_tokens is not None and self.spent_tokens() >= self.budget_tokens) or (
            self.budget_usd is not None and self.spent_usd() >= self.budget_usd
        ):
            self.budget_in_flight = self.in_flight + 1

    def budget_reached(self) -> str | None:
        """Name of the budget that forbids a request now, counting what is in flight at the running mean per
        completed request; None if none does. Evaluated afresh at every attempt (not sticky): when requests in
        flight fail (a 429), the room they held is given back. ``stopped_by`` keeps the last budget that refused
        a request (the summary's "which limit ended the dataset")."""
        n = max(1, self.new_ok)
        reached = None
        if self.budget_tokens is not None:
            est = self.completion_tokens / n if self.new_ok else 0.0
            if self.spent_tokens() + self.in_flight * est >= self.budget_tokens:
                reached = "budget_completion_tokens"
        if self.budget_usd is not None and reached is None:
            est = self.cost_usd / n if self.new_ok else 0.0
            if self.spent_usd() + self.in_flight * est >= self.budget_usd:
                reached = "budget_usd"
        if reached:
            self.stopped_by = reached
        return reached


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` when no tokenizer is at hand: its UTF-8 bytes / 4, rounded up (the estimate the request
    limits use; real vocabularies average 3-5 bytes a token on English and code)."""
    return -(-len(text.encode("utf-8", "replace")) // 4)


def token_counter(tokenizer=None):
    """``text -> number of tokens``: ``tokenizer``'s count (a ``tokenizers.Tokenizer`` or a transformers
    tokenizer; no special tokens added), or :func:`estimate_tokens` when None."""
    if tokenizer is None:
        return estimate_tokens

    def count(text: str) -> int:
        enc = tokenizer.encode(text, add_special_tokens=False)
        return len(enc.ids if hasattr(enc, "ids") else enc)

    return count


def _prompt_text(messages) -> str:
    """The texts of a request's ``messages`` (JSON text, as journaled): every string content, concatenated."""
    try:
        msgs = json.loads(messages) if isinstance(messages, str) else messages
    except ValueError:
        return str(messages)
    parts = []
    for m in msgs or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            parts.extend(p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "\n".join(parts)


def reply_cost(fields: dict, price: dict, count_tokens) -> tuple[float, bool]:
    """``(USD, counted)``: the cost of a reply that came without ``usage.cost``, at ``price``
    (``backends.<name>.price_per_m``: ``{"prompt": usd, "completion": usd}`` per million tokens).

    The token counts are the reply's usage (``prompt_tokens``, ``completion_tokens``); a count the reply left out is
    ours (``counted`` True): the ids the server returned (``prompt_ids``, ``output_ids``), else ``count_tokens``
    (:func:`token_counter`) of the prompt's texts (``messages``) or of the reply's text (content, reasoning, tool
    calls; an undecodable reply's ``raw_reply``)."""
    counted = False
    prompt = fields.get("prompt_tokens")
    if prompt is None:
        counted = True
        prompt = (
            len(fields["prompt_ids"])
            if fields.get("prompt_ids")
            else count_tokens(_prompt_text(fields.get("messages")))
        )
    completion = fields.get("completion_tokens")
    if completion is None:
        counted = True
        if fields.get("output_ids"):
            completion = len(fields["output_ids"])
        else:
            text = "".join(fields.get(k) or "" for k in ("reasoning", "content", "tool_calls", "raw_reply"))
            completion = count_tokens(text)
    return (prompt * float(price["prompt"]) + completion * float(price["completion"])) / 1e6, counted


def uncosted_backends(backends: dict) -> list[str]:
    """Names of the backends (``{name: config entry}``) whose replies no dollar budget can count: no
    ``price_per_m``, not OpenRouter (whose replies carry ``usage.cost``) and not a server the build launches (on
    the user's own machines: nothing is bought). A plain OpenAI-compatible endpoint (a hosted vLLM, any provider)
    reports tokens at most, never dollars."""
    return [
        n
        for n, b in backends.items()
        if (b or {}).get("type") != "openrouter" and not (b or {}).get("price_per_m") and not (b or {}).get("launch")
    ]


def bad_budget(value) -> str | None:
    """Why a budget value (``budget_usd``, ``budget_completion_tokens``) caps nothing, or None for a real cap:
    NaN, infinite or negative (``.nan`` / ``.inf`` in YAML: no comparison stops at them)."""
    if value is None or isinstance(value, bool):
        return None
    v = float(value)
    if math.isnan(v):
        return "is NaN (no spend ever reaches it)"
    if math.isinf(v):
        return f"is {'infinite' if v > 0 else 'negative infinity'} (it caps nothing; null means no budget)"
    if v < 0:
        return f"is negative ({value})"
    return None


class Pricer:
    """Costs the replies of a job that come without ``usage.cost`` (:func:`reply_cost`), at their backend's
    ``price_per_m``. Our token counts use the target tokenizer (``target``: the job's loaded TargetTokens, else
    the tokenizer of ``target_cfg["path"]``, loaded at the first reply that needs it), else :func:`estimate_tokens`.
    The first reply costed from our own count is warned about once."""

    def __init__(self, dataset: str, target=None, target_cfg: dict | None = None):
        self.dataset = dataset
        self.target = target
        self.target_cfg = target_cfg or {}
        self._count = None
        self.counted_by = None  # "the target tokenizer" | "an estimate (UTF-8 bytes / 4)", once a count was needed
        self.warned = False
        self.warned_tokens = False

    def count_tokens(self):
        if self._count is None:
            tok = getattr(self.target, "tok", None)
            if tok is None and self.target_cfg.get("path"):
                from ..view import load_tokenizer

                try:
                    tok = load_tokenizer(self.target_cfg["path"], bool(self.target_cfg.get("trust_remote_code")))
                except ValueError as exc:
                    logger.warning("[%s] %s: token counts are estimated", self.dataset, exc)
            self._count = token_counter(tok)
            self.counted_by = "the target tokenizer" if tok is not None else "an estimate (UTF-8 bytes / 4)"
        return self._count

    def price(self, fields: dict, cfg, into: dict | None = None) -> None:
        """Set ``cost_usd`` of ``into`` (default ``fields``, a reply's RESPONSES fields) from backend ``cfg``'s
        ``price_per_m`` when the reply carried no usable cost; nothing when it did or there is no price."""
        if fields.get("cost_usd") is not None or not cfg.price_per_m:
            return
        usd, counted = reply_cost(fields, cfg.price_per_m, self.count_tokens())
        (fields if into is None else into)["cost_usd"] = usd
        if counted and not self.warned:
            self.warned = True
            self.count_tokens()
            logger.warning(
                "[%s] backend %s returned a reply without its token usage: its cost is counted from %s of its "
                "tokens at backends.%s.price_per_m",
                self.dataset,
                cfg.name,
                self.counted_by,
                cfg.name,
                extra={"reason": "counted_cost"},
            )

    def completion_tokens(self, rec: dict, budgeted: bool) -> int:
        """The completion tokens a reply adds to the token budget: its usage's, else (when a token budget is set)
        our own count of them (:func:`reply_cost`'s), warned once; else 0."""
        n = rec.get("completion_tokens")
        if n is not None or not budgeted:
            return int(n or 0)
        count = self.count_tokens()
        text = "".join(rec.get(k) or "" for k in ("reasoning", "content", "tool_calls", "raw_reply"))
        counted = len(rec["output_ids"]) if rec.get("output_ids") else count(text)
        if not self.warned_tokens:
            self.warned_tokens = True
            logger.warning(
                "[%s] backend %s returned a reply without usage.completion_tokens: the token budget counts %s of "
                "its tokens",
                self.dataset,
                rec.get("backend"),
                self.counted_by,
                extra={"reason": "counted_tokens"},
            )
        return counted
