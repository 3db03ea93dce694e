"""Rule tokenize: responses shard -> token ids + loss mask with the target tokenizer."""
from eagle3_data.logs import setup_logging
from eagle3_data.tokenize import tokenize

setup_logging(snakemake.log[0])
tokenize(
    snakemake.input.responses,
    snakemake.output[0],
    target=snakemake.params.target,
    chat_template_kwargs=snakemake.params.chat_template_kwargs,
    max_tokens=snakemake.params.max_tokens,
)
