"""Rule extract: one merge selection -> the target's auxiliary + final hidden states (safetensors), reusing
the rows of samples already computed (a hard link under cache_dir/hidden_states keeps them across reruns)."""

from eagle3_data.errors import run_stage
from eagle3_data.extract import extract_states
from eagle3_data.logs import setup_logging
from eagle3_data.settings import ExtractSettings

log = setup_logging(snakemake.log[0])
settings = ExtractSettings.from_config(snakemake.config)  # params: the stored layout; the rest is how it runs
ds, shard = snakemake.wildcards.ds, snakemake.wildcards.shard
run_stage(
    lambda: extract_states(
        snakemake.input.selection,
        snakemake.output.states,
        settings=settings,
        reuse_path=settings.reuse_path(ds, shard),
        selection_digest=snakemake.params.selection,
        summary_path=snakemake.output.summary,
        images_path=settings.validated_path(ds, shard),
    ),
    log=log,
)
