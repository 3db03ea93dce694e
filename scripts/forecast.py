"""Rule forecast: the pilots' responses (rule forecast_pilot, which runs scripts/generate.py) -> the forecast report."""

from eagle3_data import config as cfg
from eagle3_data.errors import run_stage
from eagle3_data.forecast import forecast
from eagle3_data.logs import setup_logging
from eagle3_data.settings import GenerateSettings

log = setup_logging(snakemake.log[0])
conf = snakemake.config
inp = snakemake.input


def spec(ds: str) -> dict:
    """What the forecast reads of dataset ``ds``: its files and its generate settings."""
    s = GenerateSettings.from_config(conf, ds)
    return {
        "prompts": [f for f in inp.prompts if f.startswith(f"results/{ds}/prompts/")],
        "pilot": [f for f in inp.pilot if f.startswith(f"results/forecast/pilot/{ds}/")],
        "pilot_summaries": [f for f in inp.pilot_summaries if f.startswith(f"results/forecast/pilot/{ds}/")],
        "generation": s.generation,
        "backends": s.backends,
        "num_shards": s.num_shards,
    }


settings = {ds: spec(ds) for ds in cfg.generated_datasets(conf)}
run_stage(
    lambda: forecast(
        settings,
        snakemake.output.md,
        snakemake.output.json,
        target=snakemake.params.target,
        pilot_samples=snakemake.params.pilot_samples,
        cache_dir=conf["cache_dir"],
        backends=conf.get("backends") or {},
    ),
    log=log,
)
