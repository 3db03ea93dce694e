"""The whole Snakefile on a scratch copy of the embedded default config, checked stage by stage by value.

One full run (module-scoped fixture, a few minutes on 2 cores) feeds every test here; the incremental tests
work on copies of the finished tree so they see the real Snakemake metadata.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from safetensors import safe_open

from eagle3_data.testing.workflow import run_snakemake

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(demo_run) -> Path:
    return demo_run


def config(wd: Path) -> dict:
    return yaml.safe_load((wd / "config.yaml").read_text())


def rows(paths) -> list[dict]:
    out = []
    for p in paths:
        out.extend(pq.read_table(p).to_pylist())
    return out


def test_every_stage_output_exists_and_tally_is_printed(built):
    cfg = config(built)
    for ds, d in cfg["datasets"].items():
        for s in range(d.get("shards", 1)):
            assert (built / f"results/{ds}/validated/{s:03d}.parquet").exists()
            assert (built / f"results/{ds}/rejected/{s:03d}.parquet").exists()
    for k in range(cfg["merge"]["shards"]):
        assert (built / f"results/merged/{k:03d}.parquet").exists()
    for ds, d in cfg["datasets"].items():  # one hidden-states file per validated shard (merge selection)
        for s in range(d.get("shards", 1)):
            assert (built / f"results/hidden_states/{ds}/{s:03d}.safetensors").exists()
    out = (built / "run.out").read_text()
    # the run's last lines: one row per dataset with what generate, validate and the rejects counted
    summary = out[out.rindex("Run summary") :].splitlines()
    assert summary[0] == "Run summary"
    cells = {ln.split()[0]: ln.split() for ln in summary[3:]}
    for ds, d in cfg["datasets"].items():
        n = d.get("shards", 1)
        kept = len(rows([built / f"results/{ds}/validated/{s:03d}.parquet" for s in range(n)]))
        rejected = len(rows(sorted((built / f"results/{ds}/rejected").glob("*.parquet"))))
        if d["source"]["format"] == "pretokenized":
            # samples = its rows: kept + rejected at every stage (the columns add up)
            assert cells[ds][1:5] == ["-", str(kept + rejected), str(rejected), str(kept)]
        else:
            prompts = len(rows([built / f"results/{ds}/prompts/{s:03d}.parquet" for s in range(n)]))
            source_rejects = len(rows([built / f"results/{ds}/rejected/normalize.parquet"]))
            # shards, samples (the source rows: prompts + normalize's rejects), ok, failed, not sent, rejected,
            # kept, left, cost; every source row is kept or rejected (the columns add up)
            assert cells[ds][1:10] == [
                f"{n}/{n}",
                str(prompts + source_rejects),
                str(prompts),
                "0",
                "0",
                str(rejected),
                str(kept),
                "0",
                "0.00",
            ], summary
            assert prompts + source_rejects == kept + rejected
        assert cells[ds][-1] in ("done", "pre-tokenized")
    # the server the build launched is gone and left no temp files behind
    assert not list((built / "results").rglob("*.tmp"))


def test_counts_are_conserved_from_prompts_to_validated(built):
    cfg = config(built)
    for ds, d in cfg["datasets"].items():
        n = d.get("shards", 1)
        norm_rejects = rows([built / f"results/{ds}/rejected/normalize.parquet"])
        if d["source"]["format"] == "pretokenized":
            upstream = rows([built / f"results/{ds}/tokens/{s:03d}.parquet" for s in range(n)])
        else:
            prompts = rows([built / f"results/{ds}/prompts/{s:03d}.parquet" for s in range(n)])
            responses = rows([built / f"results/{ds}/responses/{s:03d}.parquet" for s in range(n)])
            # mode `last`: exactly one response per prompt, none twice
            assert sorted(r["sample_id"] for r in responses) == sorted(p["sample_id"] for p in prompts)
            upstream = prompts
        validated = rows([built / f"results/{ds}/validated/{s:03d}.parquet" for s in range(n)])
        rejected = rows([built / f"results/{ds}/rejected/{s:03d}.parquet" for s in range(n)])
        assert len(validated) + len(rejected) == len(upstream), ds
        assert not {r["sample_id"] for r in validated} & {r["sample_id"] for r in rejected}
        assert len(validated) > 0, ds
        # the bundled samples include messy rows: each is rejected with a reason, never dropped silently
        assert all(r["reason"] for r in norm_rejects + rejected)
        assert norm_rejects, f"{ds}: the bundled sample has messy rows that normalize must reject"


def test_every_generated_sample_validates_with_its_reasoning(built):
    """The tiny thinking target's completions (reasoning, end-of-reasoning marker, answer, end of turn) all pass
    validation: reasoning markers, round trip and the exact billed-count audit included."""
    cfg = config(built)
    ok = bad = 0
    for ds, d in cfg["datasets"].items():
        if d["source"]["format"] == "pretokenized":
            continue
        n = d.get("shards", 1)
        ok += len(rows([built / f"results/{ds}/validated/{s:03d}.parquet" for s in range(n)]))
        rejected = rows([built / f"results/{ds}/rejected/{s:03d}.parquet" for s in range(n)])
        bad += len(rejected)
        assert not rejected, [(r["sample_id"], r["reason"], r["detail"]) for r in rejected]
        responses = rows([built / f"results/{ds}/responses/{s:03d}.parquet" for s in range(n)])
        assert responses and all(r["reasoning"] and r["content"] for r in responses), ds
    assert ok > 50 and bad == 0


def test_audit_shows_our_prompts_and_completions_are_what_the_server_counted(built):
    """The demo's server (`transformers serve` on the tiny target) renders prompts with the target's own chat
    template and counts the ids it generated: every validated generated sample must agree with it exactly, the
    tool-calling SWE-agent prompts included (a gap here = a template or tokenization drift)."""
    import csv

    with open(built / "results/reports/audit.csv") as fh:
        audit = {(r["dataset"], r["ids_source"]): r for r in csv.DictReader(fh)}
    total = audit[("(all)", "(all)")]
    cfg = config(built)
    generated = [ds for ds, d in cfg["datasets"].items() if d["source"]["format"] != "pretokenized"]
    validated = rows(
        [
            built / f"results/{ds}/validated/{s:03d}.parquet"
            for ds in generated
            for s in range(cfg["datasets"][ds].get("shards", 1))
        ]
    )
    assert int(total["samples"]) == len(validated) > 50
    assert int(total["prompt_billed_samples"]) == int(total["prompt_equal_samples"]) == len(validated)
    assert int(total["completion_billed_samples"]) == int(total["completion_equal_samples"]) == len(validated)
    assert int(total["prompt_tokens"]) == sum(r["num_prompt_tokens"] for r in validated)
    assert {ds for ds, src in audit if src != "(all)"} == set(generated)
    assert int(audit[("sweagent_demo", "(all)")]["prompt_equal_samples"]) > 10


def test_token_ids_and_loss_mask_cover_exactly_the_completion(built):
    from transformers import AutoTokenizer

    cfg = config(built)
    tok = AutoTokenizer.from_pretrained(built / cfg["target"]["path"])
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    checked = 0
    for ds, d in cfg["datasets"].items():
        n = d.get("shards", 1)
        validated = rows([built / f"results/{ds}/validated/{s:03d}.parquet" for s in range(n)])
        for r in validated:
            ids, mask = r["input_ids"], r["loss_mask"]
            assert len(ids) == len(mask) == r["num_tokens"]
            assert 0 <= min(ids) and max(ids) < len(tok)
            assert ids[-1] == eot and mask[-1] == 1
        if d["source"]["format"] == "pretokenized":
            continue
        responses = {
            r["sample_id"]: r for r in rows([built / f"results/{ds}/responses/{s:03d}.parquet" for s in range(n)])
        }
        for r in validated:
            resp = responses[r["sample_id"]]
            prompt = tok.apply_chat_template(
                json.loads(resp["messages"]),
                tools=json.loads(resp["tools"]) if resp["tools"] else None,
                add_generation_prompt=True,
                tokenize=False,
                **cfg["target"]["chat_template_kwargs"],
            )
            prompt_ids = tok.encode(prompt, add_special_tokens=False)
            p = r["num_prompt_tokens"]
            assert r["input_ids"][:p] == prompt_ids
            assert r["loss_mask"] == [0] * p + [1] * (r["num_tokens"] - p)
            # the demo target thinks (Kimi K2.5 format): the prompt ends in <think>, the completion holds the
            # reasoning, the end-of-reasoning marker, the answer and the end-of-turn token
            assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
            assert resp["reasoning"] and resp["content"]
            completion = tok.decode(r["input_ids"][p:], skip_special_tokens=False)
            assert completion == resp["reasoning"] + "</think>" + resp["content"] + "<|im_end|>"
            assert r["num_completion_tokens"] == resp["completion_tokens"]
            checked += 1
    assert checked >= 50


def test_merged_shards_and_hidden_states_match_the_tiny_target(built):
    """Each selection's hidden states hold exactly its rows (ids, mask, sample order); every merged row names a
    selection whose file holds it; the states equal a one-by-one forward of the tiny target."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config(built)
    tcfg = cfg["target"]["tiny"]
    H, L = tcfg["hidden_size"], tcfg["num_layers"]
    manifest = json.loads((built / "results/merged/manifest.json").read_text())
    merged = rows([built / f"results/merged/{k:03d}.parquet" for k in range(cfg["merge"]["shards"])])
    assert manifest["totals"]["samples"] == len(merged)
    held = {}
    for key, sel in manifest["selections"].items():
        sel_rows = rows([built / sel["path"]])
        assert sel["samples"] == len(sel_rows) and sel["tokens"] == sum(r["num_tokens"] for r in sel_rows)
        T = sel["tokens"]
        with safe_open(str(built / f"results/hidden_states/{key}.safetensors"), "pt") as f:
            aux, final = f.get_tensor("aux_hidden_states"), f.get_tensor("hidden_states")
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            offsets = f.get_tensor("sample_offsets")
            meta = f.metadata()
        assert tuple(aux.shape) == (T, 3 * H), "auxiliary states: tokens x 3H, no padding rows"
        assert tuple(final.shape) == (T, H), "final states: tokens x H, no padding rows"
        assert ids.tolist() == [i for r in sel_rows for i in r["input_ids"]]
        assert mask.tolist() == [m for r in sel_rows for m in r["loss_mask"]]
        assert offsets.tolist()[-1] == T and len(offsets) == len(sel_rows) + 1
        assert json.loads(meta["layers"]) == [1, L // 2 - 1, L - 4]
        assert json.loads(meta["sample_ids"]) == [r["sample_id"] for r in sel_rows]
        assert meta["selection_digest"] == sel["digest"]
        # the demo's final_norm both: the final norm's input, with the formula its first batch showed
        assert meta["final_norm"] == "both" and meta["norm_formula"] in ("llama", "weight_in_fp32", "gemma")
        for j, r in enumerate(sel_rows):
            held[(key, r["sample_id"])] = (aux[offsets[j] : offsets[j + 1]], final[offsets[j] : offsets[j + 1]])
    # the merged set is an index over the selections' states: every row found, none left over
    assert {(r["source"], r["sample_id"]) for r in merged} == set(held)
    model = AutoModelForCausalLM.from_pretrained(built / cfg["target"]["path"], dtype=torch.float32)
    layers = [1, L // 2 - 1, L - 4]
    for r in merged[:: max(1, len(merged) // 6)]:
        with torch.inference_mode():
            hs = model(input_ids=torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states
        a, fin = held[(r["source"], r["sample_id"])]
        torch.testing.assert_close(a, torch.cat([hs[i + 1][0] for i in layers], -1), atol=1e-4, rtol=1e-4)
        with torch.inference_mode():  # pre-norm: the target's own final norm of it is HF's last hidden state
            torch.testing.assert_close(model.get_decoder().norm(fin), hs[-1][0], atol=1e-4, rtol=1e-4)
    validated = sum(
        len(rows([built / f"results/{ds}/validated/{s:03d}.parquet" for s in range(d.get("shards", 1))]))
        for ds, d in cfg["datasets"].items()
    )
    assert len(merged) <= validated and len(merged) >= 0.9 * validated  # dedup/cap may drop a few


def _dry_run_jobs(wd: Path, *args: str) -> dict[str, int]:
    proc = run_snakemake(wd, "-n", "--quiet", "rules", *args)
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:")[1].split("Reasons:")[0]
    jobs = {}
    for line in table.splitlines():
        m = re.match(r"^(\S+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) not in ("total", "job"):
            jobs[m.group(1)] = int(m.group(2))
    return jobs


@pytest.fixture
def scratch(built, tmp_path) -> Path:
    wd = tmp_path / "copy"
    shutil.copytree(built, wd, symlinks=True)
    return wd


def test_second_run_does_nothing(scratch):
    proc = run_snakemake(scratch, "--cores", "2")
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_changed_sample_file_reruns_only_that_dataset(scratch):
    src = scratch / "resources/samples/ultrachat.jsonl"
    lines = src.read_text().splitlines()
    src.write_text("\n".join(lines[:-1]) + "\n")  # drop one record
    jobs = _dry_run_jobs(scratch)
    assert jobs.get("normalize_ultrachat_demo") == 1
    assert not any(j.startswith("normalize_") and j != "normalize_ultrachat_demo" for j in jobs)
    shards = config(scratch)["datasets"]["ultrachat_demo"].get("shards", 1)
    assert jobs.get("generate") == shards and jobs.get("tokenize") == shards and jobs.get("validate") == shards
    assert jobs.get("merge") == 1 and jobs.get("report") == 1
    # a dry run lists every extract job as waiting on the merge checkpoint; which of them really run (only the
    # selections whose digest changed) is decided after it: tests/workflow/test_incremental.py runs it for real
    assert jobs.get("extract") == sum(d.get("shards", 1) for d in config(scratch)["datasets"].values())


def test_changed_generation_params_rerun_only_that_dataset(scratch):
    cfg = config(scratch)
    cfg["datasets"]["sweagent_demo"].setdefault("generation", {})["temperature"] = 0.5
    (scratch / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    jobs = _dry_run_jobs(scratch)
    assert not any(j.startswith("normalize_") for j in jobs)
    assert jobs.get("generate") == cfg["datasets"]["sweagent_demo"].get("shards", 1)
    assert jobs.get("merge") == 1


def _outputs(wd: Path, pattern: str) -> dict[str, bytes]:
    return {str(p.relative_to(wd)): p.read_bytes() for p in sorted(wd.glob(pattern))}


def test_journal_survives_deleting_results_and_rebuilds_are_deterministic(built, scratch):
    """A rerun after deleting results/ sends no request again: every response comes from the journal. With the
    extraction links deleted too it is a from-scratch extraction, and it gives byte-identical hidden states and
    exports (same target, same config)."""
    shutil.rmtree(scratch / "results")
    shutil.rmtree(scratch / "logs")
    shutil.rmtree(scratch / ".snakemake", ignore_errors=True)
    shutil.rmtree(scratch / "cache/hidden_states")
    run_snakemake(scratch, "--cores", "2")
    for pattern in (
        "results/hidden_states/*/*.safetensors",
        "results/export/specforge/rows_*/*.ckpt",
        "results/merged/*.parquet",
    ):
        old, new = _outputs(built, pattern), _outputs(scratch, pattern)
        assert old.keys() == new.keys() and old, pattern
        assert [k for k in old if old[k] != new[k]] == [], pattern
    sums = [json.loads(p.read_text()) for p in (scratch / "results/hidden_states").glob("*/*.json")]
    assert all(s["reused_tokens"] == 0 and s["forwarded_tokens"] == s["num_tokens"] for s in sums)
    logs = [p for p in (scratch / "logs/generate").rglob("*.log") if ".server-" not in p.name]
    assert len(logs) == sum(
        d.get("shards", 1) for d in config(scratch)["datasets"].values() if d["source"]["format"] != "pretokenized"
    )
    assert not [p for p in (scratch / "logs/generate").rglob("*.log") if ".server-" in p.name], "no server started"
    for log in logs:
        text = log.read_text()
        assert re.search(r"\"sent\": 0\b", text), f"{log}: expected no request sent\n{text[-2000:]}"


def test_transport_and_run_settings_rerun_nothing(scratch, monkeypatch):
    """Every key config.RERUNS says reruns nothing, changed at once: still "Nothing to be done"."""
    monkeypatch.setenv("EAGLE3_TEST_KEY", "not-a-real-key")

    def change(c):
        b = c["backends"]["tiny_local"]
        b.update(
            max_concurrency=3,
            timeout_s=77,
            requests_per_minute=600,
            tokens_per_minute=10**6,
            headers={"X-Title": "eagle3"},
            cost_lookup_delay_s=2,
            api_key_env="EAGLE3_TEST_KEY",
        )
        b["launch"].update(
            command=b["launch"]["command"] + " --log-level warning",
            ready_timeout_s=99,
            stop_grace_s=3,
            env=dict(b["launch"].get("env") or {}, EXTRA="1"),
        )
        c["generation"].update(max_retries=2, retry_initial_s=0.5, retry_max_s=9, stop_grace_s=3)
        c["datasets"]["sweagent_demo"]["generation"].update(max_retries=1)
        c["datasets"]["ultrachat_demo"]["source"]["max_reject_rate"] = 0.9
        c["normalize"] = {"max_reject_rate": 0.8}
        c["validate"].update(max_reject_rate=0.5)
        c["validate"]["count_tolerance"]["aggregate_rel"] = 0.5
        c["merge"].update(memory_mb=2000, threads=1)
        c["extract"].update(gpu_lock_dir="/tmp/other-locks")  # device, batch_tokens: the demo's plan measures

    _set(scratch, change)
    assert _dry_run_jobs(scratch) == {}


def _set(wd: Path, mutate) -> dict:
    cfg = config(wd)
    mutate(cfg)
    (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def test_changed_merge_max_len_reruns_merge_and_below_only(scratch):
    # as a user would override one nested key: a second config file merged over the default
    (scratch / "overrides.yaml").write_text("merge:\n  max_len: 512\n")
    cfg = config(scratch)
    jobs = _dry_run_jobs(scratch, "--configfile", "config.yaml", "overrides.yaml")
    assert set(jobs) == {"merge", "provenance", "extract", "export", "plan", "vocab", "all"}, jobs  # extract: see above
    assert jobs["export"] == cfg["merge"]["shards"]


def test_changed_extraction_layers_rerun_extraction_only(scratch):
    cfg = _set(scratch, lambda c: c["extract"].__setitem__("layers", [0, 2, 5]))
    jobs = _dry_run_jobs(scratch)
    # the plan restates the layers and the exports are copies of the extracted states: nothing upstream reruns
    assert set(jobs) == {"extract", "export", "plan", "all"}, jobs
    assert jobs["extract"] == sum(d.get("shards", 1) for d in cfg["datasets"].values())  # one per selection


def test_new_dataset_runs_its_chain_plus_merge_and_below(scratch):
    def add(c):
        c["datasets"]["ultrachat_copy"] = {
            "source": {"format": "ultrachat", "path": "resources/samples/ultrachat.jsonl"},
            "shards": 1,
        }

    _set(scratch, add)
    jobs = _dry_run_jobs(scratch)
    assert jobs.get("normalize_ultrachat_copy") == 1
    assert not any(j.startswith("normalize_") and j != "normalize_ultrachat_copy" for j in jobs)
    assert jobs.get("generate") == 1 and jobs.get("tokenize") == 1 and jobs.get("validate") == 1
    assert jobs.get("merge") == 1 and jobs.get("report") == 1
