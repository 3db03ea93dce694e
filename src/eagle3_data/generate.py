"""The ``generate`` stage: send each prompt to the target model's backends, journal, write RESPONSES parquet.

One job = one dataset shard. Flow:

1. read the PROMPTS parquet (``schemas.PROMPTS``); a row whose ``messages``/``tools`` is not usable becomes a
   ``failed`` row with reason ``bad_prompt`` (no request is sent);
2. build the requests: mode ``last`` regenerates the final assistant turn (prompt = messages before it; a
   conversation without an assistant message is sent whole if it ends on a user/tool message); mode ``all``
   regenerates every assistant turn in order, each prompt built from the regenerated history (sequential per
   sample). Agent trajectories are the same: the prompt is cut before an assistant step;
3. request key = ``io.content_hash(dataset, sample_id, turn, target_name, prompt messages, tools, sampling)``
   with sampling = ``{max_tokens, temperature, top_p, extra_body}``: independent of the backend, so a response
   from OpenRouter satisfies the same request later routed to SGLang;
4. read the journal (:mod:`.journal`; only the fields resume needs are kept in memory), send only missing keys;
   local servers (a backend's ``launch:``) start only when something must be sent. A backend with
   ``native_generate`` gets prompt ids rendered with the target's chat template (``generate(target=...)``) and
   returns exact ``output_ids``; reasoning/content are split at the ``</think>`` id;
5. write every RESPONSES row with ``schemas.CheckedParquetWriter`` (arrow-level contract checks, atomic rename
   when the job succeeds): each new response is journaled, and its journal line goes into the output batch by
   batch while the job runs; responses of earlier runs are streamed back from the journal at the end, then the
   failed rows. Ok rows are never all held in memory. The job imports neither pandas nor ``pyarrow.compute`` /
   ``pyarrow.dataset`` (each ~50 MB of RSS; see :func:`schemas.table_from_json_lines`).

Budgets (per dataset in config; a shard job gets ``1/num_shards`` of each): ``max_samples`` caps the samples
considered (sorted by ``sample_id``), ``budget_completion_tokens`` and ``budget_usd`` stop *new* requests once
spent + (in flight x mean per completed request) reaches the budget, so the overshoot is at most what was in
flight. Samples never sent get no row (a rerun with a larger budget sends them); the summary counts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from . import paid
from . import schemas
from . import progress
from . import run as run_mod
from .backends import limits
from .backends.client import (
    Backend,
    BackendConfig,
    BackendDown,
    BackendPool,
    FatalBackendError,
    RetryableError,
    SampleError,
    build_body,
    build_native_body,
    prompt_think_state,
    retry_wait,
)
from .backends.server import launch_server, shared_server
from .errors import ExpectedFailure, Interrupted, log_to_file
from .io import content_hash, remove_stale_partials, write_json
from .journal import JournalWriter, iter_journal_file, read_journal
from .templates import request_messages, thinking_enabled

logger = logging.getLogger("eagle3_data.generate")

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "extra_body")
RESPONSE_FIELDS = [f.name for f in schemas.RESPONSES]
PROMPT_ROLES = ("user", "tool")


class GenerationStopped(ExpectedFailure):
    """The job stopped early (credentials/credits rejected, a missing key variable, every backend down, every
    request failed); the journal keeps every response. ``message`` names the shard, backend and URL, ``hint`` what
    to do next."""


class GenerationInterrupted(GenerationStopped, Interrupted):
    """SIGTERM or Ctrl-C stopped the job; the journal keeps every response, a rerun resumes."""


class _Terminated(BaseException):
    pass


class _BudgetStop(Exception):
    """A budget forbids sending this new request."""


class _StopRequested(_BudgetStop):
    """The run is stopping (:func:`run.stop_reason`): no new request is started; the sample is not sent."""


# ---------------------------------------------------------------------------------------------------
# prompts -> requests


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
    backend reads, :func:`backends.client.history_reasoning`)."""
    msg: dict = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning"):
        msg["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        msg["tool_calls"] = json.loads(rec["tool_calls"])
    return msg


def sampling_params(generation: dict) -> dict:
    return {k: generation.get(k) if k != "extra_body" else (generation.get(k) or {}) for k in SAMPLING_KEYS}


def request_key(dataset: str, sample_id: str, turn: int, target_name: str, messages: list, tools, sampling: dict) -> str:
    """Backend-independent key of one request (see module docstring)."""
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


def read_prompts(prompts_path, mode: str) -> tuple[list[Sample], list[dict]]:
    """Read a PROMPTS parquet; return (samples, bad rows as dicts with sample_id/row/reason detail)."""
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
        try:
            messages = _parse_json_cell(cols["messages"][i], "messages", i, prompts_path)
            tools = _parse_json_cell(tools_col[i], "tools", i, prompts_path)
            for what, text, value in (("messages", cols["messages"][i], messages), ("tools", tools_col[i], tools)):
                if text and _SURROGATE_ESCAPE.search(text):  # a \udXXX escape: a valid pair, or a broken emoji?
                    try:
                        json.dumps(value, ensure_ascii=False).encode("utf-8")
                    except UnicodeEncodeError:
                        raise ValueError(f"{prompts_path} row {i}: {what} hold an unpaired surrogate (a \\udXXX "
                                         "escape, e.g. a broken emoji): not valid Unicode, can't be sent") from None
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise ValueError(f"{prompts_path} row {i}: messages must be a JSON list of objects with 'role'")
            if tools is not None and not isinstance(tools, list):
                raise ValueError(f"{prompts_path} row {i}: tools must be a JSON list or null")
            turns = assistant_turns(messages, mode)
            if not turns:
                raise ValueError(f"{prompts_path} row {i}: no assistant turn to regenerate and the last message "
                                 "is not a user/tool message")
        except ValueError as exc:
            bad.append({"sample_id": sid, "row": i, "detail": str(exc), "raw": cols["messages"][i],
                        "tools": tools_col[i]})
            continue
        samples.append(Sample(sid, cols["messages"][i], tools_col[i] if tools else None, turns,
                              int(rows_col[i] if rows_col[i] is not None else i)))
    return samples, bad


# ---------------------------------------------------------------------------------------------------
# run state


@dataclass
class _State:
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
    logged_errors: dict = field(default_factory=dict)  # reason -> failures logged with their text so far
    t0: float = field(default_factory=time.monotonic)
    first_sent_at: float | None = None  # unix time this run's first request asked for a slot
    last_done_at: float | None = None  # unix time its last attempt ended

    def spent_tokens(self) -> int:
        return self.completion_tokens + self.journal_completion_tokens

    def spent_usd(self) -> float:
        return self.cost_usd + self.journal_cost_usd

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


def _failed_row(sample: Sample, dataset: str, turn: int, key: str, prompt, reason: str, detail: str) -> dict:
    return {
        "sample_id": sample.sample_id, "dataset": dataset, "turn": int(turn), "request_key": key,
        "messages": json.dumps(prompt, ensure_ascii=False) if not isinstance(prompt, str) else prompt,
        "tools": json.dumps(sample.tools, ensure_ascii=False) if sample.tools else None,
        "status": "failed", "error": f"{reason}: {detail}"[:2000].encode("utf-8", "replace").decode("utf-8"),
    }


class _Runner:
    def __init__(self, *, dataset, target_name, generation, records, journal, pool, state, sampling, target=None,
                 writer=None, write_batch_rows: int = 256, target_format: dict | None = None):
        self.dataset = dataset
        self.target_name = target_name
        self.generation = generation
        self.records = records
        self.journal = journal
        self.pool = pool
        self.state = state
        self.sampling = sampling
        self.max_attempts = int(generation.get("max_retries", 5)) + 1
        self.wait = retry_wait(float(generation.get("retry_initial_s", 1.0)), float(generation.get("retry_max_s", 60.0)))
        self.rows: list[dict] = []  # failed rows, written at the end
        self.journal_keys: list[str] = []  # ok turns answered by the journal: written from it at the end
        # new ok records go to the output as they arrive, ``write_batch_rows`` at a time (a row group each)
        self.writer = writer
        self.write_batch_rows = max(1, int(write_batch_rows))
        self.out_lines: list[bytes] = []
        self.live: asyncio.Semaphore | None = None  # set by _run
        self.backing_off = 0  # tasks sleeping before a retry without a live permit
        self.max_backing_off = 0  # how many may (set by _run: the pool's capacity)
        self.target = target  # TargetTokens, for backends with native_generate
        self.stopping: str | None = None  # why the run is stopping: no new request starts (see _run)
        self.keys: list[str] = []  # the configured API keys (paid.configured_keys): never stored from a reply
        self.reject_other_models = bool(generation.get("reject_other_models", False))
        fmt = target_format or {}  # the target's family and chat_template_kwargs (+ the dataset's)
        self.template = fmt.get("template")
        self.thinking = thinking_enabled(self.template, {**(fmt.get("chat_template_kwargs") or {}), **(
            (generation.get("extra_body") or {}).get("chat_template_kwargs") or {})})
        self.max_tokens = int(generation.get("max_tokens") or 0)

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
                except _BudgetStop:
                    st.not_sent += 1
                    st.done += 1
                    return
                except paid.PaidReject as exc:  # paid for, can't be kept: journaled once, a named reject
                    self.write(self.journal.append(exc.record))
                    st.completion_tokens += exc.record.get("completion_tokens") or 0
                    st.prompt_tokens += exc.record.get("prompt_tokens") or 0
                    st.cost_usd += exc.record.get("cost_usd") or 0.0
                    st.failed[exc.reason] = st.failed.get(exc.reason, 0) + 1
                    st.done += 1
                    st.last_error = exc.record["error"]
                    n = st.logged_errors[exc.reason] = st.logged_errors.get(exc.reason, 0) + 1
                    if n <= 3:
                        logger.warning("[%s] sample %s: paid reply refused: %s (journaled: not bought again)%s",
                                       self.dataset, sample.sample_id, st.last_error[:300],
                                       " (further ones: in the failed rows only)" if n == 3 else "")
                    return
                except (RetryableError, SampleError) as exc:
                    st.failed[exc.reason] = st.failed.get(exc.reason, 0) + 1
                    st.done += 1
                    where = f"backend {exc.backend}, " if getattr(exc, "backend", None) else ""
                    detail = f"{exc.message} ({where}after {getattr(exc, 'attempts', 1)} attempt(s))"
                    st.last_error = f"{exc.reason}: {detail}"
                    n = st.logged_errors[exc.reason] = st.logged_errors.get(exc.reason, 0) + 1
                    if n <= 3:  # the text of the first failures of each kind (all are in the failed rows)
                        logger.warning("[%s] sample %s failed: %s%s", self.dataset, sample.sample_id, st.last_error,
                                       " (further failures of this kind: in the failed rows only)" if n == 3 else "")
                    self.rows.append(_failed_row(sample, self.dataset, turn, key, prompt, exc.reason, detail))
                    return
                self.write(self.journal.append(rec))
                st.completion_tokens += rec.get("completion_tokens") or 0
                st.prompt_tokens += rec.get("prompt_tokens") or 0
                st.cost_usd += rec.get("cost_usd") or 0.0
                if rec.get("cost_usd") is None and st.budget_usd is not None and not st.warned_unknown_cost:
                    st.warned_unknown_cost = True
                    logger.warning("[%s] budget_usd is set but backend %s returned a response without a usable "
                                   "cost (no usage.cost, a failed cost lookup): the dollar budget counts known "
                                   "costs only", self.dataset, rec.get("backend"))
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

    def native_prompt(self, prompt: list, tools) -> tuple[list[int], str]:
        """Prompt ids from the target's chat template (+ think state) for SGLang ``/generate``."""
        from .templates import TemplateError

        if self.target is None:
            raise SampleError("no_target", "native_generate needs the target tokenizer (generate(target=...))")
        try:
            ids = self.target.prompt_ids(prompt, tools)
        except TemplateError as exc:
            raise SampleError(exc.reason, str(exc)[:300]) from None
        return ids, prompt_think_state(self.target, ids)

    def write(self, line: bytes) -> None:
        """Queue a new ok record (its journal line) for the output; a full batch goes to the writer (a row group)."""
        if self.writer is None:
            return
        self.out_lines.append(line)
        if len(self.out_lines) >= self.write_batch_rows:
            self.flush()

    def flush(self) -> None:
        if self.writer is not None and self.out_lines:
            self.writer.write_json_lines(b"".join(self.out_lines))
        self.out_lines = []

    async def backoff_sleep(self, seconds: float) -> None:
        """Sleep before a retry without holding a ``live`` permit (see :func:`_run`): a burst of 429s with
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
            raise _BudgetStop()
        attempts = 0
        backend = None
        avoid = None  # the backend whose fault (refused connection, 5xx) ended the last attempt
        native: list = []  # (input_ids, think state) rendered once, on the first native attempt
        try:
            async for attempt in tenacity.AsyncRetrying(
                stop=tenacity.stop_after_attempt(self.max_attempts),
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
                    async with self.pool.slot(avoid=avoid) as backend:
                        # budgets gate every attempt (a retry after a 429 costs as much as a new request),
                        # checked when a slot is free so that the spend of everything in flight is counted: the
                        # overshoot is at most what was in flight
                        if self.stopping:
                            raise _StopRequested()
                        if st.budget_reached():
                            raise _BudgetStop()
                        if backend.cfg.native_generate:
                            if not native:
                                native.append(self.native_prompt(prompt, tools))
                            ids, think = native[0]
                            body = json.dumps(build_native_body(backend.cfg, ids, self.sampling)).encode()
                            est = len(ids) + self.max_tokens
                        else:
                            body = json.dumps(build_body(backend.cfg, prompt, tools, self.sampling,
                                                         thinking=self.thinking), ensure_ascii=False).encode()
                            est = len(body) // 4 + self.max_tokens
                        st.in_flight += 1
                        st.sent += 1
                        try:
                            if backend.cfg.native_generate:
                                fields = await backend.post_native(body, self.target, think, est)
                            else:
                                fields = await backend.post_chat(body, est)
                        except RetryableError as exc:
                            backend.record(False, exc.backend_fault, f"{exc.reason}: {exc.message}")
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
        rec = {
            **fields,
            "sample_id": sample.sample_id, "dataset": self.dataset, "turn": int(turn), "request_key": key,
            "messages": json.dumps(prompt, ensure_ascii=False),
            "tools": json.dumps(tools, ensure_ascii=False) if tools else None,
            "status": "ok", "error": None,
        }
        if fields.get("cost_usd") is None and backend.cfg.cost_lookup and fields.get("generation_id"):
            st.in_flight += 1  # still counted by the budgets while its cost is unknown
            try:
                rec["cost_usd"] = await backend.lookup_cost(fields["generation_id"])
            except asyncio.CancelledError:
                # the job is stopping (SIGTERM, another request's fatal error) while the stats of a response it
                # paid for are looked up (seconds of waits): journal it without its cost, never pay for it again
                self.write(self.journal.append(rec))
                raise
            finally:
                st.in_flight -= 1
        bad = rec.pop("_bad_bytes", 0)
        try:
            warning = paid.check_reply(rec, asked_model=backend.cfg.model, keys=self.keys,
                                       reject_other_models=self.reject_other_models, bad_bytes=bad)
        except paid.PaidReject as exc:
            exc.record = paid.reject_record(exc, {k: rec.get(k) for k in (
                "sample_id", "dataset", "turn", "request_key", "messages", "tools")}, self.keys)
            raise
        if warning:
            st.other_model += 1
            if st.other_model <= 3:
                logger.warning("[%s] sample %s: %s; kept (counted in the summary)%s", self.dataset,
                               sample.sample_id, paid.scrub(warning, self.keys)[:300],
                               "; further ones: counted only" if st.other_model == 3 else "")
        return rec


def _job_overhead(state: _State) -> dict:
    """``startup_s``: seconds from this process's start (its interpreter, imports, reading the inputs) to its
    first request asking for a slot; ``wrapup_s``: from its last attempt's end to now (writing the outputs).
    Both None when it sent nothing. The forecast adds them to the simulated requests (a job's time is these
    plus its requests')."""
    if state.first_sent_at is None:
        return {"startup_s": None, "wrapup_s": None}
    import psutil  # a dependency of snakemake

    started = psutil.Process().create_time()
    return {"startup_s": round(max(0.0, state.first_sent_at - started), 3),
            "wrapup_s": round(max(0.0, time.time() - (state.last_done_at or state.first_sent_at)), 3)}


def _cpu_s() -> float:
    """CPU seconds (user + system, every thread) this process has used since it started: the job's whole client
    cost, its interpreter start and imports included (``benchmarks/generation_run.py`` divides it by requests)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return round(ru.ru_utime + ru.ru_stime, 3)


def _first_leaf(eg: BaseExceptionGroup) -> BaseException:
    """The exception a TaskGroup's failure stands for: a FatalBackendError, else an interrupt (SIGTERM as
    ``_Terminated``, KeyboardInterrupt), else the first task's exception."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    for kinds in (FatalBackendError, (_Terminated, KeyboardInterrupt)):
        for e in leaves:
            if isinstance(e, kinds):
                return e
    return leaves[0]


async def _run(runner: _Runner, samples: list[Sample], display: progress.JobProgress) -> None:
    # SIGTERM during the request phase cancels this task through the event loop: a Python-level handler that
    # raises (what _sigterm_as_exception installs for the rest of the job) can land inside an event-loop callback,
    # where asyncio logs and swallows it, and the job would then run to its end. Raised here as _Terminated.
    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    terminated = False
    previous = None

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        main.cancel()

    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    prog = asyncio.create_task(display.run())
    grace_s = float(runner.generation.get("stop_grace_s", 10.0))

    def on_stop(reason: str) -> None:
        """The run is stopping: start no request; replies in flight get ``stop_grace_s`` to arrive (journaled),
        then the job ends as interrupted (its output is not written: a rerun resumes)."""
        runner.stopping = reason
        logger.warning("[%s] %s: no new requests; %d in flight get %g s to arrive", runner.dataset, reason,
                       runner.state.in_flight, grace_s)
        loop.call_later(grace_s, on_sigterm)

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
            if pending:
                await asyncio.wait(set(pending))
            watcher.cancel()
        if runner.stopping:  # every task ended before the grace period: the job stops all the same
            raise asyncio.CancelledError()
    except BaseExceptionGroup as eg:  # a task's exception, unwrapped: a stop before an interrupt before a bug
        raise _first_leaf(eg) from None
    except asyncio.CancelledError:
        if terminated or runner.stopping:
            raise _Terminated() from None
        raise
    finally:
        stopper.cancel()
        if previous is not None:  # remove_signal_handler leaves SIG_DFL: put the job's own handler back
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, previous)
        prog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prog
        await runner.pool.aclose()


