"""Rule tiny_target: build the tiny random-weight target (tokenizer + model) from a seed."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import TinyTargetSettings
from eagle3_data.tiny_target import build_tiny_target

log = setup_logging(snakemake.log[0])
settings = TinyTargetSettings.from_config(snakemake.config)
run_stage(lambda: build_tiny_target(snakemake.output[0], settings), log=log)
