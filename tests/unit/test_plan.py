"""Extraction plan: the seed's figures from its numbers, exact cap alternatives, measured throughput."""

from __future__ import annotations

import json
import shutil
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.formatting import format_bytes, format_hours

from eagle3_data import plan as pl
from eagle3_data import schemas
from eagle3_data.merge import merge
from eagle3_data.settings import ExtractSettings, MergeSettings, PlanSettings

# The seed's table (samples, tokens) per dataset; A1: 2,800 samples, ~44.9M tokens, ~16k average.
SEED = {
    "B1_glaive": (9998, 17.0e6),
    "B2_opencodeinstruct": (2932, 11.4e6),
    "B3_magicoder": (3383, 10.5e6),
    "B4_mixturethoughts": (1891, 10.2e6),
    "B5_openthoughts": (2112, 11.0e6),
    "B6_ultrachat": (5957, 11.1e6),
    "B7_sharegpt": (5476, 10.9e6),
    "B8_sweagent": (3565, 8.8e6),
    "A1_deepswekimi": (2800, 44.9e6),
    "A2_kimik25": (2000, 2.6e6),
}
KIMI_K25 = {
    "model_type": "kimi_k25",
    "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168},
}


def seed_lengths(tmp_path, shards=4):
    """Per-sample lengths with the seed's per-dataset counts and means (lognormal spread, an assumption:
    sigma 0.8 for the generated B sets, 0.5 for the uniformly long A1). B completions are the last half of a
    sample; A1/A2 agent trajectories are supervised throughout (every assistant turn), modelled as
    num_supervised = num_tokens so a cap truncates rather than drops them."""
    rng = np.random.default_rng(0)
    ds, n_tok, n_sup = [], [], []
    for name, (n, tokens) in SEED.items():
        x = rng.lognormal(0.0, 0.5 if name.startswith("A1") else 0.8, n)
        x = np.maximum(2, np.round(x / x.mean() * tokens / n)).astype(np.int64)
        ds += [name] * n
        n_tok.append(x)
        n_sup.append(x if name.startswith("A") else x // 2)
    n_tok, n_sup = np.concatenate(n_tok), np.concatenate(n_sup)
    order = rng.permutation(len(ds))
    ds = np.array(ds)[order]
    n_tok, n_sup = n_tok[order], n_sup[order]
    paths, man_shards = [], []
    for k, idx in enumerate(np.array_split(np.arange(len(ds)), shards)):
        p = tmp_path / f"{k:03d}.parquet"
        pq.write_table(
            pa.table({"dataset": ds[idx].tolist(), "num_tokens": n_tok[idx], "num_supervised": n_sup[idx]}), p
        )
        paths.append(p)
        man_shards.append(
            {
                "path": str(p),
                "samples": len(idx),
                "tokens": int(n_tok[idx].sum()),
                "supervised_tokens": int(n_sup[idx].sum()),
            }
        )
    manifest = {
        "shards": man_shards,
        "totals": {"samples": len(ds), "tokens": int(n_tok.sum()), "supervised_tokens": int(n_sup.sum())},
    }
    return paths, manifest


def within(x, target, rel=0.10):
    return abs(x - target) <= rel * target


def test_seed_figures(tmp_path):
    paths, manifest = seed_lengths(tmp_path)
    assert round(manifest["totals"]["tokens"] / 1e6, 1) == 138.4 and manifest["totals"]["samples"] == 40114
    # throughput: what the seed's 91 h for 138.4M tokens on 8 GPUs implies (422.5 tokens/s, 52.8 per GPU)
    tps = 138.4e6 / (91 * 3600) / 8
    p = pl.build_plan(
        manifest,
        paths,
        settings=PlanSettings.defaults(
            ExtractSettings.defaults(KIMI_K25, dtype="bfloat16", gpus_per_job=8),
            tokens_per_s_per_gpu=tps,
            gpus_total=8,
            caps=[8192],
            drop=["A1_deepswekimi"],
        ),
    )
    assert p["layers"] == [1, 29, 57] and p["model"]["hidden_size"] == 7168
    sc = {s["name"]: s for s in p["scenarios"]}
    seed_key = "aux_only_bf16"
    assert p["bytes_per_token"][seed_key]["total"] == 3 * 7168 * 2 == 43008
    # 5.5 TB "as is": 138.4M x 43,008 B = 5.95e12 B = 5.41 TiB  (the seed's T is binary: -1.6%)
    as_is = sc["as merged"]["bytes"][seed_key]
    assert within(as_is / pl.TIB, 5.5) and within(as_is / pl.TB, 5.5)  # decimal reading also within 10% (+8.2%)
    # 3.5 TB with the cap at 8,192 and A1 dropped
    both = sc["cap 8,192 and drop A1_deepswekimi"]
    assert within(both["bytes"][seed_key] / pl.TIB, 3.5)
    assert 85e6 < both["tokens"] < 93.5e6  # A1's 44.9M gone, and the cap cut some long B samples
    # the seed's 72 h fits the cap alone (A1 capped, kept) at the throughput its 91 h implies
    assert within(sc["as merged"]["wall_hours"], 91, 0.01)
    assert within(sc["cap 8,192"]["wall_hours"], 72)
    assert not within(both["wall_hours"], 72)  # ... and not the cap + drop alternative (~57 h)
    # the configured layout (3 aux + final, bf16) is 8H+5 B/token: 7.2 TiB, not the seed's 5.5
    assert p["bytes_per_token"]["configured"]["total"] == 8 * 7168 + 5
    assert not within(sc["as merged"]["bytes"]["configured"] / pl.TIB, 5.5)
    # per-shard figures add up to the totals
    assert sum(s["tokens"] for s in p["shards"]) == p["totals"]["tokens"]
    assert abs(sum(s["gpu_hours"] for s in p["shards"]) - p["totals"]["gpu_hours"]) < 1e-6
    md = pl.render_markdown(p)
    assert "3 x 7,168 x 2 = 43,008 B/token" in md
    assert "138,4" in md and "| cap 8,192 and drop A1_deepswekimi |" in md and "TiB" in md


def test_bytes_per_token_and_model_dims(tmp_path):
    assert pl.bytes_per_token(4096)["total"] == 8 * 4096 + 5
    assert pl.bytes_per_token(4096, ids_bytes=16)["total"] == 8 * 4096 + 16  # SpecForge's .ckpt: 8H+16
    fp8 = pl.bytes_per_token(4096, aux_format="fp8_e4m3", final="supervised", final_share=0.25)
    assert fp8["aux"] == 3 * 4096 + 12 and fp8["final"] == 4096 * 2 * 0.25 + 1
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096}))
    assert pl.model_dims(tmp_path)["num_layers"] == 32
    assert pl.model_dims(KIMI_K25) == {
        "num_layers": 61,
        "hidden_size": 7168,
        "model_type": "kimi_k2",
        "vocab_size": KIMI_K25["text_config"].get("vocab_size", 0),
    }
    with pytest.raises(KeyError, match="num_hidden_layers"):
        pl.model_dims({"foo": 1})
    with pytest.raises(ValueError, match="throughput"):
        pl.build_plan({"shards": []}, [], settings=PlanSettings.defaults(ExtractSettings.defaults(KIMI_K25)))


