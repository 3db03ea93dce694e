"""Rule gguf_target: convert the target's GGUF file into a transformers directory (weights, tokenizer, template)."""

from eagle3_data.errors import run_stage
from eagle3_data.gguf_target import build_gguf_target
from eagle3_data.logs import setup_logging
from eagle3_data.settings import GGUFTargetSettings

log = setup_logging(snakemake.log[0])
settings = GGUFTargetSettings.from_config(snakemake.config)
facts = run_stage(lambda: build_gguf_target(snakemake.output[0], snakemake.input.gguf, settings), log=log)
log.info(
    "gguf_target: %s -> %s (%s, %d layers, hidden %d, vocab %d)",
    facts["gguf"],
    snakemake.output[0],
    facts["architecture"],
    facts["num_layers"],
    facts["hidden_size"],
    facts["vocab_size"],
)
