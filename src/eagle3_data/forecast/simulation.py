"""The generation's time: simulated runs of every shard's job at once, at each backend's concurrency, with the
pilot's lengths, latencies and failure rates."""

from __future__ import annotations

from ..settings import backend_settings
from .fits import quantile, latency_fit, length_model


#: simulated runs of the generation (their mean is the forecast's time; p10..p90 its range), for a run of up to
#: SIM_REQUESTS / SIMULATIONS requests; larger runs get fewer (at least SIM_MIN_RUNS), so the job stays short
SIMULATIONS = 64
SIM_REQUESTS = 4_000_000
SIM_MIN_RUNS = 4


def pilot_faults(summaries: list[dict]) -> dict[str, dict]:
    """Per backend, the pilot's attempts and the retries they needed, from the pilot jobs' summaries (their
    ``attempts``, see :func:`pilot`; else generate's own ``sent``, ``retry_reasons``, ``by_backend``):
    ``{backend: {"attempts", "rate_limited", "faults"}}``. A job's attempts and retries are attributed to its
    backends in proportion to the responses each answered; ``rate_limited`` counts ``http_429`` retries,
    ``faults`` every other reason (5xx, errors in a 200 body, timeouts, connection errors)."""
    out: dict[str, dict] = {}
    for sm in summaries:
        sm = sm.get("attempts") or sm
        by = {k: int(v) for k, v in (sm.get("by_backend") or {}).items() if int(v) > 0}
        total = sum(by.values())
        if not total:
            continue
        reasons = sm.get("retry_reasons") or {}
        limited = int(reasons.get("http_429", 0))
        faults = sum(int(v) for k, v in reasons.items() if k != "http_429")
        for name, n in by.items():
            w = n / total
            d = out.setdefault(name, {"attempts": 0.0, "rate_limited": 0.0, "faults": 0.0})
            d["attempts"] += w * int(sm.get("sent") or 0)
            d["rate_limited"] += w * limited
            d["faults"] += w * faults
    return out


