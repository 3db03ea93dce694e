"""The run-wide view (eagle3_data.runtime.runview) and the last screen from what a stopped or failed run journaled."""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.runtime import runview
from eagle3_data.report import run_summary, run_summary_rows


@dataclass
class FakeState:  # the fields of generate's _State that a snapshot reads
    total: int
    done: int = 0
    ok: int = 0
    not_sent: int = 0
    in_flight: int = 0
    new_ok: int = 0
    from_journal: int = 0
    instant: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    journal_cost_usd: float = 0.0
    budget_usd: float | None = None
    retries: int = 0
    sent: int = 0
    last_error: str | None = None
    last_done_at: float | None = None
    failed: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def spent_usd(self) -> float:
        return self.cost_usd + self.journal_cost_usd


CONFIG = {
    "backends": {"openrouter": {"max_concurrency": 100}, "local": {"max_concurrency": 8}},
    "generation": {"backends": ["openrouter"]},
    "datasets": {
        "a": {"source": {"format": "sharegpt", "path": "x"}, "shards": 2},
        "b": {"source": {"format": "sharegpt", "path": "x"}, "shards": 1, "generation": {"backends": ["local"]}},
        "p": {"source": {"format": "pretokenized", "path": "x"}},
    },
}


def _write(run_dir, ds, shard, **kw):
    st = FakeState(**{k: v for k, v in kw.items() if k not in ("final", "down")})
    snap = runview.snapshot(st, ds, shard, backends=["x"], down=kw.get("down"), final=kw.get("final", False))
    runview.write_snapshot(run_dir, snap)
    return snap


def test_rows_add_up_over_shards_and_a_dead_backend_shows_down(tmp_path):
    now = time.time()
    _write(
        tmp_path,
        "a",
        "000",
        total=50,
        done=20,
        ok=19,
        failed={"http_400": 1},
        in_flight=30,
        completion_tokens=4000,
        cost_usd=1.25,
        budget_usd=5.0,
        last_done_at=now,
        new_ok=19,
    )
    _write(
        tmp_path,
        "a",
        "001",
        total=50,
        done=30,
        ok=30,
        in_flight=40,
        completion_tokens=6000,
        cost_usd=0.75,
        journal_cost_usd=0.5,
        budget_usd=5.0,
        last_done_at=now,
        new_ok=20,
        from_journal=10,
    )
    _write(
        tmp_path,
        "b",
        "000",
        total=10,
        done=2,
        ok=2,
        in_flight=8,
        last_done_at=now - 500,
        last_error="connect_error: refused",
        t0=time.monotonic() - 600,
    )
    view = runview.RunView(CONFIG, tmp_path, stall_s=120)
    rows = {r["backend"]: r for r in view.rows(now)}
    o = rows["openrouter"]
    assert (o["done"], o["total"], o["started"], o["shards"], o["in_flight"], o["limit"]) == (50, 100, 2, 2, 70, 100)
    assert o["spent_usd"] == 2.5 and o["budget_usd"] == 10.0 and o["down"] is None
    # a minute later 10 more samples: ETA = 40 left / (10 / 60 s) = 240 s
    _write(
        tmp_path,
        "a",
        "000",
        total=50,
        done=30,
        ok=29,
        failed={"http_400": 1},
        in_flight=30,
        completion_tokens=5000,
        cost_usd=1.5,
        budget_usd=5.0,
        last_done_at=now + 60,
    )
    o = {r["backend"]: r for r in view.rows(now + 60)}["openrouter"]
    assert o["done"] == 60 and round(o["eta_s"]) == 240 and round(o["tok_s"]) == round(1000 / 60)
    line = view.line(o)
    assert (
        line.startswith("generate openrouter: 60/100 samples, 2/2 shards | in flight 70/100 |") and "ETA 4:00" in line
    )
    b = {r["backend"]: r for r in view.rows(now + 60)}["local"]
    assert b["eta_s"] is None and b["down"].startswith("no reply for 560 s (last error: connect_error: refused")
    assert "DOWN: no reply" in view.line(b) and len(view.line(b)) < 260
    # a backend the job's pool marked down says so at once
    _write(tmp_path, "b", "000", total=10, done=2, ok=2, last_done_at=now + 60, down={"local": "refused for 30 s"})
    b = {r["backend"]: r for r in view.rows(now + 61)}["local"]
    assert b["down"] == "local: refused for 30 s" and b["eta_s"] is None


