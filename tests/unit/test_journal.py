"""Response journal: append, read across shard files, torn lines, durability contract."""

from __future__ import annotations

import os
import json

import pytest

from eagle3_data.generate.journal import JournalError, JournalWriter, journal_path, read_journal


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


def test_batches_are_fsynced_by_the_writer_thread_not_the_appending_one(tmp_path, monkeypatch):
    """append never waits for the disk: a full batch, and a partial one after sync_interval_s, are fsync-ed by the
    writer's thread; close fsyncs the rest."""
    import os
    import threading
    import time

    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(threading.current_thread().name), real(fd))[1])
    j = JournalWriter(tmp_path, "ds", "002", sync_every=3, sync_interval_s=0.2)
    j.ensure_open()  # the file is made at the first record, or here
    calls.clear()  # the new file's directory entry, synced at creation
    main = threading.current_thread().name
    for k in "abc":
        j.append(rec(k))  # a full batch: the thread syncs it
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls and main not in calls
    j.append(rec("d"))  # a partial batch: synced after the interval
    time.sleep(0.6)
    assert len(calls) == 2 and main not in calls
    j.append(rec("e"))
    j.close()  # the rest: at close, in the caller's thread
    assert calls[-1] == main and len(calls) == 3
    assert set(read_journal(tmp_path, "ds")[0]) == set("abcde")


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
    assert recs["a"]["content"] == "text a"  # first occurrence wins (files read in sorted order)
    assert read_journal(tmp_path, "missing") == (
        {},
        {"files": 0, "lines": 0, "records": 0, "bad_lines": 0, "duplicates": 0},
    )


def test_torn_line_skipped_and_next_append_starts_fresh_line(tmp_path):
    with JournalWriter(tmp_path, "ds", "000") as j:
        j.append(rec("a"))
        j.append(rec("b"))
    p = journal_path(tmp_path, "ds", "000")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 9])  # crash in the middle of record b
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


def test_records_with_values_no_responses_row_can_hold_are_bad_lines(tmp_path, caplog):
    p = journal_path(tmp_path, "ds", "000")
    p.parent.mkdir(parents=True)
    bad = [
        rec("a", completion_tokens="12"),
        rec("b", cost_usd=float("nan")),
        rec("c", output_ids=[1, 2.0]),
        rec("d", turn="1"),
        rec("e", content=7),
        rec("f", cost_usd=-0.5),
        rec("g", prompt_tokens=-1),
        rec("h", output_ids=[1, 2**31]),
        rec("i", turn=True),
        rec("j", latency_s=float("inf")),
        rec("k", prompt_tokens=2**40),
    ]
    good = [
        rec("ok1", completion_tokens=3, cost_usd=0.0, output_ids=[0, 5], turn=1, latency_s=1),
        rec("ok2", prompt_tokens=2**31 - 1, completed_at=1.7e9),
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in bad[:5] + good + bad[5:]))
    with caplog.at_level("WARNING", logger="eagle3_data.generate.journal"):
        recs, stats = read_journal(tmp_path, "ds")
    assert sorted(recs) == ["ok1", "ok2"] and stats["bad_lines"] == len(bad) == 11
    assert "line 1: field 'completion_tokens' is '12', not a count" in caplog.text
    assert "line 2: field 'cost_usd' is nan, not a finite number" in caplog.text
    assert "line 5: field 'content' is int, not text" in caplog.text


def test_stale_partial_outputs_are_removed_but_a_live_writers_is_not(tmp_path):
    from eagle3_data.files import atomic_path, remove_stale_partials

    out = tmp_path / "out[1].parquet"  # glob characters in the name
    dead = tmp_path / ".out[1].parquet.dead1234.tmp"  # left by a kill -9: no lock held
    dead.write_bytes(b"partial")
    other = tmp_path / ".other.parquet.x.tmp"
    other.write_bytes(b"not ours")
    with atomic_path(out) as live:  # a writer removes what dead writers of its output left, first
        assert not dead.exists() and other.exists()
        live.write_bytes(b"in progress")
        dead.write_bytes(b"partial")
        assert remove_stale_partials(out) == [dead]
        assert live.exists() and other.exists() and not dead.exists()
    assert out.read_bytes() == b"in progress" and not live.exists()
    assert remove_stale_partials(out) == []


def test_held_replies_are_the_owners_alone_and_read_until_the_journal_takes_them(tmp_path, monkeypatch):
    """save_held's fallback: a folder of the user's own (0700) in the temp directory, files 0600; a folder of that
    name readable by others (pre-created by another user) is refused; read_journal reads the held records, and
    adopt_held moves them into the journal folder once its disk can take them."""
    import errno
    import tempfile

    from eagle3_data.generate import journal as jm

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    jdir = tmp_path / "cache" / "journal"
    real_write, real_fsync = os.write, os.fsync

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    recs = [{"request_key": f"k{i}", "status": "ok", "content": f"reply {i}"} for i in range(3)]
    monkeypatch.setattr(jm.os, "write", full)  # the journal's disk is full: the records go to the fallback
    path, in_journal = jm.save_held(recs, jdir, "ds", "000")
    monkeypatch.setattr(jm.os, "write", real_write)
    assert not in_journal and path.parent == jm.held_dir(jdir, "ds") and path.stat().st_mode & 0o777 == 0o600
    top = tmp_path / "tmp" / f"eagle3-held-{os.getuid()}"
    assert {p.stat().st_mode & 0o777 for p in (top, path.parent, path.parent.parent)} == {0o700}
    got, stats = jm.read_journal(jdir, "ds")
    assert sorted(got) == ["k0", "k1", "k2"] and stats["files"] == 2  # the (empty) journal and the held file
    monkeypatch.setattr(jm.os, "fsync", full)
    assert jm.adopt_held(jdir, "ds") == 0 and path.exists()  # still full: kept where it is, still read
    assert sorted(jm.read_journal(jdir, "ds")[0]) == ["k0", "k1", "k2"]
    assert sorted(p.name for p in (jdir / "ds").iterdir()) == ["000.jsonl"]  # no part file left behind
    monkeypatch.setattr(jm.os, "fsync", real_fsync)
    assert jm.adopt_held(jdir, "ds") == 3 and not path.exists()
    assert sorted(p.name for p in (jdir / "ds").iterdir()) == ["000.jsonl", f"held-{path.name}"]
    assert sorted(jm.read_journal(jdir, "ds")[0]) == ["k0", "k1", "k2"]
    top.chmod(0o755)  # a folder of that name others can read (another user made it): nothing is written there
    monkeypatch.setattr(jm.os, "write", full)
    assert jm.save_held(recs, jdir, "ds", "001") == (None, False)
