# Stage 7: DuckDB reports (CSV + Markdown + HTML) and plots (PNG) over the parquet files -> results/reports/.
# Tables (HTML: the report page shows them in the page, a CSV would only be a download) and plots are flagged
# with report() so `snakemake --report report.html` shows them on one self-contained page; captions are in
# report/*.rst. tally.md is printed at the end of a run.


rule report:
    input:
        validated=validated_files(DATASETS),
        rejected=rejected_files(DATASETS),
        responses=responses_files(DATASETS),
        summaries=[f.replace(".parquet", ".json") for f in responses_files(DATASETS)],
    output:
        tally_md="results/reports/tally.md",
        tally_csv="results/reports/tally.csv",
        tally_html=report("results/reports/tally.html", caption="../report/tally.rst", category="1. Tables", labels={"table": "tally"}),
        rejects_md="results/reports/rejects.md",
        rejects_csv="results/reports/rejects.csv",
        rejects_html=report("results/reports/rejects.html", caption="../report/rejects.rst", category="1. Tables", labels={"table": "rejects"}),
        cost_md="results/reports/cost.md",
        cost_csv="results/reports/cost.csv",
        cost_html=report("results/reports/cost.html", caption="../report/cost.rst", category="1. Tables", labels={"table": "cost"}),
        throughput_md="results/reports/throughput.md",
        throughput_csv="results/reports/throughput.csv",
        throughput_html=report("results/reports/throughput.html", caption="../report/throughput.rst", category="1. Tables", labels={"table": "throughput"}),
        limits_md="results/reports/limits.md",
        limits_csv="results/reports/limits.csv",
        limits_html=report("results/reports/limits.html", caption="../report/limits.rst", category="1. Tables", labels={"table": "limits"}),
        audit_md="results/reports/audit.md",
        audit_csv="results/reports/audit.csv",
        audit_html=report("results/reports/audit.html", caption="../report/audit.rst", category="1. Tables", labels={"table": "audit"}),
        lengths_png=report("results/reports/lengths.png", caption="../report/lengths.rst", category="2. Plots", labels={"plot": "lengths"}),
        completion_vs_time_png=report("results/reports/completion_vs_time.png", caption="../report/completion_vs_time.rst", category="2. Plots", labels={"plot": "completion vs time"}),
        cost_over_time_png=report("results/reports/cost_over_time.png", caption="../report/cost_over_time.rst", category="2. Plots", labels={"plot": "cost over time"}),
        rejects_png=report("results/reports/rejects.png", caption="../report/rejects_plot.rst", category="2. Plots", labels={"plot": "rejects"}),
        front="results/reports/front.html",  # tally, cost, rejects on the report page's front (report/workflow.rst)
    params:
        backends={n: {"type": b.get("type"), "base_url": b.get("base_url"), "launch": bool(b.get("launch"))}
                  for n, b in config["backends"].items()},
        datasets=cfg.datasets_data_settings(config),
        generation={ds: cfg.generation_data_settings(config, ds) for ds in GENERATED},
    log:
        "logs/report.log",
    conda:
        "../envs/cpu.yaml",
    script:
        "../scripts/report.py"
