"""``answers: original`` in real builds: a copy of the demo build (``demo_run`` in conftest.py) with one dataset
switched to its source's own answers, beside the generated ones, run to the end; what the switch reruns (and back);
a config with no backend at all."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, run_snakemake

pytestmark = pytest.mark.slow

DS = "ultrachat_demo"  # one shard in the demo config


def _config(wd: Path) -> dict:
    return yaml.safe_load((wd / "config.yaml").read_text())


def _set_answers(wd: Path, value: str) -> dict:
    cfg = _config(wd)
    cfg["datasets"][DS]["answers"] = value
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def _jobs(out: str) -> dict[str, int]:
    """The job counts of the first ``Job stats:`` table in snakemake's output ({} for "Nothing to be done")."""
    if "Job stats:" not in out:
        return {}
    table = out.split("Job stats:")[1].split("Reasons:")[0].split("Select jobs")[0]
    jobs = {}
    for line in table.splitlines():
        m = re.match(r"^(\S+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) not in ("total", "job"):
            jobs[m.group(1)] = int(m.group(2))
    return jobs


def _dry_run_jobs(wd: Path) -> dict[str, int]:
    proc = run_snakemake(wd, "-n", "--quiet", "rules")
    return _jobs(proc.stdout + proc.stderr)


def _files(wd: Path, pattern: str) -> dict[str, bytes]:
    return {str(p.relative_to(wd)): p.read_bytes() for p in sorted(wd.glob(pattern)) if p.is_file()}


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture
def scratch(demo_run, tmp_path) -> Path:
    wd = tmp_path / "copy"
    shutil.copytree(demo_run, wd, symlinks=True)
    return wd


#: what a switch of one dataset's answers reruns, in a dry run (every extract job is listed: the merge checkpoint
#: decides after it which selections changed; tests/workflow/test_incremental.py style)
BELOW = {"tokenize", "validate", "merge", "provenance", "extract", "export", "plan", "vocab", "report", "view", "all"}


def test_switching_answers_reruns_the_datasets_responses_and_below_only(scratch):
    _set_answers(scratch, "original")
    jobs = _dry_run_jobs(scratch)
    assert set(jobs) == BELOW | {"original_answers"}, jobs  # no normalize, no generate of any dataset
    assert jobs["original_answers"] == jobs["tokenize"] == jobs["validate"] == 1


def test_original_answers_beside_generated_datasets_end_to_end_and_back(demo_run, scratch):
    """The demo with ultrachat_demo on its own answers: no request and no journal line for it, its rows through
    tokenize, validate, merge, extract and export beside the generated datasets' untouched files, labelled in the
    reports; switched back, generate answers every request from the journal (none sent)."""
    journal = _files(scratch, "cache/journal/**/*")
    others = _files(scratch, "results/*/responses/*")
    others = {k: v for k, v in others.items() if not k.startswith(f"results/{DS}/")}
    generated = {r["sample_id"]: r for r in _rows(scratch / f"results/{DS}/responses/000.parquet")}

    _set_answers(scratch, "original")
    proc = run_snakemake(scratch, "--cores", "2")
    out = proc.stdout + proc.stderr
    ran = _jobs(out)
    assert (
        ran.get("original_answers") == 1 and "generate" not in ran and not any(j.startswith("normalize_") for j in ran)
    ), ran
    assert _files(scratch, "cache/journal/**/*") == journal  # no request, nothing journaled
    assert {k: v for k, v in _files(scratch, "results/*/responses/*").items() if k in others} == others

    rows = _rows(scratch / f"results/{DS}/responses/000.parquet")
    summary = json.loads((scratch / f"results/{DS}/responses/000.json").read_text())
    assert summary["sent"] == 0 and summary["answers"] == "original" and summary["rows"] == len(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and {r["backend"] for r in rows} == {"original"}
    assert all(r["cost_usd"] is None and r["completion_tokens"] is None for r in rows)
    # mode last: the same samples and the same prompts generate sent, the source's answer instead of the target's
    assert {r["sample_id"] for r in ok} == set(generated)
    for r in ok:
        assert r["messages"] == generated[r["sample_id"]]["messages"]
        assert r["content"] != generated[r["sample_id"]]["content"] and r["reasoning"] == ""

    validated = _rows(scratch / f"results/{DS}/validated/000.parquet")
    rejected = _rows(scratch / f"results/{DS}/rejected/000.parquet")
    assert len(validated) + len(rejected) == len(rows) and len(validated) > 0.9 * len(rows)
    assert {r["backend"] for r in validated} == {"original"}
    manifest = json.loads((scratch / "results/merged/manifest.json").read_text())
    assert manifest["selections"][f"{DS}/000"]["samples"] > 0
    state = json.loads((scratch / f"results/hidden_states/{DS}/000.json").read_text())
    assert state["forwarded_tokens"] == manifest["selections"][f"{DS}/000"]["tokens"] > 0  # new rows: all forwarded
    assert len(list((scratch / "results/export/specforge").rglob("data_*.ckpt"))) == manifest["totals"]["samples"]

    tally = (scratch / "results/reports/tally.md").read_text()
    assert re.search(rf"^\| {DS} .*\| Original answers +\|", tally, flags=re.M), tally
    with open(scratch / "results/reports/cost.csv") as fh:
        cost = {(r["dataset"], r["backend"]): r for r in csv.DictReader(fh)}
    assert float(cost[(DS, "original")]["cost_usd"]) == 0.0 and int(cost[(DS, "original")]["responses_ok"]) == len(ok)
    last = out[out.rindex("Run summary") :].splitlines()
    line = next(ln for ln in last if ln.startswith(DS))
    assert line.rstrip().endswith("original answers") and "Original answers (answers: original" in out
    # the request settings of generation are nothing to a dataset that sends no request
    cfg = _config(scratch)
    cfg["datasets"][DS]["generation"] = {"temperature": 0.3, "max_tokens": 77, "budget_usd": 1.0}
    (scratch / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert _dry_run_jobs(scratch) == {}
    cfg["datasets"][DS]["generation"] = {"mode": "all"}  # which turns: its responses and below
    (scratch / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert set(_dry_run_jobs(scratch)) == BELOW | {"original_answers"}
    del cfg["datasets"][DS]["generation"]
    (scratch / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    # back to regenerate: generate runs again and the journal answers every request
    _set_answers(scratch, "regenerate")
    jobs = _dry_run_jobs(scratch)
    assert set(jobs) == BELOW | {"generate"} and jobs["generate"] == 1, jobs
    run_snakemake(scratch, "--cores", "2")
    back = json.loads((scratch / f"results/{DS}/responses/000.json").read_text())
    assert back["sent"] == 0 and back["from_journal"] == len(generated)
    assert _files(scratch, "cache/journal/**/*") == journal
    ids = {r["sample_id"]: r["input_ids"] for r in _rows(scratch / f"results/{DS}/validated/000.parquet")}
    assert ids == {r["sample_id"]: r["input_ids"] for r in _rows(demo_run / f"results/{DS}/validated/000.parquet")}


def test_a_config_without_backends_when_no_dataset_is_generated(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    cfg = _config(wd)
    del cfg["backends"], cfg["generation"]
    cfg["datasets"] = {
        DS: {**cfg["datasets"][DS], "answers": "original"},
        "pretokenized_demo": cfg["datasets"]["pretokenized_demo"],
    }
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    jobs = _dry_run_jobs(wd)
    assert jobs["original_answers"] == 1 and "generate" not in jobs and jobs["validate_pretokenized"] == 1, jobs
