# Stage 3: responses shard -> exact target token ids + loss mask (prompt via the target's chat template).


rule tokenize:
    input:
        responses="results/{ds}/responses/{shard}.parquet",
        target=target_input(),
    output:
        "results/{ds}/tokens/{shard}.parquet",
    wildcard_constraints:
        ds=_alternation(GENERATED),
    params:
        target=TARGET,
    log:
        "logs/tokenize/{ds}/{shard}.log",
    script:
        "../scripts/tokenize.py"
