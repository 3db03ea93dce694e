"""Rule merge: validated shards -> merged, shuffled shards + one selection per validated shard + manifest."""
from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.merge import memory_limit_of, merge, source_key
from eagle3_data.settings import MergeSettings

log = setup_logging(snakemake.log[0])
settings = MergeSettings.from_config(snakemake.config)
validated = list(snakemake.input)
run_stage(lambda: merge(
    validated,
    list(snakemake.output.shards),
    snakemake.output.manifest,
    settings=settings,
    selections=list(snakemake.output.selections),
    sources=[source_key(p) for p in validated],
    # DuckDB's budget: the job's resources (merge.memory_mb and merge.threads, or a profile's set-resources)
    memory_limit=memory_limit_of(snakemake.resources.mem_mb),
    threads=snakemake.threads,
), log=log)
