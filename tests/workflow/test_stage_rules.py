"""The plan, vocab and export rules as they run in the full demo build (``demo_run`` in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml


def test_plan_vocab_and_export_outputs_of_the_demo(demo_run: Path):
    wd = demo_run
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    k = cfg["merge"]["shards"]
    man = json.loads((wd / "results/merged/manifest.json").read_text())
    merged_tokens = sum(
        sum(
            pq.read_table(wd / f"results/merged/{i:03d}.parquet", columns=["num_tokens"])
            .column("num_tokens")
            .to_pylist()
        )
        for i in range(k)
    )
    plan = json.loads((wd / "results/reports/plan.json").read_text())
    assert plan["totals"]["tokens"] == man["totals"]["tokens"] == merged_tokens
    assert {s["job"] for s in plan["shards"]} == set(man["selections"])  # one row per extraction job
    assert sum(s["tokens"] for s in plan["shards"]) == merged_tokens
    assert plan["throughput"]["source"] == "measured" and plan["throughput"]["tokens_per_s_per_gpu"] > 0
    assert [s["name"] for s in plan["scenarios"]][:2] == ["as merged", "cap 1,024"]

    vm = torch.load(wd / "results/vocab/vocab_mapping.pt", weights_only=True)
    assert vm["d2t"].shape == (cfg["vocab"]["draft_vocab_size"],) and vm["t2d"].shape == (272,)
    assert int(vm["t2d"].sum()) == cfg["vocab"]["draft_vocab_size"]

    exported = [json.loads((wd / f"results/export/specforge/{i:03d}.json").read_text()) for i in range(k)]
    assert [e["start_index"] for e in exported] == [0] + [
        sum(s["samples"] for s in man["shards"][:i]) for i in range(1, k)
    ]
    files = sorted((wd / "results/export/specforge").rglob("data_*.ckpt"))
    assert len(files) == man["totals"]["samples"]
    rec = torch.load(files[0], weights_only=True)
    H = cfg["target"]["tiny"]["hidden_size"]
    T = rec["input_ids"].shape[0]
    assert rec["aux_hidden_state"].shape == (1, T, 3 * H) and rec["hidden_state"].shape == (1, T, H)
    assert rec["loss_mask"].shape == (T,) and rec["input_ids"].dtype == torch.int64
