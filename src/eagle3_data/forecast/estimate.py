"""The forecast of one dataset: its requests and prompt tokens, and the tokens, dollars and latencies its pilot
implies."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from ..images import TargetImages, image_parts
from ..settings import backend_settings
from ..templates import TemplateError, request_messages, target_tokens
from .errors import ForecastError
from .fits import expected_longest, latency_fit, length_model
from .pilot_job import capped_samples
from .prices import backend_prices


def _prompt_lengths(tt, prompts: list[tuple[list, list | None]], images=None) -> tuple[list[int], int]:
    """Token counts of each (messages, tools) prompt rendered with the target's template, each image counted as
    the positions the target's processor gives it (``images``: :class:`eagle3_data.images.TargetImages`, from
    the image's size; ``None``: one placeholder per image); unrenderable prompts count 0 and are counted (they
    are sent, and rejected at tokenize)."""
    texts, failed, extra = [], 0, []
    for messages, tools in prompts:
        try:
            texts.append(tt.render(messages, tools, True))
        except TemplateError:
            texts.append("")
            failed += 1
        pics = image_parts(messages) if images is not None else []
        extra.append(sum(images.count_for_size(p["image"]["width"], p["image"]["height"]) - 1 for p in pics))
    lens = [len(x) + e for x, e in zip(tt.encode_texts(texts), extra)] if texts else []
    return lens, failed


def _target_images(target: dict, prompts: list[tuple[list, list | None]]):
    """The target's image processor when some prompt holds images and the target has one, else None (a text
    target's image prompts are rejected at tokenize: ``image_prompt_text_target``)."""
    if not any(image_parts(m) for m, _ in prompts):
        return None
    try:
        return TargetImages.load(target["path"])
    except (ValueError, OSError, KeyError):
        return None


def _dataset_requests(prompts_paths: list, generation, num_shards: int, template: str | None):
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
    cols = [
        "sample_id",
        "status",
        "messages",
        "tools",
        "prompt_tokens",
        "completion_tokens",
        "cost_usd",
        "latency_s",
        "backend",
    ]
    rows: list[dict] = []
    for p in paths:
        rows += [{**r, "shard": Path(p).stem} for r in pq.ParquetFile(p).read(columns=cols).to_pylist()]
    return rows


def forecast_dataset(ds: str, spec: dict, *, target: dict, template: str | None, cache_dir) -> dict:
    """The forecast of one dataset (see the module docstring); ``spec`` = ``{prompts: [paths], pilot: [paths],
    generation (:class:`eagle3_data.settings.GenerationSettings`), backends: {name: cfg} (priority order, the
    schema's defaults filled: :func:`eagle3_data.settings.backend_settings`), num_shards}``. Raises :class:`ForecastError` when no pilot
    request was answered."""
    gen = spec["generation"]
    backends = spec["backends"]
    tt = target_tokens(target, (gen.extra_body or {}).get("chat_template_kwargs"))
    prompts, n_samples, n_bad, per_shard = _dataset_requests(spec["prompts"], gen, spec["num_shards"], template)
    images = _target_images(target, prompts)
    lens, unrenderable = _prompt_lengths(tt, prompts, images)
    rows = _pilot_rows(spec["pilot"])
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise ForecastError(
            f"dataset {ds}: no pilot request was answered ({len(rows)} failed; see "
            f"logs/forecast_pilot/{ds}/): nothing to forecast from"
        )
    pilot_lens, _ = _prompt_lengths(
        tt, [(json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None) for r in ok], images
    )
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
    bt, bu = gen.budget_completion_tokens, gen.budget_usd
    if bt is not None and completion > float(bt):
        frac, stopped_by = float(bt) / completion, "budget_completion_tokens"
    if bu is not None and usd is not None and usd * frac > float(bu):
        frac, stopped_by = float(bu) / usd, "budget_usd"
    a, b = latency_fit([(c, float(r["latency_s"])) for c, r in zip(comp, ok) if r["latency_s"] is not None])
    sent = requests * frac
    remaining = max(0.0, sent - n_ok)  # the pilot's answered requests are journaled: the build doesn't send them
    longest = expected_longest(comp, sent, gen.max_tokens)
    tail_s = a + b * longest
    conc = sum(int(backend_settings(c)["max_concurrency"]) for c in backends.values())
    ok_by_shard: dict[str, int] = {}
    for r in ok:
        ok_by_shard[r["shard"]] = ok_by_shard.get(r["shard"], 0) + 1
    # the jobs of the simulation: each shard's requests (scaled to the budget) and what the pilot left of them
    shard_jobs = [
        {"shard": sh, "requests": round(n * frac), "remaining": max(0, round(n * frac) - ok_by_shard.get(sh, 0))}
        for sh, n in sorted(per_shard.items())
    ]
    return {
        "dataset": ds,
        "samples": n_samples,
        "unusable": n_bad,
        "requests": requests,
        "requests_sent": round(sent),
        "stopped_by": stopped_by,
        "prompt_tokens": int(sum(lens)),  # image positions included (the target's processor)
        "prompt_tokens_sent": round(sum(lens) * frac),
        "images": sum(len(image_parts(m)) for m, _ in prompts),
        "unrenderable_prompts": unrenderable,
        "completion_tokens_per_request": round(mean_comp, 1),
        "expected_completion_tokens": round(completion * frac),
        "cost_per_request_usd": cost_per_request,
        "usd": None if usd is None else usd * frac,
        "cost_source": ", ".join(sorted(sources)) if usd is not None else None,
        "missing_prices": sorted(n for n, p in prices.items() if p is None),
        "latency_a_s": round(a, 4),
        "latency_b_s_per_token": b,
        "tail_s": tail_s,
        "longest_tokens": round(longest),
        "length_model": length_model(comp, gen.max_tokens),
        "concurrency": conc,
        "backends": list(backends),
        "shards": shard_jobs,
        "retry": {
            "max_retries": int(gen.max_retries),
            "retry_initial_s": float(gen.retry_initial_s),
            "retry_max_s": float(gen.retry_max_s),
        },
        "requests_remaining": round(remaining),
        # what the pilot left, at the mean cost per request: exactly 0.0 when nothing is left (usd x frac - the
        # pilot's dollars is the same sum, but leaves float noise such as 6.9e-18 where the two are equal)
        "usd_remaining": None if usd is None else remaining * cost_per_request,
        "pilot": {
            "requests": len(rows),
            "samples": len({r["sample_id"] for r in rows}),  # sent (or answered from the journal)
            "ok": n_ok,
            "failed": len(rows) - n_ok,
            "completion_tokens": sum(comp),
            "prompt_tokens": int(sum(pilot_lens)),
            "billed_prompt_tokens": sum(int(r["prompt_tokens"] or 0) for r in ok),
            "cost_usd": sum(known) if known else None,
            "latency_s_mean": sum(float(r["latency_s"] or 0) for r in ok) / n_ok,
            "latency_s_max": max(float(r["latency_s"] or 0) for r in ok),
        },
        "_pilot_ok": ok,
        "_pilot_lengths": comp,  # for the backends' fits and the simulation (not written)
    }
