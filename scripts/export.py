"""Rule export: one extract file -> SpecForge / speculators per-sample files (global sample indices)."""
from eagle3_data.export import export, start_indices
from eagle3_data.logs import setup_logging

setup_logging(snakemake.log[0])
s = snakemake.params.settings
export(
    snakemake.input.hidden,
    snakemake.params.out_dir,
    layout=snakemake.wildcards.layout,
    start_index=start_indices(snakemake.input.manifest)[int(snakemake.wildcards.k)],
    group_size=s.get("group_size", 2000),
    manifest_path=snakemake.output[0],
    allow_norm_mismatch=s.get("allow_norm_mismatch", False),
)
