# Generation forecast before paying (`snakemake forecast`): a pilot of forecast.pilot_samples samples per dataset,
# sent by generate's own code into generate's journal (cache/journal/<ds>/<shard>.jsonl, the same request keys: the
# build answers them from the journal and never pays for them twice), then per dataset and in total the requests,
# prompt tokens (the target's chat template), expected completion tokens, dollars and hours at the configured
# concurrency (eagle3_data.forecast). Not part of the default target: run it before the build.


rule forecast_pilot:
    input:
        prompts="results/{ds}/prompts/{shard}.parquet",
        target=target_input(),
    output:
        responses="results/forecast/pilot/{ds}/{shard}.parquet",
        summary="results/forecast/pilot/{ds}/{shard}.json",
    wildcard_constraints:
        ds=_alternation(GENERATED),
    # as rule generate: what the requests depend on, plus the pilot's size
    params:
        pilot_samples=FORECAST["pilot_samples"],
        target_name=TARGET["name"],
        generation=lambda wc: cfg.generation_data_settings(config, wc.ds),
        backends=lambda wc: cfg.backends_data_settings(config, wc.ds),
        num_shards=lambda wc: len(shards(wc.ds)),
        target=lambda wc: cfg.target_data_settings(config) if any(b.get("native_generate") for b in cfg.backends_config(config, wc.ds).values()) else None,
        target_format={"template": TARGET.get("template", "generic"),
                       "chat_template_kwargs": TARGET.get("chat_template_kwargs") or {}},
    threads: 0
    resources:
        generate_jobs=1,
        **seat_resources(),
        gpu=lambda wc: cfg.launch_gpus(config, wc.ds) if workflow.non_local_exec else 0,
    log:
        "logs/forecast_pilot/{ds}/{shard}.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/forecast.py"


rule forecast:
    input:
        prompts=[f"results/{ds}/prompts/{s}.parquet" for ds in GENERATED for s in shards(ds)],
        pilot=[f"results/forecast/pilot/{ds}/{s}.parquet" for ds in GENERATED for s in shards(ds)],
        pilot_summaries=[f"results/forecast/pilot/{ds}/{s}.json" for ds in GENERATED for s in shards(ds)],
        target=target_input(),
    output:
        md="results/reports/forecast.md",
        json="results/reports/forecast.json",
    params:
        pilot_samples=FORECAST["pilot_samples"],
        target=cfg.target_data_settings(config),
        generation={ds: cfg.generation_data_settings(config, ds) for ds in GENERATED},
        backends={ds: cfg.backends_data_settings(config, ds) for ds in GENERATED},
        prices={name: b.get("price_per_m") for name, b in (config.get("backends") or {}).items()},
        concurrency={name: b.get("max_concurrency") for name, b in (config.get("backends") or {}).items()},
    log:
        "logs/forecast.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../scripts/forecast.py"
