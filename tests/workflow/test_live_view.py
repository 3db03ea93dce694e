"""The run-wide view on a terminal: a live table at the bottom of the console, Snakemake's own messages above it,
the run's last screen after the table's last state; plain lines when asked (``EAGLE3_LIVE_VIEW=0``).

``snakemake`` runs under a pseudo-terminal (``pty``) against the fault server in this process, on the scratch
workflow of ``test_stop.py`` (2 shards).
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_data.testing.workflow import snakemake_env

from eagle3_data.testing.fault_server import FaultServer
from test_stop import TARGETS, _workflow, target_dir  # noqa: F401  (the fixture is used by name)

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


#: the terminal's size (columns, rows)
SIZE = (160, 50)


def _run_in_pty(wd: Path, env: dict, timeout: float = 300, args=(*TARGETS, "--cores", "2")) -> tuple[int, str]:
    """Run the build (``args``) with a terminal of :data:`SIZE` as its stdin, stdout and stderr; return (exit code,
    everything it printed)."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", SIZE[1], SIZE[0], 0, 0))
    os.set_blocking(master, False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", *args, "--configfile", "mine.yaml"],
        cwd=wd,
        env=snakemake_env({"COLUMNS": str(SIZE[0]), "TERM": "xterm", **env}),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal's other side closed: every writer ended
                data = b""
            if not data and proc.poll() is not None:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        raise AssertionError("the build did not end within the timeout")
    os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture
def server():
    fs = FaultServer({"latency_min_s": 0.05, "latency_max_s": 0.15, "min_tokens": 3, "max_tokens": 8}).start()
    yield fs
    fs.stop()


def test_a_terminal_gets_a_live_table_with_snakemakes_lines_above_it(tmp_path, target_dir, server):  # noqa: F811
    wd = _workflow(tmp_path, target_dir, server)
    rc, out = _run_in_pty(wd, {})
    text = ANSI.sub("", out)
    assert rc == 0, text[-3000:]
    # the table: its header and the backend's row with every sample done
    header = [i for i, ln in enumerate(text.splitlines()) if re.search(r"backend\s+samples\s+shards\s+in flight", ln)]
    assert header, text[-3000:]
    rows = re.findall(r"^\s*fake\s+(\d+)/200\s+(\d+)/2\s", text, re.M)
    assert rows and rows[-1] == ("200", "2"), rows
    assert "generate fake:" not in text  # no plain lines on a terminal
    # Snakemake's own messages reached the console (through the table's redirect, not lost)
    assert "steps (100%) done" in text
    # the last screen comes after the table's last state, not under a redrawn table
    lines = text.splitlines()
    summary = max(i for i, ln in enumerate(lines) if ln.startswith("Run summary"))
    assert summary > max(header)
    assert re.search(r"^chat\s+2/2\s+200\s+200\s", text, re.M), text[-2000:]
    assert "\x1b[?25l" in out  # rich hid the cursor to redraw in place ...
    assert out.rfind("\x1b[?25h") > out.rfind("\x1b[?25l")  # ... and gave it back


def test_plain_lines_on_a_terminal_when_asked(tmp_path, target_dir, server):  # noqa: F811
    wd = _workflow(tmp_path, target_dir, server)
    rc, out = _run_in_pty(wd, {"EAGLE3_LIVE_VIEW": "0"})
    text = ANSI.sub("", out)
    assert rc == 0, text[-3000:]
    assert re.search(r"^generate fake: 200/200 samples, 2/2 shards", text, re.M), text[-3000:]
    assert not re.search(r"backend\s+samples\s+shards", text)
    assert "\x1b[?25l" not in out


def test_a_backend_failing_every_request_shows_down_with_why_while_it_lasts(tmp_path, target_dir):  # noqa: F811
    """The backend answers HTTP 5xx to everything for ~12 s, then recovers (down_after_s 60: its jobs keep
    retrying): the run's lines say ``DOWN: fake: answered only HTTP 5xx for N s ...`` during the outage, not only at
    the end, and an ETA again once it answers; the run succeeds."""
    import threading

    import yaml

    with FaultServer(
        {"latency_min_s": 0.02, "latency_max_s": 0.05, "min_tokens": 3, "max_tokens": 8, "p5xx": 1.0}
    ) as fs:
        wd = _workflow(tmp_path, target_dir, fs, max_retries=12)
        cfg = yaml.safe_load((wd / "mine.yaml").read_text())
        cfg["backends"]["fake"]["down_after_s"] = 60
        cfg["generation"].update(retry_initial_s=0.5, retry_max_s=2)
        (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
        stop = threading.Event()

        def recover():  # 12 s after the first request, the backend answers again
            while not stop.is_set() and not fs.app.request_times:
                time.sleep(0.05)
            if not stop.wait(12):
                fs.app.config.update({"p5xx": 0.0})

        t = threading.Thread(target=recover, daemon=True)
        t.start()
        p = subprocess.run(
            [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile", "mine.yaml"],
            cwd=wd,
            env=snakemake_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        stop.set()
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("generate fake: ")]
    down = [i for i, ln in enumerate(lines) if "| DOWN: fake: answered only HTTP 5xx for " in ln]
    assert down, lines
    assert "attempts, none succeeded; out after 60 s); last error: http_50" in lines[down[0]], lines[down[0]]
    # ... while it lasted: the lines after it show an ETA or done again
    assert any("| ETA " in ln or ln.endswith("| done") for ln in lines[down[-1] + 1 :]), lines
