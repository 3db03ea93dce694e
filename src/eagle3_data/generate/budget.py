"""The job's running state: counts, spend, and the budgets that stop new requests.

Budgets (per dataset in config; a shard job gets ``1/num_shards`` of each): ``budget_completion_tokens`` and
``budget_usd`` stop *new* requests once spent + (in flight x mean per completed request) reaches the budget, so the
overshoot is at most what was in flight: the replies of the requests in flight when it was reached, each at most
``max_tokens`` completion tokens (:meth:`JobState.budget_reached`; ``budget_in_flight`` counts them, and the run's
last screen says by how much a budget was overshot, :func:`eagle3_data.report.run_summary`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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
