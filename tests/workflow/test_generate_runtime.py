"""The generation runtime: request slots shared by a run's jobs, dead backends taken out fast and named, error
texts kept, and expected failures reported as one line (eagle3_data.errors)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from test_generate import backends_cfg, gen_cfg, run, simple_convs, write_prompts

from eagle3_data import config as cfg
from eagle3_data.backends import BackendConfig
from eagle3_data.backends.limits import HostSlots, host_slots, job_limit, jobs_using, sharing_mode
from eagle3_data.errors import ExpectedFailure, Interrupted, format_failure
from eagle3_data.generate import GenerationStopped
from eagle3_data.generate.journal import read_journal
from eagle3_data.runtime.run import Owner, Run

CHILD = r"""
import json, sys
from eagle3_data.errors import run_stage
from eagle3_data.generate import generate
from eagle3_data.logs import setup_logging
a = json.loads(sys.argv[1])
log = setup_logging(a.get("log"))
from eagle3_data.settings import GenerateSettings
settings = GenerateSettings.defaults(dataset=a.get("dataset", "ds"), target_name="tiny-target",
                                     generation=a["generation"], backends=a["backends"], journal_dir=a["journal"],
                                     backend_jobs=a.get("backend_jobs"))
run_stage(lambda: generate(a["prompts"], a["out"], settings, shard=a["shard"], progress_interval_s=0.5), log=log)
"""


def run_env(tmp_path: Path) -> dict:
    """The environment of a job of a workflow run owned by this test process (as the Snakefile would set it)."""
    return {**os.environ, "EAGLE3_RUN_DIR": str(tmp_path / "run"), "EAGLE3_RUN_OWNER": str(Owner.me())}


def job(args: dict, env: dict | None = None) -> subprocess.Popen:
    """A generate job as the script runs it (errors.run_stage), Ctrl-C as from a terminal (SIGINT not ignored)."""
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


# ---------------------------------------------------------------------------------------------------------------
# shared request slots


def test_host_slots_are_shared_and_returned_when_a_holder_dies(tmp_path):
    slots = HostSlots(tmp_path / "b.sem", 3)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from eagle3_data.backends.limits import HostSlots\n"
                f"s = HostSlots({str(tmp_path / 'b.sem')!r}, 3)\n"
                "assert s.try_take() and s.try_take(); print('held', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert slots.free() == 1
        assert slots.try_take() and not slots.try_take()  # the third slot; none left over both processes
        holder.kill()  # SIGKILL: the kernel gives its 2 slots back
        holder.wait(10)
        assert slots.free() == 2
        slots.give()
        assert slots.free() == 3
    finally:
        holder.kill()
    assert HostSlots.remove_all(tmp_path) == 1 and slots.free() == -1


def test_job_limits_by_mode():
    assert sharing_mode(None, {}) == "job" and sharing_mode(Run(Path("/x"), Owner.me()), {}) == "host"
    assert sharing_mode(Run(Path("/x"), Owner.me()), {"EAGLE3_CONCURRENCY": "split"}) == "split"
    assert (
        job_limit(2000, "host", 16) == 2000 and job_limit(2000, "split", 16) == 125 and job_limit(5, "split", 16) == 1
    )
    cfg = {
        "generation": {"backends": ["a"]},
        "datasets": {
            "x": {"source": {"format": "sharegpt"}, "shards": 4},
            "y": {"source": {"format": "sharegpt"}, "shards": 2, "generation": {"backends": ["b", "a"]}},
            "z": {"source": {"format": "pretokenized"}, "shards": 8},
        },
    }
    assert jobs_using(cfg, "a") == 6 and jobs_using(cfg, "b") == 2


def test_jobs_of_a_run_share_the_backend_limit(tmp_path, fs):
    """Three concurrent jobs of one run, each allowed the backend's whole max_concurrency (6): together they never
    have more than 6 requests in flight, the limit is reached, and the jobs' requests interleave (not one job
    after another)."""
    fs.app.config.update({"latency_min_s": 0.15, "latency_max_s": 0.15})
    env = run_env(tmp_path)
    procs = []
    for i in range(3):
        prompts = write_prompts(tmp_path / f"p{i}.parquet", simple_convs(60, start=100 * i))
        procs.append(
            job(
                {
                    "prompts": str(prompts),
                    "out": str(tmp_path / f"o{i}.parquet"),
                    "shard": f"00{i}",
                    "generation": gen_cfg(),
                    "backends": backends_cfg(fs, max_concurrency=6, timeout_s=10),
                    "journal": str(tmp_path / "journal"),
                },
                env,
            )
        )
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all("at most 6 request(s) in flight from this job, 6 over all jobs on this machine" in o for o in outs)
    assert fs.stats()["max_in_flight"] == 6 and fs.stats()["completed"] == 180
    recs, _ = read_journal(tmp_path / "journal", "ds", fields=("completed_at",))
    spans = []
    for i in range(3):
        times = sorted(
            json.loads(line)["completed_at"]
            for line in (tmp_path / "journal" / "ds" / f"00{i}.jsonl").read_text().splitlines()
        )
        spans.append((times[0], times[-1]))
    for a in spans:  # every job was answered while the others were
        for b in spans:
            assert a[0] < b[1] and b[0] < a[1], spans


# ---------------------------------------------------------------------------------------------------------------
# dead backends, error texts


def test_refusing_backend_stops_the_job_within_its_bound(tmp_path):
    from eagle3_data.backends import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    bk = {
        "local": dict(
            type="openai", base_url=url, model="m", api_key_env=None, max_concurrency=4, timeout_s=5, down_after_s=2
        )
    }
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(28))
    t0 = time.monotonic()
    with pytest.raises(GenerationStopped) as ei:
        run(tmp_path, None, prompts, gen=gen_cfg(backends=["local"], max_retries=50, retry_max_s=0.5), bk=bk)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert 2 <= took < 12, took
    assert re.match(
        rf"\[ds/000\] backend 'local' \({re.escape(url)}\) refused connections for [2-9] s \(\d+ attempts, "
        r"none succeeded; backends.local.down_after_s is 2\); ",
        msg,
    ), msg
    assert "last error: connection_error: ConnectError: " in msg and "(Connection refused)" in msg
    assert msg.endswith(
        "Start the server or fix the backend's base_url, then rerun the same command; 0 responses "
        "of ds are journaled and will not be requested again"
    )
    assert not (tmp_path / "out.parquet").exists()


def test_backend_answering_only_5xx_is_taken_out_and_named(tmp_path, fs):
    fs.app.config.update({"p5xx": 1.0})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(20))
    t0 = time.monotonic()
    with pytest.raises(GenerationStopped) as ei:
        run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=100, retry_max_s=0.3), bk=backends_cfg(fs, down_after_s=1.5))
    assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert re.search(rf"backend 'fault' \({re.escape(fs.url)}/v1\) answered only HTTP 5xx for [1-9] s", msg), msg
    assert "last error: http_50" in msg and "provider error" in msg  # the server's own words


def test_a_dead_backend_of_two_is_taken_out_and_the_job_finishes_on_the_other(tmp_path, fs, caplog):
    from eagle3_data.backends import free_port

    dead = {
        "dead": dict(
            type="openai",
            base_url=f"http://127.0.0.1:{free_port()}/v1",
            model="x",
            api_key_env=None,
            max_concurrency=4,
            timeout_s=1.0,
            down_after_s=1,
        )
    }
    fs.app.config.update({"latency_min_s": 0.1, "latency_max_s": 0.1})
    bk = {**dead, **backends_cfg(fs, name="live", max_concurrency=2)}
    with caplog.at_level("WARNING", logger="eagle3_data"):
        s = run(
            tmp_path,
            fs,
            write_prompts(tmp_path / "p.parquet", simple_convs(50)),
            gen=gen_cfg(backends=["dead", "live"], max_retries=30),
            bk=bk,
        )
    assert s["ok"] == 50 and s["by_backend"] == {"live": 50}
    assert any(
        "backend dead (http://127.0.0.1:" in r.getMessage()
        and "is out for this job: it refused connections" in r.getMessage()
        for r in caplog.records
    )


def test_4xx_bodies_and_openrouter_metadata_are_kept_key_scrubbed(tmp_path, fs, monkeypatch, caplog):
    key = "sk-or-CANARY-4xx-1234567"
    monkeypatch.setenv("E3D_4XX_KEY", key)
    raw = json.dumps({"error": {"message": f"'kimi-k2.5x' is not a valid model ID (key {key})"}})
    fs.app.config.update(
        {
            "fail_after": 3,
            "fail_status": 400,
            "fail_body": {
                "error": {
                    "code": 400,
                    "message": "Provider returned error",
                    "metadata": {"raw": raw, "provider_name": "Moonshot AI"},
                }
            },
        }
    )
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(8))
    with caplog.at_level("WARNING", logger="eagle3_data"):
        s = run(tmp_path, fs, prompts, bk=backends_cfg(fs, api_key_env="E3D_4XX_KEY", max_concurrency=1))
    assert s["ok"] == 3 and s["failed"] == {"http_400": 5}
    failed = [r for r in pq.read_table(tmp_path / "out.parquet").to_pylist() if r["status"] == "failed"]
    assert len(failed) == 5
    for r in failed:
        assert r["error"].startswith("http_400: Provider returned error; provider Moonshot AI; raw: ")
        assert "is not a valid model ID (key [api key])" in r["error"] and key not in r["error"]
        assert r["error"].endswith("(backend fault, after 1 attempt(s))")
    logged = [r.getMessage() for r in caplog.records if "failed: http_400" in r.getMessage()]
    assert len(logged) == 3 and all("not a valid model ID" in m and key not in m for m in logged)


def test_every_request_failed_names_the_last_error(tmp_path, fs):
    fs.app.config.update(
        {"fail_after": 0, "fail_status": 400, "fail_body": {"detail": "Server is pinned to 'results/target/tiny-kimi'"}}
    )
    with pytest.raises(GenerationStopped) as ei:
        run(tmp_path, fs, write_prompts(tmp_path / "p.parquet", simple_convs(4)))
    assert str(ei.value).startswith(
        "[ds/000] every request failed (4 of 4 requests: {'http_400': 4}); last error: http_400: Server "
        "is pinned to 'results/target/tiny-kimi' (backend fault, after 1 attempt(s))"
    )


# ---------------------------------------------------------------------------------------------------------------
# one line per expected failure


def test_missing_key_at_job_start_is_one_line_without_traceback(tmp_path, fs):
    env = {k: v for k, v in os.environ.items() if k != "E3D_UNSET_KEY"}
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(3))
    p = job(
        {
            "prompts": str(prompts),
            "out": str(tmp_path / "o.parquet"),
            "shard": "000",
            "generation": gen_cfg(),
            "backends": backends_cfg(fs, api_key_env="E3D_UNSET_KEY"),
            "journal": str(tmp_path / "journal"),
            "log": str(tmp_path / "job.log"),
        },
        env,
    )
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 1
    lines = [ln for ln in out.splitlines() if "ERROR" in ln]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert lines[0].endswith(
        "ERROR eagle3_data: [ds/000] backend 'fault': environment variable E3D_UNSET_KEY "
        "(api_key_env) is not set or empty. Export E3D_UNSET_KEY=<your key> and rerun the same "
        "command; 0 responses of ds are journaled and will not be requested again"
    )
    log = (tmp_path / "job.log").read_text()
    assert log.count("ERROR") == 1 and lines[0] in log
    assert fs.stats()["requests"] == 0


def test_run_stage_reports_expected_failures_once_and_bugs_with_their_traceback(tmp_path):
    code = r"""
