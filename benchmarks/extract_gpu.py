"""GPU extraction benchmark: tokens/s, model FLOP utilisation and where the time goes, for the padded and packed
layouts at two batch sizes, on a random 8B model.

    python benchmarks/extract_gpu.py                 # Llama-3.1-8B config, bf16, one GPU (benchmarks/extract_gpu.sh)
    python benchmarks/extract_gpu.py --runs packed-flex:65536 --tokens 100000   # one layout/kernel
    python benchmarks/extract_gpu.py --tiny          # the same code path on CPU with a tiny config (tests)
    python benchmarks/extract_gpu.py --check-imports # the import path, with the packages a GPU machine lacks blocked
    python benchmarks/extract_gpu.py --gpu-tests     # pytest -m gpu tests/test_extract_gpu.py under the same guard

The model is Meta's public Llama-3.1-8B ``config.json`` (values written below, no download), randomly
initialised directly on the device in bf16 (weights never touch the disk). The data is a synthetic merged
shard of 200k tokens with mixed lengths (lognormal, median 1,024, mean ~1,500, 16..8,192 tokens). Each run is
``extract_states()`` end to end (forwards with hooks, device-to-host copies, writes of the safetensors file, its
flush and rename) with one ``extract.attention`` setting and ``batch_tokens``, after a warm-up on a shard of 1.5
batches (kernel selection, FlexAttention compilation of the first two shapes); its file is deleted after the run
(disk).

MFU = useful model FLOPs / (seconds x peak). Useful FLOPs per sample of n tokens (forward only, no lm_head:
extraction computes no logits) = 2 x P x n + 2 x L x d x n^2, with P = decoder parameters without the
embedding (matmul weights + norms), L layers, d = hidden size (the attention term counts QK^T and AV under a
causal mask: 2 matmuls x 2 FLOPs x n^2/2 x d per layer). Padding computed inside a batch is not counted.
Peak: bf16 dense tensor TFLOPs of the detected GPU (H100/H200 989, A100 312, L40S 362, B200 2250) or
``--peak-tflops``.

Output: one JSON line per run (tokens/s, MFU, peak GPU memory, bytes written per second, and the share of the
run's wall time in forward / device-to-host copy / file writing / waiting for the writer / final flush; the
copies and writes overlap the forwards, so ``io_exposed_share`` = (waiting + final flush) / wall time is what
they cost, ``loop_io_exposed_share`` the same without the final flush), then
one summary JSON line (the best run, the targets: MFU >= 40%, exposed I/O < 10% of wall time, peak memory
within the device; and the Kimi-K2.5 projection of :func:`projection` at the best run's MFU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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
            num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=16384, bos_token_id=1,
            eos_token_id=2)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "B200": 2250.0, "GH200": 989.0}
#: the runs of a default invocation: ``attention:batch_tokens`` (padded budgets count padding, packed ones don't)
RUNS = "padded:16384,padded:65536,packed:16384,packed:65536"
TINY_RUNS = "padded:256,padded:1024,packed:256,packed:1024"
#: the project's dependencies a GPU machine without package access lacks (it has torch, transformers,
#: safetensors, numpy, pyarrow, pandas, pytest and their own dependencies): extraction must not import them
ABSENT_ON_GPU_MACHINE = ("snakemake", "duckdb", "pandera", "tenacity", "aiolimiter", "jsonschema", "ijson",
                         "sglang")

# The seed's dataset totals (samples, tokens): 138.4M tokens in 40,114 samples; A1 ~16k tokens on average.
SEED_DATASETS = {
    "B1_glaive": (9998, 17.0e6), "B2_opencodeinstruct": (2932, 11.4e6), "B3_magicoder": (3383, 10.5e6),
    "B4_mixturethoughts": (1891, 10.2e6), "B5_openthoughts": (2112, 11.0e6), "B6_ultrachat": (5957, 11.1e6),
    "B7_sharegpt": (5476, 10.9e6), "B8_sweagent": (3565, 8.8e6), "A1_deepswekimi": (2800, 44.9e6),
    "A2_kimik25": (2000, 2.6e6),
}
SEED_HOURS, SEED_GPUS = 91.0, 8
#: Kimi-K2.5's language model (the DeepSeek-V3 architecture of Kimi K2): 61 layers, multi-head latent attention
#: with 64 heads, query/key head size 128 + 64 (rope) = 192, value head size 128; ~32B activated parameters
#: per token of ~1T (MoE: 8 routed experts of 384 + 1 shared)
KIMI_K25 = {"layers": 61, "heads": 64, "qk_head_dim": 192, "v_head_dim": 128, "active_params": 32e9}


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


def projection(mfu: float, *, peak_tflops: float = 989.0, gpus: int = SEED_GPUS, spread_sigma: float = 0.8,
               a1_sigma: float = 0.5) -> dict:
    """Hours to extract the seed's 138.4M tokens for Kimi-K2.5 on ``gpus`` GPUs (tensor parallel over all of
    them, as the SGLang backend runs it) at ``mfu`` of ``peak_tflops`` each, with the FLOP count above:
    ``2 x active parameters x tokens`` + causal attention ``layers x heads x (qk + v head size) x sum n^2``.
    ``sum n^2`` from the seed's per-dataset samples and tokens, with lognormal lengths (``E[n^2] = mean^2 x
    exp(sigma^2)``; sigma 0.8, 0.5 for the uniformly long A1: an assumption, the seed gives means only)."""
    k = KIMI_K25
    tokens = sum(t for _, t in SEED_DATASETS.values())
    sum_n2 = sum(n * (t / n) ** 2 * np.exp((a1_sigma if name.startswith("A1") else spread_sigma) ** 2)
                 for name, (n, t) in SEED_DATASETS.items())
    dense = 2 * k["active_params"] * tokens
    attention = k["layers"] * k["heads"] * (k["qk_head_dim"] + k["v_head_dim"]) * sum_n2
    seconds = (dense + attention) / (gpus * peak_tflops * 1e12 * mfu)
    return {"model": "Kimi-K2.5 (61 layers, MLA 64 heads qk 192 / v 128, ~32B active of ~1T)", "tokens": tokens,
            "samples": sum(n for n, _ in SEED_DATASETS.values()), "sum_n2": float(sum_n2),
            "dense_flops": dense, "attention_flops": float(attention), "flops": float(dense + attention),
            "gpus": gpus, "peak_tflops_per_gpu": peak_tflops, "mfu_assumed": mfu,
            "hours": round(seconds / 3600, 2), "seed_hours": SEED_HOURS,
            "seed_implied_mfu": round((dense + attention) / (SEED_HOURS * 3600 * gpus * peak_tflops * 1e12), 5)}


def make_shard(path: Path, tokens: int, vocab: int, max_len: int, seed: int = 0) -> list[int]:
    """A merged-schema shard of random ids with lognormal lengths (median ``max_len / 8``, sigma 0.9) in
    ``16..max_len`` (written with pyarrow only: no schema-value check, which needs pandera). Returns the
    lengths."""
    from eagle3_data import schemas
    from eagle3_data.io import write_parquet

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(max_len / 8), 0.9), 16, max_len)))
    rows = []
    for i, n in enumerate(lengths):
        p = n // 2
        rows.append({"sample_id": f"g{i}", "dataset": "bench", "input_ids": rng.integers(0, vocab, n).tolist(),
                     "loss_mask": [0] * p + [1] * (n - p), "num_tokens": n, "num_supervised": n - p,
                     "truncated": False})
    write_parquet(schemas.from_rows(rows, schemas.MERGED), path)
    return lengths


def block_imports() -> None:
    """Make the packages of :data:`ABSENT_ON_GPU_MACHINE` unimportable (``sys.modules[name] = None``: an import
    raises ImportError, ``importlib.util.find_spec`` says absent)."""
    for name in ABSENT_ON_GPU_MACHINE:
        if name in sys.modules and sys.modules[name] is not None:
            raise SystemExit(f"{name} was imported before the guard")
        sys.modules[name] = None


def check_imports() -> dict:
    """Import everything a GPU run uses (the guard must be on); returns the third-party packages loaded."""
    import importlib

    for mod in ("eagle3_data.extract", "eagle3_data.extract.stage", "eagle3_data.extract.transformers_backend",
                "eagle3_data.extract.writeback", "eagle3_data.schemas", "eagle3_data.devices",
                "torch.nn.attention.flex_attention", "safetensors", "transformers"):
        importlib.import_module(mod)
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: F401  (the lazy modules too)

    std = set(getattr(sys, "stdlib_module_names", ()))
    third = sorted({m.split(".")[0] for m, v in sys.modules.items() if v is not None} - std
                   - {"eagle3_data", "__main__"})
    return {"benchmark": "extract_gpu", "check_imports": True, "blocked": list(ABSENT_ON_GPU_MACHINE),
            "third_party_loaded": [m for m in third if not m.startswith("_")]}


def padded_tokens(lengths: list[int], batch_tokens: int) -> int:
    """Tokens a padded forward computes (padding included) for these lengths and budget."""
    from eagle3_data.extract.batching import padded_batches

    return sum(len(b) * max(lengths[i] for i in b) for b in padded_batches(lengths, batch_tokens))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny config on CPU (tests the code path)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens in the timed shard (default 200k; tiny 2k)")
    ap.add_argument("--runs", default=None, help=f"comma-separated attention:batch_tokens (default {RUNS}; "
                                                 f"tiny {TINY_RUNS})")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out-dir", default=None, help="where the extract files go (default a temp dir)")
    ap.add_argument("--block-imports", action="store_true",
                    help=f"make {', '.join(ABSENT_ON_GPU_MACHINE)} unimportable first (the GPU machine lacks them)")
    ap.add_argument("--check-imports", action="store_true", help="only import the GPU path (with the guard)")
    ap.add_argument("--gpu-tests", action="store_true",
                    help="run pytest -m gpu tests/test_extract_gpu.py with the guard, then exit with its status")
    a = ap.parse_args()

    if a.block_imports or a.check_imports or a.gpu_tests:
        block_imports()
    if a.check_imports:
        print(json.dumps(check_imports()))
        return
    if a.gpu_tests:
        import pytest

        root = Path(__file__).resolve().parents[1]
        raise SystemExit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "--rootdir", str(root),
                                      str(root / "tests" / "test_extract_gpu.py")]))

    import torch

    from eagle3_data import extract as ex
    from eagle3_data.settings import ExtractSettings

    cfg_dict = TINY if a.tiny else LLAMA_31_8B
    device = "cpu" if a.tiny else "cuda"
    dtype = "float32" if a.tiny else "bfloat16"
    tokens = a.tokens or (2_000 if a.tiny else 200_000)
    max_len = min(a.max_len, 512) if a.tiny else a.max_len
    runs = []
    for spec in (a.runs or (TINY_RUNS if a.tiny else RUNS)).split(","):
        att, _, bt = spec.strip().partition(":")
        runs.append((att, int(bt)))
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --tiny on CPU)")

    from transformers import AutoModelForCausalLM, LlamaConfig

    if a.peak_tflops:
        peak, gpu = a.peak_tflops * 1e12, "given"
    elif device == "cuda":
        gpu = torch.cuda.get_device_name(0)
        key = next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in gpu), None)
        peak = PEAK_TFLOPS[key] * 1e12 if key else None
    else:
        peak, gpu = 1e12, "cpu (nominal 1 TFLOP/s; MFU meaningless)"
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if device == "cuda" else None

    t_start = time.perf_counter()
    results = []
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

        warm = {}  # per budget: 1.5 batches, so the warm-up sees two batch shapes (FlexAttention compiles both)
        for bt in sorted({bt for _, bt in runs}):
            warm[bt] = tmp / f"warm{bt}.parquet"
            make_shard(warm[bt], bt * 3 // 2, cfg_dict["vocab_size"], max_len, seed=bt)
        shard = tmp / "000.parquet"
        lengths = make_shard(shard, tokens, cfg_dict["vocab_size"], max_len)
        flops = useful_flops(cfg_dict, lengths)
        settings = ExtractSettings.defaults(model_dir, layers=layers, dtype=dtype)

        for attention, batch_tokens in runs:
            try:  # one failing layout/kernel must not cost the others' figures (one GPU session, one try)
                run = settings.replace(attention=attention, batch_tokens=batch_tokens)
                ex.extract_states(warm[batch_tokens], tmp / "warm.safetensors", settings=run, model=loaded)
                (tmp / "warm.safetensors").unlink()
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                info = ex.extract_states(shard, tmp / "000.safetensors", settings=run, model=loaded)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                (tmp / "000.safetensors").unlink()
            except Exception as exc:  # noqa: BLE001 - reported in the run's JSON line
                import traceback

                traceback.print_exc()
                print(json.dumps({"benchmark": "extract_gpu", "run": f"{attention}@{batch_tokens}",
                                  "error": f"{type(exc).__name__}: {exc}"[:1000]}), flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            peak_mem = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None
            T, tm = info["num_tokens"], info["timing"]
            computed = padded_tokens(lengths, batch_tokens) if info["attention"] == "padded" else T
            share = {k.replace("_s", "_share"): round(v / seconds, 4) for k, v in tm.items()}
            res = {
                "benchmark": "extract_gpu", "run": f"{info['attention']}@{batch_tokens}", "attention": attention,
                "kernel": info["attention"], "batch_tokens": batch_tokens, "tokens": T, "samples": len(lengths),
                "batches": info["batches"], "computed_tokens": computed,
                "padding_share": round(1 - T / computed, 4),
                "seconds": round(seconds, 3), "tokens_per_s": round(T / seconds, 1),
                "mfu": round(flops / seconds / peak, 4) if peak else None,
                "mfu_forward_only": round(flops / tm["forward_s"] / peak, 4) if peak and tm["forward_s"] else None,
                "achieved_tflops_per_s": round(flops / seconds / 1e12, 2),
                "peak_gpu_mem_gib": round(peak_mem, 2) if peak_mem is not None else None,
                "bytes_written": info["bytes"], "write_bytes_per_s": round(info["bytes"] / seconds),
                "timing_s": tm, **share,
                "io_exposed_share": round((tm["wait_s"] + tm["flush_s"]) / seconds, 4),
                "loop_io_exposed_share": (round(tm["wait_s"] / info["model_seconds"], 4)
                                          if info["model_seconds"] else None),
                "non_forward_share": round(1 - tm["forward_s"] / seconds, 4),
            }
            results.append(res)
            print(json.dumps(res), flush=True)

    if not results:
        raise SystemExit("every run failed (see the error lines above)")
    best = max(results, key=lambda r: r["tokens_per_s"])
    on_gpu = device == "cuda" and peak is not None and best["mfu"] is not None
    T = results[0]["tokens"]
    print(json.dumps({
        "benchmark": "extract_gpu", "tiny": a.tiny, "device": gpu if device == "cuda" else "cpu",
        "gpu_mem_gib": round(gpu_mem, 1) if gpu_mem else None,
        "model": "Llama-3.1-8B config, random init" if not a.tiny else "tiny Llama",
        "dtype": dtype, "decoder_params": decoder_params(cfg_dict), "aux_layers": layers,
        "tokens": T, "samples": len(lengths), "max_len": max_len, "useful_tflops": round(flops / 1e12, 2),
        "peak_tflops": peak / 1e12 if peak else None,
        "runs": [{k: r[k] for k in ("run", "tokens_per_s", "mfu", "io_exposed_share", "peak_gpu_mem_gib")}
                 for r in results],
        "best": best["run"], "tokens_per_s": best["tokens_per_s"], "mfu": best["mfu"],
        "targets": {"mfu_ge_0.40": bool(on_gpu and best["mfu"] >= 0.40),
                    "io_exposed_lt_0.10": best["io_exposed_share"] < 0.10,
                    "peak_mem_within_device": bool(gpu_mem and max(r["peak_gpu_mem_gib"] for r in results) < gpu_mem)},
        "file_bytes_per_token": round(best["bytes_written"] / T, 1),
        "kimi_k25_projection": projection(best["mfu"] if on_gpu else 0.40,
                                          peak_tflops=PEAK_TFLOPS["H200"]) | {
            "mfu_source": f"measured ({best['run']}, dense 8B on {gpu})" if on_gpu else "assumed: the 40% target"},
        "init_s": round(init_s, 1), "total_s": round(time.perf_counter() - t_start, 1),
    }))


if __name__ == "__main__":
    main()
