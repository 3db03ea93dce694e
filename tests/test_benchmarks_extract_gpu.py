"""benchmarks/extract_gpu.py is correct by construction: its FLOP count and its --tiny run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import extract_gpu as g  # noqa: E402


def test_param_count_matches_transformers_and_flops():
    import torch
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
    del torch


def test_tiny_run_prints_one_json_line():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "extract_gpu.py"), "--tiny"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["benchmark"] == "extract_gpu" and res["tiny"] and res["tokens"] >= 3000
    assert res["tokens_per_s"] > 0 and res["useful_tflops"] > 0 and 0 < res["mfu"] < 1
    assert res["aux_layers"] == [1, 3, 4]
    # file bytes per token: 3 aux + 1 final at float32 + ids/mask, nothing padded
    assert abs(res["file_bytes_per_token"] - (4 * 64 * 4 + 5)) < 2
