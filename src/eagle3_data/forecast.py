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
   - **hours at the configured concurrency**: a latency model fitted on the pilot, ``latency = a + b x
     completion_tokens`` (least squares over the pilot's answered requests; ``b = 0`` with fewer than two distinct
     lengths). A dataset's work is ``requests x (a + b x mean completion)`` request-seconds; its hours are
     work / (the summed ``max_concurrency`` of its backends) + the tail, the latency ``a + b x L`` of the longest
     request expected among the dataset's (:func:`expected_longest`: ``L`` from a lognormal fitted to the pilot's
     completion lengths, capped at ``max_tokens``; the last long requests finish alone). The total: backends that
     share datasets form one pool; a pool takes max(its work / its summed concurrency, for each backend the work
     only it can do / its concurrency) + its longest tail, and pools run side by side (the total is the longest pool). The latencies are
     the pilot's: a server loaded with ``max_concurrency`` requests may answer slower, which the pilot (a few
     requests at once) can't see.

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
from .report import format_hours, format_usd, human_tokens, markdown_table
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
          **generate_kwargs) -> dict:
    """Send one shard's pilot through :func:`.generate.generate` (same requests, keys and journal as the full
    job) and write its RESPONSES parquet to ``out_path``.

    Args:
        n: pilot samples for the whole dataset (``forecast.pilot_samples``); this shard sends its share.
        generation: the dataset's generation config; its budgets are not applied to the pilot.
        generate_kwargs: the rest of :func:`.generate.generate`'s arguments (target_name, backends, journal_dir,
            log, summary_path, target, target_format, backend_jobs).

    Returns: generate's summary, plus ``pilot_samples`` (the ids sent or answered from the journal).
    Raises: what :func:`.generate.generate` raises.
    """
    ids = pilot_sample_ids(prompts_path, generation, n=n, num_shards=num_shards, shard=shard)
    gen = {**generation, "budget_completion_tokens": None, "budget_usd": None}
    logger.info("[%s/%s] pilot: %d sample(s)", dataset, shard, len(ids))
    summary = generate(prompts_path, out_path, dataset=dataset, shard=shard, generation=gen, num_shards=num_shards,
                       sample_ids=set(ids), **generate_kwargs)
    return {**summary, "pilot_samples": ids}


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
    """(prompts of every request generate will send: [(messages, tools)], samples, unusable rows)."""
    prompts, n_samples, n_bad = [], 0, 0
    for path in prompts_paths:
        shard = Path(path).stem
        samples, bad = capped_samples(path, generation, num_shards, shard)
        n_samples += len(samples)
        n_bad += len([b for b in bad if not b.get("dup")])
        for s in samples:
            history, tools = s.messages, s.tools
            for turn in s.turns:
                prompts.append((request_messages(history[:turn], template), tools))
    return prompts, n_samples, n_bad


def _pilot_rows(paths: list) -> list[dict]:
    cols = ["sample_id", "status", "messages", "tools", "prompt_tokens", "completion_tokens", "cost_usd",
            "latency_s", "backend"]
    rows: list[dict] = []
    for p in paths:
        rows += pq.ParquetFile(p).read(columns=cols).to_pylist()
    return rows


def forecast_dataset(ds: str, spec: dict, *, target: dict, template: str | None, cache_dir) -> dict:
    """The forecast of one dataset (see the module docstring); ``spec`` = ``{prompts: [paths], pilot: [paths],
    generation, backends: {name: cfg} (priority order), num_shards}``. Raises :class:`ForecastError` when no pilot
    request was answered."""
    gen = spec["generation"]
    backends = spec["backends"]
    tt = target_tokens(target, (gen.get("extra_body") or {}).get("chat_template_kwargs"))
    prompts, n_samples, n_bad = _dataset_requests(spec["prompts"], gen, spec["num_shards"], template)
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
    per_request_s = a + b * mean_comp
    work_s = sent * per_request_s
    remaining = max(0.0, sent - n_ok)  # the pilot's answered requests are journaled: the build doesn't send them
    tail_s = a + b * expected_longest(comp, sent, gen.get("max_tokens"))
    conc = sum(int(c.get("max_concurrency") or 8) for c in backends.values())
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
        "latency_a_s": round(a, 4), "latency_b_s_per_token": b, "work_s": work_s, "tail_s": tail_s,
        "concurrency": conc, "backends": list(backends), "hours": (work_s / conc + tail_s) / 3600,
        "requests_remaining": round(remaining), "remaining_work_s": remaining * per_request_s,
        "usd_remaining": None if usd is None else max(0.0, usd * frac - sum(known)),
        "hours_remaining": (remaining * per_request_s / conc + (tail_s if remaining else 0.0)) / 3600,
        "pilot": {"requests": len(rows), "ok": n_ok, "failed": len(rows) - n_ok,
                  "completion_tokens": sum(comp), "prompt_tokens": int(sum(pilot_lens)),
                  "billed_prompt_tokens": sum(int(r["prompt_tokens"] or 0) for r in ok),
                  "cost_usd": sum(known) if known else None,
                  "latency_s_mean": sum(float(r["latency_s"] or 0) for r in ok) / n_ok,
                  "latency_s_max": max(float(r["latency_s"] or 0) for r in ok)},
    }


