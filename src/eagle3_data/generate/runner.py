"""The request runner: each sample's turns answered from the journal or sent to the backends (retries, budgets,
journal appends), and the event loop that keeps the backends' slots full (:func:`run_requests`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time

from ..backends import paid
from . import progress
from . import startup
from ..runtime import run as run_mod
from ..backends.errors import FatalBackendError, RetryableError, SampleError, retry_wait
from ..backends.request import Request
from ..prompt_check import EARLY_REPLIES
from ..templates import request_messages, thinking_enabled
from .budget import BudgetStop, Pricer
from .prompts import Sample, assistant_message, request_key

logger = logging.getLogger("eagle3_data.generate")


#: a request's attempts, 429s that used up no retry included, stay under ``max_attempts`` times this
FREE_429_FACTOR = 10


class Terminated(BaseException):
    """SIGTERM arrived (raised in the main thread, or by :func:`run_requests` when SIGTERM cancelled the loop)."""


class StopRequested(BudgetStop):
    """The run is stopping (:func:`eagle3_data.runtime.run.stop_reason`): no new request starts; the sample is not sent."""


def failed_row(sample: Sample, dataset: str, turn: int, key: str, prompt, reason: str, detail: str) -> dict:
    """A ``failed`` RESPONSES row: ``prompt`` (messages, or their JSON text) and ``error`` = ``"<reason>: <detail>"``
    (at most 2,000 characters, valid UTF-8)."""
    return {
        "sample_id": sample.sample_id,
        "dataset": dataset,
        "turn": int(turn),
        "request_key": key,
        "messages": json.dumps(prompt, ensure_ascii=False) if not isinstance(prompt, str) else prompt,
        "tools": json.dumps(sample.tools, ensure_ascii=False) if sample.tools else None,
        "status": "failed",
        "error": f"{reason}: {detail}"[:2000].encode("utf-8", "replace").decode("utf-8"),
    }


class Runner:
    """Answers a shard's samples: each turn from the journal (``records``: request key -> the fields resume needs)
    or with a request to ``pool`` (None: nothing may be sent), with retries and budgets (``state``: a
    :class:`.budget.JobState`); new responses are appended to ``journal`` and streamed into ``writer``; failed rows
    are kept in ``rows``, journal-answered keys in ``journal_keys``."""

    def __init__(
        self,
        settings,
        *,
        records,
        journal,
        pool,
        state,
        target=None,
        writer=None,
        write_batch_rows: int = 256,
    ):
        """``settings``: the job's :class:`eagle3_data.settings.GenerateSettings` (dataset, target name and format,
        generation settings: sampling, retries, backoff, ``reject_other_models``, the stop grace)."""
        gen = settings.generation
        self.dataset = settings.dataset
        self.target_name = settings.target_name
        self.generation = gen
        self.records = records
        self.journal = journal
        self.pool = pool
        self.state = state
        self.sampling = gen.sampling()
        self.max_attempts = int(gen.max_retries) + 1
        self.retry_initial_s = float(gen.retry_initial_s)
        self.retry_max_s = float(gen.retry_max_s)
        self.wait = retry_wait(self.retry_initial_s, self.retry_max_s)
        self.rows: list[dict] = []  # failed rows, written at the end
        self.journal_keys: list[str] = []  # ok turns answered by the journal: written from it at the end
        # new ok records go to the output as they arrive, ``write_batch_rows`` at a time (a row group each)
        self.writer = writer
        self.write_batch_rows = max(1, int(write_batch_rows))
        self.out_lines: list[bytes] = []
        self.live: asyncio.Semaphore | None = None  # set by run_requests
        self.backing_off = 0  # tasks sleeping before a retry without a live permit
        self.max_backing_off = 0  # how many may (set by run_requests: the pool's capacity)
        self.target = target  # TargetTokens, for backends with native_generate or return_token_ids
        self.prompt_checks = 0  # replies with server prompt ids checked against our render (prompt_check)
        self.stopping: str | None = None  # why the run is stopping: no new request starts (see run_requests)
        self.keys: list[str] = []  # the configured API keys (paid.configured_keys): never stored from a reply
        # what stops the job once the replies in flight have had the stop grace: a FatalBackendError (401/402/403)
        # or a JournalWriteError; the paid records the journal could not take are held in ``held``
        self.fatal: BaseException | None = None
        self.held: list[dict] = []
        self.on_stop = None  # run_requests: stop starting requests, give those in flight the grace
        self.reject_other_models = bool(gen.reject_other_models)
        self.pricer = Pricer(self.dataset, target, settings.target)  # costs replies without usage.cost
        fmt = settings.target_format or {}  # the target's family and chat_template_kwargs (+ the dataset's)
        self.template = fmt.get("template")
        self.thinking = thinking_enabled(
            self.template, {**(fmt.get("chat_template_kwargs") or {}), **gen.chat_template_kwargs}
        )

    def steps(self, sample: Sample):
        """Yield (turn, prompt, tools, key, journaled record or None); the caller sends the request if None and
        passes the new record back via ``send``-style generator protocol."""
        history = sample.messages
        tools = sample.tools
        for turn in sample.turns:
            prompt = request_messages(history[:turn], self.template)
            key = request_key(self.dataset, sample.sample_id, turn, self.target_name, prompt, tools, self.sampling)
            rec = yield turn, prompt, tools, key, self.records.get(key)
            if rec is None:
                return
            if turn < len(history):
                orig = history[turn]
                # an original turn with tool calls is answered by the tool messages after it: keep it; a
                # regenerated turn that calls tools where the original did not would have no tool results after it
                # (servers answer such a history with HTTP 400): the later turns follow the original conversation
                if not orig.get("tool_calls") and not rec.get("tool_calls"):
                    history[turn] = assistant_message(rec)

    def pending(self, sample: Sample) -> bool:
        """True if some turn of ``sample`` is not journaled; adds journaled spend to the state."""
        gen = self.steps(sample)
        item = next(gen)
        while True:
            rec = item[-1]
            if rec is None:
                return True
            self.state.journal_completion_tokens += rec.get("completion_tokens") or 0
            self.state.journal_cost_usd += rec.get("cost_usd") or 0.0
            if rec.get("status") == "failed":  # a paid reject: journaled, never bought again
                return False
            try:
                item = gen.send(rec)
            except StopIteration:
                return False

    async def run_sample(self, sample: Sample) -> None:
        gen = self.steps(sample)
        item = next(gen)
        st = self.state
        requested = False
        while True:
            turn, prompt, tools, key, rec = item
            if rec is not None:
                st.from_journal += 1
                self.journal_keys.append(key)
                if rec.get("status") == "failed":  # a paid reject of an earlier run: its row comes from the journal
                    reason = (rec.get("error") or "paid_reject").split(":", 1)[0]
                    st.failed[reason] = st.failed.get(reason, 0) + 1
                    st.done += 1
                    st.instant += not requested
                    return
            else:
                requested = True
                try:
                    rec = await self.request(sample, turn, prompt, tools, key)
                except BudgetStop:
                    st.not_sent += 1
                    st.done += 1
                    return
                except FatalBackendError as exc:  # 401/402/403: no new request; those in flight get the grace
                    st.not_sent += 1
                    st.done += 1
                    self.stop_job(exc, exc.message.split(":", 1)[0][:200])
                    return
                except paid.PaidReject as exc:  # paid for, can't be kept: journaled once, a named reject
                    self.write(self.journal_append(exc.record))
                    st.completion_tokens += self.pricer.completion_tokens(exc.record, st.budget_tokens is not None)
                    st.prompt_tokens += exc.record.get("prompt_tokens") or 0
                    st.cost_usd += exc.record.get("cost_usd") or 0.0
                    st.note_spend()
                    st.failed[exc.reason] = st.failed.get(exc.reason, 0) + 1
                    st.done += 1
                    st.last_error = exc.record["error"]
                    n = st.logged_errors[exc.reason] = st.logged_errors.get(exc.reason, 0) + 1
                    if n <= 3:
                        logger.warning(
                            "[%s] sample %s: paid reply refused: %s (journaled: not bought again)%s",
                            self.dataset,
                            sample.sample_id,
                            st.last_error[:300],
                            " (further ones: in the failed rows only)" if n == 3 else "",
                            extra={"tally": False},
                        )  # counted in ``failed``
                    return
                except (RetryableError, SampleError) as exc:
                    st.failed[exc.reason] = st.failed.get(exc.reason, 0) + 1
                    if isinstance(exc, RetryableError):  # no paid reply, nothing journaled: a rerun sends it again
                        st.unpaid[exc.reason] = st.unpaid.get(exc.reason, 0) + 1
                    st.done += 1
                    where = f"backend {exc.backend}, " if getattr(exc, "backend", None) else ""
                    detail = f"{exc.message} ({where}after {getattr(exc, 'attempts', 1)} attempt(s))"
                    st.last_error = f"{exc.reason}: {detail}"
                    if isinstance(exc, RetryableError):
                        st.last_unpaid = st.last_error
                    n = st.logged_errors[exc.reason] = st.logged_errors.get(exc.reason, 0) + 1
                    if n <= 3:  # the text of the first failures of each kind (all are in the failed rows)
                        logger.warning(
                            "[%s] sample %s failed: %s%s",
                            self.dataset,
                            sample.sample_id,
                            st.last_error,
                            " (further failures of this kind: in the failed rows only)" if n == 3 else "",
                            extra={"tally": False},
                        )  # counted in ``failed``
                    self.rows.append(failed_row(sample, self.dataset, turn, key, prompt, exc.reason, detail))
                    return
                self.write(self.journal_append(rec))
                st.completion_tokens += self.pricer.completion_tokens(rec, st.budget_tokens is not None)
                st.prompt_tokens += rec.get("prompt_tokens") or 0
                st.cost_usd += rec.get("cost_usd") or 0.0
                st.note_spend()
                if rec.get("cost_usd") is None and st.budget_usd is not None and not st.warned_unknown_cost:
                    st.warned_unknown_cost = True
                    logger.warning(
                        "[%s] budget_usd is set but backend %s returned a response without a usable "
                        "cost (no usage.cost, a failed cost lookup): the dollar budget counts known "
                        "costs only",
                        self.dataset,
                        rec.get("backend"),
                        extra={"reason": "unknown_cost"},
                    )
                st.by_backend[rec["backend"]] = st.by_backend.get(rec["backend"], 0) + 1
                rec = {k: rec.get(k) for k in ("content", "reasoning", "tool_calls")}  # the history's; rest on disk
                st.new_ok += 1
            try:
                item = gen.send(rec)
            except StopIteration:
                st.ok += 1
                st.done += 1
                st.instant += not requested
                return

    def stop_job(self, exc: BaseException, reason: str) -> None:
        """Stop the job because of ``exc`` (a 402, a journal that can't be written): no request starts from now on,
        the replies in flight get the stop grace to arrive and be journaled (:func:`run_requests`), then ``exc``
        is raised. Without an event loop (nothing is sent) ``exc`` is raised at once."""
        if self.fatal is None:
            self.fatal = exc
        if self.on_stop is None:
            raise exc
        self.on_stop(reason)

    def journal_append(self, rec: dict) -> bytes | None:
        """Journal a paid record and return its line; when the journal can't be written, hold ``rec`` in memory
        (``held``: written to a fallback file when the job ends), stop the job (:meth:`stop_job`) and return
        None."""
        from .journal import JournalWriteError

        try:
            return self.journal.append(rec)
        except JournalWriteError as exc:
            self.held.append(rec)
            self.stop_job(exc, "the response journal can't be written")
            return None

    def gate(self) -> None:
        """Raise :class:`StopRequested` if the job is stopping: called just before a request goes out (after the
        slot and the rate limits), so no request starts after a stop (a 402, a signal) has arrived."""
        if self.stopping:
            raise StopRequested()

    def write(self, line: bytes | None) -> None:
        """Queue a new ok record (its journal line) for the output; a full batch goes to the writer (a row group)."""
        if self.writer is None or line is None:
            return
        self.out_lines.append(line)
        if len(self.out_lines) >= self.write_batch_rows:
            self.flush()

    def flush(self) -> None:
        if self.writer is not None and self.out_lines:
            self.writer.write_json_lines(b"".join(self.out_lines))
        self.out_lines = []

    async def backoff_sleep(self, seconds: float) -> None:
        """Sleep before a retry without holding a ``live`` permit (see :func:`run_requests`): a burst of 429s with
        ``Retry-After`` leaves tasks waiting for the free slots, not the slots idle. At most ``max_backing_off``
        tasks do so at once (then they sleep holding their permit), so the tasks alive stay bounded."""
        if self.live is None or self.backing_off >= self.max_backing_off:
            await asyncio.sleep(seconds)
            return
        self.backing_off += 1
        self.live.release()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.backing_off -= 1
        # not in the finally: a task cancelled while it sleeps (the job stopping) must not wait for a permit
        await self.live.acquire()

    async def request(self, sample: Sample, turn: int, prompt: list, tools: list | None, key: str) -> dict:
        import tenacity

        st = self.state
        if self.pool is None:  # no network: a budget was already reached by journaled responses
            raise BudgetStop()
        attempts = 0
        free = 0  # 429s answered while the backend was being slowed down: they use up no retry (Backend.rate_limited)
        backend = None
        avoid = None  # the backend whose fault (refused connection, 5xx) ended the last attempt
        req = Request(prompt, tools, self.sampling, self.thinking, self.target)  # native ids: rendered once
        most = self.max_attempts * FREE_429_FACTOR

        def stop(retry_state) -> bool:
            return attempts - free >= self.max_attempts or attempts >= most

        try:
            async for attempt in tenacity.AsyncRetrying(
                stop=stop,
                wait=self.wait,
                retry=tenacity.retry_if_exception_type(RetryableError),
                reraise=True,
                sleep=self.backoff_sleep,
            ):
                with attempt:
                    attempts += 1
                    if attempts > 1:
                        st.retries += 1
                    if st.first_sent_at is None:  # before the wait for a slot: that wait is the requests' time
                        st.first_sent_at = time.time()
                        startup.release()  # the next job on this machine may start (eagle3_data.generate.startup)
                    async with self.pool.slot(avoid=avoid) as backend:
                        # budgets gate every attempt (a retry after a 429 costs as much as a new request),
                        # checked when a slot is free so that the spend of everything in flight is counted: the
                        # overshoot is at most what was in flight
                        if self.stopping:
                            raise StopRequested()
                        if st.budget_reached():
                            raise BudgetStop()
                        payload = backend.encode(req)  # the backend's dialect (chat or native)
                        st.in_flight += 1
                        st.sent += 1
                        sent_at = time.monotonic()
                        try:
                            fields = await backend.send(payload, gate=self.gate)
                        except StopRequested:  # the job began stopping while this one waited for a rate limit
                            st.sent -= 1
                            raise
                        except paid.PaidReject:  # a 200 that can't be read: paid for, journaled once as a reject
                            backend.record(True)
                            raise
                        except RetryableError as exc:
                            backend.record(False, exc.backend_fault, f"{exc.reason}: {exc.message}")
                            if exc.reason == "http_429" and backend.rate_limited(
                                sent_at, exc.retry_after, self.retry_initial_s, self.retry_max_s
                            ):
                                free += 1
                            if exc.reason == "timeout":  # abandoned after the server had it: it may be billed
                                st.timed_out[backend.name] = st.timed_out.get(backend.name, 0) + 1
                            avoid = backend if exc.backend_fault else None  # retry elsewhere if possible
                            st.retry_reasons[exc.reason] = st.retry_reasons.get(exc.reason, 0) + 1
                            raise
                        finally:
                            st.in_flight -= 1
                            st.last_done_at = time.time()
                        backend.record(True)
        except (RetryableError, SampleError) as exc:
            exc.attempts = attempts
            exc.backend = backend.name if backend is not None else None
            raise
        except paid.PaidReject as exc:  # the reply itself is unusable (e.g. a cut-off body): its reject record
            if isinstance(exc.fields, dict):
                exc.fields["attempts"] = attempts
                if backend is not None:
                    fields = {**exc.fields, "messages": json.dumps(prompt, ensure_ascii=False)}
                    self.pricer.price(fields, backend.cfg, into=exc.fields)
            exc.record = paid.reject_record(
                exc,
                {
                    "sample_id": sample.sample_id,
                    "dataset": self.dataset,
                    "turn": int(turn),
                    "request_key": key,
                    "messages": json.dumps(prompt, ensure_ascii=False),
                    "tools": json.dumps(tools, ensure_ascii=False) if tools else None,
                },
                self.keys,
            )
            raise
        rec = {
            **fields,
            "sample_id": sample.sample_id,
            "dataset": self.dataset,
            "turn": int(turn),
            "request_key": key,
            "messages": json.dumps(prompt, ensure_ascii=False),
            "tools": json.dumps(tools, ensure_ascii=False) if tools else None,
            "status": "ok",
            "error": None,
            "attempts": attempts,
        }
        if fields.get("cost_usd") is None and backend.cfg.cost_lookup and fields.get("generation_id"):
            st.in_flight += 1  # still counted by the budgets while its cost is unknown
            try:
                rec["cost_usd"] = await backend.lookup_cost(fields["generation_id"])
            except asyncio.CancelledError:
                # the job is stopping (SIGTERM, another request's fatal error) while the stats of a response it
                # paid for are looked up (seconds of waits): journal it without its cost, never pay for it again
                self.write(self.journal_append(rec))
                raise
            finally:
                st.in_flight -= 1
        self.pricer.price(rec, backend.cfg)
        bad = rec.pop("_bad_bytes", 0)
        try:
            warning = paid.check_reply(
                rec,
                asked_model=backend.cfg.model,
                keys=self.keys,
                reject_other_models=self.reject_other_models,
                bad_bytes=bad,
            )
        except paid.PaidReject as exc:
            exc.record = paid.reject_record(
                exc,
                {k: rec.get(k) for k in ("sample_id", "dataset", "turn", "request_key", "messages", "tools")},
                self.keys,
            )
            raise
        if rec.get("prompt_ids") and self.target is not None and self.prompt_checks < EARLY_REPLIES:
            self.check_server_prompt(rec, backend, prompt, tools)
        if warning:
            st.other_model += 1
            if st.other_model <= 3:
                logger.warning(
                    "[%s] sample %s: %s; kept (counted in the summary)%s",
                    self.dataset,
                    sample.sample_id,
                    paid.scrub(warning, self.keys)[:300],
                    "; further ones: counted only" if st.other_model == 3 else "",
                    extra={"tally": False},
                )  # counted in ``other_model``
        return rec

    def check_server_prompt(self, rec: dict, backend, prompt: list, tools: list | None) -> None:
        """One of the shard's first :data:`..prompt_check.EARLY_REPLIES` replies with server prompt ids: compare
        them with the target's render of ``prompt`` (rendered and encoded as tokenize does). On a mismatch the paid
        reply is journaled (tokenize rejects it ``server_prompt_mismatch``) and :class:`FatalBackendError` stops the
        job before more is paid, naming the first differing position and both tokens as text."""
        from ..prompt_check import mismatch_detail
        from ..templates import TemplateError

        self.prompt_checks += 1
        try:
            ours = self.target.encode_texts([self.target.render(prompt, tools, True)])[0]
        except TemplateError:
            return  # our template can't render it: tokenize names that reject
        detail = mismatch_detail(self.target, ours, rec["prompt_ids"])
        if detail is None:
            return
        self.write(self.journal_append(rec))
        raise FatalBackendError(
            f"backend {backend.cfg.name!r} ({backend.cfg.base_url}), sample {rec['sample_id']}: {detail}",
            hint="the server renders prompts with another chat template than the one the build trains on: set "
            "target.template / target.chat_template_kwargs to what the server uses, or start the server with "
            "the target's own chat template, then rerun the same command",
        )


def first_leaf(eg: BaseExceptionGroup) -> BaseException:
    """The exception a TaskGroup's failure stands for: a FatalBackendError, else an interrupt (SIGTERM as
    ``Terminated``, KeyboardInterrupt), else the first task's exception."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    for kinds in (FatalBackendError, (Terminated, KeyboardInterrupt)):
        for e in leaves:
            if isinstance(e, kinds):
                return e
    return leaves[0]


