"""generate stage against the fault-injecting test server (eagle3_data.testing.fault_server) on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing.fault_server import body_hash

from eagle3_data import schemas
from eagle3_data.generate import GenerationStopped, assistant_turns, generate, request_key
from eagle3_data.files import write_parquet
from eagle3_data.generate.journal import read_journal
from eagle3_data.settings import GenerateSettings

ACCEPTANCE_FAULTS = {
    "p429": 0.10,
    "p5xx": 0.05,
    "ptimeout": 0.02,
    "preset": 0.02,
    "perror200": 0.01,
    "pmalformed": 0.01,
    "hang_s": 3.0,
    "retry_after_s": 0.01,
}


def write_prompts(path: Path, convs: list[list[dict]], tools=None, ids=None) -> Path:
    rows = []
    for i, msgs in enumerate(convs):
        rows.append(
            dict(
                sample_id=ids[i] if ids else f"s{i:04d}",
                dataset="ds",
                messages=msgs if isinstance(msgs, str) else json.dumps(msgs),
                tools=json.dumps(tools) if tools else None,
                source_format="test",
                source_row=i,
            )
        )
    write_parquet(schemas.from_rows(rows, schemas.PROMPTS), path)
    return path


def simple_convs(n: int, start: int = 0) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"question number {i}"}, {"role": "assistant", "content": "original"}]
        for i in range(start, start + n)
    ]


def gen_cfg(**kw) -> dict:
    cfg = dict(
        backends=["fault"],
        mode="last",
        max_tokens=30,
        temperature=1.0,
        top_p=1.0,
        extra_body={},
        max_retries=6,
        max_samples=None,
        budget_completion_tokens=None,
        budget_usd=None,
        retry_initial_s=0.01,
        retry_max_s=0.05,
    )
    cfg.update(kw)
    return cfg


def backends_cfg(fs, name="fault", **kw) -> dict:
    b = dict(
        type="openrouter",
        base_url=fs.url + "/v1",
        model="vendor/model",
        api_key_env=None,
        max_concurrency=8,
        timeout_s=1.0,
    )
    b.update(kw)
    return {name: b}


#: generate()'s own keywords; the rest of a run's keywords are its settings (GenerateSettings fields)
JOB_KEYWORDS = ("log", "summary_path", "sample_ids", "progress_interval_s", "write_batch_rows")


def gen_settings(tmp_path, gen, bk, **kw) -> GenerateSettings:
    """The job's settings: ``gen`` and ``bk`` with the schema's defaults, the journal under ``tmp_path``."""
    kw = {"dataset": "ds", "target_name": "tiny-target", "journal_dir": tmp_path / "journal", **kw}
    return GenerateSettings.defaults(generation=gen, backends=bk, **kw)


def run(tmp_path, fs, prompts, gen=None, bk=None, shard="000", out="out.parquet", **kw):
    job = {k: kw.pop(k) for k in JOB_KEYWORDS if k in kw}
    settings = gen_settings(tmp_path, gen or gen_cfg(), bk or backends_cfg(fs), **kw)
    return generate(prompts, tmp_path / out, settings, shard=shard, **{"progress_interval_s": 0.5, **job})


def rows_by_key(path) -> dict:
    return {r["request_key"]: r for r in pq.read_table(path).to_pylist()}


def test_assistant_turns_rules():
    u, a, t, s = ({"role": r, "content": r} for r in ("user", "assistant", "tool", "system"))
    assert assistant_turns([s, u, a, u, a], "last") == [4]
    assert assistant_turns([s, u, a, u, a], "all") == [2, 4]
    assert assistant_turns([u, a, t], "last") == [1]  # last assistant, even with a tool result after it
    assert assistant_turns([s, u], "last") == [2]  # no assistant: a fresh turn after the user message
    assert assistant_turns([u, a, t, a, t], "all") == [1, 3]
    assert assistant_turns([s], "last") == []  # nothing to answer
    assert assistant_turns([a, u], "last") == [2]  # a leading assistant turn is never a target


def test_replies_with_unstorable_values_are_paid_rejects_or_stored_as_nulls(tmp_path, fs):
    """An unpaired surrogate in the text can't be journaled (UTF-8) or tokenized: the billed reply is a paid reject
    (never retried: each retry would be billed). A NaN cost, a 1e30 or negative count, an out-of-range token id
    would break the output mid-run: stored as nulls, the reply kept."""
    fs.app.config.update({"psurrogate": 0.3, "pbadusage": 0.3, "seed": 5})
    fs.app.reset()
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(60))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=8))
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    rows = [r for r in table if r["status"] == "ok"]
    out = fs.app.outcomes
    assert s["ok"] == 60 - out["surrogate"] == len(rows) and out["surrogate"] > 5 and out["badusage"] > 5
    assert s["retry_reasons"] == {} and s["failed"] == {"invalid_unicode": out["surrogate"]} and len(table) == 60
    assert all("\ud800" not in r["content"] for r in rows)
    nulls = [r for r in rows if r["prompt_tokens"] is None]
    assert len(nulls) == out["badusage"]
    assert all(r["cost_usd"] is None and r["reasoning_tokens"] is None and r["output_ids"] is None for r in nulls)
    good = [r for r in rows if r["prompt_tokens"] is not None]
    assert all(r["cost_usd"] > 0 and r["reasoning_tokens"] == 0 for r in good)


def test_reply_values_are_checked_one_by_one():
    from eagle3_data.backends.chat import parse_response
    from eagle3_data.backends.errors import RetryableError
    from eagle3_data.backends.fields import as_cost, as_count, as_token_ids
    from eagle3_data.backends.native import parse_native_response
    from eagle3_data.backends.definition import BackendConfig
    from eagle3_data.backends.paid import PaidReject

    assert [
        as_count(v) for v in (5, 5.9, "7", None, True, -1, 1e30, float("inf"), float("nan"), "x", 2**31, 2**31 - 1)
    ] == [5, 5, 7, None, None, None, None, None, None, None, None, 2**31 - 1]
    assert [as_cost(v) for v in (0.5, "0.25", 0, -0.1, float("nan"), float("inf"), None, False, "x")] == [
        0.5,
        0.25,
        0.0,
        None,
        None,
        None,
        None,
        None,
        None,
    ]
    assert as_token_ids([0, 5, 2**31 - 1]) == [0, 5, 2**31 - 1]
    assert [as_token_ids(v) for v in ([1, 2**31], [-1], [1, True], [1.0], [], None)] == [None] * 6
    be = BackendConfig.from_dict("b", {"type": "openrouter", "base_url": "http://x/v1", "model": "m"})
    body = {
        "id": "gen-1",
        "provider": "P",
        "choices": [{"finish_reason": "stop", "message": {"content": "hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001},
    }
    f = parse_response(be, json.dumps(body).encode(), 0.5)
    assert (f["content"], f["prompt_tokens"], f["cost_usd"], f["provider"]) == ("hi", 3, 0.001, "P")
    for path, value in (
        (("choices", 0, "message", "content"), "ok \ud800"),
        (("provider",), "P\udfff"),
        (("choices", 0, "message", "reasoning"), "\ud83d"),
    ):
        b = json.loads(json.dumps(body))
        node = b
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(PaidReject, match=f"{path[-1]} has an unpaired surrogate") as ei:
            parse_response(be, json.dumps(b).encode(), 0.5)
        # billed: a paid reject with the reply's usage and cost, the unstorable field dropped
        assert ei.value.reason == "invalid_unicode" and ei.value.fields["cost_usd"] == 0.001
        assert ei.value.fields[path[-1]] is None and ei.value.fields["completion_tokens"] == 2
    ok_pair = json.loads(json.dumps({**body, "choices": [{"message": {"content": "emoji \ud83d\ude00"}}]}))
    assert parse_response(be, json.dumps(ok_pair).encode(), 0.5)["content"] == "emoji \U0001f600"
    with pytest.raises(RetryableError, match="no output_ids"):
        parse_native_response(be, json.dumps({"output_ids": [5, 2**31], "meta_info": {}}).encode(), 0.1, None)


def test_faults_every_sample_ends_once(tmp_path, fs):
    fs.app.config.update(ACCEPTANCE_FAULTS)
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(300))
    summary = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=8))
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert sorted(ids) == [f"s{i:04d}" for i in range(300)]  # every sample exactly once
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert all(r["error"] and ":" in r["error"] for r in failed)
    assert summary["ok"] == len(ok) and summary["failed_total"] == len(failed)
    stats = fs.stats()
    outcomes = stats["outcomes"]
    # the faults really happened, and every kind was retried but the cut-off 200s (billed: a named reject, once)
    for k in ("429", "timeout", "reset", "error200", "malformed"):
        assert outcomes.get(k, 0) > 0, (k, outcomes)
    assert {"http_429", "timeout", "connection_error", "error_in_body"} <= set(summary["retry_reasons"])
    assert "malformed_json" not in summary["retry_reasons"]
    assert summary["failed"]["undecodable_reply"] == outcomes["malformed"]
    # nothing billed was paid twice, and every completed reply is in the output
    assert max(stats["completed_by_body"].values()) == 1 and max(stats["billed_by_body"].values()) == 1
    assert stats["completed"] == len(ok)
    assert summary["sent"] == stats["requests"]
    for r in ok:
        assert r["content"] and r["completion_tokens"] > 0 and r["cost_usd"] > 0
        assert r["provider"] == "FaultProvider" and r["backend"] == "fault"
        assert json.loads(r["messages"]) == [{"role": "user", "content": f"question number {int(r['sample_id'][1:])}"}]


def test_unpaid_failures_fail_the_job_and_the_rerun_sends_exactly_them(tmp_path, fs):
    """Samples whose retries ran out without a paid reply (here 500s) end the job in one line, with every paid reply
    journaled and no output (so the same command reruns the job); the rerun sends exactly those samples."""
    fs.app.config.update({"fail_after": 2, "fail_status": 500})  # 2 requests succeed, every later one is a 500
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    with pytest.raises(GenerationStopped) as ei:
        run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=2))
    msg = str(ei.value)
    assert type(ei.value).__name__ == "UnpaidFailures"
    assert msg.startswith("[ds/000] 3 of 5 samples failed without a paid reply (http_500 3); last error: http_500: ")
    assert "Rerun the same command to send them (2 responses of ds are journaled" in msg and "\n" not in msg
    assert not (tmp_path / "out.parquet").exists() and list(tmp_path.glob("*.tmp*")) == []
    assert fs.app.requests == 2 + 3 * 3 and fs.app.completed == 2
    assert len(read_journal(tmp_path / "journal", "ds")[0]) == 2  # failures are not journaled
    fs.app.config.update({"fail_after": None})
    fs.app.reset()
    s2 = run(tmp_path, fs, prompts)
    assert s2["sent"] == 3 == fs.app.requests and s2["ok"] == 5 and s2["from_journal"] == 2
    assert fs.app.completed == 3 and max(fs.app.completed_by_body.values()) == 1
    # the sent bodies are those of the 3 samples that had failed
    sent = sorted(int(b["messages"][0]["content"].split()[-1]) for b in fs.app.bodies)
    assert sent == [2, 3, 4]


def test_unpaid_failures_kept_as_failed_rows_with_keep(tmp_path, fs):
    fs.app.config.update({"fail_after": 2, "fail_status": 500})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    s1 = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=2, unpaid_failures="keep"))
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sorted(r["status"] for r in rows) == ["failed"] * 3 + ["ok"] * 2
    assert all(r["error"].startswith("http_500") and "3 attempt" in r["error"] for r in rows if r["status"] == "failed")
    assert s1["sent"] == 2 + 3 * 3 and s1["failed_total"] == 3 and s1["failed_unpaid"] == 3
    assert s1["unpaid"] == {"http_500": 3}
    assert len(read_journal(tmp_path / "journal", "ds")[0]) == 2  # failures are not journaled
    fs.app.config.update({"fail_after": None})
    s2 = run(tmp_path, fs, prompts)
    assert s2["sent"] == 3 and s2["ok"] == 5 and s2["from_journal"] == 2


def test_final_failures_stay_failed_and_the_job_succeeds(tmp_path, fs):
    """A 4xx answer no retry can fix and a paid reject are final: written as failed rows, the job succeeds (so the
    same command does not rerun it)."""
    fs.app.config.update({"perror422body": 0.3, "pbadbytes": 0.2, "seed": 4})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts)
    assert set(s["failed"]) == {"http_422", "invalid_utf8"} and s["failed_unpaid"] == 0
    assert s["failed_total"] == fs.app.outcomes["error422body"] + fs.app.outcomes["badbytes"] >= 8
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sum(r["status"] == "failed" for r in rows) == s["failed_total"] and s["retries"] == 0


def test_a_429_storm_slows_the_backend_down_instead_of_failing_samples(tmp_path, fs):
    """Every request of the first 3 s is refused with 429 (Retry-After 0.3 s), far longer than a request's 4
    retries last. Without a back-off every request in flight uses its retries up and fails. The adaptive back-off
    pauses the backend and halves the requests in flight per round of 429s (those use up no retry) down to one, so
    only the one request in flight at a time uses retries up while the storm lasts: at most a sample or two fail,
    and the backend is asked a few times per round instead of once per request waiting."""
    fs.app.config.update({"storm_s": 3.0, "retry_after_s": 0.3, "latency_min_s": 0.01, "latency_max_s": 0.02})
    fs.app.reset()
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(100))
    s = run(
        tmp_path, fs, prompts, gen=gen_cfg(max_retries=4, retry_initial_s=0.2, retry_max_s=0.5, unpaid_failures="keep")
    )
    storm = fs.app.outcomes["429"]
    failed = s["failed"].get("http_429", 0)
    assert s["failed"] == s["unpaid"] == ({"http_429": failed} if failed else {}) and failed <= 2
    assert s["ok"] == 100 - failed == fs.app.completed
    assert s["retry_reasons"] == {"http_429": storm} and storm <= 40


def test_every_request_failing_stops_the_job(tmp_path, fs):
    """A backend that answers nothing but errors is a configuration problem: no output, a clear error."""
    fs.app.config.update({"p5xx": 1.0})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    with pytest.raises(GenerationStopped, match=r"every request failed \(5 of 5 requests: {.http_50"):
        run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=1))
    assert not (tmp_path / "out.parquet").exists()
    assert read_journal(tmp_path / "journal", "ds")[0] == {}
    fs.app.config.update({"p5xx": 0.0})
    assert run(tmp_path, fs, prompts)["ok"] == 5


def test_resume_sends_nothing_and_output_identical(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    s1 = run(tmp_path, fs, prompts, out="a.parquet")
    n1 = fs.stats()["requests"]
    assert s1["sent"] == n1 == 40
    s2 = run(tmp_path, fs, prompts, out="b.parquet")
    assert fs.stats()["requests"] == n1 and s2["sent"] == 0 and s2["from_journal"] == 40
    assert rows_by_key(tmp_path / "a.parquet") == rows_by_key(tmp_path / "b.parquet")
    # the journal is read across shard files: a re-sharded dataset finds the old responses
    s3 = run(tmp_path, fs, prompts, shard="007", out="c.parquet")
    assert s3["sent"] == 0
    # the key does not depend on the backend: another backend/model/url still resumes
    bk = backends_cfg(fs, name="other", type="sglang", model="local/path", base_url=fs.url + "/v1/")
    s4 = run(tmp_path, fs, prompts, gen=gen_cfg(backends=["other"]), bk=bk, out="d.parquet")
    assert s4["sent"] == 0
    # ...but a different sampling parameter is a different request
    s5 = run(tmp_path, fs, prompts, gen=gen_cfg(max_tokens=31), out="e.parquet")
    assert s5["sent"] == 40


def test_torn_last_journal_line(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(10))
    run(tmp_path, fs, prompts)
    jfile = tmp_path / "journal" / "ds" / "000.jsonl"
    lines = jfile.read_bytes().splitlines(keepends=True)
    assert len(lines) == 10
    jfile.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # crash mid-write
    fs.app.reset()
    s = run(tmp_path, fs, prompts, out="again.parquet")
    assert s["sent"] == 1 and s["from_journal"] == 9 and s["journal_bad_lines"] == 1
    timing = ("latency_s", "completed_at")  # the re-sent response has its own timing
    strip = lambda rows: {k: {f: v for f, v in r.items() if f not in timing} for k, r in rows.items()}  # noqa: E731
    assert strip(rows_by_key(tmp_path / "again.parquet")) == strip(rows_by_key(tmp_path / "out.parquet"))
    recs, stats = read_journal(tmp_path / "journal", "ds")
    assert len(recs) == 10 and stats["bad_lines"] == 1  # the fragment stayed on its own line
    assert run(tmp_path, fs, prompts, out="third.parquet")["sent"] == 0


def test_402_stops_with_clear_message_and_intact_journal(tmp_path, fs):
    fs.app.config.update({"fail_after": 25, "fail_status": 402})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(100))
    with pytest.raises(GenerationStopped) as ei:
        run(tmp_path, fs, prompts, gen=gen_cfg(), bk=backends_cfg(fs, max_concurrency=4))
    msg = str(ei.value)
    assert "402" in msg and "insufficient credits" in msg and "journal" in msg
    assert not (tmp_path / "out.parquet").exists()
    recs, stats = read_journal(tmp_path / "journal", "ds")
    assert stats["bad_lines"] == 0 and 20 <= len(recs) <= 25
    assert all(r["status"] == "ok" and r["content"] for r in recs.values())
    # credits topped up: the rerun sends only what is missing
    fs.app.config.update({"fail_after": None})
    fs.app.reset()
    s = run(tmp_path, fs, prompts)
    assert s["from_journal"] == len(recs) and s["sent"] == 100 - len(recs)
    assert max(fs.stats()["completed_by_body"].values()) == 1


def test_api_key_canary_never_written(tmp_path, fs, monkeypatch):
    canary = "sk-or-CANARY-7f3a9c1e55d2"
    monkeypatch.setenv("E3D_TEST_KEY", canary)
    fs.app.config.update({**ACCEPTANCE_FAULTS, "require_key": canary, "p5xx": 0.3})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    log = tmp_path / "logs" / "job.log"
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(max_retries=1, unpaid_failures="keep"),
        bk=backends_cfg(fs, api_key_env="E3D_TEST_KEY"),
        log=log,
    )
    assert s["ok"] > 0 and s["failed_total"] > 0  # a run with failures
    # a wrong key stops the job with 401; the message names the variable, not the value
    monkeypatch.setenv("E3D_TEST_KEY", canary + "-wrong")
    with pytest.raises(GenerationStopped, match="401"):
        run(
            tmp_path,
            fs,
            write_prompts(tmp_path / "p2.parquet", simple_convs(3, start=100)),
            bk=backends_cfg(fs, api_key_env="E3D_TEST_KEY"),
            log=log,
            out="o2.parquet",
        )
    monkeypatch.delenv("E3D_TEST_KEY")
    with pytest.raises(GenerationStopped, match="E3D_TEST_KEY"):
        run(
            tmp_path,
            fs,
            write_prompts(tmp_path / "p3.parquet", simple_convs(3, start=200)),
            bk=backends_cfg(fs, api_key_env="E3D_TEST_KEY"),
            log=log,
            out="o3.parquet",
        )
    assert log.read_text().count("done") >= 1
    hits = [p for p in tmp_path.rglob("*") if p.is_file() and canary.encode() in p.read_bytes()]
    assert hits == []


def test_mode_all_uses_regenerated_history(tmp_path, fs):
    conv = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first q"},
        {"role": "assistant", "content": "orig one"},
        {"role": "user", "content": "second q"},
        {"role": "assistant", "content": "orig two"},
    ]
    prompts = write_prompts(tmp_path / "p.parquet", [conv, conv[:3]])
    s = run(tmp_path, fs, prompts, gen=gen_cfg(mode="all"))
    assert s["sent"] == 3 and s["ok"] == 2
    rows = sorted(pq.read_table(tmp_path / "out.parquet").to_pylist(), key=lambda r: (r["sample_id"], r["turn"]))
    assert [(r["sample_id"], r["turn"]) for r in rows] == [("s0000", 2), ("s0000", 4), ("s0001", 2)]
    first, second = rows[0], rows[1]
    assert json.loads(first["messages"]) == conv[:2]
    hist = json.loads(second["messages"])
    assert hist[2] == {"role": "assistant", "content": first["content"]} and hist[2]["content"] != "orig one"
    assert hist[:2] == conv[:2] and hist[3] == conv[3] and len(hist) == 4
    # resume in mode all walks the journal through the regenerated history
    assert run(tmp_path, fs, prompts, gen=gen_cfg(mode="all"), out="again.parquet")["sent"] == 0


def test_agent_trajectory_tools_passed_through(tmp_path, fs):
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
    conv = [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
        {"role": "assistant", "content": "done"},
    ]
    prompts = write_prompts(tmp_path / "p.parquet", [conv], tools=tools)
    run(tmp_path, fs, prompts)
    (row,) = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert row["turn"] == 4 and json.loads(row["messages"]) == conv[:4] and json.loads(row["tools"]) == tools
    sent_body = {"messages": conv[:4], "tools": tools, "max_tokens": 30, "temperature": 1.0, "top_p": 1.0}
    assert fs.stats()["completed_by_body"] == {body_hash(sent_body): 1}
    assert row["request_key"] == request_key(
        "ds",
        "s0000",
        4,
        "tiny-target",
        conv[:4],
        tools,
        {"max_tokens": 30, "temperature": 1.0, "top_p": 1.0, "extra_body": {}},
    )


def test_bad_prompts_fail_with_reason_without_requests(tmp_path, fs):
    good = simple_convs(2)
    convs = good + ["not json", [{"role": "system", "content": "only a system prompt"}]]
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    s = run(tmp_path, fs, prompts)
    rows = {r["sample_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    assert s["sent"] == 2 and s["failed"] == {"bad_prompt": 2}
    assert rows["s0002"]["error"].startswith("bad_prompt") and "row 2" in rows["s0002"]["error"]
    assert rows["s0003"]["status"] == "failed" and "user/tool" in rows["s0003"]["error"]


def test_completion_token_budget_overshoot_bounded(tmp_path, fs):
    fs.app.config.update({"min_tokens": 20, "max_tokens": 40, "latency_min_s": 0.01, "latency_max_s": 0.03})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(60))
    conc = 4
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(max_tokens=40, budget_completion_tokens=400),
        bk=backends_cfg(fs, max_concurrency=conc),
    )
    assert s["stopped_by"] == "budget_completion_tokens"
    assert 400 <= s["total_completion_tokens"] <= 400 + conc * 40
    assert s["not_sent"] > 0 and s["ok"] + s["not_sent"] == 60
    assert pq.read_table(tmp_path / "out.parquet").num_rows == s["ok"]  # never-sent samples get no row
    # a rerun with the same budget sends nothing (journaled spend counts)
    assert (
        run(tmp_path, fs, prompts, gen=gen_cfg(max_tokens=40, budget_completion_tokens=400), out="b.parquet")["sent"]
        == 0
    )


def test_budget_holds_when_most_attempts_get_429(tmp_path, fs):
    """Requests backing off after 429s give their task permit back; every retry is gated by the budget like a
    new request, so a 429 storm can't admit a crowd of requests that all complete after the budget is spent."""
    fs.app.config.update({"p429": 0.7, "retry_after_s": 0.01, "min_tokens": 10, "max_tokens": 10, "seed": 2})
    fs.app.reset()
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(120))
    conc = 2
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(max_tokens=10, budget_completion_tokens=50, max_retries=30),
        bk=backends_cfg(fs, max_concurrency=conc),
    )
    assert s["stopped_by"] == "budget_completion_tokens" and s["retries"] > 5
    assert 50 <= s["total_completion_tokens"] <= 50 + conc * 10
    assert s["ok"] + s["not_sent"] == 120 and s["failed"] == {}


