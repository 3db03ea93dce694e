"""Rule normalize_<dataset>: source file -> prompts (or pre-tokenized tokens) shards + rejects."""
from eagle3_data import config as cfg
from eagle3_data.logs import setup_logging
from eagle3_data.normalize import normalize

log = setup_logging(snakemake.log[0])
src = snakemake.params.source
normalize(
    snakemake.input.source,
    src["format"],
    snakemake.params.dataset,
    snakemake.params.num_shards,
    list(snakemake.output.shards),
    snakemake.output.rejects,
    max_samples=src.get("max_samples"),
    options=src.get("options") or {},
    log=log,
    # a check, not a rerun trigger: read from the config (a dataset's own ceiling, else normalize.max_reject_rate)
    max_reject_rate=cfg.normalize_reject_ceiling(snakemake.config, snakemake.params.dataset),
    on_error=src.get("on_error") or "fail",
)
