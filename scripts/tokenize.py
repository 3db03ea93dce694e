"""Rule tokenize: responses shard -> token ids + loss mask with the target tokenizer."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import TokenizeSettings
from eagle3_data.tokens import tokenize

log = setup_logging(snakemake.log[0])
settings = TokenizeSettings.from_config(snakemake.config, snakemake.wildcards.ds)
run_stage(lambda: tokenize(snakemake.input.responses, snakemake.output[0], settings=settings), log=log)
