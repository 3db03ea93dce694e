"""Rule generate: prompts shard -> responses shard through the dataset's backends (journaled in cache/)."""
import logging

from eagle3_data import config as cfg
from eagle3_data.backends.limits import jobs_using
from eagle3_data.errors import in_workflow_run, run_stage
from eagle3_data.generate import generate
from eagle3_data.logs import setup_logging

# inside a workflow run the console shows the run-wide view (eagle3_data.runview): this shard's progress lines and
# summary go to its log file, only warnings and errors to the console
log = setup_logging(snakemake.log[0], console_level=logging.WARNING if in_workflow_run() else None)
ds = snakemake.wildcards.ds
# the whole settings from the config at run time (rule params carry only the part the responses depend on, as
# rerun triggers): concurrency, timeouts, rate limits, headers, key variables, launch and retries rerun nothing
backends = cfg.backends_config(snakemake.config, ds)
run_stage(lambda: generate(
    snakemake.input.prompts,
    snakemake.output.responses,
    dataset=ds,
    shard=snakemake.wildcards.shard,
    target_name=snakemake.params.target_name,
    generation=cfg.generation_config(snakemake.config, ds),
    backends=backends,
    backend_jobs={name: jobs_using(snakemake.config, name) for name in backends},
    journal_dir=f"{snakemake.config.get('cache_dir', 'cache')}/journal",
    num_shards=snakemake.params.num_shards,
    summary_path=snakemake.output.summary,
    target=snakemake.params.target,
    target_format=snakemake.params.target_format,
    # where the config sets each budget: named when a budget stops the shard
    budget_sources={k: cfg.generation_source(snakemake.config, ds, k)
                    for k in ("budget_usd", "budget_completion_tokens")},
    log=log,
), log=log)
