"""A rerun heals: samples whose retries ran out without a paid reply (the backend answering 5xx to every other
request, 2 attempts each) end their generate job in one line, with the last screen saying how many and that a rerun sends them; rerunning the
same command sends exactly those requests (counted at the fault server: none paid twice), and the run after that
has nothing to do.

The scratch workflow of ``test_stop.py`` (one generated dataset, 200 prompts in 2 shards, the qwen3 fixture as
the target), against the fault server in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_data.testing.workflow import snakemake_env

from eagle3_data.testing.fault_server import FaultServer
from test_stop import N, TARGETS, _journaled, _workflow, target_dir  # noqa: F401

pytestmark = pytest.mark.slow


def _snakemake(wd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile", "mine.yaml"],
        cwd=wd,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_rerun_sends_exactly_the_samples_that_failed_without_a_paid_reply(tmp_path, target_dir):  # noqa: F811
    with FaultServer({"min_tokens": 3, "max_tokens": 8, "p5xx": 0.5, "seed": 7}) as fs:
        wd = _workflow(tmp_path, target_dir, fs, max_retries=1)
        p = _snakemake(wd)
        out = p.stdout + p.stderr
        assert p.returncode != 0, out[-3000:]
        paid = fs.app.completed
        assert 20 < N - paid < 100 and paid == _journaled(wd)  # every paid reply is journaled
        lines = [ln for ln in out.splitlines() if "failed without a paid reply (http_50" in ln]
        jobs = [ln for ln in lines if " ERROR eagle3_data: " in ln]  # each job's one line, as it ends
        assert len(jobs) == 2 and all("Rerun the same command to send them" in ln for ln in jobs), out[-3000:]
        assert "Traceback" not in out
        assert not any((wd / t).exists() for t in TARGETS)  # no output: the same command reruns both jobs
        # the jobs' warnings (a failed sample each) are counted per reason in the run's view, not printed
        assert " WARNING eagle3_data" not in out, [ln for ln in out.splitlines() if " WARNING " in ln][:5]
        views = [ln for ln in out.splitlines() if ln.startswith("generate fake: ")]
        assert any("| warnings: http_50" in ln for ln in views), views
        screen = out[out.index("Run summary (the run failed") :]
        row = next(ln.split() for ln in screen.splitlines() if ln.startswith("chat "))
        # no shard finished generate; the columns add up: Samples = Kept + Rejected + Not sent + Left
        assert row[:5] == ["chat", "0/2", str(N), str(paid), str(N - paid)], row
        assert int(row[2]) == int(row[6]) + int(row[7]) + int(row[5]) + int(row[8]) and row[8] == str(N), row
        # the cause is the run's last line, not Snakemake's WorkflowError
        last = out.rstrip().splitlines()[-1]
        assert last.startswith("The run failed: logs/generate/chat/00") and "without a paid reply" in last, last
        assert "At least one job did not complete successfully" not in out
        assert (
            f"Failed, not paid: rerun the same command to retry them (only they are sent; nothing journaled is "
            f"paid again): chat {N - paid}."
        ) in screen
        why = screen[screen.index("Why (each failed job's error; its log has the details):") :].splitlines()[1:3]
        assert sorted(ln.split(":")[0].strip() for ln in why) == [
            "logs/generate/chat/000.log",
            "logs/generate/chat/001.log",
        ]

        fs.app.config.update({"p5xx": 0.0})
        fs.app.reset()
        p = _snakemake(wd)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        # exactly the failed samples were sent, each once, and nothing was paid twice
        assert fs.app.requests == fs.app.completed == N - paid
        assert max(fs.app.completed_by_body.values()) == 1 and _journaled(wd) == N
        assert "Failed, not paid" not in p.stdout + p.stderr
        # the shard's log holds both attempts (snakemake deleted it before the rerun): the outage, then the heal
        log = (wd / "logs/generate/chat/000.log").read_text()
        heads = [ln for ln in log.splitlines() if ln.startswith("===== ")]
        assert [h.split(": ", 1)[1] for h in heads] == [
            "attempt 1 of this job =====",
            "attempt 2 of this job (earlier ones above) =====",
        ], heads
        first = log[: log.index(heads[1])]
        assert "failed without a paid reply (http_50" in first and "without a paid reply" not in log[len(first) :]

        fs.app.reset()
        p = _snakemake(wd)
        assert p.returncode == 0 and "Nothing to be done" in p.stdout + p.stderr and fs.app.requests == 0


def test_unlock_runs_without_the_api_key(tmp_path, target_dir):  # noqa: F811
    """After a kill -9 the lock must be released before anything else: `snakemake --unlock` needs no API key."""
    import yaml

    with FaultServer() as fs:
        wd = _workflow(tmp_path, target_dir, fs)
    cfg = yaml.safe_load((wd / "mine.yaml").read_text())
    cfg["backends"]["fake"]["api_key_env"] = "E3D_NOT_SET_KEY"
    (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
    env = snakemake_env(unset=["E3D_NOT_SET_KEY"])
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", "--unlock", "--configfile", "mine.yaml"],
        cwd=wd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "1", "--configfile", "mine.yaml"],
        cwd=wd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "E3D_NOT_SET_KEY is not set" in p.stderr  # a build still needs it


def test_a_damaged_file_in_results_is_named_once_and_rebuilt_by_the_rerun(tmp_path, target_dir):  # noqa: F811
    """A responses shard cut in half and a zero-byte summary (a copy cut short, a disk repaired after a crash):
    the rerun names each in one line, removes it and rebuilds it from the journal (no request), with no
    traceback; the tokens shard that read it is rebuilt too. A dry run names them and removes nothing."""
    import pyarrow.parquet as pq

    tokens = "results/chat/tokens/000.parquet"
    with FaultServer({"min_tokens": 3, "max_tokens": 8}) as fs:
        wd = _workflow(tmp_path, target_dir, fs)
        cmd = [sys.executable, "-m", "snakemake", *TARGETS, tokens, "--cores", "2", "--configfile", "mine.yaml"]

        def snakemake(*extra):
            return subprocess.run(
                cmd + list(extra), cwd=wd, env=snakemake_env(), capture_output=True, text=True, timeout=600
            )

        p = snakemake()
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        rows = pq.read_table(wd / TARGETS[0]).num_rows
        cut = wd / TARGETS[0]
        cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
        (wd / "results/chat/responses/000.json").write_bytes(b"")
        fs.app.reset()
        p = snakemake("-n")
        assert p.returncode == 0 and cut.exists(), (p.stdout + p.stderr)[-3000:]
        assert f"{TARGETS[0]} is damaged (cut off: no parquet footer at its end): a run (not -n) removes it" in p.stderr
        p = snakemake()
        out = p.stdout + p.stderr
        assert p.returncode == 0 and "Traceback" not in out, out[-3000:]
        for path, why in (
            (TARGETS[0], "cut off: no parquet footer at its end"),
            ("results/chat/responses/000.json", "0 bytes"),
        ):
            line = f"{path} is damaged ({why}): removed; this run rebuilds it (replies come from the journal: nothing paid for is bought again)"
            assert out.count(line) == 1, out[-3000:]
        assert fs.app.requests == 0  # rebuilt from the journal
        assert pq.read_table(wd / TARGETS[0]).num_rows == rows and json.loads(
            (wd / "results/chat/responses/000.json").read_text()
        )
        assert pq.read_table(wd / tokens).num_rows > 0
        p = snakemake()
        assert p.returncode == 0 and "Nothing to be done" in p.stdout + p.stderr
