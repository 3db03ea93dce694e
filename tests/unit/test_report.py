"""Report tally: totals equal sums computed independently from the parquet files; sources; rejects."""

from __future__ import annotations

import csv
import random
import re
from collections import Counter

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from eagle3_data.testing.workflow import md_rows
from eagle3_data import schemas
from eagle3_data.formatting import dollars, format_usd
from eagle3_data.report import backend_location, format_tally, tally


BACKENDS = {
    "local_sglang": {"type": "sglang", "base_url": "http://127.0.0.1:30000/v1"},
    "tiny_local": {"type": "openai", "base_url": "http://127.0.0.1:{port}/v1", "launch": {"command": "x"}},
    "openrouter": {"type": "openrouter", "base_url": "https://openrouter.ai/api/v1"},
}


def vrow(rng, ds, i, backend, ids_source="reconstructed"):
    n = rng.randint(5, 200)
    p = rng.randint(1, n - 1)
    return {
        "sample_id": f"{ds}-{i}",
        "dataset": ds,
        "input_ids": [rng.randrange(1000) for _ in range(n)],
        "loss_mask": [0] * p + [1] * (n - p),
        "num_tokens": n,
        "num_prompt_tokens": p,
        "num_completion_tokens": n - p,
        "ids_source": ids_source,
        "billed_completion_tokens": n - p,
        "finish_reason": "stop",
        "backend": backend,
        "provider": None,
        "cost_usd": 0.001,
    }


@pytest.fixture
def build(tmp_path):
    rng = random.Random(4)
    plan = {"b_local": ["tiny_local"], "b_remote": ["openrouter"], "b_mixed": ["local_sglang", "openrouter"]}
    validated, rejected, responses = [], [], []
    for ds, bks in plan.items():
        for shard in range(2):
            rows = [vrow(rng, ds, f"{shard}-{i}", bks[i % len(bks)]) for i in range(rng.randint(3, 9))]
            p = tmp_path / ds / "validated" / f"{shard:03d}.parquet"
            schemas.write_checked(schemas.from_rows(rows, schemas.VALIDATED), "validated", p)
            validated.append(p)
            resp = [
                {
                    "sample_id": r["sample_id"],
                    "dataset": ds,
                    "turn": 1,
                    "request_key": f"k-{r['sample_id']}",
                    "status": "ok",
                    "cost_usd": 0.01,
                    "backend": r["backend"],
                    "completion_tokens": 3,
                }
                for r in rows
            ]
            resp.append(
                {
                    "sample_id": "f",
                    "dataset": ds,
                    "turn": 1,
                    "request_key": f"fail-{ds}-{shard}",
                    "status": "failed",
                    "cost_usd": 0.0,
                    "backend": bks[0],
                }
            )
            rp = tmp_path / ds / "responses" / f"{shard:03d}.parquet"
            schemas.write_checked(schemas.from_rows(resp, schemas.RESPONSES), "responses", rp)
            responses.append(rp)
        rej = [
            {"sample_id": f"r{i}", "dataset": ds, "stage": st, "reason": rs, "detail": None, "source_row": i}
            for i, (st, rs) in enumerate(
                [
                    ("validate", "missing_end_of_turn"),
                    ("validate", "missing_end_of_turn"),
                    ("normalize", "empty_conversation"),
                ][: rng.randint(1, 3)]
            )
        ]
        rjp = tmp_path / ds / "rejected" / "000.parquet"
        schemas.write_checked(schemas.from_rows(rej, schemas.REJECTS), "rejects", rjp)
        rejected.append(rjp)
    pre = [vrow(rng, "a_pre", i, None, "pretokenized") for i in range(6)]
    p = tmp_path / "a_pre" / "validated" / "000.parquet"
    schemas.write_checked(schemas.from_rows(pre, schemas.VALIDATED), "validated", p)
    validated.append(p)
    config = {ds: {"source": {"format": "sharegpt"}} for ds in plan}
    config["a_pre"] = {"source": {"format": "pretokenized"}}
    config["b_empty"] = {"source": {"format": "ultrachat"}}
    return validated, rejected, responses, config


