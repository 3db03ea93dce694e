"""GPU assignment with file locks: distinct devices for concurrent jobs, n for a job needing n (fake pools)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from eagle3_data import devices
from eagle3_data.extract import device_context

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from eagle3_data.devices import gpu_devices
    n, hold, out, lock_dir = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    with gpu_devices(n, lock_dir=lock_dir, poll_s=0.05, timeout_s=60) as ids:
        t0 = time.time()
        seen = os.environ["CUDA_VISIBLE_DEVICES"]
        time.sleep(hold)
        t1 = time.time()
    with open(out, "w") as fh:
        json.dump({"ids": ids, "env": seen, "t0": t0, "t1": t1, "after": os.environ.get("CUDA_VISIBLE_DEVICES")}, fh)
    """
)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")}
    env.update(extra)
    return env


def run_workers(tmp_path, jobs: list[int], n_gpus: int, hold: float = 0.6) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = clean_env(EAGLE3_NUM_GPUS=str(n_gpus))
    procs = []
    for j, n in enumerate(jobs):
        out = tmp_path / f"out{j}.json"
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(script), str(n), str(hold), str(out), str(tmp_path / "locks")], env=env
                ),
                out,
                n,
            )
        )
    results = []
    for p, out, n in procs:
        assert p.wait(timeout=120) == 0
        r = json.loads(out.read_text())
        r["n"] = n
        results.append(r)
    return results


def overlapping(a, b) -> bool:
    return a["t0"] < b["t1"] and b["t0"] < a["t1"]


def test_concurrent_jobs_get_distinct_devices(tmp_path):
    # 6 jobs of 1-3 GPUs on a fake 4-GPU machine: more demand than devices, so some must wait
    jobs = [1, 2, 1, 3, 1, 2]
    results = run_workers(tmp_path, jobs, n_gpus=4)
    for r in results:
        assert len(r["ids"]) == r["n"] == len(set(r["ids"]))
        assert set(r["ids"]) <= {"0", "1", "2", "3"}
        assert r["env"] == ",".join(r["ids"])
        assert r["after"] is None  # restored after the block
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            if overlapping(a, b):
                assert not set(a["ids"]) & set(b["ids"]), (a, b)
    # demand 10 > 4: the jobs cannot all have run at once
    assert any(not overlapping(a, b) for i, a in enumerate(results) for b in results[i + 1 :])


def test_job_needing_all_devices_gets_all(tmp_path):
    results = run_workers(tmp_path, [8, 1, 8], n_gpus=8, hold=0.3)
    full = [r for r in results if r["n"] == 8]
    assert all(sorted(r["ids"], key=int) == [str(i) for i in range(8)] for r in full)
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            assert not overlapping(a, b)  # an 8-GPU job excludes every other job


def test_pool_errors_timeout_and_release_on_kill(tmp_path):
    env = clean_env(EAGLE3_NUM_GPUS="2")
    with pytest.raises(ValueError, match="needs 3 GPU"):
        with devices.gpu_devices(3, lock_dir=tmp_path, env=env):
            pass
    with pytest.raises(ValueError, match="EAGLE3_NUM_GPUS"):
        devices.visible_pool(clean_env(EAGLE3_NUM_GPUS="two"))
    assert devices.gpu_devices(0, env=env).__enter__() == []

    # a holder process keeps both devices; we time out; after it is killed we get them at once
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from eagle3_data.devices import gpu_devices\n"
            f"with gpu_devices(2, lock_dir={str(tmp_path)!r}):\n print('held', flush=True); time.sleep(60)",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not become free"):
            with devices.gpu_devices(1, lock_dir=tmp_path, env=dict(env), timeout_s=0.5, poll_s=0.05):
                pass
        assert time.monotonic() - t0 < 10
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    env2 = dict(env)
    with devices.gpu_devices(2, lock_dir=tmp_path, env=env2, timeout_s=5) as ids:
        assert sorted(ids) == ["0", "1"] and env2["CUDA_VISIBLE_DEVICES"] in ("0,1", "1,0")
    assert "CUDA_VISIBLE_DEVICES" not in env2


def test_pool_sources_and_slurm(tmp_path):
    assert devices.visible_pool(clean_env(CUDA_VISIBLE_DEVICES="3,5")) == (["3", "5"], "CUDA_VISIBLE_DEVICES")
    assert devices.visible_pool(clean_env(CUDA_VISIBLE_DEVICES="")) == ([], "CUDA_VISIBLE_DEVICES")
    # a user-restricted pool: ids come from that list
    env = clean_env(CUDA_VISIBLE_DEVICES="3,5")
    with devices.gpu_devices(1, lock_dir=tmp_path, env=env, timeout_s=5) as a:
        with devices.gpu_devices(1, lock_dir=tmp_path, env=clean_env(CUDA_VISIBLE_DEVICES="3,5"), timeout_s=5) as b:
            assert {a[0], b[0]} == {"3", "5"}
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    # SLURM: the scheduler's devices are used as they are, no lock files
    env = clean_env(CUDA_VISIBLE_DEVICES="0,1", SLURM_JOB_ID="42")
    with devices.gpu_devices(2, lock_dir=tmp_path / "slurm", env=env) as ids:
        assert ids == ["0", "1"]
    assert not (tmp_path / "slurm").exists()


def test_extract_device_context(tmp_path, monkeypatch):
    for k in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "EAGLE3_NUM_GPUS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(devices.shutil, "which", lambda name: None)  # no nvidia-smi: a CPU machine
    with device_context("auto", 1, tmp_path) as (dev, ids):
        assert (dev, ids) == ("cpu", [])
    monkeypatch.setenv("EAGLE3_NUM_GPUS", "4")
    import torch

    with device_context("auto", 1, tmp_path) as (dev, ids):  # GPUs present but a CPU-only torch build
        assert (dev, ids) == ("cpu" if torch.version.cuda is None else "cuda", ids)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build (CUDA itself is never touched here)
    monkeypatch.setattr(devices, "cuda_initialized", lambda: False)
    monkeypatch.setenv("EAGLE3_GPU_LOCK_DIR", str(tmp_path))
    with device_context("auto", 2, tmp_path) as (dev, ids):
        assert dev == "cuda" and len(ids) == 2
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(ids)
        # another job on the same machine (its own environment) gets the other two
        other = clean_env(EAGLE3_NUM_GPUS="4")
        with devices.gpu_devices(2, lock_dir=tmp_path, env=other, timeout_s=5) as ids2:
            assert not set(ids) & set(ids2) and len(ids2) == 2
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with device_context("cpu", 1, tmp_path) as (dev, ids):
        assert (dev, ids) == ("cpu", [])
    with pytest.raises(ValueError, match="device"):
        with device_context("tpu", 1, tmp_path):
            pass
