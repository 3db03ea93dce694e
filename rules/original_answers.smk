# Stage 2, for datasets with `answers: original`: prompts shard -> responses shard of the source's own assistant
# answers (the prompt as rule generate would send it, the answer from the source; eagle3_data.original_answers).
# No request, no backend, no journal: tokenize, validate and everything below run on its output unchanged.
from eagle3_data.settings import OriginalAnswersSettings


rule original_answers:
    input:
        prompts=GENERATION_PROMPTS,  # the prompts decontaminate kept when it is on, else normalize's
    output:
        responses="results/{ds}/responses/{shard}.parquet",
        summary="results/{ds}/responses/{shard}.json",
    log:
        "logs/original_answers/{ds}/{shard}.log",
    wildcard_constraints:
        ds=_alternation(ORIGINAL),
    conda:
        "../envs/cpu.yaml"
    # params: what the rows depend on (OriginalAnswersSettings.params): answers, generation.mode (which turns),
    # generation.max_samples and the shard count (which samples), the target's form of history tool-call ids
    params:
        settings=lambda wc: OriginalAnswersSettings.from_config(config, wc.ds).params(),
    script:
        "../scripts/original_answers.py"