def test_printer_prints_short_lines_when_they_change(tmp_path):
    _write(tmp_path, "a", "000", total=5, done=5, ok=5, final=True, completion_tokens=10)
    out = io.StringIO()
    runview.start(CONFIG, tmp_path, interval_s=0.05, stream=out, live=False)
    time.sleep(0.4)
    runview.stop()
    lines = out.getvalue().splitlines()
    assert lines and lines[0].startswith("generate openrouter: 5/5 samples, 1/2 shards")
    assert len(set(lines)) == len(lines) <= 2  # printed when they change, not every interval


def _rows_file(path, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(n)]}), path)


def test_last_screen_after_an_interrupted_run_counts_what_was_journaled(tmp_path):
    res = tmp_path / "results"
    run_dir = tmp_path / "run"
    # shard 000 finished (its summary), shard 001 was stopped: its job's last snapshot says 19 paid responses
    p = res / "a" / "responses" / "000.json"
    p.parent.mkdir(parents=True)
    p.write_text(
        json.dumps(
            {
                "samples": 50,
                "ok": 50,
                "failed_total": 0,
                "not_sent": 0,
                "total_cost_usd": 0.5,
                "wall_s": 12.0,
                "stopped_by": "all samples done",
                "other_model_replies": 3,
            }
        )
    )
    _write(run_dir, "a", "001", total=50, done=20, ok=19, failed={"timeout": 1}, cost_usd=0.19, new_ok=19)
    _write(run_dir, "b", "000", total=10, done=0)  # started, nothing answered yet
    _rows_file(res / "a" / "validated" / "000.parquet", 48)
    _rows_file(res / "a" / "validated" / "007.parquet", 35)  # an earlier config's shard: not this config's
    _rows_file(res / "a" / "rejected" / "000.parquet", 2)
    _rows_file(res / "a" / "validated" / "001.parquet", 44)  # an earlier run's: shard 001 did not finish in this one
    _rows_file(res / "a" / "rejected" / "001.parquet", 6)
    (res / "forecast" / "pilot" / "a").mkdir(parents=True)
    (res / "forecast" / "pilot" / "a" / "000.json").write_text(
        json.dumps({"ok": 8, "from_journal": 0, "cost_usd": 0.063})
    )
    rows = {r["dataset"]: r for r in run_summary_rows(CONFIG["datasets"], res, run_dir)}
    a = rows["a"]
    # Shards: generate finished; Kept/Rejected: shard 000's (001's files are an earlier run's); Left: the 20 samples
    # shard 001 answered (journaled) but did not take through validate
    assert (a["shards"], a["samples"], a["ok"], a["failed"], a["not_sent"], a["kept"], a["rejected"], a["left"]) == (
        "1/2",
        100,
        69,
        1,
        30,
        48,
        2,
        20,
    )
    assert abs(a["cost_usd"] - 0.69) < 1e-9 and a["ended_by"] == "all samples done, stopped"
    assert (rows["b"]["shards"], rows["b"]["ok"], rows["b"]["not_sent"], rows["b"]["left"]) == ("0/1", 0, 10, 0)
    for r in rows.values():  # the columns add up after a stop
        assert r["samples"] == r["kept"] + r["rejected"] + (r["not_sent"] or 0) + (r["left"] or 0), r
    text = run_summary(CONFIG["datasets"], res, ok=False, run_dir=run_dir)
    assert "Forecast pilot: 8 responses paid for, $0.063 " in text
    assert (
        "Replies naming another model than asked (kept; generation.reject_other_models: true refuses them): "
        "a 3." in text
    )
    cells = {ln.split()[0]: ln.split() for ln in text.splitlines()[3:7]}
    assert cells["a"][:9] == ["a", "1/2", "100", "69", "1", "30", "2", "48", "20"] and cells["a"][9] == "0.69"
    assert "Samples: source rows (= Kept + Rejected + Not sent + Left)." in text


