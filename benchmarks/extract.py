"""Extraction benchmark (CPU): eagle3_data.extract vs a batch-1 ``output_hidden_states=True`` dumper.

    python benchmarks/extract.py [--samples 160] [--hidden 256] [--layers 8]
    python benchmarks/extract.py --toy    # seconds: 16 samples of a hidden-64 model (what CI runs)

Same tiny random Llama (built locally), same mixed-length samples (lognormal, 8..1,024 tokens), same dtype
(float32 for speed; CPU bf16 matmuls are emulated). Baseline = the Model-Optimizer HF dumper
(``compute_hidden_states_hf.py``): one sample at a time through the whole causal LM with
``output_hidden_states=True``, aux = cat(hidden_states[i+1]), final = hidden_states[-1], one ``torch.save``
file per sample. Ours = ``extract()`` (forward hooks, length-sorted batches under a token budget, one
safetensors file, no padding stored). Both include writing to disk; model loading is excluded.

Storage per token (bf16, as a real run stores): ours (as is, and with both savers) against SpecForge's padded
per-sample layout (``DataCollatorWithPadding`` batches of 32 in dataset order padded to the batch's longest
row, each sample saved at the padded length: aux 3H + final H bf16 + int64 ids + int64 mask, ``torch.save``).
The storage figures (two bf16 runs: CPU bf16 matmuls are emulated, hence slow) use the first
``--storage-samples`` samples (default 32; bytes per token do not depend on the count), so the default size ends
within minutes on 2 cores. ``flop_bound`` is the ceiling on the speed-up that any layout could reach on this CPU:
the decoder's FLOPs (no lm_head; counted as ``benchmarks/extract_gpu.py`` counts them, attention included) at the
best float32 matmul rate measured on the model's own shapes, against the baseline's measured time; beside it, the
time of ours split into matmuls, attention and the rest (the shares of one more run under the torch profiler)
against the time the 2x target allows. Ends with one JSON line (ratios and targets: speed >= 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def make_rows(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(160), 1.0, n), 8, 1024).astype(int)
    rows = []
    for i, L in enumerate(lengths):
        p = int(L * rng.uniform(0.3, 0.8))
        rows.append(
            {
                "sample_id": f"b{i}",
                "dataset": "bench",
                "input_ids": rng.integers(0, vocab, L).tolist(),
                "loss_mask": [0] * p + [1] * (L - p),
                "num_tokens": int(L),
                "num_supervised": int(L - p),
                "truncated": False,
            }
        )
    return rows


def baseline_dump(model, rows, layers, out_dir: Path) -> float:
    """Model-Optimizer HF approach: batch 1, output_hidden_states=True, torch.save per sample."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            out = model(input_ids=ids, output_hidden_states=True)
            hs = out.hidden_states
            aux = torch.cat([hs[i + 1] for i in layers], dim=-1)[0]
            torch.save(
                {
                    "input_ids": ids[0],
                    "hidden_states": hs[-1][0],
                    "aux_hidden_states": aux,
                    "loss_mask": torch.tensor(r["loss_mask"]),
                    "conversation_id": r["sample_id"],
                },
                out_dir / f"{r['sample_id']}.pt",
            )
    return time.perf_counter() - t0


