"""Rule report: DuckDB tallies of samples, tokens, source and rejects per dataset."""
from eagle3_data.logs import setup_logging
from eagle3_data.report import tally

setup_logging(snakemake.log[0])
tally(
    list(snakemake.input.validated),
    list(snakemake.input.rejected),
    list(snakemake.input.responses),
    snakemake.output.tally_md,
    snakemake.output.tally_csv,
    snakemake.output.rejects_csv,
    backends=snakemake.params.backends,
    datasets_config=snakemake.params.datasets,
)
