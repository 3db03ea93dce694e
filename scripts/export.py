"""Rules export / export_heldout: one merged shard (or the held-out set, indices from 0) -> SpecForge /
speculators per-sample files (global sample indices), read from the hidden-states files of the selections its rows
came from."""

from eagle3_data.errors import run_stage
from eagle3_data.export import MergedShard, export, start_indices
from eagle3_data.logs import setup_logging
from eagle3_data.settings import ExportSettings

log = setup_logging(snakemake.log[0])
settings = ExportSettings.from_config(snakemake.config)
heldout = bool(snakemake.params.get("heldout"))  # rule export_heldout


def main():
    shard = MergedShard(
        snakemake.input.merged,
        start_index=0 if heldout else start_indices(snakemake.input.manifest)[int(snakemake.wildcards.k)],
        heldout=heldout,
    )
    return export(
        shard,
        snakemake.params.out_dir,
        settings=settings,
        layout=snakemake.wildcards.layout,
        states_dir="results/hidden_states",
        merge_manifest=snakemake.input.manifest,
        manifest_path=snakemake.output[0],
        provenance=snakemake.input.get("provenance"),
    )


run_stage(main, log=log)
