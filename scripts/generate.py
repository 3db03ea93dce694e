"""Rule generate: prompts shard -> responses shard through the dataset's backends (journaled in cache/)."""
from eagle3_data import config as cfg
from eagle3_data.backends.limits import jobs_using
from eagle3_data.errors import run_stage
from eagle3_data.generate import generate
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
# Backend settings (concurrency, timeouts, rate limits, headers, key variables, launch) come from the config at run
# time, not from rule params: changing them reruns nothing.
backends = cfg.backends_config(snakemake.config, snakemake.wildcards.ds)
run_stage(lambda: generate(
    snakemake.input.prompts,
    snakemake.output.responses,
    dataset=snakemake.wildcards.ds,
    shard=snakemake.wildcards.shard,
    target_name=snakemake.params.target_name,
    generation=snakemake.params.generation,
    backends=backends,
    backend_jobs={name: jobs_using(snakemake.config, name) for name in backends},
    journal_dir=snakemake.params.journal_dir,
    num_shards=snakemake.params.num_shards,
    summary_path=snakemake.output.summary,
    target=snakemake.params.target,
    log=log,
), log=log)
