# Stage 3: responses shard -> exact target token ids + loss mask (prompt via the target's chat template).


rule tokenize:
    input:
        responses="results/{ds}/responses/{shard}.parquet",
        target=target_input(),
    output:
        "results/{ds}/tokens/{shard}.parquet",
    log:
        "logs/tokenize/{ds}/{shard}.log",
    wildcard_constraints:
        ds=_alternation(RESPONDED),
    conda:
        "../envs/cpu.yaml"
    params:
        target=TargetSettings.from_config(config).params(),
        # a dataset's chat_template_kwargs (e.g. thinking off) change the prompt the target saw
        chat_template_kwargs=lambda wc: TokenizeSettings.from_config(config, wc.ds).chat_template_kwargs,
        # the requests' max_tokens: a billed completion count at it means the reply was cut
        max_tokens=lambda wc: TokenizeSettings.from_config(config, wc.ds).max_tokens,
    script:
        "../scripts/tokenize.py"
