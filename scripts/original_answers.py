"""Rule original_answers: prompts shard -> responses shard of the source's own answers (no request sent)."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.original_answers import original_answers
from eagle3_data.settings import OriginalAnswersSettings

log = setup_logging(snakemake.log[0])
settings = OriginalAnswersSettings.from_config(snakemake.config, snakemake.wildcards.ds)
run_stage(
    lambda: original_answers(
        snakemake.input.prompts,
        snakemake.output.responses,
        shard=snakemake.wildcards.shard,
        settings=settings,
        summary_path=snakemake.output.summary,
    ),
    log=log,
)
