# Per-row provenance of the merged set: results/merged/provenance.parquet, one row per merged row (training shards,
# then the held-out set) with its source file and row, the target's fingerprint and chat-template hash, the backend,
# engine and version, the reply's model and provider, the sampling settings, request key (the journal record),
# generation id, cost and attempts; and results/reports/provenance.json (config digest, package versions, the
# repository's commit). The exports' side tables take their columns from it (src/eagle3_data/provenance.py).


rule provenance:
    input:
        merged=expand("results/merged/{k}.parquet", k=MERGED_SHARDS),
        heldout=heldout_merged(),
        responses=responses_files(MERGE_DATASETS),
        prompts=prompts_files(MERGE_DATASETS),
        benchmarks=benchmark_files(),
        target=target_input(),
    output:
        table="results/merged/provenance.parquet",
        json="results/reports/provenance.json",
    log:
        "logs/provenance.log",
    conda:
        "../envs/cpu.yaml"
    params:
        datasets=provenance_datasets(),
        backends=provenance_backends(),
        decontaminate=DECONTAMINATE.params(),
    script:
        "../scripts/provenance.py"