def test_usd_budget_and_sample_cap(tmp_path, fs):
    fs.app.config.update(
        {
            "min_tokens": 30,
            "max_tokens": 30,
            "price_out": 0.001,
            "price_in": 0.0,
            "latency_min_s": 0.01,
            "latency_max_s": 0.02,
        }
    )
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(50))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(budget_usd=0.3), bk=backends_cfg(fs, max_concurrency=3))
    assert s["stopped_by"] == "budget_usd"
    assert 0.3 <= s["total_cost_usd"] <= 0.3 + 3 * 0.03 + 1e-9
    s2 = run(tmp_path, fs, prompts, gen=gen_cfg(max_samples=20), out="cap.parquet", num_shards=2)
    assert s2["stopped_by"] == "max_samples" and s2["over_max_samples"] == 40
    assert pq.read_table(tmp_path / "cap.parquet").num_rows == 10


def test_priority_overflow_and_ejection(tmp_path, fs):
    fs.app.config.update({"latency_min_s": 0.05, "latency_max_s": 0.05})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    bk = {**backends_cfg(fs, name="first", max_concurrency=2), **backends_cfg(fs, name="second", max_concurrency=2)}
    s = run(tmp_path, fs, prompts, gen=gen_cfg(backends=["first", "second"]), bk=bk)
    assert s["by_backend"]["first"] >= 15 and s["by_backend"]["second"] >= 15 and s["ok"] == 40
    assert fs.stats()["max_in_flight"] <= 4
    # a dead first backend (connection refused) is taken out; its requests go to the next one
    from eagle3_data.backends import free_port

    dead = {
        "dead": dict(
            type="openai",
            base_url=f"http://127.0.0.1:{free_port()}/v1",
            model="x",
            api_key_env=None,
            max_concurrency=4,
            timeout_s=1.0,
        )
    }
    bk2 = {**dead, **backends_cfg(fs, name="live", max_concurrency=2)}
    s2 = run(
        tmp_path,
        fs,
        write_prompts(tmp_path / "p2.parquet", simple_convs(30, start=50)),
        gen=gen_cfg(backends=["dead", "live"], max_retries=30),
        bk=bk2,
        out="o2.parquet",
    )
    assert s2["ok"] == 30 and s2["by_backend"] == {"live": 30}
    # a single retry is enough: a retry after a backend fault waits for another backend rather than the same one
    s3 = run(
        tmp_path,
        fs,
        write_prompts(tmp_path / "p3.parquet", simple_convs(40, start=100)),
        gen=gen_cfg(backends=["dead", "live"], max_retries=1),
        bk=bk2,
        out="o3.parquet",
    )
    assert s3["ok"] == 40 and s3["failed"] == {} and s3["by_backend"] == {"live": 40}


