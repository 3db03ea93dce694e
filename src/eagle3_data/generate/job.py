"""The job entry: :func:`generate`, one dataset shard from its PROMPTS parquet to its RESPONSES parquet (the flow is
described in :mod:`eagle3_data.generate`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

from ..backends import paid
from . import progress
from ..runtime import run as run_mod
from .. import schemas
from ..backends import limits
from ..backends.errors import BackendDown, FatalBackendError
from ..backends.definition import BackendConfig
from ..errors import ExpectedFailure, Interrupted, log_to_file
from ..files import content_hash, remove_stale_partials, write_json
from .journal import JournalWriteError, JournalWriter, read_journal, save_held
from ..logs import tally_warnings
from .budget import JobState
from .context import job_logging, server_log_path, sigterm_as_exception
from .output import write_journaled
from .prompts import Sample, read_prompts, sampling_params, shard_share
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
    journal after all, a fallback file the hint names (move it into the journal folder before rerunning), or
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
            f"{n} that arrived after it were written to {path}: move that file into "
            f"{Path(journal_dir) / dataset}/ before rerunning (its replies are then not paid for again)"
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


@contextlib.contextmanager
def backend_pool(cfgs: list[BackendConfig], run, backend_jobs: dict | None, tag: str):
    """The job's :class:`BackendPool`: each backend capped at this job's share of its ``max_concurrency``
    (:func:`.limits.job_limit`), with the run's host slots when the limit is shared on this machine."""
    from ..backends import pool  # httpx and the transport: only for a job that sends requests

    mode = limits.sharing_mode(run)
    backends = []
    for c in cfgs:
        n_jobs = (backend_jobs or {}).get(c.name, 1)
        cap = limits.job_limit(c.max_concurrency, mode, n_jobs)
        slots = limits.host_slots(c) if mode == "host" else None
        # rate limits have no shared counter: each job of the run takes an even share of them
        share = 1.0 / max(1, n_jobs) if mode in ("host", "split") else 1.0
        backends.append(pool.Backend(c, cap=cap, slots=slots, rate_share=share))
        logger.info(
            "%s backend %s: at most %d request(s) in flight from this job%s%s",
            tag,
            c.name,
            cap,
            f", {c.max_concurrency} over all jobs on this machine"
            if slots
            else f" ({c.max_concurrency} split over {n_jobs} jobs)"
            if mode == "split"
            else "",
            f"; rate limits: 1/{n_jobs} of the backend's each"
            if share < 1 and (c.requests_per_minute or c.tokens_per_minute)
            else "",
        )
    yield pool.BackendPool(backends)


def _load_target(target: dict | None, generation: dict, dataset: str):
    """TargetTokens for native ``/generate`` prompts and the check of a ``return_token_ids`` server's prompt ids
    (chat_template_kwargs: target's, then the dataset's)."""
    from ..templates import target_tokens

    if not target or not target.get("path"):
        raise ValueError(
            f"dataset {dataset}: a backend has native_generate or return_token_ids: true, which "
            "needs the target tokenizer: pass generate(target=config['target'])"
        )
    return target_tokens(target, (generation.get("extra_body") or {}).get("chat_template_kwargs"))


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
            have none (:func:`backends.chat.history_reasoning`). Regenerated reasoning (mode ``all``) always goes
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
            (a subclass) for SIGTERM / Ctrl-C; :class:`UnpaidFailures` (a subclass) when samples failed without a
            paid reply and ``generation["unpaid_failures"]`` is ``"rerun"`` (the default; not for the forecast's
            pilot). The journal keeps every completed response; no output is written.
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
        return _generate(
            prompts_path,
            out_path,
            dataset=dataset,
            shard=shard,
            target_name=target_name,
            generation=generation,
            backends=backends,
            journal_dir=journal_dir,
            log=log,
            num_shards=num_shards,
            progress_interval_s=progress_interval_s,
            summary_path=summary_path,
            target=target,
            write_batch_rows=write_batch_rows,
            target_format=target_format,
            backend_jobs=backend_jobs,
            sample_ids=sample_ids,
            budget_sources=budget_sources,
        )
    except (Terminated, KeyboardInterrupt):  # outside the request phase (reading prompts, the final write)
        raise GenerationInterrupted(
            f"[{dataset}/{shard}] interrupted",
            hint="rerun the same command to resume; every response received so far is journaled",
        ) from None
    finally:
        pa.set_memory_pool(old_pool)
        from . import startup

        startup.release()  # a job that sent nothing gives its start-up slot back here (eagle3_data.generate.startup)