def test_kept_counts_only_validated_files_made_from_the_current_responses(tmp_path):
    """A shard regenerated after an earlier run validated it (a config change, --forcerun) and not validated again
    (the run failed or stopped later): its old validated and rejected files are not this run's; its samples are
    Left, and the columns still add up."""
    import os

    res = tmp_path / "results"
    for shard in ("000", "001"):
        _rows_file(res / "a" / "validated" / f"{shard}.parquet", 9)
        _rows_file(res / "a" / "rejected" / f"{shard}.parquet", 1)
        p = res / "a" / "responses" / f"{shard}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(
            json.dumps(
                {
                    "samples": 10,
                    "ok": 10,
                    "failed_total": 0,
                    "not_sent": 0,
                    "total_cost_usd": 0.1,
                    "wall_s": 1.0,
                    "stopped_by": "all samples done",
                }
            )
        )
        _rows_file(res / "a" / "responses" / f"{shard}.parquet", 10)
    old = time.time() - 600  # shard 001's validate ran before its generate ran again
    for name in ("validated", "rejected"):
        os.utime(res / "a" / name / "001.parquet", (old, old))
    before = time.time() - 1200  # shard 000's chain in order
    os.utime(res / "a" / "responses" / "000.parquet", (before, before))
    a = run_summary_rows({"a": CONFIG["datasets"]["a"]}, res)[0]
    assert (a["shards"], a["samples"], a["kept"], a["rejected"], a["not_sent"], a["left"]) == ("2/2", 20, 9, 1, 0, 10)


def test_eta_is_this_runs_own_rate_not_the_journals(tmp_path):
    """A resume: 400 of a shard's 500 samples come from the journal within the first seconds; the ETA must come
    from the samples this run sent (10 in 60 s: 90 left take 540 s), not 410 in 60 s."""
    now = time.time()
    view = runview.RunView(CONFIG, tmp_path)
    _write(tmp_path, "a", "000", total=500, done=0, t0=time.monotonic())
    _write(tmp_path, "a", "001", total=500, done=500, ok=500, from_journal=500, instant=500, final=True)
    view.rows(now)
    _write(
        tmp_path,
        "a",
        "000",
        total=500,
        done=410,
        ok=410,
        from_journal=400,
        instant=400,
        new_ok=10,
        last_done_at=now + 60,
    )
    o = {r["backend"]: r for r in view.rows(now + 60)}["openrouter"]
    assert o["done"] == 910 and round(o["eta_s"]) == 540, o
    assert "ETA 9:00" in view.line(o)


def test_warnings_are_counted_per_reason_in_the_live_view(tmp_path):
    """The live view counts the jobs' warnings by reason (failed samples by their reason, the jobs' other warnings
    by theirs) instead of a console line each; their text stays in the shard logs."""
    import logging

    from rich.console import Console

    from eagle3_data.generate import JobState
    from eagle3_data.logs import tally_warnings

    st = JobState(total=100, budget_tokens=None, budget_usd=None, done=30, ok=10, failed={"http_503": 12, "timeout": 8})
    with tally_warnings(st.warnings):
        lg = logging.getLogger("eagle3_data.generate")
        lg.warning("stopped by budget_usd", extra={"reason": "budget_usd"})
        lg.warning("sample x failed", extra={"tally": False})  # counted in failed already
        lg.warning("something else")
    assert st.warnings == {"budget_usd": 1, "other": 1}
    runview.write_snapshot(tmp_path, runview.snapshot(st, "a", "000"))
    view = runview.RunView(CONFIG, tmp_path)
    o = {r["backend"]: r for r in view.rows()}["openrouter"]
    assert o["warnings"] == {"http_503": 12, "timeout": 8, "budget_usd": 1, "other": 1}
    assert "| warnings: http_503 12, timeout 8, budget_usd 1, +1 more |" in view.line(o), view.line(o)
    out = io.StringIO()
    Console(file=out, width=300).print(view.table())
    assert "http_503 12, timeout 8, budget_usd 1, +1 more" in out.getvalue()