def _rows(n, seed=3):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(4, 120)
        mask = [0] * length
        for _ in range(rng.randint(1, 3)):  # one to three supervised spans anywhere
            a = rng.randrange(length)
            for j in range(a, min(length, a + rng.randint(1, 20))):
                mask[j] = 1
        rows.append(
            {
                "sample_id": f"s{i}",
                "dataset": "ab"[i % 2],
                "input_ids": [rng.randrange(1000) for _ in range(length)],
                "loss_mask": mask,
                "num_tokens": length,
                "num_prompt_tokens": 0,
                "num_completion_tokens": sum(mask),
                "ids_source": "reconstructed",
                "billed_completion_tokens": None,
                "finish_reason": "stop",
                "backend": "x",
                "provider": None,
                "cost_usd": 0.0,
            }
        )
    return rows


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_cap_alternative_equals_merge_with_that_max_len(tmp_path, overflow):
    rows = _rows(300)
    val = tmp_path / "v.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.VALIDATED), "validated", val)
    full = [tmp_path / "full" / f"{i:03d}.parquet" for i in range(2)]
    merge([val], full, tmp_path / "full.json", settings=MergeSettings.defaults(max_len=1000, seed=0))
    for cap in (10, 50):
        capped = merge(
            [val],
            [tmp_path / f"c{cap}.parquet"],
            tmp_path / f"c{cap}.json",
            settings=MergeSettings.defaults(max_len=cap, overflow=overflow, seed=0),
        )
        got = pl.scenario_totals(full, cap=cap, overflow=overflow)
        assert (got["samples"], got["tokens"], got["supervised_tokens"]) == (
            capped["totals"]["samples"],
            capped["totals"]["tokens"],
            capped["totals"]["supervised_tokens"],
        )
        got_b = pl.scenario_totals(full, cap=cap, drop=["a"], overflow=overflow)
        assert got_b["samples"] == capped["shards"][0]["datasets"].get("b", 0) and set(got_b["per_dataset"]) == {"b"}


