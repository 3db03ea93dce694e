"""benchmarks/extract_gpu.py is correct by construction: its FLOP count, its Kimi-K2.5 projection, its import
guard (the GPU machine's packages only) and its --tiny run on CPU (the GPU run's code path)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from eagle3_data.testing.workflow import ROOT, load_benchmark

g = load_benchmark("extract_gpu")


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
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "extract_gpu.py"), "--check-imports"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["check_imports"] and set(res["blocked"]) >= {"snakemake", "duckdb", "pandera", "sglang"}
    assert {"torch", "transformers", "safetensors", "numpy", "pyarrow"} <= set(res["third_party_loaded"])
    assert not set(res["blocked"]) & set(res["third_party_loaded"])
    # the guard really blocks: an import fails, and availability checks (find_spec) see nothing
    code = (
        "import importlib.util\nfrom eagle3_data.testing.workflow import load_benchmark\ng = load_benchmark('extract_gpu')\n"
        "g.block_imports()\nprint(importlib.util.find_spec('duckdb'))\n"
        "try:\n    import pandera\nexcept ImportError: print('blocked')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT
    )
    assert out.stdout.split() == ["None", "blocked"], out.stderr[-2000:]


def _lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.strip().splitlines() if x.startswith("{")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The --tiny run under the guard, as the GPU script runs the bench step: ``(stdout lines, --jsonl lines)``."""
    jsonl = tmp_path_factory.mktemp("tiny") / "out.jsonl"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "extract_gpu.py"),
            "--tiny",
            "--block-imports",
            "--jsonl",
            str(jsonl),
            "--time-limit-s",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return _lines(out.stdout), _lines(jsonl.read_text())


def test_tiny_run_prints_imports_check_runs_profile_and_summary(tiny):
    lines, from_file = tiny
    assert lines == from_file  # every line also in --jsonl, as printed
    assert [d["kind"] for d in lines] == [
        "imports",
        "check",
        "run",
        "run",
        "run",
        "profile",
        "profile",
        "run",
        "summary",
    ]
    assert all(d["benchmark"] == "extract_gpu" for d in lines)
    imports = lines[0]
    assert {"torch", "transformers", "safetensors"} <= set(imports["third_party_loaded"])
    assert not set(imports["blocked"]) & set(imports["third_party_loaded"])
    runs, res = [d for d in lines if d["kind"] == "run"], lines[-1]
    # the default runs (bf16 aux eager, then with the fused elementwise kernels, fp8 aux), then the optional bigger
    # batch once the profiles are done (eager, then fused)
    assert [r["run"] for r in runs] == [
        "packed:loop@1024+eager",
        "packed:loop@1024",
        "packed:loop@1024+fp8+eager",
        "packed:loop@2048",
    ]
    assert [r["aux_format"] for r in runs] == ["same", "same", "fp8_e4m3", "same"]
    # float32 on CPU: the MLP products fuse, the norms do not (compiled, their float32 rsqrt differs)
    assert [r["fused"]["mlps"] for r in runs] == [0, 8, 0, 8] and [r["fused"]["norms"] for r in runs] == [0] * 4
    T = res["tokens"]
    for r in runs:
        assert r["tokens"] == T and r["computed_tokens"] == T and r["padding_share"] == 0  # packed: no padding
        # (seconds: 3 decimals, tokens/s: 1)
        assert T / (r["seconds"] + 5e-4) - 0.05 <= r["tokens_per_s"] <= T / (r["seconds"] - 5e-4) + 0.05
        tm = r["timing_s"]
        assert tm["forward_s"] > 0 and tm["write_s"] > 0 and 0 <= tm["drain_s"] <= tm["wait_s"]
        # the exposed share is the waits (drain included) and the final flush, over the run's wall time
        # (timings: 4 decimals, seconds: 3, shares: 4)
        exposed = tm["wait_s"] + tm["flush_s"]
        lo, hi = (exposed - 1e-4) / (r["seconds"] + 5e-4), (exposed + 1e-4) / (r["seconds"] - 5e-4)
        assert lo - 5e-5 <= r["io_exposed_share"] <= hi + 5e-5
        assert 0 < r["forward_share"] <= 1 and r["lm_head_calls"] == 0  # extraction computes no logits
        # MFU: the useful FLOPs over the run's seconds at the peak (the tiny run's nominal 1 TFLOP/s)
        lo, hi = (res["useful_flops"] / (r["seconds"] + s) / 1e12 for s in (5e-4, -5e-4))
        assert lo - 5e-5 <= r["mfu"] <= hi + 5e-5  # (MFU: 4 decimals)
        # the 8B-on-a-GPU targets are never met by the tiny CPU run; a miss says why
        assert r["targets"]["tokens_per_s_ge_30000"] is False and r["targets"]["mfu_ge_0.45"] is False
        assert r["met"] is False and any("MFU" in w for w in r["why"])
    bf16, fp8 = runs[0], runs[2]
    # the stored layout: 3 aux + 1 final float32 rows (+ ids, mask) vs fp8 aux with one float32 scale per layer
    # (the headers differ by the aux_scales entry and the metadata's aux_format: under 256 bytes)
    H = 64
    assert bf16["bytes_written"] - fp8["bytes_written"] == pytest.approx(T * 3 * H * 3 - T * 3 * 4, abs=256)