# ---------------------------------------------------------------------------------------------------
# the stage


@contextlib.contextmanager
def _backend_pool(cfgs: list[BackendConfig], run, backend_jobs: dict | None, tag: str):
    """The job's :class:`BackendPool`: each backend capped at this job's share of its ``max_concurrency``
    (:func:`.limits.job_limit`), with the run's host slots when the limit is shared on this machine."""
    mode = limits.sharing_mode(run)
    backends = []
    for c in cfgs:
        n_jobs = (backend_jobs or {}).get(c.name, 1)
        cap = limits.job_limit(c.max_concurrency, mode, n_jobs)
        slots = limits.host_slots(run, c.name, c.max_concurrency) if mode == "host" else None
        # rate limits have no shared counter: each job of the run takes an even share of them
        share = 1.0 / max(1, n_jobs) if mode in ("host", "split") else 1.0
        backends.append(Backend(c, cap=cap, slots=slots, rate_share=share))
        logger.info("%s backend %s: at most %d request(s) in flight from this job%s%s", tag, c.name, cap,
                    f", {c.max_concurrency} over all jobs on this machine" if slots else
                    f" ({c.max_concurrency} split over {n_jobs} jobs)" if mode == "split" else "",
                    f"; rate limits: 1/{n_jobs} of the backend's each" if share < 1 and (
                        c.requests_per_minute or c.tokens_per_minute) else "")
    yield BackendPool(backends)