def test_plan_measures_throughput(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            max_position_embeddings=512,
        )
    ).save_pretrained(model_dir)
    val = tmp_path / "v.parquet"
    schemas.write_checked(schemas.from_rows(_rows(60), schemas.VALIDATED), "validated", val)
    merged = [tmp_path / "m" / f"{i:03d}.parquet" for i in range(2)]
    merge([val], merged, tmp_path / "m.json", settings=MergeSettings.defaults(max_len=1000, seed=0))
    extract = ExtractSettings.defaults(model_dir, dtype="float32", device="cpu")
    settings = PlanSettings.defaults(
        extract, measure_tokens=500, gpus_total=1, caps=[32], drop=["a"], cache_dir=str(tmp_path / "cache")
    )
    dirs = dict(states_dir=tmp_path / "results/hidden_states", export_dir=tmp_path / "results/export")
    p = pl.plan(tmp_path / "m.json", merged, tmp_path / "plan.md", tmp_path / "plan.json", settings=settings, **dirs)
    assert p["throughput"]["source"] == "measured" and p["throughput"]["tokens_per_s_per_gpu"] > 0
    assert p["throughput"]["measured"]["tokens"] >= 500 and "cached" not in p["throughput"]["measured"]
    assert p["bytes_per_token"]["configured"]["total"] == 3 * 32 * 4 + 32 * 4 + 5
    on_disk = json.loads((tmp_path / "plan.json").read_text())
    assert on_disk["totals"]["tokens"] == json.loads((tmp_path / "m.json").read_text())["totals"]["tokens"]
    assert [s["name"] for s in on_disk["scenarios"]] == ["as merged", "cap 32", "drop a", "cap 32 and drop a"]
    assert "measured" in (tmp_path / "plan.md").read_text()
    # a plan rewritten for another export.layouts measures nothing: the figure is kept under cache_dir
    import eagle3_data.extract as ex

    def no_forward(*a, **kw):
        raise AssertionError("measured again")

    real, ex.extract_states = ex.extract_states, no_forward
    try:
        again = pl.plan(
            tmp_path / "m.json",
            merged,
            tmp_path / "plan.md",
            tmp_path / "plan.json",
            settings=settings.replace(export_layouts=["speculators"]),
            **dirs,
        )
    finally:
        ex.extract_states = real
    kept = again["throughput"]["measured"]
    assert (
        kept["cached"].startswith(str(tmp_path / "cache" / "plan"))
        and kept["tokens_per_s_per_gpu"] == p["throughput"]["measured"]["tokens_per_s_per_gpu"]
    )
    assert again["exports"]["requested"] == ["speculators"] and "kept in" in (tmp_path / "plan.md").read_text()
    # another batch size is another measurement
    assert pl.measure_key(merged[0], settings) != pl.measure_key(
        merged[0], settings.replace(extract=extract.replace(batch_tokens=99))
    )


def test_units_scale_with_the_size_of_the_build():
    # bytes: the largest decimal unit keeping the number >= 1, the binary one beside it
    assert format_bytes(512) == "512 B"
    assert format_bytes(43_818_936) == "43.82 MB (41.79 MiB)"  # the demo: 42,584 tokens x 1,029 B
    assert format_bytes(5_952_307_200_000) == "5.95 TB (5.41 TiB)"  # the seed: 138.4M x 43,008 B
    assert format_bytes(2_000) == "2.00 KB (1.95 KiB)"
    # durations given in hours: seconds, minutes or hours
    assert format_hours(42_584 / 1978.1 / 3600) == "21.5 s"
    assert format_hours(0.5) == "30.0 min"
    assert format_hours(91.04) == "91.0 h" and format_hours(91.04, 2) == "91.04 h"


