"""Rule validate: tokens shard -> validated + rejected shards (fails above the reject-rate ceiling)."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import ValidateSettings
from eagle3_data.validate import validate

log = setup_logging(snakemake.log[0])
settings = ValidateSettings.from_config(snakemake.config)  # params carry the part the rejects depend on
run_stage(
    lambda: validate(
        snakemake.input.tokens,
        snakemake.output.validated,
        snakemake.output.rejected,
        settings=settings,
        shard=snakemake.wildcards.shard,
    ),
    log=log,
)
