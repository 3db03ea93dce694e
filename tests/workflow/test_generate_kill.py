"""kill -9 of a generate job at three points, then a rerun: same final set as an uninterrupted run, and the
fault server's counter shows no request completed *and journaled* was ever sent again.

The job runs in a child process (so ``SIGKILL`` really kills the interpreter mid-flight); the fault server runs
in a thread of the test process (its counters are read right after each kill). A request in flight at the kill
may have been answered by the server but never received or journaled by the client: re-sending that one is
allowed (the client never completed it), re-sending anything that was in the journal at the kill is not.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing.fault_server import FaultServer, body_hash

from eagle3_data import schemas
from eagle3_data.files import write_parquet
from eagle3_data.generate.journal import journal_path, read_journal

N = 200
CONC = 8
# retryable faults only (and enough retries) so every sample ends ok in every run: the final sets compare exactly
FAULTS = {
    "p429": 0.10,
    "p5xx": 0.05,
    "preset": 0.02,
    "perror200": 0.01,
    "retry_after_s": 0.01,
    "latency_min_s": 0.02,
    "latency_max_s": 0.06,
}
SAMPLING = {"max_tokens": 30, "temperature": 1.0, "top_p": 1.0}

CHILD = r"""
import json, sys
from eagle3_data.errors import run_stage
from eagle3_data.generate import generate
from eagle3_data.logs import setup_logging
a = json.loads(sys.argv[1])
log = setup_logging(None)
from eagle3_data.settings import GenerateSettings
settings = GenerateSettings.defaults(target_name="tiny-target", generation=a["generation"], backends=a["backends"],
                                     journal_dir=a["journal"])
run_stage(lambda: generate(a["prompts"], a["out"], settings, shard="000", progress_interval_s=0.5), log=log)
"""


def write_prompts(path: Path) -> Path:
    rows = [
        dict(
            sample_id=f"s{i:04d}",
            dataset="ds",
            source_format="test",
            source_row=i,
            tools=None,
            messages=json.dumps(
                [{"role": "user", "content": f"question number {i}"}, {"role": "assistant", "content": "original"}]
            ),
        )
        for i in range(N)
    ]
    write_parquet(schemas.from_rows(rows, schemas.PROMPTS), path)
    return path


def job_args(tmp_path: Path, fs: FaultServer, journal: str, out: str) -> dict:
    return {
        "prompts": str(tmp_path / "p.parquet"),
        "out": str(tmp_path / out),
        "journal": str(tmp_path / journal),
        "generation": dict(
            backends=["fault"],
            mode="last",
            extra_body={},
            max_retries=12,
            retry_initial_s=0.01,
            retry_max_s=0.05,
            **SAMPLING,
        ),
        "backends": {
            "fault": dict(
                type="openrouter",
                base_url=fs.url + "/v1",
                model="vendor/model",
                api_key_env=None,
                max_concurrency=CONC,
                timeout_s=5.0,
            )
        },
    }


def start_job(args: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def journal_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def sent_body_hash(rec: dict) -> str:
    """The fault server's hash of the request that produced a journaled record."""
    return body_hash({"messages": json.loads(rec["messages"]), **SAMPLING})


def final_set(path: Path) -> set[tuple]:
    return {
        (r["sample_id"], r["turn"], r["request_key"], r["status"], r["content"], r["completion_tokens"])
        for r in pq.read_table(path).to_pylist()
    }


@pytest.fixture
def fs():
    with FaultServer(FAULTS) as server:
        yield server