def specforge_padded_bytes(rows, hidden: int, out_dir: Path, batch_size: int = 32) -> int:
    """Write SpecForge's padded per-sample files (bf16) and return their total size in bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for b in range(0, len(rows), batch_size):
        batch = rows[b : b + batch_size]
        longest = max(len(r["input_ids"]) for r in batch)
        for r in batch:
            n = len(r["input_ids"])
            ids = torch.zeros(longest, dtype=torch.long)
            ids[:n] = torch.tensor(r["input_ids"])
            mask = torch.zeros(longest, dtype=torch.long)
            mask[:n] = torch.tensor(r["loss_mask"])
            rec = {
                "input_ids": ids,
                "loss_mask": mask,
                "aux_hidden_state": torch.zeros(1, longest, 3 * hidden, dtype=torch.bfloat16),
                "hidden_state": torch.zeros(1, longest, hidden, dtype=torch.bfloat16),
            }
            p = out_dir / f"data_{r['sample_id']}.ckpt"
            torch.save(rec, p)
            total += p.stat().st_size
    return total


def gemm_rate(hidden: int, intermediate: int, dtype=torch.float32, reps: int = 5) -> float:
    """The best float32 matmul rate this CPU reaches on the model's own shapes (FLOP/s): ``[m, hidden] @ [hidden,
    intermediate]`` and back, m in 2,048 / 8,192 rows, best of ``reps``; a generous ceiling for any layout."""
    best = 0.0
    with torch.inference_mode():
        for m in (2048, 8192):
            for k, n in ((hidden, intermediate), (intermediate, hidden)):
                a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
                a @ b  # warm-up
                for _ in range(reps):
                    t0 = time.perf_counter()
                    a @ b
                    best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
    return best


def time_shares(fn) -> dict:
    """Run ``fn()`` under the torch profiler (CPU) and return the shares of its operators' self CPU time: ``matmul``
    (``aten::mm`` / ``addmm`` / ``bmm``), ``attention`` (the scaled-dot-product kernels), ``other`` (norms,
    rotary, activations, copies, ...)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        if ev.key in ("aten::mm", "aten::addmm", "aten::bmm"):
            parts["matmul"] += ev.self_cpu_time_total
        elif "scaled_dot_product" in ev.key or "flash_attention" in ev.key:
            parts["attention"] += ev.self_cpu_time_total
        else:
            parts["other"] += ev.self_cpu_time_total
    total = sum(parts.values()) or 1.0
    return {k: round(v / total, 3) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--storage-samples", type=int, default=32, help="samples of the bf16 storage figures")
    ap.add_argument("--toy", action="store_true", help="16 samples, hidden 64: seconds (CI runs it)")
    a = ap.parse_args()
    if a.toy:
        a.samples, a.hidden, a.vocab = 16, 64, 512
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from eagle3_data import extract as ex
    from eagle3_data.extract.transformers_backend import load_target
    from eagle3_data import schemas
    from eagle3_data.settings import ExtractSettings

    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "tiny"
        build_model(model_dir, a.hidden, a.layers, a.vocab)
        rows = make_rows(a.samples, a.vocab)
        T = sum(r["num_tokens"] for r in rows)
        merged = tmp / "000.parquet"
        schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", merged)
        layers = ex.default_layers(a.layers)

        loaded = load_target(model_dir, dtype="float32", device="cpu")
        # warm-up both paths once on a few samples (allocator, kernels)
        baseline_dump(loaded[0], rows[:4], layers, tmp / "warm")
        s32 = ExtractSettings.defaults(model_dir, layers=layers, batch_tokens=a.batch_tokens, dtype="float32")
        ex.extract_states(merged, tmp / "warm.safetensors", settings=s32, model=loaded)

        base_s = baseline_dump(loaded[0], rows, layers, tmp / "baseline")
        t0 = time.perf_counter()
        info = ex.extract_states(merged, tmp / "ours.safetensors", settings=s32, model=loaded)
        ours_s = time.perf_counter() - t0
        # where ours spends its time (one more run, profiled: shares of the operators' CPU time)
        shares = time_shares(
            lambda: ex.extract_states(merged, tmp / "profiled.safetensors", settings=s32, model=loaded)
        )

        # storage at bf16, on the first --storage-samples samples
        srows = rows[: max(1, a.storage_samples)]
        sT = sum(r["num_tokens"] for r in srows)
        smerged = tmp / "storage.parquet"
        schemas.write_checked(schemas.from_rows(srows, schemas.MERGED), "merged", smerged)
        base_bytes32 = sum((tmp / "baseline" / f"{r['sample_id']}.pt").stat().st_size for r in srows)
        loaded16 = load_target(model_dir, dtype="bfloat16", device="cpu")
        s16 = s32.replace(dtype="bfloat16")
        i16 = ex.extract_states(smerged, tmp / "ours16.safetensors", settings=s16, model=loaded16)
        isv = ex.extract_states(
            smerged,
            tmp / "saved16.safetensors",
            model=loaded16,
            settings=s16.replace(final_states="supervised", aux_format="fp8_e4m3"),
        )
        sf_bytes = specforge_padded_bytes(srows, a.hidden, tmp / "specforge")
        padded_tokens = sum(
            max(len(r["input_ids"]) for r in srows[b : b + 32]) * len(srows[b : b + 32])
            for b in range(0, len(srows), 32)
        )

        # saver error against bf16
        tb, _ = ex.load_states(tmp / "ours16.safetensors")
        ts, _ = ex.load_states(tmp / "saved16.safetensors")
        ref, got = tb["aux_hidden_states"].float(), ts["aux_hidden_states"].float()
        cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
        fm = ts["final_mask"]
        fin_err = (tb["hidden_states"][fm].float() - ts["hidden_states"][fm].float()).abs().max().item()

    # the speed-up no layout can beat on this CPU: ours computes the decoder's FLOPs (no lm_head), counted as
    # benchmarks/extract_gpu.py counts them, at the best matmul rate measured here; the baseline's time as measured
    from eagle3_data.testing.flops import useful_flops

    cfg = loaded[0].config.to_dict()
    flops = useful_flops(cfg, [r["num_tokens"] for r in rows])
    rate = gemm_rate(a.hidden, cfg["intermediate_size"])
    floor_s = flops / rate
    speed = (T / ours_s) / (T / base_s)
    print(
        json.dumps(
            {
                "benchmark": "extract",
                "toy": a.toy,
                "model": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "aux_layers": layers},
                "samples": len(rows),
                "tokens": T,
                "lengths": {"min": min(r["num_tokens"] for r in rows), "max": max(r["num_tokens"] for r in rows)},
                "baseline_batch1_tokens_per_s": round(T / base_s, 1),
                "ours_tokens_per_s": round(T / ours_s, 1),
                "ours_batches": info["batches"],
                "ours_attention": info["attention"],
                "speedup": round(speed, 2),
                "target_speedup_min": 2.0,
                "speedup_ok": speed >= 2.0,
                "flop_bound": {
                    "useful_gflops": round(flops / 1e9, 2),
                    "best_matmul_gflops_per_s": round(rate / 1e9, 1),
                    "ours_achieved_gflops_per_s": round(flops / ours_s / 1e9, 1),
                    "floor_s": round(floor_s, 3),
                    "ours_s": round(ours_s, 3),
                    "baseline_s": round(base_s, 3),
                    "speedup_ceiling": round(base_s / floor_s, 2),
                    # the run's time split by the profiled shares, against the time the 2x target allows
                    "ours_s_by_part": {k: round(v * ours_s, 3) for k, v in shares.items()},
                    "target_s": round(base_s / 2.0, 3),
                },
                "storage_samples": len(srows),
                "storage_tokens": sT,
                "bytes_per_token_bf16": {
                    "ours": round(i16["bytes"] / sT, 1),
                    "ours_fp8_aux_supervised_final": round(isv["bytes"] / sT, 1),
                    "specforge_padded_per_sample": round(sf_bytes / sT, 1),
                    "baseline_modelopt_pt_float32": round(base_bytes32 / sT, 1),
                },
                "specforge_padding_overhead": round(padded_tokens / sT, 3),
                "storage_ratio_specforge_vs_ours": round(sf_bytes / i16["bytes"], 2),
                "savers_error_vs_bf16": {
                    "aux_fp8_max_abs": round((ref - got).abs().max().item(), 5),
                    "aux_fp8_min_cosine": round(cos.min().item(), 6),
                    "aux_fp8_mean_cosine": round(cos.mean().item(), 6),
                    "final_supervised_max_abs": fin_err,
                    "final_rows_stored_share": round(isv["final_rows"] / sT, 3),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
