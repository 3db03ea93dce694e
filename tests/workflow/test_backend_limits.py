"""One limit per backend per machine: a backend's request slots are named by the backend (base URL, model, API key
variable), not by the run, so two ``snakemake`` runs in one workdir, or in two workdirs, never have more than its
``max_concurrency`` in flight together (counted at the fault server), and a killed run leaves nothing that makes
another run's jobs fail: its orphaned generate jobs end as usual (no traceback) while the next run starts.

Every test has its own limits directory (``EAGLE3_LIMITS_DIR``: the ``limits_dir`` fixture of conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing.workflow import copy_workflow, snakemake_env

from eagle3_data.backends import BackendConfig
from eagle3_data.backends.limits import HostSlots, backend_identity, host_slots

LIMIT = 4


def backend(fs_url: str = "http://127.0.0.1:9", **kw) -> dict:
    b = {
        "type": "openrouter",
        "base_url": f"{fs_url}/v1",
        "model": "vendor/model",
        "api_key_env": None,
        "max_concurrency": LIMIT,
        "timeout_s": 20,
    }
    b.update(kw)
    return b


# -------------------------------------------------------------------------------------------------- the slots


def test_slots_are_named_by_the_backend_never_by_its_key(limits_dir, monkeypatch):
    monkeypatch.setenv("FAKE_KEY_VAR", "sk-or-v1-CANARY-limits")
    a = BackendConfig.from_dict("a", backend(api_key_env="FAKE_KEY_VAR"))
    b = BackendConfig.from_dict("renamed", backend(api_key_env="FAKE_KEY_VAR", timeout_s=5))  # same backend
    c = BackendConfig.from_dict("a", backend(api_key_env="OTHER_KEY_VAR"))  # another account
    d = BackendConfig.from_dict("a", backend(model="vendor/other"))
    assert backend_identity(a) == backend_identity(b)
    assert len({backend_identity(x) for x in (a, c, d)}) == 3
    sa, sb, sc = host_slots(a), host_slots(b), host_slots(c)
    assert sa.path == sb.path == limits_dir / f"{backend_identity(a)}.sem" and sa.semid == sb.semid != sc.semid
    assert sa.try_take() and sb.try_take() and sa.free() == LIMIT - 2 and sc.free() == LIMIT
    rec = json.loads(sa.path.read_text())
    assert rec["api_key_env"] == "FAKE_KEY_VAR" and rec["limit"] == LIMIT and rec["base_url"] == a.base_url
    assert not any(b"CANARY" in p.read_bytes() for p in limits_dir.iterdir() if p.is_file())
    for s in (sa, sb, sc):
        s.register(False)
    assert sa.free() == -1 and sc.free() == -1 and not list(limits_dir.glob("*.sem"))  # the last one out removed it


def test_a_set_in_use_keeps_its_limit_and_one_nobody_uses_takes_the_new_one(limits_dir):
    first = HostSlots(limits_dir / "b.sem", 3)
    second = HostSlots(limits_dir / "b.sem", 10)  # another config of the same backend, while the first runs
    assert second.limit == 3 and second.fair_share() == 2 and first.fair_share() == 2
    second.register(False)
    first.register(False)
    assert HostSlots(limits_dir / "b.sem", 10).free() == 10


def test_a_set_removed_under_a_job_is_attached_again_without_exceeding_the_limit(limits_dir):
    """A set removed while a job holds slots (``ipcrm``, or an older release's onstart removing a dead run's sets):
    the job's next operation attaches to a new set and takes its held slots from it, never raising."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from eagle3_data.backends.limits import HostSlots\n"
                f"s = HostSlots({str(limits_dir / 'b.sem')!r}, 3)\n"
                "assert s.try_take() and s.try_take(); print('held', flush=True); sys.stdin.readline()\n"
                "s.give(); print(s.free(), s.try_take(), s.try_take(), flush=True); sys.stdin.readline()\n"
                "s.register(False); print('out', flush=True)"
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert HostSlots.remove_all(limits_dir) == 1
        mine = HostSlots(limits_dir / "b.sem", 3)  # a job starting now makes a new set with all 3 free
        assert mine.free() == 3 and mine.try_take()
        holder.stdin.write("\n")
        holder.stdin.flush()
        # the holder re-took what it could (2 of the 2 free) then gave one back: 1 free; it takes that one, no more
        assert holder.stdout.readline().split() == ["1", "True", "False"]
        assert mine.free() == 0 and mine.users() == 2
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "out"
        assert holder.wait(10) == 0, holder.stderr.read()
        assert "Traceback" not in holder.stderr.read()
        assert mine.free() == 2 and mine.users() == 1
    finally:
        holder.kill()