def simulate_generation(
    jobs: list[dict],
    backends: dict[str, dict],
    lengths: dict[str, dict],
    *,
    runs: int = SIMULATIONS,
    seed: int = 0,
    max_retries: int = 5,
    retry_initial_s: float = 1.0,
    retry_max_s: float = 60.0,
    vary=None,
) -> dict:
    """Simulate the generation ``runs`` times (event by event) and return its times.

    The model is how generate behaves (:mod:`.backends.limits`, :class:`.backends.pool.BackendPool`): every job
    (shard) runs from t = 0; each backend has ``concurrency`` slots shared by the jobs that use it; a free slot
    goes to the job with requests waiting that has the fewest in flight on that backend (the fair share); a job's
    request takes a free slot of its first backend that has one (overflow, in its priority order). A request's
    completion length is drawn from its dataset's lognormal (``lengths[ds]``: :func:`length_model`), and an
    attempt on backend ``b`` takes ``a + b_per_token x length`` seconds. An attempt is refused at once with
    probability ``p_rate_limit`` (HTTP 429) or fails at a uniformly drawn point of its latency with probability
    ``p_fault`` (a provider error mid-generation); the request is retried after a full-jitter exponential
    backoff (``retry_initial_s`` doubling to ``retry_max_s``), behind the job's requests not yet sent, at most
    ``max_retries`` times.

    Args:
        jobs: ``[{"dataset", "requests", "backends": [names in priority order]}]``, each optionally with its own
            ``max_retries``, ``retry_initial_s``, ``retry_max_s`` (else the keyword arguments').
        backends: name -> ``{"concurrency", "a" (s), "b" (s per token), "p_rate_limit", "p_fault"}``; a job's
            dataset may override the latency with ``backends[name]["latency"][dataset] = (a, b)``.
        lengths: dataset -> :func:`length_model`.
        vary: optional ``vary(rng) -> (backends, lengths)``, called at the start of each run with the run's
            ``random.Random``: that run's parameters (how :func:`simulated_hours` carries the pilot's uncertainty
            into the runs).

    Returns: ``{"span_s": [each run's time, s], "dataset_s": {ds: [each run's time until its last request
        ended]}, "work_s": {ds: mean request-seconds (every attempt)}, "busy_s": {backend: mean request-seconds}}``.
    """
    import heapq
    import math
    import random

    order = list(backends)
    users = {b: [j for j, job in enumerate(jobs) if b in job["backends"]] for b in order}
    # a job's backends before b in its priority: it takes b's slot only while none of them has one free
    before = {
        (j, b): job["backends"][: job["backends"].index(b)] for j, job in enumerate(jobs) for b in job["backends"]
    }
    base = (backends, lengths)
    retry = [
        (
            int(job.get("max_retries", max_retries)),
            float(job.get("retry_initial_s", retry_initial_s)),
            float(job.get("retry_max_s", retry_max_s)),
        )
        for job in jobs
    ]
    datasets = sorted({job["dataset"] for job in jobs})
    out = {
        "span_s": [],
        "dataset_s": {ds: [] for ds in datasets},
        "work_s": dict.fromkeys(datasets, 0.0),
        "busy_s": dict.fromkeys(order, 0.0),
    }
    for run in range(max(1, int(runs))):
        rng = random.Random(f"{seed}:{run}")
        backends, lengths = vary(rng) if vary is not None else base
        lat = {}
        for j, job in enumerate(jobs):
            for b in job["backends"]:
                be = backends[b]
                lat[j, b] = (be.get("latency") or {}).get(job["dataset"], (be["a"], be["b"]))
        pending = [int(job["requests"]) for job in jobs]
        left = list(pending)
        retries: list[list] = [[] for _ in jobs]
        inflight = {b: [0] * len(jobs) for b in order}
        free = {b: int(backends[b]["concurrency"]) for b in order}
        heap: list = []
        seq = 0
        done_at = [0.0] * len(jobs)

        def fill(t: float) -> None:
            again = True
            while again:  # a pass may fill a job's first backend, sending its next requests to the second
                again = False
                for b in order:
                    again |= fill_backend(t, b)

        def fill_backend(t: float, b: str) -> bool:
            nonlocal seq
            be, use, fl = backends[b], users[b], inflight[b]
            started = False
            while free[b] > 0:
                best = -1
                for j in use:
                    if (
                        (pending[j] or retries[j])
                        and (best < 0 or fl[j] < fl[best])
                        and not any(free[p] > 0 for p in before[j, b])
                    ):
                        best = j
                if best < 0:
                    break
                j = best
                if pending[j]:
                    pending[j] -= 1
                    m = lengths[jobs[j]["dataset"]]
                    n = math.exp(m["mu"] + m["sigma"] * rng.gauss(0.0, 1.0)) if m["mu"] > float("-inf") else 1.0
                    n = max(1.0, min(float(m["cap"]), n) if m["cap"] else n)
                    attempt = 1
                else:
                    n, attempt = retries[j].pop(0)
                a, per = lat[j, b]
                dur = a + per * n
                u = rng.random()
                if u < be["p_rate_limit"]:
                    dur, ok = 0.0, False
                elif u < be["p_rate_limit"] + be["p_fault"]:
                    dur, ok = dur * rng.random(), False
                else:
                    ok = True
                free[b] -= 1
                fl[j] += 1
                seq += 1
                out["work_s"][jobs[j]["dataset"]] += dur
                out["busy_s"][b] += dur
                heapq.heappush(heap, (t + dur, seq, b, j, n, attempt, ok))
                started = True
            return started

        fill(0.0)
        t = 0.0
        while heap:
            t, _s, b, j, n, attempt, ok = heapq.heappop(heap)
            if b is None:  # a retry's backoff ended: it queues behind the job's requests not yet sent
                retries[j].append((n, attempt))
                fill(t)
                continue
            free[b] += 1
            inflight[b][j] -= 1
            if not ok and attempt <= retry[j][0]:
                r0, r1 = retry[j][1], retry[j][2]
                wait = max(r0 / 4, rng.uniform(0.0, min(r1, r0 * 2 ** (attempt - 1))))
                seq += 1
                heapq.heappush(heap, (t + wait, seq, None, j, n, attempt + 1, None))
            else:
                left[j] -= 1
                if not left[j]:
                    done_at[j] = t
            fill(t)
        out["span_s"].append(max(done_at, default=0.0))
        for ds in datasets:
            out["dataset_s"][ds].append(
                max((done_at[j] for j, job in enumerate(jobs) if job["dataset"] == ds), default=0.0)
            )
    n_runs = len(out["span_s"])
    out["work_s"] = {k: v / n_runs for k, v in out["work_s"].items()}
    out["busy_s"] = {k: v / n_runs for k, v in out["busy_s"].items()}
    return out