def test_a_failing_backend_shows_down_with_why_while_it_lasts(tmp_path):
    """A backend whose every attempt fails shows ``DOWN: <why>`` in the line and the table while it lasts, not
    only once its jobs gave up on it (down_after_s); it goes when the backend answers again."""
    import asyncio
    import logging

    from rich.console import Console

    from eagle3_data.generate import progress
    from eagle3_data.backends.pool import Backend, BackendPool
    from eagle3_data.backends.definition import BackendConfig

    cfg = BackendConfig.from_dict(
        "openrouter",
        {
            "type": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "model": "m",
            "api_key_env": None,
            "max_concurrency": 4,
            "down_after_s": 30,
        },
    )

    async def failing_pool():
        b = Backend(cfg)
        for _ in range(4):
            b.record(False, True, "connection_error: refused")
        b.fault_since -= 7  # the first refusal 7 s ago: not yet down_after_s, yet every attempt failed
        pool = BackendPool([b])
        await pool.aclose()
        return pool

    pool = asyncio.run(failing_pool())
    assert pool.backends[0].down is None
    st = FakeState(total=100, done=30, ok=30, in_flight=4)
    display = progress.JobProgress(st, "[a/000]", 5.0, logging.getLogger("eagle3_data.generate"), live=False)
    display.run_dir, display.pool = tmp_path, pool
    display.snapshot()
    view = runview.RunView(CONFIG, tmp_path)
    o = {r["backend"]: r for r in view.rows()}["openrouter"]
    line = view.line(o)
    assert "DOWN: openrouter: refused connections for 7 s (4 attempts, none succeeded; out after 30 s)" in line, line
    assert o["eta_s"] is None
    out = io.StringIO()
    Console(file=out, width=300).print(view.table())
    assert "DOWN: openrouter: refused connections" in out.getvalue(), out.getvalue()
    pool.backends[0].record(True)  # it answers again: the next snapshot clears it
    display.snapshot()
    assert {r["backend"]: r for r in view.rows()}["openrouter"]["down"] is None


def test_generation_is_done_once_every_generate_job_of_the_run_ended_and_its_eta_never_climbs(tmp_path):
    """Shard 001's responses were there before the run (no generate job, no snapshot): once the run's only generate
    job ended, the backend's row is done, with 1 shard, not an ETA growing while the later stages run. Without
    Snakemake's account of the jobs (another console), the row shows no ETA once no job of it runs."""
    from eagle3_data.runtime.stageview import JobTally

    now = time.time()
    tally = JobTally()
    tally.run_info({"generate": 1, "tokenize": 1, "total": 2})
    tally.job_started(7, "generate", at=now - 60)
    _write(tmp_path, "a", "000", total=50, done=20, ok=20, new_ok=20, last_done_at=now, t0=time.monotonic() - 30)
    view = runview.RunView(CONFIG, tmp_path, tally=tally)
    o = {r["backend"]: r for r in view.rows(now)}["openrouter"]
    assert (o["started"], o["shards"]) == (1, 2) and o["eta_s"] is not None  # 001 may still start
    _write(tmp_path, "a", "000", total=50, done=50, ok=50, new_ok=50, last_done_at=now + 10, final=True)
    tally.job_finished(7, at=now + 10)
    for t in (now + 10, now + 300, now + 1200):  # the later stages run on: the row stays done
        o = {r["backend"]: r for r in view.rows(t)}["openrouter"]
        assert (o["started"], o["finished"], o["shards"], o["eta_s"]) == (1, 1, 1, None), o
        assert view.line(o).endswith("| done"), view.line(o)
    plain = runview.RunView(CONFIG, tmp_path, tally=lambda: None)
    o = {r["backend"]: r for r in plain.rows(now + 1200)}["openrouter"]
    assert (o["shards"], o["eta_s"]) == (2, None) and view.line(o).endswith("| ETA -"), view.line(o)


