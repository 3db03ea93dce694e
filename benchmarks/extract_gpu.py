"""GPU extraction benchmark: tokens/s and model FLOP utilisation of ``extract()`` on a random 8B model.

    python benchmarks/extract_gpu.py                 # Llama-3.1-8B config, bf16, one GPU, < 5 minutes
    python benchmarks/extract_gpu.py --tiny          # the same code path on CPU with a tiny config (tests)

The model is Meta's public Llama-3.1-8B ``config.json`` (values written below, no download), randomly
initialised directly on the device in bf16 (weights never touch the disk). The data is a synthetic merged
shard with mixed lengths (lognormal, mean ~1,500, 16..8,192 tokens). The timed run is ``extract()`` end to end
(forwards with hooks, device-to-host copies, writing the safetensors file), after a warm-up shard.

MFU = useful model FLOPs / (seconds x peak). Useful FLOPs per sample of n tokens (forward only, no lm_head:
extraction computes no logits) = 2 x P x n + 2 x L x d x n^2, with P = decoder parameters without the
embedding (matmul weights + norms), L layers, d = hidden size (the attention term counts QK^T and AV under a
causal mask: 2 matmuls x 2 FLOPs x n^2/2 x d per layer). Padding computed inside a batch is not counted.
Peak: bf16 dense tensor TFLOPs of the detected GPU (H100/H200 989, A100 312, L40S 362, B200 2250) or
``--peak-tflops``. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B config.json (public)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
TINY = dict(LLAMA_31_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=4096, bos_token_id=1,
            eos_token_id=2)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "B200": 2250.0, "GH200": 989.0}


def decoder_params(cfg: dict) -> int:
    """Parameters of the decoder layers + final norm (no embedding, no lm_head)."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q = d * cfg["num_attention_heads"] * hd
    kv = 2 * d * cfg["num_key_value_heads"] * hd
    o = cfg["num_attention_heads"] * hd * d
    mlp = 3 * d * f
    return L * (q + kv + o + mlp + 2 * d) + d


def useful_flops(cfg: dict, lengths) -> float:
    P, L, d = decoder_params(cfg), cfg["num_hidden_layers"], cfg["hidden_size"]
    n = np.asarray(lengths, dtype=np.float64)
    return float(2 * P * n.sum() + 2 * L * d * (n ** 2).sum())


def make_shard(path: Path, tokens: int, vocab: int, max_len: int, seed: int = 0) -> list[int]:
    from eagle3_data import schemas

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(1000), 0.9), 16, max_len)))
    rows = []
    for i, n in enumerate(lengths):
        p = n // 2
        rows.append({"sample_id": f"g{i}", "dataset": "bench", "input_ids": rng.integers(0, vocab, n).tolist(),
                     "loss_mask": [0] * p + [1] * (n - p), "num_tokens": n, "num_supervised": n - p,
                     "truncated": False})
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", path)
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny config on CPU (tests the code path)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens in the timed shard (default 400k; tiny 3k)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per forward (default 32768)")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out-dir", default=None, help="where the extract file goes (default a temp dir)")
    a = ap.parse_args()

    from eagle3_data import extract as ex
    from eagle3_data.extract.transformers_backend import load_target

    cfg_dict = TINY if a.tiny else LLAMA_31_8B
    device = "cpu" if a.tiny else "cuda"
    dtype = "float32" if a.tiny else "bfloat16"
    tokens = a.tokens or (3_000 if a.tiny else 400_000)
    batch_tokens = a.batch_tokens or (2048 if a.tiny else 32768)
    max_len = min(a.max_len, 1024) if a.tiny else a.max_len
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --tiny on CPU)")

    from transformers import AutoModelForCausalLM, LlamaConfig

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-extract-gpu-", dir=a.out_dir) as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "llama-3.1-8b-random"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(cfg_dict))
        cfg = LlamaConfig(**cfg_dict)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        model.eval()
        init_s = time.perf_counter() - t0
        loaded = (model, model.get_decoder())
        layers = ex.default_layers(cfg_dict["num_hidden_layers"])

        warm = tmp / "warm.parquet"
        make_shard(warm, max(batch_tokens, tokens // 20), cfg_dict["vocab_size"], max_len, seed=1)
        ex.extract_states(warm, tmp / "warm.safetensors", model_path=model_dir, layers=layers, dtype=dtype,
                   batch_tokens=batch_tokens, model=loaded)
        (tmp / "warm.safetensors").unlink()

        shard = tmp / "000.parquet"
        lengths = make_shard(shard, tokens, cfg_dict["vocab_size"], max_len)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        info = ex.extract_states(shard, tmp / "000.safetensors", model_path=model_dir, layers=layers, dtype=dtype,
                          batch_tokens=batch_tokens, model=loaded)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        model_s = info["model_seconds"]
        peak_mem = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None

    flops = useful_flops(cfg_dict, lengths)
    if a.peak_tflops:
        peak, gpu = a.peak_tflops * 1e12, "given"
    elif device == "cuda":
        gpu = torch.cuda.get_device_name(0)
        key = next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in gpu), None)
        peak = PEAK_TFLOPS[key] * 1e12 if key else None
    else:
        peak, gpu = 1e12, "cpu (nominal 1 TFLOP/s; MFU meaningless)"
    T = info["num_tokens"]
    print(json.dumps({
        "benchmark": "extract_gpu", "tiny": a.tiny, "device": gpu if device == "cuda" else "cpu",
        "model": "Llama-3.1-8B config, random init" if not a.tiny else "tiny Llama",
        "dtype": dtype, "decoder_params": decoder_params(cfg_dict), "aux_layers": layers,
        "tokens": T, "samples": len(lengths), "batch_tokens": batch_tokens, "batches": info["batches"],
        "seconds_end_to_end": round(seconds, 2), "seconds_model_loop": round(model_s, 2),
        "tokens_per_s": round(T / seconds, 1), "tokens_per_s_model_loop": round(T / model_s, 1),
        "useful_tflops": round(flops / 1e12, 2),
        "achieved_tflops_per_s": round(flops / seconds / 1e12, 2),
        "mfu": round(flops / seconds / peak, 4) if peak else None, "peak_tflops": peak / 1e12 if peak else None,
        "file_bytes_per_token": round(info["bytes"] / T, 1), "peak_gpu_mem_gib": round(peak_mem, 1) if peak_mem else None,
        "init_s": round(init_s, 1), "total_s": round(time.perf_counter() - t_start, 1),
    }))


if __name__ == "__main__":
    main()
