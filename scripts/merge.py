"""Rule merge: validated shards -> merged, shuffled shards + one selection per validated shard + manifest (+ the
held-out set when merge.heldout > 0)."""

from pathlib import Path

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.merge import MergeResources, memory_limit_of, merge, remove_leftover_heldout, source_key
from eagle3_data.settings import MergeSettings

log = setup_logging(snakemake.log[0])
settings = MergeSettings.from_config(snakemake.config)
validated = list(snakemake.input.validated)
heldout = snakemake.output.get("heldout")  # an output only when merge.heldout > 0


def main():
    if heldout is None:  # off: an earlier run's held-out file would hold training samples now
        remove_leftover_heldout(Path(snakemake.output.manifest).with_name("heldout.parquet"), "results/export/heldout")
    return merge(
        validated,
        list(snakemake.output.shards),
        snakemake.output.manifest,
        settings=settings,
        selections=list(snakemake.output.selections),
        sources=[source_key(p) for p in validated],
        heldout_path=heldout,
        prompt_paths=list(snakemake.input.prompts),  # their prompt_key: the held-out draw goes by prompt text
        # DuckDB's budget: the job's resources (merge.memory_mb and merge.threads, or a profile's set-resources)
        resources=MergeResources(memory_limit=memory_limit_of(snakemake.resources.mem_mb), threads=snakemake.threads),
    )


run_stage(main, log=log)
