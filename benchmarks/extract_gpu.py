"""GPU extraction benchmark: tokens/s per GPU, model FLOP utilisation (MFU) and where the time goes, for the packed
transformers backend on a random 8B model with the states written to local disk in the shipped layout, once with
bf16 auxiliary states and once with fp8 ones; packed == one-by-one states on a sample; a profile of one batch's
forward.

    python benchmarks/extract_gpu.py --block-imports # Llama-3.1-8B config, bf16, one GPU (benchmarks/extract_gpu.sh)
    python benchmarks/extract_gpu.py --runs packed-flex:65536 --only-runs --tokens 100000   # one layout/kernel
    python benchmarks/extract_gpu.py --tiny          # the same code path on CPU with a tiny config (tests)
    python benchmarks/extract_gpu.py --check-imports # the import path, with the packages a GPU machine lacks blocked
    python benchmarks/extract_gpu.py --gpu-tests     # pytest -m gpu tests/gpu/test_extract_gpu.py under the same guard

The model is Meta's public Llama-3.1-8B ``config.json`` (values written below, no download), randomly
initialised directly on the device in bf16 (weights never touch the disk). The data is a synthetic merged
shard of 400k tokens (fewer when the disk is short) with mixed lengths (lognormal, median 1,024, mean ~1,500,
16..8,192 tokens). Each run is ``extract_states()`` end to end (forwards with hooks, device-to-host copies,
writes of the safetensors file, its flush and rename) with one ``extract.attention``, ``batch_tokens`` and
``aux_format``, after a warm-up on a shard of 2.25 batches (kernel selection, the two pinned host buffers,
FlexAttention compilation); its file is deleted after the run (disk).

MFU = useful model FLOPs / (seconds x peak). Useful FLOPs per sample of n tokens (forward only, no lm_head:
extraction computes no logits) = 2 x P x n + 2 x L x d x n^2, with P = decoder parameters without the
embedding (matmul weights + norms), L layers, d = hidden size (the attention term counts QK^T and AV under a
causal mask: 2 matmuls x 2 FLOPs x n^2/2 x d per layer). Padding computed inside a batch is not counted.
Peak: bf16 dense tensor TFLOPs of the detected GPU (H100/H200 989, A100 312, L40S 362, B200 2250) or
``--peak-tflops``.

Output: JSON lines (each also appended to ``--jsonl``), ``kind``:

- ``imports`` (with ``--block-imports``): the third-party packages the GPU path loaded with the guard on;
- ``check``: the packed states of a sample of mixed lengths (one forward) against the same samples forwarded one
  at a time, through the same kernel and through the model's own attention: per tensor the max abs error, the
  reference's max abs and their ratio, within ``2^-5`` (tests/gpu/test_extract_gpu.py's bf16 bound); and the fp8
  auxiliary states against the bf16 ones, relative to each token and layer's max abs (bound 16/448: half of
  e4m3's spacing in its top binade, at the scale's 448);
- ``run``, one per run: tokens/s, MFU (whole run and forward only), peak GPU memory, bytes written/s, and the
  share of the run's wall time in forward / device-to-host copy / file writing / waiting for the writer /
  final flush. The copies and writes overlap the forwards, so ``io_exposed_share`` = (waiting + final flush) /
  wall time is what they cost (``drain_s``: the part of waiting after the last forward; ``loop_io_exposed_share``
  the waits before it, over the forwards' wall time); ``targets`` (the throughput and MFU ones hold for the 8B
  config on a GPU only: False with ``--tiny``) and, for each missed one, ``why`` (the summary's adds the profile);
- ``profile``: one mixed batch's forward under ``torch.profiler``: the device time in matmuls, attention and
  elementwise/norm operators (shares, and the matmuls' and attention's TFLOP/s), the top operators, the share of
  the forward the device was busy, the host synchronisations in it, and whether the lm_head ran;
- ``summary``: the best run and the issue's targets: >= 30,000 tokens/s and MFU >= 45% with writes on, exposed
  copies and writes < 10% of wall time, peak memory within the device; the disk's own write rate; the
  Kimi-K2.5 projection of :func:`projection` at the best run's MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from eagle3_data.testing.flops import decoder_params, useful_flops  # noqa: F401  (counted here, tested as g.*)

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B config.json (public)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
TINY = dict(
    LLAMA_31_8B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    max_position_embeddings=16384,
    bos_token_id=1,
    eos_token_id=2,
)
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
    "GH200": 989.0,
}
#: the runs of a default invocation: ``attention:batch_tokens[:fp8]`` (``fp8``: ``aux_format: fp8_e4m3``; padded
#: budgets count padding, packed ones don't); the optional ones run after the profile when time is left
RUNS = "packed:65536:eager,packed:65536,packed:65536:fp8"
OPTIONAL_RUNS = "packed:131072"
TINY_RUNS = "packed:1024:eager,packed:1024,packed:1024:fp8:eager"
TINY_OPTIONAL_RUNS = "packed:2048"
#: the issue's targets for the 8B config on one H200 with writes on
TARGET_TOKENS_PER_S, TARGET_MFU, TARGET_IO_EXPOSED = 30_000, 0.45, 0.10
#: bf16 bound of the packed == one-by-one check (tests/gpu/test_extract_gpu.py): max |a - b| <= 2^-5 x max |b|
CHECK_TOL = 2.0**-5
#: fp8 e4m3 bound relative to a token-layer's max abs: half the spacing (32) of the top binade, over 448
FP8_BOUND = 16 / 448
#: the project's dependencies a GPU machine without package access lacks (it has torch, transformers,
#: safetensors, numpy, pyarrow, pandas, pytest and their own dependencies): extraction must not import them
ABSENT_ON_GPU_MACHINE = ("snakemake", "duckdb", "pandera", "tenacity", "aiolimiter", "jsonschema", "ijson", "sglang")

# The seed's dataset totals (samples, tokens): 138.4M tokens in 40,114 samples; A1 ~16k tokens on average.
SEED_DATASETS = {
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
SEED_HOURS, SEED_GPUS = 91.0, 8
#: Kimi-K2.5's language model (the DeepSeek-V3 architecture of Kimi K2): 61 layers, multi-head latent attention
#: with 64 heads, query/key head size 128 + 64 (rope) = 192, value head size 128; ~32B activated parameters
#: per token of ~1T (MoE: 8 routed experts of 384 + 1 shared)
KIMI_K25 = {"layers": 61, "heads": 64, "qk_head_dim": 192, "v_head_dim": 128, "active_params": 32e9}


def projection(
    mfu: float, *, peak_tflops: float = 989.0, gpus: int = SEED_GPUS, spread_sigma: float = 0.8, a1_sigma: float = 0.5
) -> dict:
    """Hours to extract the seed's 138.4M tokens for Kimi-K2.5 on ``gpus`` GPUs (tensor parallel over all of
    them, as the SGLang backend runs it) at ``mfu`` of ``peak_tflops`` each, with the FLOP count above:
    ``2 x active parameters x tokens`` + causal attention ``layers x heads x (qk + v head size) x sum n^2``.
    ``sum n^2`` from the seed's per-dataset samples and tokens, with lognormal lengths (``E[n^2] = mean^2 x
    exp(sigma^2)``; sigma 0.8, 0.5 for the uniformly long A1: an assumption, the seed gives means only)."""
    k = KIMI_K25
    tokens = sum(t for _, t in SEED_DATASETS.values())
    sum_n2 = sum(
        n * (t / n) ** 2 * np.exp((a1_sigma if name.startswith("A1") else spread_sigma) ** 2)
        for name, (n, t) in SEED_DATASETS.items()
    )
    dense = 2 * k["active_params"] * tokens
    attention = k["layers"] * k["heads"] * (k["qk_head_dim"] + k["v_head_dim"]) * sum_n2
    seconds = (dense + attention) / (gpus * peak_tflops * 1e12 * mfu)
    return {
        "model": "Kimi-K2.5 (61 layers, MLA 64 heads qk 192 / v 128, ~32B active of ~1T)",
        "tokens": tokens,
        "samples": sum(n for n, _ in SEED_DATASETS.values()),
        "sum_n2": float(sum_n2),
        "dense_flops": dense,
        "attention_flops": float(attention),
        "flops": float(dense + attention),
        "gpus": gpus,
        "peak_tflops_per_gpu": peak_tflops,
        "mfu_assumed": mfu,
        "hours": round(seconds / 3600, 2),
        "seed_hours": SEED_HOURS,
        "seed_implied_mfu": round((dense + attention) / (SEED_HOURS * 3600 * gpus * peak_tflops * 1e12), 5),
    }


def make_shard(path: Path, tokens: int, vocab: int, max_len: int, seed: int = 0, lengths=None) -> list[int]:
    """A merged-schema shard of random ids: ``lengths`` if given, else lognormal lengths (median ``max_len / 8``,
    sigma 0.9) in ``16..max_len`` up to ``tokens`` (written with pyarrow only: no schema-value check, which needs
    pandera). Returns the lengths."""
    from eagle3_data import schemas
    from eagle3_data.files import write_parquet

    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths, total = [], 0
        while total < tokens:
            lengths.append(int(np.clip(rng.lognormal(np.log(max_len / 8), 0.9), 16, max_len)))
            total += lengths[-1]
    rows = []
    for i, n in enumerate(lengths):
        p = n // 2
        rows.append(
            {
                "sample_id": f"g{i}",
                "dataset": "bench",
                "input_ids": rng.integers(0, vocab, n).tolist(),
                "loss_mask": [0] * p + [1] * (n - p),
                "num_tokens": n,
                "num_supervised": n - p,
                "truncated": False,
            }
        )
    write_parquet(schemas.from_rows(rows, schemas.MERGED), path)
    return list(lengths)


class _Stop(BaseException):
    """SIGTERM (the step's time limit): stop the run in progress, print the summary of those done."""


_SIGNAL = {"emitting": False, "pending": False}


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop; the summary must not be cut by a second
    if _SIGNAL["emitting"]:  # a line being written: stop right after it (Emit raises)
        _SIGNAL["pending"] = True
        return
    raise _Stop()


class Emit:
    """Append each JSON line to ``path`` and print it (flushed), so a run cut short keeps its lines; a SIGTERM
    meanwhile takes effect once both are done (a line is in both places or in neither)."""

    def __init__(self, path=None):
        self.path = path

    def __call__(self, obj: dict, final: bool = False) -> dict:
        line = json.dumps({"benchmark": "extract_gpu", **obj})
        _SIGNAL["emitting"] = True
        try:
            if self.path:
                with open(self.path, "a") as fh:
                    fh.write(line + "\n")
            print(line, flush=True)
        finally:
            _SIGNAL["emitting"] = False
        if _SIGNAL["pending"] and not final:
            _SIGNAL["pending"] = False
            raise _Stop()
        return obj


def _num(x, digits: int = 4):
    """A float for JSON: ``digits`` significant digits, None for NaN/inf."""
    x = float(x)
    return float(f"{x:.{digits}g}") if np.isfinite(x) else None


def disk_write_rate(directory, nbytes: int = 1 << 30, chunk: int = 64 << 20) -> float:
    """GB/s writing ``nbytes`` of random bytes to a new file in ``directory`` (``os.write``, then one fsync): the
    disk's own rate, beside the runs' writes. The file is removed."""
    buf = memoryview(np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes())
    fd, path = tempfile.mkstemp(dir=directory, prefix=".disk-probe-")
    try:
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // chunk)):
            view = buf
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        return max(1, nbytes // chunk) * chunk / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)


def max_err(got, ref) -> dict:
    """``max_abs_err``, ``ref_max_abs`` and ``rel`` (their ratio) of two float tensors of one shape, in float32."""
    g, r = got.float(), ref.float()
    err = float((g - r).abs().max()) if g.numel() else 0.0
    top = float(r.abs().max()) if r.numel() else 0.0
    rel = err / top if top > 0 else (0.0 if err == 0 else float("inf"))
    return {"max_abs_err": _num(err), "ref_max_abs": _num(top), "rel": _num(rel)}


def check_packed_vs_single(tmp: Path, settings, loaded, vocab: int, max_len: int, batch_tokens: int) -> dict:
    """The ``check`` line (module docstring): a sample of 8 lengths from ``max_len`` down to 1 extracted packed
    (one forward), one sample per forward through the same kernel and through the model's own attention
    (``padded``, batch 1), and packed with fp8 auxiliary states; the files read back and compared."""
    import torch

    from eagle3_data import extract as ex

    lengths = [n for n in (max_len, max_len // 2, max_len // 8, 333, 130, 17, 7, 1) if n <= max_len]
    sel = tmp / "check.parquet"
    make_shard(sel, 0, vocab, max_len, seed=7, lengths=lengths)
    packed_bt = max(batch_tokens, sum(lengths))
    t0 = time.perf_counter()
    files, infos = {}, {}
    for name, kw in (
        ("packed", dict(attention="packed", batch_tokens=packed_bt)),
        ("one_by_one", dict(attention="packed", batch_tokens=1)),
        ("one_by_one_model_attention", dict(attention="padded", batch_tokens=1)),
        ("packed_fp8", dict(attention="packed", batch_tokens=packed_bt, aux_format="fp8_e4m3")),
    ):
        path = tmp / f"check-{name}.safetensors"
        infos[name] = ex.extract_states(sel, path, settings=settings.replace(**kw), model=loaded)
        files[name] = ex.load_states(path, dtype=torch.float32)[0]
        path.unlink()
    keys = ("aux_hidden_states", "hidden_states")
    dev = loaded[0].get_input_embeddings().weight.device  # compared where the model is (GPU: seconds less)
    files = {name: {k: f[k].to(dev) for k in keys} for name, f in files.items()}
    ref = files["packed"]
    out = {
        "kind": "check",
        "check": "packed_vs_one_by_one",
        "dtype": settings.dtype,
        "kernel": infos["packed"]["attention"],
        "model_attention": str(loaded[0].config._attn_implementation),
        "samples": len(lengths),
        "tokens": sum(lengths),
        "lengths": lengths,
        "batches": {k: v["batches"] for k, v in infos.items()},
    }
    for name in ("one_by_one", "one_by_one_model_attention"):
        out[f"vs_{name}"] = {k: max_err(ref[k], files[name][k]) for k in keys}
    finite = all(bool(torch.isfinite(f[k]).all()) for f in files.values() for k in keys)
    T, A, H = ref["aux_hidden_states"].shape[0], len(infos["packed"]["layers"]), infos["packed"]["hidden_size"]
    bf, q = ref["aux_hidden_states"].reshape(T, A, H), files["packed_fp8"]["aux_hidden_states"].reshape(T, A, H)
    amax = bf.abs().amax(-1)
    rel = ((q - bf).abs().amax(-1) / amax.clamp_min(1e-30))[amax > 0]
    worst = float(rel.max()) if rel.numel() else 0.0
    fp8 = {
        "max_abs_err": _num((q - bf).abs().max()),
        "max_rel_to_token_amax": _num(worst, 6),
        "bound": _num(FP8_BOUND, 6),
        "ok": bool(worst <= FP8_BOUND * (1 + 1e-4)),
    }  # (fp32 scale arithmetic)
    out["fp8_aux_vs_packed"] = fp8
    out["fp8_final_vs_packed"] = max_err(files["packed_fp8"]["hidden_states"], ref["hidden_states"])
    out["tol_rel"] = CHECK_TOL
    out["finite"] = finite
    out["ok"] = bool(
        finite
        and fp8["ok"]
        and all(
            v["rel"] is not None and v["rel"] <= CHECK_TOL
            for name in ("one_by_one", "one_by_one_model_attention")
            for v in out[f"vs_{name}"].values()
        )
    )
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
_ATTENTION_MARKS = ("flash_attention", "scaled_dot_product", "efficient_attention", "flex_attention", "cudnn_attention")


def op_category(name: str) -> str:
    """``matmul``, ``attention`` or ``elementwise_norm`` (norms, rotary, activation, residual adds, casts,
    concatenations, copies) for a profiler operator name."""
    if name in _MATMUL_OPS:
        return "matmul"
    if any(m in name for m in _ATTENTION_MARKS):
        return "attention"
    return "elementwise_norm"


def profile_forward(
    model_dir, loaded, layers, dtype: str, shard_path, batch_tokens: int, cfg: dict, peak, fused: str = "off"
) -> dict:
    """The ``profile`` line: one packed forward of a mixed batch (the shard's samples in file order, up to
    ``batch_tokens``) under ``torch.profiler``, after one unprofiled forward at the same shapes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eagle3_data.extract.layout import TokenShard
    from eagle3_data.extract.transformers_backend import TransformersBackend

    shard = TokenShard(shard_path)
    idx, used = [], 0
    for i, n in enumerate(shard.lengths):
        if used + n <= batch_tokens:
            idx.append(i)
            used += n
    lengths = [shard.lengths[i] for i in idx]
    ids = [shard.sample_ids_of(i) for i in idx]
    model, _ = loaded
    cuda = model.get_input_embeddings().weight.device.type == "cuda"
    be = TransformersBackend(model_dir, layers=layers, dtype=dtype, loaded=loaded, attention="packed", fused=fused)
    head = model.get_output_embeddings()
    lm_calls = []
    hook = head.register_forward_hook(lambda *a: lm_calls.append(1)) if head is not None else None
    try:
        be.capture(ids)
        if cuda:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            out = be.capture(ids)
            if cuda:
                end.record()
            wall = time.perf_counter() - t0
            del out
        if cuda:
            end.synchronize()
            forward_ms = start.elapsed_time(end)
        else:
            forward_ms = wall * 1000
    finally:
        be.close()
        if hook is not None:
            hook.remove()
    # per operator, the device time of the kernels it launched itself (CPU: its own CPU time); on CUDA the
    # kernels' (and copies') own events besides, for the busy time and the top kernels
    from torch.autograd import DeviceType

    parts = {"matmul": 0.0, "attention": 0.0, "elementwise_norm": 0.0}
    ops: dict = {}
    kernels: dict = {}
    syncs: dict = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CPU:
            if "Synchronize" in ev.name or ev.name == "cudaMemcpy":
                syncs[ev.name] = syncs.get(ev.name, 0) + 1
            if getattr(ev, "is_async", False) or not ev.name.startswith("aten::"):
                continue
            us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
            if us > 0:
                parts[op_category(ev.name)] += us
                ops[ev.name] = ops.get(ev.name, 0.0) + us
        elif cuda:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.time_range.elapsed_us()
    # the fused (compiled) kernels run under no aten:: operator: their own kernel events are elementwise work
    fused_us = sum(us for name, us in kernels.items() if name.startswith("triton")) if cuda else 0.0
    parts["elementwise_norm"] += fused_us
    attributed_ms = sum(parts.values()) / 1000
    busy_ms = sum(kernels.values()) / 1000 if cuda else attributed_ms
    L, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    T = sum(lengths)
    mm_flops = 2 * (decoder_params(cfg) - L * 2 * d - d) * T
    att_flops = 2 * L * d * float(np.sum(np.square(np.asarray(lengths, dtype=np.float64))))
    total = sum(parts.values()) or 1.0
    res = {
        "kind": "profile",
        "kernel": be.attention,
        "fused": be.fused,
        "fused_kernels_ms": round(fused_us / 1000, 2),
        "tokens": T,
        "samples": len(lengths),
        "max_len": max(lengths),
        "forward_ms": round(forward_ms, 2),
        "device_busy_ms": round(busy_ms, 2),
        "attributed_ms": round(attributed_ms, 2),
        "busy_share": round(busy_ms / forward_ms, 4) if forward_ms else None,
        "shares": {k: round(v / total, 4) for k, v in parts.items()},
        "ms": {k: round(v / 1000, 2) for k, v in parts.items()},
        "matmul_tflops": _num(mm_flops / (parts["matmul"] / 1e6) / 1e12, 3) if parts["matmul"] else None,
        "attention_tflops": _num(att_flops / (parts["attention"] / 1e6) / 1e12, 3) if parts["attention"] else None,
        "forward_mfu": round(useful_flops(cfg, lengths) / (forward_ms / 1000) / peak, 4) if peak else None,
        "top_ops": [
            {"op": k, "ms": round(us / 1000, 2), "share": round(us / total, 4)}
            for k, us in sorted(ops.items(), key=lambda kv: -kv[1])[:10]
        ],
        "top_kernels": [
            {"kernel": k[:120], "ms": round(us / 1000, 2)}
            for k, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
        ],
        "host_syncs": syncs,
        "lm_head_calls": len(lm_calls),
    }
    return res


def why(r: dict, prof: dict | None, flops_per_token: float, peak, disk_gb_s) -> list[str]:
    """What a run's figures say about each target it misses (one sentence each)."""
    out, tm, sec = [], r["timing_s"], r["seconds"]
    slow = (r["mfu"] is not None and r["mfu"] < TARGET_MFU) or r["tokens_per_s"] < TARGET_TOKENS_PER_S
    if slow:
        f = r["mfu_forward_only"]
        if f is not None and f < TARGET_MFU:
            s = (
                f"the forwards alone reach MFU {f} < {TARGET_MFU} (they are {r['forward_share']:.1%} of the run's "
                "wall time)"
            )
            if prof and prof.get("shares"):
                sh = prof["shares"]
                s += (
                    f"; one batch's device time: matmul {sh['matmul']:.1%} at {prof['matmul_tflops']} TFLOP/s, "
                    f"attention {sh['attention']:.1%} at {prof['attention_tflops']} TFLOP/s, elementwise/norm "
                    f"{sh['elementwise_norm']:.1%}; device busy {prof['busy_share']:.1%} of the forward"
                )
            out.append(s)
        else:
            out.append(
                f"the forwards reach MFU {f} but are {r['forward_share']:.1%} of the run: exposed I/O "
                f"{r['io_exposed_share']:.1%}, other host time {r['other_share']:.1%} (shard read, file "
                "header, per-batch Python, fp8 quantisation on the compute stream)"
            )
        if peak:
            need = TARGET_TOKENS_PER_S * flops_per_token / peak
            out.append(
                f"{flops_per_token / 1e9:.2f} GFLOP per token: {TARGET_TOKENS_PER_S:,} tokens/s needs MFU {need:.3f}"
            )
    if r["io_exposed_share"] >= TARGET_IO_EXPOSED:
        loop_wait = tm["wait_s"] - tm.get("drain_s", 0.0)
        out.append(
            f"exposed copies/writes {r['io_exposed_share']:.1%} of {sec} s: waits during the forwards "
            f"{loop_wait:.2f} s, drain after the last forward {tm.get('drain_s', 0.0):.2f} s, final flush "
            f"{tm['flush_s']:.2f} s; the writer thread took {tm['write_s']:.2f} s for {r['bytes_written'] / 1e9:.2f} "
            f"GB ({r['write_gb_s_while_writing']} GB/s; the disk alone {disk_gb_s} GB/s), the device-to-host copies "
            f"{tm['copy_s']:.2f} s ({r['d2h_gb_s']} GB/s)"
        )
    if r.get("peak_mem_ok") is False:
        out.append(f"peak GPU memory {r['peak_gpu_mem_gib']} GiB exceeds the device")
    return out


def gpu_state() -> str | None:
    """nvidia-smi's clocks, power and temperature now (None without nvidia-smi)."""
    try:
        q = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=15,
        )
        return q.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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

    for mod in (
        "eagle3_data.extract",
        "eagle3_data.extract.stage",
        "eagle3_data.extract.transformers_backend",
        "eagle3_data.extract.writeback",
        "eagle3_data.schemas",
        "eagle3_data.devices",
        "torch.nn.attention.flex_attention",
        "safetensors",
        "transformers",
    ):
        importlib.import_module(mod)
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: F401  (the lazy modules too)

    std = set(getattr(sys, "stdlib_module_names", ()))
    third = sorted(
        {m.split(".")[0] for m, v in sys.modules.items() if v is not None} - std - {"eagle3_data", "__main__"}
    )
    return {
        "benchmark": "extract_gpu",
        "check_imports": True,
        "blocked": list(ABSENT_ON_GPU_MACHINE),
        "third_party_loaded": [m for m in third if not m.startswith("_")],
    }


def padded_tokens(lengths: list[int], batch_tokens: int) -> int:
    """Tokens a padded forward computes (padding included) for these lengths and budget."""
    from eagle3_data.extract.batching import padded_batches

    return sum(len(b) * max(lengths[i] for i in b) for b in padded_batches(lengths, batch_tokens))


def parse_runs(spec: str) -> list[tuple[str, int, str, str]]:
    """``attention:batch_tokens[:fp8][:eager],...`` -> ``[(attention, batch_tokens, aux_format, fused)]``
    (``fp8``: ``aux_format: fp8_e4m3``; ``eager``: ``extract.fused: off``, else ``on``)."""
    runs = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        att, bt, *rest = part.split(":")
        if set(rest) - {"fp8", "same", "eager"}:
            raise SystemExit(f"bad run {part!r}: attention:batch_tokens[:fp8][:eager]")
        runs.append((att, int(bt), "fp8_e4m3" if "fp8" in rest else "same", "off" if "eager" in rest else "on"))
    return runs


def run_name(kernel: str, batch_tokens: int, aux: str, fused: str) -> str:
    """``packed:varlen@65536+fp8+eager``: the kernel, the budget, fp8 auxiliary states, unfused elementwise."""
    return f"{kernel}@{batch_tokens}" + ("+fp8" if aux != "same" else "") + ("+eager" if fused == "off" else "")


def report(path) -> str:
    """A short table of a ``--jsonl`` file's lines (what the end of the GPU script's output shows)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        k = d.get("kind")
        if d.get("error"):
            rows.append(f"{k} {d.get('run', '')}: ERROR {d['error'][:300]}")
        elif k == "check":
            e = {n: d[f"vs_{n}"]["hidden_states"]["rel"] for n in ("one_by_one", "one_by_one_model_attention")}
            rows.append(
                f"check ok={d['ok']} {d['kernel']} {d['dtype']}: rel err vs one-by-one {e}; fp8 aux "
                f"{d['fp8_aux_vs_packed']['max_rel_to_token_amax']} (bound {d['fp8_aux_vs_packed']['bound']})"
            )
        elif k == "run" and d.get("skipped"):
            rows.append(f"run {d['run']}: skipped ({d['skipped']})")
        elif k == "run":
            rows.append(
                f"run {d['run']}: {d['tokens_per_s']:,.0f} tokens/s, MFU {d['mfu']} (forward only "
                f"{d['mfu_forward_only']}), io exposed {d['io_exposed_share']}, peak {d['peak_gpu_mem_gib']} "
                f"GiB, met={d['met']}"
            )
            rows += [f"    why: {w}" for w in d["why"]]
        elif k == "profile":
            rows.append(
                f"profile {d['kernel']} {d['tokens']} tokens: {d['shares']}, matmul {d['matmul_tflops']} / "
                f"attention {d['attention_tflops']} TFLOP/s, busy {d['busy_share']}, syncs "
                f"{d['host_syncs']}, lm_head calls {d['lm_head_calls']}"
            )
        elif k == "summary":
            rows.append(
                f"summary: best {d['best']} {d['tokens_per_s']:,.0f} tokens/s MFU {d['mfu']} "
                f"targets {d['targets']} met={d['met']} (disk {d.get('disk_write_gb_s')} GB/s, "
                f"{d['total_s']} s)"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny config on CPU (tests the code path)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens in the timed shard (default 400k; tiny 2k)")
    ap.add_argument(
        "--runs", default=None, help=f"comma-separated attention:batch_tokens[:fp8] (default {RUNS}; tiny {TINY_RUNS})"
    )
    ap.add_argument(
        "--optional-runs",
        default=None,
        help=f"runs after the profile, each only if --time-limit-s leaves time for it (default "
        f"{OPTIONAL_RUNS}; tiny {TINY_OPTIONAL_RUNS}; '' for none)",
    )
    ap.add_argument("--only-runs", action="store_true", help="no check, no profile, no optional runs")
    ap.add_argument("--time-limit-s", type=float, default=None, help="the step's time limit (optional runs)")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out-dir", default=None, help="where the extract files go (default a temp dir)")
    ap.add_argument("--jsonl", default=None, help="also append every JSON line to this file as it is printed")
    ap.add_argument(
        "--block-imports",
        action="store_true",
        help=f"make {', '.join(ABSENT_ON_GPU_MACHINE)} unimportable first (the GPU machine lacks them) "
        "and print the imports line",
    )
    ap.add_argument("--check-imports", action="store_true", help="only import the GPU path (with the guard)")
    ap.add_argument(
        "--gpu-tests",
        action="store_true",
        help="run pytest -m gpu tests/gpu/test_extract_gpu.py with the guard, then exit with its status",
    )
    ap.add_argument("-k", dest="tests_k", default=None, help="with --gpu-tests: pytest's -k expression")
    ap.add_argument("--report", default=None, help="print a short table of this --jsonl file and exit")
    a = ap.parse_args()
    if a.report:
        print(report(a.report))
        return
    t_start = time.perf_counter()
    signal.signal(signal.SIGTERM, _on_sigterm)

    if a.block_imports or a.check_imports or a.gpu_tests:
        block_imports()
    emit = Emit(a.jsonl)
    if a.check_imports:
        print(json.dumps(check_imports()))
        return
    if a.gpu_tests:
        import pytest

        root = Path(__file__).resolve().parents[1]
        args = ["-q", "-p", "no:cacheprovider", "-m", "gpu", "--rootdir", str(root)]
        args += ["-k", a.tests_k] if a.tests_k else []
        raise SystemExit(pytest.main(args + [str(root / "tests" / "gpu" / "test_extract_gpu.py")]))
    if a.block_imports:
        emit({"kind": "imports", **{k: v for k, v in check_imports().items() if k != "benchmark"}})

    import torch

    from eagle3_data import extract as ex
    from eagle3_data.settings import ExtractSettings

    cfg_dict = TINY if a.tiny else LLAMA_31_8B
    device = "cpu" if a.tiny else "cuda"
    dtype = "float32" if a.tiny else "bfloat16"
    want_tokens = a.tokens or (2_000 if a.tiny else 400_000)
    max_len = min(a.max_len, 512) if a.tiny else a.max_len
    runs = parse_runs(a.runs or (TINY_RUNS if a.tiny else RUNS))
    optional = (
        []
        if a.only_runs
        else parse_runs(
            a.optional_runs if a.optional_runs is not None else (TINY_OPTIONAL_RUNS if a.tiny else OPTIONAL_RUNS)
        )
    )
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --tiny on CPU)")
    deadline = t_start + a.time_limit_s if a.time_limit_s else None

    from transformers import AutoModelForCausalLM, LlamaConfig

    if a.peak_tflops:
        peak, gpu = a.peak_tflops * 1e12, "given"
    elif device == "cuda":
        gpu = torch.cuda.get_device_name(0)
        key = next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in gpu), None)
        peak = PEAK_TFLOPS[key] * 1e12 if key else None
    else:
        peak, gpu = 1e12, "cpu (nominal 1 TFLOP/s; MFU meaningless)"
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else None
    on_gpu = device == "cuda" and peak is not None and not a.tiny

    results, extra = [], {}
    prof = None
    interrupted = False
    try:
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
            if device == "cuda":
                torch.cuda.synchronize()
            extra["init_s"] = round(time.perf_counter() - t0, 1)
            w = model.get_decoder().layers[0].mlp.down_proj.weight
            extra["init_weight_std"] = _num(w.detach().float().std())  # 0.02: the init ran (not empty memory)
            loaded = (model, model.get_decoder())
            layers = ex.default_layers(cfg_dict["num_hidden_layers"])
            H, A = cfg_dict["hidden_size"], len(layers)
            extra["disk_write_gb_s"] = None
            if not a.only_runs:
                try:
                    extra["disk_write_gb_s"] = round(disk_write_rate(tmp, (64 << 20) if a.tiny else (1 << 30)), 2)
                except OSError as exc:
                    extra["disk_probe_error"] = str(exc)[:200]
            # the timed file must fit the disk (the warm-up's is deleted before): at most 60% of what is free
            per_token = (A + 1) * H * torch.tensor([], dtype=getattr(torch, dtype)).element_size() + 5
            free = shutil.disk_usage(tmp).free
            tokens = min(want_tokens, int(0.6 * free / per_token))
            extra.update(disk_free_gb=round(free / 1e9, 1), tokens_capped_by_disk=tokens < want_tokens)
            settings = ExtractSettings.defaults(model_dir, layers=layers, dtype=dtype)

            shard = tmp / "000.parquet"
            lengths = make_shard(shard, tokens, cfg_dict["vocab_size"], max_len)
            T = sum(lengths)
            flops = useful_flops(cfg_dict, lengths)
            warm: dict = {}

            if not a.only_runs:
                try:
                    emit(check_packed_vs_single(tmp, settings, loaded, cfg_dict["vocab_size"], max_len, runs[0][1]))
                except Exception as exc:  # noqa: BLE001 - reported; the runs still measure
                    import traceback

                    traceback.print_exc()
                    emit({"kind": "check", "error": f"{type(exc).__name__}: {exc}"[:1000]})

            def one_run(attention: str, batch_tokens: int, aux: str, fused: str) -> dict | None:
                """Warm-up, then the timed ``extract_states``; prints and returns the run line (None on error)."""
                try:  # one failing layout/kernel must not cost the others' figures (one GPU session, one try)
                    if batch_tokens not in warm:  # 2.25 batches: both pinned buffers, two shapes
                        warm[batch_tokens] = tmp / f"warm{batch_tokens}.parquet"
                        make_shard(
                            warm[batch_tokens],
                            batch_tokens * 9 // 4,
                            cfg_dict["vocab_size"],
                            max_len,
                            seed=batch_tokens,
                        )
                    run = settings.replace(attention=attention, batch_tokens=batch_tokens, aux_format=aux, fused=fused)
                    ex.extract_states(warm[batch_tokens], tmp / "warm.safetensors", settings=run, model=loaded)
                    (tmp / "warm.safetensors").unlink()
                    if device == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    head = model.get_output_embeddings()
                    lm_calls = []
                    hook = head.register_forward_hook(lambda *_: lm_calls.append(1)) if head is not None else None
                    try:
                        t0 = time.perf_counter()
                        info = ex.extract_states(shard, tmp / "000.safetensors", settings=run, model=loaded)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        seconds = time.perf_counter() - t0
                    finally:
                        if hook is not None:
                            hook.remove()
                        (tmp / "000.safetensors").unlink(missing_ok=True)
                except Exception as exc:  # noqa: BLE001 - reported in the run's JSON line
                    import traceback

                    traceback.print_exc()
                    emit(
                        {
                            "kind": "run",
                            "run": run_name(attention, batch_tokens, aux, fused),
                            "error": f"{type(exc).__name__}: {exc}"[:1000],
                        }
                    )
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    return None
                peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
                tm = info["timing"]
                computed = padded_tokens(lengths, batch_tokens) if info["attention"] == "padded" else T
                share = {k.replace("_s", "_share"): round(v / seconds, 4) for k, v in tm.items()}
                io_exposed = (tm["wait_s"] + tm["flush_s"]) / seconds
                loop_s = info["model_seconds"] - tm.get("drain_s", 0.0)
                states_bytes = info["bytes"] - T * 5 - (len(lengths) + 1) * 8
                r = {
                    "kind": "run",
                    "run": run_name(info["attention"], batch_tokens, aux, fused),
                    "attention": attention,
                    "kernel": info["attention"],
                    "batch_tokens": batch_tokens,
                    "fused": info.get("fused"),
                    "aux_format": info["aux_format"],
                    "tokens": T,
                    "samples": len(lengths),
                    "batches": info["batches"],
                    "computed_tokens": computed,
                    "padding_share": round(1 - T / computed, 4),
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(T / seconds, 1),
                    "mfu": round(flops / seconds / peak, 4) if peak else None,
                    "mfu_forward_only": (
                        round(flops / tm["forward_s"] / peak, 4) if peak and tm["forward_s"] else None
                    ),
                    "achieved_tflops_per_s": round(flops / seconds / 1e12, 2),
                    "peak_gpu_mem_gib": round(peak_mem, 2) if peak_mem is not None else None,
                    "peak_mem_ok": bool(gpu_mem and peak_mem < gpu_mem) if device == "cuda" else None,
                    "bytes_written": info["bytes"],
                    "write_bytes_per_s": round(info["bytes"] / seconds),
                    "write_gb_s_while_writing": (
                        round(info["bytes"] / 1e9 / tm["write_s"], 2) if tm["write_s"] else None
                    ),
                    "d2h_gb_s": round(states_bytes / 1e9 / tm["copy_s"], 2) if tm["copy_s"] else None,
                    "timing_s": tm,
                    **share,
                    "io_exposed_share": round(io_exposed, 4),
                    "loop_io_exposed_share": (
                        round((tm["wait_s"] - tm.get("drain_s", 0.0)) / loop_s, 4) if loop_s > 0 else None
                    ),
                    "non_forward_share": round(1 - tm["forward_s"] / seconds, 4),
                    "other_share": round(1 - (tm["forward_s"] + tm["wait_s"] + tm["flush_s"]) / seconds, 4),
                    "lm_head_calls": len(lm_calls),
                }
                r["targets"] = {
                    f"tokens_per_s_ge_{TARGET_TOKENS_PER_S}": bool(on_gpu and r["tokens_per_s"] >= TARGET_TOKENS_PER_S),
                    f"mfu_ge_{TARGET_MFU}": bool(on_gpu and r["mfu"] >= TARGET_MFU),
                    f"io_exposed_lt_{TARGET_IO_EXPOSED}": io_exposed < TARGET_IO_EXPOSED,
                    "peak_mem_within_device": bool(r["peak_mem_ok"]),
                }
                r["met"] = all(r["targets"].values())
                r["why"] = why(r, prof, flops / T, peak, extra["disk_write_gb_s"])
                results.append(r)
                return emit(r)

            for attention, batch_tokens, aux, fused in runs:
                one_run(attention, batch_tokens, aux, fused)
            if not results and not a.only_runs:  # every packed run failed: the padded path's figure instead
                one_run("padded", runs[0][1], "same", "off")
            if not a.only_runs:
                try:
                    prof = emit(profile_forward(model_dir, loaded, layers, dtype, shard, runs[0][1], cfg_dict, peak))
                    if any(r[3] == "on" for r in runs):  # the same batch with the fused elementwise kernels
                        emit(
                            profile_forward(
                                model_dir, loaded, layers, dtype, shard, runs[0][1], cfg_dict, peak, fused="on"
                            )
                        )
                except Exception as exc:  # noqa: BLE001 - reported; the runs' figures stand
                    import traceback

                    traceback.print_exc()
                    emit({"kind": "profile", "error": f"{type(exc).__name__}: {exc}"[:1000]})
                for r in results:  # the profile explains a missed MFU target: say so in the summary's why
                    r["why"] = why(r, prof, flops / T, peak, extra["disk_write_gb_s"])
            for attention, batch_tokens, aux, fused in optional:
                best_tps = max((r["tokens_per_s"] for r in results), default=0)
                need = (T + batch_tokens * 9 / 4) / best_tps * 1.5 + 15 if best_tps else float("inf")
                if deadline is not None and time.perf_counter() + need > deadline:
                    emit(
                        {
                            "kind": "run",
                            "run": run_name(attention, batch_tokens, aux, fused),
                            "skipped": f"needs ~{need:.0f} s, {deadline - time.perf_counter():.0f} s left",
                        }
                    )
                    continue
                one_run(attention, batch_tokens, aux, fused)
    except _Stop:
        interrupted = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the summary now (the step's kill follows 10 s after)

    if not results:
        emit(
            {
                "kind": "summary",
                "error": "no run finished (see the error lines above)",
                "interrupted": interrupted,
                "tokens": None,
                **extra,
            },
            final=True,
        )
        raise SystemExit(1)
    same = [r for r in results if r["aux_format"] == "same"] or results
    best = max(same, key=lambda r: r["tokens_per_s"])
    fp8 = [r for r in results if r["aux_format"] != "same"]
    mfu_ok = on_gpu and best["mfu"] is not None
    emit(
        {
            "kind": "summary",
            "tiny": a.tiny,
            "device": gpu if device == "cuda" else "cpu",
            "gpu_mem_gib": round(gpu_mem, 1) if gpu_mem else None,
            "model": "Llama-3.1-8B config, random init" if not a.tiny else "tiny Llama",
            "dtype": dtype,
            "decoder_params": decoder_params(cfg_dict),
            "aux_layers": layers,
            "tokens": T,
            "samples": len(lengths),
            "max_len": max_len,
            "useful_tflops": round(flops / 1e12, 2),
            "useful_flops": flops,
            "gflop_per_token": round(flops / T / 1e9, 3),
            "peak_tflops": peak / 1e12 if peak else None,
            "runs": [
                {
                    k: r[k]
                    for k in (
                        "run",
                        "aux_format",
                        "tokens_per_s",
                        "mfu",
                        "mfu_forward_only",
                        "io_exposed_share",
                        "peak_gpu_mem_gib",
                        "met",
                    )
                }
                for r in results
            ],
            "best": best["run"],
            "tokens_per_s": best["tokens_per_s"],
            "mfu": best["mfu"],
            "targets": best["targets"],
            "met": best["met"],
            "why": best["why"],
            "fp8": (
                {
                    k: max(fp8, key=lambda r: r["tokens_per_s"])[k]
                    for k in ("run", "tokens_per_s", "mfu", "io_exposed_share", "targets", "met", "why")
                }
                if fp8
                else None
            ),
            "file_bytes_per_token": round(best["bytes_written"] / T, 1),
            "interrupted": interrupted,
            "kimi_k25_projection": projection(best["mfu"] if mfu_ok else TARGET_MFU, peak_tflops=PEAK_TFLOPS["H200"])
            | {
                "mfu_source": (
                    f"measured ({best['run']}, dense 8B on {gpu})"
                    if mfu_ok
                    else f"assumed: the {TARGET_MFU:.0%} target"
                )
            },
            "matmul_settings": {
                "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                "tf32": torch.backends.cuda.matmul.allow_tf32,
            },
            "gpu_state_after": gpu_state() if device == "cuda" else None,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            **extra,
            "total_s": round(time.perf_counter() - t_start, 1),
        },
        final=True,
    )


if __name__ == "__main__":
    main()
