"""Rule validate: tokens shard -> validated + rejected shards (fails above the reject-rate ceiling)."""
from eagle3_data import config as cfg
from eagle3_data.logs import setup_logging
from eagle3_data.validate import validate

setup_logging(snakemake.log[0])
validate(
    snakemake.input.tokens,
    snakemake.output.validated,
    snakemake.output.rejected,
    target=snakemake.params.target,
    settings=cfg.section(snakemake.config, "validate"),  # params carry the part rejects depend on
    shard=snakemake.wildcards.shard,
)
