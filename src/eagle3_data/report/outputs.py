"""What the report stage writes: the columns of each CSV and the outputs of rule report (one list)."""

from __future__ import annotations


TALLY_COLUMNS = [
    "dataset",
    "kind",
    "samples",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "source",
    "backends",
    "rejected",
    "responses_ok",
    "responses_failed",
    "cost_usd",
]
REJECT_COLUMNS = ["dataset", "stage", "reason", "count", "example"]
COST_COLUMNS = [
    "dataset",
    "backend",
    "provider",
    "level",
    "responses_ok",
    "responses_failed",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cost_usd",
    "usd_per_m_completion_tokens",
    "usd_per_m_tokens",
]
THROUGHPUT_COLUMNS = [
    "bucket_start_utc",
    "minutes_from_start",
    "responses_ok",
    "responses_failed",
    "completion_tokens",
    "completion_tokens_per_min",
    "cost_usd",
    "cumulative_completion_tokens",
    "cumulative_cost_usd",
    "mean_completion_tokens",
    "cumulative_mean_completion_tokens",
]
LIMIT_COLUMNS = [
    "dataset",
    "ended_by",
    "evidence",
    "shards",
    "shards_reported",
    "samples_ok",
    "responses_failed",
    "not_sent",
    "over_max_samples",
    "max_samples",
    "completion_tokens",
    "budget_completion_tokens",
    "cost_usd",
    "budget_usd",
]
AUDIT_COLUMNS = [
    "dataset",
    "ids_source",
    "level",
    "samples",
    "completion_billed_samples",
    "completion_tokens",
    "billed_completion_tokens",
    "completion_rel",
    "completion_equal_samples",
    "prompt_billed_samples",
    "prompt_tokens",
    "billed_prompt_tokens",
    "prompt_rel",
    "prompt_equal_samples",
    "prompt_diff_median",
    "prompt_diff_min",
    "prompt_diff_max",
]
#: every output of rule report, the one list (rules/report.smk makes the rule's outputs from it): (rule output
#: name, file name under results/reports/, caption file under report/ or None, report category, labels); a file
#: with a caption is flagged with Snakemake's report() and shown on the `snakemake --report` page
REPORT_STEMS = ("tally", "rejects", "cost", "throughput", "limits", "audit")
PLOT_STEMS = {
    "lengths": ("lengths", "lengths"),
    "completion_vs_time": ("completion_vs_time", "completion vs time"),
    "cost_over_time": ("cost_over_time", "cost over time"),
    "rejects": ("rejects_plot", "rejects"),
}
RULE_OUTPUTS: list[tuple[str, str, str | None, str | None, dict | None]] = [
    *[
        (
            f"{stem}_{ext}",
            f"{stem}.{ext}",
            *((f"{stem}.rst", "1. Tables", {"table": stem}) if ext == "html" else (None, None, None)),
        )
        for stem in REPORT_STEMS
        for ext in ("md", "csv", "html")
    ],
    *[
        (f"{stem}_png", f"{stem}.png", f"{caption}.rst", "2. Plots", {"plot": label})
        for stem, (caption, label) in PLOT_STEMS.items()
    ],
    ("front", "front.html", None, None, None),  # tally, cost, rejects on the report page's front (report/workflow.rst)
]
#: every file :func:`write_reports` writes into its ``out_dir`` (the plots are :func:`eagle3_data.report.plots.write_plots`'s)
REPORT_FILES = [file for _, file, *_ in RULE_OUTPUTS if not file.endswith(".png")]
