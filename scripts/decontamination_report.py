"""Rule decontamination_report: results/reports/decontamination.{md,csv} from the decontaminate stage's outputs."""

from eagle3_data.decontaminate.report import write_report
from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
run_stage(
    lambda: write_report(snakemake.input.kept, snakemake.input.rejected, snakemake.output.md, snakemake.output.csv),
    log=log,
)
