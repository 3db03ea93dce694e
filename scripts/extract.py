"""Rule extract: one merge selection -> the target's auxiliary + final hidden states (safetensors), reusing
the rows of samples already computed (a hard link under cache_dir/hidden_states keeps them across reruns)."""
from eagle3_data import config as cfg
from eagle3_data.extract import extract_states
from eagle3_data.logs import setup_logging

setup_logging(snakemake.log[0])
s = snakemake.params.states
run = cfg.section(snakemake.config, "extract")  # how to run (devices, batch size): never a rerun trigger
ds, shard = snakemake.wildcards.ds, snakemake.wildcards.shard
extract_states(
    snakemake.input.selection,
    snakemake.output.states,
    model_path=snakemake.params.model_path,
    layers=s["layers"],
    dtype=s["dtype"],
    backend=s["backend"],
    final_norm=s["final_norm"],
    final_states=s["final_states"],
    aux_format=s["aux_format"],
    device=run["device"],
    batch_tokens=run["batch_tokens"],
    attention=run["attention"],
    gpus=run["gpus_per_job"],
    lock_dir=run["gpu_lock_dir"],
    trust_remote_code=bool(snakemake.config["target"].get("trust_remote_code", False)),
    reuse_path=f"{snakemake.config.get('cache_dir', 'cache')}/hidden_states/{ds}/{shard}.safetensors",
    selection_digest=snakemake.params.selection,
    summary_path=snakemake.output.summary,
)
