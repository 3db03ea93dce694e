"""Backend-level request settings, SGLang native /generate, OpenRouter cost lookup, token limits, streamed output.

All against the fault server (eagle3_data.testing.fault_server) on loopback; the native path uses the tiny target's real
tokenizer so that the stored output_ids are real target ids that the tokenize stage accepts as ``exact``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pyarrow.parquet as pq
import pytest

from eagle3_data.generate import GenerationStopped

from test_generate import backends_cfg, gen_cfg, rows_by_key, run, simple_convs, write_prompts

from eagle3_data import schemas
from eagle3_data.backends import Backend, BackendConfig
from eagle3_data.backends.native import build_native_body
from eagle3_data.backends.request import Payload


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from eagle3_data.settings import TinyTargetSettings
    from eagle3_data.tiny_target import build_tiny_target

    path = tmp_path_factory.mktemp("target") / "tiny"
    facts = build_tiny_target(path, settings=TinyTargetSettings.defaults(seed=0))
    return path, facts["special_token_ids"]


# ------------------------------------------------------------------------------------------ backend settings


def test_backend_settings_reach_every_request_body_but_not_the_key(tmp_path, fs):
    provider = {
        "order": ["deepinfra", "together"],
        "only": ["deepinfra", "together"],
        "ignore": ["x"],
        "allow_fallbacks": False,
        "quantizations": ["fp8"],
        "require_parameters": True,
        "data_collection": "deny",
    }
    reasoning = {"effort": "high", "exclude": False}
    bk = backends_cfg(
        fs,
        provider=provider,
        reasoning=reasoning,
        extra_body={"usage": {"include": True}},
        headers={"X-Title": "eagle3-data", "HTTP-Referer": "https://example.org"},
    )
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(6))
    s = run(tmp_path, fs, prompts, bk=bk, gen=gen_cfg(extra_body={"top_k": 20}))
    assert s["ok"] == 6 and len(fs.app.bodies) == 6
    for body, headers in zip(fs.app.bodies, fs.app.headers):
        assert body["provider"] == provider and body["reasoning"] == reasoning
        assert body["usage"] == {"include": True} and body["top_k"] == 20 and body["stream"] is False
        assert body["max_tokens"] == 30 and body["model"] == "vendor/model"
        assert headers["x-title"] == "eagle3-data" and headers["http-referer"] == "https://example.org"
    # backend settings are not part of the request key: the same prompts on a differently-set backend resume
    bk2 = backends_cfg(fs, provider={"order": ["other"]}, reasoning={"max_tokens": 100, "enabled": True})
    assert run(tmp_path, fs, prompts, bk=bk2, gen=gen_cfg(extra_body={"top_k": 20}), out="b.parquet")["sent"] == 0
    assert rows_by_key(tmp_path / "out.parquet") == rows_by_key(tmp_path / "b.parquet")


def test_dataset_extra_body_overrides_backend_and_sglang_reasoning_content(tmp_path, fs):
    fs.app.config.update({"reasoning_tokens": 7, "reasoning_field": "reasoning_content"})
    bk = backends_cfg(
        fs,
        type="sglang",
        extra_body={"chat_template_kwargs": {"thinking": True}, "separate_reasoning": True, "top_k": 5},
    )
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(3))
    run(tmp_path, fs, prompts, bk=bk, gen=gen_cfg(extra_body={"top_k": 50}))
    for body in fs.app.bodies:
        assert body["chat_template_kwargs"] == {"thinking": True} and body["separate_reasoning"] is True
        assert body["top_k"] == 50 and "provider" not in body  # the dataset's value wins
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert all(len(r["reasoning"].split()) == 7 and r["content"] and r["provider"] == "fault" for r in rows)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"type": "sglang", "provider": {"order": ["a"]}}, "provider routing is an OpenRouter setting"),
        ({"type": "openai", "reasoning": {"effort": "low"}}, "reasoning settings need"),
        ({"headers": {"Authorization": "Bearer x"}}, "must not carry credentials"),
        ({"type": "openai", "native_generate": True}, "native_generate needs type sglang"),
        ({"type": "sglang", "cost_lookup": True}, "cost_lookup needs type openrouter"),
        ({"extra_body": ["not", "a", "mapping"]}, "extra_body must be a mapping"),
    ],
)
def test_backend_config_errors_name_backend_and_key(bad, match):
    cfg = {"type": "openrouter", "base_url": "http://127.0.0.1:1/v1", "model": "m", **bad}
    with pytest.raises(ValueError, match=match) as ei:
        BackendConfig.from_dict("b1", cfg)
    assert "'b1'" in str(ei.value)


# ------------------------------------------------------------------------------------------ native /generate


def native_backend(fs, **kw) -> dict:
    return backends_cfg(
        fs,
        name="sgl",
        type="sglang",
        native_generate=True,
        model="local/tiny",
        extra_body={"sampling_params": {"top_k": 7}},
        **kw,
    )


@pytest.mark.parametrize("include_stop", [True, False])
def test_native_generate_exact_ids_reasoning_split_and_tokenize_exact(tmp_path, fs, tiny, include_stop):
    from eagle3_data.templates import load_target_tokens
    from eagle3_data.tokens import tokenize_rows

    path, sp = tiny
    # the tiny target is Kimi K2.5-like: its prompt ends in <think>, the server's ids start with the reasoning
    fs.app.config.update(
        {
            "gen_think": [None, sp["</think>"]],
            "gen_eot": sp["<|im_end|>"],
            "reasoning_tokens": 9,
            "min_tokens": 5,
            "max_tokens": 12,
            "gen_include_stop": include_stop,
        }
    )
    target = {"path": str(path), "template": "kimi-k25", "chat_template_kwargs": {}}
    convs = simple_convs(8)
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(backends=["sgl"], max_tokens=64, temperature=0.6, top_p=0.95, extra_body={"min_p": 0.1}),
        bk=native_backend(fs),
        target=target,
    )
    assert s["ok"] == 8 and s["by_backend"] == {"sgl": 8}
    tt = load_target_tokens(str(path), "kimi-k25")
    for body in fs.app.bodies:  # what reached /generate
        assert set(body) == {"input_ids", "sampling_params", "stream"}
        assert body["sampling_params"] == {
            "max_new_tokens": 64,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 7,
            "min_p": 0.1,
        }
    sent = sorted(tuple(b["input_ids"]) for b in fs.app.bodies)
    assert sent == sorted(tuple(tt.prompt_ids(c[:1], None)) for c in convs)
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    for r in rows:
        ids = r["output_ids"]
        assert sp["<think>"] not in ids and (ids[-1] == sp["<|im_end|>"]) == include_stop
        j = ids.index(sp["</think>"])
        assert r["reasoning"] == bytes(ids[:j]).decode() and len(r["reasoning"]) == 9
        end = len(ids) - (1 if include_stop else 0)
        assert r["content"] == bytes(ids[j + 1 : end]).decode() and 5 <= len(r["content"]) <= 12
        assert r["finish_reason"] == "stop" and r["reasoning_tokens"] == j + 1 and r["completion_tokens"] == len(ids)
        assert r["prompt_tokens"] == len(tt.prompt_ids(json.loads(r["messages"]), None)) and r["cost_usd"] is None
    toks = tokenize_rows(rows, tt)
    assert [t["ids_source"] for t in toks] == ["exact"] * 8 and not any(t["reject_reason"] for t in toks)
    for r, t in zip(rows, toks):  # the completion ids are the server's ids, + <|im_end|>
        comp = [x for x, m in zip(t["input_ids"], t["loss_mask"]) if m]
        assert comp == (r["output_ids"] if include_stop else r["output_ids"] + [sp["<|im_end|>"]])


def test_native_generate_truncated_non_reasoning_and_abort(tmp_path, fs, tiny):
    from eagle3_data.templates import load_target_tokens
    from eagle3_data.tokens import tokenize_rows

    path, sp = tiny
    fs.app.config.update(
        {"gen_eot": sp["<|im_end|>"], "min_tokens": 20, "max_tokens": 20, "gen_abort_rate": 0.3, "seed": 3}
    )
    fs.app.rng.seed(3)
    target = {"path": str(path), "template": "kimi-k2"}
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(10))
    s = run(
        tmp_path,
        fs,
        prompts,
        gen=gen_cfg(backends=["sgl"], max_tokens=12, max_retries=10),
        bk=native_backend(fs),
        target=target,
    )
    assert s["ok"] == 10 and s["retry_reasons"].get("aborted", 0) == fs.stats()["outcomes"]["abort"] > 0
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    for r in rows:
        assert r["finish_reason"] == "length" and len(r["output_ids"]) == 12 and r["reasoning"] is None
        assert r["content"] == bytes(r["output_ids"]).decode()
    toks = tokenize_rows(rows, load_target_tokens(str(path), "kimi-k2"))
    assert all(t["ids_source"] == "exact" and t["num_completion_tokens"] == 12 for t in toks)  # no end token added


def test_native_generate_needs_target(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(2))
    with pytest.raises(ValueError, match="native_generate.*target"):
        run(tmp_path, fs, prompts, gen=gen_cfg(backends=["sgl"]), bk=native_backend(fs))


def test_native_body_mapping():
    cfg = BackendConfig.from_dict(
        "s",
        {
            "type": "sglang",
            "base_url": "http://h:1/v1",
            "model": "m",
            "native_generate": True,
            "extra_body": {"rid_prefix": "x"},
        },
    )
    body = build_native_body(
        cfg,
        [1, 2],
        {
            "max_tokens": 9,
            "temperature": 0.0,
            "top_p": None,
            "extra_body": {"chat_template_kwargs": {"thinking": False}, "separate_reasoning": False, "stop": ["a"]},
        },
    )
    assert body == {
        "input_ids": [1, 2],
        "rid_prefix": "x",
        "stream": False,
        "sampling_params": {"max_new_tokens": 9, "temperature": 0.0, "stop": ["a"]},
    }
    assert cfg.root_url == "http://h:1"


# ------------------------------------------------------------------------------------------ cost lookup


def test_cost_lookup_by_generation_id_after_404s(tmp_path, fs):
    fs.app.config.update({"omit_cost": True, "cost_404s": 2, "price_out": 0.001})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    s = run(tmp_path, fs, prompts, bk=backends_cfg(fs, cost_lookup=True, cost_lookup_delay_s=0.01))
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert len(fs.app.costs) == 5
    assert sorted(r["cost_usd"] for r in rows) == sorted(fs.app.costs.values())
    assert all(n == 3 for n in fs.app.cost_lookups.values())  # 2 x 404, then the stats
    assert s["cost_usd"] == pytest.approx(sum(fs.app.costs.values()), abs=1e-6)
    # without cost_lookup the cost stays unknown (null), never guessed
    s2 = run(tmp_path, fs, write_prompts(tmp_path / "p2.parquet", simple_convs(3, start=50)), out="o2.parquet")
    assert [r["cost_usd"] for r in pq.read_table(tmp_path / "o2.parquet").to_pylist()] == [None] * 3
    assert s2["cost_usd"] == 0


def test_cost_lookup_gives_up_and_keeps_the_response(tmp_path, fs, caplog):
    fs.app.config.update({"omit_cost": True, "cost_404s": 100})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(2))
    with caplog.at_level("WARNING", logger="eagle3_data.generate"):
        s = run(
            tmp_path,
            fs,
            prompts,
            bk=backends_cfg(fs, cost_lookup=True, cost_lookup_delay_s=0.005),
            gen=gen_cfg(budget_usd=5.0),
        )
    assert s["ok"] == 2
    assert [r["cost_usd"] for r in pq.read_table(tmp_path / "out.parquet").to_pylist()] == [None, None]
    assert all(n == 5 for n in fs.app.cost_lookups.values())
    # a dollar budget can only count known costs: said once, not per response
    assert caplog.text.count("budget_usd is set but backend fault returned a response without a usable cost") == 1


# ------------------------------------------------------------------------------------------ token limit


def test_tokens_per_minute_limiter_waits():
    cfg = BackendConfig.from_dict(
        "t", {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m", "tokens_per_minute": 6000}
    )

    async def go():
        b = Backend(cfg)
        try:
            t0 = time.monotonic()
            await b._limits(10_000)  # over the per-minute capacity: charged as the whole minute's tokens
            t1 = time.monotonic()
            await b._limits(150)  # 6000/min = 100/s refill: ~1.5 s
            return t1 - t0, time.monotonic() - t1
        finally:
            await b.aclose()

    first, second = asyncio.run(go())
    assert first < 0.2 and 1.2 < second < 3.0


def test_tokens_per_minute_paces_a_run(tmp_path, fs):
    # est per request = len(body)//4 + max_tokens ~ 2035 tokens; 60,000/min -> a burst of ~29 requests, then
    # 1,000 tokens/s: 32 requests need ~5,000 tokens beyond the burst, i.e. several seconds
    n, tpm, mt = 32, 60_000, 2000
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(n))
    t0 = time.monotonic()
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_tokens=mt), bk=backends_cfg(fs, tokens_per_minute=tpm))
    wall = time.monotonic() - t0
    assert s["ok"] == n
    est = sum(
        len(
            json.dumps(
                {
                    "model": "vendor/model",
                    "messages": c[:1],
                    "max_tokens": mt,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "stream": False,
                },
                ensure_ascii=False,
            ).encode()
        )
        // 4
        + mt
        for c in simple_convs(n)
    )
    need = (est - tpm) / (tpm / 60)
    assert need > 2 and 0.8 * need <= wall <= need + 3


# ------------------------------------------------------------------------------------------ output writing


def test_output_written_from_journal_in_batches(tmp_path, fs):
    fs.app.config.update(**{"p5xx": 1.0})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(23))
    with pytest.raises(GenerationStopped, match="every request failed"):  # nothing journaled, no output
        run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=0), out="failed.parquet")
    fs.app.config.update(**{"p5xx": 0.0})
    run(tmp_path, fs, write_prompts(tmp_path / "p0.parquet", simple_convs(20)), out="half.parquet")
    s = run(tmp_path, fs, prompts, out="a.parquet", write_batch_rows=4)  # 20 journaled + 3 new
    assert s["from_journal"] == 20 and s["sent"] == 3
    pf = pq.ParquetFile(tmp_path / "a.parquet")
    assert pf.metadata.num_rows == 23
    assert pf.schema_arrow.equals(schemas.RESPONSES)
    assert sorted(r["sample_id"] for r in pf.read().to_pylist()) == [f"s{i:04d}" for i in range(23)]
    assert rows_by_key(tmp_path / "a.parquet") == {
        **rows_by_key(tmp_path / "half.parquet"),
        **{k: v for k, v in rows_by_key(tmp_path / "a.parquet").items() if int(v["sample_id"][1:]) >= 20},
    }


def test_checked_writer_rejects_bad_batches_and_leaves_path_untouched(tmp_path):
    row = dict(sample_id="a", dataset="d", turn=1, request_key="k1", status="ok", completion_tokens=3, cost_usd=0.1)
    out = tmp_path / "r.parquet"
    out.write_bytes(b"previous")
    with pytest.raises(schemas.SchemaError, match="request_key.*across batches.*k1"):
        with schemas.CheckedParquetWriter("responses", out) as w:
            w.write_rows([row])
            w.write_rows([{**row, "sample_id": "b"}])
    for bad, what in (
        ({"status": "done"}, "status"),
        ({"turn": -1}, "turn"),
        ({"cost_usd": -1.0}, "cost_usd"),
        ({"request_key": None}, "request_key"),
        ({"dataset": None}, "dataset"),
    ):
        with pytest.raises(schemas.SchemaError, match=f"{out}.*{what}"):
            with schemas.CheckedParquetWriter("responses", out) as w:
                w.write_rows([{**row, "request_key": "k0"}, {**row, **bad}])
    assert out.read_bytes() == b"previous" and list(tmp_path.iterdir()) == [out]
    with schemas.CheckedParquetWriter("responses", out) as w:
        w.write_rows([row, {**row, "request_key": "k2", "completion_tokens": None, "cost_usd": None}])
    t = pq.read_table(out)
    assert t.num_rows == 2 and t.schema.equals(schemas.RESPONSES)
    schemas.check(t, "responses")  # agrees with the pandera contract
    with schemas.CheckedParquetWriter("responses", tmp_path / "empty.parquet"):
        pass
    assert pq.read_table(tmp_path / "empty.parquet").num_rows == 0


def test_output_writer_arrow_path_and_python_fallback_agree(tmp_path, fs):
    from eagle3_data.generate import write_output

    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    run(tmp_path, fs, prompts, out="ref.parquet")
    jfile = tmp_path / "journal" / "ds" / "000.jsonl"
    lines = jfile.read_bytes().splitlines(keepends=True)
    # a torn fragment mid-file (a crash, then a rerun appended after it) and a duplicate of an earlier record
    jfile.write_bytes(b"".join(lines[:10]) + lines[10][:40] + b"\n" + b"".join(lines[10:]) + lines[3])
    keys = list(rows_by_key(tmp_path / "ref.parquet"))
    ref = rows_by_key(tmp_path / "ref.parquet")
    for block in (1 << 20, 4096, 200):  # whole file in arrow until the torn line; several blocks; too small
        out = tmp_path / f"o{block}.parquet"
        n = write_output(out, tmp_path / "journal", "ds", keys, [], batch_rows=7, block_bytes=block)
        assert n == 30 and rows_by_key(out) == ref
        if block == 4096:  # ~1 KB records: written batch by batch, never as one table
            assert pq.ParquetFile(out).metadata.num_row_groups >= 5
    with pytest.raises(RuntimeError, match="vanished"):
        write_output(tmp_path / "x.parquet", tmp_path / "journal", "ds", keys + ["nope"], [], 7)
    assert not (tmp_path / "x.parquet").exists()


def test_wanted_runs_takes_each_key_once_as_contiguous_slices():
    from eagle3_data.generate import wanted_runs

    wanted = {"a", "b", "c", "e"}
    assert wanted_runs(["a", "x", "b", "c", "b", "e"], wanted) == [(0, 1), (2, 4), (5, 6)]  # 2nd "b": taken
    assert wanted == set()
    assert wanted_runs(["p", "q"], {"z"}) == [] and wanted_runs([], {"a"}) == []
    assert wanted_runs(["a", "b"], {"a", "b", "c"}) == [(0, 2)]


def test_json_lines_batches_match_from_rows_and_checks_catch_duplicates_within_a_batch(tmp_path):
    rows = [
        dict(
            sample_id="s1",
            dataset="d",
            turn=1,
            request_key="k1",
            status="ok",
            content='héllo "q"\n',
            completion_tokens=3,
            cost_usd=0.25,
            output_ids=[1, 2, 70000],
            latency_s=1.5,
            extra_field="x",
        ),
        dict(sample_id="s2", dataset="d", turn=0, request_key="k2", status="failed", error="http_400: bad"),
    ]
    ref = schemas.from_rows([{k: v for k, v in r.items() if k != "extra_field"} for r in rows], schemas.RESPONSES)
    t = schemas.table_from_json_lines(b"".join(json.dumps(r).encode() + b"\n" for r in rows), schemas.RESPONSES)
    assert t.schema.equals(schemas.RESPONSES) and t.to_pylist() == ref.to_pylist()
    assert t.to_pylist()[1]["content"] is None and t.to_pylist()[0]["output_ids"] == [1, 2, 70000]
    out = tmp_path / "r.parquet"
    with pytest.raises(schemas.SchemaError, match="request_key.*check unique.*k1"):
        with schemas.CheckedParquetWriter("responses", out) as w:
            w.write_rows([rows[0], {**rows[1], "request_key": "k1"}])
    assert not out.exists()
    with schemas.CheckedParquetWriter("responses", out) as w:
        w.write_json_lines(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
        w.write_json_lines(b"\n")  # nothing: no empty row group
    assert pq.read_table(out).to_pylist() == ref.to_pylist() and pq.ParquetFile(out).metadata.num_row_groups == 1


def test_new_responses_are_streamed_into_the_output_and_stale_partials_removed(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(23))
    stale = tmp_path / ".out.parquet.abc123.tmp"  # a killed job's partial output
    stale.write_bytes(b"partial")
    s = run(tmp_path, fs, prompts, write_batch_rows=5)
    assert s["ok"] == 23 and not stale.exists()
    meta = pq.ParquetFile(tmp_path / "out.parquet").metadata
    # written while the job ran: one row group per 5 responses as they arrived (+ the last partial batch)
    assert meta.num_row_groups == 5 and meta.num_rows == 23
    assert [meta.row_group(i).num_rows for i in range(5)] == [5, 5, 5, 5, 3]


def test_generate_job_imports_neither_pandas_nor_pyarrow_compute_or_dataset(tmp_path, fs):
    """Each costs ~50 MB of RSS per job (generation_client benchmark); the job reads PROMPTS, writes new, journaled
    and failed rows, and resumes, without them. Run in a subprocess: pytest itself has pandas loaded."""
    import subprocess

    fs.app.config.update({"p5xx": 0.3, "seed": 3})
    fs.app.reset()
    convs = simple_convs(40) + [[{"role": "system", "content": "nothing to answer"}]]  # a bad_prompt failed row
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    code = """
import json, sys
from eagle3_data.generate import generate
from eagle3_data.settings import GenerateSettings
gen, bk, prompts, work = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
settings = GenerateSettings.defaults(target_name="t", generation=gen, backends=bk, journal_dir=f"{work}/journal")
runs = [generate(prompts, f"{work}/{out}", settings, shard="000") for out in ("a.parquet", "b.parquet")]
mods = sorted(m for m in sys.modules if m.split(".")[0] == "pandas" or m in ("pyarrow.compute", "pyarrow.dataset"))
print(json.dumps({"mods": mods, "runs": runs}))
"""
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            json.dumps(gen_cfg(max_retries=0, unpaid_failures="keep")),
            json.dumps(backends_cfg(fs)),
            str(prompts),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    first, second = res["runs"]
    assert res["mods"] == []
    assert first["failed"]["bad_prompt"] == 1 and first["failed_total"] > 1 and first["ok"] >= 20
    assert second["from_journal"] == first["ok"] and second["sent"] == first["failed_total"] - 1
    b = rows_by_key(tmp_path / "b.parquet")
    assert len(b) == 41 and sum(r["status"] == "ok" for r in b.values()) == second["ok"]
    a = rows_by_key(tmp_path / "a.parquet")
    assert all(b[k] == r for k, r in a.items() if r["status"] == "ok")  # journaled rows come back unchanged


def test_a_task_backing_off_gives_its_live_permit_back_while_it_sleeps():
    from eagle3_data.generate import Runner

    from eagle3_data.settings import GenerateSettings

    runner = Runner(
        GenerateSettings.defaults(dataset="d", target_name="t"), records={}, journal=None, pool=None, state=None
    )

    async def scenario():
        runner.live = live = asyncio.Semaphore(1)
        runner.max_backing_off = 1
        await live.acquire()  # the retrying task's permit
        sleeper = asyncio.create_task(runner.backoff_sleep(0.1))
        await asyncio.sleep(0.02)
        await asyncio.wait_for(live.acquire(), 0.05)  # a new task gets the permit during the backoff
        await asyncio.sleep(0.2)
        assert not sleeper.done()  # slept; now waits for a permit again
        live.release()
        await asyncio.wait_for(sleeper, 1.0)
        assert live.locked()  # ... and holds it once it wakes up
        return True

    assert asyncio.run(scenario())


# ------------------------------------------------------------------------------------------ hostile replies


def mock_backend(handler, monkeypatch=None, timeout_s=5.0, **cfg):
    """A Backend whose HTTP goes to ``handler`` (an httpx.MockTransport handler) instead of the network."""
    import httpx

    # the backend's own HTTP session (its headers: Authorization as the backend sets it) over a mock transport
    return Backend(
        BackendConfig.from_dict(
            "m", {"type": "openrouter", "base_url": "http://mock/v1", "model": "m", "timeout_s": timeout_s, **cfg}
        ),
        transport=httpx.MockTransport(handler),
    )


def post(be, body=b"{}"):
    async def go():
        try:
            return await be.send(Payload(body))
        finally:
            await be.aclose()

    return asyncio.run(go())


def reply(**over):
    body = {
        "id": "gen-1",
        "choices": [{"finish_reason": "stop", "message": {"content": "fine"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.001},
    }
    body.update(over)
    return body


def test_odd_reply_shapes_are_parsed_or_retried_never_crash():
    import httpx

    from eagle3_data.backends import RetryableError

    def serve(body):
        return mock_backend(lambda req: httpx.Response(200, json=body))

    f = post(serve(reply(usage=[1, 2])))  # usage not an object: counts unknown
    assert f["content"] == "fine" and f["completion_tokens"] is None and f["cost_usd"] is None
    f = post(serve(reply(usage={"completion_tokens": 2, "completion_tokens_details": [1]})))
    assert f["completion_tokens"] == 2 and f["reasoning_tokens"] is None
    parts = [{"type": "text", "text": "hello "}, {"type": "image_url"}, {"type": "text", "text": "world"}]
    f = post(
        serve(
            reply(
                choices=[
                    {
                        "finish_reason": "stop",
                        "message": {"content": parts, "reasoning": [{"type": "text", "text": "think"}]},
                    }
                ]
            )
        )
    )
    assert (f["content"], f["reasoning"]) == ("hello world", "think")  # content parts are joined, not dropped
    for bad, reason in (
        ({"content": [{"type": "image_url"}]}, "empty_response"),  # no text part, no usage
        ({"content": "x", "tool_calls": "not a list"}, "malformed_json"),
        ({"content": "x", "tool_calls": {"name": "f"}}, "malformed_json"),
    ):
        with pytest.raises(RetryableError) as ei:
            post(serve(reply(choices=[{"message": bad}], usage=None)))
        assert ei.value.reason == reason


def test_transport_failures_and_trickling_replies_are_retryable_timeouts():
    import httpx

    from eagle3_data.backends import RetryableError

    bad_gzip = mock_backend(
        lambda req: httpx.Response(200, content=b"not gzip at all", headers={"Content-Encoding": "gzip"})
    )
    with pytest.raises(RetryableError) as ei:
        post(bad_gzip)
    assert ei.value.reason == "http_error" and "DecodingError" in ei.value.message

    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self):
            for _ in range(100):  # a byte every 0.1 s: each read is quick, the whole is not
                await asyncio.sleep(0.1)
                yield b" "

    t0 = time.monotonic()
    with pytest.raises(RetryableError) as ei:
        post(mock_backend(lambda req: httpx.Response(200, stream=Trickle()), timeout_s=0.5))
    assert ei.value.reason == "timeout" and time.monotonic() - t0 < 2.0


def test_error_texts_are_scrubbed_of_the_api_key_and_of_surrogates(monkeypatch):
    import httpx

    from eagle3_data.backends import FatalBackendError, RetryableError, SampleError

    monkeypatch.setenv("MOCK_KEY", "sk-or-v1-0123456789abcdef\n")  # pasted with its newline: stripped, works
    seen = []

    def echo(req):
        seen.append(req.headers["authorization"])
        body = json.dumps({"error": {"message": f"bad header {req.headers['authorization']} \ud800"}})  # escaped
        return httpx.Response(400, content=body.encode())

    with pytest.raises(SampleError) as ei:
        post(mock_backend(echo, api_key_env="MOCK_KEY"))
    assert seen == ["Bearer sk-or-v1-0123456789abcdef"]
    assert "0123456789abcdef" not in str(ei.value) and "[api key]" in ei.value.message
    assert str(ei.value).encode("utf-8")  # the lone surrogate became "?"
    with pytest.raises(RetryableError) as ei:  # errors inside a 200 body too
        post(
            mock_backend(
                lambda r: httpx.Response(200, json={"error": {"message": r.headers["authorization"]}}),
                api_key_env="MOCK_KEY",
            )
        )
    assert "0123456789abcdef" not in str(ei.value)
    monkeypatch.setenv("MOCK_KEY", "sk-or v1\u00e9")  # can't be a header: stop, name the variable
    with pytest.raises(FatalBackendError, match="MOCK_KEY.*characters an HTTP header can't carry") as ei:
        mock_backend(echo, api_key_env="MOCK_KEY")
    assert "sk-or" not in str(ei.value)


def test_looked_up_costs_that_are_not_a_price_count_as_misses():
    import httpx

    for value in (float("nan"), -0.5, True, "abc", None):
        be = mock_backend(
            lambda req, v=value: httpx.Response(200, content=json.dumps({"data": {"total_cost": v}}).encode()),
            cost_lookup=True,
            cost_lookup_delay_s=0.01,
        )

        async def go():
            try:
                return await be.lookup_cost("gen-1")
            finally:
                await be.aclose()

        assert asyncio.run(go()) is None and be.cost_lookup_misses == 1, value


def test_native_reply_with_odd_meta_info_is_retried_or_parsed(tiny):
    from eagle3_data.backends import RetryableError
    from eagle3_data.backends.native import parse_native_response
    from eagle3_data.templates import target_tokens

    tt = target_tokens({"path": str(tiny[0]), "template": "kimi-k2"})
    be = BackendConfig.from_dict(
        "s", {"type": "sglang", "base_url": "http://x/v1", "model": "m", "native_generate": True}
    )
    ids = [104, 105, tt.eot_ids[0]] if getattr(tt, "eot_ids", None) else [104, 105]
    f = parse_native_response(be, json.dumps({"output_ids": ids, "meta_info": [1, 2]}).encode(), 0.1, tt)
    assert f["output_ids"] == ids and f["finish_reason"] == "stop" and f["prompt_tokens"] is None
    with pytest.raises(RetryableError) as ei:
        parse_native_response(
            be, json.dumps({"output_ids": ids, "meta_info": {"finish_reason": "abort"}}).encode(), 0.1, tt
        )
    assert ei.value.reason == "aborted"


def test_journal_read_back_agrees_with_the_resume_index_on_rejected_records(tmp_path, fs):
    """A record the resume index skips (a negative cost, written by hand or a foreign tool) must not reach the
    output through the arrow path either: its valid duplicate later in the journal is the one used."""
    from eagle3_data.generate import write_output
    from eagle3_data.generate.journal import read_journal

    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(12))
    run(tmp_path, fs, prompts, out="ref.parquet")
    jfile = tmp_path / "journal" / "ds" / "000.jsonl"
    lines = jfile.read_bytes().splitlines(keepends=True)
    poisoned = json.loads(lines[4])
    poisoned.update(cost_usd=-1.0, content="POISON")
    jfile.write_bytes(b"".join(lines[:4]) + json.dumps(poisoned).encode() + b"\n" + b"".join(lines[4:]))
    recs, st = read_journal(tmp_path / "journal", "ds")
    assert st["bad_lines"] == 1 and recs[poisoned["request_key"]]["content"] != "POISON"
    keys = list(rows_by_key(tmp_path / "ref.parquet"))
    for block in (1 << 20, 2048):
        out = tmp_path / f"o{block}.parquet"
        assert write_output(out, tmp_path / "journal", "ds", keys, [], batch_rows=5, block_bytes=block) == 12
        assert rows_by_key(out) == rows_by_key(tmp_path / "ref.parquet")
    s = run(tmp_path, fs, prompts, out="rerun.parquet")  # the stage itself: nothing sent again
    assert s["sent"] == 0 and rows_by_key(tmp_path / "rerun.parquet") == rows_by_key(tmp_path / "ref.parquet")
