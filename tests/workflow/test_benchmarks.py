"""Every benchmark runs in CI at toy size (seconds each), so none can rot: it must finish and end with its one
JSON line holding its figures. The figures themselves are the benchmarks' business (full size, by hand)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_data.testing.workflow import ROOT, snakemake_env, vllm_cpu_env

#: the toy-size arguments of each benchmark (python benchmarks/<name>.py <args>)
TOY = {
    "merge": ["--toy"],
    "extract": ["--toy"],
    "extract_gpu": ["--tiny"],
    "generation_client": ["--toy"],
    "generation_run": ["--toy"],
    "tokenize_validate": ["--toy"],
    "rehearsal": ["--toy"],
    "capture_bytes": ["--toy"],
    "draft_quality": ["--toy", "--seeds", "2", "--measure-seeds", "1"],
}
#: keys each JSON line must have, beyond "benchmark"
KEYS = {
    "merge": ["merge_s", "baseline_pyarrow_s", "ratio_merge_vs_baseline", "merge_memory_ratio_full_vs_half"],
    "extract": ["ours_tokens_per_s", "baseline_batch1_tokens_per_s", "speedup", "bytes_per_token_bf16", "flop_bound"],
    "extract_gpu": ["tokens"],
    "generation_client": ["clients", "ideal_schedule_s"],
    "generation_run": [
        "client_cpu_ms_per_request",
        "time_to_first_request_s",
        "in_flight",
        "request_phase_s",
        "phase_vs_ideal",
        "server_cpu_ms_per_request",
        "baseline_one_process_per_job",
        "snakemake_floor",
        "met",
    ],
    "tokenize_validate": [],
    "rehearsal": ["incremental", "samples", "merged_samples"],
    "capture_bytes": [
        "states_bytes_per_token",
        "exports_bytes_per_token",
        "baseline_specforge_bf16_bytes_per_token",
        "ratio_eagle3_fp8_states_vs_baseline",
        "target_eagle3_fp8_states_le",
        "met",
    ],
    "draft_quality": [
        "drafters",
        "baseline",
        "tau_onpolicy",
        "measured_acceptance_length",
        "ratio_regenerated_vs_original",
        "fp8_vs_bf16_abs_diff",
        "peer_capture",
        "targets",
        "sizes",
        "seeds",
        "precision",
        "target_argmax_agreement_heldout",
        "tau_onpolicy_by_seed",
    ],
}


def test_every_benchmark_has_a_toy_mode():
    """Every file of benchmarks/ is a benchmark (what they share is in eagle3_data.testing) with a toy mode."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts == set(TOY), f"give these a toy mode in TOY: {scripts - set(TOY)}; gone: {set(TOY) - scripts}"


