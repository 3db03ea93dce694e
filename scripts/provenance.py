"""Rule provenance: results/merged/provenance.parquet (each merged row's origin) + results/reports/provenance.json."""

import hashlib
from pathlib import Path

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.provenance import MergedFiles, build_provenance

log = setup_logging(snakemake.log[0])
benchmarks = {str(p): hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in snakemake.input.benchmarks}
run_stage(
    lambda: build_provenance(
        MergedFiles(
            merged=list(snakemake.input.merged),
            heldout=(list(snakemake.input.heldout) or [None])[0],
            responses=list(snakemake.input.responses),
            prompts=list(snakemake.input.prompts),
        ),
        snakemake.output.table,
        datasets=snakemake.params.datasets,
        backends=snakemake.params.backends,
        target_path=snakemake.config["target"]["path"],
        json_path=snakemake.output.json,
        config=snakemake.config,
        extra={"decontaminate": {**snakemake.params.decontaminate, "benchmark_files": benchmarks}},
    ),
    log=log,
)