def test_each_stage_after_generation_has_its_own_rate_and_eta_or_none(tmp_path):
    """Snakemake's account of the run's jobs: tokenize (2 of 4 ended in 60 s since its first start, one runs) has
    an ETA of 60 s for the 2 left; validate (waiting on tokenize, none running) has none; merge is done."""
    from eagle3_data.runtime.stageview import JobTally, StageView

    t0 = 1_000_000.0
    tally = JobTally()
    tally.run_info(
        {"normalize_a": 1, "tokenize": 4, "validate": 3, "validate_pretokenized": 1, "merge": 1, "total": 10}
    )
    for j in range(3):
        tally.job_started(j, "tokenize", at=t0 + j)
    tally.job_finished(0, at=t0 + 30)
    tally.job_finished(1, at=t0 + 50)
    tally.job_started(10, "validate_pretokenized", at=t0)
    tally.job_failed(10, "validate_pretokenized", at=t0 + 5)
    tally.job_started(20, "merge", at=t0)
    tally.job_finished(20, at=t0 + 1)
    tally.run_info(
        {"normalize_a": 1, "tokenize": 4, "validate": 3, "validate_pretokenized": 1, "merge": 1, "total": 10}
    )
    view = StageView(tmp_path, tally)
    rows = {r["stage"]: r for r in view.rows(t0 + 60)}
    assert list(rows) == ["tokenize", "validate", "merge"]  # normalize: not a stage the view shows
    tok = rows["tokenize"]
    assert (tok["jobs"], tok["finished"], tok["running"], tok["state"]) == (4, 2, 1, "running")
    assert round(tok["rate"] * 60, 6) == 2.0 and round(tok["eta_s"]) == 60
    assert view.line(tok) == "tokenize: 2/4 jobs | 2.0 jobs/min | ETA 1:00"
    val = rows["validate"]
    assert (val["jobs"], val["failed"], val["running"], val["state"], val["eta_s"]) == (4, 1, 0, "waiting", None)
    assert view.line(val) == "validate: 0/4 jobs, 1 failed | ETA -"
    assert view.line(rows["merge"]) == "merge: 1/1 jobs | done"


