"""A change costs what it changes, down to the GPU: real reruns of the demo build (copies of ``demo_run``),
counting the tokens that pass through the target (each extract job's summary: forwarded vs reused tokens,
checked against the model's input in tests/workflow/test_extract.py) and which hidden-states files were rewritten.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from eagle3_data.testing.workflow import run_snakemake

pytestmark = pytest.mark.slow


def states(wd: Path) -> dict[str, tuple[int, bytes]]:
    """Every hidden-states file: ``{"<ds>/<shard>": (mtime_ns, bytes)}``."""
    out = {}
    for p in sorted((wd / "results/hidden_states").glob("*/*.safetensors")):
        out[f"{p.parent.name}/{p.stem}"] = (p.stat().st_mtime_ns, p.read_bytes())
    return out


def summaries(wd: Path) -> dict[str, dict]:
    return {
        f"{p.parent.name}/{p.stem}": json.loads(p.read_text())
        for p in sorted((wd / "results/hidden_states").glob("*/*.json"))
    }


def selection_tokens(wd: Path, key: str) -> dict[str, int]:
    t = pq.read_table(wd / f"results/merged/selection/{key}.parquet", columns=["sample_id", "num_tokens"])
    return dict(zip(t.column("sample_id").to_pylist(), t.column("num_tokens").to_pylist()))


def rerun_jobs(before: dict, after: dict) -> set[str]:
    """Selections whose extract job ran: its summary was rewritten (a job always rewrites its outputs)."""
    return {k for k in after if k not in before or after[k] != before[k]}


def total_tokens(wd: Path) -> int:
    return json.loads((wd / "results/merged/manifest.json").read_text())["totals"]["tokens"]


@pytest.fixture
def scratch(demo_run, tmp_path) -> Path:
    wd = tmp_path / "copy"
    shutil.copytree(demo_run, wd, symlinks=True)
    return wd


def _overrides(wd: Path, text: str) -> list[str]:
    (wd / "overrides.yaml").write_text(text)
    return ["--configfile", "config.yaml", "overrides.yaml"]


def test_retrying_one_failed_request_forwards_only_that_sample(scratch):
    """The journal loses one validated sample's response (as if its request had failed); `--forcerun generate`
    sends exactly that request again; only its shard's states are recomputed, and only for that sample."""
    key = "sharegpt_demo/000"
    journal = scratch / "cache/journal/sharegpt_demo/000.jsonl"
    lines = journal.read_text().splitlines()
    sel = selection_tokens(scratch, key)
    victim = next(i for i, ln in enumerate(lines) if json.loads(ln)["sample_id"] in sel)
    sid = json.loads(lines[victim])["sample_id"]
    journal.write_text("\n".join(lines[:victim] + lines[victim + 1 :]) + "\n")
    before_states, before_sum = states(scratch), summaries(scratch)

    proc = run_snakemake(scratch, "--cores", "2", "--forcerun", "generate")
    sent = [json.loads(p.read_text())["sent"] for p in (scratch / "results").glob("*/responses/*.json")]
    assert sum(sent) == 1, sent
    after_states, after_sum = states(scratch), summaries(scratch)
    ran = rerun_jobs(before_sum, after_sum)
    assert ran <= {key}, ran  # the other selections' jobs never ran
    for k in after_states:
        if k != key:
            assert after_states[k] == before_states[k], f"{k} was rewritten"
    if ran:  # the new response validated: only it went through the model
        s = after_sum[key]
        new_sel = selection_tokens(scratch, key)
        assert s["forwarded_samples"] == (1 if sid in new_sel else 0)
        assert s["forwarded_tokens"] == new_sel.get(sid, 0) <= sum(new_sel.values()) < total_tokens(scratch)
        assert s["reused_tokens"] == sum(new_sel.values()) - s["forwarded_tokens"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_new_dataset_forwards_only_its_tokens(scratch):
    cfg = yaml.safe_load((scratch / "config.yaml").read_text())
    before_states, before_sum = states(scratch), summaries(scratch)
    # prompts no other dataset holds (a copy of ultrachat_demo's would reuse its replies, found by what was asked,
    # and merge would drop the identical rows as duplicates)
    args = _overrides(
        scratch,
        "datasets:\n  math_more:\n    source: {format: instruction_response, path: "
        "resources/samples/math_word_problems.jsonl, max_samples: 5}\n    shards: 1\n",
    )
    run_snakemake(scratch, "--cores", "2", *args)
    after_states, after_sum = states(scratch), summaries(scratch)
    assert rerun_jobs(before_sum, after_sum) == {"math_more/000"}
    for k, v in before_states.items():
        assert after_states[k] == v, f"{k} was rewritten"  # same bytes, same mtime
    s = after_sum["math_more/000"]
    assert s["forwarded_tokens"] == sum(selection_tokens(scratch, "math_more/000").values()) > 0
    assert s["reused_tokens"] == 0
    assert len(cfg["datasets"]) + 1 == len({k.split("/")[0] for k in after_states})
    # the exports follow the new shuffled order and hold every kept sample
    man = json.loads((scratch / "results/merged/manifest.json").read_text())
    assert len(list((scratch / "results/export/specforge").rglob("data_*.ckpt"))) == man["totals"]["samples"]


def test_cap_and_max_len_changes_forward_only_the_affected_samples(scratch):
    ds = "sharegpt_demo"
    keys = [f"{ds}/000", f"{ds}/001"]
    kept = {k: selection_tokens(scratch, k) for k in keys}
    n = sum(len(v) for v in kept.values())

    # lower the cap: the dataset's jobs rerun, nothing is forwarded (every kept sample is stored)
    before_states, before_sum = states(scratch), summaries(scratch)
    run_snakemake(scratch, "--cores", "2", *_overrides(scratch, f"merge:\n  max_samples: {{{ds}: {n - 4}}}\n"))
    after_states, after_sum = states(scratch), summaries(scratch)
    ran = rerun_jobs(before_sum, after_sum)
    assert ran and ran <= set(keys)
    assert all(after_sum[k]["forwarded_tokens"] == 0 for k in ran)
    assert all(after_states[k] == before_states[k] for k in after_states if k not in ran)
    assert sum(after_sum[k]["num_samples"] for k in keys) == n - 4

    # raise it back: only the samples the lower cap had dropped go through the model again
    before_sum = summaries(scratch)
    capped = {k: selection_tokens(scratch, k) for k in keys}
    run_snakemake(scratch, "--cores", "2", *_overrides(scratch, "merge:\n  max_samples: {}\n"))
    after_sum = summaries(scratch)
    back = {k: selection_tokens(scratch, k) for k in keys}
    assert back == kept
    readded = sum(t for k in keys for sid, t in back[k].items() if sid not in capped[k])
    assert sum(after_sum[k]["forwarded_tokens"] for k in rerun_jobs(before_sum, after_sum)) == readded > 0

    # a lower max_len: the states of a truncated sample are the prefix of the stored ones (causal model), so
    # exactly the selections holding a longer sample rerun, and forward nothing
    before_states, before_sum = states(scratch), summaries(scratch)
    before_sel = {k: selection_tokens(scratch, k) for k in before_sum}
    longest = max(t for v in before_sel.values() for t in v.values())
    cut = max(8, longest // 2)
    run_snakemake(scratch, "--cores", "2", *_overrides(scratch, f"merge:\n  max_len: {cut}\n"))
    after_states, after_sum = states(scratch), summaries(scratch)
    ran = rerun_jobs(before_sum, after_sum)
    assert ran == {k for k, v in before_sel.items() if max(v.values(), default=0) > cut} != set()
    assert all(after_sum[k]["forwarded_tokens"] == 0 for k in ran)
    assert all(after_states[k] == before_states[k] for k in after_states if k not in ran)


def _dry_run_rules(wd: Path, *args: str) -> set[str]:
    """The rules a dry run would run (``--quiet rules``' job stats)."""
    out = run_snakemake(wd, "-n", "--quiet", "rules", *args)
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return set()
    table = text.split("Job stats:")[1].split("Reasons:")[0]
    return {m.group(1) for m in re.finditer(r"^(\S+)\s+\d+\s*$", table, flags=re.M)} - {"job", "total"}


def _mtimes(wd: Path, *patterns: str) -> dict[str, int]:
    return {str(p.relative_to(wd)): p.stat().st_mtime_ns for pat in patterns for p in sorted(wd.glob(pat))}


def test_heldout_split_reruns_merge_and_exports_and_forwards_nothing(scratch):
    """merge.heldout on: merge, the exports (both sets), plan and vocab rerun; generation, tokenize and validate
    do not, and no extract job runs (the held-out rows stay in the selections). Off again: the training set is
    whole again and the held-out merged file is gone."""
    man0 = json.loads((scratch / "results/merged/manifest.json").read_text())
    upstream = (
        "results/*/responses/*.parquet",
        "results/*/tokens/*.parquet",
        "results/*/validated/*.parquet",
        "results/*/prompts/*.parquet",
        "results/merged/selection/*/*.parquet",
    )
    before_up = _mtimes(scratch, *upstream[:-1])
    before_states, before_sum = states(scratch), summaries(scratch)
    vocab_before = (scratch / "results/vocab/vocab.json").stat().st_mtime_ns
    args = _overrides(scratch, "merge:\n  heldout: 0.3\n")
    # the dry run lists every extract job as waiting on the merge checkpoint; the real run below runs none
    assert _dry_run_rules(scratch, *args) == {
        "merge",
        "provenance",
        "extract",
        "export",
        "export_heldout",
        "plan",
        "vocab",
        "all",
    }
    run_snakemake(scratch, "--cores", "2", *args)
    assert _mtimes(scratch, *upstream[:-1]) == before_up  # generate, tokenize, validate, normalize: not rerun
    assert rerun_jobs(before_sum, summaries(scratch)) == set() and states(scratch) == before_states
    assert (scratch / "results/vocab/vocab.json").stat().st_mtime_ns != vocab_before

    man = json.loads((scratch / "results/merged/manifest.json").read_text())
    held = pq.read_table(scratch / "results/merged/heldout.parquet").to_pylist()
    train = [
        r
        for k in range(len(man["shards"]))
        for r in pq.read_table(scratch / f"results/merged/{k:03d}.parquet").to_pylist()
    ]
    key = lambda r: (r["dataset"], r["sample_id"])  # noqa: E731
    assert len(held) == man["heldout"]["samples"] > 0 and len(train) == man["totals"]["samples"]
    assert not {key(r) for r in held} & {key(r) for r in train}
    assert len(held) + len(train) == man0["totals"]["samples"]  # the same kept rows, split (the demo has no cap)
    # drawn by prompt text: no held-out row's prompt_key (its normalized user text) is a training row's, and the
    # manifest states that rule
    keys = {
        (r["dataset"], r["sample_id"]): r["prompt_key"]
        for p in scratch.glob("results/*/prompts/*.parquet")
        for r in pq.read_table(p, columns=["dataset", "sample_id", "prompt_key"]).to_pylist()
    }
    prompt_of = lambda r: keys.get((r["dataset"], re.sub(r"@[0-9]+$", "", r["sample_id"])))  # noqa: E731
    held_keys, train_keys = {prompt_of(r) for r in held} - {None}, {prompt_of(r) for r in train} - {None}
    assert held_keys and train_keys and not held_keys & train_keys
    assert "prompt_key" in man["heldout"]["rule"]
    assert man["selections"] == man0["selections"]  # same digests: nothing to extract
    # exports: the training directory holds the training set only; the held-out one beside it, from index 0
    spec = sorted((scratch / "results/export/specforge").rglob("data_*.ckpt"))
    assert len(spec) == len(train)  # the files past the smaller training set's end were removed
    held_files = sorted((scratch / "results/export/heldout/specforge").rglob("data_*.ckpt"))
    assert sorted(int(p.stem[5:]) for p in held_files) == list(range(len(held)))
    first = torch.load(scratch / "results/export/heldout/specforge/rows_0-2000/data_0.ckpt", weights_only=True)
    assert first["input_ids"].tolist() == held[0]["input_ids"]
    info = json.loads((scratch / "results/export/heldout/specforge.json").read_text())
    assert (info["set"], info["num_samples"]) == ("heldout", len(held))
    # the vocabulary counts the training set's supervised tokens; the plan counts both sets (both are extracted)
    assert (
        json.loads((scratch / "results/vocab/vocab.json").read_text())["supervised_tokens"]
        == man["totals"]["supervised_tokens"]
    )
    plan = json.loads((scratch / "results/reports/plan.json").read_text())
    assert plan["totals"]["tokens"] == man0["totals"]["tokens"] == man["totals"]["tokens"] + man["heldout"]["tokens"]
    assert plan["totals"]["heldout_samples"] == len(held)

    # off again: everything trained on is the whole set again, the held-out merged file is removed
    before_sum = summaries(scratch)
    run_snakemake(scratch, "--cores", "2", *_overrides(scratch, "merge:\n  heldout: 0\n"))
    assert rerun_jobs(before_sum, summaries(scratch)) == set()
    assert not (scratch / "results/merged/heldout.parquet").exists()
    assert len(list((scratch / "results/export/specforge").rglob("data_*.ckpt"))) == man0["totals"]["samples"]
    assert "results/export/heldout" in (scratch / "logs/merge.log").read_text()  # the leftover export, named


def readme_step(n: int) -> list[str]:
    """The commands of README step ``n``'s first fenced bash block, as written."""
    from eagle3_data.testing.workflow import ROOT

    text = (ROOT / "README.md").read_text()
    start = text.index(f"**{n}. ")
    block = text[text.index("```bash\n", start) + len("```bash\n") :]
    return [ln for ln in block[: block.index("```")].splitlines() if ln.strip()]


def test_readme_step_8_exports_both_layouts_without_extracting(scratch):
    """README step 8 as written, after extraction: both layouts (and speculators' data directory) are written from
    the states already there; no extract job runs, no hidden-states file is rewritten, and the plan's rewrite (its
    disk check counts the new export) reuses the throughput it measured."""
    import subprocess

    import datasets

    printf, run = readme_step(8)
    assert printf == "printf 'export:\\n  layouts: [specforge, speculators]\\n' >> my.yaml"
    assert run == "snakemake --cores 16 --configfile my.yaml"
    # a user's my.yaml: the config the states were extracted with, without an export section (as the README's
    # step 2 makes it from resources/configs/openrouter.yaml)
    cfg = yaml.safe_load((scratch / "config.yaml").read_text())
    del cfg["export"]
    (scratch / "my.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    before_states, before_sum = states(scratch), summaries(scratch)
    subprocess.run(["bash", "-c", printf], cwd=scratch, check=True)
    proc = run_snakemake(scratch, *run.split()[1:])
    out = proc.stdout + proc.stderr
    stats = out.split("Job stats:")[1].split("Select jobs")[0] if "Job stats:" in out else ""
    ran = {m.group(1) for m in re.finditer(r"^(\S+)\s+\d+\s*$", stats, flags=re.M)} - {"job", "total"}
    assert "extract" not in ran and {"export", "export_dataset"} <= ran, ran
    assert rerun_jobs(before_sum, summaries(scratch)) == set() and states(scratch) == before_states
    man = json.loads((scratch / "results/merged/manifest.json").read_text())
    n = man["totals"]["samples"]
    assert len(list((scratch / "results/export/specforge").rglob("data_*.ckpt"))) == n
    spec = scratch / "results/export/speculators"
    assert len(list((spec / "hidden_states").glob("hs_*.safetensors"))) == n
    ds = datasets.load_from_disk(str(spec))  # speculators' ArrowDataset reads the data path with this
    assert len(ds) == n and set(ds.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    assert (spec / "token_freq.pt").is_file()
    first = json.loads((spec / "000.json").read_text())
    assert (first["final_norm"], first["final_state"]) == ("both", "pre")  # the default: both forms stored
    plan = json.loads((scratch / "results/reports/plan.json").read_text())
    assert plan["exports"]["requested"] == ["specforge", "speculators"] and plan["throughput"]["measured"]["cached"]