async def run_requests(runner: Runner, samples: list[Sample], display: progress.JobProgress) -> None:
    # SIGTERM or SIGINT during the request phase (a cancelled cluster job, a terminal's Ctrl-C reaching the whole
    # process group) stops the job as the run's stop file does: no new request, the replies in flight (paid for)
    # get stop_grace_s to arrive and be journaled, then Terminated. A second Ctrl-C (SIGINT: an impatient user, or
    # the terminal's Ctrl-C reaching the job and snakemake's stop both) changes nothing: the replies in flight are
    # paid for, and ending now would buy them again. A second SIGTERM (a scheduler's kill) ends it at once. Handled
    # through the event loop: a Python-level handler that raises (what sigterm_as_exception installs for the rest
    # of the job) can land inside an event-loop callback, where asyncio logs and swallows it.
    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    terminated = False
    previous: dict[int, object] = {}

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        main.cancel()

    signals: list[str] = []

    def on_signal(name: str) -> None:
        signals.append(name)
        if len(signals) == 1:
            on_stop(f"{name} received")
        elif name != "SIGINT":
            on_sigterm()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) is signal.SIG_IGN:  # e.g. SIGINT in a background job: left ignored
                continue
            previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, on_signal, sig.name)
    prog = asyncio.create_task(display.run())
    grace_s = float(runner.generation.stop_grace_s)

    def on_stop(reason: str) -> None:
        """The run is stopping: start no request; replies in flight get ``stop_grace_s`` to arrive (journaled),
        then the job ends as interrupted (its output is not written: a rerun resumes). Once: a later call (the
        stop file seen after a signal) changes nothing."""
        if runner.stopping:
            return
        runner.stopping = reason
        logger.warning(
            "[%s] %s: no new requests; %d in flight get %g s to arrive",
            runner.dataset,
            reason,
            runner.state.in_flight,
            grace_s,
            extra={"reason": "stopping"},
        )
        loop.call_later(grace_s, on_sigterm)

    runner.on_stop = on_stop  # a 402 or a journal write error stops the job the same way (Runner.stop_job)
    stopper = asyncio.create_task(run_mod.watch_stop(on_stop))
    try:
        # a permit per sample task in flight or waiting for a slot, at most capacity + 1/8: a 10,000-sample shard
        # does not hold 10,000 coroutines at once (each costs a few KB) and a freed slot always has a task waiting
        # for it. A task sleeping before a retry gives its permit back meanwhile (Runner.backoff_sleep), so
        # requests backing off after 429s never leave slots idle.
        live = runner.live = asyncio.Semaphore(runner.pool.capacity + max(64, runner.pool.capacity // 8))
        runner.max_backing_off = runner.pool.capacity
        pending: set[asyncio.Task] = set()

        def finished(t: asyncio.Task) -> None:
            live.release()
            pending.discard(t)

        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(runner.pool.watch())  # raises BackendDown when every backend is down
            for s in samples:
                if runner.stopping:
                    break
                await live.acquire()
                if runner.stopping:
                    live.release()
                    break
                t = tg.create_task(runner.run_sample(s))
                pending.add(t)
                t.add_done_callback(finished)
                # the new task runs now, up to its request: the first requests leave at once, not after the
                # producer has created capacity + 1/8 tasks (acquire does not yield while permits are free)
                await asyncio.sleep(0)
            if pending:
                await asyncio.wait(set(pending))
            watcher.cancel()
        if runner.fatal is not None:  # every reply in flight arrived (journaled or held) before the grace ended
            raise runner.fatal
        if runner.stopping:  # every task ended before the grace period: the job stops all the same
            raise asyncio.CancelledError()
    except BaseExceptionGroup as eg:  # a task's exception, unwrapped: a stop before an interrupt before a bug
        raise first_leaf(eg) from None
    except asyncio.CancelledError:
        if runner.fatal is not None:  # the grace after a 402 / a journal write error ended
            raise runner.fatal from None
        if terminated or runner.stopping:
            raise Terminated() from None
        raise
    finally:
        stopper.cancel()
        for sig, handler in previous.items():  # remove_signal_handler leaves its default: the job's own back
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
        prog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prog
        await runner.pool.aclose()
