"""Rule forecast_pilot's job: one shard's pilot, sent through generate itself (same requests, keys and journal), and
the samples it takes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..generate import generate, read_prompts, shard_share
from ..files import content_hash, write_json

logger = logging.getLogger("eagle3_data.forecast")


def capped_samples(prompts_path, generation, num_shards: int, shard: str) -> tuple[list, list]:
    """The samples of one shard generate will consider, as generate picks them: (samples sorted by ``sample_id``
    and cut to the shard's ``max_samples`` share, unusable rows). ``generation``: the dataset's
    :class:`eagle3_data.settings.GenerationSettings`. Each sample is a :class:`.generate.Sample`."""
    samples, bad = read_prompts(prompts_path, generation.mode)
    samples.sort(key=lambda s: s.sample_id)
    if generation.max_samples is not None:
        samples = samples[: shard_share(int(generation.max_samples), num_shards, shard)]
    return samples, bad


def pilot_sample_ids(prompts_path, generation, *, n: int, num_shards: int, shard: str) -> list[str]:
    """The ids of the pilot samples of one shard: this shard's part of ``n`` (:func:`.generate.shard_share`), the
    samples generate will send with the smallest ``content_hash("pilot", sample_id)`` (a sample unrelated to the
    source order, the same on every run)."""
    samples, _bad = capped_samples(prompts_path, generation, num_shards, shard)
    k = shard_share(int(n), num_shards, shard)
    ranked = sorted(samples, key=lambda s: content_hash("pilot", s.sample_id))
    return sorted(s.sample_id for s in ranked[:k])


def pilot(
    prompts_path,
    out_path,
    settings,
    *,
    n: int,
    shard: str,
    log=None,
    summary_path=None,
    attempts_path=None,
) -> dict:
    """Send one shard's pilot through :func:`.generate.generate` (same requests, keys and journal as the full
    job) and write its RESPONSES parquet to ``out_path``.

    Args:
        settings: the dataset's :class:`eagle3_data.settings.GenerateSettings` (as rule generate's); its budgets
            are not applied to the pilot.
        n: pilot samples for the whole dataset (``forecast.pilot_samples``); this shard sends its share.
        shard, log: as :func:`.generate.generate`'s.
        summary_path: where to write the returned summary as JSON (optional).
        attempts_path: a JSON-lines file (under ``cache_dir``, beside the journal) where each pilot run that sent
            requests appends its attempts and the retries they needed (generate's ``sent``, ``retry_reasons``,
            ``by_backend``): a rerun answered from the journal sends nothing, and what the paid pilot saw of the
            backends' failures is kept for the forecast (``attempts`` in the summary, the sum of its lines).

    Returns: generate's summary, plus ``pilot_samples`` (the ids sent or answered from the journal) and
    ``attempts`` (``{"sent", "retry_reasons", "by_backend"}`` of every pilot run of this shard that sent requests,
    and the latest such run's ``startup_s`` and ``wrapup_s``: see :func:`.generate.generate`).
    Raises: what :func:`.generate.generate` raises.
    """
    ids = pilot_sample_ids(prompts_path, settings.generation, n=n, num_shards=settings.num_shards, shard=shard)
    unbudgeted = settings.replace(
        generation=settings.generation.replace(budget_completion_tokens=None, budget_usd=None)
    )
    logger.info("[%s/%s] pilot: %d sample(s)", settings.dataset, shard, len(ids))
    summary = generate(prompts_path, out_path, unbudgeted, shard=shard, log=log, sample_ids=set(ids))
    out = {**summary, "pilot_samples": ids, "attempts": _attempts(summary, attempts_path)}
    if summary_path is not None:
        write_json(out, summary_path)
    return out


def _attempts(summary: dict, attempts_path) -> dict:
    """This run's attempts (when it sent requests) appended to ``attempts_path``; the sum over every pilot run of
    the shard recorded there (see :func:`pilot`)."""
    this = {
        "sent": int(summary.get("sent") or 0),
        "retry_reasons": dict(summary.get("retry_reasons") or {}),
        "by_backend": dict(summary.get("by_backend") or {}),
        "startup_s": summary.get("startup_s"),
        "wrapup_s": summary.get("wrapup_s"),
    }
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
    return total
