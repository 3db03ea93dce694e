"""Response journal: append, read across shard files, torn lines, durability contract."""

from __future__ import annotations

import json

import pytest

from eagle3_data.journal import JournalError, JournalWriter, journal_path, read_journal


def rec(key: str, **kw) -> dict:
    return {"request_key": key, "sample_id": key.upper(), "status": "ok", "content": f"text {key}", **kw}


def test_append_and_read_back(tmp_path):
    with JournalWriter(tmp_path, "ds", "000", sync_every=2) as j:
        for k in "abc":
            j.append(rec(k, output_ids=[1, 2, 3]))
        assert j.written == 3
    recs, stats = read_journal(tmp_path, "ds")
    assert set(recs) == {"a", "b", "c"} and recs["b"]["output_ids"] == [1, 2, 3]
    assert stats == {"files": 1, "lines": 3, "records": 3, "bad_lines": 0, "duplicates": 0}
    assert journal_path(tmp_path, "ds", "000").read_text().count("\n") == 3


def test_records_visible_before_close(tmp_path):
    # each record reaches the OS at once (a kill -9 after append loses nothing)
    j = JournalWriter(tmp_path, "ds", "001", sync_every=1000, sync_interval_s=1000)
    j.append(rec("x"))
    assert set(read_journal(tmp_path, "ds")[0]) == {"x"}
    j.close()
    with pytest.raises(JournalError):
        j.append(rec("y"))


def test_reads_all_shard_files_and_counts_duplicates(tmp_path):
    with JournalWriter(tmp_path, "ds", "000") as j:
        j.append(rec("a"))
    with JournalWriter(tmp_path, "ds", "003") as j:
        j.append(rec("b"))
        j.append(rec("a", content="second copy"))
    with JournalWriter(tmp_path, "other", "000") as j:
        j.append(rec("z"))
    recs, stats = read_journal(tmp_path, "ds")
    assert set(recs) == {"a", "b"} and stats["files"] == 2 and stats["duplicates"] == 1
    assert recs["a"]["content"] == "text a"       # first occurrence wins (files read in sorted order)
    assert read_journal(tmp_path, "missing") == ({}, {"files": 0, "lines": 0, "records": 0, "bad_lines": 0, "duplicates": 0})


def test_torn_line_skipped_and_next_append_starts_fresh_line(tmp_path):
    with JournalWriter(tmp_path, "ds", "000") as j:
        j.append(rec("a"))
        j.append(rec("b"))
    p = journal_path(tmp_path, "ds", "000")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 9])                    # crash in the middle of record b
    recs, stats = read_journal(tmp_path, "ds")
    assert set(recs) == {"a"} and stats["bad_lines"] == 1
    with JournalWriter(tmp_path, "ds", "000") as j:
        j.append(rec("b"))
    recs, stats = read_journal(tmp_path, "ds")
    assert set(recs) == {"a", "b"} and stats["bad_lines"] == 1
    lines = p.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["request_key"] == "b"


def test_non_record_lines_are_bad(tmp_path):
    p = journal_path(tmp_path, "ds", "000")
    p.parent.mkdir(parents=True)
    p.write_text('[1, 2]\n{"no_key": 1}\n\n{"request_key": "k"}\n')
    recs, stats = read_journal(tmp_path, "ds")
    assert list(recs) == ["k"] and stats["bad_lines"] == 2


def test_record_without_key_rejected(tmp_path):
    with JournalWriter(tmp_path, "ds", "000") as j, pytest.raises(JournalError, match="request_key"):
        j.append({"content": "x"})
