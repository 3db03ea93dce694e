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
    backend=s.get("backend", "transformers"),
    gpus=s.get("gpus_per_job", 1),
    lock_dir=s.get("gpu_lock_dir"),
    final_norm=s.get("final_norm", "post"),
    final_states=s.get("final_states", "all"),
    aux_format=s.get("aux_format", "same"),
)