def test_totals_equal_parquet_sums(tmp_path, build):
    validated, rejected, responses, config = build
    out = tmp_path / "reports"
    rows = tally(validated, rejected, responses, out, datasets_config=config, backends=BACKENDS)
    by = {r["dataset"]: r for r in rows}

    # independent sums with pyarrow
    exp: dict = {}
    for p in validated:
        t = pq.read_table(p)
        ds = t.column("dataset")[0].as_py()
        e = exp.setdefault(ds, Counter())
        e["samples"] += t.num_rows
        e["total_tokens"] += pc.sum(pc.list_value_length(t.column("input_ids"))).as_py()
        e["completion_tokens"] += pc.sum(pc.list_flatten(t.column("loss_mask")).cast("int64")).as_py()
    for ds, e in exp.items():
        assert by[ds]["samples"] == e["samples"]
        assert by[ds]["total_tokens"] == e["total_tokens"]
        assert by[ds]["completion_tokens"] == e["completion_tokens"]
        assert by[ds]["prompt_tokens"] == e["total_tokens"] - e["completion_tokens"]
    gen = [d for d in exp if d != "a_pre"]
    for col in ("samples", "total_tokens", "completion_tokens"):
        assert by["Total generated"][col] == sum(exp[d][col] for d in gen)
        assert by["Total pre-tokenized"][col] == exp["a_pre"][col]
        assert by["Grand total"][col] == sum(e[col] for e in exp.values())
    n_rej = sum(pq.read_table(p).num_rows for p in rejected)
    assert by["Grand total"]["rejected"] == n_rej
    costs = sum(pc.sum(pq.read_table(p).column("cost_usd")).as_py() for p in responses)
    assert by["Grand total"]["cost_usd"] == pytest.approx(costs)
    assert by["Grand total"]["responses_failed"] == len(responses)

    # sources, order (pre-tokenized listed apart), empty configured dataset
    assert (by["b_local"]["source"], by["b_remote"]["source"], by["b_mixed"]["source"]) == ("Local", "Remote", "Mixed")
    assert by["a_pre"]["source"] == "Pre-tokenized" and by["a_pre"]["kind"] == "pretokenized"
    assert by["b_empty"]["samples"] == 0 and by["b_empty"]["kind"] == "generated"
    names = [r["dataset"] for r in rows]
    assert names == [
        "b_empty",
        "b_local",
        "b_mixed",
        "b_remote",
        "Total generated",
        "a_pre",
        "Total pre-tokenized",
        "Grand total",
    ]

    # files
    with open(out / "tally.csv") as fh:
        csv_rows = list(csv.DictReader(fh))
    assert [r["dataset"] for r in csv_rows] == names
    assert int(csv_rows[-1]["total_tokens"]) == by["Grand total"]["total_tokens"]
    with open(out / "rejects.csv") as fh:
        rej = list(csv.DictReader(fh))
    expected = Counter()
    for p in rejected:
        for r in pq.read_table(p).to_pylist():
            expected[(r["dataset"], r["stage"], r["reason"])] += 1
    assert {(r["dataset"], r["stage"], r["reason"]): int(r["count"]) for r in rej} == dict(expected)
    md = (out / "tally.md").read_text()
    assert "**Grand total**" in md and "Rejects by reason" in md
    assert format_tally(rows).count("\n") == len(rows) + 1


def test_empty_inputs_and_backend_location(tmp_path):
    rows = tally([], [], [], tmp_path / "r", datasets_config={"x": {}}, backends={})
    assert rows[0]["dataset"] == "x" and rows[-1]["samples"] == 0
    assert (tmp_path / "r" / "tally.md").exists() and (tmp_path / "r" / "rejects.csv").exists()
    assert backend_location({"type": "openai", "base_url": "http://gpu-node-3:30000/v1"}) == "local"
    assert backend_location({"type": "openai", "base_url": "http://10.0.0.5:30000/v1"}) == "local"
    assert backend_location({"type": "openai", "base_url": "https://api.together.xyz/v1"}) == "remote"
    assert backend_location(None) == "unknown"
    with pytest.raises(FileNotFoundError, match="validated"):
        tally([tmp_path / "missing.parquet"], [], [], tmp_path / "r")


def _responses(tmp_path, ds, shard, rows):
    p = tmp_path / ds / "responses" / f"{shard}.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.RESPONSES), "responses", p)
    return p


