# Stage 2: prompts shard -> responses shard, through the dataset's backends (OpenAI-compatible HTTP).
# Completed responses are journaled under cache/ (outside results/), keyed by a hash of the request, so a
# failed, killed or deleted target never pays for the same response twice.
# A backend's max_concurrency holds over all generate jobs on one machine, of every run (shared request slots), so
# every shard can be in flight at once; a launched server is started once per run and shared by every job that
# needs it (eagle3_data.run, eagle3_data.backends.server).


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
    # an HTTP client waiting on its backends: it takes no core from --cores, so CPU stages keep running beside
    # it; how many run at once is the `generate_jobs` resource (profiles/default: 32; the run gives each a worker,
    # eagle3_data.run.widen_local_workers), shared out over the backends in use (seat_resources, rules/common.smk)
    threads: 0
    resources:
        generate_jobs=1,
        **seat_resources(),
        # a cluster job starts its own server for a launched backend: it asks for the server's GPUs (sbatch --gpus).
        # Locally the run's one server holds its GPUs through the per-GPU locks (eagle3_data.devices) instead.
        gpu=lambda wc: cfg.launch_gpus(config, wc.ds) if workflow.non_local_exec else 0,
    log:
        "logs/generate/{ds}/{shard}.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/generate.py"
