# Generation forecast before paying (`snakemake forecast`): a pilot of forecast.pilot_samples samples per dataset,
# sent by generate's own code into generate's journal (cache/journal/<ds>/<shard>.jsonl, the same request keys: the
# build answers them from the journal and never pays for them twice), then per dataset and in total the requests,
# prompt tokens (the target's chat template), expected completion tokens, dollars and hours at the configured
# concurrency (eagle3_data.forecast). Not part of the default target: run it before the build.


# the pilot: rule generate (its inputs, params, resources, script) with its own outputs and log, plus the pilot's size
use rule generate as forecast_pilot with:
    output:
        responses="results/forecast/pilot/{ds}/{shard}.parquet",
        summary="results/forecast/pilot/{ds}/{shard}.json",
    log:
        "logs/forecast_pilot/{ds}/{shard}.log",
    params:
        pilot_samples=FORECAST["pilot_samples"],


rule forecast:
    input:
        prompts=generation_prompts(GENERATED),
        pilot=[f"results/forecast/pilot/{ds}/{s}.parquet" for ds in GENERATED for s in shards(ds)],
        pilot_summaries=[f"results/forecast/pilot/{ds}/{s}.json" for ds in GENERATED for s in shards(ds)],
        target=target_input(),
    output:
        md="results/reports/forecast.md",
        json="results/reports/forecast.json",
    log:
        "logs/forecast.log",
    conda:
        "../envs/cpu.yaml"
    params:
        pilot_samples=FORECAST["pilot_samples"],
        target=TargetSettings.from_config(config).params(),
        generation={ds: generate_settings(ds).params()["generation"] for ds in GENERATED},
        backends={ds: generate_settings(ds).params()["backends"] for ds in GENERATED},
        prices={name: b.get("price_per_m") for name, b in (config.get("backends") or {}).items()},
        concurrency={name: b.get("max_concurrency") for name, b in (config.get("backends") or {}).items()},
    script:
        "../scripts/forecast.py"