def _log_file(log) -> Path | None:
    """The job log's file: ``log`` itself when a path, else the first FileHandler of a Logger (or its parents)."""
    if isinstance(log, (str, os.PathLike)):
        return Path(log)
    lg = log if isinstance(log, logging.Logger) else logging.getLogger("eagle3_data")
    while lg is not None:
        for h in lg.handlers:
            if getattr(h, "baseFilename", None):
                return Path(h.baseFilename)
        lg = lg.parent if lg.propagate else None
    return None


def _server_log_path(log, journal_dir: Path, dataset: str, shard: str, backend: str) -> Path:
    p = _log_file(log)
    if p is not None:
        return p.with_name(f"{p.stem}.server-{backend}.log")
    return journal_dir / dataset / f"{shard}.server-{backend}.log"


@contextlib.contextmanager
def _job_logging(log):
    """Attach a file handler for ``log`` (a path) to the package logger for the job's duration."""
    if not isinstance(log, (str, os.PathLike)):
        yield
        return
    pkg = logging.getLogger("eagle3_data")
    target = os.path.abspath(log)
    if any(getattr(h, "baseFilename", None) == target for h in pkg.handlers):
        yield
        return
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(target, mode="a")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    pkg.addHandler(h)
    if pkg.level == logging.NOTSET or pkg.level > logging.INFO:
        pkg.setLevel(logging.INFO)
    try:
        yield
    finally:
        pkg.removeHandler(h)
        h.close()


