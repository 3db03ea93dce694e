"""The report rule on a scratch copy of the finished demo, and `snakemake --report` rendered offline, also in
headless Chromium (tables and loss-mask views shown in the page; skipped without a ``chromium`` binary).

Works on a copy of the session's finished demo run (``demo_run`` in conftest.py).
"""

from __future__ import annotations

import base64
import csv
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from eagle3_data.testing.workflow import md_rows, run_snakemake
from eagle3_data.report.plots import PLOT_FILES
from eagle3_data.report import REPORT_FILES, RULE_OUTPUTS
from eagle3_data.testing.headless import Browser, find_chromium

# flagged with report(): the tables as HTML pages, the plots, the plan, one loss-mask page per dataset
REPORTED = sorted([file for _, file, caption, *_ in RULE_OUTPUTS if caption] + ["plan.html"])


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
    found = re.findall(r"data:([\w/+.-]+);charset=utf8;filename=([\w.-]+);base64,([A-Za-z0-9+/=]+)", html)
    embedded = {k: (mime, v) for mime, k, v in found if k != "logo.svg"}  # logo.svg: Snakemake's own
    datasets = sorted(p.name for p in (demo / "results").iterdir() if (p / "validated").is_dir())
    views = [f"{ds}.html" for ds in datasets]
    assert sorted(embedded) == sorted(REPORTED + views)
    for name, (mime, b64) in embedded.items():
        src = demo / "results" / "reports" / ("view/" if name in views else "") / name
        assert base64.b64decode(b64) == src.read_bytes(), name
        assert mime in ("text/html", "image/png"), (name, mime)  # shown in the page; a CSV would be a download
    assert "data:text/csv" not in html
    for caption in (
        "a short-biased sample",
        "Which limit ended each generated dataset",
        "What the draft model is trained on",
    ):
        assert caption in html


def test_report_front_page_shows_the_tally_cost_and_rejects(demo):
    """The page's front (the workflow description, report/workflow.rst) carries the report rule's
    results/reports/front.html: the tally, cost and rejects tables, each cell as the Markdown reports have it."""
    html = (demo / "report.html").read_text()
    front = (demo / "results" / "reports" / "front.html").read_text()
    assert json.dumps(front)[1:-1] in html  # embedded verbatim in the page's description
    titles = re.findall(r"<h3>(.*?)</h3>", front)
    assert titles == [
        "Tally",
        "Cost and tokens by dataset, backend and provider",
        "Rejects by dataset, stage and reason",
    ], titles
    sections = re.split(r"<h3>.*?</h3>", front)[1:]
    entities = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"'}

    def text(cell: str) -> str:
        return re.sub("&[a-z]+;", lambda m: entities[m.group(0)], re.sub(r"<[^>]+>", "", cell))

    for section, stem in zip(sections, ("tally", "cost", "rejects")):
        shown = [
            "|".join(text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row))
            for row in re.findall(r"<tr>(.*?)</tr>", section, flags=re.S)
        ]
        # md_rows splits escaped pipes too: joined again, the row's text (bold marks and escapes dropped)
        expected = [
            "|".join(row).replace("**", "").replace("\\|", "|")
            for row in md_rows((demo / "results" / "reports" / f"{stem}.md").read_text())
        ]
        assert [row for row in shown if row] == expected, stem
    tally = md_rows((demo / "results" / "reports" / "tally.md").read_text())
    datasets = sorted(p.name for p in (demo / "results").iterdir() if (p / "validated").is_dir())
    assert {r[0] for r in tally} >= set(datasets)


def test_report_rule_graph_lists_every_rule_once(demo):
    html = (demo / "report.html").read_text()
    nodes = re.search(r'"name": "node-data", "values": (\[.*?\])\}', html).group(1)
    rules = [n["rule"] for n in json.loads(nodes)]
    assert len(rules) == len(set(rules)), sorted(r for r in rules if rules.count(r) > 1)
    assert {"validate", "validate_pretokenized", "tokenize", "view", "report", "plan"} <= set(rules)


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
        assert int(rows["Total generated"][col]) + int(rows["Total pre-tokenized"][col]) == int(
            rows["Grand total"][col]
        )
    md = (demo / "results" / "reports" / "tally.md").read_text()
    g = int(rows["Grand total"]["samples"])
    assert ["**Grand total**", f"**{g:,}**"] in [r[:2] for r in md_rows(md)]


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


