"""The forecast as Markdown (``results/reports/forecast.md``)."""

from __future__ import annotations

from ..formatting import format_hours
from ..report import markdown_table


def forecast_usd(v: float | None, *, sign: bool = True) -> str:
    """A forecast's dollars ``v`` (USD) in cents: ``"$1,234.50"``, ``"$0.00"`` for zero or less (a forecast
    has no negative cost), ``"under $0.01"`` for a positive amount below half a cent (it would round to
    ``$0.00``); ``"unknown"`` for None. ``sign=False`` leaves out the ``$`` (table cells under "Cost $")."""
    if v is None:
        return "unknown"
    cur = "$" if sign else ""
    if v <= 0:
        return f"{cur}0.00"
    if v < 0.005:
        return f"under {cur}0.01" if sign else "< 0.01"
    return f"{cur}{v:,.2f}"


def pilot_sentence(fc: dict) -> str:
    """What the pilot sent, for the head of the forecast: ``"From a pilot of 50 samples per dataset"`` when every
    dataset's pilot sent ``fc["pilot_samples"]`` samples, else the size planned and what each dataset sent:
    ``"From a pilot of 50 samples per dataset planned; sent: sharegpt 35 (all it sends), ultrachat 28 (all it
    sends), swe 50"`` ("all it sends": the dataset has no more samples for the build to send). ``fc``:
    :func:`eagle3_data.forecast.forecast`'s result (each dataset's ``samples`` and ``pilot.samples``)."""
    planned = int(fc["pilot_samples"])
    head = f"From a pilot of {planned:,} {'sample' if planned == 1 else 'samples'}"
    if len(fc["datasets"]) > 1:
        head += " per dataset"
    sent = {ds: int(d["pilot"]["samples"]) for ds, d in fc["datasets"].items()}
    if all(n == planned for n in sent.values()):
        return head
    parts = [
        f"{ds} {n:,}" + (" (all it sends)" if n < planned and n == fc["datasets"][ds]["samples"] else "")
        for ds, n in sent.items()
    ]
    return f"{head} planned; sent: {', '.join(parts)}"


def _latency(a: float, b: float) -> str:
    """A latency fit ``a + b x tokens`` (seconds, seconds per token): ``"0.12 s + 1.950 ms/token"``; an
    intercept that rounds to zero reads ``0.00``, never ``-0.00``."""
    return f"{round(a, 2) + 0.0:.2f} s + {round(1000 * b, 3) + 0.0:.3f} ms/token"


def _remaining(t: dict, span) -> str:
    """The line on what the build sends after the pilot: requests, dollars and time, or that it sends none."""
    if not t["requests_remaining"]:
        return "The pilot sent every request: the build sends none, and pays nothing more for generation."
    usd = forecast_usd(t["usd_remaining"]) if t["usd_remaining"] is not None else "unknown dollars"
    return (
        f"Already paid by the pilot: the build sends {t['requests_remaining']:,} more request(s), for {usd} in "
        f"{span(t['hours_remaining'], t['hours_remaining_p10'], t['hours_remaining_p90'])}."
    )


def render_markdown(fc: dict) -> str:
    """The forecast as Markdown: per-dataset table with the total, the pilot, the backends and the method."""
    t = fc["total"]

    def span(h, lo, hi) -> str:
        return f"{format_hours(h, 2)} ({format_hours(lo, 2)} to {format_hours(hi, 2)})"

    rows = []
    for d in fc["datasets"].values():
        rows.append(
            {
                **d,
                "usd_s": forecast_usd(d["usd"], sign=False),
                "time": format_hours(d["hours"], 2),
                "stop": d["stopped_by"] or "",
            }
        )
    rows.append(
        {
            "dataset": "Total",
            "requests": t["requests"],
            "requests_sent": t["requests_sent"],
            "prompt_tokens_sent": t["prompt_tokens_sent"],
            "expected_completion_tokens": t["expected_completion_tokens"],
            "usd_s": forecast_usd(t["usd"], sign=False)
            + (" (+ unknown)" if t["usd"] is not None and t["usd_unknown"] else ""),
            "time": span(t["hours"], t["hours_p10"], t["hours_p90"]),
            "stop": "",
            "total": True,
        }
    )
    cols = [
        ("dataset", "Dataset", "text"),
        ("requests", "Requests", ""),
        ("requests_sent", "Sent", ""),
        ("prompt_tokens_sent", "Prompt tokens", "tok"),
        ("expected_completion_tokens", "Completion tokens", "tok"),
        ("usd_s", "Cost $", "text"),
        ("time", "Done after", "text"),
        ("stop", "Budget stop", "text"),
    ]
    sim = fc.get("simulation") or {}
    lines = [
        "# Generation forecast",
        "",
        f"{pilot_sentence(fc)}. The pilot is journaled: the build answers its samples from the journal and does "
        "not pay for them again. Prompt tokens: every request's prompt rendered with the "
        "target's chat template; completion tokens and dollars: requests x the pilot's mean per answered request; "
        "time: the mean of simulated runs at each backend's `max_concurrency` (in brackets: 10th to 90th "
        'percentile; "Done after": when a dataset\'s last request ends, all datasets running together).',
        "",
        markdown_table(rows, cols, bold=lambda r: r.get("total", False)),
        "",
        _remaining(t, span),
        "",
        "## Pilot",
        "",
        markdown_table(
            [
                {
                    "dataset": d["dataset"],
                    **d["pilot"],
                    "cost": "" if d["pilot"]["cost_usd"] is None else forecast_usd(d["pilot"]["cost_usd"], sign=False),
                    "per": d["completion_tokens_per_request"],
                    "longest": d["longest_tokens"],
                    "fit": _latency(d["latency_a_s"], d["latency_b_s_per_token"]),
                    "src": d["cost_source"]
                    or "unknown: set backends." + "/".join(d["missing_prices"] or ["<name>"]) + ".price_per_m",
                }
                for d in fc["datasets"].values()
            ],
            [
                ("dataset", "Dataset", "text"),
                ("samples", "Samples", ""),
                ("requests", "Requests", ""),
                ("failed", "Failed", ""),
                ("per", "Completion tok / request", ""),
                ("longest", "Longest expected (tok)", ""),
                ("cost", "Cost $", "text"),
                ("fit", "Latency", "text"),
                ("latency_s_max", "Longest (s)", ""),
                ("src", "Prices", "text"),
            ],
        ),
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
        markdown_table(
            [
                {
                    "backend": name,
                    "concurrency": m["concurrency"],
                    "pilot": m["pilot_responses"],
                    "fit": _latency(m["a"], m["b"]),
                    "rl": f"{100 * m['p_rate_limit']:.1f} %",
                    "fault": f"{100 * m['p_fault']:.1f} %",
                    "work": f"{m['busy_s']:,.0f}",
                    "limit": format_hours(m["busy_s"] / max(1, m["concurrency"]) / 3600, 2),
                }
                for name, m in fc["backends"].items()
            ],
            [
                ("backend", "Backend", "text"),
                ("concurrency", "Concurrency", ""),
                ("pilot", "Pilot responses", ""),
                ("fit", "Latency", "text"),
                ("rl", "Rate-limited", "text"),
                ("fault", "Failed", "text"),
                ("work", "Work (request-s)", "text"),
                ("limit", "Work at the limit", "text"),
            ],
        ),
        "",
    ]
    return "\n".join(lines)
