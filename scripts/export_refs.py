"""Rule export_refs: the SpecForge ref manifest of an in-place export directory (every exported shard's samples, in
the merged order, pointing at results/hidden_states/) and manifest.json.done."""

from pathlib import Path

from eagle3_data.errors import run_stage
from eagle3_data.export.inplace_specforge import write_ref_manifest
from eagle3_data.logs import setup_logging

log = setup_logging(snakemake.log[0])
run_stage(lambda: write_ref_manifest(Path(snakemake.output.manifest).parent), log=log)