@pytest.mark.parametrize("name", sorted(TOY))
def test_benchmark_runs_at_toy_size(name, tmp_path):
    if name == "draft_quality":
        vllm_cpu_env()  # it serves the drafters with vLLM's CPU build (skips, or fails in CI, where it is missing)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *TOY[name]],
        cwd=tmp_path,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=1800 if name == "draft_quality" else 900,  # a build, 3 drafters, 5 vLLM servers: ~11 min on 2 cores
    )
    assert proc.returncode == 0, f"{name}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = proc.stdout.strip().splitlines()[-1]
    out = json.loads(line)
    assert out["benchmark"] == name
    for key in KEYS[name]:
        assert key in out, f"{name}: {key} missing from {line[:500]}"
    if name == "generation_run":  # 2 datasets x 2 shards x 100 samples at a limit of 50, every figure measured
        assert out["jobs"] == 4 and out["requests"] == 200 and out["product_ok"] == out["baseline_ok"] == 200
        assert out["same_bodies"] is True
        for fig in ("client_cpu_ms_per_request", "time_to_first_request_s", "request_phase_s"):
            f = out[fig]
            assert f["product"] > 0 and f["baseline"] > 0, (fig, f)
            # each figure is rounded (CPU and first request to 3 decimals, the request phase to 2): the ratio,
            # taken before rounding, lies within what the rounded figures allow
            h = 0.005 if fig == "request_phase_s" else 0.0005
            lo, hi = (f["product"] - h) / (f["baseline"] + h), (f["product"] + h) / max(1e-9, f["baseline"] - h)
            assert lo - 0.001 <= f["ratio"] <= hi + 0.001, (fig, f)
        for who in ("product", "baseline"):
            assert 0 < out["in_flight"][who]["mean"] <= out["in_flight"][who]["max"] <= out["limit"], out["in_flight"]
            assert 0.3 < out["phase_vs_ideal"][who] < 10 and out["server_cpu_ms_per_request"][who] > 0
        per_job = out["baseline_one_process_per_job"]  # the bare client as one process per job: every body sent
        assert per_job["processes"] == 4 and per_job["requests"] == 200 and per_job["cpu_ms_per_request"] > 0
        assert per_job["product_ratio"] == pytest.approx(
            out["client_cpu_ms_per_request"]["product"] / per_job["cpu_ms_per_request"], rel=0.02
        ), per_job
        # the targets: the request phase and the share of the limit in flight; CPU and first request: references
        assert set(out["met"]) == {"request_phase", "in_flight"} and set(out["targets"]) == {
            "request_phase_ratio_max",
            "in_flight_share_min",
        }
        assert out["in_flight_share_of_limit"] == pytest.approx(out["in_flight"]["product"]["mean"] / 50, abs=2e-3)
        assert out["met"]["in_flight"] == (out["in_flight"]["product"]["mean"] >= 0.95 * 50)
        assert (
            out["references"]["cpu_within"] == (out["client_cpu_ms_per_request"]["ratio"] <= 1.25 + 1e-3)
            or abs(out["client_cpu_ms_per_request"]["ratio"] - 1.25) < 2e-3
        )
        floor = out["snakemake_floor"]  # thin script jobs (read + write their shard), launched as the product's are
        assert floor["jobs"] == 4 and 0 < floor["job_cpu_s_at_script_start_mean"] < floor["job_cpu_s_mean"], floor
        assert floor["ttfr_ratio"] == pytest.approx(
            floor["time_to_first_job_s"] / out["time_to_first_request_s"]["baseline"], rel=0.01
        ), floor
        assert floor["cpu_ratio"] == pytest.approx(
            (floor["job_cpu_s_mean"] * 4 + out["baseline_cpu_s"]) / out["baseline_cpu_s"], rel=0.05
        ), floor
    if name == "capture_bytes":  # the writer's bytes at H = 4,096: the plan's formula plus the files' headers
        for part in ("states_bytes_per_token", "exports_bytes_per_token"):
            for k, v in out[part].items():
                assert v["plan_formula"] <= v["bytes_per_token"] <= v["plan_formula"] + 150, (k, v)
        assert out["states_bytes_per_token"]["eagle3 fp8 (aux + final)"]["plan_formula"] == 16405
        assert out["exports_bytes_per_token"]["speculators_fp8"]["plan_formula"] == 16396
        assert 0.49 < out["ratio_eagle3_fp8_states_vs_baseline"] < 0.51 and out["met"] is True
    if name == "draft_quality":
        _check_draft_quality(out)
    if name == "extract":  # the ceiling: the decoder's FLOPs at the best matmul rate; no run gets below its floor
        fb = out["flop_bound"]
        assert 0 < fb["floor_s"] < fb["ours_s"] and fb["target_s"] == pytest.approx(fb["baseline_s"] / 2, abs=1e-3)
        # the figures are rounded to 3 decimals (ms), the ceiling to 2
        lo, hi = fb["baseline_s"] / (fb["floor_s"] + 6e-4), fb["baseline_s"] / max(1e-9, fb["floor_s"] - 6e-4)
        assert lo - 0.01 <= fb["speedup_ceiling"] <= hi + 0.01, fb
        # three parts and the total, each rounded to 1 ms; shares rounded to 0.001 of the total
        assert sum(fb["ours_s_by_part"].values()) == pytest.approx(fb["ours_s"], rel=0.005, abs=2.5e-3), fb
        assert fb["ours_s_by_part"]["matmul"] > 0 and fb["ours_s_by_part"]["attention"] > 0
    if name == "rehearsal":  # the incremental scenario: retried requests + 1 new dataset cost what they change
        inc = out["incremental"]
        assert out["samples"] == out["merged_samples"] > 0
        # the default sizes' time target is the whole rehearsal's: forecast + build + incremental scenario
        assert out["run_s"] > out["total_s"] + inc["wall_s"] * 0.9 and out["target_applies_to"].startswith("run_s")
        assert inc["snakemake_rc"] == 0 and inc["retried_requests"] == 2  # --toy retries 2 of ~20 samples
        assert inc["requests_sent"] == inc["retried_requests"] + inc["new_dataset_samples"], inc
        # every retried or new sample is forwarded unless the fault-injecting server failed it (0.3 % per request)
        assert 1 <= inc["rows_forwarded"] <= inc["requests_sent"], inc
        assert 0 < inc["tokens_forwarded"] < inc["tokens_total"] / 2, inc
        assert inc["jobs_rerun"]["normalize"] == 1, inc  # only the new dataset's normalize job