import sys
from eagle3_data.errors import ExpectedFailure, run_stage
from eagle3_data.logs import setup_logging
log = setup_logging(sys.argv[2])
def fail():
    if sys.argv[1] == "expected":
        raise ExpectedFailure("datasets.x.source.path: nope.jsonl does not exist", hint="fix the path")
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
    return {}["bug"]
run_stage(fail, log=log)
"""
    res = {}
    for kind in ("expected", "interrupt", "bug"):
        p = subprocess.run(
            [sys.executable, "-c", code, kind, str(tmp_path / f"{kind}.log")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        res[kind] = (p.returncode, p.stderr, (tmp_path / f"{kind}.log").read_text())
    rc, err, log = res["expected"]
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.strip().endswith("ERROR eagle3_data: datasets.x.source.path: nope.jsonl does not exist. Fix the path")
    header, line = log.splitlines()
    assert line + "\n" == err and header.startswith("===== ")
    assert header.endswith(": attempt 1 of this job =====")
    rc, err, log = res["interrupt"]
    assert rc == 130 and err.strip().endswith("ERROR eagle3_data: interrupted. Rerun the same command to resume")
    rc, err, log = res["bug"]
    assert rc == 1 and err.count("Traceback") == 1 and "KeyError: 'bug'" in err and log.count("Traceback") == 1


def test_a_job_log_keeps_every_attempt(tmp_path):
    """Snakemake deletes a job's log before each attempt; the log still opens with the earlier attempts, each
    below a line naming it: an outage's history is kept."""
    import logging

    from eagle3_data.logs import ATTEMPT_RE, attempts_path, last_attempt, setup_logging

    path = tmp_path / "000.log"
    for attempt in ("first", "second", "third"):
        path.unlink(missing_ok=True)  # what snakemake does before it runs the job (Job.remove_existing_output)
        log = setup_logging(str(path))
        log.info("the %s attempt", attempt)
        for h in log.handlers:
            h.flush()
    lines = path.read_text().splitlines()
    assert [m.group(1) if (m := ATTEMPT_RE.match(ln)) else None for ln in lines] == ["1", None, "2", None, "3", None]
    assert lines[0].endswith(": attempt 1 of this job =====")
    assert lines[4].endswith(": attempt 3 of this job (earlier ones above) =====")
    assert [ln.split(": ", 1)[1] for ln in lines[1::2]] == [
        "the first attempt",
        "the second attempt",
        "the third attempt",
    ]
    assert attempts_path(path).read_text() == path.read_text() and attempts_path(path).name == ".000.log.attempts"
    assert [ln.split(": ", 1)[1] for ln in last_attempt(lines)] == ["the third attempt"]
    # called twice without a deletion in between (one process, or a script run by hand): nothing repeated
    log = setup_logging(str(path))
    log.info("a fourth")
    for h in log.handlers:
        h.flush()
    assert path.read_text().count("the first attempt") == 1 and path.read_text().splitlines()[-2].startswith("=====")
    logging.getLogger("eagle3_data").handlers.clear()


