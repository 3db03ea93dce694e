"""Rule generate: prompts shard -> responses shard through the dataset's backends (journaled in cache/)."""
from eagle3_data import config as cfg
from eagle3_data.generate import generate
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
ds = snakemake.wildcards.ds
generate(
    snakemake.input.prompts,
    snakemake.output.responses,
    dataset=ds,
    shard=snakemake.wildcards.shard,
    target_name=snakemake.params.target_name,
    # the whole settings (rule params carry only the part the responses depend on, as rerun triggers)
    generation=cfg.generation_config(snakemake.config, ds),
    backends=cfg.backends_config(snakemake.config, ds),
    journal_dir=f"{snakemake.config.get('cache_dir', 'cache')}/journal",
    num_shards=snakemake.params.num_shards,
    summary_path=snakemake.output.summary,
    target=snakemake.params.target,
    target_format=snakemake.params.target_format,
    log=log,
)
