"""benchmarks/extract_gpu.py is correct by construction: its FLOP count, its Kimi-K2.5 projection, its import
guard (the GPU machine's packages only) and its --tiny run on CPU (the GPU run's code path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import extract_gpu as g  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])  # as on the GPU machine
    return env


def test_param_count_matches_transformers_and_flops():
    from transformers import LlamaConfig, LlamaForCausalLM

    # the formula against a real (tiny) model's decoder parameters
    model = LlamaForCausalLM(LlamaConfig(**g.TINY))
    real = sum(p.numel() for n, p in model.model.named_parameters() if "embed_tokens" not in n)
    assert g.decoder_params(g.TINY) == real
    # Llama-3.1-8B: 8.03B total = 6.98B decoder + 2 x 128256 x 4096 (embedding, lm_head)
    assert abs(g.decoder_params(g.LLAMA_31_8B) + 2 * 128256 * 4096 - 8.03e9) < 0.01e9
    cfg = g.TINY
    P, L, d = g.decoder_params(cfg), cfg["num_hidden_layers"], cfg["hidden_size"]
    assert g.useful_flops(cfg, [10, 20]) == 2 * P * 30 + 2 * L * d * (100 + 400)


def test_kimi_projection_arithmetic():
    p = g.projection(0.40)
    assert p["tokens"] == 138.4e6 and p["samples"] == 40114
    assert p["dense_flops"] == 2 * 32e9 * 138.4e6
    # causal attention: 61 layers x 64 heads x (192 + 128) x sum n^2; A1 alone: 2,800 x 16,036^2 x e^0.25
    assert p["attention_flops"] == pytest.approx(61 * 64 * 320 * p["sum_n2"])
    assert p["sum_n2"] > 2800 * (44.9e6 / 2800) ** 2 * 1.284
    assert p["flops"] == pytest.approx(1.069e19, rel=0.01)
    assert p["hours"] == pytest.approx(p["flops"] / (8 * 989e12 * 0.40) / 3600, abs=0.01)
    assert p["hours"] == pytest.approx(0.94, abs=0.01)
    # the seed's 91 h on 8 GPUs is ~0.4% of the H200 peak by the same count; 10x less MFU is 10x more hours
    assert p["seed_implied_mfu"] == pytest.approx(0.0041, abs=0.0001)
    assert g.projection(0.04)["hours"] == pytest.approx(9.4, abs=0.1)


def test_import_guard_passes_and_blocks():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "extract_gpu.py"), "--check-imports"],
                         capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["check_imports"] and set(res["blocked"]) >= {"snakemake", "duckdb", "pandera", "sglang"}
    assert {"torch", "transformers", "safetensors", "numpy", "pyarrow"} <= set(res["third_party_loaded"])
    assert not set(res["blocked"]) & set(res["third_party_loaded"])
    # the guard really blocks: an import fails, and availability checks (find_spec) see nothing
    code = ("import sys, importlib.util; sys.path.insert(0, 'benchmarks'); import extract_gpu as g\n"
            "g.block_imports()\nprint(importlib.util.find_spec('duckdb'))\n"
            "try:\n    import pandera\nexcept ImportError: print('blocked')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env(),
                         cwd=ROOT)
    assert out.stdout.split() == ["None", "blocked"], out.stderr[-2000:]


def test_tiny_run_under_the_guard_prints_a_line_per_run_and_a_summary():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "extract_gpu.py"), "--tiny", "--block-imports"],
                         capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.strip().splitlines() if x.startswith("{")]
    runs, res = lines[:-1], lines[-1]
    assert [r["run"] for r in runs] == ["padded@256", "padded@1024", "packed:loop@256", "packed:loop@1024"]
    T = res["tokens"]
    for r in runs:
        assert r["benchmark"] == "extract_gpu" and r["tokens"] == T and r["tokens_per_s"] > 0
        assert r["bytes_written"] > T * 4 * 64 * 4 and r["write_bytes_per_s"] > 0
        assert 0 < r["forward_share"] <= 1 and 0 <= r["io_exposed_share"] < 1
        assert r["timing_s"]["forward_s"] > 0 and r["timing_s"]["write_s"] > 0
        if r["kernel"] == "padded":
            assert r["computed_tokens"] >= T
        else:  # packed: nothing but the real tokens is computed
            assert r["computed_tokens"] == T and r["padding_share"] == 0
    assert runs[1]["computed_tokens"] > T  # a padded budget of 1,024 pads the shorter samples of a batch
    assert res["benchmark"] == "extract_gpu" and res["tiny"] and res["samples"] > 10
    assert res["tokens_per_s"] > 0 and 0 < res["mfu"] < 1 and res["aux_layers"] == [1, 3, 4]
    assert res["best"] in [r["run"] for r in runs] and len(res["runs"]) == 4
    # file bytes per token: 3 aux + 1 final at float32 + ids/mask, nothing padded
    assert abs(res["file_bytes_per_token"] - (4 * 64 * 4 + 5)) < 2
    proj = res["kimi_k25_projection"]
    assert proj["mfu_assumed"] == 0.40 and proj["mfu_source"].startswith("assumed") and proj["hours"] == 0.94