def test_debug_logs_of_every_library_never_show_the_key(tmp_path, fs, monkeypatch):
    """Even with httpx/httpcore/aiohttp/asyncio at DEBUG (they log request lines and response headers), the key or
    the Authorization header never reaches a log record or a traceback."""
    import logging

    canary = "sk-or-CANARY-debug-91b2"
    monkeypatch.setenv("E3D_TEST_KEY", canary)
    fs.app.config.update({**ACCEPTANCE_FAULTS, "require_key": canary, "p5xx": 0.2, "hang_s": 1.5})
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    h = Grab(level=logging.DEBUG)
    h.setFormatter(logging.Formatter("%(name)s %(message)s"))
    names = ("", "httpx", "httpcore", "aiohttp", "asyncio", "eagle3_data", "hpack", "h11")
    old = {n: logging.getLogger(n).level for n in names}
    root = logging.getLogger()
    root.addHandler(h)
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.DEBUG)
        s = run(
            tmp_path,
            fs,
            write_prompts(tmp_path / "p.parquet", simple_convs(30)),
            gen=gen_cfg(max_retries=1, unpaid_failures="keep"),
            bk=backends_cfg(fs, api_key_env="E3D_TEST_KEY", headers={"X-Title": "eagle3-data-test"}),
        )
        assert s["ok"] > 0 and s["failed_total"] > 0
        monkeypatch.setenv("E3D_TEST_KEY", canary + "-wrong")  # 401: the fatal path formats an error message
        with pytest.raises(GenerationStopped, match="401") as ei:
            run(
                tmp_path,
                fs,
                write_prompts(tmp_path / "p2.parquet", simple_convs(3, start=100)),
                bk=backends_cfg(fs, api_key_env="E3D_TEST_KEY"),
                out="o2.parquet",
            )
        assert canary not in str(ei.value) and canary not in repr(ei.value.__context__)
    finally:
        root.removeHandler(h)
        for n, lv in old.items():
            logging.getLogger(n).setLevel(lv)
    assert any(r.startswith("asyncio") for r in records)  # the DEBUG loggers really were on
    assert [r for r in records if canary in r or "Bearer" in r] == []


