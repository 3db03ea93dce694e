"""Rule export_dataset: the speculators export directory made a data path speculators trains on as it is (the
`datasets` directory of every exported shard's samples, and token_freq.pt)."""

from pathlib import Path

from eagle3_data.errors import run_stage
from eagle3_data.export import write_speculators_dataset
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
run_stage(
    lambda: write_speculators_dataset(
        Path(snakemake.output.token_freq).parent, token_frequencies=snakemake.input.token_frequencies
    ),
    log=log,
)
