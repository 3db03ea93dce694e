# Stage 7: DuckDB reports (CSV + Markdown + HTML) and plots (PNG) over the parquet files -> results/reports/.
# Tables (HTML: the report page shows them in the page, a CSV would only be a download) and plots are flagged
# with report() so `snakemake --report report.html` shows them on one self-contained page; captions are in
# report/*.rst. tally.md is printed at the end of a run. The outputs are the one list eagle3_data.report.RULE_OUTPUTS.
from eagle3_data.report import RULE_OUTPUTS


def report_outputs():
    """Rule report's named outputs from RULE_OUTPUTS (files with a caption flagged for `snakemake --report`)."""
    out = {}
    for name, file, caption, category, labels in RULE_OUTPUTS:
        path = f"results/reports/{file}"
        out[name] = report(path, caption=f"../report/{caption}", category=category, labels=labels) if caption else path
    return out


rule report:
    input:
        validated=validated_files(DATASETS),
        rejected=rejected_files(DATASETS),
        responses=responses_files(DATASETS),
        summaries=[f.replace(".parquet", ".json") for f in responses_files(DATASETS)],
    output:
        **report_outputs(),
    log:
        "logs/report.log",
    conda:
        "../envs/cpu.yaml"
    params:
        backends={
            n: {"type": b.get("type"), "base_url": b.get("base_url"), "launch": bool(b.get("launch"))}
            for n, b in config["backends"].items()
        },
        datasets=stage_settings.datasets_data_settings(config),
        # the limits report: generated datasets' budgets; an answers: original dataset has only its sample cap
        generation={
            **{ds: stage_settings.generation_data_settings(config, ds) for ds in GENERATED},
            **{ds: {"max_samples": OriginalAnswersSettings.from_config(config, ds).max_samples} for ds in ORIGINAL},
        },
    script:
        "../scripts/report.py"
