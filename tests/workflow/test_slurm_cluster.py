"""The embedded default run for real on a one-node SLURM cluster through ``profiles/slurm``.

A real slurmctld + slurmd + slurmdbd (``eagle3_data.testing.slurm_cluster``) with two fake GPUs runs every job the executor
plugin submits; ``sbatch`` is wrapped to record each submission's arguments before it runs the real one. The
run starts from the response journal of the local demo run (``demo_run``), so generation replays the same
responses (sampling is random) and every output must equal the local run's: validated and merged parquet,
hidden states. Skipped, saying why, where the SLURM packages are not installed or the test does not run as root
(``.ci/run`` installs them with apt-get).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors import safe_open

from eagle3_data.testing.workflow import copy_workflow, snakemake_env
from eagle3_data.testing.slurm_cluster import ACCOUNT, SYSTEM_CONF, OneNodeCluster, has_own_config, missing
from eagle3_data.testing.slurm_cluster import sbatch_option as _opt

pytestmark = pytest.mark.slow

pytest.importorskip("snakemake_executor_plugin_slurm")

RECORDER = """#!/bin/bash
# records the argv of each sbatch call (NUL-separated, one file per call), then runs the real sbatch
printf '%s\\0' "$@" > "$(mktemp "{record}/sbatch.XXXXXX")"
exec {real} "$@"
"""

GPU_RULES = {"extract", "plan"}
EXPECTED_JOBS = {
    "tiny_target": 1,
    "normalize_sharegpt_demo": 1,
    "normalize_ultrachat_demo": 1,
    "normalize_sweagent_demo": 1,
    "normalize_pretokenized_demo": 1,
    "generate": 4,
    "tokenize": 4,
    "validate": 4,
    "validate_pretokenized": 1,
    "view": 1,
    "merge": 1,
    "extract": 5,
    "plan": 1,
    "vocab": 1,
    "export": 2,
    "report": 1,
    "provenance": 1,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    gone = missing()
    if gone:
        pytest.skip(
            f"real SLURM cluster test skipped: {', '.join(gone)} not available here (.ci/run installs "
            "munge slurm-client slurmctld slurmd slurmdbd mariadb-server with apt-get, as root)"
        )
    if has_own_config():
        pytest.skip(f"real SLURM cluster test skipped: this machine has a SLURM config of its own ({SYSTEM_CONF})")
    c = OneNodeCluster(tmp_path_factory.mktemp("cluster"), gpus=2).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def slurm_run(cluster, demo_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm-run")
    wd = copy_workflow(tmp / "w")
    shutil.copytree(demo_run / "cache" / "journal", wd / "cache" / "journal")  # the local run's responses
    record = tmp / "record"
    record.mkdir()
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "sbatch"
    shim.write_text(RECORDER.format(record=record, real=shutil.which("sbatch")))
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = snakemake_env({**cluster.env, "EAGLE3_SLURM_ACCOUNT": ACCOUNT})
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--workflow-profile",
        "profiles/slurm",
        "--slurm-init-seconds-before-status-checks",
        "1",
        "--retries",
        "0",
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=wd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=2400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the plugin can loop on status checks and ignore SIGTERM
        out, _ = proc.communicate()
        pytest.fail(f"the SLURM run did not finish in 2400 s:\n{out[-6000:]}")
    wall = time.monotonic() - t0
    calls = [f.read_bytes().decode().split("\0")[:-1] for f in sorted(record.glob("sbatch.*"))]
    (tmp / "sbatch-lines.txt").write_text("\n".join(" ".join(c) for c in calls) + "\n")
    print(f"\nreal-SLURM run: {wall:.0f} s wall, {len(calls)} sbatch calls (lines: {tmp / 'sbatch-lines.txt'})")
    return {"wd": wd, "rc": proc.returncode, "out": out, "calls": calls, "wall_s": wall}


def _rule(argv: list[str]) -> str:
    m = re.search(r"--target-jobs '([A-Za-z0-9_]+):", _opt(argv, "--wrap") or "")
    return m.group(1) if m else "?"


def test_every_rule_ran_on_the_partition_it_needs(slurm_run, cluster):
    assert slurm_run["rc"] == 0, slurm_run["out"][-8000:]
    by_rule: dict[str, list[list[str]]] = {}
    for argv in slurm_run["calls"]:
        by_rule.setdefault(_rule(argv), []).append(argv)
    assert {r: len(v) for r, v in by_rule.items()} == EXPECTED_JOBS
    for rule, calls in by_rule.items():
        for argv in calls:
            assert _opt(argv, "-A") == ACCOUNT
            if rule in GPU_RULES:
                assert (_opt(argv, "-p"), _opt(argv, "--gpus")) == ("gpu", "1"), (rule, argv)
            else:
                assert (_opt(argv, "-p"), _opt(argv, "--gpus")) == ("cpu", None), (rule, argv)
    # SLURM itself: every job completed, and the GPU jobs were given a (fake) GPU
    jobs = cluster.sacct_jobs()
    mine = [j for j in jobs if not j["name"] == "wrap"]
    assert len(mine) == sum(EXPECTED_JOBS.values()), jobs
    assert {j["state"] for j in mine} == {"COMPLETED"}, jobs
    gpu_jobs = [j for j in mine if j["partition"] == "gpu"]
    assert len(gpu_jobs) == 6 and all("gres/gpu=1" in j["tres"] for j in gpu_jobs), gpu_jobs


def _parquet_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_outputs_equal_the_local_run(slurm_run, demo_run):
    assert slurm_run["rc"] == 0, slurm_run["out"][-8000:]
    wd = slurm_run["wd"]
    compared = 0
    for sub in ("tokens", "validated", "rejected"):
        for local in sorted(demo_run.glob(f"results/*/{sub}/*.parquet")):
            rel = local.relative_to(demo_run)
            assert _parquet_rows(wd / rel) == _parquet_rows(local), rel
            compared += 1
    for local in sorted(demo_run.glob("results/merged/*.parquet")):
        rel = local.relative_to(demo_run)
        assert _parquet_rows(wd / rel) == _parquet_rows(local), rel
        compared += 1
    states = sorted(demo_run.glob("results/hidden_states/*/*.safetensors"))
    assert len(states) == 5  # one per validated shard
    for local in states:
        rel = local.relative_to(demo_run)
        with safe_open(str(local), "pt") as a, safe_open(str(wd / rel), "pt") as b:
            assert a.keys() == b.keys() and a.metadata() == b.metadata()
            for key in a.keys():
                ta, tb = a.get_tensor(key), b.get_tensor(key)
                assert ta.dtype == tb.dtype and ta.shape == tb.shape and bool((ta == tb).all()), (rel, key)
        compared += 1
    assert compared >= 20
    # generation replayed the local run's journal: no request was sent, no server started
    for log in (wd / "logs/generate").rglob("*.log"):
        if ".server-" not in log.name:
            assert re.search(r"\"sent\": 0\b", log.read_text()), log