def _check_draft_quality(out: dict) -> None:
    """Three drafters trained on the same supervised tokens, scored on the same held-out rows, and each served by
    vLLM with the target: its counters, the estimate beside them, and speculators' capture beside ours."""
    d, sizes = out["drafters"], out["sizes"]
    assert set(d) == {"regenerated", "original", "regenerated_fp8"}
    # the defaults: speculators' Trainer's precision (bfloat16 states under a bfloat16 autocast) and optimizer (Muon)
    # where the CPU has bfloat16 matmuls, else float32 and AdamW (emulated bfloat16 is 25 times slower)
    native = out["native_bfloat16"]
    assert (out["precision"], out["optimizer"]) == (("bfloat16", "muon") if native else ("float32", "adamw"))
    assert out["served_dtype"] == "float32"
    # the target's greedy replies are its argmax at (nearly) every supervised position of the held-out rows; a
    # loss mask or final-state row shifted by one token would put these near 0
    regen = {k: v for k, v in out["target_argmax_agreement_heldout"].items() if k.endswith("_regen")}
    assert regen and all(v["share"] >= 0.9 and v["positions"] > 0 for v in regen.values()), regen
    assert sizes["train_samples"]["regenerated"] > 0 and sizes["train_samples"]["original"] > 0
    # the held-out split goes by prompt text: no normalized prompt is both trained on and held out
    split = sizes["heldout_split"]
    assert split["shared"] == 0 and split["example"] is None and out["targets"]["heldout_split_met"]
    assert split["heldout_prompts"] > 0 and split["training_prompts"] > split["heldout_prompts"]
    assert out["seeds"]["training"] == [0, 1] and out["seeds"]["measured"] == [0]
    # the FP8 drafter reads the same batches through hs-connectors' FP8 backend; the original drafter gets as many
    # supervised tokens (its steps the fewest that reach them)
    steps, sup = sizes["steps"], sizes["supervised_tokens"]
    assert steps["regenerated_fp8"] == steps["regenerated"] and sup["regenerated_fp8"] == sup["regenerated"]
    assert sizes["same_supervised_tokens"] and sup["original"] >= sup["regenerated"] > 0
    assert sup["original"] < sup["regenerated"] + sizes["tokens_per_step"], sup  # within one batch of it
    for k in d:
        fit, on = d[k]["training"], d[k]["onpolicy"]["overall"]
        assert fit["steps"] == steps[k] and fit["tokens"] == steps[k] * sizes["tokens_per_step"]
        # speculators' linear schedule: 1% warm-up (none at toy size), then down to 0 at the last step's end
        warm = steps[k] // 100
        assert fit["lr_peak"] == pytest.approx(out["lr"])
        assert fit["lr_last_step"] == pytest.approx(out["lr"] / (steps[k] - warm))
        assert on["samples"] == sum(sizes["heldout_onpolicy"].values()) and on["positions"] > 0
        assert on["tau"] == pytest.approx(1 + sum(on["acc"]), abs=2e-4) and len(on["acc"]) == sizes["ttt_steps"]
        # two seeds: the first seed's drafter in full, each seed's tau, the targets read on their mean
        by_seed = out["tau_onpolicy_by_seed"][k]
        assert len(by_seed) == 2 and by_seed[0] == on["tau"]
        assert out["tau_onpolicy"][k] == pytest.approx(sum(by_seed) / 2, abs=1e-6)
        # vLLM's counters, per domain and overall: 3 tokens a draft, accepted ones counted per position
        m = d[k]["measured"]
        assert set(m) == set(out["baseline"]) and m["overall"]["requests"] == on["samples"]
        for g in (v for v in m.values() if isinstance(v, dict)):
            assert g["drafts"] > 0 and g["draft_tokens"] == 3 * g["drafts"] and 0 <= g["accepted"] <= g["draft_tokens"]
            rates = g["acceptance_rate_per_position"]
            assert len(rates) == 3 and rates == sorted(rates, reverse=True)  # a later token needs the earlier ones
            assert sum(rates) * g["drafts"] == pytest.approx(g["accepted"], abs=0.01)
            assert g["acceptance_length"] == pytest.approx(1 + g["accepted"] / g["drafts"], abs=1e-6)
            assert g["completion_tokens"] > 0
            # every verify step emits its accepted drafts and one token of the target, and the prefill one more:
            # the counters of a group's window are those of its requests (the last step's surplus cut at max_tokens)
            surplus = g["drafts"] + g["accepted"] - (g["completion_tokens"] - g["requests"])
            assert 0 <= surplus <= 3 * g["requests"], g
        # the replies' own counters (per domain) add up to /metrics' over the window (overall)
        assert m["overall"]["replies_add_up"] is True and m["overall"]["completion_tokens_per_s"] > 0
        assert out["measured_acceptance_length"][k] == m["overall"]["acceptance_length"]
        # the estimate replayed at the positions an engine drafts from (the walk) drafts about as often as vLLM did:
        # the same replies (greedy, the held-out rows are the target's own), the same verify loop
        assert abs(on["walk_drafts"] - m["overall"]["drafts"]) <= 0.1 * m["overall"]["drafts"], (on, m["overall"])
        assert set(d[k]["estimate_vs_measured"]) == set(m) - {"startup_s"}
    # the target alone drafts nothing; the same prompts, greedy, give (nearly) the same replies with a drafter
    assert out["baseline"]["overall"]["drafts"] == 0 and out["baseline"]["overall"]["acceptance_length"] == 1.0
    base_tokens = out["baseline"]["overall"]["completion_tokens"]
    for k in d:
        assert abs(d[k]["measured"]["overall"]["completion_tokens"] - base_tokens) <= 0.05 * base_tokens
    acc = out["measured_acceptance_length"]
    assert out["ratio_regenerated_vs_original"]["measured"] == pytest.approx(
        acc["regenerated"] / acc["original"], abs=2e-4
    )
    assert out["ratio_regenerated_vs_original"]["estimate"] == pytest.approx(
        out["tau_onpolicy"]["regenerated"] / out["tau_onpolicy"]["original"], abs=2e-4
    )
    # speculators' own capture (vLLM, float32) of the held-out rows' tokens equals our extract stage's (float32)
    peer = out["peer_capture"]
    assert peer["layer_ids"] == [2, 15, 27, 30] and peer["samples"] == sum(sizes["heldout_onpolicy"].values())
    assert peer["rel"] < 1e-4 and peer["speculators_tokens_per_s"] > 0 and peer["ours_tokens_per_s"] > 0, peer
    assert {"measured_ratio_ge", "measured_fp8_abs_diff_le", "measured_ratio_met", "measured_fp8_met"} <= set(
        out["targets"]
    )


