"""Rule decontaminate: prompts shard -> the prompts kept + rejects (benchmark_overlap, near_duplicate)."""

from pathlib import Path

from eagle3_data.decontaminate import decontaminate
from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import DecontaminateSettings

log = setup_logging(snakemake.log[0])
settings = DecontaminateSettings.from_config(snakemake.config)
# the earlier datasets' signature files (results/<ds>/minhash/<shard>.parquet), grouped in the params' order (with
# near_duplicates.within_dataset, last, this dataset's own)
earlier = {
    ds: [p for p in snakemake.input.earlier if Path(p).parent.parent.name == ds] for ds in snakemake.params.earlier
}
run_stage(
    lambda: decontaminate(
        snakemake.input.prompts,
        snakemake.output.prompts,
        snakemake.output.rejects,
        settings=settings,
        dataset=snakemake.wildcards.ds,
        benchmark_files=list(snakemake.input.benchmarks),
        signatures_path=(list(snakemake.input.signatures) or [None])[0],
        earlier=earlier,
        log_=log,
    ),
    log=log,
)