@contextlib.contextmanager
def _sigterm_as_exception():
    """While active (main thread only), SIGTERM raises so that ``finally`` blocks stop servers and close
    the journal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _load_target(target: dict | None, generation: dict, dataset: str):
    """TargetTokens for native ``/generate`` prompts (chat_template_kwargs: target's, then the dataset's)."""
    from .templates import target_tokens

    if not target or not target.get("path"):
        raise ValueError(f"dataset {dataset}: a backend has native_generate: true, which needs the target "
                         "tokenizer: pass generate(target=config['target'])")
    return target_tokens(target, (generation.get("extra_body") or {}).get("chat_template_kwargs"))


def _journal_batches(path: Path, block_bytes: int):
    """Record batches (``schemas.RESPONSES`` columns) of one journal file, parsed by pyarrow's streaming JSON
    reader (about ``block_bytes`` of JSON per batch, extra keys ignored). Raises ``pyarrow.ArrowInvalid`` at the
    first line it can't parse (a torn write, a record longer than a block): the caller falls back to Python."""
    import pyarrow as pa
    import pyarrow.json as pj

    with pa.OSFile(str(path), "r") as fh:
        reader = pj.open_json(fh, read_options=pj.ReadOptions(block_size=block_bytes, use_threads=False),
                              parse_options=pj.ParseOptions(explicit_schema=schemas.RESPONSES,
                                                            unexpected_field_behavior="ignore"))
        yield from reader


