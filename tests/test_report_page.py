"""The report rule on a scratch copy of the finished demo, and `snakemake --report` rendered offline.

Works on a copy of the session's finished demo run (``demo_run`` in conftest.py).
"""

from __future__ import annotations

import base64
import csv
import re
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import run_snakemake
from eagle3_data.plots import PLOT_FILES
from eagle3_data.report import REPORT_FILES

REPORTED = sorted([f for f in REPORT_FILES if f.endswith(".csv")] + PLOT_FILES + ["plan.md"])  # flagged with report()


@pytest.fixture(scope="module")
def demo(demo_run, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("report_page") / "wf"
    shutil.copytree(demo_run, work, symlinks=True)
    run_snakemake(work, "--report", "report.html")
    return work


def test_every_report_file_exists(demo):
    out = demo / "results" / "reports"
    for name in REPORT_FILES + PLOT_FILES:
        assert (out / name).stat().st_size > 0, name
    for name in PLOT_FILES:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_report_page_is_self_contained_with_every_table_and_plot(demo):
    html = (demo / "report.html").read_text()
    assert len(html) > 100_000
    assert not re.findall(r"""(?:src|href)\s*=\s*["']https?://""", html), "the page loads something from the net"
    found = re.findall(r"data:[\w/+.-]+;charset=utf8;filename=([\w.-]+);base64,([A-Za-z0-9+/=]+)", html)
    embedded = {k: v for k, v in found if k != "logo.svg"}  # logo.svg: Snakemake's own
    assert sorted(embedded) == REPORTED
    for name, b64 in embedded.items():
        assert base64.b64decode(b64) == (demo / "results" / "reports" / name).read_bytes(), name
    for caption in ("B8 pattern", "Which limit ended each generated dataset"):
        assert caption in html


def _read_csv(path: Path) -> list[dict]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_tally_totals_equal_sums_over_validated_parquet(demo):
    files = sorted((demo / "results").glob("*/validated/*.parquet"))
    assert files
    exp: dict[str, Counter] = {}
    for p in files:
        t = pq.read_table(p, columns=["dataset", "input_ids", "loss_mask"])
        for ds in set(t.column("dataset").to_pylist()):
            sub = t.filter(pc.equal(t.column("dataset"), ds))
            e = exp.setdefault(ds, Counter())
            e["samples"] += sub.num_rows
            e["total_tokens"] += pc.sum(pc.list_value_length(sub.column("input_ids"))).as_py() or 0
            e["completion_tokens"] += pc.sum(pc.list_flatten(sub.column("loss_mask")).cast("int64")).as_py() or 0
    rows = {r["dataset"]: r for r in _read_csv(demo / "results" / "reports" / "tally.csv")}
    for ds, e in exp.items():
        for col in ("samples", "total_tokens", "completion_tokens"):
            assert int(rows[ds][col]) == e[col], (ds, col)
        assert int(rows[ds]["prompt_tokens"]) == e["total_tokens"] - e["completion_tokens"]
    for col in ("samples", "total_tokens", "completion_tokens"):
        assert int(rows["Grand total"][col]) == sum(e[col] for e in exp.values())
        assert int(rows["Total generated"][col]) + int(rows["Total pre-tokenized"][col]) == int(rows["Grand total"][col])
    md = (demo / "results" / "reports" / "tally.md").read_text()
    g = int(rows["Grand total"]["samples"])
    assert f"| **Grand total** | **{g:,}** |" in md


def test_cost_and_throughput_equal_sums_over_responses(demo):
    files = sorted((demo / "results").glob("*/responses/*.parquet"))
    assert files
    t = pa.concat_tables([pq.read_table(p) for p in files])
    ok = t.filter(pc.equal(t.column("status"), "ok"))
    comp = pc.sum(ok.column("completion_tokens")).as_py()
    cost = pc.sum(t.column("cost_usd")).as_py() or 0.0
    (total,) = [r for r in _read_csv(demo / "results" / "reports" / "cost.csv") if r["level"] == "total"]
    assert int(total["completion_tokens"]) == comp and int(total["responses_ok"]) == ok.num_rows
    assert float(total["cost_usd"]) == pytest.approx(cost, abs=1e-9)
    tp = _read_csv(demo / "results" / "reports" / "throughput.csv")
    assert sum(int(r["completion_tokens"]) for r in tp) == comp
    assert int(tp[-1]["cumulative_completion_tokens"]) == comp
    limits = {r["dataset"] for r in _read_csv(demo / "results" / "reports" / "limits.csv")}
    assert limits == set(t.column("dataset").to_pylist())
