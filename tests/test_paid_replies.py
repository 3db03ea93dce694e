"""Paid replies are kept or refused with a named reason, never bought twice; errors no retry can fix are not
retried; a journal that can't be written stops the job in one line before it pays for more."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_generate import backends_cfg, gen_cfg, run, simple_convs, write_prompts  # noqa: E402

from eagle3_data import journal as journal_mod  # noqa: E402
from eagle3_data.journal import JournalWriteError, read_journal  # noqa: E402


def _read_only(monkeypatch, root: Path) -> None:
    """The file system under ``root`` is read-only (EROFS for every write open; works as root too)."""
    real_open = os.open

    def ro_open(path, flags, *a, **kw):
        if str(path).startswith(str(root)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(journal_mod.os, "open", ro_open)


def test_read_only_journal_is_one_line_and_nothing_is_sent(tmp_path, fs, monkeypatch):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(6))
    run(tmp_path, fs, prompts)
    _read_only(monkeypatch, tmp_path / "journal")
    # everything journaled: the job needs no write and succeeds
    fs.app.reset()
    s = run(tmp_path, fs, prompts, out="again.parquet")
    assert s["from_journal"] == 6 and fs.app.requests == 0
    more = write_prompts(tmp_path / "p2.parquet", simple_convs(6, start=50))
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, more, out="more.parquet")
    assert "\n" not in str(e.value) and e.value.message.startswith(
        f"cannot write the response journal in {tmp_path / 'journal' / 'ds'}/: the file system is read-only")
    assert fs.app.requests == 0


def test_unwritable_journal_directory_stops_before_any_request(tmp_path, fs):
    (tmp_path / "journal").write_text("a file where the journal directory should be")
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, prompts)
    assert e.value.message.startswith(f"cannot write the response journal in {tmp_path / 'journal' / 'ds'}/:")
    assert "rerun the same command" in e.value.hint and fs.app.requests == 0


def test_full_disk_stops_sending_and_a_rerun_pays_only_for_the_rest(tmp_path, fs, monkeypatch):
    """ENOSPC at the 6th record: the job ends with one line naming the directory and 'the disk is full'; it sent
    at most what was in flight after that; the rerun (space freed) sends only the requests not journaled."""
    fs.app.config.update({"latency_min_s": 0.02, "latency_max_s": 0.05})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    real_write = os.write
    calls = {"n": 0}

    def write(fd, data):
        if fd > 2 and bytes(data[:2]) == b'{"':
            calls["n"] += 1
            if calls["n"] > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(journal_mod.os, "write", write)
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, prompts, gen=gen_cfg(), bk=backends_cfg(fs, max_concurrency=4))
    assert "the disk is full" in e.value.message and str(tmp_path / "journal" / "ds") in e.value.message
    assert fs.app.completed <= 6 + 4  # at most the requests in flight when the write failed
    monkeypatch.setattr(journal_mod.os, "write", real_write)
    recs, _ = read_journal(tmp_path / "journal", "ds")
    assert len(recs) == 5
    first = fs.app.completed
    fs.app.reset()
    s = run(tmp_path, fs, prompts)
    assert s["ok"] == 40 and s["from_journal"] == 5 and fs.app.completed == 35
    assert first + fs.app.completed - 40 <= 5  # paid twice: only replies that arrived after the disk filled