def test_format_failure():
    assert format_failure(ExpectedFailure("a thing broke", hint="do this")) == "a thing broke. Do this"
    assert format_failure(ExpectedFailure("it stopped.", hint="rerun")) == "it stopped. Rerun"
    assert str(Interrupted("interrupted")) == "interrupted" and Interrupted("x").exit_code == 130


def test_interrupt_inside_a_workflow_run_goes_to_the_log_file_only(tmp_path):
    """Ctrl-C reaches every job of a run: each writes its line to its log file; the run prints one line for all."""
    code = r"""
import sys
from eagle3_data.errors import run_stage
from eagle3_data.logs import setup_logging
log = setup_logging(sys.argv[1])
def work():
    raise KeyboardInterrupt
run_stage(work, log=log)
"""
    env = run_env(tmp_path)
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "j.log")], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 130 and p.stderr == ""
    assert "interrupted. Rerun the same command to resume" in (tmp_path / "j.log").read_text()


def test_run_end_prints_one_interrupt_line_with_the_journal_count(tmp_path, monkeypatch, capsys):
    """The interrupt line is the run's last words: printed when the snakemake process exits (run.say_last), after
    Snakemake's closing lines; here printed at once (run._print_last_words)."""
    from eagle3_data.runtime import run as run_mod

    monkeypatch.setattr(run_mod, "_said", [True])  # no exit hook in the test process

    def end(*args, **kw):
        run_mod.end(*args, **kw)
        run_mod._print_last_words()

    journal = tmp_path / "cache" / "journal" / "ds"
    journal.mkdir(parents=True)
    (journal / "000.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    (journal / "001.jsonl").write_text('{"a": 4}\n{"torn')
    monkeypatch.setattr(run_mod, "_signals", {"SIGINT": True})
    monkeypatch.delenv("EAGLE3_RUN_DIR", raising=False)
    end(tmp_path / "cache", ok=False)
    err = capsys.readouterr().err
    assert err == (
        f"Interrupted (Ctrl-C). Rerun the same command to resume; 4 responses of this config are "
        "journaled in "
        f"{tmp_path / 'cache' / 'journal'}/ and will not be requested again.\n"
    )
    # this config's datasets only: another config's journal is not "reusable"
    (tmp_path / "cache" / "journal" / "other").mkdir()
    (tmp_path / "cache" / "journal" / "other" / "000.jsonl").write_text('{"a": 5}\n' * 10)
    end(tmp_path / "cache", ok=False, datasets=["ds"])
    assert " 4 responses of this config " in capsys.readouterr().err
    monkeypatch.setattr(run_mod, "_signals", {})
    end(tmp_path / "cache", ok=False, logs_dir=tmp_path / "logs")  # a failure without a job's error: no line
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_host_slots_come_back_after_an_interrupted_job(tmp_path, fs, sig):
    """A job stopped mid-run gives its slots back (SEM_UNDO / aclose): the next job has the whole limit."""
    fs.app.config.update({"latency_min_s": 0.3, "latency_max_s": 0.3})
    env = run_env(tmp_path)
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(200))
    args = {
        "prompts": str(prompts),
        "out": str(tmp_path / "o.parquet"),
        "shard": "000",
        "generation": gen_cfg(),
        "backends": backends_cfg(fs, max_concurrency=5, timeout_s=10),
        "journal": str(tmp_path / "journal"),
    }
    watch = host_slots(BackendConfig.from_dict("fault", args["backends"]["fault"]))  # the machine's slots
    p = job(args, env)
    deadline = time.monotonic() + 60
    while fs.stats()["completed"] < 10:
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert watch.free() == 0 and watch.users() == 2  # the job holds all 5 (200 requests wait)
    p.send_signal(sig)
    assert p.wait(30) == 130
    assert watch.free() == 5 and watch.users() == 1


