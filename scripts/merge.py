"""Rule merge: validated shards -> merged, shuffled shards + one selection per validated shard + manifest."""
from eagle3_data.logs import setup_logging
from eagle3_data.merge import merge, source_key

setup_logging(snakemake.log[0])
s = snakemake.params.settings
validated = list(snakemake.input)
merge(
    validated,
    list(snakemake.output.shards),
    snakemake.output.manifest,
    selections=list(snakemake.output.selections),
    sources=[source_key(p) for p in validated],
    datasets=s.get("datasets"),
    max_samples=s.get("max_samples") or {},
    max_len=s["max_len"],
    overflow=s.get("overflow", "truncate"),
    seed=s["seed"],
    # DuckDB's budget: the job's memory (resources mem_mb: merge.memory_mb, a profile or --set-resources) less a
    # quarter for the parquet writers and Python; its threads: the job's
    memory_limit=f"{max(256, int(snakemake.resources.mem_mb * 0.75))}MB",
    threads=snakemake.threads,
)