def _write_output(out_path, journal_dir: Path, dataset: str, ok_keys: list[str], failed_rows: list[dict],
                  batch_rows: int, block_bytes: int = 1 << 18) -> int:
    """Write a RESPONSES parquet from the journal: the journaled records of ``ok_keys`` (see
    :func:`_write_journaled`) + ``failed_rows``; return the row count. (The stage itself streams its new
    responses into the writer as they arrive and reads only earlier runs' responses back from the journal.)

    Raises RuntimeError if a key is missing from the journal."""
    with schemas.CheckedParquetWriter("responses", out_path) as w:
        _write_journaled(w, Path(journal_dir) / dataset, set(ok_keys), batch_rows, block_bytes)
        w.write_rows(failed_rows)
        return w.rows


def _wanted_runs(keys: list, wanted: set) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of positions whose key is in ``wanted`` (each key taken once: removed from
    ``wanted``, so a later duplicate is skipped). ``["a", "x", "b", "c"]`` with wanted {a, b, c} -> [(0, 1), (2, 4)]."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, k in enumerate(keys):
        if k in wanted:
            wanted.discard(k)
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(keys)))
    return runs


def _batch_suspect(rb) -> bool:
    """True if a journal batch holds a value :func:`journal.record_problem` rejects that parsing alone lets
    through (a negative count or cost, a non-finite number, a negative token id): the arrow path and
    :func:`journal.read_journal` must agree on which records exist."""
    for name in ("turn", "prompt_tokens", "completion_tokens", "reasoning_tokens"):
        if any(v is not None and v < 0 for v in rb.column(name).to_pylist()):
            return True
    for name in ("cost_usd", "latency_s", "completed_at"):
        if any(v is not None and (not math.isfinite(v) or (name == "cost_usd" and v < 0))
               for v in rb.column(name).to_pylist()):
            return True
    ids = rb.column("output_ids").values  # the int32 child (a freshly parsed batch: no slicing offsets)
    if not len(ids):
        return False
    import numpy as np  # already loaded by pyarrow; np.frombuffer, unlike to_numpy, loads no pyarrow.compute

    return int(np.frombuffer(ids.buffers()[1], dtype=np.int32, count=len(ids), offset=4 * ids.offset).min()) < 0


def _write_journaled(w: schemas.CheckedParquetWriter, folder: Path, wanted: set, batch_rows: int,
                     block_bytes: int = 1 << 18, files: list | None = None) -> None:
    """Write the journaled records whose ``request_key`` is in ``wanted`` (emptied as they are found) to ``w``.

    The ``*.jsonl`` files of ``folder`` (or only ``files``: those the resume index found the keys in, so that
    a shard does not parse the other shards' journals) are streamed in name order, first occurrence of a key
    wins (as in :func:`journal.read_journal`). Each file is read in ~``block_bytes`` batches by pyarrow's JSON
    reader (no Python dict per row, zero-copy slices of the wanted rows); from a line it can't parse (torn
    write) on, that file is read line by line in Python (``batch_rows`` rows a batch).

    Raises RuntimeError if a key is missing from the journal (it was appended this run or read at start)."""
    import pyarrow as pa

    for path in (sorted(files) if files is not None else sorted(folder.glob("*.jsonl"))) if wanted else []:
        try:
            for rb in _journal_batches(path, block_bytes):
                if _batch_suspect(rb):  # a value journal.record_problem rejects: judge each line in Python
                    raise pa.ArrowInvalid("a record with an out-of-range value")
                runs = _wanted_runs(rb.column("request_key").to_pylist(), wanted)
                if runs:  # zero-copy slices: no pyarrow.compute (its kernel registry is ~50 MB RSS)
                    w.write_table(pa.Table.from_batches([rb.slice(a, b - a) for a, b in runs]))
                if not wanted:
                    break
        except pa.ArrowInvalid as exc:  # torn line or an oversized record: the rest of this file in Python
            logger.debug("journal %s: arrow reader stopped (%s); reading it line by line", path, exc)
            batch: list[dict] = []
            for rec in iter_journal_file(path):
                if rec["request_key"] in wanted:
                    wanted.discard(rec["request_key"])
                    batch.append({k: rec.get(k) for k in RESPONSE_FIELDS})
                    if len(batch) >= batch_rows:
                        w.write_rows(batch)
                        batch = []
            w.write_rows(batch)
        if not wanted:
            break
    if wanted:
        raise RuntimeError(f"{folder}: {len(wanted)} journaled response(s) vanished while the job "
                           f"ran (e.g. request_key {sorted(wanted)[0]}); output not written")


