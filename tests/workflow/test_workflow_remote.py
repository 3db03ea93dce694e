"""The workflow against a remote-style (OpenRouter-shaped) backend that needs an API key and injects faults.

A canary key set in the environment must appear in no file the build writes (results/, logs/, the journal in
cache/, .snakemake/), neither after a run with retried and failed requests nor after a run stopped by a 401.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, run_snakemake
from eagle3_data.testing.fault_server import FaultServer

CANARY = "sk-or-v1-CANARY-3f9c2e7a1b5d4c8e9f0a"


def _files_containing(root: Path, needle: str) -> list[Path]:
    hits = []
    for sub in ("results", "logs", "cache", ".snakemake"):
        for p in (root / sub).rglob("*"):
            if p.is_file() and needle.encode() in p.read_bytes():
                hits.append(p)
    return hits


@pytest.fixture
def remote_workflow(tmp_path):
    server = FaultServer(
        {
            "require_key": CANARY,
            "p429": 0.10,
            "p5xx": 0.05,
            "perror200": 0.02,
            "pmalformed": 0.02,
            "retry_after_s": 0.01,
            "min_tokens": 5,
            "max_tokens": 30,
        }
    ).start()
    wd = copy_workflow(tmp_path / "wf")
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    cfg["backends"]["remote"] = {
        "type": "openrouter",
        "base_url": f"{server.url}/v1",
        "model": "moonshotai/kimi-k2.5",
        "api_key_env": "CANARY_API_KEY",
        "max_concurrency": 16,
        "timeout_s": 10,
    }
    # unpaid_failures: keep, so a sample whose one retry failed is written as a failed row (its error message must
    # not carry the key either) and the run ends rc 0
    cfg["generation"].update(
        {
            "backends": ["remote"],
            "max_retries": 1,
            "retry_initial_s": 0.01,
            "retry_max_s": 0.05,
            "unpaid_failures": "keep",
        }
    )
    cfg["datasets"] = {k: v for k, v in cfg["datasets"].items() if k in ("ultrachat_demo", "sharegpt_demo")}
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        yield wd, server
    finally:
        server.stop()


def test_canary_key_is_never_written(remote_workflow, monkeypatch):
    wd, server = remote_workflow
    monkeypatch.setenv("CANARY_API_KEY", CANARY)
    targets = ["results/ultrachat_demo/tokens/000.parquet", "results/sharegpt_demo/tokens/001.parquet"]
    run_snakemake(wd, "--cores", "2", *targets)
    rows = pq.read_table(wd / "results/ultrachat_demo/responses/000.parquet").to_pylist()
    assert rows and {r["provider"] for r in rows if r["status"] == "ok"} == {"FaultProvider"}
    assert server.stats()["requests"] > len(rows), "faults were injected, so some requests were retried"
    assert max(server.stats()["completed_by_body"].values()) == 1, "no completed request paid twice"
    assert _files_containing(wd, CANARY) == []

    # a wrong key: 401 stops the job at once with a clear message that does not carry the key either
    monkeypatch.setenv("CANARY_API_KEY", CANARY + "-revoked")
    shutil.rmtree(wd / "cache/journal/ultrachat_demo")  # so the rerun must send requests
    # targets first: --forcerun takes every word after it as a rule name
    proc = run_snakemake(wd, "--cores", "1", *targets, "--forcerun", "generate", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "401" in out, out[-4000:]
    assert CANARY not in out
    assert _files_containing(wd, CANARY) == []
