"""The ``forecast`` target: what generation will cost and how long it will take, before paying for it.

Two rules (``rules/forecast.smk``):

1. ``forecast_pilot`` (one job per dataset shard, like ``generate``): sends a *pilot* of the shard's samples,
   ``forecast.pilot_samples`` per dataset split over its shards (:func:`.generate.shard_share`), through
   :func:`.generate.generate` itself: the same requests, request keys and journal
   (``<cache_dir>/journal/<dataset>/<shard>.jsonl``) as the full ``generate`` job, which then answers those samples
   from the journal (the pilot is never paid twice). The pilot samples are taken from the samples generate will
   send (the first ``max_samples`` share by ``sample_id``), in the order of a hash of their id, so that they are a
   sample of the dataset unrelated to its source order. Budgets don't apply to the pilot (it is small and its
   spend counts toward them in the full job, as every journaled response does).
2. ``forecast`` (one job): per generated dataset and in total

   - **requests**: the requests generate will send (one per sample; mode ``all``: one per assistant turn), after
     ``max_samples``; samples whose prompt is unusable send none;
   - **prompt tokens**: every request's prompt rendered with the target's chat template
     (``add_generation_prompt=True``) and encoded as ``tokenize`` does (:meth:`.templates.TargetTokens.render`,
     :meth:`~.templates.TargetTokens.encode_texts`); mode ``all`` renders the dataset's own earlier assistant turns,
     where the build puts the regenerated ones;
   - **expected completion tokens**: requests x the pilot's mean billed ``completion_tokens`` per answered request;
   - **dollars**: requests x the pilot's mean cost per answered request. A pilot response's cost is its
     ``usage.cost`` (OpenRouter returns it; ``cost_usd`` in the journal), else its billed prompt and completion
     tokens at the backend's per-token prices: for ``type: openrouter``, OpenRouter's model list
     (``GET {base_url}/models``, ``pricing.prompt`` / ``pricing.completion`` in USD per token; fetched once and
     cached in ``<cache_dir>/forecast/prices-<hash>.json``: delete it to fetch again), else the config's
     ``backends.<name>.price_per_m: {prompt, completion}`` (USD per million tokens). Without either, the dollars are
     unknown and the report says which key to set;
   - budgets: when the expected completion tokens or dollars pass ``budget_completion_tokens`` / ``budget_usd``,
     the requests sent, tokens and dollars are scaled down to the budget (generate stops new requests there);
   - **hours at the configured concurrency**: the mean of simulated runs of the whole generation
     (:func:`simulate_generation`), with their 10th and 90th percentiles: every shard's job at once, each
     backend's ``max_concurrency`` slots shared fairly by the jobs that use it, overflow to a dataset's next
     backend, reply lengths drawn from a lognormal fitted to the dataset's pilot lengths (capped at
     ``max_tokens``), latencies ``a + b x completion_tokens`` fitted per backend on the pilot (least squares,
     :func:`latency_fit`), rate limits and failures at the rates the pilot met (:func:`pilot_faults`), retried
     after generate's backoff. The tail (the long replies that start last, and the retries of long replies)
     is what spreads the runs. The latencies are the pilot's: a server loaded with ``max_concurrency``
     requests may answer slower, which the pilot (a few requests at once) can't see.

The forecast is written as ``results/reports/forecast.md`` (tables and the arithmetic) and ``forecast.json``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pyarrow.parquet as pq

from .errors import ExpectedFailure
from .generate import generate, read_prompts, shard_share
from .io import content_hash, write_json, write_text
from .formatting import dollars, format_hours, format_usd, human_tokens
from .report import markdown_table
from .templates import TemplateError, request_messages, target_tokens

logger = logging.getLogger("eagle3_data.forecast")

DEFAULT_PILOT_SAMPLES = 50

#: per-token prices of OpenRouter's model list, by base_url + model: fetched once per job
_PRICE_CACHE: dict[str, dict] = {}


class ForecastError(ExpectedFailure):
    """The forecast can't be made (no pilot response answered, an unreadable model list); names what to fix."""


# ---------------------------------------------------------------------------------------------------------------
# the pilot


def capped_samples(prompts_path, generation: dict, num_shards: int, shard: str) -> tuple[list, list]:
    """The samples of one shard generate will consider, as generate picks them: (samples sorted by ``sample_id``
    and cut to the shard's ``max_samples`` share, unusable rows). Each sample is a :class:`.generate.Sample`."""
    samples, bad = read_prompts(prompts_path, generation.get("mode", "last"))
    samples.sort(key=lambda s: s.sample_id)
    cap = generation.get("max_samples")
    if cap is not None:
        samples = samples[:shard_share(int(cap), num_shards, shard)]
    return samples, bad