def test_prompt_with_an_escaped_unpaired_surrogate_is_a_bad_prompt_row(tmp_path, fs):
    convs = simple_convs(5)
    convs[2][0]["content"] = "broken emoji \ud83d here"  # json.dumps escapes it: valid UTF-8 text
    convs[3][0]["content"] = "valid pair \ud83d\ude00 here"  # a real emoji: fine
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    s = run(tmp_path, fs, prompts)
    assert s["ok"] == 4 and s["failed"] == {"bad_prompt": 1} and s["sent"] == 4
    rows = {r["sample_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}
    bad = [r for r in rows.values() if r["status"] == "failed"]
    assert len(bad) == 1 and "unpaired surrogate" in bad[0]["error"] and "row 2" in bad[0]["error"]


def test_max_samples_parts_add_up_to_the_cap_across_shards():
    from eagle3_data.generate import shard_share

    for cap, n in ((2, 4), (10, 3), (7, 7), (0, 2), (5, 1), (1000, 64)):
        parts = [shard_share(cap, n, f"{i:03d}") for i in range(n)]
        assert sum(parts) == cap and max(parts) - min(parts) <= 1, (cap, n, parts)
    assert shard_share(10, 3, "custom") == 4


def test_budget_stop_says_which_budget_and_how_many_were_not_sent(tmp_path, fs):
    """The job's last lines name the budget that stopped it (where the config sets it, its value and this shard's
    share), what was spent and how many samples were never sent; ``done`` counts only samples with an outcome."""
    fs.app.config.update(
        {
            "min_tokens": 30,
            "max_tokens": 30,
            "price_out": 0.001,
            "price_in": 0.0,
            "latency_min_s": 0.01,
            "latency_max_s": 0.02,
        }
    )
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(50))
    log = tmp_path / "job.log"
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(budget_usd=0.6),
        bk=backends_cfg(fs, max_concurrency=3),
        log=log,
        num_shards=2,
        budget_sources={"budget_usd": "datasets.ds.generation.budget_usd"},
    )
    assert s["stopped_by"] == "budget_usd" and s["not_sent"] > 0 and s["ok"] + s["not_sent"] == 50
    text = log.read_text()
    finished = [ln for ln in text.splitlines() if "finished:" in ln]
    assert len(finished) == 1
    assert f"finished: {s['ok']}/50 done" in finished[0]
    assert finished[0].endswith(f"stopped by budget_usd: {s['not_sent']} of 50 samples not sent")
    assert f"${s['total_cost_usd']:.4f} of $0.3000 budget_usd" in finished[0]
    warn = [ln for ln in text.splitlines() if "WARNING" in ln and "stopped by budget_usd" in ln]
    assert len(warn) == 1
    assert (
        f"[ds/000] stopped by budget_usd (datasets.ds.generation.budget_usd = $0.6000, this shard's share "
        f"$0.3000 of 2 shards): ${s['total_cost_usd']:.4f} spent; {s['not_sent']} of 50 samples not sent"
    ) in warn[0]


