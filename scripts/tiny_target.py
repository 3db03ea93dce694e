"""Rule tiny_target: build the tiny random-weight target (tokenizer + model) from a seed: a Kimi K2.5-style text
target, or (``target.tiny.kind: qwen2.5-vl``) a tiny Qwen2.5-VL for image prompts."""

from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
from eagle3_data.settings import TinyTargetSettings
from eagle3_data.tiny_vlm import build_tiny_vlm_target
from eagle3_data.tiny_target import build_tiny_target

log = setup_logging(snakemake.log[0])
settings = TinyTargetSettings.from_config(snakemake.config)
build = build_tiny_vlm_target if settings.kind == "qwen2.5-vl" else build_tiny_target
run_stage(lambda: build(snakemake.output[0], settings), log=log)