def test_plan_scales_its_units_to_a_small_build(demo):
    md = (demo / "results" / "reports" / "plan.md").read_text()
    assert "0.00 TB" not in md and " MB (" in md  # the demo: ~44 MB of hidden states
    total = re.search(r"- GPU time: .* GPU hours \(([\d.,]+) (s|min|h)\)", md)
    assert total and float(total.group(1).replace(",", "")) >= 1, md


# ------------------------------------------------------------------------------------------ in a browser

_CLICK_LINK = (
    "(t => { const a = [...document.querySelectorAll('a')].find(e => e.innerText.trim() === t); "
    "if (a) a.click(); return !!a; })"
)
_CLICK_EYE = (
    "(t => { const r = [...document.querySelectorAll('tr')].find(r => r.cells[0] && "
    "r.cells[0].innerText.trim() === t); const a = r && r.querySelector('a[iconname=eye]'); "
    "if (a) a.click(); return !!a; })"
)


@pytest.fixture(scope="module")
def browser():
    exe = find_chromium()
    if not exe:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    with Browser(exe, width=1400, height=900) as b:
        yield b


def _show_result(b: Browser, report_html: Path, category: str, label: str) -> int:
    """Open the report page, click ``category`` in the menu, then the eye icon of result ``label``; the
    execution context of the iframe the page shows it in."""
    b.goto(report_html.as_uri())
    b.wait_for("document.querySelector('#app') && document.querySelector('#app').innerText.length > 0")
    assert b.eval(f"{_CLICK_LINK}({json.dumps(category)})"), category
    b.wait_for(f"{_CLICK_EYE}({json.dumps(label)})")
    b.wait_for("document.querySelector('iframe') !== null")
    frames = b.child_frames()
    assert len(frames) == 1 and frames[0]["url"].startswith("data:text/html"), frames
    return b.frame_context(frames[0]["id"])