def test_rejects_report_shows_the_error_text(tmp_path):
    """A request's error text (here OpenRouter's raw provider message) reaches the rejects report."""
    import csv

    from eagle3_data import schemas
    from eagle3_data.files import write_parquet
    from eagle3_data.report import tally

    text = (
        'http_400: Provider returned error; provider Moonshot AI; raw: {"error": "not a valid model ID"} '
        "(backend openrouter, after 1 attempt(s))"
    )
    rows = [
        dict(sample_id=f"s{i}", dataset="ds", stage="generate", reason="http_400", detail=text, source_row=i)
        for i in range(3)
    ] + [dict(sample_id="t", dataset="ds", stage="validate", reason="truncated", detail=None, source_row=9)]
    write_parquet(schemas.from_rows(rows, schemas.REJECTS), tmp_path / "rej.parquet")
    tally([], [tmp_path / "rej.parquet"], [], tmp_path / "r", datasets_config={"ds": {}}, backends={})
    with open(tmp_path / "r" / "rejects.csv") as fh:
        rej = {r["reason"]: r for r in csv.DictReader(fh)}
    assert rej["http_400"]["count"] == "3" and rej["http_400"]["example"] == text
    assert rej["truncated"]["example"] == ""
    md = (tmp_path / "r" / "tally.md").read_text()
    cells = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines() if line.startswith("|")
    ]
    row = next(c for c in cells if c[:3] == ["ds", "generate", "http_400"])
    assert row[3] == "3" and row[4].startswith("http_400: Provider returned error; provider Moonshot AI; raw:"), row


