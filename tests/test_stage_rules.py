"""The plan, vocab and export rules (and extract's new settings) run in the workflow, with exactly the lines
this helper's report asks the lead to add to Snakefile, config.yaml, the config schema and scripts/extract.py
applied to a scratch copy. Validated shards are staged directly (generation is not under test here), and
``--allowed-rules`` keeps Snakemake from rebuilding them."""

from __future__ import annotations

import json
import re
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import copy_workflow, run_snakemake
from eagle3_data import schemas

SNAKEFILE_INCLUDES = '''include: "rules/plan.smk"
include: "rules/vocab.smk"
include: "rules/export.smk"
'''
ALL_TARGETS = '''        plan=rules.plan.output.md,
        vocab=rules.vocab.output.mapping,
        exports=expand("results/export/{layout}/{k}.json", layout=config["export"]["layouts"], k=MERGED_SHARDS),
'''
CONFIG_EXTRACT = '''  final_norm: post                # post: output of the final norm (SpecForge, Model-Optimizer) | pre: its input (speculators, vLLM)
  final_states: all               # all | supervised: final states only where the loss reads them (mask[p] or mask[p-1])
  aux_format: same                # same: `dtype` | fp8_e4m3: per-token, per-layer scales (about half the bytes)
  gpu_lock_dir: null              # device lock files, on local disk; null: $EAGLE3_GPU_LOCK_DIR or /tmp/eagle3-data-gpu-locks
'''
CONFIG_SECTIONS = '''
export:
  layouts: [specforge]            # any of specforge (post-norm), speculators (needs extract.final_norm: pre)
  group_size: 2000                # SpecForge files per rows_* directory
  allow_norm_mismatch: false

plan:
  tokens_per_s_per_gpu: null      # null: measure on the start of the first merged shard (the plan job then holds GPUs)
  measure_tokens: 20000
  gpus_total: 8                   # devices the extract jobs share (wall hours = GPU hours / busy devices)
  caps: [1024]                    # alternatives: per-sample token caps
  drop: []                        # alternatives: datasets to leave out, e.g. [A1_deepswekimi]

vocab:
  draft_vocab_size: 256           # SpecForge configs use 32000; must be <= the target vocabulary (tiny target: 272)
'''
SCHEMA_EXTRACT = '''      final_norm: {type: string, enum: [post, pre]}
      final_states: {type: string, enum: [all, supervised]}
      aux_format: {type: string, enum: [same, fp8_e4m3]}
      gpu_lock_dir: {type: [string, "null"]}
'''
SCHEMA_SECTIONS = '''
  export:
    type: object
    additionalProperties: false
    properties:
      layouts: {type: array, items: {type: string, enum: [specforge, speculators]}, uniqueItems: true}
      group_size: {type: integer, minimum: 1}
      allow_norm_mismatch: {type: boolean}

  plan:
    type: object
    additionalProperties: false
    properties:
      tokens_per_s_per_gpu: {type: [number, "null"], exclusiveMinimum: 0}
      measure_tokens: {type: integer, minimum: 1}
      gpus_total: {type: integer, minimum: 1}
      caps: {type: array, items: {type: integer, minimum: 1}}
      drop: {type: array, items: {type: string}}

  vocab:
    type: object
    additionalProperties: false
    properties:
      draft_vocab_size: {type: integer, minimum: 1}
'''
SCRIPT_EXTRACT = '''"""Rule extract: merged shard -> auxiliary + final hidden states of the target (safetensors)."""
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
'''


def apply_lead_lines(wd: Path) -> None:
    """Apply the report's lines to the copy; each part is skipped once the lead has applied it for real."""
    sf = (wd / "Snakefile").read_text()
    if 'rules/plan.smk' not in sf:
        anchor = 'include: "rules/extract.smk"\n'
        assert anchor in sf
        sf = sf.replace(anchor, anchor + SNAKEFILE_INCLUDES)
    if "rules.plan.output" not in sf:
        all_anchor = "        report=rules.report.output,\n"
        assert all_anchor in sf
        sf = sf.replace(all_anchor, all_anchor + ALL_TARGETS)
    (wd / "Snakefile").write_text(sf)
    cfg = (wd / "config.yaml").read_text()
    if "final_norm:" not in cfg:
        anchor = "  batch_tokens: 8192\n"
        assert cfg.count(anchor) == 1
        cfg = cfg.replace(anchor, anchor + CONFIG_EXTRACT)
    if "\nplan:" not in cfg:
        cfg = cfg.rstrip("\n") + "\n" + CONFIG_SECTIONS
    (wd / "config.yaml").write_text(cfg)
    sch = (wd / "schemas" / "config.schema.yaml").read_text()
    if "final_norm" not in sch:
        anchor = "      batch_tokens: {type: integer, minimum: 1}\n"
        assert sch.count(anchor) == 1
        sch = sch.replace(anchor, anchor + SCHEMA_EXTRACT)
    if "\n  plan:" not in sch:
        sch = sch.rstrip("\n") + "\n" + SCHEMA_SECTIONS
    (wd / "schemas" / "config.schema.yaml").write_text(sch)
    if "final_norm" not in (wd / "scripts" / "extract.py").read_text():
        (wd / "scripts" / "extract.py").write_text(SCRIPT_EXTRACT)