def test_heldout_tokens_are_planned_for_extraction(tmp_path):
    """merge.heldout: the held-out rows are extracted too, so the plan's totals and alternatives count them: the
    same figures as the merge without the split (whose selections hold the same rows), the held-out part named."""
    val = tmp_path / "v.parquet"
    schemas.write_checked(schemas.from_rows(_rows(300), schemas.VALIDATED), "validated", val)
    full = [tmp_path / "full" / "000.parquet"]
    m0 = merge([val], full, tmp_path / "full.json", settings=MergeSettings.defaults(max_len=1000, seed=0))
    split = [tmp_path / "split" / "000.parquet"]
    held = tmp_path / "split" / "heldout.parquet"
    m1 = merge(
        [val],
        split,
        tmp_path / "split.json",
        heldout_path=held,
        settings=MergeSettings.defaults(max_len=1000, seed=0, heldout=0.25),
    )
    assert 0 < m1["heldout"]["samples"] < m0["totals"]["samples"] and m1["totals"]["tokens"] < m0["totals"]["tokens"]
    settings = PlanSettings.defaults(
        ExtractSettings.defaults(KIMI_K25), tokens_per_s_per_gpu=100.0, caps=[50], drop=["a"]
    )
    p0 = pl.build_plan(m0, full, settings=settings)
    p1 = pl.build_plan(m1, split + [held], settings=settings)
    for key in ("samples", "tokens", "supervised_tokens", "bytes", "gpu_hours"):
        assert p1["totals"][key] == p0["totals"][key], key
    assert (p1["totals"]["heldout_samples"], p1["totals"]["heldout_tokens"]) == (
        m1["heldout"]["samples"],
        m1["heldout"]["tokens"],
    )
    assert [(s["name"], s["samples"], s["tokens"]) for s in p1["scenarios"]] == [
        (s["name"], s["samples"], s["tokens"]) for s in p0["scenarios"]
    ]
    md = pl.render_markdown(p1)
    assert f"of which {m1['heldout']['tokens']:,} tokens in {m1['heldout']['samples']:,} samples are the held-out" in md
    assert "held-out" not in pl.render_markdown(p0)


LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 128256}


def test_bytes_of_the_states_and_of_each_export_at_8b():
    """H = 4,096 (an 8B target): the FP8 choice of the states is at most 16.5 KB/token (speculators' FP8 files:
    16.4 KB), SpecForge's own bf16 layout 32.8 KB; each export's bytes per token from its contract."""
    fp8 = pl.bytes_per_token(4096, 3, aux_format="fp8_e4m3", final_format="fp8_e4m3")
    assert fp8["total"] == 3 * 4096 + 12 + 4096 + 4 + 5 == 16405 <= 16500
    ex = {
        k: pl.export_bytes_per_token(k, 4096)["total"]
        for k in ("specforge", "specforge_dflash", "specforge_dspark", "speculators", "speculators_fp8", "modelopt")
    }
    assert ex == {
        "specforge": 8 * 4096 + 16,
        "specforge_dflash": 10 * 4096 + 16,
        "specforge_dspark": 12 * 4096 + 16,
        "speculators": 8 * 4096 + 8,
        "speculators_fp8": 4 * 4096 + 12,
        "modelopt": 8 * 4096 + 16,
    }
    assert ex["speculators_fp8"] == 16396  # hs_connectors' FP8 file: [T, 4, H] fp8 + a float32 scale + int64 ids
    with pytest.raises(ValueError, match="unknown export layout"):
        pl.export_bytes_per_token("eagle", 4096)


