# Stage 4: structural checks + pandera schema; rejects written with reason codes. Pre-tokenized datasets join here.


rule validate:
    input:
        tokens="results/{ds}/tokens/{shard}.parquet",
        target=target_input(),
    output:
        validated="results/{ds}/validated/{shard}.parquet",
        rejected="results/{ds}/rejected/{shard}.parquet",
    log:
        "logs/validate/{ds}/{shard}.log",
    wildcard_constraints:
        ds=_alternation(RESPONDED),
    conda:
        "../envs/cpu.yaml"
    params:
        target=VALIDATE.target.params(),
        settings=VALIDATE.params(),  # the rest (reject ceilings) only fails the job: not a param
    script:
        "../scripts/validate.py"


# Pre-tokenized datasets (normalize writes their tokens shards) are validated the same way under their own rule
# name: the report's rule graph draws one node per rule and DAG depth, and these jobs sit two levels above the
# generated datasets' (no generate/tokenize before them), so a single rule was drawn twice.
use rule validate as validate_pretokenized with:
    wildcard_constraints:
        ds=_alternation(PRETOKENIZED),