def pilot_sample_ids(prompts_path, generation: dict, *, n: int, num_shards: int, shard: str) -> list[str]:
    """The ids of the pilot samples of one shard: this shard's part of ``n`` (:func:`.generate.shard_share`), the
    samples generate will send with the smallest ``content_hash("pilot", sample_id)`` (a sample unrelated to the
    source order, the same on every run)."""
    samples, _bad = capped_samples(prompts_path, generation, num_shards, shard)
    k = shard_share(int(n), num_shards, shard)
    ranked = sorted(samples, key=lambda s: content_hash("pilot", s.sample_id))
    return sorted(s.sample_id for s in ranked[:k])


def pilot(prompts_path, out_path, *, n: int, dataset: str, shard: str, generation: dict, num_shards: int = 1,
          summary_path=None, attempts_path=None, **generate_kwargs) -> dict:
    """Send one shard's pilot through :func:`.generate.generate` (same requests, keys and journal as the full
    job) and write its RESPONSES parquet to ``out_path``.

    Args:
        n: pilot samples for the whole dataset (``forecast.pilot_samples``); this shard sends its share.
        generation: the dataset's generation config; its budgets are not applied to the pilot.
        summary_path: where to write the returned summary as JSON (optional).
        attempts_path: a JSON-lines file (under ``cache_dir``, beside the journal) where each pilot run that sent
            requests appends its attempts and the retries they needed (generate's ``sent``, ``retry_reasons``,
            ``by_backend``): a rerun answered from the journal sends nothing, and what the paid pilot saw of the
            backends' failures is kept for the forecast (``attempts`` in the summary, the sum of its lines).
        generate_kwargs: the rest of :func:`.generate.generate`'s arguments (target_name, backends, journal_dir,
            log, target, target_format, backend_jobs).

    Returns: generate's summary, plus ``pilot_samples`` (the ids sent or answered from the journal) and
    ``attempts`` (``{"sent", "retry_reasons", "by_backend"}`` of every pilot run of this shard that sent requests,
    and the latest such run's ``startup_s`` and ``wrapup_s``: see :func:`.generate.generate`).
    Raises: what :func:`.generate.generate` raises.
    """
    ids = pilot_sample_ids(prompts_path, generation, n=n, num_shards=num_shards, shard=shard)
    gen = {**generation, "budget_completion_tokens": None, "budget_usd": None}
    logger.info("[%s/%s] pilot: %d sample(s)", dataset, shard, len(ids))
    summary = generate(prompts_path, out_path, dataset=dataset, shard=shard, generation=gen, num_shards=num_shards,
                       sample_ids=set(ids), **generate_kwargs)
    this = {"sent": int(summary.get("sent") or 0), "retry_reasons": dict(summary.get("retry_reasons") or {}),
            "by_backend": dict(summary.get("by_backend") or {}),
            "startup_s": summary.get("startup_s"), "wrapup_s": summary.get("wrapup_s")}
    runs = [this] if this["sent"] else []
    if attempts_path is not None:
        path = Path(attempts_path)
        earlier = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    earlier.append(json.loads(line))
                except ValueError:  # a line cut by a crash: what it held is lost, the rest is kept
                    continue
        if this["sent"]:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(json.dumps(this, sort_keys=True) + "\n")
        runs = earlier + runs
    total = {"sent": 0, "retry_reasons": {}, "by_backend": {}, "startup_s": None, "wrapup_s": None}
    for r in runs:
        total["sent"] += int(r.get("sent") or 0)
        for key in ("retry_reasons", "by_backend"):
            for k, v in (r.get(key) or {}).items():
                total[key][k] = total[key].get(k, 0) + int(v)
        for key in ("startup_s", "wrapup_s"):  # the latest run's that measured it
            if r.get(key) is not None:
                total[key] = r[key]
    out = {**summary, "pilot_samples": ids, "attempts": total}
    if summary_path is not None:
        write_json(out, summary_path)
    return out


# ---------------------------------------------------------------------------------------------------------------
# prices


def _price_cache_path(cache_dir, base_url: str) -> Path:
    return Path(cache_dir) / "forecast" / f"prices-{content_hash(base_url, length=12)}.json"


