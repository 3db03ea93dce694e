"""The backends of a job: a live :class:`Backend` (settings + HTTP session + its dialect, limits and health) and the
:class:`BackendPool` that hands out their slots in priority order.

A backend owns its protocol: :meth:`Backend.encode` turns a :class:`.request.Request` into the body of the
backend's dialect (:mod:`.chat`, or :mod:`.native` for ``native_generate``) and :meth:`Backend.send` posts it and
returns the parsed reply (RESPONSES fields), whatever the dialect.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import httpx

from . import chat, native
from ..errors import ExpectedFailure
from .errors import BackendDown, FatalBackendError, RetryableError, SampleError
from .fields import as_cost
from .transport import HttpSession, check_status
from .request import Payload, Request
from .definition import BackendConfig

logger = logging.getLogger("eagle3_data.backends")

#: a storm of 429s, which the adaptive back-off answers (Backend.rate_limited): at least STORM_MIN_429 of the
#: backend's last STORM_WINDOW answers were 429s, and at least half of them
STORM_WINDOW = 20
STORM_MIN_429 = 4
#: a backend whose every attempt (at least 3) for this many seconds ended in a backend fault shows as down in the
#: run-wide view while it lasts (Backend.trouble); it is taken out only after its down_after_s
LIVE_DOWN_S = 5.0


def dialect_for(cfg: BackendConfig):
    """The module speaking ``cfg``'s API (:mod:`.native` for ``native_generate``, else :mod:`.chat`): its ``url``,
    ``encode`` and ``parse`` functions."""
    return native if cfg.native_generate else chat


class Backend:
    """A live backend: config + HTTP session (:class:`.transport.HttpSession`, sized to this job's cap) + its dialect
    + in-flight count. ``transport``: see :class:`.transport.HttpSession`.

    Concurrency: at most ``cap`` requests in flight from this job (default ``max_concurrency``); with ``slots`` (a
    :class:`.limits.HostSlots` shared by every generate job on this machine, of any run) each request also holds
    one of the backend's ``max_concurrency`` slots, so the limit holds over all jobs together (see
    :class:`BackendPool`).
    Rate limits (``requests_per_minute``, ``tokens_per_minute``): this job sends at ``rate_share`` of them
    (1 / the jobs that use the backend, in a workflow run), so the jobs together stay under them.

    Rate limits answered (HTTP 429): in a storm of them (most of the last answers; a sporadic 429 is retried as
    any error), an adaptive back-off (:meth:`rate_limited`) pauses the backend and halves the requests this job
    keeps in flight to it (``limit``, at least 1) once per round of requests, and each reply that arrives raises
    it by one again, up to ``cap``; a 429 that slows the backend down uses up no retry of its request, so a storm
    of 429s slows the job instead of failing its samples.

    Health: ``eject_after`` consecutive backend faults (connection refused, 5xx) take it out of rotation for
    ``eject_s`` seconds; its requests go to the other backends meanwhile. A backend whose every attempt ended in such
    a fault for ``cfg.down_after_s`` seconds (no success in between) is *down*: out for the rest of the job, and when
    every backend of the job is down the job stops (:class:`BackendDown`, naming the backend, its URL and the last
    error).
    """

    def __init__(
        self,
        cfg: BackendConfig,
        *,
        eject_after: int = 20,
        eject_s: float = 30.0,
        cap: int | None = None,
        slots=None,
        rate_share: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.cfg = cfg
        self.name = cfg.name
        self.in_flight = 0
        self.cap = int(cap or cfg.max_concurrency)
        self.limit = float(self.cap)  # requests in flight allowed now: lowered by 429s (rate_limited)
        self.cut_at = 0.0  # monotonic time of the last cut: a 429 to a request sent before it cuts no further
        self.cuts = 0
        self.rounds = 0  # cuts since the last reply that arrived (the pause doubles with them)
        self.recent: collections.deque = collections.deque(maxlen=STORM_WINDOW)  # last answers: 429 or not
        self.grew = False  # the last reply raised the limit: a released slot wakes one more waiter
        self.slots = slots  # HostSlots or None
        if slots is not None:
            slots.register()
        self.held = 0  # host slots this job holds (in use: in_flight of them; the rest kept for waiting requests)
        self.host_blocked = False  # the last try found this job under its cap but no host slot free
        self.eject_after = eject_after
        self.eject_s = min(eject_s, max(1.0, cfg.down_after_s / 3))  # ejections never hide a dead backend for long
        self.consecutive_faults = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.fault_since: float | None = None  # first backend fault since the last success
        self.fault_count = 0
        self.last_error: str | None = None
        self.down: str | None = None  # why the backend is out for good
        self.dialect = dialect_for(cfg)
        self.session = HttpSession(cfg, self.cap, transport)
        self.limiter = None
        self.token_limiter = None
        # this job's share of the backend's rate limits (1 / the jobs that use it: together they never pass them)
        self.rpm = float(cfg.requests_per_minute) * rate_share if cfg.requests_per_minute else None
        self.tpm = float(cfg.tokens_per_minute) * rate_share if cfg.tokens_per_minute else None
        if self.rpm or self.tpm:
            from aiolimiter import AsyncLimiter

            if self.rpm:
                self.limiter = AsyncLimiter(self.rpm, 60.0)
            if self.tpm:
                self.token_limiter = AsyncLimiter(self.tpm, 60.0)
        self.cost_lookups = 0
        self.cost_lookup_misses = 0

    def available(self, now: float) -> bool:
        """True if a request may be sent now (takes a host slot for it when slots are shared: the caller then
        counts it in ``in_flight``)."""
        if self.down or self.in_flight >= min(self.cap, int(self.limit)) or now < self.ejected_until:
            return False
        if self.slots is None or self.held > self.in_flight:
            return True
        if self.held >= self.slots.fair_share():
            # holding its share, this job is nobody's reason to yield: a mark left from an earlier wait would make
            # every job at its share yield to every other one while slots lie free
            self.slots.starving(False)
            if self.slots.starving():
                self.host_blocked = False  # yielding to a job that waits: our own released slots wake us
                return False
        if self.slots.try_take():
            self.held += 1
            self.host_blocked = False
            self.slots.starving(False)
            return True
        self.host_blocked = True
        self.slots.starving(True)
        return False

    def put_back(self, keep: bool) -> None:
        """A request ended: keep its host slot for a waiting request of this job (``keep``) unless this job holds more
        than its fair share while another job waits; return the slots held beyond those in use otherwise."""
        if self.slots is None or self.held <= self.in_flight:
            return
        spare = self.held - self.in_flight
        if keep:
            over = self.held - self.slots.fair_share()
            if over <= 0 or not self.slots.starving():
                return
            spare = min(spare, over)
        else:
            self.slots.starving(False)
        self.slots.give(spare)
        self.held -= spare

    def record(self, ok: bool, backend_fault: bool = False, error: str | None = None) -> None:
        """Count a request's outcome. ``backend_fault`` (refused connection, 5xx) with ``error`` (reason: text)
        counts toward an ejection and toward being down (see the class docstring)."""
        if not (error or "").startswith("http_429"):  # (a 429 is counted by rate_limited)
            self.recent.append(False)
        if ok:
            self.rounds = 0
            if self.limit < self.cap:
                self.limit = min(float(self.cap), self.limit + 1.0)
                self.grew = True
            self.consecutive_faults = 0
            self.fault_since = None
            self.fault_count = 0
            return
        if backend_fault:
            now = time.monotonic()
            self.last_error = error or self.last_error
            if self.fault_since is None:
                self.fault_since = now
            self.fault_count += 1
            self.consecutive_faults += 1
            if self.check_down(now):
                return
            if self.consecutive_faults >= self.eject_after:
                self.ejected_until = time.monotonic() + self.eject_s
                self.ejections += 1
                self.consecutive_faults = 0
                logger.warning(
                    "backend %s: %d consecutive failures, out of rotation for %.0f s",
                    self.name,
                    self.eject_after,
                    self.eject_s,
                    extra={"reason": "backend_ejected"},
                )

    def rate_limited(
        self, sent_at: float, retry_after: float | None = None, initial_s: float = 1.0, max_s: float = 60.0
    ) -> bool:
        """A request sent at ``sent_at`` (``time.monotonic()``) was answered HTTP 429. In a storm (at least
        :data:`STORM_MIN_429` of the backend's last :data:`STORM_WINDOW` answers, and half of them, were 429s: a
        sporadic 429 is retried as any other error), the first such answer of a
        round (to a request sent after the last one's cut) halves ``limit`` (at least 1) and pauses the backend
        for ``retry_after`` seconds (else ``initial_s`` doubling per round in a row, at most ``max_s``): no request
        of this job goes to it meanwhile (a storm answered at once would otherwise be asked again at once).
        Returns True when the 429 is not to use up a retry of its request (the backend was being slowed down:
        ``limit`` was above 1, or the request left before the round's cut), False once the job sends it one
        request at a time."""
        self.recent.append(True)
        n = sum(self.recent)
        if n < STORM_MIN_429 or 2 * n < len(self.recent):  # a sporadic 429: retried as any other error
            return False
        if sent_at < self.cut_at:  # the same round as the last cut
            return True
        now = time.monotonic()
        before = self.limit
        self.limit = max(1.0, self.limit / 2)
        self.rounds += 1
        pause = retry_after if retry_after is not None else initial_s * 2 ** (self.rounds - 1)
        pause = max(0.0, min(max_s, pause))
        self.cut_at = now
        self.ejected_until = max(self.ejected_until, now + pause)
        self.cuts += 1
        (logger.warning if self.cuts == 1 else logger.info)(
            "backend %s: rate limited (HTTP 429): paused %.1f s, then at most %d request(s) in flight from this job "
            "(was %d; one more per reply that arrives)",
            self.name,
            pause,
            int(self.limit),
            int(before),
            extra={"reason": "rate_limited"},
        )
        return before > 1.0

    def check_down(self, now: float) -> bool:
        """Whether the backend is down: every attempt (at least 3) since ``fault_since`` ended in a backend fault and
        ``down_after_s`` have passed since the first (checked at each fault and by :meth:`BackendPool.watch`)."""
        if (
            not self.down
            and self.fault_since is not None
            and self.fault_count >= 3
            and now - self.fault_since >= self.cfg.down_after_s
        ):
            self.down = (
                f"{self._failing()} for {now - self.fault_since:.0f} s ({self.fault_count} attempts, none "
                f"succeeded; backends.{self.name}.down_after_s is {self.cfg.down_after_s:g})"
            )
        return bool(self.down)

    def _failing(self) -> str:
        err = self.last_error or ""
        return (
            "refused connections"
            if err.startswith("connection_error")
            else "answered only HTTP 5xx"
            if err.startswith("http_5")
            else "failed"
        )

    def slowed(self, now: float | None = None) -> str | None:
        """Why this job sends the backend fewer requests than its cap now, and until when, for the run-wide view:
        after a 429 storm (:meth:`rate_limited`) the limit it is at, the pause's end (local time) while it lasts,
        and how many replies bring it back to the cap (one more request per reply); None at the cap."""
        if not self.cuts or int(self.limit) >= self.cap or self.down:
            return None
        now = time.monotonic() if now is None else now
        pause = ""
        if now < self.ejected_until:
            pause = (
                f", paused until {time.strftime('%H:%M:%S', time.localtime(time.time() + self.ejected_until - now))}"
            )
        left = self.cap - int(self.limit)
        return (
            f"rate limited (HTTP 429): {int(self.limit)} of {self.cap} in flight{pause}; back to {self.cap} after "
            f"{left} more repl{'ies' if left != 1 else 'y'}"
        )

    def trouble(self, now: float | None = None) -> str | None:
        """Why the backend is not answering now, for the run-wide view (:mod:`eagle3_data.runtime.runview`): its ``down``
        reason once it is out, else, while every attempt (at least 3) of the last :data:`LIVE_DOWN_S` seconds or
        more ended in a backend fault, what it does, since when and the last error; None while it answers."""
        if self.down:
            return self.down
        now = time.monotonic() if now is None else now
        if (
            self.fault_since is None
            or self.fault_count < 3
            or now - self.fault_since < min(LIVE_DOWN_S, self.cfg.down_after_s)
        ):
            return None
        return (
            f"{self._failing()} for {now - self.fault_since:.0f} s ({self.fault_count} attempts, none succeeded; "
            f"out after {self.cfg.down_after_s:g} s); last error: {(self.last_error or '')[:100]}"
        )

    async def _limits(self, est_tokens: int) -> None:
        if self.limiter is not None:
            await self.limiter.acquire()
        if self.token_limiter is not None:
            # charged up front (estimated prompt + max_tokens), as OpenAI-style TPM limits count max_tokens
            await self.token_limiter.acquire(min(float(max(1, est_tokens)), self.tpm))

    def encode(self, request: Request) -> Payload:
        """``request`` as this backend's dialect sends it (:func:`dialect_for`); raises :class:`SampleError` when it
        can't be (a native prompt the target's template can't render)."""
        return self.dialect.encode(self.cfg, request)

    async def send(self, payload: Payload, gate=None) -> dict:
        """POST one encoded request (:meth:`encode`) after the rate limits; return the parsed reply (RESPONSES fields,
        the same keys for every dialect) or raise Retryable/Sample/FatalBackendError (messages scrubbed), or
        :class:`eagle3_data.backends.paid.PaidReject` for a 200 reply that can't be read.

        ``payload.est_tokens``: the request's estimated prompt + max_tokens, charged to ``tokens_per_minute``;
        ``gate``: called after the rate limits, just before the request goes out (it raises to stop it)."""
        await self._limits(payload.est_tokens)
        if gate is not None:
            gate()
        t0 = time.monotonic()
        try:
            resp = await self.session.post(self.dialect.url(self.cfg), payload.body)
            check_status(self.cfg, resp)
            return self.dialect.parse(self.cfg, resp.content, time.monotonic() - t0, payload)
        except (RetryableError, SampleError, FatalBackendError) as exc:
            raise self._scrubbed(exc) from None

    def _scrubbed(self, exc: Exception) -> Exception:
        """``exc`` with its message scrubbed (:meth:`BackendConfig.scrub`): it reaches logs and failed rows."""
        if isinstance(exc, (RetryableError, SampleError)):
            exc.message = self.cfg.scrub(exc.message)
            exc.args = (f"{exc.reason}: {exc.message}" if exc.message else exc.reason,)
        elif isinstance(exc, ExpectedFailure):
            exc.message = self.cfg.scrub(exc.message)
            exc.args = (exc.message,)
        else:
            exc.args = tuple(self.cfg.scrub(str(a)) for a in exc.args)
        return exc

    async def lookup_cost(self, generation_id: str, attempts: int = 5) -> float | None:
        """OpenRouter ``GET {base_url}/generation?id=...`` -> ``data.total_cost`` (USD), or None.

        Stats appear only after accounting finishes, so a 404 is retried after ``cost_lookup_delay_s`` (doubling,
        ``attempts`` tries); any other failure gives None (the response is kept without a cost)."""
        delay = self.cfg.cost_lookup_delay_s
        self.cost_lookups += 1
        for n in range(attempts):
            try:
                async with asyncio.timeout(self.cfg.timeout_s):  # a whole-request deadline, as in HttpSession.post
                    resp = await self.session.get("/generation", params={"id": generation_id})
            except (httpx.HTTPError, TimeoutError) as exc:
                logger.debug("backend %s: cost lookup %s failed: %s", self.name, generation_id, type(exc).__name__)
                resp = None
            if resp is not None and resp.status_code == 200:
                try:
                    data = resp.json().get("data")
                    cost = as_cost(data.get("total_cost")) if isinstance(data, dict) else None
                    if cost is not None:
                        return cost
                    break  # no usable cost in the stats
                except (ValueError, AttributeError, TypeError):
                    break
            if resp is not None and resp.status_code not in (404, 429) and resp.status_code < 500:
                break
            if n + 1 < attempts:
                await asyncio.sleep(delay * 2**n)
        self.cost_lookup_misses += 1
        return None

    async def aclose(self) -> None:
        if self.slots is not None:
            self.slots.give(self.held)
            self.held = 0
            self.slots.starving(False)
            self.slots.register(False)
        await self.session.aclose()


class BackendPool:
    """Backends in priority order: a request takes the first backend with a free slot (overflow goes on).

    ``async with pool.slot() as backend:`` waits until some backend in rotation has capacity. With host slots
    (:class:`.limits.HostSlots`), a request that ends hands its slot to a request of this job waiting for one, else
    gives it back to the other jobs; while requests wait only because other jobs hold every slot, one of them polls
    for a freed slot every ``poll_s`` (doubling to ``poll_max_s``). Raises :class:`BackendDown` when every backend
    is down.
    """

    def __init__(self, backends: list[Backend], *, poll_s: float = 0.02, poll_max_s: float = 0.25):
        if not backends:
            raise ValueError("BackendPool needs at least one backend")
        self.backends = backends
        self._cond = asyncio.Condition()
        self._waiting = 0
        self._poller: asyncio.Task | None = None
        self.poll_s, self.poll_max_s = poll_s, poll_max_s
        self._poll = poll_s

    @property
    def capacity(self) -> int:
        return sum(b.cap for b in self.backends)

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends)

    def check_down(self) -> None:
        """Raise :class:`BackendDown` if every backend is down (naming each, its URL and its last error)."""
        if all(b.down for b in self.backends):
            raise BackendDown(
                "; ".join(
                    f"backend {b.name!r} ({b.cfg.base_url}) {b.down}; last error: {b.last_error}" for b in self.backends
                )
            )

    async def watch(self, interval_s: float = 1.0) -> None:
        """Every ``interval_s``: mark backends down whose faults have lasted ``down_after_s`` (even while no request
        is being tried: all backing off or the backend ejected), wake the waiters, and raise :class:`BackendDown`
        when every backend is down (run it beside the requests; cancel it when they are done)."""
        logged: set[str] = set()
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            changed = [b for b in self.backends if not b.down and b.check_down(now)]
            if changed:
                async with self._cond:
                    self._cond.notify_all()
            self.check_down()
            for b in self.backends:  # (when all are down, BackendDown above says it all)
                if b.down and b.name not in logged:
                    logged.add(b.name)
                    logger.warning(
                        "backend %s (%s) is out for this job: it %s; last error: %s; its requests go to "
                        "the other backends",
                        b.name,
                        b.cfg.base_url,
                        b.down,
                        b.last_error,
                        extra={"reason": "backend_down"},
                    )

    async def acquire(self, avoid: Backend | None = None) -> Backend:
        """The first backend in priority order with a free slot. ``avoid`` (the backend whose fault ended a
        request's last attempt) is skipped, waiting for another one's slot, while another backend is in rotation
        (not ejected); it is used only when it is the only one left."""
        me = asyncio.current_task()
        async with self._cond:
            self._waiting += 1
            try:
                while True:
                    self.check_down()
                    now = time.monotonic()
                    choices = self.backends
                    if avoid is not None and any(
                        b is not avoid and not b.down and now >= b.ejected_until for b in self.backends
                    ):
                        choices = [b for b in self.backends if b is not avoid]
                    for b in choices:
                        if b.available(now):
                            b.in_flight += 1
                            self._poll = self.poll_s
                            if self._waiting > 1:
                                # the next waiter tries too: host slots that other jobs gave back are taken by as
                                # many waiters as need them, not one per release of this job's own (a job that got
                                # few slots at the start would otherwise stay at that count while slots lie free)
                                self._cond.notify(1)
                            return b
                    # all busy or ejected: wake on release, when the earliest ejection ends, or (one waiter) to poll
                    # for a host slot another job gave back
                    wake = [b.ejected_until - now for b in self.backends if b.ejected_until > now and not b.down]
                    if any(b.host_blocked and not b.down for b in choices) and self._poller in (None, me):
                        self._poller = me
                        wake.append(self._poll)
                        self._poll = min(self.poll_max_s, self._poll * 2)
                    timeout = max(0.01, min(wake)) if wake else None
                    try:  # asyncio.timeout, not wait_for: the wait (and its lock) stays in this task when cancelled
                        async with asyncio.timeout(timeout):
                            await self._cond.wait()
                    except TimeoutError:
                        pass
            finally:
                self._waiting -= 1
                if not self._waiting:  # nobody here waits for a slot any more (they took one, maybe elsewhere)
                    for b in self.backends:
                        if b.slots is not None:
                            b.slots.starving(False)
                if self._poller is me:
                    self._poller = None
                    self._cond.notify(1)  # another waiter takes over the polling

    async def release(self, b: Backend) -> None:
        async with self._cond:
            b.in_flight -= 1
            b.put_back(keep=self._waiting > 0)
            self._cond.notify(2 if b.grew else 1)  # a raised limit frees one more slot
            b.grew = False

    def slot(self, avoid: Backend | None = None) -> "_Slot":
        return _Slot(self, avoid)

    async def aclose(self) -> None:
        for b in self.backends:
            await b.aclose()


class _Slot:
    """``async with pool.slot() as backend``: a backend slot held for the block (one small object per request)."""

    __slots__ = ("avoid", "backend", "pool")

    def __init__(self, pool: BackendPool, avoid: Backend | None = None):
        self.pool = pool
        self.avoid = avoid
        self.backend: Backend | None = None

    async def __aenter__(self) -> Backend:
        self.backend = await self.pool.acquire(self.avoid)
        return self.backend

    async def __aexit__(self, *exc) -> None:
        await self.pool.release(self.backend)