def test_plan_checks_the_sink(tmp_path, monkeypatch):
    """Free space per filesystem against the states plus the requested exports (less what is already written), and
    the write rate at the configured throughput; a shortfall is a warning naming the settings that fix it."""
    import shutil as sh

    man = {
        "shards": [{"samples": 1000, "tokens": 10_000_000, "supervised_tokens": 5_000_000}],
        "selections": {"d/000": {"samples": 1000, "tokens": 10_000_000}},
    }
    states, exports = tmp_path / "results/hidden_states", tmp_path / "results/export"
    extract = ExtractSettings.defaults(LLAMA_8B, dtype="bfloat16", drafters=["eagle3", "dspark"])
    settings = PlanSettings.defaults(
        extract,
        tokens_per_s_per_gpu=27_000.0,
        gpus_total=8,
        write_gb_per_s=5.0,
        export_layouts=["specforge", "speculators_fp8", "specforge_dspark"],
    )
    Usage = type(sh.disk_usage(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**13, 10**13 - 10**11, 10**11))  # 100 GB free
    p = pl.build_plan(man, [], settings=settings, states_dir=states, export_dir=exports)
    assert p["layers"] == [1, 15, 28, 8, 22, 29] and p["drafter_layers"]["dspark"] == [1, 8, 15, 22, 29]
    U = 6
    states_bpt = U * 4096 * 2 + 4096 * 2 + 5
    assert p["bytes_per_token"]["configured"]["total"] == states_bpt
    want = {
        "states": 10_000_000 * states_bpt + 8 * (1000 + 1),
        "specforge": 10_000_000 * (8 * 4096 + 16),
        "speculators_fp8": 10_000_000 * (4 * 4096 + 12),
        "specforge_dspark": 10_000_000 * (12 * 4096 + 16),
    }
    [disk] = p["disks"]  # one filesystem (tmp_path's) for all of them
    assert disk["parts"] == pytest.approx(want) and disk["needed"] == pytest.approx(sum(want.values()))
    assert disk["free"] == 10**11 and disk["short"] == pytest.approx(sum(want.values()) - 10**11)
    assert p["totals"]["bytes_with_exports"] == pytest.approx(sum(want.values()))
    # 8 GPUs x 27,000 tokens/s x 57,349 B = 12.4 GB/s, over the 5 GB/s the filesystem takes
    assert p["write_rate"]["bytes_per_s_per_gpu"] == pytest.approx(27_000 * states_bpt)
    assert p["write_rate"]["bytes_per_s"] == pytest.approx(8 * 27_000 * states_bpt)
    disk_w, rate_w = p["warnings"]
    assert disk_w.startswith(f"disk: {states} and {exports / 'specforge'} and ") and "short; set" in disk_w
    assert "extract.aux_format: fp8_e4m3 and extract.final_format: fp8_e4m3" in disk_w
    assert "extract.final_states: supervised" in disk_w and "fewer export.layouts" in disk_w
    assert (
        rate_w.startswith(
            "write rate: 8 GPU(s) extracting write 12.39 GB/s of states, more than plan.write_gb_per_s = 5.00 GB/s"
        )
        and "plan.gpus_total" in rate_w
    )
    md = pl.render_markdown(p)
    assert md.index("## Warnings") < md.index("## Bytes per token") < md.index("## Exports") < md.index("## Disk")
    assert "| speculators_fp8 | copied | **yes** | 16,396 B |" in md and "| modelopt | copied | no | 32,784 B |" in md
    assert "| speculators_inplace | in place (sample table only) | no | 16 B |" in md
    # without the copies: the states alone (no in-place layout requested here)
    assert p["totals"]["bytes_without_copies"] == pytest.approx(want["states"]) and p["exports"]["in_place"] == []
    assert f"without the copies (the states and the in-place sample tables): {format_bytes(want['states'])}" in md
    # speculators read in place instead of copied: its sample table's 16 bytes a token, not 16,396
    inplace = pl.build_plan(
        man,
        [],
        settings=settings.replace(export_layouts=["specforge", "speculators_inplace"]),
        states_dir=states,
        export_dir=exports,
    )
    assert inplace["exports"]["in_place"] == ["speculators_inplace"]
    assert inplace["exports"]["bytes"]["speculators_inplace"] == 10_000_000 * 16
    assert inplace["totals"]["bytes_without_copies"] == pytest.approx(want["states"] + 10_000_000 * 16)
    assert inplace["totals"]["bytes_with_exports"] == pytest.approx(
        want["states"] + want["specforge"] + 10_000_000 * 16
    )
    assert "0.88 GB/s per GPU in bf16 (32,773 B/token), 0.44 GB/s with" in md
    assert "[2 warnings]" in pl.summary_line(p, "plan.md")

    # what is already written counts as written (a rerun rewrites it in place): no shortfall once it is all there
    (states / "d").mkdir(parents=True)
    (states / "d" / "000.json").write_text(json.dumps({"bytes": want["states"]}))
    for k in ("specforge", "speculators_fp8", "specforge_dspark"):
        (exports / k).mkdir(parents=True)
        (exports / k / "000.json").write_text(json.dumps({"bytes": want[k]}))
    p = pl.build_plan(man, [], settings=settings.replace(write_gb_per_s=20.0), states_dir=states, export_dir=exports)
    assert p["disks"][0]["needed"] == 0 and p["warnings"] == []
    assert "## Warnings" not in pl.render_markdown(p)
