"""Report tally: totals equal sums computed independently from the parquet files; sources; rejects."""

from __future__ import annotations

import csv
import random
from collections import Counter

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from eagle3_data import schemas
from eagle3_data.report import backend_location, format_tally, tally

BACKENDS = {
    "local_sglang": {"type": "sglang", "base_url": "http://127.0.0.1:30000/v1"},
    "tiny_local": {"type": "openai", "base_url": "http://127.0.0.1:{port}/v1", "launch": {"command": "x"}},
    "openrouter": {"type": "openrouter", "base_url": "https://openrouter.ai/api/v1"},
}


def vrow(rng, ds, i, backend, ids_source="reconstructed"):
    n = rng.randint(5, 200)
    p = rng.randint(1, n - 1)
    return {"sample_id": f"{ds}-{i}", "dataset": ds, "input_ids": [rng.randrange(1000) for _ in range(n)],
            "loss_mask": [0] * p + [1] * (n - p), "num_tokens": n, "num_prompt_tokens": p,
            "num_completion_tokens": n - p, "ids_source": ids_source, "billed_completion_tokens": n - p,
            "finish_reason": "stop", "backend": backend, "provider": None, "cost_usd": 0.001}


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
            resp = [{"sample_id": r["sample_id"], "dataset": ds, "turn": 1, "request_key": f"k-{r['sample_id']}",
                     "status": "ok", "cost_usd": 0.01, "backend": r["backend"], "completion_tokens": 3}
                    for r in rows]
            resp.append({"sample_id": "f", "dataset": ds, "turn": 1, "request_key": f"fail-{ds}-{shard}",
                         "status": "failed", "cost_usd": 0.0, "backend": bks[0]})
            rp = tmp_path / ds / "responses" / f"{shard:03d}.parquet"
            schemas.write_checked(schemas.from_rows(resp, schemas.RESPONSES), "responses", rp)
            responses.append(rp)
        rej = [{"sample_id": f"r{i}", "dataset": ds, "stage": st, "reason": rs, "detail": None, "source_row": i}
               for i, (st, rs) in enumerate([("validate", "missing_end_of_turn"), ("validate", "missing_end_of_turn"),
                                            ("normalize", "empty_conversation")][: rng.randint(1, 3)])]
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
    assert names == ["b_empty", "b_local", "b_mixed", "b_remote", "Total generated", "a_pre",
                     "Total pre-tokenized", "Grand total"]

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
