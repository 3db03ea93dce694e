"""Launched servers live for the workflow run (`transformers serve` standing in for SGLang): one start for every
generate job, gone after a failed run and after Ctrl-C; expected failures print one line; backend transport
settings are not rule params."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, run_snakemake, snakemake_env
from test_server_launch import gone

pytestmark = pytest.mark.slow

GENERATED = ["sharegpt_demo/000", "sharegpt_demo/001", "ultrachat_demo/000", "sweagent_demo/000"]


def server_pids(wd: Path) -> list[int]:
    """Pids of the server processes the run's log says were started (uvicorn's "Started server process [N]")."""
    log = wd / "logs" / "servers" / "tiny_local.log"
    return [int(p) for p in re.findall(r"Started server process \[(\d+)\]", log.read_text())] if log.exists() else []


@pytest.fixture(scope="module")
def prompts_built(tmp_path_factory) -> Path:
    """A scratch workflow with the tiny target and the prompts of the generated datasets built (nothing generated)."""
    wd = copy_workflow(tmp_path_factory.mktemp("servers"))
    run_snakemake(
        wd,
        "--cores",
        "2",
        "results/target/tiny-kimi",
        *[f"results/{s.split('/')[0]}/prompts/{s.split('/')[1]}.parquet" for s in GENERATED],
    )
    return wd


def fresh_copy(built: Path, dest: Path) -> Path:
    shutil.copytree(built, dest, symlinks=True)
    return dest


def test_demo_run_started_one_server_for_all_generate_jobs(demo_run):
    summaries = [
        json.loads((demo_run / f"results/{ds}/responses/{shard}.json").read_text())
        for ds, shard in (s.split("/") for s in GENERATED)
    ]
    assert sum(len(s["servers_started"]) for s in summaries) == 1  # one job started it ...
    assert sum(len(s["servers_attached"]) for s in summaries) == 3  # ... the three others attached
    pids = server_pids(demo_run)
    assert len(pids) == 1, (demo_run / "logs/servers/tiny_local.log").read_text()[-3000:]
    assert gone(pids[0], within=1.0)  # stopped when the run ended
    assert not (demo_run / "cache" / "runs").exists()  # and the run's state removed
    stop = re.findall(
        r"supervisor of tiny_local\] stopping: (.*)", (demo_run / "logs/servers/tiny_local.log").read_text()
    )
    assert stop in (["SIGTERM"], ["no job used it for 300 s"]), stop  # the end of the run, or idle since generation


def test_transport_settings_rerun_nothing(demo_run, tmp_path):
    wd = tmp_path / "wd"
    shutil.copytree(demo_run, wd, symlinks=True)
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    b = cfg["backends"]["tiny_local"]
    b.update(max_concurrency=16, timeout_s=99, down_after_s=5)
    b["launch"].update(ready_timeout_s=600, idle_timeout_s=30)
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = run_snakemake(wd, "-n").stdout
    assert "Nothing to be done" in out, out[-3000:]


def test_failed_run_stops_the_server_and_says_why_once(prompts_built, tmp_path):
    from eagle3_data.backends import free_port

    wd = fresh_copy(prompts_built, tmp_path / "wd")
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    url = f"http://127.0.0.1:{free_port()}/v1"
    cfg["backends"]["dead"] = {
        "type": "openai",
        "base_url": url,
        "model": "m",
        "api_key_env": None,
        "max_concurrency": 2,
        "timeout_s": 10,
        "down_after_s": 3,
    }
    cfg["datasets"]["ultrachat_demo"]["generation"] = {"backends": ["dead"]}
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    targets = [
        "results/sharegpt_demo/responses/000.parquet",
        "results/sharegpt_demo/responses/001.parquet",
        "results/ultrachat_demo/responses/000.parquet",
    ]
    proc = run_snakemake(wd, "--cores", "2", *targets, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out
    said = [ln for ln in out.splitlines() if f"backend 'dead' ({url}) refused connections for 3 s" in ln]
    job = [ln for ln in said if " ERROR eagle3_data: " in ln]  # the job's one line, as it ends
    why = [ln for ln in said if ln.strip().startswith("logs/generate/ultrachat_demo/000.log: ")]  # the last screen
    last = out.rstrip().splitlines()[-1]  # and the run's last line (not Snakemake's WorkflowError)
    assert len(job) == 1 and len(why) == 1 and len(said) == 3 and last == f"The run failed: {why[0].strip()}", out[
        -4000:
    ]
    assert out.index(job[0]) < out.index("Why (each failed job's error; its log has the details):") < out.index(why[0])
    assert job[0].endswith(
        "Start the server or fix the backend's base_url, then rerun the same command; 0 responses "
        "of ultrachat_demo are journaled and will not be requested again"
    )
    pids = server_pids(wd)
    assert len(pids) == 1 and gone(pids[0], within=1.0)
    assert not (wd / "cache" / "runs").exists()


def test_ctrl_c_stops_the_server_and_prints_how_to_resume_once(prompts_built, tmp_path):
    wd = fresh_copy(prompts_built, tmp_path / "wd")
    targets = ["results/sharegpt_demo/responses/000.parquet", "results/sharegpt_demo/responses/001.parquet"]
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "2", *targets],
            cwd=wd,
            env=snakemake_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    journal = wd / "cache" / "journal" / "sharegpt_demo"
    try:
        deadline = time.monotonic() + 300
        while not any(p.stat().st_size for p in journal.glob("*.jsonl")):  # the server is up and answering
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()[-3000:]
            time.sleep(0.2)
        before = len(out_path.read_text().splitlines())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
        assert proc.wait(120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out_path.read_text()
    after = text.splitlines()[before:]
    n = sum(p.read_bytes().count(b"\n") for p in journal.glob("*.jsonl"))
    assert "Traceback" not in text
    said = [ln for ln in after if ln.startswith("Interrupted (Ctrl-C).")]
    assert said == [
        f"Interrupted (Ctrl-C). Rerun the same command to resume; {n:,} response{'s' if n != 1 else ''} "
        f"of this config {'are' if n != 1 else 'is'} journaled in cache/journal/ and will not be requested "
        "again."
    ], "\n".join(after)
    assert not any("interrupted. Rerun" in ln for ln in after)  # the jobs' own lines went to their log files
    pids = server_pids(wd)
    assert len(pids) == 1 and gone(pids[0], within=1.0)
    assert not (wd / "cache" / "runs").exists()
    (tmp_path / "ctrl_c_lines.txt").write_text("\n".join(after))
