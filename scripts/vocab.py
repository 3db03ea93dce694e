"""Rule vocab: merged shards -> supervised-token frequencies + draft vocabulary d2t/t2d."""
from eagle3_data.logs import setup_logging
from eagle3_data.vocab import build_vocab

setup_logging(snakemake.log[0])
build_vocab(
    list(snakemake.input.merged),
    snakemake.output.mapping,
    snakemake.output.freq,
    snakemake.output.summary,
    draft_vocab_size=snakemake.params.draft_vocab_size,
    model_path=snakemake.params.model_path,
)
