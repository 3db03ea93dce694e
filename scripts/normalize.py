"""Rule normalize_<dataset>: source file -> prompts (or pre-tokenized tokens) shards + rejects."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.normalize import normalize
from eagle3_data.settings import NormalizeSettings

log = setup_logging(snakemake.log[0])
settings = NormalizeSettings.from_config(snakemake.config, snakemake.params.dataset)
run_stage(lambda: normalize(settings, list(snakemake.output.shards), snakemake.output.rejects, log=log), log=log)