def test_progress_lines_in_a_log_file_are_plain_lines(tmp_path, fs):
    """A log file (not a terminal) gets one plain progress line per interval: no carriage returns, the count, the
    rate and ETA, in flight, tok/s, dollars, outcomes; with a token budget, tokens of the budget."""
    fs.app.config.update(
        {
            "min_tokens": 10,
            "max_tokens": 10,
            "latency_min_s": 0.15,
            "latency_max_s": 0.15,
            "price_out": 0.0001,
            "price_in": 0.0,
        }
    )
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    log = tmp_path / "job.log"
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(max_tokens=10, budget_completion_tokens=100000),
        bk=backends_cfg(fs, max_concurrency=2),
        log=log,
        out="a.parquet",
    )
    assert s["ok"] == 30 and s["not_sent"] == 0
    text = log.read_text()
    assert "\r" not in text
    lines = [ln.split("[ds/000] ", 1)[1] for ln in text.splitlines() if " done " in ln and "|" in ln]
    assert len(lines) >= 3  # ~2.3 s at 0.5 s per line, + the last one
    import re

    pat = re.compile(
        r"^(finished: )?(\d+)/30 done +(\d+)%\|[#0-9 ]{10}\| \[\d\d:\d\d<(\d\d:\d\d|\?), +"
        r"(\?|[\d.]+) samples/s\] \| in flight (\d) \| [\d.,]+ tok/s \| \$[\d.]+ spent \| "
        r"([\d,]+) of 100,000 budget_completion_tokens( \(budget in ~[\d:]+\))? \| "
        r"ok (\d+), failed 0, journal 0 \| retries \d+, requests \d+$"
    )
    for ln in lines:
        m = pat.match(ln)
        assert m, ln
        n = int(m.group(2))
        assert int(m.group(3)) == 100 * n // 30 or abs(int(m.group(3)) - 100 * n / 30) < 1
        assert int(m.group(6)) <= 2 and int(m.group(9)) == n
        assert int(m.group(7).replace(",", "")) == 10 * n
    assert lines[-1].startswith("finished: 30/30 done 100%")
    assert "in flight 0" in lines[-1] and "$0.0300 spent" in lines[-1]
    # rerun: everything answered by the journal, nothing sent, the rate counts no journaled sample
    s2 = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(max_tokens=10),
        bk=backends_cfg(fs, max_concurrency=2),
        log=log,
        out="b.parquet",
    )
    assert s2["sent"] == 0 and s2["from_journal"] == 30
    last = [ln for ln in log.read_text().splitlines() if "finished:" in ln][-1]
    assert "finished: 30/30 done 100%" in last and "?" in last and "journal 30" in last