def test_tiny_check_line_compares_packed_with_one_by_one(tiny):
    check = next(d for d in tiny[0] if d["kind"] == "check")
    assert check["kernel"] == "packed:loop" and check["model_attention"] == "sdpa" and check["dtype"] == "float32"
    assert check["batches"]["packed"] == 1 and check["batches"]["one_by_one"] == check["samples"] == 8
    assert check["tokens"] == sum(check["lengths"]) and max(check["lengths"]) == 512
    for name in ("vs_one_by_one", "vs_one_by_one_model_attention"):
        for tensor, e in check[name].items():
            # float32 on CPU: packing changes the rounding only (~1e-7), far inside the bf16 bound
            assert 0 <= e["rel"] < 1e-5 and e["ref_max_abs"] > 0, (name, tensor, e)
            assert e["max_abs_err"] == pytest.approx(e["rel"] * e["ref_max_abs"], rel=1e-2, abs=1e-12)
    fp8 = check["fp8_aux_vs_packed"]  # lossy, within half of e4m3's top-binade spacing of each row's max
    assert 1e-3 < fp8["max_rel_to_token_amax"] <= fp8["bound"] * (1 + 1e-4) and fp8["bound"] == pytest.approx(16 / 448)
    assert check["fp8_final_vs_packed"]["max_abs_err"] == 0  # fp8 touches the aux states only
    assert check["ok"] is True and check["finite"] is True and check["tol_rel"] == 2**-5


def test_tiny_profile_splits_the_forward(tiny):
    prof = next(d for d in tiny[0] if d["kind"] == "profile")
    assert prof["kernel"] == "packed:loop" and 0 < prof["tokens"] <= 1024 and prof["lm_head_calls"] == 0
    assert sum(prof["shares"].values()) == pytest.approx(1, abs=2e-3)
    assert min(prof["shares"].values()) > 0  # matmuls, the per-sample attention, norms/rotary/activations
    assert sum(prof["ms"].values()) == pytest.approx(prof["attributed_ms"], abs=0.05)
    assert 0 < prof["busy_share"] <= 1.05 and prof["matmul_tflops"] > 0
    ops = {o["op"] for o in prof["top_ops"]}
    assert "aten::mm" in ops and any("scaled_dot_product" in o for o in ops)
    eager, fused = [d for d in tiny[0] if d["kind"] == "profile"]  # the same batch, then with the fused kernels
    assert eager["fused"]["mlps"] == 0 and fused["fused"]["mlps"] == 8 and fused["tokens"] == eager["tokens"]
    assert fused["fused_kernels_ms"] == eager["fused_kernels_ms"] == 0  # on CPU no triton kernel is timed


