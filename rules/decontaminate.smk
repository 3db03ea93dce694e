# Stage 1b (on when decontaminate.benchmarks lists a file or decontaminate.near_duplicates.enabled): prompts shard ->
# the prompts kept + rejects, before anything is paid for them. benchmark_overlap: a prompt overlapping a benchmark
# item (exact, whitespace-normalised, word n-grams); near_duplicate: a prompt nearly duplicating one of a dataset
# listed before its own (MinHash signatures from rule minhash, datasketch LSH), or with
# near_duplicates.within_dataset one of an earlier source row of its own dataset. Each shard reads only the
# signatures of the datasets before its own, so adding a dataset at the end reruns nothing of the others
# (src/eagle3_data/decontaminate/). Generate and original_answers then read results/{ds}/decontaminated/.


rule minhash:
    input:
        prompts="results/{ds}/prompts/{shard}.parquet",
    output:
        "results/{ds}/minhash/{shard}.parquet",
    log:
        "logs/minhash/{ds}/{shard}.log",
    wildcard_constraints:
        ds=_alternation(PROMPT_DATASETS),
    conda:
        "../envs/cpu.yaml"
    params:
        settings=DECONTAMINATE.signature_params(),  # num_perm, shingle, seed
    script:
        "../scripts/minhash.py"


rule decontaminate:
    input:
        prompts="results/{ds}/prompts/{shard}.parquet",
        benchmarks=benchmark_files(),
        signatures=lambda wc: [f"results/{wc.ds}/minhash/{wc.shard}.parquet"] if DECONTAMINATE.near_on else [],
        earlier=lambda wc: earlier_signatures(wc.ds),
    output:
        prompts="results/{ds}/decontaminated/{shard}.parquet",
        rejects="results/{ds}/rejected/decontaminate/{shard}.parquet",
    log:
        "logs/decontaminate/{ds}/{shard}.log",
    wildcard_constraints:
        ds=_alternation(PROMPT_DATASETS),
    conda:
        "../envs/cpu.yaml"
    # params: the rules in force (DecontaminateSettings.params: the benchmarks' names and formats, the n-gram rule,
    # the near-duplicate threshold and signature keys) and which datasets come before this one
    params:
        settings=DECONTAMINATE.params(),
        earlier=lambda wc: earlier_datasets(wc.ds),
    script:
        "../scripts/decontaminate.py"


rule decontamination_report:
    input:
        kept=decontaminated_files(PROMPT_DATASETS),
        rejected=decontaminate_rejects(PROMPT_DATASETS),
    output:
        md="results/reports/decontamination.md",
        csv="results/reports/decontamination.csv",
    log:
        "logs/decontamination_report.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/decontamination_report.py"
