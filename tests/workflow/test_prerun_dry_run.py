"""The checks before any job runs (eagle3_data.runtime.prerun) in a dry run of the workflow: a missing target and an
unset SLURM account variable are each one line, no traceback (the checks themselves: tests/unit/test_prerun.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, snakemake_env


def _dry_run(wd, *args, env=None, unset=()):
    e = snakemake_env(env, unset=list(unset))
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", *args], cwd=wd, env=e, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_dry_run_refuses_a_missing_target_and_an_unset_slurm_account(tmp_path):
    wd = copy_workflow(tmp_path / "w")
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    cfg["target"].update(path="models/not-downloaded", build_tiny=False)
    (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
    p = _dry_run(wd, "--cores", "1", "--configfile", "mine.yaml")
    assert p.returncode == 1
    errs = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert errs[-1].startswith("Config error: target.path: models/not-downloaded does not exist"), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    pytest.importorskip("snakemake_executor_plugin_slurm")
    p = _dry_run(wd, "--workflow-profile", "profiles/slurm", unset=["EAGLE3_SLURM_ACCOUNT"])
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "slurm_account" in p.stderr and "EAGLE3_SLURM_ACCOUNT is not set" in p.stderr, p.stderr[-3000:]
