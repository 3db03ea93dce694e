"""Stop means stop: however a build is stopped, its generate jobs start no request more than 5 s after the signal,
journal every reply already paid for (the jobs' own SIGINT / SIGTERM, as from a terminal's Ctrl-C, stops them
as the stop file does: the replies in flight get the grace period), and a rerun sends only what is missing.

A scratch workflow with one generated dataset (200 prompts in 2 shards) against the fault server in this process
(replies take 0.3-0.6 s, 4 at a time per shard: a shard takes ~11 s). Each test starts ``snakemake`` in a session
of its own, waits for the first replies, stops it one way, and reads the server's request times: the last request
must have arrived at most 5 s after the signal.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, snakemake_env

from eagle3_data.testing.fault_server import FaultServer

pytestmark = pytest.mark.slow

N = 200
TARGETS = ["results/chat/responses/000.parquet", "results/chat/responses/001.parquet"]
STOP_S = 5.0


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A target tokenizer with a chat template (the qwen3 fixture), checked once: its check stamp is copied into
    every test's cache so no run parses with a transformers import."""
    from eagle3_data.testing.tokenizer_fixtures import save_fixture

    from eagle3_data.runtime import prerun

    d = tmp_path_factory.mktemp("target") / "qwen"
    save_fixture("qwen3", d)
    cache = d.parent / "cache"
    prerun.check_target({"target": {"path": str(d), "template": "qwen3"}}, cache)
    return d, cache / "checks"


@pytest.fixture
def server():
    fs = FaultServer({"latency_min_s": 0.3, "latency_max_s": 0.6, "min_tokens": 3, "max_tokens": 8}).start()
    yield fs
    fs.stop()