def test_tiny_summary_targets_and_projection(tiny):
    lines = tiny[0]
    runs, res = [d for d in lines if d["kind"] == "run"], lines[-1]
    assert res["tiny"] and res["samples"] > 10 and res["aux_layers"] == [1, 3, 4] and res["interrupted"] is False
    best = max((r for r in runs if r["aux_format"] == "same"), key=lambda r: r["tokens_per_s"])
    assert res["best"] == best["run"] and res["tokens_per_s"] == best["tokens_per_s"]
    assert res["targets"] == best["targets"] and res["met"] is False
    # the summary's why is the run's, its MFU sentence completed by the profile's split (done after the runs)
    assert res["why"][1:] == best["why"][1:] and "; one batch's device time: matmul" in res["why"][0]
    assert res["why"][0].startswith(best["why"][0].split(";")[0])
    assert set(res["targets"]) == {
        "tokens_per_s_ge_30000",
        "mfu_ge_0.45",
        "io_exposed_lt_0.1",
        "peak_mem_within_device",
    }
    assert res["fp8"]["run"] == "packed:loop@1024+fp8+eager" and len(res["runs"]) == 4
    P, L, d = g.decoder_params(g.TINY), g.TINY["num_hidden_layers"], g.TINY["hidden_size"]
    dense = 2 * P * res["tokens"]  # + the attention term, 2 L d n^2 per sample of n <= max_len tokens
    assert dense < res["useful_flops"] < dense + 2 * L * d * res["tokens"] * res["max_len"]
    # file bytes per token: 3 aux + 1 final at float32 + ids/mask, nothing padded
    assert abs(res["file_bytes_per_token"] - (4 * 64 * 4 + 5)) < 2
    assert res["disk_write_gb_s"] > 0 and res["init_weight_std"] == pytest.approx(0.02, rel=0.2)
    proj = res["kimi_k25_projection"]  # no GPU: the projection assumes the 45% target
    assert proj["mfu_assumed"] == 0.45 and proj["mfu_source"].startswith("assumed")
    assert proj["hours"] == pytest.approx(proj["flops"] / (8 * 989e12 * 0.45) / 3600, abs=0.01)
    assert proj["hours"] == pytest.approx(0.83, abs=0.01)


def test_report_summarises_the_jsonl(tiny, tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in tiny[0]) + "\nnot json\n")
    text = g.report(p)
    assert text.splitlines()[0].startswith("check ok=True packed:loop")
    assert "run packed:loop@1024+fp8+eager:" in text and "    why: " in text and "profile packed:loop" in text
    assert text.splitlines()[-1].startswith("summary: best packed:loop@")


def test_sigterm_stops_the_run_and_prints_a_summary_of_those_done(tmp_path):
    """The step's time limit (SIGTERM) mid-run: the finished run's line, then a summary marked interrupted."""
    jsonl = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "extract_gpu.py"),
            "--tiny",
            "--only-runs",
            "--tokens",
            "40000",
            "--runs",
            "packed:1024,packed:1024:fp8,packed:256",
            "--jsonl",
            str(jsonl),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        first = json.loads(proc.stdout.readline())  # the first run done: stop in the second
        proc.send_signal(signal.SIGTERM)
        rest = _lines(proc.stdout.read())
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert first["kind"] == "run" and first["run"] == "packed:loop@1024"
    assert [d["kind"] for d in rest] == ["summary"] and rest[0]["interrupted"] is True
    assert [r["run"] for r in rest[0]["runs"]] == ["packed:loop@1024"]
    assert _lines(jsonl.read_text()) == [first] + rest


def test_the_gpu_script_runs_every_step_on_cpu_and_brings_back_its_files(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "extract_gpu.sh"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**_env(), "OUT": str(out), "PYTHON": sys.executable},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for step in ("bench", "gpu_tests", "flex", "flex_tests"):
        assert f"== {step} rc=0" in text, text[-3000:]
    # the device tool brings back at most 8 files, none in a folder
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "bench.log",
        "env.txt",
        "extract_gpu.jsonl",
        "extract_gpu.log",
        "flex.log",
        "flex_tests.log",
        "gpu_tests.log",
    ]
    lines = _lines((out / "extract_gpu.jsonl").read_text())
    kinds = [d["kind"] for d in lines]
    assert kinds == [
        "imports",
        "check",
        "run",
        "run",
        "run",
        "profile",
        "profile",
        "run",
        "summary",
        "imports",
        "run",
        "summary",
    ]
    assert lines[-2]["run"] == "packed:flex@1024"
    # it ends with the short table, then the bench step's summary line
    tail = text.strip().splitlines()
    assert json.loads(tail[-1]) == lines[8] and tail[-2].startswith("summary: best packed:flex@1024")
    assert not list(ROOT.glob(".extract_gpu_tmp.*"))  # the benchmark's files are gone


def test_a_failing_run_is_reported_and_the_padded_path_measured_instead():
    """Every packed run failing (here: the varlen kernel on CPU) costs its line, not the session's figures."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "extract_gpu.py"),
            "--tiny",
            "--tokens",
            "500",
            "--runs",
            "packed-varlen:256",
            "--optional-runs",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [d for d in _lines(out.stdout) if d["kind"] == "run"]
    assert runs[0]["run"] == "packed-varlen@256" and "needs CUDA" in runs[0]["error"]
    assert runs[1]["run"] == "padded@256+eager" and runs[1]["tokens_per_s"] > 0 and runs[1]["computed_tokens"] >= 500
    assert _lines(out.stdout)[-1]["best"] == "padded@256+eager"