def test_extraction_shows_tokens_of_its_jobs_rate_device_and_eta(tmp_path):
    """Two of the run's three extract jobs started (one reused half its tokens at once, one forwards on a GPU):
    tokens done of the run's (the third counted as the mean started one), the forwarded tokens/s over the last
    minute (the reused ones are no rate), the running job's device, and the ETA of the tokens left at that rate."""
    from eagle3_data.runtime.stageview import JobTally
    from eagle3_data.runtime.tokenprogress import TokenProgress

    now = time.time()
    tally = JobTally()
    tally.run_info({"extract": 3, "total": 3})
    tally.job_started(1, "extract", at=now - 100)
    tally.job_started(2, "extract", at=now - 100)
    a = TokenProgress(tmp_path, "chat", "000", tokens=1000, reused=500)
    a.start("cpu")
    a.update(500, final=True)
    b = TokenProgress(tmp_path, "chat", "001", tokens=2000, reused=0)
    b.start("cuda:0 (NVIDIA H100 80GB HBM3)")
    tally.job_finished(1, at=now - 50)
    view = runview.RunView(CONFIG, tmp_path, tally=tally)
    view.stages.rows(now)
    b.update(600, final=False)
    b.write()
    (ext,) = view.stages.rows(now + 60)
    assert (ext["stage"], ext["jobs"], ext["finished"], ext["running"]) == ("extract", 3, 1, 1)
    assert (ext["done"], ext["total"]) == (1600, 4500)  # 1000 + 600 of 1000 + 2000 + 1500
    assert round(ext["rate"]) == 10 and round(ext["eta_s"]) == 290  # 600 forwarded in 60 s; 2900 tokens left
    assert ext["devices"] == "cuda:0 (NVIDIA H100 80GB HBM3)"
    line = view.lines(now + 60)[-1]
    assert line == "extract: 1/3 jobs | 1,600/4,500 tokens | 10 tok/s | on cuda:0 (NVIDIA H100 80GB HBM3) | ETA 4:50"
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=200).print(view.table(now + 60))
    assert re.search(
        r"extract\s+1/3\s+1,600/4,500\s+10 tok/s\s+cuda:0 \(NVIDIA H100 80GB HBM3\)\s+4:50", out.getvalue()
    )
    # the job forwarded its last token; Snakemake still runs it (its file is written): an ETA all the same
    b.update(2000, final=True)
    (ext,) = view.stages.rows(now + 65)
    assert (ext["done"], ext["running"], ext["state"]) == (3000, 1, "running") and ext["eta_s"] is not None
    # the job ended: no ETA once nothing runs; done once every extract job of the run ended
    tally.job_finished(2, at=now + 70)
    (ext,) = view.stages.rows(now + 80)
    assert (ext["state"], ext["eta_s"]) == ("waiting", None) and view.stages.line(ext).endswith("| ETA -")
    tally.job_started(3, "extract", at=now + 80)
    tally.job_finished(3, at=now + 81)
    (ext,) = view.stages.rows(now + 90)
    assert ext["state"] == "done" and view.stages.line(ext).endswith("| done")