def total_hours(per_ds: list[dict], concurrency: dict[str, int], work: str = "work_s") -> tuple[float, list[dict]]:
    """Hours of the whole generation (the module docstring's pool model): (hours, pools as ``{backends, work_s,
    concurrency, tail_s, hours}``). ``per_ds``: dicts with ``backends`` (names), ``tail_s`` and the request-seconds
    under the key ``work``; ``concurrency``: backend name -> ``max_concurrency``."""
    parent = {b: b for d in per_ds for b in d["backends"]}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for d in per_ds:
        for b in d["backends"][1:]:
            parent[find(b)] = find(d["backends"][0])
    pools: dict[str, dict] = {}
    for d in per_ds:
        p = pools.setdefault(find(d["backends"][0]), {"backends": set(), "work_s": 0.0, "tail_s": 0.0, "only": {}})
        p["backends"].update(d["backends"])
        p["work_s"] += d[work]
        if d[work]:
            p["tail_s"] = max(p["tail_s"], d["tail_s"])
        if len(d["backends"]) == 1:
            p["only"][d["backends"][0]] = p["only"].get(d["backends"][0], 0.0) + d[work]
    out = []
    for p in pools.values():
        conc = sum(concurrency[b] for b in p["backends"])
        body = max([p["work_s"] / conc] + [w / concurrency[b] for b, w in p["only"].items()])
        out.append({"backends": sorted(p["backends"]), "work_s": p["work_s"], "concurrency": conc,
                    "tail_s": p["tail_s"], "hours": (body + p["tail_s"]) / 3600})
    return max((p["hours"] for p in out), default=0.0), out



def render_markdown(fc: dict) -> str:
    """The forecast as Markdown: per-dataset table with the total, the pilot, prices and the method."""
    rows = []
    for d in fc["datasets"].values():
        rows.append({**d, "usd_s": format_usd(d["usd"]) if d["usd"] is not None else "unknown",
                     "time": format_hours(d["hours"], 2), "stop": d["stopped_by"] or ""})
    t = fc["total"]
    rows.append({"dataset": "Total", "requests": t["requests"], "requests_sent": t["requests_sent"],
                 "prompt_tokens_sent": t["prompt_tokens_sent"],
                 "expected_completion_tokens": t["expected_completion_tokens"],
                 "usd_s": (format_usd(t["usd"]) if t["usd"] is not None else "unknown")
                 + (" (+ unknown)" if t["usd"] is not None and t["usd_unknown"] else ""),
                 "time": format_hours(t["hours"], 2), "stop": "", "total": True})
    cols = [("dataset", "Dataset", "text"), ("requests", "Requests", ""), ("requests_sent", "Sent", ""),
            ("prompt_tokens_sent", "Prompt tokens", "tok"), ("expected_completion_tokens", "Completion tokens", "tok"),
            ("usd_s", "Cost $", "text"), ("time", "Time", "text"), ("stop", "Budget stop", "text")]
    lines = [
        "# Generation forecast",
        "",
        f"From a pilot of {fc['pilot_samples']} sample(s) per dataset (journaled: the build answers them from the "
        "journal and does not pay for them again). Prompt tokens: every request's prompt rendered with the "
        "target's chat template; completion tokens and dollars: requests x the pilot's mean per answered request; "
        "time: at each backend's `max_concurrency`.",
        "",
        markdown_table(rows, cols, bold=lambda r: r.get("total", False)),
        "",
        f"Already paid by the pilot: the build sends {t['requests_remaining']:,} more request(s), for "
        + (f"${format_usd(t['usd_remaining'])}" if t["usd_remaining"] is not None else "unknown dollars")
        + f" in {format_hours(t['hours_remaining'], 2)}.",
        "",
        "## Pilot",
        "",
        markdown_table([{"dataset": d["dataset"], **d["pilot"],
                         "cost": format_usd(d["pilot"]["cost_usd"]) if d["pilot"]["cost_usd"] is not None else "",
                         "per": d["completion_tokens_per_request"],
                         "fit": f"{d['latency_a_s']:.2f} s + {1000 * d['latency_b_s_per_token']:.3f} ms/token",
                         "src": d["cost_source"] or "unknown: set backends."
                         + "/".join(d["missing_prices"] or ["<name>"]) + ".price_per_m"}
                        for d in fc["datasets"].values()],
                       [("dataset", "Dataset", "text"), ("requests", "Requests", ""), ("failed", "Failed", ""),
                        ("per", "Completion tok / request", ""), ("cost", "Cost $", "text"),
                        ("fit", "Latency", "text"), ("latency_s_max", "Longest (s)", ""),
                        ("src", "Prices", "text")]),
        "",
        "## Time",
        "",
        "Each request takes `a + b x completion tokens` seconds (fitted on the pilot). A dataset's work is requests x "
        "that latency at its mean completion length; its time is work / its backends' summed `max_concurrency` plus "
        "the tail: the latency of the longest request expected among the dataset's (a lognormal fitted to the pilot's "
        "completion lengths, at the quantile n / (n + 1) for n requests, capped at `max_tokens`). Backends that share "
        "a dataset form a pool; a pool takes the larger "
        "of its work / its concurrency and, per backend, the work only that backend can do / its concurrency, plus "
        "its longest tail; pools run side by side.",
        "",
        markdown_table([{**p, "backends": ", ".join(p["backends"]), "work": f"{p['work_s']:,.0f}",
                         "tail": f"{p['tail_s']:,.1f}", "time": format_hours(p["hours"], 2)} for p in fc["pools"]],
                       [("backends", "Backends", "text"), ("work", "Work (request-s)", "text"),
                        ("concurrency", "Concurrency", ""), ("tail", "Tail (s)", "text"), ("time", "Time", "text")]),
        "",
    ]
    return "\n".join(lines)


