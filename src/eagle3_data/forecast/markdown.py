"""The forecast as Markdown (``results/reports/forecast.md``)."""

from __future__ import annotations

from ..formatting import format_hours, format_usd
from ..report import markdown_table


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
                "usd_s": format_usd(d["usd"]) if d["usd"] is not None else "unknown",
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
            "usd_s": (format_usd(t["usd"]) if t["usd"] is not None else "unknown")
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
        f"From a pilot of {fc['pilot_samples']} sample(s) per dataset (journaled: the build answers them from the "
        "journal and does not pay for them again). Prompt tokens: every request's prompt rendered with the "
        "target's chat template; completion tokens and dollars: requests x the pilot's mean per answered request; "
        "time: the mean of simulated runs at each backend's `max_concurrency` (in brackets: 10th to 90th "
        'percentile; "Done after": when a dataset\'s last request ends, all datasets running together).',
        "",
        markdown_table(rows, cols, bold=lambda r: r.get("total", False)),
        "",
        f"Already paid by the pilot: the build sends {t['requests_remaining']:,} more request(s), for "
        + (f"${format_usd(t['usd_remaining'])}" if t["usd_remaining"] is not None else "unknown dollars")
        + f" in {span(t['hours_remaining'], t['hours_remaining_p10'], t['hours_remaining_p90'])}.",
        "",
        "## Pilot",
        "",
        markdown_table(
            [
                {
                    "dataset": d["dataset"],
                    **d["pilot"],
                    "cost": format_usd(d["pilot"]["cost_usd"]) if d["pilot"]["cost_usd"] is not None else "",
                    "per": d["completion_tokens_per_request"],
                    "longest": d["longest_tokens"],
                    "fit": f"{d['latency_a_s']:.2f} s + {1000 * d['latency_b_s_per_token']:.3f} ms/token",
                    "src": d["cost_source"]
                    or "unknown: set backends." + "/".join(d["missing_prices"] or ["<name>"]) + ".price_per_m",
                }
                for d in fc["datasets"].values()
            ],
            [
                ("dataset", "Dataset", "text"),
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
                    "fit": f"{m['a']:.2f} s + {1000 * m['b']:.3f} ms/token",
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
