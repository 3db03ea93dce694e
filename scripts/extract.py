"""Rule extract: merged shard -> auxiliary + final hidden states of the target (safetensors)."""
from eagle3_data.extract import extract
from eagle3_data.logs import setup_logging

setup_logging(snakemake.log[0])
s = snakemake.params.settings
extract(
    snakemake.input.merged,
    snakemake.output[0],
    model_path=snakemake.params.model_path,
    layers=s.get("layers"),
    dtype=s.get("dtype", "float32"),
    device=s.get("device", "auto"),
    batch_tokens=s.get("batch_tokens", 8192),
)
