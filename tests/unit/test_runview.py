"""The run-wide view (eagle3_data.runtime.runview) and the last screen from what a stopped or failed run journaled."""

from __future__ import annotations

import io
import json
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
