# Stage 7: DuckDB tallies over the parquet files -> results/reports/ (printed at the end of a run).


rule report:
    input:
        validated=validated_files(DATASETS),
        rejected=rejected_files(DATASETS),
        responses=responses_files(DATASETS),
    output:
        tally_md="results/reports/tally.md",
        tally_csv="results/reports/tally.csv",
        rejects_csv="results/reports/rejects.csv",
    params:
        backends=config["backends"],
        datasets=config["datasets"],
    log:
        "logs/report.log",
    script:
        "../scripts/report.py"