def generate(
    prompts_path,
    out_path,
    *,
    dataset: str,
    shard: str,
    target_name: str,
    generation: dict,
    backends: dict,
    journal_dir,
    log=None,
    num_shards: int = 1,
    progress_interval_s: float = 5.0,
    summary_path=None,
    target: dict | None = None,
    write_batch_rows: int = 256,
    target_format: dict | None = None,
    backend_jobs: dict | None = None,
    sample_ids=None,
    budget_sources: dict | None = None,
) -> dict:
    """Generate responses for one dataset shard; write ``out_path`` (RESPONSES parquet); return a summary.

    Args:
        prompts_path: PROMPTS parquet (``schemas.PROMPTS``).
        out_path: RESPONSES parquet to write (atomically; one row per (sample, regenerated turn), ``ok`` or
            ``failed`` with ``error`` = ``"<reason>: <detail>"``; never-sent samples get no row).
        dataset, shard: names; the journal is ``<journal_dir>/<dataset>/<shard>.jsonl``.
        target_name: identity of the target model in request keys.
        generation: the dataset's ``generation:`` config (backends, mode, max_tokens, temperature, top_p,
            extra_body, max_retries, max_samples, budget_completion_tokens, budget_usd; optional
            retry_initial_s / retry_max_s (backoff, default 1 / 60 s)).
        backends: config ``backends:`` (name -> dict); only those named in ``generation["backends"]`` are used.
        journal_dir: directory for journals (outside ``results/``).
        log: the job log: a path (progress lines are appended to it), a ``logging.Logger`` already writing to a
            file (e.g. from ``logs.setup_logging``), or None. Local servers log to ``<stem>.server-<backend>.log``
            beside that file (without a file: in the journal folder).
        num_shards: shards of the dataset; per-dataset caps and budgets are split evenly across them.
        progress_interval_s: seconds between progress lines (:mod:`.progress`: on a terminal of its own the job
            draws a tqdm bar and writes these lines to its log file only).
        summary_path: if given, the returned summary is also written there as JSON (atomically); the report
            reads ``stopped_by`` from it.
        target: the config ``target`` slice (``path``, ``template``, ``trust_remote_code``,
            ``chat_template_kwargs``); needed only when a backend has ``native_generate: true`` (SGLang
            ``/generate``: prompt ids are rendered with the target's chat template, ``chat_template_kwargs``
            updated by ``generation.extra_body.chat_template_kwargs``, and the exact ``output_ids`` are stored).
        write_batch_rows: rows per output batch (a parquet row group; memory: one batch of JSON lines).
        target_format: ``{"template": family, "chat_template_kwargs": {...}}`` of the target (config ``target``):
            Kimi families get their history tool-call ids rewritten to ``functions.<name>:<index>`` in the prompt
            sent (and stored, and keyed); a thinking target (family and kwargs, the dataset's
            ``extra_body.chat_template_kwargs`` included) gets an empty reasoning on history tool-call turns that
            have none (:func:`backends.client.history_reasoning`). Regenerated reasoning (mode ``all``) always goes
            back in the field the backend reads.
        backend_jobs: backend name -> generate jobs using it in the whole workflow (:func:`.limits.jobs_using`):
            cluster jobs split a backend's ``max_concurrency`` over them (:mod:`.backends.limits`).
        sample_ids: if given (a set of ids), only these samples of the shard are considered, after the
            ``max_samples`` cap; unusable rows outside it get no row. The forecast's pilot (:mod:`.forecast`): the
            same requests, keys and journal as the full job, which then answers them from the journal.
        budget_sources: budget key -> where the config sets it (:func:`.config.generation_source`, e.g.
            ``"datasets.x.generation.budget_usd"`` or the global ``"generation.budget_usd"``): named by the
            warning a budget stop logs (default ``"generation.<key>"``).

    Runtime (not arguments, so that none of it reruns anything): inside a workflow run (:mod:`.run`) a backend's
    ``max_concurrency`` is shared with the run's other generate jobs on this machine and a launched server is the
    run's (:func:`.backends.server.shared_server`); otherwise this job has the whole limit and its own server.

    Returns: dict with dataset, shard, samples, ok, failed (reason -> count), from_journal, sent (HTTP
        requests), retries, not_sent, completion_tokens / prompt_tokens / cost_usd (this run),
        total_completion_tokens / total_cost_usd (incl. journal), by_backend, stopped_by, servers_started
        (launched servers this job started), servers_attached (run servers it used), wall_s (s), startup_s and
        wrapup_s (s from the process start to the first request, and from the last attempt's end to the
        summary; None when nothing was sent), cpu_s (CPU seconds of the job process, user + system, since it
        started).

    Raises:
        GenerationStopped: 401/402/403 from a backend, a missing API key variable, every backend down (refused
            connections or only 5xx for ``down_after_s``), every request failed; :class:`GenerationInterrupted`
            (a subclass) for SIGTERM / Ctrl-C. The journal keeps every completed response; no output is written.
        ServerLaunchError: a local server did not start.
        ValueError: bad config or an unreadable prompts file (message names file/row/key).
        templates.TemplateError: the target tokenizer can't be loaded (native_generate only).

    Output: ok rows are not kept in memory; new ones are written as they arrive and earlier runs' are read back
    from the journal, in batches of ``write_batch_rows``, with :class:`schemas.CheckedParquetWriter` (arrow-level
    checks of the RESPONSES contract, atomic rename).
    """
    # malloc-backed arrow buffers for the job: they reuse the heap the run's Python objects free, where a
    # mimalloc/jemalloc pool keeps its own tens of MB on top of the run's peak (generation_client benchmark)
    import pyarrow as pa

    old_pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        return _generate(prompts_path, out_path, dataset=dataset, shard=shard, target_name=target_name,
                         generation=generation, backends=backends, journal_dir=journal_dir, log=log,
                         num_shards=num_shards, progress_interval_s=progress_interval_s, summary_path=summary_path,
                         target=target, write_batch_rows=write_batch_rows, target_format=target_format,
                         backend_jobs=backend_jobs, sample_ids=sample_ids,
                         budget_sources=budget_sources)
    except (_Terminated, KeyboardInterrupt):  # outside the request phase (reading prompts, the final write)
        raise GenerationInterrupted(f"[{dataset}/{shard}] interrupted", hint="rerun the same command to resume; "
                                    "every response received so far is journaled") from None
    finally:
        pa.set_memory_pool(old_pool)


