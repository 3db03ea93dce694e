"""The minimal configs of ``resources/configs/`` run end to end on their own, with stand-ins for what a test can't
have: the tiny thinking target for Kimi K2.5, and the fault server's exact-length variant
(``eagle3_data.testing.rehearsal_server``) for OpenRouter / the SGLang server the build launches.

Each run layers one small stand-in file on the shipped config (``--configfile <shipped> standin.yaml``): the target
(tiny, built by the workflow), the endpoint (URL, or the launch command), and a draft vocabulary that fits the
tiny target. Everything else (dataset, generation settings, defaults of the keys left out) is as shipped.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, run_snakemake

pytestmark = pytest.mark.slow

SERVER = "eagle3_data.testing.rehearsal_server"  # run with python -m
CANARY = "sk-or-v1-CANARY-minimal-config-7d1e"
# replies: reasoning of 12 characters, an answer of 5..40, billed completion = both + </think> + <|im_end|>
REPLY = {"reasoning_tokens": 12, "min_tokens": 5, "max_tokens": 40, "eot_tokens": 2}
TINY = {"name": "tiny-kimi", "path": "results/target/tiny-kimi", "build_tiny": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


@pytest.fixture
def openrouter_standin():
    port = _free_port()
    conf = {**REPLY, "reasoning_field": "reasoning", "require_key": CANARY}
    proc = subprocess.Popen(
        [sys.executable, "-m", SERVER, "--port", str(port), "--config", json.dumps(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "stand-in server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _check_build(wd, ds: str, shipped: dict) -> list[dict]:
    """Every stage's output is there and every generated sample validated, with its reasoning."""
    prompts = pq.read_table(wd / f"results/{ds}/prompts/000.parquet").num_rows
    responses = pq.read_table(wd / f"results/{ds}/responses/000.parquet").to_pylist()
    validated = pq.read_table(wd / f"results/{ds}/validated/000.parquet").to_pylist()
    rejected = pq.read_table(wd / f"results/{ds}/rejected/000.parquet").to_pylist()
    assert prompts > 10 and len(responses) == prompts
    assert not rejected, [(r["sample_id"], r["reason"], r["detail"]) for r in rejected]
    assert len(validated) == prompts
    assert all(len(r["reasoning"]) == 12 and r["content"] for r in responses)
    assert (wd / f"results/hidden_states/{ds}/000.safetensors").exists()
    assert (wd / "results/reports/tally.md").read_text().count(ds) >= 1
    manifest = json.loads((wd / "results/merged/manifest.json").read_text())
    assert manifest["totals"]["samples"] == len(validated)
    # the keys the shipped config leaves out took their defaults (one merged shard, no export)
    assert shipped.get("merge", {}).get("shards") is None and not (wd / "results/export").exists()
    return responses


def test_openrouter_config_runs_on_its_own(tmp_path, openrouter_standin):
    wd = copy_workflow(tmp_path / "w")
    shipped = yaml.safe_load((wd / "resources/configs/openrouter.yaml").read_text())
    standin = {
        "target": TINY,
        "backends": {"openrouter": {"base_url": f"{openrouter_standin}/v1"}},
        "vocab": {"draft_vocab_size": 256},
    }
    (wd / "standin.yaml").write_text(yaml.safe_dump(standin))
    run_snakemake(
        wd,
        "--cores",
        "2",
        "--configfile",
        "resources/configs/openrouter.yaml",
        "standin.yaml",
        env={"OPENROUTER_API_KEY": CANARY},
        timeout=1800,
    )
    responses = _check_build(wd, "sharegpt", shipped)
    assert {r["backend"] for r in responses} == {"openrouter"} and {r["provider"] for r in responses} == {
        "FaultProvider"
    }
    assert _stats(openrouter_standin)["completed"] == len(responses)
    # the shipped routing and reasoning settings reached the endpoint; the key did not reach any file
    bodies = httpx.get(f"{openrouter_standin}/admin/bodies", timeout=10).json()["bodies"]
    assert bodies and all(b["provider"] == shipped["backends"]["openrouter"]["provider"] for b in bodies)
    assert all(b["reasoning"] == {"enabled": True} and b["model"] == "moonshotai/kimi-k2.5" for b in bodies)
    assert all(b["max_tokens"] == 32768 and b["top_p"] == 0.95 for b in bodies)
    for sub in ("results", "logs", "cache", ".snakemake"):
        for p in (wd / sub).rglob("*"):
            assert not (p.is_file() and CANARY.encode() in p.read_bytes()), p


def test_sglang_local_config_runs_on_its_own(tmp_path):
    wd = copy_workflow(tmp_path / "w")
    shipped = yaml.safe_load((wd / "resources/configs/sglang-local.yaml").read_text())
    conf = {**REPLY, "reasoning_field": "reasoning_content"}
    command = f"{shlex.quote(sys.executable)} -m {SERVER} --port {{port}} --config {shlex.quote(json.dumps(conf))}"
    standin = {
        "target": TINY,
        "backends": {
            "sglang_local": {
                "launch": {"command": command, "ready_timeout_s": 120, "python": sys.executable, "gpus": 0}
            }
        },
        "vocab": {"draft_vocab_size": 256},
    }
    (wd / "standin.yaml").write_text(yaml.safe_dump(standin))
    run_snakemake(
        wd,
        "--cores",
        "2",
        "--configfile",
        "resources/configs/sglang-local.yaml",
        "standin.yaml",
        unset=["OPENROUTER_API_KEY"],
        timeout=1800,
    )
    responses = _check_build(wd, "ultrachat", shipped)
    assert {r["backend"] for r in responses} == {"sglang_local"}
    summary = json.loads((wd / "results/ultrachat/responses/000.json").read_text())
    assert summary["sent"] == len(responses)  # every response from the server the build launched