def test_report_page_shows_the_tally_in_the_page(demo, browser, tmp_path_factory):
    ctx = _show_result(browser, demo / "report.html", "1. Tables", "tally")
    browser.wait_for("document.querySelector('table') !== null", context_id=ctx)
    cells = browser.eval(
        "[...document.querySelectorAll('table')[0].rows].map(r => [...r.cells].map(c => c.innerText.trim()))",
        context_id=ctx,
    )
    shown = {r[0]: r for r in cells[1:]}
    assert cells[0][:2] == ["Dataset", "Samples"]
    rows = _read_csv(demo / "results" / "reports" / "tally.csv")
    assert list(shown) == [r["dataset"] for r in rows]
    for r in rows:  # every dataset's and total's numbers, as the rendered page shows them
        got = shown[r["dataset"]]
        assert got[1] == f"{int(r['samples']):,}", got
        for col, k in (("prompt_tokens", 2), ("completion_tokens", 3), ("total_tokens", 4)):
            n = int(r[col])
            assert got[k] == (f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"), (col, got)
        assert got[6] == f"{int(r['rejected']):,}", got
    shot = browser.screenshot(tmp_path_factory.mktemp("screenshots") / "report_tally.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot of the report page showing the tally: {shot}")


def test_report_page_shows_the_loss_mask_view_in_the_page(demo, browser, tmp_path_factory):
    ds = "sharegpt_demo"
    ctx = _show_result(browser, demo / "report.html", "4. Loss-mask view", ds)
    browser.wait_for("document.querySelectorAll('.tokens').length > 0", context_id=ctx)
    samples = browser.eval("[...document.querySelectorAll('h2')].map(h => h.innerText)", context_id=ctx)
    shown = browser.eval(
        "[...document.querySelectorAll('.tokens')].map(d => [...d.querySelectorAll('span.t')].map("
        "s => [+s.dataset.i, +s.dataset.id, s.classList.contains('m1') ? 1 : 0]))",
        context_id=ctx,
    )
    assert len(samples) == len(shown) == 3
    validated = pa.concat_tables(
        [pq.read_table(p) for p in sorted((demo / "results" / ds / "validated").glob("*.parquet"))]
    )
    by_id = {r["sample_id"]: r for r in validated.to_pylist()}
    for sid, spans in zip(samples, shown):
        r = by_id[sid]
        keep = [i for i, _, _ in spans]  # long context runs are shortened: compare the tokens drawn
        assert [t for _, t, _ in spans] == [r["input_ids"][i] for i in keep]
        assert [m for _, _, m in spans] == [r["loss_mask"][i] for i in keep]  # green exactly where mask is 1
        assert set(range(len(r["input_ids"]))) - set(keep) <= {i for i, m in enumerate(r["loss_mask"]) if not m}
    shot = browser.screenshot(tmp_path_factory.mktemp("screenshots") / "report_loss_mask_view.png")
    assert shot.stat().st_size > 20_000
    print(f"screenshot of the report page showing the loss-mask view: {shot}")


# the home view's layout: where the description's paragraphs, titles and tables and the rule graph (vega's canvas
# and its menu button) are drawn, and which element the page shows at the middle of each cell of the first and the
# last column (the Cost $ columns) of each front table, scrolled into view
_LAYOUT = """(() => {
  const box = e => { const r = e.getBoundingClientRect(); return {l: r.left, t: r.top, r: r.right, b: r.bottom}; };
  const front = document.querySelector('.eagle3-front');
  const pane = front.closest('.overflow-auto');
  pane.scrollTop = 0; pane.scrollLeft = 0;
  const items = [...front.closest('.prose').querySelectorAll('p, h2, h3, table')].map(
    e => ({what: e.tagName + ' ' + e.innerText.trim().slice(0, 40), ...box(e)}));
  const edges = [...front.querySelectorAll('table')].flatMap(
    t => [...t.rows].flatMap(r => [r.cells[0], r.cells[r.cells.length - 1]]));
  const hits = edges.map(c => {
    c.scrollIntoView({block: 'center', inline: 'center'});
    const r = c.getBoundingClientRect();
    const at = document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2);
    return {cell: c.innerText.trim(), same: !!at && (at === c || c.contains(at)), at: at ? at.tagName : null};
  });
  pane.scrollTop = 0; pane.scrollLeft = 0;
  return {pane: box(pane), graph: box(document.querySelector('#rulegraph')), items, hits};
})()"""


def _intersect(a: dict, b: dict) -> bool:
    return a["l"] < b["r"] and b["l"] < a["r"] and a["t"] < b["b"] and b["t"] < a["b"]


@pytest.mark.parametrize(("width", "height"), [(1400, 900), (1920, 1080), (1024, 768)])
def test_report_home_draws_the_rule_graph_clear_of_the_tally_cost_and_rejects(demo, width, height, tmp_path_factory):
    """The page's home view (the description with the tally, cost and rejects tables, and the rule graph), laid
    out by headless Chromium at three window sizes: the rule graph intersects no paragraph, title or table of the
    description; the description starts inside the pane, not above or left of what it scrolls to; from 1400 px
    wide every table fits the pane's width; the middle of every cell of each table's first and last column (Cost
    $ in the tally), scrolled into view, shows that cell, nothing drawn over it."""
    exe = find_chromium()
    if not exe:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    with Browser(exe, width=width, height=height) as b:
        b.goto((demo / "report.html").as_uri())
        b.wait_for("document.querySelector('.eagle3-front table') !== null")
        # vega draws the graph on a canvas, asynchronously: wait until it is sized to the graph
        b.wait_for("(c => !!c && c.height > 300)(document.querySelector('#rulegraph canvas.marks'))")
        lay = b.eval(_LAYOUT)
        shot = b.screenshot(tmp_path_factory.mktemp("screenshots") / f"report_home_{width}x{height}.png")
    print(f"screenshot of the report page's home view at {width}x{height}: {shot}")
    graph, pane, items = lay["graph"], lay["pane"], lay["items"]
    assert graph["r"] - graph["l"] > 100 and graph["b"] - graph["t"] > 300, graph  # the graph is drawn
    tables = [i for i in items if i["what"].startswith("TABLE")]
    titles = [i["what"] for i in items if i["what"][:2] in ("H2", "H3")]
    assert len(tables) >= 3 and any("Tally" in t for t in titles) and any("Cost" in t for t in titles), titles
    assert not [i["what"] for i in items if _intersect(i, graph)], (graph, items)
    assert all(i["t"] >= pane["t"] and i["l"] >= pane["l"] for i in items), (pane, items)  # none cut off
    if width >= 1400:
        assert all(t["r"] <= pane["r"] + 0.5 for t in tables), (pane, tables)  # no table runs past the pane
    assert lay["hits"][1]["cell"] == "Cost $" and len(lay["hits"]) >= 40, lay["hits"][:3]  # the tally's header
    assert [h for h in lay["hits"] if not h["same"]] == [], "cells drawn over"
