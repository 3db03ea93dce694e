"""`snakemake --report` and the other modes that run no job, without the API key: they read the files a build
made and send nothing, so the config checks don't ask for the key there; a run still does.

Works on a copy of the session's finished demo run (``demo_run`` in conftest.py), its backend given an
``api_key_env`` and one responses shard removed: a build stopped before generation finished, whose dataset still
has requests to send.
"""

from __future__ import annotations

import json
import shutil

import pytest

from eagle3_data.testing.workflow import run_snakemake

KEY = "E3D_REPORT_TEST_KEY"


@pytest.fixture(scope="module")
def stopped_build(demo_run, tmp_path_factory):
    wd = tmp_path_factory.mktemp("report_without_key") / "wf"
    shutil.copytree(demo_run, wd, symlinks=True)
    cfg = wd / "config.yaml"
    text = cfg.read_text()
    assert text.count("    api_key_env: null") == 1
    cfg.write_text(text.replace("    api_key_env: null", f"    api_key_env: {KEY}"))
    (wd / "results" / "sharegpt_demo" / "responses" / "001.parquet").unlink()
    return wd


def test_a_run_still_asks_for_the_key(stopped_build):
    proc = run_snakemake(
        stopped_build, "--cores", "1", "results/sharegpt_demo/responses/001.parquet", check=False, unset=[KEY]
    )
    assert proc.returncode == 1
    assert f"Config error: {KEY} is not set (backends.tiny_local.api_key_env, used by sharegpt_demo)" in proc.stderr
    assert not (stopped_build / "results" / "sharegpt_demo" / "responses" / "001.parquet").exists()


def test_report_is_made_without_the_key(stopped_build):
    proc = run_snakemake(stopped_build, "--report", "report.html", check=False, unset=[KEY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert KEY not in proc.stdout + proc.stderr
    html = (stopped_build / "report.html").read_text()
    front = (stopped_build / "results" / "reports" / "front.html").read_text()
    assert json.dumps(front)[1:-1] in html  # the build's tally, cost and rejects, as the report rule wrote them
    assert not (stopped_build / "results" / "sharegpt_demo" / "responses" / "001.parquet").exists()


@pytest.mark.parametrize("args", [["--summary"], ["--rulegraph"], ["--list-changes", "params"]])
def test_other_modes_that_run_no_job_need_no_key(stopped_build, args):
    proc = run_snakemake(stopped_build, *args, check=False, unset=[KEY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert KEY not in proc.stdout + proc.stderr
    if args == ["--summary"]:  # the missing shard is what a run would make
        (row,) = [r for r in proc.stdout.splitlines() if r.startswith("results/sharegpt_demo/responses/001.parquet")]
        assert "missing" in row
