"""Rule vocab: merged shards -> supervised-token frequencies + draft vocabulary d2t/t2d."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import VocabSettings
from eagle3_data.vocab import build_vocab

log = setup_logging(snakemake.log[0])
settings = VocabSettings.from_config(snakemake.config)
run_stage(
    lambda: build_vocab(
        list(snakemake.input.merged),
        snakemake.output.mapping,
        snakemake.output.freq,
        snakemake.output.summary,
        settings=settings,
    ),
    log=log,
)