def test_a_shard_answered_from_the_journal_reads_back_only_the_journal_files_holding_its_keys(
    tmp_path, fs, monkeypatch
):
    """At its end a job writes the responses the journal answered from the files the resume index found them in,
    not from every shard's journal of the dataset (a build after the forecast's pilot would otherwise parse every
    other shard's whole journal, once per shard)."""
    import eagle3_data.generate.output as g

    for k, shard in enumerate(("000", "001")):
        p = write_prompts(
            tmp_path / f"p{shard}.parquet", simple_convs(6, start=10 * k), ids=[f"k{k}{i}" for i in range(6)]
        )
        run(tmp_path, fs, p, shard=shard, out=f"out{shard}.parquet")
    opened = []
    real = g.journal_batches
    monkeypatch.setattr(
        g, "journal_batches", lambda path, *a, **kw: (opened.append(Path(path).name), real(path, *a, **kw))[1]
    )
    s = run(tmp_path, fs, tmp_path / "p001.parquet", shard="001", out="again.parquet")
    assert s["from_journal"] == 6 and s["sent"] == 0
    assert opened == ["001.jsonl"]
    assert sorted(pq.read_table(tmp_path / "again.parquet").column("sample_id").to_pylist()) == [
        f"k1{i}" for i in range(6)
    ]