def test_kill9_three_points_then_rerun(tmp_path, fs):
    write_prompts(tmp_path / "p.parquet")

    # reference: one uninterrupted run (own journal)
    ref = start_job(job_args(tmp_path, fs, "journal_ref", "ref.parquet"))
    out, _ = ref.communicate(timeout=60)
    assert ref.returncode == 0, out.decode()[-3000:]
    reference = final_set(tmp_path / "ref.parquet")
    assert len(reference) == N and {r[3] for r in reference} == {"ok"}

    fs.app.reset()
    jfile = journal_path(tmp_path / "journal", "ds", "000")
    args = job_args(tmp_path, fs, "journal", "out.parquet")
    kills = []
    for at in (10, N // 2, N - 25):  # early, middle, late: journal lines written before the kill
        before = journal_lines(jfile)
        assert before < at, (before, at)
        proc = start_job(args)
        deadline = time.monotonic() + 30
        while journal_lines(jfile) < at:
            assert proc.poll() is None, f"job ended before the kill point {at}: {proc.stdout.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "journal did not grow"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        assert not (tmp_path / "out.parquet").exists()
        time.sleep(0.1)  # let the server notice the dropped connections
        served = dict(fs.stats()["completed_by_body"])
        recs, st = read_journal(tmp_path / "journal", "ds")
        assert st["duplicates"] == 0
        journaled = {sent_body_hash(r) for r in recs.values()}
        assert journaled <= set(served)  # everything journaled was really served
        # answered by the server during this run but never received (journaled) by the client: in flight
        prev_served = kills[-1]["served"] if kills else {}
        prev_journaled = kills[-1]["journaled"] if kills else set()
        lost = set()
        for b, n in served.items():
            extra = n - prev_served.get(b, 0) - (b in journaled and b not in prev_journaled)
            assert extra in (0, 1), (at, b, extra)
            if extra:
                lost.add(b)
        assert len(lost) <= CONC  # at most what was in flight
        kills.append(
            {
                "at": at,
                "journal": len(recs),
                "served": served,
                "journaled": journaled,
                "lost": lost,
                "bad_lines": st["bad_lines"],
            }
        )

    assert kills[0]["journal"] < kills[1]["journal"] < kills[2]["journal"] < N  # three distinct points
    final = start_job(args)
    out, _ = final.communicate(timeout=60)
    assert final.returncode == 0, out.decode()[-3000:]

    # same final set (ids, turns, keys, statuses, content) as the uninterrupted run
    assert final_set(tmp_path / "out.parquet") == reference
    recs, st = read_journal(tmp_path / "journal", "ds")
    assert len(recs) == N and st["duplicates"] == 0 and st["bad_lines"] <= 3

    # the server's counter: nothing journaled at a kill was completed again afterwards
    counts = fs.stats()["completed_by_body"]
    assert set(counts) == {sent_body_hash(r) for r in recs.values()}
    for k in kills:
        for b in k["journaled"]:
            assert counts[b] == k["served"][b], (k["at"], b)
    # a body completed twice was in flight (served, not journaled) at one of the kills, once per such kill
    for b, n in counts.items():
        assert n == 1 + sum(b in k["lost"] for k in kills), (b, n)


def test_sigterm_mid_run_stops_cleanly_and_the_rerun_completes(tmp_path, fs):
    """SIGTERM while requests are in flight (snakemake's way to stop a job) ends in one line saying how to resume
    (GenerationInterrupted through errors.run_stage: exit code 130, no traceback, no ExceptionGroup); the journal
    keeps what arrived and a rerun sends only the rest."""
    write_prompts(tmp_path / "p.parquet")
    jfile = journal_path(tmp_path / "journal", "ds", "000")
    args = job_args(tmp_path, fs, "journal", "out.parquet")
    proc = start_job(args)
    deadline = time.monotonic() + 30
    while journal_lines(jfile) < 40:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 130, out[-2000:]
    recs, st = read_journal(tmp_path / "journal", "ds")
    last = out.strip().splitlines()[-1]
    assert last.endswith(
        f"ERROR eagle3_data: [ds/000] interrupted. Rerun the same command to resume; {len(recs)} "
        "responses of ds are journaled and will not be requested again"
    ), out[-2000:]
    assert "Traceback" not in out and "ExceptionGroup" not in out and not (tmp_path / "out.parquet").exists()
    assert not list(tmp_path.glob(".out.parquet.*.tmp"))  # the partial output was removed
    assert 40 <= len(recs) < N and st["bad_lines"] == 0
    rerun = start_job(args)
    assert rerun.wait(60) == 0, rerun.stdout.read().decode()[-2000:]
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert len(rows) == N and len({r["request_key"] for r in rows}) == N
    assert all(
        rows_r["content"] == recs[rows_r["request_key"]]["content"] for rows_r in rows if rows_r["request_key"] in recs
    )  # journaled responses come back unchanged
