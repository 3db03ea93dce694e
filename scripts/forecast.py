"""Rules forecast_pilot (one shard's pilot, through generate: journaled) and forecast (the forecast report)."""
from eagle3_data import config as cfg
from eagle3_data.backends.limits import jobs_using
from eagle3_data.errors import run_stage
from eagle3_data.forecast import forecast, pilot
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
conf = snakemake.config
journal_dir = f"{conf.get('cache_dir', 'cache')}/journal"
p = snakemake.params

if snakemake.rule == "forecast_pilot":
    ds = snakemake.wildcards.ds
    backends = cfg.backends_config(conf, ds)  # the whole settings at run time, as rule generate reads them
    run_stage(lambda: pilot(
        snakemake.input.prompts,
        snakemake.output.responses,
        n=p.pilot_samples,
        dataset=ds,
        shard=snakemake.wildcards.shard,
        generation=cfg.generation_config(conf, ds),
        num_shards=p.num_shards,
        target_name=p.target_name,
        backends=backends,
        backend_jobs={name: jobs_using(conf, name) for name in backends},
        journal_dir=journal_dir,
        summary_path=snakemake.output.summary,
        attempts_path=f"{conf.get('cache_dir', 'cache')}/forecast/pilot/{ds}/{snakemake.wildcards.shard}.jsonl",
        target=p.target,
        target_format=p.target_format,
        log=log,
    ), log=log)
else:
    gen = cfg.generated_datasets(conf)
    datasets = {ds: {"prompts": [f for f in snakemake.input.prompts if f.startswith(f"results/{ds}/prompts/")],
                     "pilot": [f for f in snakemake.input.pilot if f.startswith(f"results/forecast/pilot/{ds}/")],
                     "pilot_summaries": [f for f in snakemake.input.pilot_summaries
                                         if f.startswith(f"results/forecast/pilot/{ds}/")],
                     "generation": cfg.generation_config(conf, ds), "backends": cfg.backends_config(conf, ds),
                     "num_shards": len(cfg.shard_names(conf, ds))} for ds in gen}
    run_stage(lambda: forecast(
        datasets,
        snakemake.output.md,
        snakemake.output.json,
        target=p.target,
        pilot_samples=p.pilot_samples,
        cache_dir=conf.get("cache_dir", "cache"),
        backends=conf.get("backends") or {},
    ), log=log)