def test_a_response_whose_cost_is_being_looked_up_when_the_job_stops_is_journaled(tmp_path, fs):
    """OpenRouter cost lookups wait seconds for the stats; when the job stops meanwhile (here a 402 on a later
    request: credits ran out) the paid response is journaled without its cost, never requested again."""
    fs.configure(omit_cost=True, cost_404s=100, fail_after=3, fail_status=402, latency_min_s=0.0, latency_max_s=0.0)
    p = write_prompts(tmp_path / "p.parquet", simple_convs(6))
    bk = backends_cfg(fs, cost_lookup=True, cost_lookup_delay_s=2.0, max_concurrency=3)
    with pytest.raises(GenerationStopped):
        run(tmp_path, fs, p, bk=bk)
    st = fs.stats()
    lines = (tmp_path / "journal" / "ds" / "000.jsonl").read_text().splitlines()
    assert st["completed"] == 3 and len(lines) == 3  # every paid reply is in the journal
    assert all(json.loads(ln)["cost_usd"] is None for ln in lines)
    fs.configure(fail_after=None, cost_404s=0)
    s = run(tmp_path, fs, p, bk=bk)
    assert s["from_journal"] == 3 and s["sent"] == 3
    assert max(fs.stats()["completed_by_body"].values()) == 1, "a paid response was requested again"