def _resp(ds, i, t, tokens, cost, backend="openrouter", provider="p1", status="ok"):
    return {
        "sample_id": f"{ds}-{i}",
        "dataset": ds,
        "turn": 1,
        "request_key": f"{ds}-{i}",
        "status": status,
        "completion_tokens": tokens if status == "ok" else None,
        "prompt_tokens": 100 if status == "ok" else None,
        "cost_usd": cost,
        "backend": backend,
        "provider": provider,
        "completed_at": t,
    }


def test_write_reports_cost_throughput_limits(tmp_path):
    from eagle3_data.report import REPORT_FILES, write_reports

    t0 = 1_700_000_000.0
    rng = random.Random(7)
    # ds_a: two providers through openrouter + one local backend; a failed response that still cost money
    a = [
        _resp("ds_a", i, t0 + 10 * i, rng.randint(1, 500), 0.001 * (1 + i % 3), provider=f"p{i % 2}") for i in range(20)
    ]
    a += [_resp("ds_a", 100 + i, t0 + 5 * i, 40, 0.0, backend="local", provider="local") for i in range(5)]
    a.append(_resp("ds_a", 999, t0 + 7, 0, 0.002, status="failed"))
    # ds_b: starts 5 minutes later; stopped by its dollar budget (summary JSON on both shards)
    b0 = [_resp("ds_b", i, t0 + 300 + 3 * i, 200 + i, 0.01) for i in range(10)]
    b1 = [_resp("ds_b", 50 + i, t0 + 301 + 3 * i, 300, 0.01) for i in range(10)]
    paths = [
        _responses(tmp_path, "ds_a", "000", a),
        _responses(tmp_path, "ds_b", "000", b0),
        _responses(tmp_path, "ds_b", "001", b1),
    ]
    for shard, stop in (("000", "budget_usd"), ("001", "budget_usd")):
        (tmp_path / "ds_b" / "responses" / f"{shard}.json").write_text(
            '{"dataset": "ds_b", "shard": "%s", "stopped_by": "%s", "not_sent": 4, "failed": {}}' % (shard, stop)
        )
    # ds_c: no summary, its token budget reached -> inferred; ds_d: nothing generated
    c = [_resp("ds_c", i, t0 + 60 + i, 100, 0.0) for i in range(10)]
    paths.append(_responses(tmp_path, "ds_c", "000", c))
    datasets = {
        "ds_a": {"source": {"format": "sharegpt"}, "shards": 1},
        "ds_b": {"source": {"format": "sharegpt"}, "shards": 2},
        "ds_c": {"source": {"format": "sharegpt"}, "shards": 1},
        "ds_d": {"source": {"format": "sharegpt"}, "shards": 1},
        "pre": {"source": {"format": "pretokenized"}},
    }
    generation = {
        "ds_a": {"max_samples": None},
        "ds_b": {"budget_usd": 0.2},
        "ds_c": {"budget_completion_tokens": 1000},
        "ds_d": {"max_samples": 10},
    }
    out = tmp_path / "reports"
    res = write_reports(
        [],
        [],
        paths,
        out,
        datasets_config=datasets,
        generation=generation,
        backends={"openrouter": {"type": "openrouter"}, "local": {"launch": {"command": "x"}}},
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT_FILES)
    everything = a + b0 + b1 + c
    ok = [r for r in everything if r["status"] == "ok"]

    # cost: detail rows sum to the dataset rows, which sum to the total; $/M is cost per million tokens
    cost = res["cost"]
    total = [r for r in cost if r["level"] == "total"]
    assert len(total) == 1
    total = total[0]
    assert total["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in everything))
    assert total["completion_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert total["responses_failed"] == 1 and total["responses_ok"] == len(ok)
    details = [r for r in cost if r["level"] == "detail"]
    assert {(r["dataset"], r["backend"], r["provider"]) for r in details} == {
        ("ds_a", "openrouter", "p0"),
        ("ds_a", "openrouter", "p1"),
        ("ds_a", "local", "local"),
        ("ds_b", "openrouter", "p1"),
        ("ds_c", "openrouter", "p1"),
    }
    for r in details:
        src = [
            x
            for x in everything
            if (x["dataset"], x["backend"], x["provider"]) == (r["dataset"], r["backend"], r["provider"])
        ]
        assert r["cost_usd"] == pytest.approx(sum(x["cost_usd"] for x in src))
        assert r["completion_tokens"] == sum(x["completion_tokens"] or 0 for x in src)
        if r["completion_tokens"]:
            assert r["usd_per_m_completion_tokens"] == pytest.approx(r["cost_usd"] * 1e6 / r["completion_tokens"])
    by_backend = {r["backend"]: r for r in cost if r["level"] == "backend" and r["provider"] == "local"}
    assert by_backend["local"]["completion_tokens"] == 200 and by_backend["local"]["cost_usd"] == 0
    with open(out / "cost.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(cost)

    # throughput: one row per minute from the first response to the last, idle minutes included
    tp = res["throughput"]
    last = max(r["completed_at"] for r in everything)
    assert len(tp) == int((last - t0) // 60) + 1
    for k, row in enumerate(tp):
        in_minute = [r for r in ok if t0 + 60 * k <= r["completed_at"] < t0 + 60 * (k + 1)]
        assert row["responses_ok"] == len(in_minute)
        assert row["completion_tokens_per_min"] == pytest.approx(sum(r["completion_tokens"] for r in in_minute))
    assert tp[-1]["cumulative_completion_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert tp[-1]["cumulative_cost_usd"] == pytest.approx(total["cost_usd"])
    assert tp[-1]["cumulative_mean_completion_tokens"] == pytest.approx(
        sum(r["completion_tokens"] for r in ok) / len(ok)
    )
    assert any(r["responses_ok"] == 0 for r in tp)  # minutes 2-4 are idle

    # limits: from the summaries when present, else inferred; pre-tokenized datasets are not listed
    lim = {r["dataset"]: r for r in res["limits"]}
    assert set(lim) == {"ds_a", "ds_b", "ds_c", "ds_d"}
    assert (lim["ds_b"]["ended_by"], lim["ds_b"]["evidence"], lim["ds_b"]["not_sent"]) == ("budget_usd", "summary", 8)
    assert (lim["ds_c"]["ended_by"], lim["ds_c"]["evidence"]) == ("budget_completion_tokens", "inferred")
    assert (lim["ds_a"]["ended_by"], lim["ds_a"]["samples_ok"]) == ("all samples done", 25)
    assert lim["ds_d"]["ended_by"] == "not generated"
    assert lim["ds_b"]["cost_usd"] == pytest.approx(0.2) and lim["ds_b"]["budget_usd"] == 0.2
    md = (out / "limits.md").read_text()
    assert ["ds_b", "budget_usd", "summary"] in [r[:3] for r in md_rows(md)]


def test_limits_mixed_and_partial_summaries(tmp_path):
    from eagle3_data.report import write_reports

    paths = []
    for shard in ("000", "001", "002"):
        paths.append(
            _responses(tmp_path, "ds", shard, [_resp("ds", f"{shard}-{i}", 1e9 + i, 5, 0.0) for i in range(3)])
        )
    for shard, stop in (("000", "max_samples"), ("001", "all samples done")):
        (tmp_path / "ds" / "responses" / f"{shard}.json").write_text('{"stopped_by": "%s"}' % stop)
    res = write_reports([], [], paths, tmp_path / "r", datasets_config={"ds": {"shards": 3}})
    (row,) = res["limits"]
    assert row["evidence"] == "partial summary" and row["shards_reported"] == 2
    assert row["ended_by"] == "all samples done (1 of 3 shards); max_samples (1 of 3 shards)"


def test_limits_count_replies_from_another_model_per_dataset(tmp_path):
    """Replies naming another model than the backend's (generate's summary ``other_model_replies``) are counted per
    dataset in the limits table (Markdown column "Other model"); a shard without the field counts 0."""
    import json as _json

    from eagle3_data.report import write_reports

    paths = []
    for ds, shard, other in (("ds_a", "000", 3), ("ds_a", "001", 2), ("ds_b", "000", None)):
        paths.append(_responses(tmp_path, ds, shard, [_resp(ds, f"{shard}-{i}", 1e9 + i, 5, 0.0) for i in range(2)]))
        summary = {"stopped_by": "all samples done", **({"other_model_replies": other} if other is not None else {})}
        (tmp_path / ds / "responses" / f"{shard}.json").write_text(_json.dumps(summary))
    res = write_reports([], [], paths, tmp_path / "r", datasets_config={"ds_a": {"shards": 2}, "ds_b": {"shards": 1}})
    lim = {r["dataset"]: r["other_model_replies"] for r in res["limits"]}
    assert lim == {"ds_a": 5, "ds_b": 0}
    md = (tmp_path / "r" / "limits.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| Dataset"))
    assert header.rstrip(" |").endswith("Other model")
    assert md_rows(md)[0][0] == "ds_a" and md_rows(md)[0][-1] == "5"


def test_audit_report_compares_billed_and_own_counts_per_dataset_and_ids_source(tmp_path):
    from eagle3_data.report import AUDIT_COLUMNS, write_reports

    rng = random.Random(11)
    rows = []
    for i in range(12):  # ds_x: reconstructed rows whose server billed 2 extra prompt tokens on every 3rd sample
        r = vrow(rng, "ds_x", i, "openrouter")
        r["billed_prompt_tokens"] = r["num_prompt_tokens"] + (2 if i % 3 == 0 else 0)
        r["billed_completion_tokens"] = r["num_completion_tokens"] + (1 if i % 4 == 0 else 0)
        rows.append(r)
    for i in range(5):  # ds_x: exact ids from /generate: equal by construction
        r = vrow(rng, "ds_x", 100 + i, "local_sglang", "exact")
        r["billed_prompt_tokens"] = r["num_prompt_tokens"]
        rows.append(r)
    for i in range(4):  # ds_y: no billed prompt counts (null)
        rows.append(vrow(rng, "ds_y", i, "tiny_local"))
    pre = [vrow(rng, "pre", i, None, "pretokenized") for i in range(3)]  # no billing: not audited
    vp = tmp_path / "v.parquet"
    schemas.write_checked(schemas.from_rows(rows + pre, schemas.VALIDATED), "validated", vp)
    out = tmp_path / "reports"
    audit = write_reports([vp], [], [], out)["audit"]
    by = {(a["dataset"], a["ids_source"]): a for a in audit}
    assert [(a["dataset"], a["ids_source"], a["level"]) for a in audit] == [
        ("ds_x", "exact", "detail"),
        ("ds_x", "reconstructed", "detail"),
        ("ds_x", "(all)", "dataset"),
        ("ds_y", "reconstructed", "detail"),
        ("ds_y", "(all)", "dataset"),
        ("(all)", "(all)", "total"),
    ]
    rec = by[("ds_x", "reconstructed")]
    mine = [r for r in rows if r["dataset"] == "ds_x" and r["ids_source"] == "reconstructed"]
    assert rec["samples"] == 12 and rec["prompt_billed_samples"] == 12 and rec["prompt_equal_samples"] == 8
    assert rec["prompt_tokens"] == sum(r["num_prompt_tokens"] for r in mine)
    assert rec["billed_prompt_tokens"] == rec["prompt_tokens"] + 8
    assert rec["prompt_rel"] == pytest.approx(8 / rec["prompt_tokens"])
    assert (rec["prompt_diff_median"], rec["prompt_diff_min"], rec["prompt_diff_max"]) == (0.0, 0, 2)
    assert rec["billed_completion_tokens"] - rec["completion_tokens"] == 3 and rec["completion_equal_samples"] == 9
    ex = by[("ds_x", "exact")]
    assert ex["prompt_equal_samples"] == ex["samples"] == 5 and ex["prompt_rel"] == 0.0
    y = by[("ds_y", "(all)")]
    assert y["samples"] == 4 and y["prompt_billed_samples"] == 0 and y["prompt_rel"] is None
    total = by[("(all)", "(all)")]
    assert (
        total["samples"] == 21
        and total["billed_prompt_tokens"] == rec["billed_prompt_tokens"] + ex["billed_prompt_tokens"]
    )
    csv_head = (out / "audit.csv").read_text().splitlines()[0]
    assert csv_head == ",".join(AUDIT_COLUMNS)
    md = (out / "audit.md").read_text()
    assert f"{100 * rec['prompt_rel']:+.2f}%" in md and ["**ds_x**", "**(all)**"] in [r[:2] for r in md_rows(md)]


def test_reports_run_on_validated_files_from_before_the_billed_prompt_column(tmp_path):
    from eagle3_data.report import write_reports

    rng = random.Random(3)
    rows = [vrow(rng, "old", i, "openrouter") for i in range(4)]
    p = tmp_path / "v.parquet"
    pq.write_table(schemas.from_rows(rows, schemas.VALIDATED).drop_columns(["billed_prompt_tokens"]), p)
    res = write_reports([p], [], [], tmp_path / "reports")
    total = res["audit"][-1]
    assert total["samples"] == 4 and total["prompt_billed_samples"] == 0 and total["prompt_rel"] is None
    assert total["billed_completion_tokens"] == sum(r["num_completion_tokens"] for r in rows)
    assert res["tally"][0]["samples"] == 4


def test_tally_without_pretokenized_data_and_dollars_as_in_the_cost_table(tmp_path):
    from eagle3_data.report import write_reports

    rng = random.Random(5)
    rows = [vrow(rng, "gen", i, "openrouter") for i in range(3)]
    vp = tmp_path / "v.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.VALIDATED), "validated", vp)
    resp = [_resp("gen", i, 1e9 + i, 10, 0.00007) for i in range(3)]  # $0.00021 in all
    out = tmp_path / "reports"
    res = write_reports(
        [vp],
        [],
        [_responses(tmp_path, "gen", "000", resp)],
        out,
        datasets_config={"gen": {"source": {"format": "sharegpt"}}},
    )
    # no all-zero "Total pre-tokenized" row anywhere when there is no pre-tokenized dataset
    assert [r["dataset"] for r in res["tally"]] == ["gen", "Total generated", "Grand total"]
    tally_md = (out / "tally.md").read_text()
    assert "pre-tokenized" not in tally_md and "pre-tokenized" not in (out / "tally.csv").read_text()
    assert "pre-tokenized" not in (out / "tally.html").read_text()
    # the same dollars, with the same meaningful precision, in the tally and the cost table
    tally_cost = {r[0]: r[-1] for r in md_rows(tally_md)}
    cost_rows = md_rows((out / "cost.md").read_text())
    assert tally_cost["**Grand total**"] == "**0.00021**" == cost_rows[-1][8]
    assert tally_cost["gen"] == "0.00021"
    only_pre = tally([vp], [], [], tmp_path / "r2", datasets_config={"gen": {"source": {"format": "pretokenized"}}})
    assert [r["dataset"] for r in only_pre] == ["gen", "Total pre-tokenized", "Grand total"]


def test_dollar_format_keeps_two_significant_digits_below_a_dollar():
    assert [format_usd(v) for v in (0, 0.0002, 0.00021, 0.01234, 0.5, 0.999, 86.04, 1234.5)] == [
        "0.00",
        "0.00020",
        "0.00021",
        "0.012",
        "0.50",
        "1.00",
        "86.04",
        "1,234.50",
    ]


def test_log_dollars_are_cents_or_four_significant_digits():
    """The forecast's log line: $0.016560699999999998 reads $0.01656 (eagle3_data.formatting.dollars)."""
    assert [dollars(v) for v in (0.016560699999999998, 0.0002, 1.23456, 1234.5, 0, None)] == [
        "$0.01656",
        "$0.0002000",
        "$1.23",
        "$1,234.50",
        "$0.00",
        "unknown",
    ]


def test_html_tables_hold_the_markdown_numbers(tmp_path, build):
    validated, rejected, responses, config = build
    rows = tally(validated, rejected, responses, tmp_path / "r", datasets_config=config, backends=BACKENDS)
    page = (tmp_path / "r" / "tally.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    cells = re.findall(r"<td[^>]*>(.*?)</td>", page)
    g = rows[-1]
    i = cells.index("<strong>Grand total</strong>")
    assert cells[i + 1 : i + 3] == [f"<strong>{g['samples']:,}</strong>", f"<strong>{g['prompt_tokens']:,}</strong>"]
    body_rows = md_rows((tmp_path / "r" / "tally.md").read_text())  # the tally's and the rejects' rows
    assert len(re.findall(r"<tr>", page)) == len(body_rows) + 2  # + their header rows


def test_run_summary_per_dataset_from_a_built_tree(tmp_path):
    """The run's last lines: per dataset done/failed/not sent from generate's shard summaries, rejects of every
    stage and validated rows from the parquet files, cost and the longest shard's time; a shard without a summary
    (a failed run) shows in ``Shards``."""
    import json

    import pyarrow as pa

    from eagle3_data.report import run_summary, run_summary_rows

    res = tmp_path / "results"

    def rows_file(path, n):
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(n)]}), path)

    def summary(ds, shard, **kw):
        p = res / ds / "responses" / f"{shard}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"dataset": ds, "shard": shard, **kw}))

    summary(
        "gen",
        "000",
        samples=28,
        ok=12,
        failed_total=0,
        not_sent=16,
        total_cost_usd=0.5012,
        wall_s=95.2,
        stopped_by="budget_usd",
    )
    summary(
        "gen",
        "001",
        samples=27,
        ok=25,
        failed_total=2,
        not_sent=0,
        total_cost_usd=0.25,
        wall_s=130.6,
        stopped_by="all samples done",
    )
    rows_file(res / "gen" / "rejected" / "normalize.parquet", 3)
    rows_file(res / "gen" / "rejected" / "000.parquet", 1)
    rows_file(res / "gen" / "rejected" / "001.parquet", 4)  # the 2 failed at generate (tokenize writes them) + 2
    rows_file(res / "gen" / "validated" / "000.parquet", 11)
    rows_file(res / "gen" / "validated" / "001.parquet", 23)
    summary(
        "half",
        "000",
        samples=10,
        ok=10,
        failed_total=0,
        not_sent=0,
        total_cost_usd=0.0,
        wall_s=3.0,
        stopped_by="all samples done",
    )
    rows_file(res / "pre" / "rejected" / "normalize.parquet", 2)
    rows_file(res / "pre" / "rejected" / "000.parquet", 4)
    rows_file(res / "pre" / "validated" / "000.parquet", 40)
    datasets = {
        "gen": {"source": {"format": "sharegpt"}, "shards": 2},
        "half": {"source": {"format": "sharegpt"}, "shards": 2},
        "pre": {"source": {"format": "pretokenized"}},
    }
    rows = run_summary_rows(datasets, res)
    keys = ("dataset", "shards", "samples", "ok", "failed", "not_sent", "rejected", "kept", "left", "time", "ended_by")
    assert [tuple(r[k] for k in keys) for r in rows] == [
        ("gen", "2/2", 58, 37, 2, 16, 8, 34, 0, "2:11", "all samples done, budget_usd"),  # 55 prompts + 3 rows
        ("half", "1/2", 10, 10, 0, 0, 0, 0, 10, "0:03", "all samples done"),  # normalize rejected; not validated
        ("pre", "-", 46, None, None, None, 6, 40, None, "", "pre-tokenized"),  # samples = rejected + kept
        ("Total", "", 114, 47, 2, 16, 14, 74, 10, "", ""),
    ]
    for r in rows:  # the columns add up: every source row is kept, rejected, not sent or left for a rerun
        assert r["samples"] == r["kept"] + r["rejected"] + (r["not_sent"] or 0) + (r["left"] or 0)
    assert rows[0]["cost_usd"] == pytest.approx(0.7512) and rows[-1]["cost_usd"] == pytest.approx(0.7512)
    assert rows[2]["cost_usd"] is None
    (res / "reports").mkdir()
    (res / "reports" / "tally.md").write_text("# Tally\n")
    text = run_summary(datasets, res, run_s=3725.0, ok=False, tally_path=res / "reports" / "tally.md")
    lines = text.splitlines()
    assert lines[0] == "Run summary (the run failed; what it had finished):"
    assert lines[1].split() == [
        "Dataset",
        "Shards",
        "Samples",
        "OK",
        "Failed",
        "Not",
        "sent",
        "Rejected",
        "Kept",
        "Left",
        "Cost",
        "$",
        "Time",
        "Ended",
        "by",
    ]
    cells = {ln.split()[0]: ln.split() for ln in lines[3:7]}
    assert cells["gen"] == [
        "gen",
        "2/2",
        "58",
        "37",
        "2",
        "16",
        "8",
        "34",
        "0",
        "0.75",
        "2:11",
        "all",
        "samples",
        "done,",
        "budget_usd",
    ]
    assert cells["pre"] == ["pre", "-", "46", "6", "40", "pre-tokenized"]
    assert cells["Total"] == ["Total", "114", "47", "2", "16", "14", "74", "10", "0.75", "1:02:05"]
    assert (
        lines[-1] == f"Tokens, rejects by reason, cost by backend: {res}/reports/tally.md (all reports: {res}/reports/)"
    )
    assert len(lines) <= 12  # one screen


def test_run_summary_says_how_many_failed_without_a_paid_reply_and_that_a_rerun_retries_them(tmp_path):
    """A shard whose job failed with samples that got no paid reply (its last snapshot in the run directory, no
    summary) and one that kept them as failed rows (generation.unpaid_failures: keep): the last screen counts them
    in Failed and says what sends them again."""
    import json

    from eagle3_data.runtime import runview
    from eagle3_data.generate import JobState
    from eagle3_data.report import run_summary, run_summary_rows

    res, run_dir = tmp_path / "results", tmp_path / "run"
    st = JobState(
        total=100,
        budget_tokens=None,
        budget_usd=None,
        done=100,
        ok=63,
        new_ok=63,
        failed={"http_429": 30, "timeout": 7},
        unpaid={"http_429": 30, "timeout": 7},
    )
    runview.write_snapshot(run_dir, runview.snapshot(st, "storm", "000", final=True))
    p = res / "kept" / "responses" / "000.json"
    p.parent.mkdir(parents=True)
    p.write_text(
        json.dumps(
            {
                "samples": 10,
                "ok": 6,
                "failed_total": 4,
                "failed_unpaid": 3,
                "not_sent": 0,
                "stopped_by": "all samples done",
            }
        )
    )
    datasets = {"storm": {"source": {"format": "sharegpt"}}, "kept": {"source": {"format": "sharegpt"}}}
    rows = run_summary_rows(datasets, res, run_dir)
    assert [(r["dataset"], r["failed"], r["rerun_unpaid"], r["kept_unpaid"], r["ended_by"]) for r in rows[:2]] == [
        ("storm", 37, 37, 0, "failed, not paid"),
        ("kept", 4, 0, 3, "all samples done"),
    ]
    lines = run_summary(datasets, res, ok=False, run_dir=run_dir).splitlines()
    assert (
        "Failed, not paid: rerun the same command to retry them (only they are sent; nothing journaled is paid "
        "again): storm 37." in lines
    )
    assert (
        "Failed, not paid, recorded as failed (generation.unpaid_failures: keep): `snakemake --forcerun "
        "generate` retries them: kept 3." in lines
    )


def test_a_failed_runs_last_screen_says_why_each_job_failed(tmp_path):
    """The cause on the last screen, not 80 lines above it: each failed job's one-line error from its log (the
    last attempt only, this run's logs only, interrupts left out)."""
    import os
    import time

    from eagle3_data.report import run_summary

    logs = tmp_path / "logs"
    (logs / "generate" / "chat").mkdir(parents=True)
    mark = "===== 2026-01-01T00:00:00+00:00 pid 1: attempt 2 of this job (earlier ones above) ====="
    (logs / "generate" / "chat" / "000.log").write_text(
        f"{mark}\n10:00:00 ERROR eagle3_data: an earlier attempt's error\n{mark}\n"
        "10:01:00 INFO eagle3_data.generate: [chat/000] 100 samples\n"
        "10:01:05 ERROR eagle3_data: [chat/000] backend 'or': environment variable OR_KEY (api_key_env) is not set "
        "or empty. Export OR_KEY=<your key> and rerun the same command\n"
    )
    (logs / "generate" / "chat" / "001.log").write_text(
        f"{mark}\n10:01:06 ERROR eagle3_data: [chat/001] interrupted. Rerun the same command to resume\n"
    )
    old = logs / "generate" / "chat" / "002.log"
    old.write_text(f"{mark}\n09:00:00 ERROR eagle3_data: a failure of an earlier run\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    datasets = {"chat": {"source": {"format": "sharegpt"}}}
    text = run_summary(datasets, tmp_path / "results", run_s=60.0, ok=False, logs_dir=logs)
    lines = text.splitlines()
    i = lines.index("Why (each failed job's error; its log has the details):")
    assert lines[i + 1 :] == [
        f"  {logs}/generate/chat/000.log: [chat/000] backend 'or': environment variable OR_KEY "
        "(api_key_env) is not set or empty. Export OR_KEY=<your key> and rerun the same command"
    ]
    assert "Why" not in run_summary(datasets, tmp_path / "results", run_s=60.0, ok=True, logs_dir=logs)
