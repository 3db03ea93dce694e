"""Rule generate: prompts shard -> responses shard through the dataset's backends (journaled in cache/)."""
from eagle3_data.generate import generate
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
generate(
    snakemake.input.prompts,
    snakemake.output.responses,
    dataset=snakemake.wildcards.ds,
    shard=snakemake.wildcards.shard,
    target_name=snakemake.params.target_name,
    generation=snakemake.params.generation,
    backends=snakemake.params.backends,
    journal_dir=snakemake.params.journal_dir,
    num_shards=snakemake.params.num_shards,
    summary_path=snakemake.output.summary,
    target=snakemake.params.target,
    target_format=snakemake.params.target_format,
    log=log,
)