def test_a_prompt_larger_than_max_prompt_bytes_is_a_named_reject_never_sent(tmp_path, fs):
    convs = simple_convs(5)
    convs[2][0]["content"] = "x" * 5000
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_prompt_bytes=2000))
    assert s["failed"] == {"prompt_too_large": 1} and s["ok"] == 4 and fs.app.requests == 4
    (row,) = [r for r in pq.read_table(tmp_path / "out.parquet").to_pylist() if r["status"] == "failed"]
    assert row["sample_id"] == "s0002" and row["messages"] == "[]"  # the oversized prompt is not copied either
    assert row["error"] == (
        f"prompt_too_large: {prompts} row 2: 5,079 bytes of messages and tools > "
        "generation.max_prompt_bytes 2,000: not sent (raise generation.max_prompt_bytes to "
        "send it)"
    )


def test_the_responses_parquet_has_the_generation_id_of_each_reply(tmp_path, fs):
    """The backend's id of each reply (OpenRouter's billing record) is a column, for new and journaled replies."""
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    run(tmp_path, fs, prompts)
    ids = {f"gen-{body_hash(b)}" for b in fs.app.bodies}
    first = pq.read_table(tmp_path / "out.parquet")
    assert "generation_id" in first.column_names and set(first.column("generation_id").to_pylist()) == ids
    run(tmp_path, fs, prompts, out="again.parquet")  # read back from the journal
    assert set(pq.read_table(tmp_path / "again.parquet").column("generation_id").to_pylist()) == ids


def test_sporadic_429s_do_not_slow_the_backend_down(tmp_path, fs, caplog):
    """5 % of requests refused with 429 (as a busy provider does): retried as before, the backend keeps its
    requests in flight (the adaptive back-off is for storms: most answers 429s)."""
    fs.app.config.update(
        {
            "p429": 0.05,
            "retry_after_s": 0.05,
            "latency_min_s": 0.02,
            "latency_max_s": 0.05,
            "fault_at": {"p429": "start"},
            "seed": 9,
        }
    )
    fs.app.reset()
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(200))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=8))
    assert s["ok"] == 200 and fs.app.outcomes["429"] >= 5 and s["retry_reasons"] == {"http_429": fs.app.outcomes["429"]}
    assert fs.app.max_in_flight == 8 and not [r for r in caplog.records if "rate limited" in r.getMessage()]
