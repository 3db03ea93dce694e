# Stage 4: structural checks + pandera schema; rejects written with reason codes. Pre-tokenized datasets join here.


rule validate:
    input:
        tokens="results/{ds}/tokens/{shard}.parquet",
        target=target_input(),
    output:
        validated="results/{ds}/validated/{shard}.parquet",
        rejected="results/{ds}/rejected/{shard}.parquet",
    params:
        target=cfg.target_data_settings(config),
        settings=cfg.validate_data_settings(config),  # the rest (reject ceilings) is read from the config
    log:
        "logs/validate/{ds}/{shard}.log",
    script:
        "../scripts/validate.py"
