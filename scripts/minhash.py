"""Rule minhash: prompts shard -> the MinHash signature of each prompt (near-duplicates across datasets)."""

from eagle3_data.decontaminate import minhash
from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import DecontaminateSettings

log = setup_logging(snakemake.log[0])
settings = DecontaminateSettings.from_config(snakemake.config)
run_stage(lambda: minhash(snakemake.input.prompts, snakemake.output[0], settings=settings, log_=log), log=log)
