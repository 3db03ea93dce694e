"""Rule export: one merged shard -> SpecForge / speculators per-sample files (global sample indices), read
from the hidden-states files of the selections its rows came from."""
from eagle3_data.export import export, start_indices
from eagle3_data.logs import setup_logging

setup_logging(snakemake.log[0])
export(
    snakemake.input.merged,
    snakemake.params.out_dir,
    layout=snakemake.wildcards.layout,
    states_dir="results/hidden_states",
    merge_manifest=snakemake.input.manifest,
    start_index=start_indices(snakemake.input.manifest)[int(snakemake.wildcards.k)],
    group_size=snakemake.params.group_size,
    manifest_path=snakemake.output[0],
    allow_norm_mismatch=(snakemake.config.get("export") or {}).get("allow_norm_mismatch", False),
)