def openrouter_prices(backend: dict, cache_dir, *, timeout_s: float = 30.0) -> dict | None:
    """USD per token ``{"prompt", "completion", "source"}`` of ``backend["model"]`` from OpenRouter's model list
    (``GET {base_url}/models``: ``data[].pricing.prompt`` / ``.completion``, decimal strings in USD per token).

    The list is fetched once and kept in ``<cache_dir>/forecast/prices-<hash of base_url>.json``. Returns None when
    the model is not listed or has no pricing; raises :class:`ForecastError` naming the URL when the list can't be
    fetched or read."""
    import httpx

    base = str(backend["base_url"]).rstrip("/")
    path = _price_cache_path(cache_dir, base)
    key = f"{base} {backend['model']}"
    if key in _PRICE_CACHE:
        return _PRICE_CACHE[key]
    if path.exists():
        listing = json.loads(path.read_text())
    else:
        url = f"{base}/models"
        try:
            resp = httpx.get(url, timeout=timeout_s)
            resp.raise_for_status()
            listing = {"url": url, "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "data": [{"id": m.get("id"), "pricing": m.get("pricing")} for m in resp.json().get("data", [])
                                if isinstance(m, dict)]}
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise ForecastError(f"backend {backend.get('name', '?')}: can't read the model list {url} "
                                f"({type(exc).__name__}: {str(exc)[:200]}); set backends.<name>.price_per_m "
                                "instead") from None
        write_json(listing, path)
    out = None
    for m in listing.get("data", []):
        if m.get("id") == backend["model"] and isinstance(m.get("pricing"), dict):
            try:
                out = {"prompt": float(m["pricing"]["prompt"]), "completion": float(m["pricing"]["completion"]),
                       "source": f"OpenRouter model list ({listing.get('url')}, {listing.get('fetched_at')})"}
            except (KeyError, TypeError, ValueError):
                out = None
            break
    _PRICE_CACHE[key] = out
    return out


def backend_prices(name: str, backend: dict, cache_dir) -> dict | None:
    """USD per token ``{"prompt", "completion", "source"}`` of a backend: ``type: openrouter``: its model list
    (:func:`openrouter_prices`), else ``price_per_m`` from the config (USD per million tokens); None if neither."""
    if backend.get("type") == "openrouter":
        found = openrouter_prices({**backend, "name": name}, cache_dir)
        if found is not None:
            return found
    table = backend.get("price_per_m")
    if table:
        return {"prompt": float(table["prompt"]) / 1e6, "completion": float(table["completion"]) / 1e6,
                "source": f"config backends.{name}.price_per_m"}
    return None


# ---------------------------------------------------------------------------------------------------------------
# the forecast


def latency_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``latency_s = a + b * completion_tokens`` over (completion_tokens, latency_s) points;
    ``(mean latency, 0.0)`` with fewer than two distinct lengths or a negative slope. Returns (a seconds,
    b seconds per token)."""
    if not points:
        return 0.0, 0.0
    n = len(points)
    mx = sum(c for c, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((c - mx) ** 2 for c, _ in points)
    if sxx <= 0:
        return my, 0.0
    b = sum((c - mx) * (t - my) for c, t in points) / sxx
    if b < 0:
        return my, 0.0
    return my - b * mx, b


def expected_longest(lengths: list[int], n: float, cap: int | None = None) -> float:
    """Expected longest of ``n`` completion lengths (tokens) drawn like the pilot's ``lengths``: a lognormal fitted
    to them (mean and sample standard deviation of the log lengths), at its ``n / (n + 1)`` quantile (the usual
    approximation of the expected maximum of ``n`` draws; E. J. Gumbel, *Statistics of Extremes*, 1958), capped at
    ``cap`` (``generation.max_tokens``) and never below the pilot's own longest. With fewer than two positive
    lengths: the pilot's longest. Long reasoning replies are rare, so a pilot of a few samples rarely sees the
    longest of thousands; the generation's tail is that longest request finishing after the others."""
    import math
    from statistics import NormalDist, fmean, stdev

    longest = float(max(lengths, default=0))
    logs = [math.log(x) for x in lengths if x > 0]
    if len(logs) < 2 or n <= 1:
        return longest
    q = math.exp(fmean(logs) + stdev(logs) * NormalDist().inv_cdf(n / (n + 1.0)))
    return max(longest, min(q, float(cap)) if cap else q)


def _prompt_lengths(tt, prompts: list[tuple[list, list | None]]) -> tuple[list[int], int]:
    """Token counts of each (messages, tools) prompt rendered with the target's template; unrenderable prompts
    count 0 and are counted (they are sent, and rejected at tokenize)."""
    texts, failed = [], 0
    for messages, tools in prompts:
        try:
            texts.append(tt.render(messages, tools, True))
        except TemplateError:
            texts.append("")
            failed += 1
    lens = [len(x) for x in tt.encode_texts(texts)] if texts else []
    return lens, failed


def _dataset_requests(prompts_paths: list, generation: dict, num_shards: int, template: str | None):
    """(prompts of every request generate will send: [(messages, tools)], samples, unusable rows, requests per
    shard ``{shard: n}``)."""
    prompts, n_samples, n_bad, per_shard = [], 0, 0, {}
    for path in prompts_paths:
        shard = Path(path).stem
        samples, bad = capped_samples(path, generation, num_shards, shard)
        n_samples += len(samples)
        n_bad += len([b for b in bad if not b.get("dup")])
        before = len(prompts)
        for s in samples:
            history, tools = s.messages, s.tools
            for turn in s.turns:
                prompts.append((request_messages(history[:turn], template), tools))
        per_shard[shard] = len(prompts) - before
    return prompts, n_samples, n_bad, per_shard