# -------------------------------------------------------------------------------------------------- workflow runs


def write_sharegpt(path: Path, n: int, tag: str) -> Path:
    rows = [
        {
            "id": f"{tag}-{i}",
            "conversations": [
                {"from": "human", "value": f"{tag} question number {i}?"},
                {"from": "gpt", "value": "an answer"},
            ],
        }
        for i in range(n)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


def workdir(path: Path, fs, datasets: dict[str, int], *, shards: int = 1) -> Path:
    """A workflow copy whose config generates ``datasets`` (name -> samples) through the fault server at LIMIT."""
    from eagle3_data.tiny_target import build_tokenizer

    wd = copy_workflow(path)
    # the target's tokenizer and chat template (checked before any job runs; generate itself never loads it)
    build_tokenizer().save_pretrained(wd / "results" / "target" / "tokenizer")
    conf = {
        "cache_dir": "cache",
        "target": {"name": "t", "path": "results/target/tokenizer", "build_tiny": False, "template": "generic"},
        "vocab": {"draft_vocab_size": 256},
        "backends": {"fault": backend(fs.url)},
        "generation": {"backends": ["fault"], "max_tokens": 30, "temperature": 1.0, "top_p": 1.0, "max_retries": 3},
        "datasets": {
            ds: {
                "source": {"format": "sharegpt", "path": str(write_sharegpt(wd / "src" / f"{ds}.json", n, ds))},
                "shards": shards,
            }
            for ds, n in datasets.items()
        },
    }
    (wd / "limits.yaml").write_text(yaml.safe_dump(conf))
    return wd


def responses(ds: str, shards: int = 1) -> list[str]:
    return [f"results/{ds}/responses/{s:03d}.parquet" for s in range(shards)]


def start(wd: Path, *targets: str, out: Path | None = None) -> subprocess.Popen:
    out = out or wd / "snakemake.out"
    fh = open(out, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "1", *targets, "--configfile", "limits.yaml"],
            cwd=wd,
            env=snakemake_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    finally:
        fh.close()


def finish(proc: subprocess.Popen, wd: Path, timeout: float = 600) -> None:
    assert proc.wait(timeout) == 0, (wd / "snakemake.out").read_text()[-5000:]


def rows(wd: Path, target: str) -> int:
    return pq.read_table(wd / target).num_rows


def wait_for(cond, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{what}: a run ended first"
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("layout", ["one workdir", "two workdirs"])
def test_two_runs_never_exceed_the_backend_limit_together(tmp_path, fs, layout):
    """Two concurrent runs (different targets; one workdir or two) on one backend: the server never sees more than
    its max_concurrency in flight, and reaches it (both runs' requests interleave)."""
    fs.app.config.update({"latency_min_s": 0.4, "latency_max_s": 0.4})
    n = 120  # 12 s of requests per run alone at the limit: longer than a run's start
    wd_a = workdir(tmp_path / "a", fs, {"ds_a": n, "ds_b": n})
    wd_b = wd_a if layout == "one workdir" else workdir(tmp_path / "b", fs, {"ds_a": n, "ds_b": n})
    run_a = start(wd_a, *responses("ds_a"), out=wd_a / "a.out")
    run_b = start(wd_b, *responses("ds_b"), out=wd_b / "b.out")
    for p, wd, name in ((run_a, wd_a, "a.out"), (run_b, wd_b, "b.out")):
        assert p.wait(600) == 0, (wd / name).read_text()[-5000:]
    assert rows(wd_a, responses("ds_a")[0]) == n and rows(wd_b, responses("ds_b")[0]) == n
    st = fs.stats()
    assert st["completed"] == 2 * n
    assert st["max_in_flight"] == LIMIT, st  # the limit held over both runs, and was reached
    # both runs' requests were answered while the other's were (the second run did not wait for the first)
    spans = []
    for wd, ds in ((wd_a, "ds_a"), (wd_b, "ds_b")):
        t = sorted(
            json.loads(line)["completed_at"]
            for line in (wd / "cache" / "journal" / ds / "000.jsonl").read_text().splitlines()
        )
        spans.append((t[0], t[-1]))
    assert spans[1][0] < spans[0][1], spans


def test_orphaned_jobs_of_a_killed_run_end_cleanly_beside_the_next_run(tmp_path, fs):
    """``kill -9`` of snakemake while its generate jobs send: the orphaned jobs stop (their owner is gone) without a
    traceback while the next run in the same workdir (after ``--unlock``) sends beside them within the limit; the
    same command again then sends only what was not journaled."""
    fs.app.config.update({"latency_min_s": 0.3, "latency_max_s": 0.3})
    n = 240  # 18 s of requests at the limit: the orphans still send when the next run's jobs do
    wd = workdir(tmp_path / "w", fs, {"ds_a": n, "ds_b": 20}, shards=2)
    run_a = start(wd, *responses("ds_a", 2), out=wd / "a.out")
    # both of A's generate jobs are sending (each has answers journaled)
    journals = [wd / "cache" / "journal" / "ds_a" / f"00{s}.jsonl" for s in range(2)]
    wait_for(lambda: all(j.exists() and j.stat().st_size for j in journals), 300, "run A's jobs sending", [run_a])
    os.kill(run_a.pid, signal.SIGKILL)
    run_a.wait(10)
    assert fs.stats()["completed"] < 2 * n - 2 * LIMIT  # the orphans have most of their requests still to send
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--unlock", "--configfile", "limits.yaml"],
        cwd=wd,
        env=snakemake_env(),
        check=True,
        capture_output=True,
    )
    run_b = start(wd, *responses("ds_b", 2), out=wd / "b.out")
    assert run_b.wait(600) == 0, (wd / "b.out").read_text()[-5000:]
    # stop means stop (issue 22): the orphans see their snakemake gone, start no new request, journal what arrives
    # and end without a traceback, beside run B
    wait_for(lambda: fs.stats()["in_flight"] == 0, 60, "the orphans' last requests")
    assert sum(rows(wd, t) for t in responses("ds_b", 2)) == 20
    journaled = sum(j.read_text().count("\n") for j in (wd / "cache" / "journal" / "ds_a").glob("*.jsonl"))
    assert 0 < journaled < n
    before = fs.stats()["completed"]
    rerun = start(wd, *responses("ds_a", 2), out=wd / "a2.out")  # the same command again: it resumes
    assert rerun.wait(600) == 0, (wd / "a2.out").read_text()[-5000:]
    assert sum(rows(wd, t) for t in responses("ds_a", 2)) == n
    st = fs.stats()
    assert st["max_in_flight"] <= LIMIT and st["completed"] - before == n - journaled, (st, before, journaled)
    texts = [(wd / name).read_text() for name in ("a.out", "b.out", "a2.out")]
    texts += [p.read_text() for p in (wd / "logs" / "generate").rglob("*.log")]
    assert not any("Traceback" in t or "Errno" in t for t in texts), texts