def test_rehearsal_server_streams_each_backend_at_its_own_speed():
    """The rehearsal's stand-in server: a request's latency is its base (drawn from the body) + its reply length
    (drawn from the dataset's profile) x the per-token latency of its model (one model per backend)."""
    from eagle3_data.testing import fault_server as fs
    from eagle3_data.testing import rehearsal_server as rs

    app = rs.RehearsalApp(
        {
            "profile_field": "user",
            "latency_min_s": 1.0,
            "latency_max_s": 1.0,
            "min_tokens": 10,
            "max_tokens": 10_000,
            "length_dist": "lognormal",
            "profiles": {"ds": {"length_mean": 2000.0}},
            "model_profiles": {"remote": {"latency_per_token_s": 0.01}, "local": {"latency_per_token_s": 0.002}},
        }
    )
    body = {"model": "remote", "user": "ds", "messages": [{"role": "user", "content": "hi"}]}
    lat = {}
    for model in ("remote", "local"):
        b = {**body, "model": model}
        bh = fs.body_hash(b)
        app.note(b)
        n = app.length(app.cfg_for("ds", model), bh)
        assert 10 <= n <= 10_000
        lat[model] = (app.latency(bh), n)
    assert lat["remote"][0] == pytest.approx(1.0 + 0.01 * lat["remote"][1])
    assert lat["local"][0] == pytest.approx(1.0 + 0.002 * lat["local"][1])


def test_fault_server_answers_a_fault_at_the_point_fault_at_names():
    """``fault_at``: a rate limit refuses at once (``start``), a provider error mid-generation comes at a drawn
    point of the latency (``uniform``), and by default a fault answers after the whole latency (``end``)."""
    import time

    import httpx

    from eagle3_data.testing.fault_server import FaultServer

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with FaultServer({"latency_min_s": 0.6, "latency_max_s": 0.6, "p429": 1.0}) as srv:
        url = f"http://127.0.0.1:{srv.port}/v1/chat/completions"

        def took(**cfg) -> tuple[int, float]:
            srv.configure(**cfg)
            t0 = time.monotonic()
            r = httpx.post(url, json=body, timeout=10)
            return r.status_code, time.monotonic() - t0

        code, s = took()
        assert code == 429 and s >= 0.6
        code, s = took(fault_at={"p429": "start"})
        assert code == 429 and s < 0.3
        srv.configure(p429=0.0, p5xx=1.0, fault_at={"p5xx": "uniform"})
        waits = [took()[1] for _ in range(8)]
        assert all(w < 0.75 for w in waits) and max(waits) - min(waits) > 0.1  # drawn in [0, 0.6]: not all alike
        srv.configure(p5xx=0.0)
        code, s = took()
        assert code == 200 and s >= 0.6
