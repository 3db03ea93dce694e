"""profiles/slurm through the real SLURM executor plugin, against stand-in SLURM commands on PATH.

The stand-ins (sbatch, sacct, squeue, sacctmgr, scontrol, scancel, sinfo, sshare) record their argv and answer
like SLURM: sbatch prints a job id, sacctmgr the account, scontrol a MinJobAge, sacct reports every job FAILED
so the run ends at once. Only one extract, one plan and one generate job are submitted (forced targets on a scratch
copy whose inputs exist as placeholders); the test checks the sbatch lines.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing.workflow import ROOT, copy_workflow, snakemake_env
from eagle3_data.testing.slurm_cluster import sbatch_option as _opt

pytest.importorskip("snakemake_executor_plugin_slurm")

STANDIN = r"""#!/bin/bash
# stand-in for SLURM's {name}: record argv (NUL-separated, one file per call), answer like SLURM
d="${{SLURM_STANDIN_DIR:?}}"
f=$(mktemp "$d/{name}.XXXXXX")
printf '%s\0' "$@" > "$f"
{answer}
"""
ANSWERS = {
    "sbatch": 'touch "$d/jobid.$$"; echo "$$"',  # --parsable: the job id (this process id, recorded for sacct)
    "sacct": 'for f in "$d"/jobid.*; do [ -e "$f" ] && echo "${f##*.}|FAILED"; done; true',
    "sacctmgr": "echo myproj",
    "scontrol": 'echo "MinJobAge               = 300 sec"',
    "squeue": "true",
    "scancel": "true",
    "sinfo": "true",
    "sshare": "echo myproj",
}

EXTRACT = "results/hidden_states/sharegpt_demo/000.safetensors"
GENERATE = "results/sharegpt_demo/responses/000.parquet"
PLAN = "results/reports/plan.md"


def _standins(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True)
    for name, answer in ANSWERS.items():
        p = bin_dir / name
        p.write_text(STANDIN.format(name=name, answer=answer))
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _calls(record: Path, name: str) -> list[list[str]]:
    out = []
    for f in sorted(record.glob(f"{name}.*")):
        out.append(f.read_bytes().decode().split("\0")[:-1])
    return out


@pytest.fixture(scope="module")
def submitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm")
    work = copy_workflow(tmp / "w")
    # placeholder files for every stage up to the merge and plan checkpoints, oldest first: with --allowed-rules nothing
    # upstream is scheduled and the jobs never run; the manifest gives the extract job its selection digest
    cfg = yaml.safe_load((work / "config.yaml").read_text())
    shards = [(ds, f"{s:03d}") for ds, d in cfg["datasets"].items() for s in range(d.get("shards", 1))]
    placeholders = ["results/target/tiny-kimi/config.json", "results/target/tiny-kimi/tiny_target.json"]
    placeholders += [f"results/{ds}/rejected/normalize.parquet" for ds in cfg["datasets"]]
    for stage in ("prompts", "responses", "tokens", "validated", "rejected"):
        placeholders += [f"results/{ds}/{stage}/{s}.parquet" for ds, s in shards]
    placeholders += [f"results/{ds}/responses/{s}.json" for ds, s in shards]
    placeholders += [f"results/merged/{k:03d}.parquet" for k in range(cfg["merge"]["shards"])]
    placeholders += [f"results/merged/selection/{ds}/{s}.parquet" for ds, s in shards]
    placeholders += [f"results/reports/plan.{ext}" for ext in ("md", "html", "json")]  # extract waits for the plan
    for f in placeholders:  # whole files (a zero-byte parquet is a damaged output the run would remove and rebuild)
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        if f.endswith(".parquet"):
            pq.write_table(pa.table({"placeholder": pa.array([], pa.int8())}), work / f)
        else:
            (work / f).write_text("{}" if f.endswith(".json") else "")
    (work / "results/merged/manifest.json").write_text(
        json.dumps({"selections": {f"{ds}/{s}": {"digest": f"{ds}/{s}"} for ds, s in shards}})
    )
    record = tmp / "record"
    record.mkdir()
    _standins(tmp / "bin")
    env = snakemake_env()
    env["PATH"] = f"{tmp / 'bin'}{os.pathsep}{env['PATH']}"
    env["SLURM_STANDIN_DIR"] = str(record)
    env["EAGLE3_SLURM_ACCOUNT"] = "myproj"
    # one run per target: a forced generate would otherwise hold back the extract job behind the merge checkpoint
    for rule, target in (("extract", EXTRACT), ("generate", GENERATE), ("plan", PLAN)):
        cmd = [
            sys.executable,
            "-m",
            "snakemake",
            "--workflow-profile",
            "profiles/slurm",
            "--force",
            "--allowed-rules",
            rule,
            "--slurm-init-seconds-before-status-checks",
            "1",
            "--latency-wait",
            "1",
            "--retries",
            "0",
            "--",
            target,
        ]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    sb = _calls(record, "sbatch")
    assert len(sb) == 3, f"expected 3 sbatch calls, got {len(sb)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    jobs = {}
    for argv in sb:
        wrap = _opt(argv, "--wrap") or ""
        rule = next((r for r in ("extract", "generate", "plan") if f"--target-jobs '{r}:" in wrap), "?")
        jobs[rule] = argv
    return {"jobs": jobs, "proc": proc, "record": record}


def test_profile_keys_are_the_plugins():
    prof = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    assert prof["executor"] == "slurm"
    text = (ROOT / "profiles" / "slurm" / "config.yaml").read_text()
    # GPUs through the plugin's resources, never through slurm_extra (the plugin rejects --gres/--gpus there)
    assert "slurm_extra" not in yaml.safe_dump(prof)
    assert "gres" not in yaml.safe_dump(prof)
    assert "--workflow-profile profiles/slurm" in text


def test_extract_job_asks_for_a_gpu_on_the_gpu_partition(submitted):
    argv = submitted["jobs"]["extract"]
    assert _opt(argv, "-p") == "gpu"
    assert _opt(argv, "--gpus") == "1"  # the rule's resources: gpu=extract.gpus_per_job
    assert _opt(argv, "-A") == "myproj"  # $EAGLE3_SLURM_ACCOUNT, checked with sacctmgr
    assert _opt(argv, "-t") == "480" and _opt(argv, "--mem") == "128000"
    assert _opt(argv, "--cpus-per-task") == "8"
    assert not any(a.startswith("--gres") for a in argv)
    wrap = _opt(argv, "--wrap")
    assert "--target-jobs 'extract:ds=sharegpt_demo,shard=000'" in wrap and "--executor slurm-jobstep" in wrap


def test_plan_job_measuring_throughput_asks_for_a_gpu_on_the_gpu_partition(submitted):
    """plan.tokens_per_s_per_gpu is null in the demo: the plan measures on a GPU, so it must not go to the cpu
    partition with --gpus (a job no cpu partition can run)."""
    argv = submitted["jobs"]["plan"]
    assert (_opt(argv, "-p"), _opt(argv, "--gpus")) == ("gpu", "1")
    assert _opt(argv, "-t") == "60" and _opt(argv, "--mem") == "128000"


def test_generate_job_is_a_long_cpu_job(submitted):
    argv = submitted["jobs"]["generate"]
    assert _opt(argv, "-p") == "cpu"
    assert _opt(argv, "--gpus") is None
    assert _opt(argv, "-A") == "myproj"
    assert _opt(argv, "-t") == "2880" and _opt(argv, "--mem") == "16000"
    assert _opt(argv, "--cpus-per-task") == "4"
    assert "--target-jobs 'generate:ds=sharegpt_demo,shard=000'" in _opt(argv, "--wrap")


def test_plugin_checked_the_account_and_polled_sacct(submitted):
    record = submitted["record"]
    (acct,) = {tuple(c) for c in _calls(record, "sacctmgr")}
    assert acct[:4] == ("-n", "-s", "list", "user")
    polls = [c for c in _calls(record, "sacct") if "--parsable2" in c]
    assert polls, "the plugin never polled sacct"
    # the stand-in said FAILED, so the run fails quickly and says so
    assert submitted["proc"].returncode != 0
    assert "SLURM status is: 'FAILED'" in submitted["proc"].stdout + submitted["proc"].stderr
    print(" ".join(shlex.quote(a) for a in submitted["jobs"]["extract"][:20]))
