"""Rule tiny_target: build the tiny random-weight target (tokenizer + model) from a seed."""
from eagle3_data.logs import setup_logging
from eagle3_data.tiny_target import build_tiny_target

setup_logging(snakemake.log[0])
build_tiny_target(snakemake.output[0], **snakemake.params.tiny)