def backend_models(per_ds: list[dict], backends: dict, summaries: list[dict]) -> dict[str, dict]:
    """The simulation's backends (see :func:`simulate_generation`) from the pilot: per backend its
    ``max_concurrency`` (the schema's default when unset), the latency fit ``a + b x completion tokens`` over every pilot response it
    answered (:func:`latency_fit`; a dataset with at least 10 answers of its own on it keeps its own fit,
    under ``latency``), and the shares of attempts rate-limited and failed (:func:`pilot_faults`; the counts
    too, as ``pilot_attempts``, ``pilot_rate_limited``, ``pilot_faults``). A backend that answered no pilot
    request (an overflow backend the pilot never reached) borrows the fit of every pilot response and every
    backend's failure rates; ``source`` says which."""
    faults = pilot_faults(summaries)
    pooled = {k: sum(f[k] for f in faults.values()) for k in ("attempts", "rate_limited", "faults")}
    names = [b for d in per_ds for b in d["backends"]]
    out: dict[str, dict] = {}
    pooled_all = [
        (int(r["completion_tokens"] or 0), float(r["latency_s"]))
        for d in per_ds
        for r in d["_pilot_ok"]
        if r["latency_s"] is not None
    ]
    for name in dict.fromkeys(names):
        pts, own = [], {}
        for d in per_ds:
            mine = [
                (int(r["completion_tokens"] or 0), float(r["latency_s"]))
                for r in d["_pilot_ok"]
                if r["backend"] == name and r["latency_s"] is not None
            ]
            pts += mine
            if len(mine) >= 10:
                own[d["dataset"]] = latency_fit(mine)
        a, b = latency_fit(pts if pts else pooled_all)
        f = faults.get(name) or pooled  # a backend the pilot never reached: every backend's rates
        att = float(f["attempts"])
        out[name] = {
            "concurrency": int(backend_settings(backends.get(name))["max_concurrency"]),
            "a": a,
            "b": b,
            "latency": own,
            "pilot_responses": len(pts),
            "source": "its own pilot responses" if pts else "no pilot response: the pooled fit of all",
            "pilot_attempts": att,
            "pilot_rate_limited": float(f["rate_limited"]),
            "pilot_faults": float(f["faults"]),
            "p_rate_limit": float(f["rate_limited"]) / att if att else 0.0,
            "p_fault": float(f["faults"]) / att if att else 0.0,
        }
    return out


def job_overhead(summaries: list[dict]) -> dict:
    """What a generate job spends besides its requests, measured on the pilot jobs (their ``attempts``' or their
    own ``startup_s`` and ``wrapup_s``, see :func:`pilot`): ``{"startup_s", "wrapup_s"}`` (means, s; 0.0 when no
    pilot job measured them) and ``job_s``, their sum. The pilot's jobs start as the build's do (every shard at
    once, on the same machine), so their start-up is the build's."""
    from statistics import fmean

    out = {}
    for key in ("startup_s", "wrapup_s"):
        xs = [float(v) for sm in summaries if (v := (sm.get("attempts") or sm).get(key)) is not None]
        out[key] = round(fmean(xs), 3) if xs else 0.0
    out["job_s"] = round(out["startup_s"] + out["wrapup_s"], 3)
    return out


def simulated_hours(per_ds: list[dict], models: dict, key: str, job_s: float = 0.0) -> dict:
    """Simulate the requests under ``key`` of every dataset's shards (``requests`` or ``remaining``) and return
    ``{"hours", "hours_p10", "hours_p90", "runs", "dataset_hours": {ds: mean hours}, "work_s": {ds: request-s},
    "busy_s": {backend: request-s}}`` (hours: the mean of the runs' times; p10/p90 their 10th/90th percentile).
    Each run draws its own lengths and failure rates from what the pilot can tell (its ``vary``), so the range
    covers both the run's chance and what a pilot of a few samples per dataset can't know. ``job_s`` (a job's
    start-up and wrap-up, :func:`job_overhead`) is added to every time."""
    from statistics import fmean

    jobs = [
        {"dataset": d["dataset"], "requests": sh[key], "backends": d["backends"], **d["retry"]}
        for d in per_ds
        for sh in d["shards"]
        if sh[key] > 0
    ]
    total = sum(j["requests"] for j in jobs)
    runs = max(SIM_MIN_RUNS, min(SIMULATIONS, SIM_REQUESTS // max(1, total)))
    lengths = {d["dataset"]: d["length_model"] for d in per_ds}
    pilot_lengths = {d["dataset"]: d["_pilot_lengths"] for d in per_ds}

    def vary(rng):
        """One run's parameters, drawn from what the pilot can tell: each dataset's lengths from a resample of its
        pilot's (bootstrap), each backend's rates from their Beta posterior (Jeffreys prior, Beta(x + 1/2,
        n - x + 1/2) for x of n attempts)."""
        lens = {
            ds: length_model([rng.choice(v) for _ in v], lengths[ds]["cap"]) if v else lengths[ds]
            for ds, v in pilot_lengths.items()
        }
        bk = {}
        for name, m in models.items():
            n = m["pilot_attempts"]
            bk[name] = (
                {
                    **m,
                    "p_rate_limit": rng.betavariate(
                        m["pilot_rate_limited"] + 0.5, max(0.0, n - m["pilot_rate_limited"]) + 0.5
                    ),
                    "p_fault": rng.betavariate(m["pilot_faults"] + 0.5, max(0.0, n - m["pilot_faults"]) + 0.5),
                }
                if n
                else m
            )
        return bk, lens

    sim = simulate_generation(jobs, models, lengths, runs=runs, vary=vary)
    span = [t + job_s for t in sim["span_s"]]
    return {
        "hours": fmean(span) / 3600,
        "hours_p10": quantile(span, 0.1) / 3600,
        "hours_p90": quantile(span, 0.9) / 3600,
        "runs": runs,
        "dataset_hours": {ds: (fmean(v) + job_s) / 3600 for ds, v in sim["dataset_s"].items()},
        "work_s": sim["work_s"],
        "busy_s": sim["busy_s"],
    }
