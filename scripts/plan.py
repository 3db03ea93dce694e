"""Rule plan: merge manifest + merged shards + target config -> extraction storage/time plan (Markdown + JSON,
and the Markdown as an HTML page for `snakemake --report`)."""

from pathlib import Path

from eagle3_data.errors import run_stage
from eagle3_data.files import write_text
from eagle3_data.logs import setup_logging
from eagle3_data.plan import plan
from eagle3_data.report import markdown_page
from eagle3_data.settings import PlanSettings

log = setup_logging(snakemake.log[0])
settings = PlanSettings.from_config(snakemake.config)


def main():
    # the training shards first (the throughput is measured on the first), then the held-out file (merge.heldout)
    merged = list(snakemake.input.merged) + list(snakemake.input.heldout)
    plan(
        snakemake.input.manifest,
        merged,
        snakemake.output.md,
        snakemake.output.json,
        settings=settings,
        states_dir="results/hidden_states",
        export_dir="results/export",
    )
    write_text(markdown_page(Path(snakemake.output.md).read_text(), "Extraction plan"), snakemake.output.html)


run_stage(main, log=log)
