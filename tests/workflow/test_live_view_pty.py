"""The live view on a real terminal stays clean: a run whose jobs log (tokenize's INFO lines, with Python dicts)
and one of which fails (a dataset whose source is no JSON: its normalize job's one-line error) draws nothing but
its tables while they are up; the job's one-line error goes above them, its INFO lines only to its log file.

``snakemake`` runs under a pseudo-terminal of 160 columns (``test_live_view._run_in_pty``) on the scratch workflow
of ``test_stop.py`` with that second dataset, ``--keep-going``; what it printed is played into a terminal emulator
(``pyte``), and the rows of the final screen (with those scrolled off it) are read back as a person would see them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyte
import pytest
import yaml

from test_live_view import SIZE, _run_in_pty, server  # noqa: F401  (the fixture is used by name)
from test_stop import _workflow, target_dir  # noqa: F401

pytestmark = pytest.mark.slow

#: a job's log record as logs.setup_logging writes it
RECORD = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) eagle3_data")
TARGETS = ["results/chat/tokens/000.parquet", "results/chat/tokens/001.parquet", "results/bad/prompts/000.parquet"]


def screen_rows(output: str) -> list[str]:
    """What a terminal of :data:`SIZE` shows after ``output``: the rows scrolled off the top, then the screen's."""
    screen = pyte.HistoryScreen(*SIZE, history=100_000)
    stream = pyte.Stream(screen)
    stream.feed(output)  # as the terminal got it (its line discipline turned each "\n" into "\r\n")
    cols = range(SIZE[0])
    rows = ["".join(line[x].data for x in cols).rstrip() for line in screen.history.top]
    return rows + [row.rstrip() for row in screen.display]


def test_nothing_but_the_tables_is_drawn_and_a_failed_jobs_error_goes_above_them(tmp_path, target_dir, server):  # noqa: F811
    wd = _workflow(tmp_path, target_dir, server)
    cfg = yaml.safe_load((wd / "mine.yaml").read_text())
    cfg["datasets"]["bad"] = {"source": {"format": "sharegpt", "path": "bad.json"}, "shards": 1}
    (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
    (wd / "bad.json").write_text("this is not JSON\n")
    rc, out = _run_in_pty(wd, {}, args=(*TARGETS, "--cores", "2", "--keep-going"))
    rows = screen_rows(out)
    text = "\n".join(rows)
    assert rc != 0, text[-4000:]  # the bad dataset's job failed; the others ran on (--keep-going)
    assert Path(wd / "results/chat/tokens/001.parquet").exists(), text[-4000:]
    # the jobs logged INFO lines (their log files have them) ...
    assert " INFO eagle3_data.tokens: tokenize " in (wd / "logs/tokenize/chat/000.log").read_text()
    # ... and none reached the terminal: no row holds an INFO record, inside a table or out of it
    assert not [r for r in rows if re.search(r"\d\d:\d\d:\d\d (DEBUG|INFO) ", r)], text[-4000:]
    # a record is only ever a row of its own, from its first column: never drawn into a table's row
    assert all(m.start() == 0 for r in rows for m in RECORD.finditer(r)), text[-4000:]
    # the failed job's one-line error, once, above the tables' last state
    errors = [i for i, r in enumerate(rows) if RECORD.match(r) and " ERROR " in r and "bad.json" in r]
    assert len(errors) == 1, text[-4000:]
    header = [i for i, r in enumerate(rows) if re.match(r"\s*backend\s+samples\s+shards\s+in flight", r)]
    stages = [i for i, r in enumerate(rows) if re.match(r"\s*stage\s+jobs\s+tokens\s+rate\s+device\s+ETA", r)]
    assert header and stages and errors[0] < header[-1] < stages[-1], text[-4000:]
    # the tables' last state: every chat sample generated, both tokenize jobs done; every row of a table is one
    last = rows[header[-1] : rows.index(next(r for r in rows[stages[-1] :] if not r.strip()), stages[-1])]
    assert re.match(r"\s*fake\s+200/\S+\s+2/\S+\s", last[1]), last
    tokenize = [r for r in last if r.split()[:1] == ["tokenize"]]
    assert len(tokenize) == 1 and tokenize[0].split()[1:2] == ["2/2"] and tokenize[0].rstrip().endswith("done"), last
    for r in last[1:]:
        assert r.split()[0] in ("fake", "stages", "stage", "tokenize", "validate", "merge", "extract", "export"), last
    # Snakemake's own messages scrolled above, and the run's last screen came after the tables
    assert any("Error in rule normalize_bad" in r for r in rows[: header[-1]]), text[-4000:]
    assert max(i for i, r in enumerate(rows) if r.startswith("Run summary")) > stages[-1]
