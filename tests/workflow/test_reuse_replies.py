"""Paid replies are found by what was asked (eagle3_data.generate.reuse): a renamed dataset, a second dataset holding
the same prompt, an old journal without indexes, mode all; never a reply asked of another target or with other
sampling. Against the fault-injecting test server, which counts what it was sent."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from eagle3_data.generate.journal import read_journal
from eagle3_data.generate.reuse import INDEX_SUFFIX, file_index, prompt_digest

from test_generate import gen_cfg, run, simple_convs, write_prompts


def _rows(path) -> dict:
    return {(r["sample_id"], r["turn"]): r for r in pq.read_table(path).to_pylist()}


def test_a_renamed_dataset_buys_nothing_again(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(20))
    first = run(tmp_path, fs, prompts, dataset="chat", out="a.parquet")
    assert first["sent"] == fs.stats()["requests"] == 20 and first["cost_usd"] > 0
    renamed = run(tmp_path, fs, prompts, dataset="chat_v2", out="b.parquet")
    assert fs.stats()["requests"] == 20 and renamed["sent"] == 0
    assert renamed["reused"] == {"chat": 20} and renamed["ok"] == 20 and renamed["total_cost_usd"] == 0
    a, b = _rows(tmp_path / "a.parquet"), _rows(tmp_path / "b.parquet")
    assert a.keys() == b.keys()
    for slot, row in b.items():
        assert row["dataset"] == "chat_v2" and row["content"] == a[slot]["content"]
        assert row["output_ids"] == a[slot]["output_ids"] and row["request_key"] != a[slot]["request_key"]
        assert row["cost_usd"] == 0 and a[slot]["cost_usd"] > 0
    # the copies are in the new dataset's own journal, naming the record that was paid for
    recs, _ = read_journal(tmp_path / "journal", "chat_v2")
    assert sorted(r["reused_from"] for r in recs.values()) == sorted(f"chat/{sid}/1" for sid, _ in a)
    # its rerun answers from its own journal: nothing reused twice, nothing sent
    again = run(tmp_path, fs, prompts, dataset="chat_v2", out="c.parquet")
    assert again["sent"] == 0 and again["reused"] == {} and again["from_journal"] == 20
    assert fs.stats()["requests"] == 20


def test_a_second_dataset_with_some_of_the_same_prompts_buys_only_the_new_ones(tmp_path, fs):
    run(tmp_path, fs, write_prompts(tmp_path / "p.parquet", simple_convs(10)), dataset="first")
    # other sample ids, six prompts shared (numbers 4..9), four new ones (10..13)
    other = write_prompts(tmp_path / "q.parquet", simple_convs(10, start=4), ids=[f"x{i}" for i in range(10)])
    s = run(tmp_path, fs, other, dataset="second", out="q.out.parquet")
    assert s["reused"] == {"first": 6} and s["sent"] == 4 and fs.stats()["requests"] == 14
    assert s["ok"] == 10


def test_another_target_or_other_sampling_is_asked_again(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(6))
    run(tmp_path, fs, prompts, dataset="a")
    s = run(tmp_path, fs, prompts, dataset="b", gen=gen_cfg(max_tokens=31), out="b.parquet")
    assert s["reused"] == {} and s["sent"] == 6
    s = run(tmp_path, fs, prompts, dataset="c", target_name="other-target", out="c.parquet")
    assert s["reused"] == {} and s["sent"] == 6
    assert fs.stats()["requests"] == 18


def test_a_journal_without_indexes_is_found_and_an_index_is_extended_not_rebuilt(tmp_path, fs):
    run(tmp_path, fs, write_prompts(tmp_path / "p.parquet", simple_convs(8)), dataset="old")
    journal = tmp_path / "journal" / "old" / "000.jsonl"
    index = journal.with_name(journal.name + INDEX_SUFFIX)
    assert not index.exists()  # a job whose requests were all new read no index and wrote none
    entries = file_index(journal)
    lines = journal.read_bytes().splitlines(keepends=True)
    offsets = [sum(len(x) for x in lines[:i]) for i in range(len(lines))]
    assert [o for _, o in entries] == offsets and len(entries) == 8
    assert [d for d, _ in entries] == [prompt_digest(json.loads(x)["messages"], json.loads(x)["tools"]) for x in lines]
    assert index.read_text().splitlines()[0] == f"eagle3-prompt-index 1 {journal.stat().st_size}"
    # records appended later: only they are read (the index's covered part is trusted as is)
    marker = "0000000000000000"
    text = index.read_text().splitlines()
    index.write_text("\n".join([text[0], f"{marker} 0", *text[2:]]) + "\n")
    run(tmp_path, fs, write_prompts(tmp_path / "p2.parquet", simple_convs(2, start=8), ids=["n0", "n1"]), dataset="old")
    grown = file_index(journal)
    assert len(grown) == 10 and grown[0] == (marker, 0) and grown[1:8] == entries[1:]
    # an index that covers more than its file (the file was replaced) is rebuilt from the file
    index.write_text(f"eagle3-prompt-index 1 {10**9}\n{marker} 0\n")
    assert file_index(journal)[0] == entries[0] and len(file_index(journal)) == 10
    # the old dataset's replies are found from a renamed copy with every index removed
    index.unlink()
    s = run(tmp_path, fs, write_prompts(tmp_path / "p.parquet", simple_convs(8)), dataset="renamed", out="r.parquet")
    assert s["reused"] == {"old": 8} and s["sent"] == 0


def test_mode_all_finds_every_turn_through_the_regenerated_history(tmp_path, fs):
    conv = [
        {"role": "user", "content": "first q"},
        {"role": "assistant", "content": "orig one"},
        {"role": "user", "content": "second q"},
        {"role": "assistant", "content": "orig two"},
        {"role": "user", "content": "third q"},
        {"role": "assistant", "content": "orig three"},
    ]
    other = [{**m, "content": m["content"].replace("q", "question")} for m in conv[:4]]
    prompts = write_prompts(tmp_path / "p.parquet", [conv, other])
    first = run(tmp_path, fs, prompts, dataset="multi", gen=gen_cfg(mode="all"), out="a.parquet")
    assert first["sent"] == 5
    s = run(tmp_path, fs, prompts, dataset="multi_renamed", gen=gen_cfg(mode="all"), out="b.parquet")
    assert s["sent"] == 0 and s["reused"] == {"multi": 5} and fs.stats()["requests"] == 5
    a, b = _rows(tmp_path / "a.parquet"), _rows(tmp_path / "b.parquet")
    assert {k: (r["messages"], r["content"]) for k, r in a.items()} == {
        k: (r["messages"], r["content"]) for k, r in b.items()
    }
