"""Rule report: DuckDB tallies of samples, tokens, source and rejects per dataset."""
from pathlib import Path

from eagle3_data.logs import setup_logging
from eagle3_data.report import tally

setup_logging(snakemake.log[0])
tally(
    list(snakemake.input.validated),
    list(snakemake.input.rejected),
    list(snakemake.input.responses),
    Path(snakemake.output.tally_md).parent,
    datasets_config=snakemake.params.datasets,
    backends=snakemake.params.backends,
)
