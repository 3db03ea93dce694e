"""The run-wide view (eagle3_data.runview) and the last screen from what a stopped or failed run journaled."""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data import runview
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
    "datasets": {"a": {"source": {"format": "sharegpt", "path": "x"}, "shards": 2},
                 "b": {"source": {"format": "sharegpt", "path": "x"}, "shards": 1,
                       "generation": {"backends": ["local"]}},
                 "p": {"source": {"format": "pretokenized", "path": "x"}}},
}


def _write(run_dir, ds, shard, **kw):
    st = FakeState(**{k: v for k, v in kw.items() if k not in ("final", "down")})
    snap = runview.snapshot(st, ds, shard, backends=["x"], down=kw.get("down"), final=kw.get("final", False))
    runview.write_snapshot(run_dir, snap)
    return snap


def test_rows_add_up_over_shards_and_a_dead_backend_shows_down(tmp_path):
    now = time.time()
    _write(tmp_path, "a", "000", total=50, done=20, ok=19, failed={"http_400": 1}, in_flight=30,
           completion_tokens=4000, cost_usd=1.25, budget_usd=5.0, last_done_at=now, new_ok=19)
    _write(tmp_path, "a", "001", total=50, done=30, ok=30, in_flight=40, completion_tokens=6000, cost_usd=0.75,
           journal_cost_usd=0.5, budget_usd=5.0, last_done_at=now, new_ok=20, from_journal=10)
    _write(tmp_path, "b", "000", total=10, done=2, ok=2, in_flight=8, last_done_at=now - 500,
           last_error="connect_error: refused", t0=time.monotonic() - 600)
    view = runview.RunView(CONFIG, tmp_path, stall_s=120)
    rows = {r["backend"]: r for r in view.rows(now)}
    o = rows["openrouter"]
    assert (o["done"], o["total"], o["started"], o["shards"], o["in_flight"], o["limit"]) == (50, 100, 2, 2, 70, 100)
    assert o["spent_usd"] == 2.5 and o["budget_usd"] == 10.0 and o["down"] is None
    # a minute later 10 more samples: ETA = 40 left / (10 / 60 s) = 240 s
    _write(tmp_path, "a", "000", total=50, done=30, ok=29, failed={"http_400": 1}, in_flight=30,
           completion_tokens=5000, cost_usd=1.5, budget_usd=5.0, last_done_at=now + 60)
    o = {r["backend"]: r for r in view.rows(now + 60)}["openrouter"]
    assert o["done"] == 60 and round(o["eta_s"]) == 240 and round(o["tok_s"]) == round(1000 / 60)
    line = view.line(o)
    assert line.startswith("generate openrouter: 60/100 samples, 2/2 shards | in flight 70/100 |") and "ETA 4:00" in line
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
    p.write_text(json.dumps({"samples": 50, "ok": 50, "failed_total": 0, "not_sent": 0, "total_cost_usd": 0.5,
                             "wall_s": 12.0, "stopped_by": "all samples done", "other_model_replies": 3}))
    _write(run_dir, "a", "001", total=50, done=20, ok=19, failed={"timeout": 1}, cost_usd=0.19, new_ok=19)
    _write(run_dir, "b", "000", total=10, done=0)  # started, nothing answered yet
    _rows_file(res / "a" / "validated" / "000.parquet", 48)
    _rows_file(res / "a" / "validated" / "007.parquet", 35)  # an earlier config's shard: not this config's
    _rows_file(res / "a" / "rejected" / "000.parquet", 2)
    (res / "forecast" / "pilot" / "a").mkdir(parents=True)
    (res / "forecast" / "pilot" / "a" / "000.json").write_text(json.dumps({"ok": 8, "from_journal": 0,
                                                                           "cost_usd": 0.063}))
    rows = {r["dataset"]: r for r in run_summary_rows(CONFIG["datasets"], res, run_dir)}
    a = rows["a"]
    assert (a["shards"], a["samples"], a["ok"], a["failed"], a["not_sent"], a["kept"], a["rejected"]) == \
        ("2/2", 100, 69, 1, 30, 48, 2)
    assert abs(a["cost_usd"] - 0.69) < 1e-9 and a["ended_by"] == "all samples done, stopped"
    assert (rows["b"]["shards"], rows["b"]["ok"], rows["b"]["not_sent"]) == ("1/1", 0, 10)
    text = run_summary(CONFIG["datasets"], res, ok=False, run_dir=run_dir)
    assert "Forecast pilot: 8 responses paid for, $0.063 " in text
    assert "Replies naming another model than asked (kept; generation.reject_other_models: true refuses them): " \
           "a 3." in text
    cells = {ln.split()[0]: ln.split() for ln in text.splitlines()[3:7]}
    assert cells["a"][:8] == ["a", "2/2", "100", "69", "1", "30", "2", "48"] and cells["a"][8] == "0.69"
