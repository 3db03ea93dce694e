"""Rule view: validated shards -> a few samples per dataset with their loss mask, as HTML pages for the report."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.view import write_report_examples

log = setup_logging(snakemake.log[0])
run_stage(
    lambda: write_report_examples(
        snakemake.params.validated,
        list(snakemake.output.pages),
        target=snakemake.params.target,
        n=snakemake.params.examples,
        context=snakemake.params.context,
    ),
    log=log,
)
