"""Rule report: DuckDB reports (Markdown + CSV) and plots (PNG) of samples, tokens, rejects, cost, throughput."""

from pathlib import Path

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.report.plots import write_plots
from eagle3_data.report import write_reports

log = setup_logging(snakemake.log[0])
out_dir = Path(snakemake.output.tally_md).parent
inputs = (list(snakemake.input.validated), list(snakemake.input.rejected), list(snakemake.input.responses))


def main():
    write_reports(
        *inputs,
        out_dir,
        datasets_config=snakemake.params.datasets,
        backends=snakemake.params.backends,
        generation=snakemake.params.generation,
        summary_paths=list(snakemake.input.summaries),  # generate's per-shard summaries: which limit ended each
    )
    write_plots(*inputs, out_dir)


run_stage(main, log=log)
