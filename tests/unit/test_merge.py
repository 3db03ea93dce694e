"""Merge: dedup, caps, max_len, seeded shuffle independent of input sharding, token-balanced shards."""

from __future__ import annotations

import hashlib
import json
import random
import re

import pyarrow.parquet as pq
import pytest

from eagle3_data import schemas
from eagle3_data.merge import merge
from eagle3_data.settings import MergeSettings


def make_rows(n: int, datasets: list[str], seed: int = 1, min_len: int = 4, max_len: int = 60) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ds = datasets[i % len(datasets)]
        length = rng.randint(min_len, max_len)
        prompt = rng.randint(1, length - 1)
        ids = [rng.randrange(0, 1000) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        rows.append(row(ds, f"{ds}-{i:05d}", ids, mask))
    return rows


def row(ds: str, sid: str, ids: list[int], mask: list[int]) -> dict:
    return {
        "sample_id": sid,
        "dataset": ds,
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_prompt_tokens": mask.index(1) if 1 in mask else len(mask),
        "num_completion_tokens": sum(mask),
        "ids_source": "reconstructed",
        "billed_completion_tokens": sum(mask),
        "finish_reason": "stop",
        "backend": "b",
        "provider": "p",
        "cost_usd": 0.0,
    }


def write_inputs(tmp_path, rows: list[dict], n_files: int, shuffle_seed: int | None = None, tag: str = "in"):
    rows = list(rows)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(rows)
    paths = []
    for f in range(n_files):
        part = rows[f::n_files]
        p = tmp_path / tag / f"{f:03d}.parquet"
        schemas.write_checked(schemas.from_rows(part, schemas.VALIDATED), "validated", p)
        paths.append(p)
    if shuffle_seed is not None:
        random.Random(shuffle_seed + 1).shuffle(paths)
    return paths


def shuffle_key(seed, ds, sid) -> str:
    return hashlib.md5(f"{seed}\x1f{ds}\x1f{sid}".encode()).hexdigest()


def heldout_draw(seed, sid) -> float:
    """The documented held-out rule, restated: md5 of (seed, 'heldout', sample_id less a trailing @<turn>), its
    first 8 hex digits over 2^32."""
    base = re.sub(r"@[0-9]+$", "", sid)
    return int(hashlib.md5(f"{seed}\x1fheldout\x1f{base}".encode()).hexdigest()[:8], 16) / 2**32


def reference_merge(rows, *, k, datasets=None, max_samples=None, max_len, overflow, seed):
    """Plain-Python statement of the merge rules, to compare against the DuckDB implementation."""
    return reference_split(
        rows,
        k=k,
        datasets=datasets,
        max_samples=max_samples,
        max_len=max_len,
        overflow=overflow,
        seed=seed,
        heldout=0.0,
    )[0]


def reference_split(rows, *, k, datasets=None, max_samples=None, max_len, overflow, seed, heldout):
    """:func:`reference_merge` with a held-out share: ``(training shards, held-out rows)``."""
    rows = [r for r in rows if datasets is None or r["dataset"] in datasets]
    seen, kept = set(), []
    for r in sorted(rows, key=lambda r: (r["dataset"], r["sample_id"])):
        key = tuple(r["input_ids"])
        if key in seen:
            continue
        seen.add(key)
        ids, mask, trunc = r["input_ids"], r["loss_mask"], False
        if len(ids) > max_len:
            if overflow == "drop":
                continue
            ids, mask, trunc = ids[:max_len], mask[:max_len], True
        if sum(mask) == 0:
            continue
        kept.append(
            {
                "sample_id": r["sample_id"],
                "dataset": r["dataset"],
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_supervised": sum(mask),
                "truncated": trunc,
            }
        )
    kept.sort(key=lambda r: shuffle_key(seed, r["dataset"], r["sample_id"]))
    held = [r for r in kept if heldout_draw(seed, r["sample_id"]) < heldout]
    kept = [r for r in kept if heldout_draw(seed, r["sample_id"]) >= heldout]
    caps = max_samples or {}
    count: dict = {}
    final = []
    for r in kept:
        count[r["dataset"]] = count.get(r["dataset"], 0) + 1
        if count[r["dataset"]] <= caps.get(r["dataset"], 1 << 62):
            final.append(r)
    total = sum(r["num_tokens"] for r in final)
    shards = [[] for _ in range(k)]
    before = 0
    for r in final:
        shards[min(k - 1, before * k // total)].append(r)
        before += r["num_tokens"]
    return shards, held


def read_shards(paths, keep_source=False):
    """Rows of each merged shard; ``source`` (the key of the validated file a row came from, which names the
    input files) dropped unless asked for."""
    shards = [pq.read_table(p).to_pylist() for p in paths]
    if not keep_source:
        shards = [[{k: v for k, v in r.items() if k != "source"} for r in s] for s in shards]
    return shards


def test_matches_reference_and_is_independent_of_input_sharding(tmp_path):
    rows = make_rows(400, ["a", "b", "c"], seed=3)
    # duplicates by content: same ids under another id and another dataset
    rows.append(row("a", "a-dup", rows[5]["input_ids"], rows[5]["loss_mask"]))
    rows.append(row("c", "c-dup", rows[7]["input_ids"], rows[7]["loss_mask"]))
    settings = dict(max_samples={"b": 50}, max_len=40, overflow="truncate", seed=7)
    outs1 = [tmp_path / "m1" / f"{i:03d}.parquet" for i in range(3)]
    outs7 = [tmp_path / "m7" / f"{i:03d}.parquet" for i in range(3)]
    man1 = merge(
        write_inputs(tmp_path, rows, 1, tag="one"),
        outs1,
        tmp_path / "m1.json",
        settings=MergeSettings.defaults(**settings),
    )
    man7 = merge(
        write_inputs(tmp_path, rows, 7, shuffle_seed=11, tag="seven"),
        outs7,
        tmp_path / "m7.json",
        settings=MergeSettings.defaults(**settings),
    )

    got1, got7 = read_shards(outs1), read_shards(outs7)
    assert got1 == got7
    # each row names the validated file it came from (its selection key: the path without .parquet)
    where = {}
    for p in sorted((tmp_path / "seven").glob("*.parquet")):
        for r in pq.read_table(p, columns=["sample_id"]).to_pylist():
            where[r["sample_id"]] = str(p.with_suffix(""))
    assert all(r["source"] == where[r["sample_id"]] for s in read_shards(outs7, keep_source=True) for r in s)
    expected = reference_merge(rows, k=3, **settings)
    assert got1 == expected
    assert man1["shards"] == [dict(s, path=str(o)) for s, o in zip(man7["shards"], outs1)]
    assert man1["totals"] == man7["totals"]
    # the cap kept exactly 50 of b; duplicates counted
    assert sum(r["dataset"] == "b" for s in got1 for r in s) == 50
    assert man1["totals"]["dropped"]["duplicate"] == 2
    assert man1["datasets"]["b"]["dropped"]["over_max_samples"] == man1["datasets"]["b"]["input_samples"] - 50 - man1[
        "datasets"
    ]["b"]["dropped"].get("no_supervised_after_truncation", 0)


def test_truncate_cuts_ids_and_mask_and_drops_unsupervised(tmp_path):
    rows = [
        row("a", "long", list(range(100, 120)), [0] * 5 + [1] * 15),  # truncated to 10, 5 supervised
        row("a", "late", list(range(200, 220)), [0] * 15 + [1] * 5),  # no supervision in first 10: dropped
        row("a", "short", [1, 2, 3], [0, 1, 1]),
    ]
    outs = [tmp_path / "m" / "000.parquet"]
    man = merge(
        write_inputs(tmp_path, rows, 1),
        outs,
        tmp_path / "m.json",
        settings=MergeSettings.defaults(max_len=10, overflow="truncate", seed=0),
    )
    got = {r["sample_id"]: r for r in pq.read_table(outs[0]).to_pylist()}
    assert set(got) == {"long", "short"}
    assert got["long"]["input_ids"] == list(range(100, 110))
    assert got["long"]["loss_mask"] == [0] * 5 + [1] * 5
    assert (got["long"]["num_tokens"], got["long"]["num_supervised"], got["long"]["truncated"]) == (10, 5, True)
    assert (got["short"]["num_tokens"], got["short"]["truncated"]) == (3, False)
    assert man["datasets"]["a"]["dropped"] == {"no_supervised_after_truncation": 1}
    assert man["totals"]["truncated"] == 1

    man = merge(
        write_inputs(tmp_path, rows, 1, tag="d"),
        outs,
        tmp_path / "m.json",
        settings=MergeSettings.defaults(max_len=10, overflow="drop", seed=0),
    )
    assert [r["sample_id"] for r in pq.read_table(outs[0]).to_pylist()] == ["short"]
    assert man["datasets"]["a"]["dropped"] == {"over_max_len": 2}


def test_nothing_left_after_max_len_is_an_error_naming_the_setting(tmp_path):
    rows = [row("a", "late", list(range(200, 220)), [0] * 15 + [1] * 5), row("a", "late2", [5] * 30, [0] * 29 + [1])]
    outs = [tmp_path / "m" / "000.parquet", tmp_path / "m" / "001.parquet"]
    with pytest.raises(ValueError, match=r"no sample left of 2 .*no_supervised_after_truncation.*merge.max_len=10"):
        merge(
            write_inputs(tmp_path, rows, 1),
            outs,
            tmp_path / "m.json",
            settings=MergeSettings.defaults(max_len=10, overflow="truncate", seed=0),
        )
    assert not any(p.exists() for p in outs) and not (tmp_path / "m.json").exists()


def test_dataset_filter_seed_and_balance(tmp_path):
    rows = make_rows(600, ["a", "b", "c"], seed=5, max_len=80)
    inputs = write_inputs(tmp_path, rows, 4)
    outs = [tmp_path / "m" / f"{i:03d}.parquet" for i in range(4)]
    man = merge(
        inputs, outs, tmp_path / "m.json", settings=MergeSettings.defaults(datasets=["a", "c"], max_len=1000, seed=1)
    )
    got = read_shards(outs)
    assert {r["dataset"] for s in got for r in s} == {"a", "c"}
    assert sum(len(s) for s in got) == 400
    tokens = [sum(r["num_tokens"] for r in s) for s in got]
    total = sum(tokens)
    assert tokens == [s["tokens"] for s in man["shards"]]
    assert total == sum(len(r["input_ids"]) for r in rows if r["dataset"] != "b")
    assert max(abs(t - total / 4) for t in tokens) <= 80  # within one sample of perfect balance
    # supervised and per-dataset counts in the manifest equal what the files hold
    for s, m in zip(got, man["shards"]):
        assert m["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in s)
        assert m["datasets"] == {d: sum(r["dataset"] == d for r in s) for d in {r["dataset"] for r in s}}
    on_disk = json.loads((tmp_path / "m.json").read_text())
    assert on_disk["totals"] == man["totals"]
    # another seed: same set, different order
    man2 = merge(
        inputs, outs, tmp_path / "m2.json", settings=MergeSettings.defaults(datasets=["a", "c"], max_len=1000, seed=2)
    )
    got2 = read_shards(outs)
    ids1 = [r["sample_id"] for s in got for r in s]
    ids2 = [r["sample_id"] for s in got2 for r in s]
    assert sorted(ids1) == sorted(ids2) and ids1 != ids2
    assert man2["totals"]["samples"] == 400


def test_more_shards_than_samples_and_conflicting_ids(tmp_path):
    rows = make_rows(2, ["a"], seed=2)
    outs = [tmp_path / "m" / f"{i:03d}.parquet" for i in range(4)]
    man = merge(
        write_inputs(tmp_path, rows, 1), outs, tmp_path / "m.json", settings=MergeSettings.defaults(max_len=100, seed=0)
    )
    assert [pq.read_table(p).num_rows for p in outs] == [s["samples"] for s in man["shards"]]
    assert sum(s["samples"] for s in man["shards"]) == 2
    assert all(p.exists() for p in outs)

    bad = [row("a", "x", [1, 2, 3], [0, 1, 1])]
    bad2 = [row("a", "x", [1, 2, 4], [0, 1, 1])]
    p1 = write_inputs(tmp_path, bad, 1, tag="c1")
    p2 = write_inputs(tmp_path, bad2, 1, tag="c2")
    out = tmp_path / "c" / "000.parquet"
    with pytest.raises(ValueError, match=r"a/x: 2 versions"):
        merge(p1 + p2, [out], tmp_path / "c.json", settings=MergeSettings.defaults(max_len=10, seed=0))
    assert not out.exists()
    assert not list((tmp_path / "c").glob(".*tmp"))


def test_bad_arguments(tmp_path):
    p = write_inputs(tmp_path, make_rows(3, ["a"]), 1)
    with pytest.raises(ValueError, match="overflow"):
        merge(
            p,
            [tmp_path / "o.parquet"],
            tmp_path / "m.json",
            settings=MergeSettings.defaults(max_len=10, overflow="cut"),
        )
    with pytest.raises(ValueError, match="max_len"):
        merge(p, [tmp_path / "o.parquet"], tmp_path / "m.json", settings=MergeSettings.defaults(max_len=0))
    with pytest.raises(FileNotFoundError, match="nope"):
        merge(
            [tmp_path / "nope.parquet"],
            [tmp_path / "o.parquet"],
            tmp_path / "m.json",
            settings=MergeSettings.defaults(max_len=10),
        )


def test_crash_mid_write_leaves_no_partial_shard(tmp_path, monkeypatch):
    from eagle3_data.merge import stage as merge_mod
    from eagle3_data.merge import write as merge_write

    inputs = write_inputs(tmp_path, make_rows(300, ["a"], seed=9), 2)
    outs = [tmp_path / "m" / f"{i:03d}.parquet" for i in range(2)]
    calls = {"n": 0}
    real = merge_write.check_merged_batch

    def flaky(table, path="<memory>", first_row=0):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash")
        return real(table, path, first_row)

    monkeypatch.setattr(merge_write, "check_merged_batch", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        merge(
            inputs,
            outs,
            tmp_path / "m.json",
            settings=MergeSettings.defaults(max_len=100, seed=0),
            resources=merge_mod.MergeResources(batch_rows=64),
        )
    assert not outs[1].exists() and not (tmp_path / "m.json").exists()
    assert not [p for p in (tmp_path / "m").iterdir() if p.name.startswith(".")]


def merged_table(rows):
    return schemas.from_rows(rows, schemas.MERGED)


def good_rows(n=6):
    return [
        {
            "sample_id": f"s{i}",
            "dataset": "d",
            "input_ids": [i + 1, 2, 3],
            "loss_mask": [0, 1, 1],
            "num_tokens": 3,
            "num_supervised": 2,
            "truncated": False,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "change,rule",
    [
        (dict(input_ids=[1, -2, 3]), "input_ids has values outside"),
        (dict(loss_mask=[0, 2, 1]), "loss_mask has values outside"),
        (dict(input_ids=[1, 2]), "input_ids length differs from num_tokens"),
        (dict(loss_mask=[0, 1]), "loss_mask length differs"),
        (dict(num_supervised=0), "num_supervised must be > 0"),
        (dict(num_supervised=1), "num_supervised differs from sum"),
        (dict(num_tokens=0, input_ids=[], loss_mask=[]), "num_tokens must be > 0"),
        (dict(sample_id=None), "sample_id is null"),
        (dict(sample_id="s1"), "sample_id repeated"),
        (dict(input_ids=None), "input_ids is null"),
    ],
)
def test_fast_batch_check_fails_on_each_bad_row(change, rule):
    from eagle3_data.merge import check_merged_batch

    rows = good_rows()
    check_merged_batch(merged_table(rows), "x.parquet")  # good rows pass
    rows[4] = dict(rows[4], **change)
    table = merged_table(rows)
    with pytest.raises(schemas.SchemaError, match=rule) as err:
        check_merged_batch(table.slice(1), "x.parquet", first_row=100)  # a sliced batch: offsets not at 0
    assert "x.parquet" in str(err.value) and "row 103" in str(err.value)
    # the pandera contract agrees that the row is bad (except the extra sum rule, which pandera lacks)
    if "sum" not in rule:
        with pytest.raises(schemas.SchemaError):
            schemas.check(table, "merged", "x.parquet")


def test_datasets_built_from_one_source_may_share_sample_ids():
    """A merged row is (dataset, sample_id): two datasets regenerated from the same prompts (other settings) keep
    their rows; the same id twice in one dataset is still refused, by both checks."""
    from eagle3_data.merge import check_merged_batch

    rows = good_rows(3) + [dict(r, dataset="other", input_ids=[9, 9, r["input_ids"][0]]) for r in good_rows(3)]
    check_merged_batch(merged_table(rows), "x.parquet")
    schemas.check(merged_table(rows), "merged", "x.parquet")
    rows[5] = dict(rows[5], sample_id="s1")
    with pytest.raises(schemas.SchemaError, match="repeated within its dataset"):
        check_merged_batch(merged_table(rows), "x.parquet")
    with pytest.raises(schemas.SchemaError):
        schemas.check(merged_table(rows), "merged", "x.parquet")


def test_fast_batch_check_names_wrong_schema():
    from eagle3_data.merge import check_merged_batch

    table = merged_table(good_rows()).drop_columns(["truncated"])
    with pytest.raises(schemas.SchemaError, match="truncated"):
        check_merged_batch(table, "x.parquet")


# --- the held-out split (merge.heldout) ----------------------------------------------------------------------


def turn_rows(n: int, datasets: list[str], seed: int = 1) -> list[dict]:
    """``make_rows`` plus multi-turn conversations (generation mode ``all``: ``<id>@<turn>`` rows)."""
    rows = make_rows(n, datasets, seed=seed)
    rng = random.Random(seed + 100)
    for c in range(40):
        for turn in (1, 3, 5)[: rng.randint(2, 3)]:
            ids = [rng.randrange(0, 1000) for _ in range(rng.randint(6, 40))]
            rows.append(row(datasets[c % len(datasets)], f"conv-{c:03d}@{turn}", ids, [0] * 3 + [1] * (len(ids) - 3)))
    return rows


def key(r) -> tuple:
    return r["dataset"], r["sample_id"]


def test_heldout_rows_follow_the_documented_rule_and_never_reach_the_training_shards(tmp_path):
    rows = turn_rows(400, ["a", "b"], seed=12)
    settings = dict(max_len=50, overflow="truncate", seed=5)
    outs = [tmp_path / "m" / f"{i:03d}.parquet" for i in range(3)]
    held_path = tmp_path / "m" / "heldout.parquet"
    inputs = write_inputs(tmp_path, rows, 3)
    sels = [tmp_path / "sel" / f"{i:03d}.parquet" for i in range(3)]
    man = merge(
        inputs,
        outs,
        tmp_path / "m.json",
        heldout_path=held_path,
        selections=sels,
        settings=MergeSettings.defaults(heldout=0.2, **settings),
    )
    train = [r for s in read_shards(outs) for r in s]
    held = pq.read_table(held_path).drop_columns(["source"]).to_pylist()
    want_train, want_held = reference_split(rows, k=3, heldout=0.2, **settings)
    assert read_shards(outs) == want_train  # the training shards: the rules above, over the training rows
    assert held == want_held  # every survivor whose draw is below 0.2, in shuffle-key order
    assert [shuffle_key(5, *key(r)) for r in held] == sorted(shuffle_key(5, *key(r)) for r in held)
    assert not {key(r) for r in train} & {key(r) for r in held}
    # the share is roughly the fraction (binomial: 0.2 +- 0.03 for ~500 rows), and held-out rows are real rows
    kept = len(train) + len(held)
    assert kept > 450 and 0.15 < len(held) / kept < 0.25, (len(held), kept)
    assert all(heldout_draw(5, r["sample_id"]) < 0.2 for r in held)
    assert all(heldout_draw(5, r["sample_id"]) >= 0.2 for r in train)
    # a conversation's turns go the same way, and some multi-turn ones are held out
    side: dict = {}
    for r in train + held:
        if "@" in r["sample_id"]:
            side.setdefault(r["sample_id"].split("@")[0], set()).add(r in held)
    assert all(len(v) == 1 for v in side.values()) and {True} in side.values() and {False} in side.values()
    # the manifest: the training totals, the held-out set apart, per dataset held-out counts and tokens
    h = man["heldout"]
    assert (h["path"], h["fraction"], h["samples"], h["tokens"]) == (
        str(held_path),
        0.2,
        len(held),
        sum(r["num_tokens"] for r in held),
    )
    assert h["supervised_tokens"] == sum(r["num_supervised"] for r in held)
    assert man["totals"]["samples"] == len(train) == sum(s["samples"] for s in man["shards"])
    for ds in ("a", "b"):
        d = man["datasets"][ds]
        assert d["heldout"] == sum(r["dataset"] == ds for r in held) > 0
        assert d["heldout_tokens"] == sum(r["num_tokens"] for r in held if r["dataset"] == ds)
        assert d["kept"] == sum(r["dataset"] == ds for r in train)
        assert d["input_samples"] == d["kept"] + d["heldout"] + sum(d["dropped"].values())
    # the selections hold both sets (extraction covers the held-out rows), as without the split
    sel_rows = {key(r) for p in sels for r in pq.read_table(p).to_pylist()}
    assert sel_rows == {key(r) for r in train + held}
    man0 = merge(
        inputs,
        [tmp_path / "z" / "000.parquet"],
        tmp_path / "z.json",
        selections=[tmp_path / "z" / "sel" / f"{i:03d}.parquet" for i in range(3)],
        settings=MergeSettings.defaults(**settings),
    )
    assert {k_: v["digest"] for k_, v in man0["selections"].items()} == {
        k_: v["digest"] for k_, v in man["selections"].items()
    }
    assert [pq.read_table(p).to_pylist() for p in sels] == [
        pq.read_table(tmp_path / "z" / "sel" / f"{i:03d}.parquet").to_pylist() for i in range(3)
    ]


def test_heldout_membership_depends_only_on_seed_and_base_id(tmp_path):
    """Not on the dataset's name (two datasets of one source hold out the same prompts), the number of input
    files or merged shards, nor on the other rows (adding data moves no sample in or out)."""
    rows = turn_rows(300, ["regen"], seed=3)
    # the same prompts with the dataset's original answers: same ids, other token ids
    orig = [dict(r, dataset="orig", input_ids=[(t + 7) % 1000 for t in r["input_ids"]]) for r in rows]

    def run(tag, rws, n_files, k, seed=9, **kw):
        outs = [tmp_path / tag / f"{i:03d}.parquet" for i in range(k)]
        held = tmp_path / tag / "heldout.parquet"
        inputs = []  # one dataset per validated file (a file's sample ids are unique)
        for ds in sorted({r["dataset"] for r in rws}):
            inputs += write_inputs(
                tmp_path, [r for r in rws if r["dataset"] == ds], n_files, shuffle_seed=n_files, tag=f"in-{tag}-{ds}"
            )
        merge(
            inputs,
            outs,
            tmp_path / f"{tag}.json",
            heldout_path=held,
            settings=MergeSettings.defaults(max_len=100, seed=seed, heldout=0.25, **kw),
        )
        train = [r for s in read_shards(outs) for r in s]
        return train, pq.read_table(held).drop_columns(["source"]).to_pylist()

    train1, held1 = run("one", rows + orig, 1, 1)
    ids = {ds: {r["sample_id"] for r in held1 if r["dataset"] == ds} for ds in ("regen", "orig")}
    assert ids["regen"] == ids["orig"] and len(ids["regen"]) > 40
    train4, held4 = run("four", rows + orig, 4, 3)
    assert held4 == held1 and sorted(map(key, train4)) == sorted(map(key, train1))
    alone = run("alone", rows, 2, 2)[1]  # without the other dataset
    assert [r for r in held1 if r["dataset"] == "regen"] == alone
    # more data: every earlier held-out sample stays held out, no earlier training sample becomes one
    more = make_rows(200, ["regen"], seed=44)
    more = [dict(r, sample_id=f"new-{i}") for i, r in enumerate(more)]
    train_m, held_m = run("more", rows + orig + more, 3, 2)
    assert {key(r) for r in held1} <= {key(r) for r in held_m}
    assert not {key(r) for r in train1} & {key(r) for r in held_m}
    assert any(r["sample_id"].startswith("new-") for r in held_m)
    # another seed: another held-out set
    assert {key(r) for r in run("seed", rows + orig, 1, 1, seed=10)[1]} != {key(r) for r in held1}


def test_max_samples_caps_count_training_rows_only(tmp_path):
    rows = make_rows(300, ["a", "b"], seed=8)
    outs = [tmp_path / "m" / "000.parquet"]
    held_path = tmp_path / "m" / "heldout.parquet"
    settings = dict(max_samples={"b": 40}, max_len=100, overflow="truncate", seed=2, heldout=0.3)
    man = merge(
        write_inputs(tmp_path, rows, 2),
        outs,
        tmp_path / "m.json",
        heldout_path=held_path,
        settings=MergeSettings.defaults(**settings),
    )
    train = read_shards(outs)[0]
    held = pq.read_table(held_path).drop_columns(["source"]).to_pylist()
    assert sum(r["dataset"] == "b" for r in train) == 40  # the cap: 40 training rows of b
    held_b = [r for r in held if r["dataset"] == "b"]
    assert len(held_b) == sum(r["dataset"] == "b" and heldout_draw(2, r["sample_id"]) < 0.3 for r in rows) > 40 * 0.3
    assert ([train], held) == reference_split(rows, k=1, **settings)
    assert man["datasets"]["b"]["dropped"] == {"over_max_samples": 150 - 40 - len(held_b)}


def test_heldout_off_changes_nothing(tmp_path):
    """merge.heldout = 0 (the default): the same files as without the split, byte for byte, whether a held-out
    path is given (then written empty, with the MERGED schema) or not."""
    rows = turn_rows(200, ["a", "b"], seed=6)
    inputs = write_inputs(tmp_path, rows, 2)
    settings = dict(max_samples={"a": 80}, max_len=40, seed=1)

    def run(tag, **kw):
        outs = [tmp_path / tag / f"{i:03d}.parquet" for i in range(2)]
        sels = [tmp_path / tag / "sel" / f"{i:03d}.parquet" for i in range(2)]
        man = merge(
            inputs, outs, tmp_path / f"{tag}.json", selections=sels, settings=MergeSettings.defaults(**settings), **kw
        )
        return man, [p.read_bytes() for p in outs + sels]

    man_a, files_a = run("plain")
    man_b, files_b = run("with", heldout_path=tmp_path / "with" / "heldout.parquet")
    assert files_a == files_b
    assert read_shards([tmp_path / "plain" / f"{i:03d}.parquet" for i in range(2)]) == reference_merge(
        rows, k=2, overflow="truncate", **settings
    )
    empty = pq.read_table(tmp_path / "with" / "heldout.parquet")
    assert empty.num_rows == 0 and empty.schema.equals(schemas.MERGED, check_metadata=False)
    for m in (man_a, man_b):
        assert (m["heldout"]["samples"], m["heldout"]["fraction"]) == (0, 0.0)
        assert all(d["heldout"] == 0 for d in m["datasets"].values())
    assert man_a["totals"] == man_b["totals"] and man_a["selections"].keys() == man_b["selections"].keys()


def test_heldout_bad_settings(tmp_path):
    p = write_inputs(tmp_path, make_rows(20, ["a"]), 1)
    out = tmp_path / "o" / "000.parquet"
    with pytest.raises(ValueError, match=r"merge.heldout=0.1 needs a held-out output file"):
        merge(p, [out], tmp_path / "m.json", settings=MergeSettings.defaults(max_len=100, heldout=0.1))
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match=r"merge.heldout must be a number in \[0, 1\)"):
            merge(
                p,
                [out],
                tmp_path / "m.json",
                heldout_path=tmp_path / "h.parquet",
                settings=MergeSettings.defaults(max_len=100, heldout=bad),
            )
    with pytest.raises(ValueError, match="also a merged shard path"):
        merge(
            p, [out], tmp_path / "m.json", heldout_path=out, settings=MergeSettings.defaults(max_len=100, heldout=0.1)
        )
    # everything held out: no training sample is an error naming the share
    with pytest.raises(ValueError, match=r"no sample left of 20 .*held out 20.*merge.heldout=0.9999"):
        merge(
            p,
            [out],
            tmp_path / "m.json",
            heldout_path=tmp_path / "h.parquet",
            settings=MergeSettings.defaults(max_len=100, heldout=0.9999),
        )
    assert not out.exists() and not (tmp_path / "h.parquet").exists()


def test_python_draw_equals_the_sql_one():
    from eagle3_data.merge import stage as merge_mod

    for seed, sid in ((0, "x"), (7, "conv@12"), ("s", "a@b"), (3, "ünï@0")):
        assert merge_mod.heldout_draw(seed, sid) == heldout_draw(seed, sid)
    assert merge_mod.base_id("a@3") == "a" and merge_mod.base_id("a@b") == "a@b" and merge_mod.base_id("a@3x") == "a@3x"


def test_copies_of_a_prompt_under_other_ids_and_in_other_datasets_fall_on_the_same_side(tmp_path):
    """The held-out draw goes by the prompt's normalized text (its prompt_key), not the sample id: 60 prompts, each
    copied under another id in the same dataset and, with other case and punctuation, in a second dataset; every
    copy lands where the first does, though a draw per id would split about half of the groups."""
    from eagle3_data.normalize import prompt_key

    base = make_rows(180, ["a"], seed=21)
    rows, prompts = [], {"a": [], "b": []}
    for i in range(60):
        text = f"Question {i}: what is the value of x, given y = {i}?"
        variants = [("a", f"a-{i}", text), ("a", f"a-copy-{i}", text), ("b", f"b-{i}", text.upper().replace(",", ""))]
        for j, (ds, sid, t) in enumerate(variants):
            r = base[3 * i + j]
            rows.append(dict(r, dataset=ds, sample_id=sid))
            key = prompt_key([{"role": "user", "content": t}])
            prompts[ds].append(
                {"sample_id": sid, "dataset": ds, "messages": json.dumps([{"role": "user", "content": t}])}
            )
            prompts[ds][-1].update(source_format="test", source_row=len(prompts[ds]) - 1, prompt_key=key)
    assert (
        len({prompt_key([{"role": "user", "content": json.loads(p["messages"])[0]["content"]}]) for p in prompts["b"]})
        == 60
    )
    prompt_paths = []
    for ds, part in prompts.items():
        p = tmp_path / "prompts" / f"{ds}.parquet"
        schemas.write_checked(schemas.from_rows(part, schemas.PROMPTS), "prompts", p)
        prompt_paths.append(p)
    held_path = tmp_path / "m" / "heldout.parquet"
    merge(
        write_inputs(tmp_path, rows, 2),
        [tmp_path / "m" / "000.parquet"],
        tmp_path / "m.json",
        heldout_path=held_path,
        prompt_paths=prompt_paths,
        settings=MergeSettings.defaults(max_len=100, heldout=0.4, seed=3),
    )
    held = {r["sample_id"] for r in pq.read_table(held_path).to_pylist()}
    train = {r["sample_id"] for r in pq.read_table(tmp_path / "m" / "000.parquet").to_pylist()}
    assert len(held) + len(train) == 180
    groups = [{f"a-{i}", f"a-copy-{i}", f"b-{i}"} for i in range(60)]
    assert all(g <= held or g <= train for g in groups)
    assert 10 < sum(g <= held for g in groups) < 40
    # the draw is the documented one, of the prompt key
    from eagle3_data.merge import stage as merge_mod

    for i in range(60):
        key = prompt_key([{"role": "user", "content": f"question {i} what is the value of x given y {i}"}])
        assert (f"a-{i}" in held) == (merge_mod.heldout_draw(3, f"a-{i}", key) < 0.4)
    # drawn per sample id (no prompts given), copies straddle the split
    merge(
        write_inputs(tmp_path, rows, 2, tag="again"),
        [tmp_path / "n" / "000.parquet"],
        tmp_path / "n.json",
        heldout_path=tmp_path / "n" / "heldout.parquet",
        settings=MergeSettings.defaults(max_len=100, heldout=0.4, seed=3),
    )
    held_by_id = {r["sample_id"] for r in pq.read_table(tmp_path / "n" / "heldout.parquet").to_pylist()}
    assert sum(not (g <= held_by_id or not g & held_by_id) for g in groups) > 10