def _generate(
    prompts_path,
    out_path,
    *,
    dataset,
    shard,
    target_name,
    generation,
    backends,
    journal_dir,
    log,
    num_shards,
    progress_interval_s,
    summary_path,
    target,
    write_batch_rows,
    backend_jobs,
    target_format=None,
    sample_ids=None,
    budget_sources=None,
) -> dict:
    t0 = time.monotonic()
    journal_dir = Path(journal_dir)
    out_path = Path(out_path)
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    tag = f"[{dataset}/{shard}]"
    # the job's warnings counted by reason (the run-wide view shows the counts; their text stays in the log)
    with job_logging(log), sigterm_as_exception(), tally_warnings() as warned:
        mode = generation.get("mode", "last")
        names = list(generation.get("backends") or [])
        if not names:
            raise ValueError(f"dataset {dataset}: generation.backends is empty")
        unknown = [n for n in names if n not in backends]
        if unknown:
            raise ValueError(f"dataset {dataset}: generation.backends names unknown backends {unknown}")
        cfgs = [BackendConfig.from_dict(n, backends[n]) for n in names]
        sampling = sampling_params(generation)

        samples, bad = read_prompts(
            prompts_path, mode, max_bytes=generation.get("max_prompt_bytes"), keys=paid.configured_keys(backends)
        )
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
        state = JobState(
            total=len(samples) + len([b for b in bad if not b.get("dup")]),
            budget_tokens=None if bt is None else float(bt) / div,
            budget_usd=None if bu is None else float(bu) / div,
        )
        state.warnings = warned
        # resume index: spend, and (mode all) what the regenerated history needs; texts stay on disk
        keep = ("completion_tokens", "cost_usd", "status", "error") + (
            ("content", "reasoning", "tool_calls") if mode == "all" else ()
        )
        key_files: dict = {}  # the file of each journaled record: the end reads back only those files
        records, jstats = read_journal(journal_dir, dataset, fields=keep, key_files=key_files)
        logger.info(
            "%s %d samples (%d unusable, %d over max_samples), mode %s; journal: %d responses in %d file(s), "
            "%d torn/bad line(s) skipped",
            tag,
            len(samples),
            len(bad),
            capped,
            mode,
            jstats["records"],
            jstats["files"],
            jstats["bad_lines"],
        )
        rows: list[dict] = []
        for b in bad:
            if b.get("dup"):
                logger.warning(
                    "%s row %d: duplicate sample_id %s skipped",
                    tag,
                    b["row"],
                    b["sample_id"],
                    extra={"reason": "duplicate_sample_id"},
                )
                continue
            s = Sample(b["sample_id"], "[]", None, [])
            reason = b.get("reason", "bad_prompt")
            key = content_hash(dataset, b["sample_id"], "bad_prompt")
            # an oversized prompt, or one quoting a key, is not copied into the output
            r = failed_row(s, dataset, 0, key, b.get("raw") or "[]", reason, b["detail"])
            r["tools"] = b.get("tools")
            rows.append(r)
            state.failed[reason] = state.failed.get(reason, 0) + 1
            state.done += 1
            state.instant += 1

        # which samples still need a request? (mode all: walk the journal through the regenerated history)
        probe = Runner(
            dataset=dataset,
            target_name=target_name,
            generation=generation,
            records=records,
            journal=None,
            pool=None,
            state=state,
            sampling=sampling,
            target_format=target_format,
        )
        target_tokens = None
        n_pending = sum(1 for s in samples if probe.pending(s))
        logger.info(
            "%s %d sample(s) need requests, %d complete in the journal", tag, n_pending, len(samples) - n_pending
        )

        servers_started, servers_attached, server_logs = [], [], {}
        network = bool(n_pending) and not state.budget_reached()
        if n_pending and not network:
            logger.info("%s %s already reached by journaled responses: nothing sent", tag, state.stopped_by)

        jw: list[JournalWriter] = []
        runners: list[Runner] = []  # the request runner, once made (its held records, after a journal write error)
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
                        if any(c.native_generate or c.return_token_ids for c in cfgs):
                            target_tokens = _load_target(target, generation, dataset)
                        run = run_mod.current()
                        for cfg in cfgs:
                            if cfg.launch:
                                from ..backends.server import launch_server, shared_server

                                if run is not None:  # one server per backend for the whole workflow run
                                    srv = stack.enter_context(
                                        shared_server(
                                            cfg.launch,
                                            cfg.model,
                                            name=cfg.name,
                                            run=run,
                                            log_path=Path("logs") / "servers" / f"{cfg.name}.log",
                                        )
                                    )
                                else:  # the Python API, a cluster job: this job's own server
                                    srv = stack.enter_context(
                                        launch_server(
                                            cfg.launch,
                                            cfg.model,
                                            server_log_path(log, journal_dir, dataset, shard, cfg.name),
                                            name=cfg.name,
                                        )
                                    )
                                cfg.base_url = cfg.base_url.replace("{port}", str(srv.port))
                                (servers_started if srv.started else servers_attached).append(cfg.name)
                                server_logs[cfg.name] = srv.log_path
                        pool = stack.enter_context(backend_pool(cfgs, run, backend_jobs, tag))
                        display.pool = pool
                    journal = stack.enter_context(JournalWriter(journal_dir, dataset, shard))
                    jw.append(journal)
                    if pool is not None:
                        journal.ensure_open()  # an unwritable journal stops the job before it pays for anything
                    runner = Runner(
                        dataset=dataset,
                        target_name=target_name,
                        generation=generation,
                        records=records,
                        journal=journal,
                        pool=pool,
                        state=state,
                        sampling=sampling,
                        target=target_tokens,
                        writer=writer,
                        write_batch_rows=write_batch_rows,
                        target_format=target_format,
                    )
                    runner.keys = paid.configured_keys(backends)
                    runners.append(runner)
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
                    rows.extend(runner.rows)
                    journal.sync()
            except FatalBackendError as exc:
                hint = exc.hint or "rerun the same command"
                if isinstance(exc, BackendDown):
                    logs = ", ".join(str(p) for p in server_logs.values())
                    hint = (
                        f"the server the build launched stopped answering: see its log ({logs}), then rerun "
                        "the same command"
                        if server_logs
                        else "start the server or fix the backend's base_url, then rerun the same command"
                    )
                raise GenerationStopped(f"{tag} {exc.message}", hint=f"{hint}; {journaled()}") from None
            except JournalWriteError as exc:
                raise _held_saved(
                    exc, runners[0].held if runners else [], journal_dir, dataset, shard, journaled()
                ) from None
            except (Terminated, KeyboardInterrupt):
                log_to_file(
                    logging.getLogger("eagle3_data"),
                    logging.INFO,
                    "%s interrupted: %s",
                    tag,
                    progress.line(state, "").lstrip(),
                )
                raise GenerationInterrupted(
                    f"{tag} interrupted", hint=f"rerun the same command to resume; {journaled()}"
                ) from None

            del records
            failed_n = sum(state.failed.values())
            failed_requests = sum(n for reason, n in state.failed.items() if reason not in PROMPT_REJECTS)
            answered = state.new_ok + state.from_journal  # requests with a response (mode all: turns, not samples)
            if failed_requests and answered == 0:
                # not one request answered: a misconfigured or unreachable backend, not data to keep
                raise GenerationStopped(
                    f"{tag} every request failed ({failed_requests} of {failed_requests} requests: {dict(state.failed)}); "
                    f"last error: {state.last_error}",
                    hint=f"check the backends {[c.name for c in cfgs]} (model, base_url, server running, API key), "
                    "then rerun the same command",
                )
            unpaid = sum(state.unpaid.values())
            if unpaid and sample_ids is None and generation.get("unpaid_failures", "rerun") == "rerun":
                # no output: the rerun of the same command reruns this job, which sends only these samples
                log_to_file(
                    logging.getLogger("eagle3_data"),
                    logging.INFO,
                    "%s ended: %s",
                    tag,
                    progress.line(state, "").lstrip(),
                )
                display.snapshot(final=True)
                raise UnpaidFailures(
                    f"{tag} {unpaid_text(state)}; last error: {state.last_unpaid}",
                    hint=f"rerun the same command to send them ({journaled()}; no output was written for this "
                    "shard, so the rerun reruns it); generation.unpaid_failures: keep records them as failed "
                    "rows instead",
                )
            if failed_requests:
                logger.warning(
                    "%s %d request(s) failed (%s)%s",
                    tag,
                    failed_requests,
                    dict(state.failed),
                    f"; {unpaid_text(state)}, recorded as failed (generation.unpaid_failures: keep): "
                    "`snakemake --forcerun generate` sends them again (journaled responses are not)"
                    if unpaid
                    else ": final (an answer no retry can fix, or a paid reply refused; journaled ones are not bought "
                    "again)",
                    extra={"tally": False},
                )  # each failed sample is counted in the view already
            runner.flush()  # new responses: streamed into the writer during the run
            # responses of earlier runs: read back from the journal
            wanted = set(runner.journal_keys)
            write_journaled(
                writer,
                journal_dir / dataset,
                wanted,
                write_batch_rows,
                files=sorted({key_files[k] for k in wanted if k in key_files}),
            )
            writer.write_rows(rows)
            n_rows = writer.rows

        if state.stopped_by:
            stopped_by = state.stopped_by
        elif capped:
            stopped_by = "max_samples"
        else:
            stopped_by = "all samples done"
        summary = {
            "dataset": dataset,
            "shard": shard,
            "samples": state.total,
            "ok": state.ok,
            "failed": dict(state.failed),
            "failed_total": failed_n,
            "from_journal": state.from_journal,
            "failed_unpaid": sum(state.unpaid.values()),
            "unpaid": dict(state.unpaid),
            "sent": state.sent,
            "retries": state.retries,
            "retry_reasons": dict(state.retry_reasons),
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
            "servers_started": servers_started,
            "servers_attached": servers_attached,
            "journal_bad_lines": jstats["bad_lines"],
            "rows": n_rows,
            "other_model_replies": state.other_model,
            "wall_s": round(time.monotonic() - t0, 3),
            **_job_overhead(state),
            "cpu_s": cpu_s(),
        }
        logger.info("%s finished: %s", tag, progress.final_line(state, "").lstrip())
        if state.not_sent:
            key = state.stopped_by or "budget"
            logger.warning(
                "%s %s",
                tag,
                progress.budget_stop_message(
                    state, key, generation.get(key), (budget_sources or {}).get(key) or f"generation.{key}", div
                ),
                extra={"reason": key},
            )
        logger.info("%s summary: %s", tag, json.dumps(summary, sort_keys=True))
        if summary_path is not None:
            write_json(summary, summary_path)
        display.snapshot(final=True)
        return summary
