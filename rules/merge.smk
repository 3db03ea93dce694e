# Stage 5: chosen datasets -> deduplicated, length-capped, seeded-shuffled merged shards balanced by tokens,
# plus one selection per validated shard (its kept rows) for extraction. A checkpoint: after it runs, the
# extract jobs are re-evaluated and only those whose selection digest changed run again. With merge.heldout > 0
# the held-out set (never in the training shards) is one more output, results/merged/heldout.parquet; its rows
# stay in the selections, so the held-out share changes no extraction (src/eagle3_data/merge/__init__.py). The
# split goes by each prompt's normalized text (the prompt_key of its prompts row): copies of a prompt never straddle it.


checkpoint merge:
    input:
        validated=validated_files(MERGE_DATASETS),
        prompts=heldout_prompt_files(),
    output:
        **heldout_merged_output(),
        shards=expand("results/merged/{k}.parquet", k=MERGED_SHARDS),
        selections=selection_files(MERGE_DATASETS),
        manifest="results/merged/manifest.json",
    log:
        "logs/merge.log",
    conda:
        "../envs/cpu.yaml"
    threads: MERGE.threads
    resources:
        mem_mb=MERGE.memory_mb,
    params:
        settings=MERGE.params(),
    script:
        "../scripts/merge.py"
