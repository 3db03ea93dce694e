# Stage 2: prompts shard -> responses shard, through the dataset's backends (OpenAI-compatible HTTP).
# Completed responses are journaled under cache/ (outside results/), keyed by a hash of the request, so a
# failed, killed or deleted target never pays for the same response twice.


rule generate:
    input:
        prompts="results/{ds}/prompts/{shard}.parquet",
        target=target_input(),
    output:
        responses="results/{ds}/responses/{shard}.parquet",
        summary="results/{ds}/responses/{shard}.json",
    wildcard_constraints:
        ds=_alternation(GENERATED),
    # params: what the responses depend on (cfg.generation_data_settings / backends_data_settings); the
    # script reads the rest (concurrency, timeouts, rate limits, headers, key variables, launch, retries)
    # from the config at run time, so changing those reruns nothing
    params:
        target_name=TARGET["name"],
        generation=lambda wc: cfg.generation_data_settings(config, wc.ds),
        backends=lambda wc: cfg.backends_data_settings(config, wc.ds),
        num_shards=lambda wc: len(shards(wc.ds)),
        # the target tokenizer renders prompt ids only for SGLang's native /generate; otherwise the target
        # config is not a dependency of generation
        target=lambda wc: cfg.target_data_settings(config) if any(b.get("native_generate") for b in cfg.backends_config(config, wc.ds).values()) else None,
        # the target's family: Kimi history tool-call ids, empty reasoning on tool-call turns of thinking targets
        target_format={"template": TARGET.get("template", "generic"),
                       "chat_template_kwargs": TARGET.get("chat_template_kwargs") or {}},
    resources:
        api_slots=lambda wc: sum(b.get("max_concurrency", 1) for b in cfg.backends_config(config, wc.ds).values()),
    log:
        "logs/generate/{ds}/{shard}.log",
    script:
        "../scripts/generate.py"