def _workflow(tmp_path: Path, target_dir, fs: FaultServer, max_retries: int = 2) -> Path:
    wd = copy_workflow(tmp_path / "w")
    d, checks = target_dir
    shutil.copytree(checks, wd / "cache" / "checks")
    convs = [
        {
            "id": f"c{i:04d}",
            "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "an answer"}],
        }
        for i in range(N)
    ]
    (wd / "chat.json").write_text(json.dumps(convs))
    cfg = {
        "cache_dir": "cache",
        "target": {"name": "qwen-fixture", "path": str(d), "build_tiny": False, "template": "qwen3"},
        "backends": {
            "fake": {
                "type": "openai",
                "base_url": fs.url + "/v1",
                "model": "m",
                "api_key_env": None,
                "max_concurrency": 8,
                "timeout_s": 30,
            }
        },
        "generation": {
            "backends": ["fake"],
            "max_tokens": 16,
            "max_retries": max_retries,
            "retry_initial_s": 0.1,
            "stop_grace_s": 2,
        },
        "datasets": {"chat": {"source": {"format": "sharegpt", "path": "chat.json"}, "shards": 2}},
        "vocab": {"draft_vocab_size": 64},
    }
    (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
    return wd


def _start(wd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile", "mine.yaml"],
        cwd=wd,
        env=snakemake_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for_replies(fs: FaultServer, proc: subprocess.Popen, n: int = 12, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while fs.app.completed < n:
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended before {n} replies:\n{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, "no replies from the generate jobs"
        time.sleep(0.1)


def _wait_quiet(fs: FaultServer, quiet_s: float = 4.0, timeout: float = 60) -> None:
    """Until no request has arrived for ``quiet_s`` and none is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        last = fs.app.request_times[-1] if fs.app.request_times else 0.0
        if fs.app.in_flight == 0 and time.time() - last >= quiet_s:
            return
        assert time.monotonic() < deadline, "requests kept coming"
        time.sleep(0.2)


def _journaled(wd: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (wd / "cache" / "journal" / "chat").glob("*.jsonl"))


def _stop_and_check(wd, fs, proc, how: str) -> tuple[float, str]:
    _wait_for_replies(fs, proc)
    t_sig = time.time()
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif how == "sigint":
        proc.send_signal(signal.SIGINT)
    elif how == "kill9":
        proc.kill()
    elif how == "ctrl-c":  # a terminal's Ctrl-C: SIGINT to the whole foreground process group
        os.killpg(proc.pid, signal.SIGINT)
    elif how == "ctrl-c twice":  # an impatient user: a second Ctrl-C while the first one's stop is under way
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"snakemake did not exit within 60 s of {how}:\n{out[-4000:]}")
    _wait_quiet(fs)
    after = [t - t_sig for t in fs.app.request_times if t > t_sig]
    print(
        f"\n{how}: {fs.app.requests} requests, {len(after)} after the signal (the last "
        f"{max(after, default=0):.2f} s after it), {fs.app.completed} completed, {_journaled(wd)} journaled"
    )
    late = [t - t_sig for t in fs.app.request_times if t > t_sig + STOP_S]
    assert not late, f"{len(late)} requests started more than {STOP_S} s after {how} (last {max(late):.1f} s)"
    assert fs.app.completed < N, "the build ran to its end"
    # every reply the server sent (paid for) arrived within the grace period and was journaled: none lost
    assert _journaled(wd) == fs.app.completed, (_journaled(wd), fs.app.completed)
    return t_sig, out


def _resume(wd, fs, *extra) -> str:
    """Rerun: only the requests not journaled are sent; every prompt ends with one response."""
    before = _journaled(wd)
    fs.app.config.update({"latency_min_s": 0.0, "latency_max_s": 0.05})  # the resume need not be slow
    fs.app.reset()
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile", "mine.yaml", *extra],
        cwd=wd,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert fs.app.completed == N - before, (fs.app.completed, before)
    assert _journaled(wd) == N
    return p.stdout + p.stderr


@pytest.mark.parametrize("how", ["sigterm", "sigint", "ctrl-c", "ctrl-c twice"])
def test_a_signal_to_snakemake_stops_the_requests(tmp_path, target_dir, server, how):
    wd = _workflow(tmp_path, target_dir, server)
    proc = _start(wd)
    _, out = _stop_and_check(wd, server, proc, how)
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    # a second Ctrl-C changes nothing: said once, the replies in flight still journaled (_stop_and_check: none lost)
    assert out.count("Already stopping: the replies in flight are paid for") == (how == "ctrl-c twice"), out[-3000:]
    # the one line of the interrupted run counts this config's journaled responses
    n = _journaled(wd)
    assert n >= 12
    line = next(ln for ln in out.splitlines() if "Rerun the same command to resume" in ln)
    assert f" {n:,} responses of this config are journaled" in line, (line, n)
    # ... and it is the run's last words: not Snakemake's WorkflowError after a deliberate stop
    assert out.rstrip().splitlines()[-1] == line, out[-1500:]
    assert line.startswith("Stopped (SIGTERM). " if how == "sigterm" else "Interrupted (Ctrl-C). "), line
    assert "At least one job did not complete successfully" not in out and "WorkflowError" not in out
    # the last screen counts what the stopped shards journaled: OK = the journal's lines, a cost, the rest not sent;
    # no shard finished generate, and the columns add up: Samples = Kept + Rejected + Not sent + Left
    screen = out[out.index("Run summary (the run failed") :]
    row = next(ln.split() for ln in screen.splitlines() if ln.startswith("chat "))
    assert row[:4] == ["chat", "0/2", str(N), str(n)], row
    assert int(row[4]) + int(row[5]) == N - n and float(row[9]) > 0 and row[-1] == "stopped", row
    assert int(row[2]) == int(row[6]) + int(row[7]) + int(row[5]) + int(row[8]), row
    _resume(wd, server)


def test_kill_9_of_snakemake_stops_its_jobs_and_the_rerun_says_to_unlock(tmp_path, target_dir, server):
    wd = _workflow(tmp_path, target_dir, server)
    proc = _start(wd)
    _stop_and_check(wd, server, proc, "kill9")
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile", "mine.yaml"],
        cwd=wd,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    # the hint is the first line the run prints, and the only one: no banner, no DAG, no LockException after it
    # (Snakemake's own "Using workflow specific profile ..." comes first: it prints it before reading the Snakefile)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if not ln.startswith("Using workflow specific profile")]
    assert lines == [
        f"The snakemake run {proc.pid} was killed and left its lock on this directory: run "
        "`snakemake --unlock` (with the same --configfile, if any), then the same command again to "
        "resume."
    ], p.stdout[-2000:] + p.stderr[-3000:]
    u = subprocess.run(
        [sys.executable, "-m", "snakemake", "--unlock", "--configfile", "mine.yaml"],
        cwd=wd,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert u.returncode == 0, u.stderr[-3000:]
    _resume(wd, server)
