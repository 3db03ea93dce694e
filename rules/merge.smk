# Stage 5: chosen datasets -> deduplicated, length-capped, seeded-shuffled merged shards balanced by tokens.


rule merge:
    input:
        validated_files(MERGE_DATASETS),
    output:
        shards=expand("results/merged/{k}.parquet", k=MERGED_SHARDS),
        manifest="results/merged/manifest.json",
    params:
        settings=config["merge"],
    log:
        "logs/merge.log",
    script:
        "../scripts/merge.py"
