"""The job entry: :func:`generate`, one dataset shard from its PROMPTS parquet to its RESPONSES parquet (the flow is
described in :mod:`eagle3_data.generate`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends import paid
from . import progress
from .. import schemas
from ..backends.errors import BackendDown, FatalBackendError
from ..errors import ExpectedFailure, Interrupted, log_to_file
from ..files import content_hash, remove_stale_partials, write_json
from .journal import JournalWriteError, JournalWriter, adopt_held, read_journal, save_held
from ..logs import tally_warnings
from .budget import JobState
from .context import job_logging, sigterm_as_exception
from .output import write_journaled
from .prompts import Sample, read_prompts, shard_share
from .reuse import reuse_replies
from .backends import start_backends
from .runner import Runner, Terminated, failed_row, run_requests

logger = logging.getLogger("eagle3_data.generate")


class GenerationStopped(ExpectedFailure):
    """The job stopped early (credentials/credits rejected, a missing key variable, every backend down, every
    request failed); the journal keeps every response. ``message`` names the shard, backend and URL, ``hint`` what
    to do next."""


#: reasons of the samples refused before any request (their prompt): not failed requests
PROMPT_REJECTS = frozenset({"bad_prompt", "prompt_too_large", "api_key_in_prompt"})


class UnpaidFailures(GenerationStopped):
    """Samples whose retries ran out without a paid reply (a dead backend, 5xx, 429, timeouts): the job wrote
    every reply it was paid for to the journal and no output, so rerunning the same command reruns it and sends
    only those samples (``generation.unpaid_failures: rerun``, the default)."""


class GenerationInterrupted(GenerationStopped, Interrupted):
    """SIGTERM or Ctrl-C stopped the job; the journal keeps every response, a rerun resumes."""


def _held_saved(
    exc: JournalWriteError, held: list[dict], journal_dir, dataset: str, shard: str, journaled: str
) -> JournalWriteError:
    """``exc`` with where the paid records it kept from the journal went (:func:`..journal.save_held`): the
    journal after all, a fallback file the hint names (the rerun reads it and moves it into the journal), or
    nowhere (those replies are paid for again)."""
    if not held:
        return exc
    path, in_journal = save_held(held, journal_dir, dataset, shard)
    n = f"{len(held):,} paid repl{'ies' if len(held) != 1 else 'y'}"
    if path is None:
        extra = f"{n} that arrived after it could be written nowhere (a rerun pays for them again)"
    elif in_journal:
        extra = f"{n} that arrived after it were journaled after all ({path})"
    else:
        extra = (
            f"{n} that arrived after it were written to {path} (readable by you only): the rerun of the same "
            f"command reads them and moves them into {Path(journal_dir) / dataset}/ (not paid for again)"
        )
    return JournalWriteError(exc.message, hint=f"{extra}; {exc.hint}; {journaled}")


def unpaid_text(state: JobState) -> str:
    """``"3 of 100 samples failed without a paid reply (http_429 2, timeout 1)"`` for the job's unpaid failures."""
    n = sum(state.unpaid.values())
    kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(state.unpaid.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{n:,} of {state.total:,} sample{'s' if state.total != 1 else ''} failed without a paid reply ({kinds})"


def _job_overhead(state: JobState) -> dict:
    """``startup_s``: seconds from this process's start (its interpreter, imports, reading the inputs) to its
    first request asking for a slot; ``wrapup_s``: from its last attempt's end to now (writing the outputs).
    Both None when it sent nothing. The forecast adds them to the simulated requests (a job's time is these
    plus its requests')."""
    if state.first_sent_at is None:
        return {"startup_s": None, "wrapup_s": None}
    import psutil  # a dependency of snakemake

    started = psutil.Process().create_time()
    return {
        "startup_s": round(max(0.0, state.first_sent_at - started), 3),
        "wrapup_s": round(max(0.0, time.time() - (state.last_done_at or state.first_sent_at)), 3),
    }


def cpu_s() -> float:
    """CPU seconds (user + system, every thread) this process has used since it started: the job's whole client
    cost, its interpreter start and imports included (``benchmarks/generation_run.py`` divides it by requests)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return round(ru.ru_utime + ru.ru_stime, 3)


def generate(
    prompts_path,
    out_path,
    settings,
    *,
    shard: str,
    log=None,
    summary_path=None,
    sample_ids=None,
    progress_interval_s: float = 5.0,
    write_batch_rows: int = 256,
) -> dict:
    """Generate responses for one dataset shard; write ``out_path`` (RESPONSES parquet); return a summary.

    Args:
        prompts_path: PROMPTS parquet (``schemas.PROMPTS``).
        out_path: RESPONSES parquet to write (atomically; one row per (sample, regenerated turn), ``ok`` or
            ``failed`` with ``error`` = ``"<reason>: <detail>"``; never-sent samples get no row).
        settings: the dataset's :class:`eagle3_data.settings.GenerateSettings` (``GenerateSettings.from_config``;
            ``GenerateSettings.defaults`` for library use): the dataset name, target name (in request keys) and
            format, its generation settings (backends in priority order, mode, sampling, retries and backoff,
            budgets, ``max_samples``, ``unpaid_failures``; the schema's defaults where unset), the backends'
            definitions, the shard count (per-dataset caps and budgets are split evenly across the shards), the
            journal directory (``<journal_dir>/<dataset>/<shard>.jsonl``, outside ``results/``), the generate jobs
            using each backend (cluster jobs split a backend's ``max_concurrency`` over them,
            :mod:`.backends.limits`), where the config sets each budget (named by a budget stop's warning) and,
            when a backend has ``native_generate`` or ``return_token_ids``, the target (its tokenizer renders or
            checks the prompt ids; ``chat_template_kwargs`` updated by ``generation.extra_body.chat_template_kwargs``).
            Kimi families get their history tool-call ids rewritten to ``functions.<name>:<index>`` in the prompt
            sent (and stored, and keyed); a thinking target gets an empty reasoning on history tool-call turns
            that have none (:func:`backends.chat.history_reasoning`).
        shard: the shard's name.
        log: the job log: a path (progress lines are appended to it), a ``logging.Logger`` already writing to a
            file (e.g. from ``logs.setup_logging``), or None. Local servers log to ``<stem>.server-<backend>.log``
            beside that file (without a file: in the journal folder).
        summary_path: if given, the returned summary is also written there as JSON (atomically); the report
            reads ``stopped_by`` from it.
        sample_ids: if given (a set of ids), only these samples of the shard are considered, after the
            ``max_samples`` cap; unusable rows outside it get no row. The forecast's pilot (:mod:`.forecast`): the
            same requests, keys and journal as the full job, which then answers them from the journal.
        progress_interval_s: seconds between progress lines (:mod:`.progress`: on a terminal of its own the job
            draws a tqdm bar and writes these lines to its log file only).
        write_batch_rows: rows per output batch (a parquet row group; memory: one batch of JSON lines).

    Runtime (not settings, so that none of it reruns anything): inside a workflow run (:mod:`.run`) a backend's
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
            (a subclass) for SIGTERM / Ctrl-C; :class:`UnpaidFailures` (a subclass) when samples failed without a
            paid reply and ``generation.unpaid_failures`` is ``"rerun"`` (not for the forecast's pilot). The
            journal keeps every completed response; no output is written.
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

    job = _Job(
        settings=settings,
        shard=shard,
        prompts_path=prompts_path,
        out_path=Path(out_path),
        log=log,
        sample_ids=sample_ids,
        progress_interval_s=progress_interval_s,
        write_batch_rows=write_batch_rows,
    )
    old_pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        return _generate(job, summary_path)
    except (Terminated, KeyboardInterrupt):  # outside the request phase (reading prompts, the final write)
        raise GenerationInterrupted(
            f"{job.tag} interrupted",
            hint="rerun the same command to resume; every response received so far is journaled",
        ) from None
    finally:
        pa.set_memory_pool(old_pool)
        from . import startup

        startup.release()  # a job that sent nothing gives its start-up slot back here (eagle3_data.generate.startup)


@dataclass
class _Job:
    """One generate job: its settings, shard, files and options, and what its steps find out on the way (the
    backends, the servers started, the journal read and written, the request runner)."""

    settings: Any  # GenerateSettings
    shard: str
    prompts_path: Any
    out_path: Path
    log: Any
    sample_ids: Any
    progress_interval_s: float
    write_batch_rows: int
    t0: float = field(default_factory=time.monotonic)
    cfgs: list = field(default_factory=list)  # the typed backends (BackendConfig), priority order
    target_tokens: Any = None  # TargetTokens for native ids / prompt-id checks
    servers_started: list = field(default_factory=list)
    servers_attached: list = field(default_factory=list)
    server_logs: dict = field(default_factory=dict)
    jstats: dict = field(default_factory=lambda: {"records": 0, "files": 0, "bad_lines": 0})
    journal: JournalWriter | None = None
    runner: Runner | None = None
    reused: dict = field(default_factory=dict)  # replies found by what was asked: source dataset -> count

    @property
    def dataset(self) -> str:
        return self.settings.dataset

    @property
    def tag(self) -> str:
        return f"[{self.dataset}/{self.shard}]"

    @property
    def journal_dir(self) -> Path:
        return Path(self.settings.journal_dir)

    @property
    def shares(self) -> int:
        """Shards the dataset's budgets are split over."""
        return max(1, self.settings.num_shards)

    def journaled(self) -> str:
        """``"<n> responses of <dataset> are journaled and will not be requested again"``."""
        n = self.jstats["records"] + (self.journal.written if self.journal else 0)
        return f"{n:,} response{'s' if n != 1 else ''} of {self.dataset} are journaled and will not be requested again"


def _generate(job: _Job, summary_path) -> dict:
    """The job's steps: read the samples and the journal, answer each sample (journal or request), check the
    failures, write the output, summarise."""
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    # the job's warnings counted by reason (the run-wide view shows the counts; their text stays in the log)
    with job_logging(job.log), sigterm_as_exception(), tally_warnings() as warned:
        job.cfgs = job.settings.backend_configs()
        samples, bad, capped = _select_samples(job)
        state = _job_state(job, samples, bad)
        state.warnings = warned
        records, key_files = _read_journal(job, samples, bad, capped)
        _reuse(job, samples, records, key_files)
        rows = _prompt_reject_rows(job, bad, state)
        display, network = _plan_requests(job, samples, records, state)
        # the output is written while the job runs (new responses as they arrive); it appears at out_path only
        # when the job succeeds (atomic rename); a partial file left by a killed job is removed here
        for stale in remove_stale_partials(job.out_path):
            logger.info("%s removed %s (partial output of an interrupted job)", job.tag, stale)
        with schemas.CheckedParquetWriter("responses", job.out_path) as writer:
            runner = _answer(job, samples, records, state, writer, network, display)
            rows.extend(runner.rows)
            del records
            _check_failures(job, state, display)
            runner.flush()  # new responses: streamed into the writer during the run
            # responses of earlier runs: read back from the journal
            wanted = set(runner.journal_keys)
            files = sorted({key_files[k] for k in wanted if k in key_files})
            write_journaled(writer, job.journal_dir / job.dataset, wanted, job.write_batch_rows, files=files)
            writer.write_rows(rows)
            n_rows = writer.rows
        summary = _summary(job, state, capped, n_rows)
        _finish(job, state, summary, summary_path, display)
        return summary


def _select_samples(job: _Job) -> tuple[list[Sample], list[dict], int]:
    """The shard's samples (sorted by ``sample_id``, cut to its ``max_samples`` share, the pilot's subset), its
    unusable rows and how many samples the cap left out."""
    gen = job.settings.generation
    samples, bad = read_prompts(
        job.prompts_path,
        gen.mode,
        max_bytes=gen.max_prompt_bytes,
        keys=paid.configured_keys(job.settings.backends),
    )
    samples.sort(key=lambda s: s.sample_id)
    capped = 0
    if gen.max_samples is not None:
        per_shard = shard_share(int(gen.max_samples), job.settings.num_shards, job.shard)
        capped = max(0, len(samples) - per_shard)
        samples = samples[:per_shard]
    if job.sample_ids is not None:  # the forecast's pilot: a subset of what the full job sends
        wanted = set(job.sample_ids)
        samples = [s for s in samples if s.sample_id in wanted]
        bad = [b for b in bad if b["sample_id"] in wanted]
    return samples, bad, capped


def _job_state(job: _Job, samples: list, bad: list) -> JobState:
    """The job's state: its samples and this shard's share of each budget."""
    gen = job.settings.generation
    bt, bu = gen.budget_completion_tokens, gen.budget_usd
    return JobState(
        total=len(samples) + len([b for b in bad if not b.get("dup")]),
        budget_tokens=None if bt is None else float(bt) / job.shares,
        budget_usd=None if bu is None else float(bu) / job.shares,
    )


def _read_journal(job: _Job, samples: list, bad: list, capped: int) -> tuple[dict, dict]:
    """The resume index (request key -> what resume needs: spend and, mode all, what the regenerated history
    needs; texts stay on disk) and the journal file of each key (the end reads back only those files)."""
    mode = job.settings.generation.mode
    key_files: dict = {}
    adopt_held(job.journal_dir, job.dataset)  # paid replies a full disk kept in the temp folder: into the journal
    records, job.jstats = read_journal(job.journal_dir, job.dataset, fields=_resume_fields(mode), key_files=key_files)
    logger.info(
        "%s %d samples (%d unusable, %d over max_samples), mode %s; journal: %d responses in %d file(s), "
        "%d torn/bad line(s) skipped",
        job.tag,
        len(samples),
        len(bad),
        capped,
        mode,
        job.jstats["records"],
        job.jstats["files"],
        job.jstats["bad_lines"],
    )
    return records, key_files


def _resume_fields(mode: str) -> tuple[str, ...]:
    """The record fields the resume index keeps: spend and status, and (mode all) what the history needs."""
    return ("completion_tokens", "cost_usd", "status", "error") + (
        ("content", "reasoning", "tool_calls") if mode == "all" else ()
    )


def _reuse(job: _Job, samples: list, records: dict, key_files: dict) -> None:
    """Answer the requests this dataset's journal does not from any journal record that asked the same
    (:mod:`.reuse`): copied into this shard's journal, not bought again."""
    probe = Runner(job.settings, records=records, journal=None, pool=None, state=JobState(0, None, None))
    with JournalWriter(job.journal_dir, job.dataset, job.shard) as jw:
        job.reused = reuse_replies(probe, samples, records, key_files, jw, _resume_fields(job.settings.generation.mode))
    if job.reused:
        logger.info(
            "%s %d repl%s found in the journal by what was asked (%s): reused, not bought again",
            job.tag,
            sum(job.reused.values()),
            "ies" if sum(job.reused.values()) != 1 else "y",
            ", ".join(f"{n} from {d}" for d, n in sorted(job.reused.items())),
        )


def _prompt_reject_rows(job: _Job, bad: list, state: JobState) -> list[dict]:
    """The failed rows of the prompts refused before any request (duplicates are skipped, with a warning)."""
    rows: list[dict] = []
    for b in bad:
        if b.get("dup"):
            logger.warning(
                "%s row %d: duplicate sample_id %s skipped",
                job.tag,
                b["row"],
                b["sample_id"],
                extra={"reason": "duplicate_sample_id"},
            )
            continue
        s = Sample(b["sample_id"], "[]", None, [])
        reason = b.get("reason", "bad_prompt")
        key = content_hash(job.dataset, b["sample_id"], "bad_prompt")
        # an oversized prompt, or one quoting a key, is not copied into the output
        r = failed_row(s, job.dataset, 0, key, b.get("raw") or "[]", reason, b["detail"])
        r["tools"] = b.get("tools")
        rows.append(r)
        state.failed[reason] = state.failed.get(reason, 0) + 1
        state.done += 1
        state.instant += 1
    return rows


def _plan_requests(job: _Job, samples: list, records: dict, state: JobState):
    """Which samples still need a request (mode all: walk the journal through the regenerated history); the
    progress display and whether the job goes to the network."""
    probe = Runner(job.settings, records=records, journal=None, pool=None, state=state)
    n_pending = sum(1 for s in samples if probe.pending(s))
    logger.info(
        "%s %d sample(s) need requests, %d complete in the journal", job.tag, n_pending, len(samples) - n_pending
    )
    network = bool(n_pending) and not state.budget_reached()
    if n_pending and not network:
        logger.info("%s %s already reached by journaled responses: nothing sent", job.tag, state.stopped_by)
    display = progress.JobProgress(state, job.tag, job.progress_interval_s, logger)
    display.backends = [c.name for c in job.cfgs]
    if job.sample_ids is not None:
        display.kind = "pilot"
    return display, network


def _answer(job: _Job, samples, records, state, writer, network: bool, display) -> Runner:
    """The request phase: the backends (servers started, the pool) when something must be sent, the journal,
    every sample answered from the journal or by a request. Backend and journal failures and signals become the
    job's errors (the journal keeps every response)."""
    try:
        with contextlib.ExitStack() as stack:
            pool = start_backends(job, stack, display) if network else None
            journal = job.journal = stack.enter_context(JournalWriter(job.journal_dir, job.dataset, job.shard))
            if pool is not None:
                journal.ensure_open()  # an unwritable journal stops the job before it pays for anything
            runner = job.runner = Runner(
                job.settings,
                records=records,
                journal=journal,
                pool=pool,
                state=state,
                target=job.target_tokens,
                writer=writer,
                write_batch_rows=job.write_batch_rows,
            )
            runner.keys = paid.configured_keys(job.settings.backends)
            if pool is not None:
                state.t0 = time.monotonic()  # the rate, ETA and tok/s: of the request phase
                with display.session():
                    asyncio.run(run_requests(runner, samples, display))
            else:
                for s in samples:  # everything is journaled: no network, no event loop
                    coro = runner.run_sample(s)
                    try:
                        coro.send(None)
                    except StopIteration:
                        pass
            journal.sync()
            return runner
    except FatalBackendError as exc:
        raise _stopped(job, exc) from None
    except JournalWriteError as exc:
        held = job.runner.held if job.runner else []
        raise _held_saved(exc, held, job.journal_dir, job.dataset, job.shard, job.journaled()) from None
    except (Terminated, KeyboardInterrupt):
        log_to_file(
            logging.getLogger("eagle3_data"),
            logging.INFO,
            "%s interrupted: %s",
            job.tag,
            progress.line(state, "").lstrip(),
        )
        raise GenerationInterrupted(
            f"{job.tag} interrupted", hint=f"rerun the same command to resume; {job.journaled()}"
        ) from None


def _stopped(job: _Job, exc: FatalBackendError) -> GenerationStopped:
    """The :class:`GenerationStopped` of a fatal backend error, its hint naming the launched servers' logs when
    the backend was one of them."""
    hint = exc.hint or "rerun the same command"
    if isinstance(exc, BackendDown):
        logs = ", ".join(str(p) for p in job.server_logs.values())
        hint = (
            f"the server the build launched stopped answering: see its log ({logs}), then rerun the same command"
            if job.server_logs
            else "start the server or fix the backend's base_url, then rerun the same command"
        )
    return GenerationStopped(f"{job.tag} {exc.message}", hint=f"{hint}; {job.journaled()}")


def _check_failures(job: _Job, state: JobState, display) -> None:
    """Stop the job when every request failed (:class:`GenerationStopped`) or samples failed without a paid reply
    and ``generation.unpaid_failures`` is ``rerun`` (:class:`UnpaidFailures`: no output, so the rerun sends
    them); otherwise warn about the failed requests."""
    tag = job.tag
    failed_requests = sum(n for reason, n in state.failed.items() if reason not in PROMPT_REJECTS)
    answered = state.new_ok + state.from_journal  # requests with a response (mode all: turns, not samples)
    if failed_requests and answered == 0:
        # not one request answered: a misconfigured or unreachable backend, not data to keep
        raise GenerationStopped(
            f"{tag} every request failed ({failed_requests} of {failed_requests} requests: {dict(state.failed)}); "
            f"last error: {state.last_error}",
            hint=f"check the backends {[c.name for c in job.cfgs]} (model, base_url, server running, API key), "
            "then rerun the same command",
        )
    unpaid = sum(state.unpaid.values())
    if unpaid and job.sample_ids is None and job.settings.generation.unpaid_failures == "rerun":
        # no output: the rerun of the same command reruns this job, which sends only these samples
        log_to_file(
            logging.getLogger("eagle3_data"), logging.INFO, "%s ended: %s", tag, progress.line(state, "").lstrip()
        )
        display.snapshot(final=True)
        raise UnpaidFailures(
            f"{tag} {unpaid_text(state)}; last error: {state.last_unpaid}",
            hint=f"rerun the same command to send them ({job.journaled()}; no output was written for this "
            "shard, so the rerun reruns it); generation.unpaid_failures: keep records them as failed "
            "rows instead",
        )
    if failed_requests:
        logger.warning(
            "%s %d request(s) failed (%s)%s",
            tag,
            failed_requests,
            dict(state.failed),
            (
                f"; {unpaid_text(state)}, recorded as failed (generation.unpaid_failures: keep): "
                "`snakemake --forcerun generate` sends them again (journaled responses are not)"
                if unpaid
                else ": final (an answer no retry can fix, or a paid reply refused; journaled ones are not bought "
                "again)"
            ),
            extra={"tally": False},
        )  # each failed sample is counted in the view already


def _summary(job: _Job, state: JobState, capped: int, n_rows: int) -> dict:
    """The job's summary (see :func:`generate`)."""
    if state.stopped_by:
        stopped_by = state.stopped_by
    elif capped:
        stopped_by = "max_samples"
    else:
        stopped_by = "all samples done"
    return {
        "dataset": job.dataset,
        "shard": job.shard,
        "samples": state.total,
        "ok": state.ok,
        "failed": dict(state.failed),
        "failed_total": sum(state.failed.values()),
        "from_journal": state.from_journal,
        "reused": dict(job.reused),
        "failed_unpaid": sum(state.unpaid.values()),
        "unpaid": dict(state.unpaid),
        "sent": state.sent,
        "retries": state.retries,
        "retry_reasons": dict(state.retry_reasons),
        "timed_out_attempts": dict(state.timed_out),
        "not_sent": state.not_sent,
        "over_max_samples": capped,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "cost_usd": round(state.cost_usd, 6),
        "total_completion_tokens": state.spent_tokens(),
        "total_cost_usd": round(state.spent_usd(), 6),
        "by_backend": dict(state.by_backend),
        # this shard's share of each budget, and the requests in flight when one was reached (its overshoot)
        "budget_completion_tokens": state.budget_tokens,
        "budget_usd": state.budget_usd,
        "budget_in_flight": state.budget_in_flight,
        "warnings": dict(state.warnings),
        "stopped_by": stopped_by,
        "servers_started": job.servers_started,
        "servers_attached": job.servers_attached,
        "journal_bad_lines": job.jstats["bad_lines"],
        "rows": n_rows,
        "other_model_replies": state.other_model,
        "wall_s": round(time.monotonic() - job.t0, 3),
        **_job_overhead(state),
        "cpu_s": cpu_s(),
    }


def _finish(job: _Job, state: JobState, summary: dict, summary_path, display) -> None:
    """Log the end (and a budget stop's warning), write the summary."""
    logger.info("%s finished: %s", job.tag, progress.final_line(state, "").lstrip())
    if state.not_sent:
        key = state.stopped_by or "budget"
        value = getattr(job.settings.generation, key, None)
        message = progress.budget_stop_message(state, key, value, job.settings.budget_source(key), job.shares)
        logger.warning("%s %s", job.tag, message, extra={"reason": key})
    for name, n in state.timed_out.items():
        timeout = next((c.timeout_s for c in job.cfgs if c.name == name), None)
        logger.warning(
            "%s %d attempt(s) abandoned at backends.%s.timeout_s = %g s and asked again: the provider may have "
            "billed them (raise timeout_s if its replies are that slow)",
            job.tag,
            n,
            name,
            timeout,
            extra={"reason": "timed_out_attempts"},
        )
    logger.info("%s summary: %s", job.tag, json.dumps(summary, sort_keys=True))
    if summary_path is not None:
        write_json(summary, summary_path)
    display.snapshot(final=True)
