# Stage 7: DuckDB reports (Markdown + CSV) and plots (PNG) over the parquet files -> results/reports/.
# Tables (CSV) and plots are flagged with report() so `snakemake --report report.html` shows them on one
# self-contained page; captions are in report/*.rst. tally.md is printed at the end of a run.


rule report:
    input:
        validated=validated_files(DATASETS),
        rejected=rejected_files(DATASETS),
        responses=responses_files(DATASETS),
        summaries=[f.replace(".parquet", ".json") for f in responses_files(DATASETS)],
    output:
        tally_md="results/reports/tally.md",
        tally_csv=report("results/reports/tally.csv", caption="../report/tally.rst", category="1. Tables", labels={"table": "tally"}),
        rejects_md="results/reports/rejects.md",
        rejects_csv=report("results/reports/rejects.csv", caption="../report/rejects.rst", category="1. Tables", labels={"table": "rejects"}),
        cost_md="results/reports/cost.md",
        cost_csv=report("results/reports/cost.csv", caption="../report/cost.rst", category="1. Tables", labels={"table": "cost"}),
        throughput_md="results/reports/throughput.md",
        throughput_csv=report("results/reports/throughput.csv", caption="../report/throughput.rst", category="1. Tables", labels={"table": "throughput"}),
        limits_md="results/reports/limits.md",
        limits_csv=report("results/reports/limits.csv", caption="../report/limits.rst", category="1. Tables", labels={"table": "limits"}),
        audit_md="results/reports/audit.md",
        audit_csv=report("results/reports/audit.csv", caption="../report/audit.rst", category="1. Tables", labels={"table": "audit"}),
        lengths_png=report("results/reports/lengths.png", caption="../report/lengths.rst", category="2. Plots", labels={"plot": "lengths"}),
        completion_vs_time_png=report("results/reports/completion_vs_time.png", caption="../report/completion_vs_time.rst", category="2. Plots", labels={"plot": "completion vs time"}),
        cost_over_time_png=report("results/reports/cost_over_time.png", caption="../report/cost_over_time.rst", category="2. Plots", labels={"plot": "cost over time"}),
        rejects_png=report("results/reports/rejects.png", caption="../report/rejects_plot.rst", category="2. Plots", labels={"plot": "rejects"}),
    params:
        backends={n: {"type": b.get("type"), "base_url": b.get("base_url"), "launch": bool(b.get("launch"))}
                  for n, b in config["backends"].items()},
        datasets=cfg.datasets_data_settings(config),
        generation={ds: cfg.generation_data_settings(config, ds) for ds in GENERATED},
    log:
        "logs/report.log",
    script:
        "../scripts/report.py"