WAITING_SNAKEFILE = """
from eagle3_data.runtime import run as run_state

rule all:
    input: expand("out/{i}.txt", i=range(12))

rule wait:
    output: "out/{i}.txt"
    threads: 0
    resources: generate_jobs=1
    shell: "echo start $(date +%s.%N) >> log; sleep 3; echo end $(date +%s.%N) >> log; touch {output}"

onstart:
    if WIDEN:
        print("workers:", run_state.widen_local_workers(workflow, 12))
"""


def _run_waiting_jobs(wd: Path, generate_jobs: int, env: dict | None = None) -> tuple:
    """Run the Snakefile in ``wd`` (jobs logging their start and end to ``log``) on 1 core with
    ``generate_jobs`` seats; return (the finished process, the most jobs that ran at once)."""
    from eagle3_data.testing.workflow import snakemake_env

    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "--resources", f"generate_jobs={generate_jobs}"],
        cwd=wd,
        env=snakemake_env(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = sorted(
        (float(t), 1 if k == "start" else -1)
        for k, t in (line.split() for line in (wd / "log").read_text().splitlines())
    )
    n = peak = 0
    for _, d in events:
        n += d
        peak = max(peak, n)
    return proc, peak


@pytest.mark.parametrize("widen", [False, True])
def test_jobs_without_threads_get_a_worker_per_generate_seat(tmp_path, widen):
    """Snakemake's local executor runs at most --cores + 5 jobs at once; widen_local_workers (the Snakefile's
    onstart) gives every generate_jobs seat a worker, so 12 waiting jobs run together on 1 core.

    The pin of a patch of Snakemake's internals (no supported setting exists): it fails the day a release moves the
    pool or stops using the widened one (widen=True: fewer jobs at once, ``workers: None``) and the day Snakemake
    gives zero-thread jobs more workers itself (widen=False: more than --cores + 5; the patch can then go)."""
    (tmp_path / "Snakefile").write_text(f"WIDEN = {widen}\n" + WAITING_SNAKEFILE)
    proc, peak = _run_waiting_jobs(tmp_path, 12)
    assert peak == (12 if widen else 1 + 5)
    assert ("workers: 18" in proc.stdout + proc.stderr) == widen  # 1 core + 5 + 12


#: loaded first by every Python of the run (PYTHONPATH): Snakemake with one of its modules' source edited, as a
#: release that renames a private attribute would ship it
RENAMED_SNAKEMAKE = """
import importlib.util, os, sys
mod, old, new = os.environ["EAGLE3_TEST_RENAME"].split("|")
spec = importlib.util.find_spec(mod)
src = open(spec.origin).read()
assert old in src, (mod, old)
m = importlib.util.module_from_spec(spec)
sys.modules[mod] = m
exec(compile(src.replace(old, new), spec.origin, "exec"), m.__dict__)
"""


@pytest.mark.parametrize(
    "rename",
    [
        "snakemake.executors.local|self.pool|self._thread_pool",  # the executor's pool
        "snakemake.scheduling.job_scheduler|self._executor|self._the_executor",  # the scheduler's executor
    ],
)
def test_widening_the_workers_fails_loudly_on_a_snakemake_that_moved_them(tmp_path, rename):
    """The worker-pool patch has no supported replacement in Snakemake 9 (widen_local_workers says why). Where a
    release moves what it replaces, the run says so on the console and the pin above fails (fewer jobs at once):
    here a Snakemake whose source has the attribute renamed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RENAMED_SNAKEMAKE)
    wd = tmp_path / "w"
    wd.mkdir()
    (wd / "Snakefile").write_text("WIDEN = True\n" + WAITING_SNAKEFILE)
    proc, peak = _run_waiting_jobs(wd, 12, {"PYTHONPATH": str(site), "EAGLE3_TEST_RENAME": rename})
    out = proc.stdout + proc.stderr
    assert "workers: None" in out and "Warning: Snakemake's local executor has no worker pool to widen" in out, out
    assert peak == 1 + 5


def test_a_job_that_started_with_few_slots_takes_the_slots_others_give_back(tmp_path):
    """Two jobs of a run share 10 slots (two HostSlots on one semaphore stand for two processes). Job A holds all
    10; job B's 20 requests wait. When A's requests end (A has nothing more to send, so it gives its slots back),
    B's waiters take every freed slot: 10 in flight, not the one or two that a release of B's own would pass on."""
    import asyncio

    from eagle3_data.backends import Backend, BackendConfig, BackendPool

    cfg = BackendConfig.from_dict(
        "b", {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", "max_concurrency": 10}
    )

    async def main():
        a = BackendPool([Backend(cfg, slots=HostSlots(tmp_path / "b.sem", 10))])
        b_backend = Backend(cfg, slots=HostSlots(tmp_path / "b.sem", 10))
        b = BackendPool([b_backend])
        held_a = [await a.acquire() for _ in range(10)]
        release = asyncio.Event()
        peak = 0

        async def request():
            nonlocal peak
            async with b.slot():
                peak = max(peak, b_backend.in_flight)
                await release.wait()

        tasks = [asyncio.create_task(request()) for _ in range(20)]
        await asyncio.sleep(0.3)
        assert b_backend.in_flight == 0  # no slot free
        for x in held_a:
            await a.release(x)
        await asyncio.sleep(1.0)  # B polls (every 0.25 s at most) and its waiters pass the turn on
        in_flight = b_backend.in_flight
        release.set()
        await asyncio.gather(*tasks)
        await a.aclose()
        await b.aclose()
        return in_flight, peak

    in_flight, peak = asyncio.run(main())
    assert in_flight == peak == 10
    assert HostSlots.remove_all(tmp_path) == 0 and not (tmp_path / "b.sem").exists()  # the last one out removed it


SEATS_SNAKEFILE = """
from eagle3_data import config as cfg

config = {CONFIG}
SEATS = cfg.backend_job_seats(config, 3)
for b, n in SEATS.items():  # as rules/common.smk registers them
    workflow.register_resource(cfg.seat_resource(b), n)
JOBS = [(ds, s) for ds in config["datasets"] for s in range(config["datasets"][ds]["shards"])]

rule all:
    input: [f"out/{{ds}}.{{s}}.txt" for ds, s in JOBS]

rule wait:
    output: "out/{{ds}}.{{s}}.txt"
    threads: 0
    resources:
        generate_jobs=1,
        **{{cfg.seat_resource(b): (lambda wc, b=b: int(b in cfg.backends_config(config, wc.ds))) for b in SEATS}},
    shell: "echo start $(date +%s.%N) >> log; sleep 3; echo end $(date +%s.%N) >> log; touch {{output}}"
"""


def test_every_shard_runs_at_once_when_the_shards_fit_in_the_generate_seats(tmp_path):
    """Two shards on backend x and one shard of a dataset on x then y (3 jobs, 3 generate seats): x may take all 3
    seats, since no job uses y alone, so the three run together (an even split, 2 seats for x, ran the
    two-backend shard only after an x shard ended)."""
    config = {
        "backends": {"x": {}, "y": {}},
        "generation": {"backends": ["x"]},
        "datasets": {
            "a": {"source": {"format": "sharegpt", "path": "a.json"}, "shards": 2},
            "b": {
                "source": {"format": "sharegpt", "path": "b.json"},
                "shards": 1,
                "generation": {"backends": ["x", "y"]},
            },
        },
    }
    assert cfg.backend_job_seats(config, 3) == {"x": 3, "y": 2}
    (tmp_path / "Snakefile").write_text(SEATS_SNAKEFILE.format(CONFIG=repr(config)))
    assert _run_waiting_jobs(tmp_path, 3)[1] == 3


def test_rate_limits_are_split_over_the_jobs_that_use_the_backend(monkeypatch):
    """requests_per_minute / tokens_per_minute have no counter shared between jobs: in a run (here split mode, as
    on a cluster) each of the 4 jobs on the backend sends at a quarter of them; outside a run a job has them all."""
    from eagle3_data.backends import BackendConfig
    from eagle3_data.generate import backend_pool

    c = BackendConfig.from_dict(
        "b",
        {
            "type": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "model": "m",
            "requests_per_minute": 120,
            "tokens_per_minute": 40_000,
        },
    )
    monkeypatch.setenv("EAGLE3_CONCURRENCY", "split")
    with backend_pool([c], None, {"b": 4}, "[t]") as pool:
        (b,) = pool.backends
        assert (b.limiter.max_rate, b.token_limiter.max_rate, b.tpm) == (30.0, 10_000.0, 10_000.0)
    monkeypatch.delenv("EAGLE3_CONCURRENCY")
    with backend_pool([c], None, {"b": 4}, "[t]") as pool:
        (b,) = pool.backends
        assert (b.limiter.max_rate, b.token_limiter.max_rate) == (120.0, 40_000.0)


def test_a_stale_lock_stops_only_the_commands_that_take_the_lock():
    """After a kill -9 a build (or --report, --touch) stops at the hint, the only line it prints; a dry run, a lint,
    --unlock, --nolock and the other modes without a lock print it and go on (eagle3_data.runtime.run.stale_lock_stops)."""
    from eagle3_data.runtime.run import stale_lock_stops

    assert stale_lock_stops(["snakemake", "--cores", "2", "--configfile", "my.yaml"])
    assert stale_lock_stops(["snakemake", "--report", "report.html"])
    for mode in (
        ["-n"],
        ["--dry-run"],
        ["--lint"],
        ["--unlock"],
        ["--nolock", "--cores", "2"],
        ["--summary"],
        ["--list-changes=code"],
        ["--dag"],
        ["--rulegraph"],
    ):
        assert not stale_lock_stops(["snakemake", *mode, "--configfile", "my.yaml"]), mode