def _pilot_rows(paths: list) -> list[dict]:
    """The pilot's RESPONSES rows, each with its ``shard`` (the file's stem)."""
    cols = ["sample_id", "status", "messages", "tools", "prompt_tokens", "completion_tokens", "cost_usd",
            "latency_s", "backend"]
    rows: list[dict] = []
    for p in paths:
        rows += [{**r, "shard": Path(p).stem} for r in pq.ParquetFile(p).read(columns=cols).to_pylist()]
    return rows


def forecast_dataset(ds: str, spec: dict, *, target: dict, template: str | None, cache_dir) -> dict:
    """The forecast of one dataset (see the module docstring); ``spec`` = ``{prompts: [paths], pilot: [paths],
    generation, backends: {name: cfg} (priority order), num_shards}``. Raises :class:`ForecastError` when no pilot
    request was answered."""
    gen = spec["generation"]
    backends = spec["backends"]
    tt = target_tokens(target, (gen.get("extra_body") or {}).get("chat_template_kwargs"))
    prompts, n_samples, n_bad, per_shard = _dataset_requests(spec["prompts"], gen, spec["num_shards"], template)
    lens, unrenderable = _prompt_lengths(tt, prompts)
    rows = _pilot_rows(spec["pilot"])
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise ForecastError(f"dataset {ds}: no pilot request was answered ({len(rows)} failed; see "
                            f"logs/forecast_pilot/{ds}/): nothing to forecast from")
    pilot_lens, _ = _prompt_lengths(tt, [(json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None)
                                         for r in ok])
    prices = {}
    costs: list[float | None] = []
    sources = set()
    for r in ok:
        if r["cost_usd"] is not None:
            costs.append(float(r["cost_usd"]))
            sources.add("usage.cost")
            continue
        name = r["backend"]
        if name not in prices:
            prices[name] = backend_prices(name, backends.get(name) or {}, cache_dir)
        p = prices[name]
        if p is None:
            costs.append(None)
            continue
        costs.append((r["prompt_tokens"] or 0) * p["prompt"] + (r["completion_tokens"] or 0) * p["completion"])
        sources.add(p["source"])
    n_ok = len(ok)
    comp = [int(r["completion_tokens"] or 0) for r in ok]
    mean_comp = sum(comp) / n_ok
    known = [c for c in costs if c is not None]
    cost_per_request = sum(known) / len(known) if len(known) == n_ok else None
    requests = len(prompts)
    completion = requests * mean_comp
    usd = None if cost_per_request is None else requests * cost_per_request
    # budgets: generate stops new requests once the (per-shard share of the) budget is spent
    frac, stopped_by = 1.0, None
    bt, bu = gen.get("budget_completion_tokens"), gen.get("budget_usd")
    if bt is not None and completion > float(bt):
        frac, stopped_by = float(bt) / completion, "budget_completion_tokens"
    if bu is not None and usd is not None and usd * frac > float(bu):
        frac, stopped_by = float(bu) / usd, "budget_usd"
    a, b = latency_fit([(c, float(r["latency_s"])) for c, r in zip(comp, ok) if r["latency_s"] is not None])
    sent = requests * frac
    remaining = max(0.0, sent - n_ok)  # the pilot's answered requests are journaled: the build doesn't send them
    longest = expected_longest(comp, sent, gen.get("max_tokens"))
    tail_s = a + b * longest
    conc = sum(int(c.get("max_concurrency") or 8) for c in backends.values())
    ok_by_shard: dict[str, int] = {}
    for r in ok:
        ok_by_shard[r["shard"]] = ok_by_shard.get(r["shard"], 0) + 1
    # the jobs of the simulation: each shard's requests (scaled to the budget) and what the pilot left of them
    shard_jobs = [{"shard": sh, "requests": round(n * frac),
                   "remaining": max(0, round(n * frac) - ok_by_shard.get(sh, 0))}
                  for sh, n in sorted(per_shard.items())]
    return {
        "dataset": ds, "samples": n_samples, "unusable": n_bad, "requests": requests,
        "requests_sent": round(sent), "stopped_by": stopped_by,
        "prompt_tokens": int(sum(lens)), "prompt_tokens_sent": round(sum(lens) * frac),
        "unrenderable_prompts": unrenderable,
        "completion_tokens_per_request": round(mean_comp, 1),
        "expected_completion_tokens": round(completion * frac),
        "cost_per_request_usd": cost_per_request, "usd": None if usd is None else usd * frac,
        "cost_source": ", ".join(sorted(sources)) if usd is not None else None,
        "missing_prices": sorted(n for n, p in prices.items() if p is None),
        "latency_a_s": round(a, 4), "latency_b_s_per_token": b, "tail_s": tail_s,
        "longest_tokens": round(longest), "length_model": length_model(comp, gen.get("max_tokens")),
        "concurrency": conc, "backends": list(backends), "shards": shard_jobs,
        "retry": {"max_retries": int(gen.get("max_retries", 5)),
                  "retry_initial_s": float(gen.get("retry_initial_s", 1.0)),
                  "retry_max_s": float(gen.get("retry_max_s", 60.0))},
        "requests_remaining": round(remaining),
        "usd_remaining": None if usd is None else max(0.0, usd * frac - sum(known)),
        "pilot": {"requests": len(rows), "ok": n_ok, "failed": len(rows) - n_ok,
                  "completion_tokens": sum(comp), "prompt_tokens": int(sum(pilot_lens)),
                  "billed_prompt_tokens": sum(int(r["prompt_tokens"] or 0) for r in ok),
                  "cost_usd": sum(known) if known else None,
                  "latency_s_mean": sum(float(r["latency_s"] or 0) for r in ok) / n_ok,
                  "latency_s_max": max(float(r["latency_s"] or 0) for r in ok)},
        "_pilot_ok": ok, "_pilot_lengths": comp,  # for the backends' fits and the simulation (not written)
    }


