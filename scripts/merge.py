"""Rule merge: validated shards -> merged, shuffled shards + manifest."""
from eagle3_data.logs import setup_logging
from eagle3_data.merge import merge

setup_logging(snakemake.log[0])
s = snakemake.params.settings
merge(
    list(snakemake.input),
    list(snakemake.output.shards),
    snakemake.output.manifest,
    datasets=s.get("datasets"),
    max_samples=s.get("max_samples") or {},
    max_len=s["max_len"],
    overflow=s.get("overflow", "truncate"),
    seed=s["seed"],
)