def test_an_extract_job_of_a_run_writes_its_progress_and_names_its_device(tmp_path, monkeypatch):
    from eagle3_data.runtime import tokenprogress
    from eagle3_data.runtime.processes import Owner

    out = "results/hidden_states/chat/003.safetensors"
    assert tokenprogress.TokenProgress.for_output(out, tokens=1, reused=0) is None  # no workflow run
    monkeypatch.setenv("EAGLE3_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("EAGLE3_RUN_OWNER", str(Owner.me()))
    # the plan's throughput measurement extracts into a temporary file: no extract job of the run
    assert (
        tokenprogress.TokenProgress.for_output(tmp_path / ".plan-measure-x" / "part.safetensors", tokens=1, reused=0)
        is None
    )
    p = tokenprogress.TokenProgress.for_output(out, tokens=90, reused=30)
    p.interval_s = 3600
    p.start("cpu")
    p.update(20)  # within the interval: not written
    snap = runview.read_snapshots(tmp_path / "run", "extract")[("chat", "003")]
    assert (snap["tokens"], snap["reused"], snap["forwarded"], snap["device"], snap["final"]) == (
        90,
        30,
        0,
        "cpu",
        False,
    )
    p.update(60, final=True)
    snap = runview.read_snapshots(tmp_path / "run", "extract")[("chat", "003")]
    assert (snap["forwarded"], snap["final"]) == (60, True)
    assert tokenprogress.device_label("cpu") == "cpu"
    monkeypatch.setattr(tokenprogress, "_gpu_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert tokenprogress.device_label("cuda:1") == "cuda:1 (NVIDIA H100 80GB HBM3)"
    assert tokenprogress.device_label("cuda", ["3"]) == "cuda:0 (NVIDIA H100 80GB HBM3) = GPU 3"
    assert tokenprogress.device_label("cuda", ["0", "1"]) == "cuda:0-1 (2× NVIDIA H100 80GB HBM3)"


def test_the_jobs_terminal_lines_the_console_keeps():
    """A job's INFO and DEBUG records stay in its log file; its warnings and errors (a bug's traceback with its
    error) and any other line come through, a progress bar's carriage-return redraws reduced to the last."""
    from eagle3_data.runtime.joboutput import LineFilter

    f = LineFilter()
    got = f.feed(
        b"00:39:46 INFO eagle3_data.tokens: tokenize x: {'samples': 3,\n 'kept': 3}\n"
        b"00:39:47 WARNING eagle3_data.merge: merge: datasets absent: ['x']\n"
        b'00:39:48 ERROR eagle3_data: bad.json: not JSON\nTraceback (most recent call last):\n  File "x"\n'
    )
    assert got == [
        "00:39:47 WARNING eagle3_data.merge: merge: datasets absent: ['x']",
        "00:39:48 ERROR eagle3_data: bad.json: not JSON",
        "Traceback (most recent call last):",
        '  File "x"',
    ]
    assert f.feed(b"Loading:  50%|#####\rLoading: 100%|##########\n00:40:00 DEBUG eagle3_data: x\n00:40") == [
        "Loading: 100%|##########"
    ]
    assert f.feed(b":01 ERROR eagle3_data.extract: extract: out of memory\n  continued\n\n") == [
        "00:40:01 ERROR eagle3_data.extract: extract: out of memory",
        "  continued",
    ]
    assert f.feed(b"no newline at the end") == [] and f.flush() == ["no newline at the end"]
    # a stage's result line (logs.NOTICE: the plan's summary, as setup_logging writes it) is shown
    import logging

    from eagle3_data.logs import NOTICE

    record = logging.LogRecord("eagle3_data.plan", NOTICE, "plan.py", 1, "plan: 1,234 tokens", None, None)
    line = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S").format(record)
    assert " NOTICE eagle3_data.plan: " in line and f.feed(line.encode() + b"\n") == [line]


def test_jobs_started_while_the_table_is_up_write_to_the_pipe_not_the_terminal(tmp_path):
    """Under a real terminal: a child process started after JobOutput.start writes its INFO record, its error and a
    plain line; the terminal gets only the error and the plain line, through ``show``; once stopped, the process's
    own descriptors are the terminal again."""
    import os
    import pty
    import select
    import subprocess
    import sys

    code = r"""
import subprocess, sys, time
from eagle3_data.runtime.joboutput import JobOutput
shown = []
jobs = JobOutput(lambda line: (jobs.terminal.write("SHOWN " + line + "\n"), jobs.terminal.flush()))
assert jobs.start() and jobs.terminal.isatty()
subprocess.run([sys.executable, "-c", "import sys; print('12:00:00 INFO eagle3_data.tokens: tokenize x: {}', file=sys.stderr);"
                "print('12:00:01 ERROR eagle3_data: bad.json: not JSON', file=sys.stderr); print('a plain line')"])
time.sleep(0.5)
jobs.stop()
print("AFTER STOP", flush=True)
"""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 30)
        try:
            data = os.read(master, 65536) if r else b""
        except OSError:
            data = b""
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=30) == 0
    lines = b"".join(chunks).decode().splitlines()
    assert lines == ["SHOWN 12:00:01 ERROR eagle3_data: bad.json: not JSON", "SHOWN a plain line", "AFTER STOP"], lines


