"""Failures a user can act on are one line naming the file or setting, never a traceback, and leave no ``.tmp``:
a full disk under an output (any stage writing through ``files.atomic_path``, or an error whose errno is only in its
text, as pyarrow's), the temporary file a writer killed by SIGBUS left, a source nested too deep for the JSON
reader, a UTF-16 source, ``EAGLE3_LIMITS_DIR`` naming a file."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_generate import backends_cfg, run, simple_convs, write_prompts

from eagle3_data.errors import run_stage
from eagle3_data.generate import GenerationStopped
from eagle3_data.files import write_json, write_text
from eagle3_data.sources import SourceFormatError, iter_records
from eagle3_data.sources.readers import InvalidLine


def test_a_full_disk_under_an_output_is_one_line_naming_it_and_leaves_no_tmp(tmp_path, monkeypatch):
    out = tmp_path / "results" / "reports" / "plan.md"

    def full(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(Exception) as ei:
        write_text("# plan\n", out)
    assert type(ei.value).__name__ == "DiskError" and str(ei.value) == (
        f"cannot write {out}: the disk is full ([Errno 28] No space left on device). Free "
        "space there (or make it writable), then rerun the same command"
    )
    assert list(out.parent.iterdir()) == []  # no .tmp left, no output


def test_a_stage_failing_on_a_full_disk_prints_one_line_without_a_traceback(tmp_path):
    """pyarrow's errors carry the errno in their text only ("[Errno 28] ..."), with no file name."""
    log_path = tmp_path / "job.log"
    code = f"""
import logging, sys
from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
log = setup_logging({str(log_path)!r})
def main():
    raise OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device")
run_stage(main, log=log)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr + log_path.read_text()
    (line,) = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert line.endswith(
        "cannot write the job's output: the disk is full ([Errno 28] No space left on device). "
        "Free space there (or make it writable), then rerun the same command"
    )


def test_other_os_errors_keep_their_traceback(tmp_path):
    log = logging.getLogger("test-one-line")
    with pytest.raises(FileNotFoundError):
        run_stage(lambda: open(tmp_path / "missing"), log=log)


def test_a_tmp_file_a_killed_writer_left_is_gone_after_the_next_write(tmp_path):
    """A writer killed by SIGBUS (an mmap on a full disk) or kill -9 runs no cleanup: its temporary file stays.
    The next write of the same output removes it (its writer holds no lock any more)."""
    out = tmp_path / "states.json"
    code = f"""
import os, signal
from eagle3_data.files import atomic_path
with atomic_path({str(out)!r}) as tmp:
    tmp.write_text("half")
    os.kill(os.getpid(), signal.SIGBUS)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    (left,) = tmp_path.glob(".states.json.*.tmp")
    write_json({"ok": True}, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["states.json"]
    assert json.loads(out.read_text()) == {"ok": True}


def test_a_source_nested_too_deep_is_a_line_naming_file_and_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text('{"conversations": []}\n{"x": ' + deep + "}\n")
    with pytest.raises(SourceFormatError) as ei:
        list(iter_records(jsonl))
    assert str(ei.value).startswith(
        f"{jsonl}:2: invalid JSON (nested too deep (more levels of arrays/objects than the JSON reader allows))"
    )
    records = list(iter_records(jsonl, on_error="skip"))
    assert isinstance(records[1][1], InvalidLine) and "nested too deep" in records[1][1].message
    arr = tmp_path / "s.json"
    arr.write_text('[{"conversations": []},\n' + deep + "]")
    with pytest.raises(SourceFormatError, match=r"s.json line 2 \(record 1\): nested too deep"):
        list(iter_records(arr))


@pytest.mark.parametrize(
    "encoding,name", [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16 or UTF-32"), ("utf-32", "UTF-32")]
)
def test_a_utf16_source_says_so_and_how_to_convert_it(tmp_path, encoding, name):
    for suffix in (".jsonl", ".json"):
        src = tmp_path / f"s{suffix}"
        text = '{"conversations": [{"from": "human", "value": "hi"}]}\n'
        src.write_bytes((text if suffix == ".jsonl" else f"[{text}]").encode(encoding))
        with pytest.raises(SourceFormatError) as ei:
            list(iter_records(src))
        assert str(ei.value).startswith(f"{src}: the file is {name}") and "not UTF-8" in str(ei.value)
        assert "iconv -f" in str(ei.value)


def test_a_json_array_that_is_not_utf8_names_the_file_and_line(tmp_path):
    src = tmp_path / "s.json"
    src.write_bytes(b'[\n{"a": "ok"},\n{"a": "caf\xe9"}]')
    with pytest.raises(SourceFormatError, match=r"s.json line \d: not UTF-8 \(invalid continuation byte"):
        list(iter_records(src))


def test_limits_dir_naming_a_file_is_one_line(tmp_path, fs, monkeypatch):
    from eagle3_data.runtime.processes import Owner

    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("EAGLE3_LIMITS_DIR", str(f))
    # a job of a workflow run owned by this process: its backends' slots are shared on the machine
    monkeypatch.setenv("EAGLE3_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("EAGLE3_RUN_OWNER", str(Owner.me()))
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(3))
    with pytest.raises(GenerationStopped) as ei:
        run(tmp_path, fs, prompts, bk=backends_cfg(fs))
    msg = str(ei.value)
    assert msg.startswith(
        f"[ds/000] the shared request slots can't be kept in EAGLE3_LIMITS_DIR={f}: it names a "
        "file, not a directory. Point EAGLE3_LIMITS_DIR at a directory (or unset it), then rerun"
    )
    assert fs.app.requests == 0 and "\n" not in msg
    assert os.path.isfile(f)


def test_a_duckdb_copy_onto_a_full_disk_is_one_line_naming_the_csv(tmp_path, monkeypatch):
    """The reports' CSV files are written by DuckDB (``COPY``), whose errors are its own, not OSError."""
    import duckdb

    from eagle3_data.report.db import write_csv

    class FullDisk:
        def execute(self, sql):
            raise duckdb.IOException('IO Error: Could not write file "x": No space left on device')

    out = tmp_path / "reports" / "tally.csv"
    with pytest.raises(Exception) as ei:
        write_csv(FullDisk(), "t", ["a"], out)
    assert type(ei.value).__name__ == "DiskError" and str(ei.value).startswith(
        f"cannot write {out}: the disk is full ([Errno 28] No space left on device)."
    )
    assert list(out.parent.iterdir()) == []
