"""Rule plan: merge manifest + merged shards + target config -> extraction storage/time plan (Markdown + JSON,
and the Markdown as an HTML page for `snakemake --report`)."""
from pathlib import Path

from eagle3_data.io import write_text
from eagle3_data.logs import setup_logging
from eagle3_data.plan import plan
from eagle3_data.report import markdown_page

setup_logging(snakemake.log[0])
e = snakemake.params.extract
p = snakemake.params.plan
plan(
    snakemake.input.manifest,
    list(snakemake.input.merged),
    snakemake.output.md,
    snakemake.output.json,
    model_path=snakemake.params.model_path,
    layers=e.get("layers"),
    dtype=e.get("dtype", "bfloat16"),
    aux_format=e.get("aux_format", "same"),
    final_states=e.get("final_states", "all"),
    tokens_per_s_per_gpu=p.get("tokens_per_s_per_gpu"),
    measure={"device": e.get("device", "auto"), "batch_tokens": e.get("batch_tokens", 8192),
             "attention": e.get("attention", "auto"), "max_tokens": p.get("measure_tokens", 20000),
             "backend": e.get("backend", "transformers")},
    gpus_per_job=e.get("gpus_per_job", 1),
    gpus_total=p.get("gpus_total", 8),
    caps=p.get("caps") or [],
    drop=p.get("drop") or [],
    overflow=snakemake.params.overflow,
)
write_text(markdown_page(Path(snakemake.output.md).read_text(), "Extraction plan"), snakemake.output.html)
