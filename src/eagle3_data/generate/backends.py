"""The job's backends: the key variables checked, the target tokenizer loaded where a backend needs it, the
launched servers started (or attached to), and the pool of backends each capped at this job's share
(:func:`start_backends`, :func:`backend_pool`)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from ..backends import limits
from ..backends.definition import BackendConfig
from ..runtime import run as run_mod
from .context import server_log_path

logger = logging.getLogger("eagle3_data.generate")


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
            (
                f", {c.max_concurrency} over all jobs on this machine"
                if slots
                else f" ({c.max_concurrency} split over {n_jobs} jobs)"
                if mode == "split"
                else ""
            ),
            (
                f"; rate limits: 1/{n_jobs} of the backend's each"
                if share < 1 and (c.requests_per_minute or c.tokens_per_minute)
                else ""
            ),
        )
    yield pool.BackendPool(backends)


def _load_target(settings):
    """TargetTokens for native ``/generate`` prompts and the check of a ``return_token_ids`` server's prompt ids
    (chat_template_kwargs: target's, then the dataset's)."""
    from ..templates import target_tokens

    target = settings.target
    if not target or not target.get("path"):
        raise ValueError(
            f"dataset {settings.dataset}: a backend has native_generate or return_token_ids: true, which "
            "needs the target tokenizer: GenerateSettings.target (GenerateSettings.from_config sets it)"
        )
    return target_tokens(target, (settings.generation.extra_body or {}).get("chat_template_kwargs"))


def start_backends(job, stack: contextlib.ExitStack, display):
    """Check the key variables, load the target tokenizer where a backend needs it, start (or attach to) the
    launched servers, and enter the job's :class:`BackendPool` (``job``: the job's state,
    :class:`eagle3_data.generate.job._Job`; ``display``: its progress display, given the pool)."""
    for c in job.cfgs:
        c.api_key()  # a missing key variable stops the job before any server starts
        if "{port}" in c.base_url and not c.launch:
            raise ValueError(f"backend {c.name!r}: base_url has {{port}} but no launch: config")
    if any(c.native_generate or c.return_token_ids for c in job.cfgs):
        job.target_tokens = _load_target(job.settings)
    run = run_mod.current()
    for c in job.cfgs:
        if c.launch:
            srv = stack.enter_context(_server(job, c, run))
            c.base_url = c.base_url.replace("{port}", str(srv.port))
            (job.servers_started if srv.started else job.servers_attached).append(c.name)
            job.server_logs[c.name] = srv.log_path
    pool = stack.enter_context(backend_pool(job.cfgs, run, job.settings.backend_jobs, job.tag))
    display.pool = pool
    return pool


def _server(job, c: BackendConfig, run):
    """The launched server of backend ``c``: the workflow run's (one per backend for the whole run) or, outside a
    run (the Python API, a cluster job), this job's own."""
    from ..backends.server import launch_server, shared_server

    if run is not None:
        return shared_server(
            c.launch, c.model, name=c.name, run=run, log_path=Path("logs") / "servers" / f"{c.name}.log"
        )
    log_path = server_log_path(job.log, job.journal_dir, job.dataset, job.shard, c.name)
    return launch_server(c.launch, c.model, log_path, name=c.name)
