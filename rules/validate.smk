# Stage 4: structural checks + pandera schema; rejects written with reason codes. Pre-tokenized datasets join here.


rule validate:
    input:
        tokens="results/{ds}/tokens/{shard}.parquet",
        target=target_input(),
    output:
        validated="results/{ds}/validated/{shard}.parquet",
        rejected="results/{ds}/rejected/{shard}.parquet",
    params:
        target=TARGET,
        settings=config["validate"],
    log:
        "logs/validate/{ds}/{shard}.log",
    script:
        "../scripts/validate.py"