def test_extract_states_in_a_run_writes_its_progress_and_logs_its_device(tmp_path, monkeypatch, caplog):
    """A tiny random Llama on the CPU: the job's last snapshot counts every token of its selection forwarded, on
    ``cpu``, and its log names the device."""
    import logging

    from eagle3_data import schemas
    from eagle3_data.extract import extract_states
    from eagle3_data.runtime.processes import Owner
    from eagle3_data.settings import ExtractSettings
    from eagle3_data.testing.workflow import save_tiny_llama

    model = save_tiny_llama(tmp_path / "tiny", hidden_size=32, num_layers=4, vocab_size=100, seed=0)
    rows = [
        {
            "sample_id": f"s{i}",
            "dataset": "chat",
            "input_ids": list(range(1, 6 + i)),
            "loss_mask": [0, 0] + [1] * (3 + i),
            "num_tokens": 5 + i,
            "num_supervised": 3 + i,
            "truncated": False,
        }
        for i in range(4)
    ]
    selection = tmp_path / "selection.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.MERGED), "merged", selection)
    monkeypatch.setenv("EAGLE3_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("EAGLE3_RUN_OWNER", str(Owner.me()))
    out = tmp_path / "results" / "hidden_states" / "chat" / "002.safetensors"
    out.parent.mkdir(parents=True)
    settings = ExtractSettings.defaults(
        model_path=model, layers=[0, 1, 2], batch_tokens=8, dtype="float32", device="cpu"
    )
    with caplog.at_level(logging.INFO, logger="eagle3_data.extract"):
        info = extract_states(selection, out, settings=settings)
    snap = runview.read_snapshots(tmp_path / "run", "extract")[("chat", "002")]
    tokens = sum(len(r["input_ids"]) for r in rows)
    assert (snap["tokens"], snap["reused"], snap["forwarded"], snap["final"]) == (tokens, 0, tokens, True)
    assert snap["device"] == "cpu" and info["device"] == "cpu"
    assert f"extract 002.safetensors: forwarding {tokens} tokens in {info['batches']} batches on cpu" in caplog.text


def test_a_backend_slowed_by_a_429_storm_says_why_and_until_when(tmp_path):
    """A 429 storm that slows a backend down to one request in flight: the view says so beside the ETA (why, the
    pause's end, the replies that bring it back); a finished shard's word no longer counts."""
    slowed = {
        "openrouter": "rate limited (HTTP 429): 1 of 64 in flight, paused until 12:03:41; back to 64 after 63 more replies"
    }
    for shard, final in (("000", False), ("001", True)):
        st = FakeState(total=10, done=2, ok=2, new_ok=2, in_flight=1)
        snap = runview.snapshot(st, "a", shard, backends=["openrouter"], slowed=slowed, final=final)
        assert snap["slowed"] == slowed
        runview.write_snapshot(tmp_path, snap)
    rv = runview.RunView(CONFIG, tmp_path, tally=lambda: None)
    (row,) = [r for r in rv.rows() if r["backend"] == "openrouter"]
    assert row["slowed"] == "openrouter: " + slowed["openrouter"] and row["down"] is None
    line = rv.line(row)
    assert "| SLOWED: openrouter: rate limited (HTTP 429): 1 of 64 in flight, paused until 12:03:41; back to 64" in line
    assert line.split(" | ")[-1].startswith("ETA ")
    st = FakeState(total=10, done=2, ok=2, new_ok=2, in_flight=1)
    runview.write_snapshot(tmp_path, runview.snapshot(st, "a", "000", backends=["openrouter"], final=False))
    (row,) = [r for r in rv.rows() if r["backend"] == "openrouter"]
    assert row["slowed"] is None and "SLOWED" not in rv.line(row)  # back at its cap: said no more


def test_backend_slowed_reports_its_limit_pause_and_the_replies_back_to_the_cap():
    import time as _time

    from eagle3_data.backends.definition import BackendConfig
    from eagle3_data.backends.pool import STORM_MIN_429, Backend

    c = BackendConfig.from_dict("b", {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"})
    b = Backend(c, cap=8)
    assert b.slowed() is None
    t = _time.monotonic()
    for _ in range(STORM_MIN_429):
        b.rate_limited(t, retry_after=30.0)
    assert int(b.limit) == 4
    clock = {_time.strftime("%H:%M:%S", _time.localtime(_time.time() + d)) for d in (29, 30, 31)}
    got = b.slowed()
    assert got.startswith("rate limited (HTTP 429): 4 of 8 in flight, paused until ") and got.endswith(
        "; back to 8 after 4 more replies"
    )
    assert got.split("until ")[1][:8] in clock  # the pause's end, local time
    b.ejected_until = 0.0  # the pause is over: the limit, and how many replies bring it back
    assert b.slowed() == "rate limited (HTTP 429): 4 of 8 in flight; back to 8 after 4 more replies"
    for _ in range(4):
        b.record(True)
    assert b.slowed() is None