def _generate(prompts_path, out_path, *, dataset, shard, target_name, generation, backends, journal_dir, log,
              num_shards, progress_interval_s, summary_path, target, write_batch_rows, backend_jobs,
              target_format=None, sample_ids=None, budget_sources=None) -> dict:
    t0 = time.monotonic()
    journal_dir = Path(journal_dir)
    out_path = Path(out_path)
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    tag = f"[{dataset}/{shard}]"
    with _job_logging(log), _sigterm_as_exception():
        mode = generation.get("mode", "last")
        names = list(generation.get("backends") or [])
        if not names:
            raise ValueError(f"dataset {dataset}: generation.backends is empty")
        unknown = [n for n in names if n not in backends]
        if unknown:
            raise ValueError(f"dataset {dataset}: generation.backends names unknown backends {unknown}")
        cfgs = [BackendConfig.from_dict(n, backends[n]) for n in names]
        sampling = sampling_params(generation)

        samples, bad = read_prompts(prompts_path, mode)
        samples.sort(key=lambda s: s.sample_id)
        cap = generation.get("max_samples")
        capped = 0
        if cap is not None:
            per_shard = shard_share(int(cap), num_shards, shard)
            capped = max(0, len(samples) - per_shard)
            samples = samples[:per_shard]
        if sample_ids is not None:  # the forecast's pilot: a subset of what the full job sends
            wanted = set(sample_ids)
            samples = [s for s in samples if s.sample_id in wanted]
            bad = [b for b in bad if b["sample_id"] in wanted]
        div = max(1, num_shards)
        bt = generation.get("budget_completion_tokens")
        bu = generation.get("budget_usd")
        state = _State(
            total=len(samples) + len([b for b in bad if not b.get("dup")]),
            budget_tokens=None if bt is None else float(bt) / div,
            budget_usd=None if bu is None else float(bu) / div,
        )
        # resume index: spend, and (mode all) what the regenerated history needs; texts stay on disk
        keep = ("completion_tokens", "cost_usd", "status", "error") + (
            ("content", "reasoning", "tool_calls") if mode == "all" else ())
        key_files: dict = {}  # the file of each journaled record: the end reads back only those files
        records, jstats = read_journal(journal_dir, dataset, fields=keep, key_files=key_files)
        logger.info(
            "%s %d samples (%d unusable, %d over max_samples), mode %s; journal: %d responses in %d file(s), "
            "%d torn/bad line(s) skipped", tag, len(samples), len(bad), capped, mode, jstats["records"],
            jstats["files"], jstats["bad_lines"],
        )
        rows: list[dict] = []
        for b in bad:
            if b.get("dup"):
                logger.warning("%s row %d: duplicate sample_id %s skipped", tag, b["row"], b["sample_id"])
                continue
            s = Sample(b["sample_id"], "[]", None, [])
            key = content_hash(dataset, b["sample_id"], "bad_prompt")
            r = _failed_row(s, dataset, 0, key, b.get("raw") or "[]", "bad_prompt", b["detail"])
            r["tools"] = b.get("tools")
            rows.append(r)
            state.failed["bad_prompt"] = state.failed.get("bad_prompt", 0) + 1
            state.done += 1
            state.instant += 1

        # which samples still need a request? (mode all: walk the journal through the regenerated history)
        probe = _Runner(dataset=dataset, target_name=target_name, generation=generation, records=records,
                        journal=None, pool=None, state=state, sampling=sampling, target_format=target_format)
        target_tokens = None
        n_pending = sum(1 for s in samples if probe.pending(s))
        logger.info("%s %d sample(s) need requests, %d complete in the journal", tag, n_pending, len(samples) - n_pending)

        servers_started, servers_attached, server_logs = [], [], {}
        network = bool(n_pending) and not state.budget_reached()
        if n_pending and not network:
            logger.info("%s %s already reached by journaled responses: nothing sent", tag, state.stopped_by)

        jw: list[JournalWriter] = []
        display = progress.JobProgress(state, tag, progress_interval_s, logger)
        display.backends = names
        if sample_ids is not None:
            display.kind = "pilot"

        def journaled() -> str:
            n = jstats["records"] + (jw[0].written if jw else 0)
            return f"{n:,} response{'s' if n != 1 else ''} of {dataset} are journaled and will not be requested again"

        # the output is written while the job runs (new responses as they arrive); it appears at out_path only
        # when the job succeeds (atomic rename); a partial file left by a killed job is removed here
        for stale in remove_stale_partials(out_path):
            logger.info("%s removed %s (partial output of an interrupted job)", tag, stale)
        with schemas.CheckedParquetWriter("responses", out_path) as writer:
            try:
                with contextlib.ExitStack() as stack:
                    pool = None
                    if network:
                        for cfg in cfgs:
                            cfg.api_key()  # a missing key variable stops the job before any server starts
                            if "{port}" in cfg.base_url and not cfg.launch:
                                raise ValueError(f"backend {cfg.name!r}: base_url has {{port}} but no launch: config")
                        if any(c.native_generate for c in cfgs):
                            target_tokens = _load_target(target, generation, dataset)
                        run = run_mod.current()
                        for cfg in cfgs:
                            if cfg.launch:
                                if run is not None:  # one server per backend for the whole workflow run
                                    srv = stack.enter_context(shared_server(
                                        cfg.launch, cfg.model, name=cfg.name, run=run,
                                        log_path=Path("logs") / "servers" / f"{cfg.name}.log"))
                                else:  # the Python API, a cluster job: this job's own server
                                    srv = stack.enter_context(launch_server(
                                        cfg.launch, cfg.model,
                                        _server_log_path(log, journal_dir, dataset, shard, cfg.name), name=cfg.name))
                                cfg.base_url = cfg.base_url.replace("{port}", str(srv.port))
                                (servers_started if srv.started else servers_attached).append(cfg.name)
                                server_logs[cfg.name] = srv.log_path
                        pool = stack.enter_context(_backend_pool(cfgs, run, backend_jobs, tag))
                        display.pool = pool
                    journal = stack.enter_context(JournalWriter(journal_dir, dataset, shard))
                    jw.append(journal)
                    if pool is not None:
                        journal.ensure_open()  # an unwritable journal stops the job before it pays for anything
                    runner = _Runner(dataset=dataset, target_name=target_name, generation=generation, records=records,
                                     journal=journal, pool=pool, state=state, sampling=sampling, target=target_tokens,
                                     writer=writer, write_batch_rows=write_batch_rows, target_format=target_format)
                    runner.keys = paid.configured_keys(backends)
                    if pool is not None:
                        state.t0 = time.monotonic()  # the rate, ETA and tok/s: of the request phase
                        with display.session():
                            asyncio.run(_run(runner, samples, display))
                    else:
                        for s in samples:  # everything is journaled: no network, no event loop
                            coro = runner.run_sample(s)
                            try:
                                coro.send(None)
                            except StopIteration:
                                pass
                    rows.extend(runner.rows)
                    journal.sync()
            except FatalBackendError as exc:
                hint = exc.hint or "rerun the same command"
                if isinstance(exc, BackendDown):
                    logs = ", ".join(str(p) for p in server_logs.values())
                    hint = (f"the server the build launched stopped answering: see its log ({logs}), then rerun "
                            "the same command" if server_logs else
                            "start the server or fix the backend's base_url, then rerun the same command")
                raise GenerationStopped(f"{tag} {exc.message}", hint=f"{hint}; {journaled()}") from None
            except (_Terminated, KeyboardInterrupt):
                log_to_file(logging.getLogger("eagle3_data"), logging.INFO, "%s interrupted: %s", tag,
                            progress.line(state, "").lstrip())
                raise GenerationInterrupted(f"{tag} interrupted",
                                            hint=f"rerun the same command to resume; {journaled()}") from None

            del records
            failed_n = sum(state.failed.values())
            failed_requests = sum(n for reason, n in state.failed.items() if reason != "bad_prompt")
            answered = state.new_ok + state.from_journal  # requests with a response (mode all: turns, not samples)
            if failed_requests and answered == 0:
                # not one request answered: a misconfigured or unreachable backend, not data to keep
                raise GenerationStopped(
                    f"{tag} every request failed ({failed_requests} of {failed_requests} requests: {dict(state.failed)}); "
                    f"last error: {state.last_error}",
                    hint=f"check the backends {[c.name for c in cfgs]} (model, base_url, server running, API key), "
                         "then rerun the same command")
            if failed_requests:
                logger.warning(
                    "%s %d request(s) failed after retries (%s): recorded as failed; `snakemake --forcerun generate` "
                    "retries them (journaled responses are not sent again)", tag, failed_requests, dict(state.failed))
            runner.flush()  # new responses: streamed into the writer during the run
            # responses of earlier runs: read back from the journal
            wanted = set(runner.journal_keys)
            _write_journaled(writer, journal_dir / dataset, wanted, write_batch_rows,
                             files=sorted({key_files[k] for k in wanted if k in key_files}))
            writer.write_rows(rows)
            n_rows = writer.rows

        if state.stopped_by:
            stopped_by = state.stopped_by
        elif capped:
            stopped_by = "max_samples"
        else:
            stopped_by = "all samples done"
        summary = {
            "dataset": dataset, "shard": shard, "samples": state.total, "ok": state.ok,
            "failed": dict(state.failed), "failed_total": failed_n, "from_journal": state.from_journal,
            "sent": state.sent, "retries": state.retries, "retry_reasons": dict(state.retry_reasons),
            "not_sent": state.not_sent, "over_max_samples": capped,
            "prompt_tokens": state.prompt_tokens, "completion_tokens": state.completion_tokens,
            "cost_usd": round(state.cost_usd, 6), "total_completion_tokens": state.spent_tokens(),
            "total_cost_usd": round(state.spent_usd(), 6), "by_backend": dict(state.by_backend),
            "stopped_by": stopped_by, "servers_started": servers_started, "servers_attached": servers_attached,
            "journal_bad_lines": jstats["bad_lines"], "rows": n_rows, "other_model_replies": state.other_model,
            "wall_s": round(time.monotonic() - t0, 3), **_job_overhead(state), "cpu_s": _cpu_s(),
        }
        logger.info("%s finished: %s", tag, progress.final_line(state, "").lstrip())
        if state.not_sent:
            key = state.stopped_by or "budget"
            logger.warning("%s %s", tag, progress.budget_stop_message(
                state, key, generation.get(key), (budget_sources or {}).get(key) or f"generation.{key}", div))
        logger.info("%s summary: %s", tag, json.dumps(summary, sort_keys=True))
        if summary_path is not None:
            write_json(summary, summary_path)
        display.snapshot(final=True)
        return summary
