"""Rule forecast's job: every generated dataset's forecast, the simulated time, the totals, written as Markdown
and JSON."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ..formatting import dollars, format_hours, human_tokens
from ..files import write_json, write_text
from .estimate import forecast_dataset
from .markdown import render_markdown
from .simulation import backend_models, job_overhead, simulated_hours

logger = logging.getLogger("eagle3_data.forecast")


def forecast(datasets: dict, out_md, out_json, *, target: dict, pilot_samples: int, cache_dir, backends: dict) -> dict:
    """Write the forecast (``out_md`` Markdown, ``out_json`` JSON) of the generated ``datasets`` and return it.

    Args:
        datasets: name -> ``{prompts: [PROMPTS parquet per shard], pilot: [pilot RESPONSES parquet per shard],
            pilot_summaries: [the pilot jobs' summary JSON files] (optional: default the ``.json`` beside each
            pilot parquet, where it exists), generation: the dataset's ``GenerationSettings``, backends: {name: backend
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
    per, summaries = _datasets_figures(datasets, target=target, cache_dir=cache_dir)
    t0 = time.monotonic()
    models = backend_models(list(per.values()), backends, summaries)
    overhead = job_overhead(summaries)
    full = simulated_hours(list(per.values()), models, "requests", overhead["job_s"])
    rest = simulated_hours(list(per.values()), models, "remaining", overhead["job_s"])
    _add_simulated(per, models, full, rest)
    logger.info(
        "simulated the generation %d + %d times (%.1f s): %s (p10 %s, p90 %s); what the pilot left: %s",
        full["runs"],
        rest["runs"],
        time.monotonic() - t0,
        format_hours(full["hours"], 2),
        format_hours(full["hours_p10"], 2),
        format_hours(full["hours_p90"], 2),
        format_hours(rest["hours"], 2),
    )
    total = _totals(per, full, rest)
    fc = {
        "pilot_samples": int(pilot_samples),
        "datasets": per,
        "total": total,
        "backends": models,
        "simulation": {"runs": full["runs"], "runs_remaining": rest["runs"], **overhead},
    }
    write_json(fc, out_json)
    write_text(render_markdown(fc), out_md)
    return fc


def _datasets_figures(datasets: dict, *, target: dict, cache_dir) -> tuple[dict, list[dict]]:
    """Each dataset's figures (:func:`forecast_dataset`, logged) and the pilot jobs' summaries."""
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
        logger.info(
            "%s: %d requests, %s prompt tokens, %s expected completion tokens, %s (%.1f s)",
            ds,
            per[ds]["requests"],
            human_tokens(per[ds]["prompt_tokens"]),
            human_tokens(round(per[ds]["expected_completion_tokens"])),
            dollars(per[ds]["usd"]),
            time.monotonic() - t0,
        )
    return per, summaries


def _add_simulated(per: dict, models: dict, full: dict, rest: dict) -> None:
    """The simulated hours and work (whole generation, what the pilot left) into each dataset's and backend's
    figures; the datasets' pilot internals dropped."""
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


def _totals(per: dict, full: dict, rest: dict) -> dict:
    """The forecast's ``total``: counts summed over the datasets, dollars (None when no price is known) and the
    simulated hours with their p10/p90."""
    known = [d["usd"] for d in per.values() if d["usd"] is not None]
    total = {
        k: sum(d[k] for d in per.values())
        for k in (
            "requests",
            "requests_sent",
            "prompt_tokens",
            "prompt_tokens_sent",
            "expected_completion_tokens",
            "requests_remaining",
        )
    }
    total.update(
        {
            "usd": sum(known) if known else None,
            "usd_unknown": sorted(d["dataset"] for d in per.values() if d["usd"] is None),
            "hours": full["hours"],
            "hours_p10": full["hours_p10"],
            "hours_p90": full["hours_p90"],
            "usd_remaining": sum(d["usd_remaining"] for d in per.values() if d["usd_remaining"] is not None)
            if known
            else None,
            "hours_remaining": rest["hours"],
            "hours_remaining_p10": rest["hours_p10"],
            "hours_remaining_p90": rest["hours_p90"],
        }
    )
    return total
