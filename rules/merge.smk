# Stage 5: chosen datasets -> deduplicated, length-capped, seeded-shuffled merged shards balanced by tokens,
# plus one selection per validated shard (its kept rows) for extraction. A checkpoint: after it runs, the
# extract jobs are re-evaluated and only those whose selection digest changed run again.


checkpoint merge:
    input:
        validated_files(MERGE_DATASETS),
    output:
        shards=expand("results/merged/{k}.parquet", k=MERGED_SHARDS),
        selections=selection_files(MERGE_DATASETS),
        manifest="results/merged/manifest.json",
    params:
        settings=MERGE.params(),
    threads: MERGE.threads
    resources:
        mem_mb=MERGE.memory_mb,
    log:
        "logs/merge.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/merge.py"