def stage_validated(wd: Path, cfg: dict) -> int:
    rng = random.Random(0)
    total = 0
    for ds, d in cfg["datasets"].items():
        for s in range(d.get("shards", 1)):
            rows = []
            for i in range(12):
                n = rng.randint(6, 80)
                p = rng.randint(1, n - 1)
                ids = [rng.randrange(256) for _ in range(n)]
                rows.append({"sample_id": f"{ds}-{s}-{i}", "dataset": ds, "input_ids": ids,
                             "loss_mask": [0] * p + [1] * (n - p), "num_tokens": n, "num_prompt_tokens": p,
                             "num_completion_tokens": n - p, "ids_source": "reconstructed",
                             "billed_completion_tokens": n - p, "finish_reason": "stop", "backend": "x",
                             "provider": None, "cost_usd": 0.0})
                total += n
            schemas.write_checked(schemas.from_rows(rows, schemas.VALIDATED), "validated",
                                  wd / f"results/{ds}/validated/{s:03d}.parquet")
    return total


@pytest.fixture(scope="module")
def wd(tmp_path_factory, root):
    wd = copy_workflow(tmp_path_factory.mktemp("wf"))
    apply_lead_lines(wd)
    return wd


def test_new_rules_run_in_the_workflow(wd, monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_GPU_LOCK_DIR", str(tmp_path / "locks"))
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    total = stage_validated(wd, cfg)
    # the DAG of `all` now holds the new rules: one plan, one vocab, one export per merged shard and layout
    dry = run_snakemake(wd, "-n", "--quiet", "rules")
    counts = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", dry.stdout, re.M))
    k = cfg["merge"]["shards"]
    assert counts.get("plan") == "1" and counts.get("vocab") == "1" and counts.get("export") == str(k)

    targets = ["results/reports/plan.md", "results/vocab/vocab_mapping.pt"] + [
        f"results/export/specforge/{i:03d}.json" for i in range(k)]
    run_snakemake(wd, "--cores", "2", "--allowed-rules", "tiny_target", "merge", "extract", "plan", "vocab",
                  "export", "--", *targets)
    man = json.loads((wd / "results/merged/manifest.json").read_text())
    assert man["totals"]["input_samples"] == sum(12 * d.get("shards", 1) for d in cfg["datasets"].values())
    plan = json.loads((wd / "results/reports/plan.json").read_text())
    assert plan["totals"]["tokens"] == man["totals"]["tokens"] <= total
    assert plan["throughput"]["source"] == "measured" and plan["throughput"]["tokens_per_s_per_gpu"] > 0
    assert [s["name"] for s in plan["scenarios"]][:2] == ["as merged", "cap 1,024"]
    vm = torch.load(wd / "results/vocab/vocab_mapping.pt", weights_only=True)
    assert vm["d2t"].shape == (256,) and vm["t2d"].shape == (272,)
    exported = [json.loads((wd / f"results/export/specforge/{i:03d}.json").read_text()) for i in range(k)]
    assert [e["start_index"] for e in exported] == [0] + [sum(s["samples"] for s in man["shards"][:i]) for i in range(1, k)]
    files = sorted((wd / "results/export/specforge").rglob("data_*.ckpt"))
    assert len(files) == man["totals"]["samples"]
    rec = torch.load(files[0], weights_only=True)
    H = cfg["target"]["tiny"]["hidden_size"]
    assert rec["aux_hidden_state"].shape[-1] == 3 * H and rec["hidden_state"].shape[-1] == H
    meta_rows = sum(pq.read_metadata(wd / f"results/merged/{i:03d}.parquet").num_rows for i in range(k))
    assert meta_rows == len(files)



