# Stage 6: merged shard -> target auxiliary + final hidden states (safetensors, no padding stored).
# `resources: gpu` caps concurrent extraction: `--resources gpu=8` keeps at most 8 devices busy.


rule extract:
    input:
        merged="results/merged/{k}.parquet",
        target=target_input(),
    output:
        "results/hidden_states/{k}.safetensors",
    params:
        model_path=TARGET["path"],
        settings=config["extract"],
    resources:
        gpu=config["extract"].get("gpus_per_job", 1),
    log:
        "logs/extract/{k}.log",
    script:
        "../scripts/extract.py"