#: simulated runs of the generation (their mean is the forecast's time; p10..p90 its range), for a run of up to
#: SIM_REQUESTS / SIMULATIONS requests; larger runs get fewer (at least SIM_MIN_RUNS), so the job stays short
SIMULATIONS = 64
SIM_REQUESTS = 4_000_000
SIM_MIN_RUNS = 4


def length_model(lengths: list[int], cap: int | None) -> dict:
    """The completion-length model the simulation draws from: a lognormal fitted to the pilot's lengths (``mu``,
    ``sigma`` of their logs; ``sigma`` 0 with fewer than two positive lengths), clipped to ``[1, cap]`` tokens
    (``cap``: ``generation.max_tokens``, None: unclipped). No lengths at all: ``mu`` = -inf (every reply 1 token)."""
    import math
    from statistics import fmean, stdev

    logs = [math.log(x) for x in lengths if x > 0]
    return {"mu": fmean(logs) if logs else float("-inf"), "sigma": stdev(logs) if len(logs) >= 2 else 0.0,
            "cap": int(cap) if cap else None}


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


def simulate_generation(jobs: list[dict], backends: dict[str, dict], lengths: dict[str, dict], *,
                        runs: int = SIMULATIONS, seed: int = 0, max_retries: int = 5, retry_initial_s: float = 1.0,
                        retry_max_s: float = 60.0, vary=None) -> dict:
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
    before = {(j, b): job["backends"][:job["backends"].index(b)] for j, job in enumerate(jobs) for b in job["backends"]}
    base = (backends, lengths)
    retry = [(int(job.get("max_retries", max_retries)), float(job.get("retry_initial_s", retry_initial_s)),
              float(job.get("retry_max_s", retry_max_s))) for job in jobs]
    datasets = sorted({job["dataset"] for job in jobs})
    out = {"span_s": [], "dataset_s": {ds: [] for ds in datasets}, "work_s": dict.fromkeys(datasets, 0.0),
           "busy_s": dict.fromkeys(order, 0.0)}
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
                    if (pending[j] or retries[j]) and (best < 0 or fl[j] < fl[best]) \
                            and not any(free[p] > 0 for p in before[j, b]):
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
            out["dataset_s"][ds].append(max((done_at[j] for j, job in enumerate(jobs) if job["dataset"] == ds),
                                            default=0.0))
    n_runs = len(out["span_s"])
    out["work_s"] = {k: v / n_runs for k, v in out["work_s"].items()}
    out["busy_s"] = {k: v / n_runs for k, v in out["busy_s"].items()}
    return out


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics, as numpy's default)."""
    s = sorted(xs)
    if not s:
        return 0.0
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def backend_models(per_ds: list[dict], backends: dict, summaries: list[dict]) -> dict[str, dict]:
    """The simulation's backends (see :func:`simulate_generation`) from the pilot: per backend its
    ``max_concurrency`` (8 when unset), the latency fit ``a + b x completion tokens`` over every pilot response it
    answered (:func:`latency_fit`; a dataset with at least 10 answers of its own on it keeps its own fit,
    under ``latency``), and the shares of attempts rate-limited and failed (:func:`pilot_faults`; the counts
    too, as ``pilot_attempts``, ``pilot_rate_limited``, ``pilot_faults``). A backend that answered no pilot
    request (an overflow backend the pilot never reached) borrows the fit of every pilot response and every
    backend's failure rates; ``source`` says which."""
    faults = pilot_faults(summaries)
    pooled = {k: sum(f[k] for f in faults.values()) for k in ("attempts", "rate_limited", "faults")}
    names = [b for d in per_ds for b in d["backends"]]
    out: dict[str, dict] = {}
    pooled_all = [(int(r["completion_tokens"] or 0), float(r["latency_s"])) for d in per_ds for r in d["_pilot_ok"]
                  if r["latency_s"] is not None]
    for name in dict.fromkeys(names):
        pts, own = [], {}
        for d in per_ds:
            mine = [(int(r["completion_tokens"] or 0), float(r["latency_s"])) for r in d["_pilot_ok"]
                    if r["backend"] == name and r["latency_s"] is not None]
            pts += mine
            if len(mine) >= 10:
                own[d["dataset"]] = latency_fit(mine)
        a, b = latency_fit(pts if pts else pooled_all)
        f = faults.get(name) or pooled  # a backend the pilot never reached: every backend's rates
        att = float(f["attempts"])
        out[name] = {"concurrency": int((backends.get(name) or {}).get("max_concurrency") or 8),
                     "a": a, "b": b, "latency": own, "pilot_responses": len(pts),
                     "source": "its own pilot responses" if pts else "no pilot response: the pooled fit of all",
                     "pilot_attempts": att, "pilot_rate_limited": float(f["rate_limited"]),
                     "pilot_faults": float(f["faults"]),
                     "p_rate_limit": float(f["rate_limited"]) / att if att else 0.0,
                     "p_fault": float(f["faults"]) / att if att else 0.0}
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

    jobs = [{"dataset": d["dataset"], "requests": sh[key], "backends": d["backends"], **d["retry"]}
            for d in per_ds for sh in d["shards"] if sh[key] > 0]
    total = sum(j["requests"] for j in jobs)
    runs = max(SIM_MIN_RUNS, min(SIMULATIONS, SIM_REQUESTS // max(1, total)))
    lengths = {d["dataset"]: d["length_model"] for d in per_ds}
    pilot_lengths = {d["dataset"]: d["_pilot_lengths"] for d in per_ds}

    def vary(rng):
        """One run's parameters, drawn from what the pilot can tell: each dataset's lengths from a resample of its
        pilot's (bootstrap), each backend's rates from their Beta posterior (Jeffreys prior, Beta(x + 1/2,
        n - x + 1/2) for x of n attempts)."""
        lens = {ds: length_model([rng.choice(v) for _ in v], lengths[ds]["cap"]) if v else lengths[ds]
                for ds, v in pilot_lengths.items()}
        bk = {}
        for name, m in models.items():
            n = m["pilot_attempts"]
            bk[name] = {**m, "p_rate_limit": rng.betavariate(m["pilot_rate_limited"] + 0.5,
                                                             max(0.0, n - m["pilot_rate_limited"]) + 0.5),
                        "p_fault": rng.betavariate(m["pilot_faults"] + 0.5, max(0.0, n - m["pilot_faults"]) + 0.5)} \
                if n else m
        return bk, lens

    sim = simulate_generation(jobs, models, lengths, runs=runs, vary=vary)
    span = [t + job_s for t in sim["span_s"]]
    return {"hours": fmean(span) / 3600, "hours_p10": _quantile(span, 0.1) / 3600,
            "hours_p90": _quantile(span, 0.9) / 3600, "runs": runs,
            "dataset_hours": {ds: (fmean(v) + job_s) / 3600 for ds, v in sim["dataset_s"].items()},
            "work_s": sim["work_s"], "busy_s": sim["busy_s"]}


def render_markdown(fc: dict) -> str:
    """The forecast as Markdown: per-dataset table with the total, the pilot, the backends and the method."""
    t = fc["total"]

    def span(h, lo, hi) -> str:
        return f"{format_hours(h, 2)} ({format_hours(lo, 2)} to {format_hours(hi, 2)})"

    rows = []
    for d in fc["datasets"].values():
        rows.append({**d, "usd_s": format_usd(d["usd"]) if d["usd"] is not None else "unknown",
                     "time": format_hours(d["hours"], 2), "stop": d["stopped_by"] or ""})
    rows.append({"dataset": "Total", "requests": t["requests"], "requests_sent": t["requests_sent"],
                 "prompt_tokens_sent": t["prompt_tokens_sent"],
                 "expected_completion_tokens": t["expected_completion_tokens"],
                 "usd_s": (format_usd(t["usd"]) if t["usd"] is not None else "unknown")
                 + (" (+ unknown)" if t["usd"] is not None and t["usd_unknown"] else ""),
                 "time": span(t["hours"], t["hours_p10"], t["hours_p90"]), "stop": "", "total": True})
    cols = [("dataset", "Dataset", "text"), ("requests", "Requests", ""), ("requests_sent", "Sent", ""),
            ("prompt_tokens_sent", "Prompt tokens", "tok"), ("expected_completion_tokens", "Completion tokens", "tok"),
            ("usd_s", "Cost $", "text"), ("time", "Done after", "text"), ("stop", "Budget stop", "text")]
    sim = fc.get("simulation") or {}
    lines = [
        "# Generation forecast",
        "",
        f"From a pilot of {fc['pilot_samples']} sample(s) per dataset (journaled: the build answers them from the "
        "journal and does not pay for them again). Prompt tokens: every request's prompt rendered with the "
        "target's chat template; completion tokens and dollars: requests x the pilot's mean per answered request; "
        "time: the mean of simulated runs at each backend's `max_concurrency` (in brackets: 10th to 90th "
        "percentile; \"Done after\": when a dataset's last request ends, all datasets running together).",
        "",
        markdown_table(rows, cols, bold=lambda r: r.get("total", False)),
        "",
        f"Already paid by the pilot: the build sends {t['requests_remaining']:,} more request(s), for "
        + (f"${format_usd(t['usd_remaining'])}" if t["usd_remaining"] is not None else "unknown dollars")
        + f" in {span(t['hours_remaining'], t['hours_remaining_p10'], t['hours_remaining_p90'])}.",
        "",
        "## Pilot",
        "",
        markdown_table([{"dataset": d["dataset"], **d["pilot"],
                         "cost": format_usd(d["pilot"]["cost_usd"]) if d["pilot"]["cost_usd"] is not None else "",
                         "per": d["completion_tokens_per_request"], "longest": d["longest_tokens"],
                         "fit": f"{d['latency_a_s']:.2f} s + {1000 * d['latency_b_s_per_token']:.3f} ms/token",
                         "src": d["cost_source"] or "unknown: set backends."
                         + "/".join(d["missing_prices"] or ["<name>"]) + ".price_per_m"}
                        for d in fc["datasets"].values()],
                       [("dataset", "Dataset", "text"), ("requests", "Requests", ""), ("failed", "Failed", ""),
                        ("per", "Completion tok / request", ""), ("longest", "Longest expected (tok)", ""),
                        ("cost", "Cost $", "text"), ("fit", "Latency", "text"),
                        ("latency_s_max", "Longest (s)", ""), ("src", "Prices", "text")]),
        "",
        "## Time",
        "",
        f"The generation is simulated {sim.get('runs', '?')} times, request by request, as generate runs it: every "
        "shard's job at once; each backend's `max_concurrency` slots shared by the jobs that use it, a free slot "
        "going to the job with the fewest requests in flight there (its fair share) and a dataset's requests "
        "overflowing to its next backend when the first is full; each reply's length drawn from a lognormal fitted "
        "to its dataset's pilot lengths (capped at `max_tokens`), its latency `a + b x completion tokens` fitted per "
        "backend on the pilot; rate limits (HTTP 429) refused at once and other failures at a random point of the "
        "request, at the pilot's rates, then retried after generate's backoff behind the job's other requests. "
        "Each run draws its own reply lengths from a resample of the pilot's and its failure rates from what the "
        "pilot's counts allow (Beta posterior), so the range also covers what a small pilot can't know. The long "
        "replies that start last and the retries of long replies make the tail, and so the spread between runs. "
        f"Every time includes a job's start-up and wrap-up as the pilot's jobs measured them "
        f"({sim.get('startup_s', 0.0):.1f} s + {sim.get('wrapup_s', 0.0):.1f} s). Not simulated: a run with more "
        "shards than generate seats (every shard's job is assumed to run at once), and a cluster run, where each "
        "job keeps its fixed share of the limits (its tail is longer).",
        "",
        markdown_table([{"backend": name, "concurrency": m["concurrency"], "pilot": m["pilot_responses"],
                         "fit": f"{m['a']:.2f} s + {1000 * m['b']:.3f} ms/token",
                         "rl": f"{100 * m['p_rate_limit']:.1f} %", "fault": f"{100 * m['p_fault']:.1f} %",
                         "work": f"{m['busy_s']:,.0f}",
                         "limit": format_hours(m["busy_s"] / max(1, m["concurrency"]) / 3600, 2)}
                        for name, m in fc["backends"].items()],
                       [("backend", "Backend", "text"), ("concurrency", "Concurrency", ""),
                        ("pilot", "Pilot responses", ""), ("fit", "Latency", "text"),
                        ("rl", "Rate-limited", "text"), ("fault", "Failed", "text"),
                        ("work", "Work (request-s)", "text"), ("limit", "Work at the limit", "text")]),
        "",
    ]
    return "\n".join(lines)


def forecast(datasets: dict, out_md, out_json, *, target: dict, pilot_samples: int, cache_dir,
             backends: dict) -> dict:
    """Write the forecast (``out_md`` Markdown, ``out_json`` JSON) of the generated ``datasets`` and return it.

    Args:
        datasets: name -> ``{prompts: [PROMPTS parquet per shard], pilot: [pilot RESPONSES parquet per shard],
            pilot_summaries: [the pilot jobs' summary JSON files] (optional: default the ``.json`` beside each
            pilot parquet, where it exists), generation: the dataset's generation config, backends: {name: backend
            config} in priority order, num_shards}``.
        target: the config ``target`` slice (``path``, ``template``, ``trust_remote_code``,
            ``chat_template_kwargs``); prompts are rendered with its chat template.
        pilot_samples: ``forecast.pilot_samples`` (for the report).
        cache_dir: the config's ``cache_dir`` (the cached model list).
        backends: every backend's config (name -> dict), for ``max_concurrency``.

    Returns: ``{"pilot_samples", "datasets": {name: per-dataset figures}, "total": {requests, requests_sent,
        prompt_tokens, prompt_tokens_sent, expected_completion_tokens, usd (None if no price is known), usd_unknown
        (datasets without prices), hours, hours_p10, hours_p90, hours_remaining (+ _p10, _p90), ...},
        "backends": {name: the simulation's model of it}, "simulation": {runs}}``; dollars in USD, hours in hours,
        tokens as counts, work in request-seconds.

    Raises: :class:`ForecastError` (no pilot answer, an unreadable model list); TemplateError (target tokenizer).
    """
    template = target.get("template")
    per = {}
    summaries = []
    for ds, spec in datasets.items():
        t0 = time.monotonic()
        per[ds] = forecast_dataset(ds, spec, target=target, template=template, cache_dir=cache_dir)
        paths = spec.get("pilot_summaries")
        if paths is None:
            paths = [Path(p).with_suffix(".json") for p in spec["pilot"] if Path(p).with_suffix(".json").exists()]
        summaries += [json.loads(Path(p).read_text()) for p in paths]
        logger.info("%s: %d requests, %s prompt tokens, %s expected completion tokens, %s (%.1f s)", ds,
                    per[ds]["requests"], human_tokens(per[ds]["prompt_tokens"]),
                    human_tokens(round(per[ds]["expected_completion_tokens"])), dollars(per[ds]["usd"]),
                    time.monotonic() - t0)
    t0 = time.monotonic()
    models = backend_models(list(per.values()), backends, summaries)
    overhead = job_overhead(summaries)
    full = simulated_hours(list(per.values()), models, "requests", overhead["job_s"])
    rest = simulated_hours(list(per.values()), models, "remaining", overhead["job_s"])
    for ds, d in per.items():
        d.pop("_pilot_ok")
        d.pop("_pilot_lengths")
        d["hours"] = full["dataset_hours"].get(ds, 0.0)
        d["work_s"] = full["work_s"].get(ds, 0.0)
        d["hours_remaining"] = rest["dataset_hours"].get(ds, 0.0)
        d["remaining_work_s"] = rest["work_s"].get(ds, 0.0)
    for name, m in models.items():
        m["busy_s"] = full["busy_s"].get(name, 0.0)
        m["busy_remaining_s"] = rest["busy_s"].get(name, 0.0)
    logger.info("simulated the generation %d + %d times (%.1f s): %s (p10 %s, p90 %s); what the pilot left: %s",
                full["runs"], rest["runs"], time.monotonic() - t0, format_hours(full["hours"], 2),
                format_hours(full["hours_p10"], 2), format_hours(full["hours_p90"], 2),
                format_hours(rest["hours"], 2))
    known = [d["usd"] for d in per.values() if d["usd"] is not None]
    total = {k: sum(d[k] for d in per.values()) for k in ("requests", "requests_sent", "prompt_tokens",
                                                           "prompt_tokens_sent", "expected_completion_tokens",
                                                           "requests_remaining")}
    total.update({"usd": sum(known) if known else None,
                  "usd_unknown": sorted(d["dataset"] for d in per.values() if d["usd"] is None),
                  "hours": full["hours"], "hours_p10": full["hours_p10"], "hours_p90": full["hours_p90"],
                  "usd_remaining": sum(d["usd_remaining"] for d in per.values() if d["usd_remaining"] is not None)
                  if known else None, "hours_remaining": rest["hours"], "hours_remaining_p10": rest["hours_p10"],
                  "hours_remaining_p90": rest["hours_p90"]})
    fc = {"pilot_samples": int(pilot_samples), "datasets": per, "total": total, "backends": models,
          "simulation": {"runs": full["runs"], "runs_remaining": rest["runs"], **overhead}}
    write_json(fc, out_json)
    write_text(render_markdown(fc), out_md)
    return fc