def forecast(datasets: dict, out_md, out_json, *, target: dict, pilot_samples: int, cache_dir,
             backends: dict) -> dict:
    """Write the forecast (``out_md`` Markdown, ``out_json`` JSON) of the generated ``datasets`` and return it.

    Args:
        datasets: name -> ``{prompts: [PROMPTS parquet per shard], pilot: [pilot RESPONSES parquet per shard],
            generation: the dataset's generation config, backends: {name: backend config} in priority order,
            num_shards}``.
        target: the config ``target`` slice (``path``, ``template``, ``trust_remote_code``,
            ``chat_template_kwargs``); prompts are rendered with its chat template.
        pilot_samples: ``forecast.pilot_samples`` (for the report).
        cache_dir: the config's ``cache_dir`` (the cached model list).
        backends: every backend's config (name -> dict), for ``max_concurrency``.

    Returns: ``{"pilot_samples", "datasets": {name: per-dataset figures}, "total": {requests, requests_sent,
        prompt_tokens, prompt_tokens_sent, expected_completion_tokens, usd (None if no price is known), usd_unknown
        (datasets without prices), hours}, "pools"}``; dollars in USD, hours in hours, tokens as counts.

    Raises: :class:`ForecastError` (no pilot answer, an unreadable model list); TemplateError (target tokenizer).
    """
    template = target.get("template")
    per = {}
    for ds, spec in datasets.items():
        t0 = time.monotonic()
        per[ds] = forecast_dataset(ds, spec, target=target, template=template, cache_dir=cache_dir)
        logger.info("%s: %d requests, %s prompt tokens, %s expected completion tokens, $%s, %s (%.1f s)", ds,
                    per[ds]["requests"], per[ds]["prompt_tokens"], per[ds]["expected_completion_tokens"],
                    per[ds]["usd"], format_hours(per[ds]["hours"], 2), time.monotonic() - t0)
    conc = {name: int(b.get("max_concurrency") or 8) for name, b in backends.items()}
    hours, pools = total_hours(list(per.values()), conc)
    hours_remaining, _ = total_hours(list(per.values()), conc, "remaining_work_s")
    known = [d["usd"] for d in per.values() if d["usd"] is not None]
    total = {k: sum(d[k] for d in per.values()) for k in ("requests", "requests_sent", "prompt_tokens",
                                                           "prompt_tokens_sent", "expected_completion_tokens",
                                                           "requests_remaining")}
    total.update({"usd": sum(known) if known else None,
                  "usd_unknown": sorted(d["dataset"] for d in per.values() if d["usd"] is None), "hours": hours,
                  "usd_remaining": sum(d["usd_remaining"] for d in per.values() if d["usd_remaining"] is not None)
                  if known else None, "hours_remaining": hours_remaining})
    fc = {"pilot_samples": int(pilot_samples), "datasets": per, "total": total, "pools": pools}
    write_json(fc, out_json)
    write_text(render_markdown(fc), out_md)
    return fc
