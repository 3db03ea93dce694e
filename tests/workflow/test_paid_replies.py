"""Paid replies are kept or refused with a named reason, never bought twice; errors no retry can fix are not
retried; a journal that can't be written stops the job in one line before it pays for more."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from test_generate import backends_cfg, gen_cfg, gen_settings, run, simple_convs, write_prompts

from eagle3_data.generate import journal as journal_mod
from eagle3_data.generate import GenerationStopped
from eagle3_data.generate.journal import JournalWriteError, read_journal


def _read_only(monkeypatch, root: Path) -> None:
    """The file system under ``root`` is read-only (EROFS for every write open; works as root too)."""
    real_open = os.open

    def ro_open(path, flags, *a, **kw):
        if str(path).startswith(str(root)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(journal_mod.os, "open", ro_open)


def test_read_only_journal_is_one_line_and_nothing_is_sent(tmp_path, fs, monkeypatch):
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(6))
    run(tmp_path, fs, prompts)
    _read_only(monkeypatch, tmp_path / "journal")
    # everything journaled: the job needs no write and succeeds
    fs.app.reset()
    s = run(tmp_path, fs, prompts, out="again.parquet")
    assert s["from_journal"] == 6 and fs.app.requests == 0
    more = write_prompts(tmp_path / "p2.parquet", simple_convs(6, start=50))
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, more, out="more.parquet")
    assert "\n" not in str(e.value) and e.value.message.startswith(
        f"cannot write the response journal in {tmp_path / 'journal' / 'ds'}/: the file system is read-only"
    )
    assert fs.app.requests == 0


def test_unwritable_journal_directory_stops_before_any_request(tmp_path, fs):
    (tmp_path / "journal").write_text("a file where the journal directory should be")
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, prompts)
    assert e.value.message.startswith(f"cannot write the response journal in {tmp_path / 'journal' / 'ds'}/:")
    assert "rerun the same command" in e.value.hint and fs.app.requests == 0


def test_full_disk_stops_sending_and_a_rerun_pays_only_for_the_rest(tmp_path, fs, monkeypatch):
    """ENOSPC at the 6th record: the job ends with one line naming the directory and 'the disk is full'; it sent
    at most what was in flight after that; the rerun (space freed) sends only the requests not journaled or held."""
    import tempfile

    (tmp_path / "spill").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "spill"))
    fs.app.config.update({"latency_min_s": 0.02, "latency_max_s": 0.05})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    real_write = os.write
    calls = {"n": 0}

    def write(fd, data):
        if fd > 2 and bytes(data[:2]) == b'{"':
            calls["n"] += 1
            if calls["n"] > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(journal_mod.os, "write", write)
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, prompts, gen=gen_cfg(), bk=backends_cfg(fs, max_concurrency=4))
    assert "the disk is full" in e.value.message and str(tmp_path / "journal" / "ds") in e.value.message
    assert fs.app.completed <= 6 + 4  # at most the requests in flight when the write failed
    monkeypatch.setattr(journal_mod.os, "write", real_write)
    recs, _ = read_journal(tmp_path / "journal", "ds")
    held = [ln for p in journal_mod.held_dir(tmp_path / "journal", "ds").glob("*.jsonl") for ln in p.open()]
    assert len(recs) == 5 + len(held)  # the replies in flight that arrived: held, read like the journal
    deadline = time.monotonic() + 10
    while fs.app.in_flight and time.monotonic() < deadline:  # requests the stopped job dropped, still answering
        time.sleep(0.05)
    first = fs.app.completed
    fs.app.reset()
    s = run(tmp_path, fs, prompts)
    assert s["ok"] == 40 and s["from_journal"] == 5 + len(held) and fs.app.completed == 35 - len(held)
    assert first + fs.app.completed - 40 <= first - 5 - len(held)  # paid twice: only replies the job never got


def _failed(path) -> dict:
    rows = pq.read_table(path).to_pylist()
    return {r["sample_id"]: r["error"] for r in rows if r["status"] == "failed"}


def test_undecodable_bytes_are_a_named_reject_bought_once(tmp_path, fs):
    fs.app.config.update({"pbadbytes": 0.3, "seed": 3})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts)
    bad = fs.app.outcomes["badbytes"]
    assert bad >= 4 and s["failed"] == {"invalid_utf8": bad} and s["ok"] == 30 - bad
    assert fs.app.requests == 30 and max(fs.app.completed_by_body.values()) == 1  # no retry, nothing bought twice
    failed = _failed(tmp_path / "out.parquet")
    assert len(failed) == bad and all(e.startswith("invalid_utf8: the reply held 2 byte(s)") for e in failed.values())
    assert s["cost_usd"] > 0 and s["total_cost_usd"] == s["cost_usd"]  # the rejects were paid: counted
    fs.app.reset()
    again = run(tmp_path, fs, prompts, out="again.parquet")
    assert fs.app.requests == 0 and again["failed"] == {"invalid_utf8": bad} and again["from_journal"] == 30
    assert _failed(tmp_path / "again.parquet") == failed


def test_client_error_in_a_200_body_is_not_retried(tmp_path, fs):
    fs.app.config.update({"perror422body": 0.3, "seed": 4})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=6))
    n = fs.app.outcomes["error422body"]
    assert n >= 4 and s["failed"] == {"http_422": n} and fs.app.requests == 30 and s["retries"] == 0
    failed = _failed(tmp_path / "out.parquet")
    assert all("error 422 inside a 200 body: Unprocessable: max_tokens exceeds" in e for e in failed.values())


def test_reply_from_another_model_is_counted_or_refused(tmp_path, fs, caplog):
    fs.app.config.update({"model": "other-vendor/fallback-model"})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(8))
    s = run(tmp_path, fs, prompts)
    assert s["ok"] == 8 and s["other_model_replies"] == 8
    assert any("names model 'other-vendor/fallback-model', not 'vendor/model'" in r.message for r in caplog.records)
    # refused: a named reject, journaled (other prompts: the journal holds the 8 kept ones)
    fs.app.reset()
    with pytest.raises(Exception, match="every request failed"):
        run(
            tmp_path,
            fs,
            write_prompts(tmp_path / "p2.parquet", simple_convs(8, start=20)),
            gen=gen_cfg(reject_other_models=True),
            out="o2.parquet",
        )
    recs, _ = read_journal(tmp_path / "journal", "ds")
    refused = [r for r in recs.values() if r["status"] == "failed"]
    assert len(refused) == 8 and all(r["error"].startswith("other_model: the reply names model") for r in refused)
    assert all(r["content"] is None and r["cost_usd"] > 0 for r in refused)
    assert fs.app.requests == 8


def test_a_huge_reply_billed_as_a_few_tokens_is_refused_before_its_bulk_is_journaled(tmp_path, fs):
    fs.app.config.update({"pad_bytes": 10_000_000, "min_tokens": 29, "max_tokens": 29})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(3))
    with pytest.raises(Exception, match="every request failed"):
        run(tmp_path, fs, prompts, bk=backends_cfg(fs, timeout_s=30.0))
    assert fs.app.requests == 3  # not retried
    recs, _ = read_journal(tmp_path / "journal", "ds")
    assert len(recs) == 3 and all(r["error"].startswith("reply_too_large: 10,000,") for r in recs.values())
    assert sum(p.stat().st_size for p in (tmp_path / "journal").rglob("*.jsonl")) < 10_000


@pytest.mark.parametrize("key", ["sk-or-CANARY-echoed-9d1f", "0123456789abcdef"])
def test_an_api_key_echoed_in_a_reply_is_never_stored(tmp_path, fs, monkeypatch, key):
    monkeypatch.setenv("E3D_PAID_KEY", key)
    fs.app.config.update({"require_key": key, "echo_key": True})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(4))
    log = tmp_path / "logs" / "job.log"
    with pytest.raises(Exception, match="every request failed"):
        run(tmp_path, fs, prompts, bk=backends_cfg(fs, api_key_env="E3D_PAID_KEY"), log=log)
    recs, _ = read_journal(tmp_path / "journal", "ds")
    assert len(recs) == 4 and all(r["error"].startswith("api_key_in_reply:") for r in recs.values())
    hits = [p for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert hits == []


def test_short_keys_are_scrubbed_from_messages():
    from eagle3_data.backends.definition import BackendConfig
    from eagle3_data.backends.paid import scrub

    os.environ["E3D_SHORT_KEY"] = "abc12"
    try:
        cfg = BackendConfig.from_dict(
            "local",
            {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key_env": "E3D_SHORT_KEY"},
        )
        assert cfg.scrub("401: bad key abc12 (Bearer abc12)") == "401: bad key [api key] (Bearer [api key])"
    finally:
        del os.environ["E3D_SHORT_KEY"]
    assert scrub("x ab y", ["ab"]) == "x [api key] y"


def test_402_gives_replies_in_flight_the_grace_and_no_request_starts_after_it(tmp_path, fs, monkeypatch):
    """The 31st request gets 402 (credits, answered at once) while 7 replies of 0.2-0.4 s are in flight: every
    reply the server completed (paid) is journaled, none is bought again by the rerun, and no request reached the
    server after the first 402 had been answered."""
    from eagle3_data.backends import pool, transport

    fs.app.config.update(
        {
            "fail_after": 30,
            "fail_status": 402,
            "latency_min_s": 0.2,
            "latency_max_s": 0.4,
            "fault_at": {"fail_status": "start"},
        }
    )
    fs.app.reset()
    # the client's own clock: when each request started going out, when the first 402 reached it (the server in
    # this process answers under the GIL: its arrival times lag by tens of ms on a busy machine)
    starts, first_402 = [], []
    real_post, real_check = transport.HttpSession.post, pool.check_status

    async def post(self, url, body):
        starts.append(time.monotonic())
        return await real_post(self, url, body)

    def check(backend, resp):
        if resp.status_code == 402 and not first_402:
            first_402.append(time.monotonic())
        return real_check(backend, resp)

    monkeypatch.setattr(transport.HttpSession, "post", post)
    monkeypatch.setattr(pool, "check_status", check)
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(100))
    with pytest.raises(GenerationStopped, match="402") as ei:
        run(tmp_path, fs, prompts, bk=backends_cfg(fs, max_concurrency=8))
    assert first_402 and [t for t in starts if t > first_402[0]] == []  # no request started after it
    assert "\n" not in str(ei.value)
    deadline = time.monotonic() + 10
    while fs.app.in_flight and time.monotonic() < deadline:  # replies a stopped job dropped, still answering
        time.sleep(0.05)
    paid = fs.app.completed
    recs, _ = read_journal(tmp_path / "journal", "ds")
    assert paid == 30 and len(recs) == paid  # every paid reply, in flight when the 402 came, is journaled
    monkeypatch.undo()
    fs.app.config.update({"fail_after": None, "latency_min_s": 0.0, "latency_max_s": 0.0})
    fs.app.reset()
    s = run(tmp_path, fs, prompts)
    assert s["from_journal"] == paid and s["sent"] == 100 - paid == fs.app.completed  # nothing bought twice


def test_replies_arriving_after_the_journal_fails_are_kept_and_not_bought_again(tmp_path, fs, monkeypatch):
    """ENOSPC at the 6th record with 8 replies of 0.2-0.4 s in flight: no request starts after it, the replies
    in flight get the grace, and those the journal can't take are written to a fallback file the message names,
    readable by the owner only; the plain rerun reads it, buys none of them again and moves it into the journal."""
    import tempfile

    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    fs.app.config.update({"latency_min_s": 0.2, "latency_max_s": 0.4})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    real_write = os.write
    calls = {"n": 0}

    def write(fd, data):
        if fd > 2 and bytes(data[:2]) == b'{"':
            calls["n"] += 1
            if calls["n"] > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(journal_mod.os, "write", write)
    with pytest.raises(JournalWriteError) as e:
        run(tmp_path, fs, prompts, gen=gen_cfg(), bk=backends_cfg(fs, max_concurrency=8))
    monkeypatch.setattr(journal_mod.os, "write", real_write)
    msg = str(e.value)
    assert "\n" not in msg and "the disk is full" in msg
    (held,) = spill.glob(f"eagle3-held-{os.getuid()}/*/ds/000-*.jsonl")
    assert held.parent == journal_mod.held_dir(tmp_path / "journal", "ds")
    n_held = len(held.read_text().splitlines())
    assert fs.app.completed == 5 + n_held and n_held >= 3  # every paid reply: journaled or held
    assert (
        f"{n_held} paid replies that arrived after it were written to {held} (readable by you only): the rerun of "
        f"the same command reads them and moves them into {tmp_path / 'journal' / 'ds'}/ (not paid for again)" in msg
    )
    # the owner's alone: the file 0600, every folder from eagle3-held-<uid> down 0700
    assert held.stat().st_mode & 0o777 == 0o600
    assert {oct(p.stat().st_mode & 0o777) for p in held.parents if spill in p.parents} == {"0o700"}
    first = fs.app.completed
    fs.app.reset()
    s = run(tmp_path, fs, prompts)  # the plain rerun: nothing moved by hand
    assert s["ok"] == 40 and s["from_journal"] == first and fs.app.completed == 40 - first  # none bought twice
    assert (
        not held.exists()
        and len((tmp_path / "journal" / "ds" / f"held-{held.name}").read_text().splitlines()) == n_held
    )
    fs.app.reset()
    assert run(tmp_path, fs, prompts, out="again.parquet")["from_journal"] == 40 and fs.app.requests == 0


def test_a_cut_off_200_is_a_named_reject_journaled_raw_once(tmp_path, fs):
    """A 200 whose JSON body is cut off is billed: it is not retried (billed again), but journaled once with its
    raw text as a paid reject ``undecodable_reply``, and the rerun does not send it."""
    fs.app.config.update({"pmalformed": 0.3, "seed": 6})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=6))
    n = fs.app.outcomes["malformed"]
    assert n >= 4 and s["failed"] == {"undecodable_reply": n} and s["failed_unpaid"] == 0 and s["retries"] == 0
    assert fs.app.requests == 30 and max(fs.app.billed_by_body.values()) == 1
    rejects = [r for r in read_journal(tmp_path / "journal", "ds")[0].values() if r["status"] == "failed"]
    assert len(rejects) == n and all(
        r["raw_reply"] == '{"id": "gen-x", "choices": [{"message": {"content": "trunc'
        and r["error"].startswith("undecodable_reply: the HTTP 200 reply is not JSON")
        for r in rejects
    )
    assert all(e.startswith("undecodable_reply: ") for e in _failed(tmp_path / "out.parquet").values())
    fs.app.reset()
    again = run(tmp_path, fs, prompts, out="again.parquet")
    assert fs.app.requests == 0 and again["failed"] == {"undecodable_reply": n}


def test_a_client_error_inside_choices_fails_at_once_like_the_top_level_one(tmp_path, fs):
    fs.app.config.update({"perror200": 0.3, "error200_code": 413, "seed": 4})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=6))
    n = fs.app.outcomes["error200"]
    assert n >= 4 and s["failed"] == {"http_413": n} and fs.app.requests == 30 and s["retries"] == 0
    assert all(
        e.startswith("http_413: error 413 inside a 200 body (choices[0].error): upstream provider error")
        for e in _failed(tmp_path / "out.parquet").values()
    )


def _key_echoed(tmp_path, fs, monkeypatch, key: str, n: int, **server) -> dict:
    """Run ``n`` prompts against a fault server that echoes the configured key (``server``: its config); the job
    stops (every reply refused); returns the journal's records after checking the key is in no file."""
    monkeypatch.setenv("E3D_PAID_KEY", key)
    fs.app.config.update({"require_key": key, **server})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(n))
    with pytest.raises(GenerationStopped, match="every request failed"):
        run(tmp_path, fs, prompts, bk=backends_cfg(fs, api_key_env="E3D_PAID_KEY"), log=tmp_path / "logs" / "job.log")
    assert [p for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()] == []
    return read_journal(tmp_path / "journal", "ds")[0]


def test_a_key_in_any_field_of_a_reply_is_never_stored(tmp_path, fs, monkeypatch):
    """The reply's `model` (here, a provider echoing the key in it) is checked like its text: the reply is a paid
    reject api_key_in_reply, and the key is in no file (journal, output, log)."""
    key = "sk-or-CANARY-model-4e7a0c"
    recs = _key_echoed(tmp_path, fs, monkeypatch, key, 6, model=f"vendor/model {key}")
    assert len(recs) == 6 and all(
        r["error"] == "api_key_in_reply: the reply's model quotes a configured API key (not stored)"
        for r in recs.values()
    )
    assert all(r["model"] == "vendor/model [api key]" for r in recs.values())


def test_a_short_key_stops_the_job_before_any_request(tmp_path, fs, monkeypatch):
    monkeypatch.setenv("E3D_PAID_KEY", "test")
    fs.app.config.update({"require_key": "test"})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(4))
    with pytest.raises(GenerationStopped, match="the key in E3D_PAID_KEY is 4 characters; a key shorter than 16"):
        run(tmp_path, fs, prompts, bk=backends_cfg(fs, api_key_env="E3D_PAID_KEY"))
    assert fs.app.requests == 0


def test_a_key_in_a_source_prompt_is_a_named_reject_never_sent(tmp_path, fs, monkeypatch):
    key = "sk-or-CANARY-prompt-19c3d2"
    monkeypatch.setenv("E3D_PAID_KEY", key)
    fs.app.config.update({"require_key": key})
    convs = simple_convs(5)
    convs[1][0]["content"] = f"my key is {key}, keep it safe"
    prompts = write_prompts(tmp_path / "p.parquet", convs)
    s = run(tmp_path, fs, prompts, bk=backends_cfg(fs, api_key_env="E3D_PAID_KEY"))
    assert s["failed"] == {"api_key_in_prompt": 1} and s["ok"] == 4 and fs.app.requests == 4
    assert _failed(tmp_path / "out.parquet") == {
        "s0001": (
            f"api_key_in_prompt: {prompts} row 1: the prompt quotes a configured API key: not sent (its text is not "
            "copied here; remove the key from the source)"
        )
    }
    hits = [p for p in tmp_path.rglob("*") if p.is_file() and p != prompts and key.encode() in p.read_bytes()]
    assert hits == []


@pytest.mark.parametrize(
    "asked,replied,same",
    [
        ("openai/gpt-4o", "openai/gpt-4o-2024-08-06", True),  # a date suffix
        ("anthropic/claude-3-5-sonnet", "anthropic/claude-3-5-sonnet-20241022", True),
        ("moonshotai/kimi-k2", "moonshotai/kimi-k2-0905", True),  # a version suffix
        ("moonshotai/kimi-k2.5", "kimi-k2.5", True),  # the vendor left out
        ("moonshotai/kimi-k2.5", "MoonshotAI/Kimi-K2.5", True),  # case
        ("vendor/model:free", "vendor/model", True),  # an OpenRouter routing variant asked for
        ("vendor/model-x", "vendor/model", False),  # a shorter, older name: another model
        ("openai/gpt-4o", "openai/gpt-4o-mini", False),  # a longer name that is not a version
        ("a/model", "b/model", False),  # another vendor's
    ],
)
def test_a_reply_names_the_model_asked_for_only_as_the_same_id_or_a_versioned_one(asked, replied, same):
    from eagle3_data.backends.paid import same_model

    assert same_model(asked, replied) is same


def test_a_reply_from_a_shorter_older_name_counts_as_another_model(tmp_path, fs):
    fs.app.config.update({"model": "vendor/model"})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(4))
    s = run(tmp_path, fs, prompts, bk=backends_cfg(fs, model="vendor/model-x"))
    assert s["ok"] == 4 and s["other_model_replies"] == 4


# ------------------------------------------------------------------ issue 44: where paid replies still leaked


def test_a_reply_with_an_unpaired_surrogate_is_bought_once_and_a_named_reject(tmp_path, fs):
    """A billed reply whose text holds ``\\ud800`` (not storable as UTF-8) was retried and re-bought on every attempt
    and every rerun; it is journaled once as the paid reject ``invalid_unicode`` and never sent again."""
    fs.app.config.update({"psurrogate": 0.3, "seed": 8})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=6))
    n = fs.app.outcomes["surrogate"]
    assert n >= 4 and s["failed"] == {"invalid_unicode": n} and s["ok"] == 30 - n and s["retries"] == 0
    assert fs.app.requests == 30 and max(fs.app.billed_by_body.values()) == 1  # no retry: nothing bought twice
    failed = _failed(tmp_path / "out.parquet")
    assert len(failed) == n and all(
        e
        == "invalid_unicode: content has an unpaired surrogate at character "
        + e.split("character ", 1)[1].split(" ", 1)[0]
        + " (paid for: journaled, not bought again)"
        for e in failed.values()
    )
    assert s["cost_usd"] == pytest.approx(fs.app.billed_usd + sum(_surrogate_costs(tmp_path)), rel=1e-9)
    fs.app.reset()
    again = run(tmp_path, fs, prompts, out="again.parquet")
    assert fs.app.requests == 0 and again["from_journal"] == 30 and again["failed"] == {"invalid_unicode": n}


def _surrogate_costs(tmp_path) -> list[float]:
    """The costs journaled with the ``invalid_unicode`` rejects (the fault server's ``billed_usd`` counts ok replies
    only)."""
    recs, _ = read_journal(tmp_path / "journal", "ds")
    return [r["cost_usd"] for r in recs.values() if (r.get("error") or "").startswith("invalid_unicode")]


@pytest.mark.parametrize("body", ["<html><body><h1>502 Bad Gateway</h1></body></html>", "", "  \n"])
def test_a_200_that_is_no_api_reply_is_retried_unpaid_not_journaled(tmp_path, fs, body):
    """A 200 whose body is an HTML page or empty carries no usage and was not billed: it was journaled as paid and
    never sent again (the rerun kept none of those samples). It is retried like any unpaid failure."""
    fs.app.config.update({"pnotjson": 0.3, "notjson_body": body, "seed": 9})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(30))
    s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=8))
    n = fs.app.outcomes["notjson"]
    assert n >= 4 and s["ok"] == 30 and s["failed"] == {} and s["retries"] == n
    assert fs.app.requests == 30 + n and max(fs.app.completed_by_body.values()) == 1
    recs, _ = read_journal(tmp_path / "journal", "ds")
    assert len(recs) == 30 and all(r["status"] == "ok" for r in recs.values())


def test_a_backend_answering_only_error_pages_leaves_its_samples_to_the_rerun(tmp_path, fs):
    fs.app.config.update({"pnotjson": 1.0})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(5))
    with pytest.raises(GenerationStopped, match="every request failed .*not_api_reply") as info:
        run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=1))
    assert "the HTTP 200 body is not the API's JSON (50 bytes, starting '<html><body><h1>502 Bad Gateway" in str(
        info.value
    )
    assert read_journal(tmp_path / "journal", "ds")[0] == {}  # nothing paid: nothing journaled
    fs.app.config.update({"pnotjson": 0.0})
    fs.app.reset()
    s = run(tmp_path, fs, prompts)
    assert s["ok"] == 5 and fs.app.requests == 5


def test_a_key_echoed_in_the_system_fingerprint_is_never_stored(tmp_path, fs, monkeypatch):
    """Every string field of a reply is checked, not a list of known ones: a provider echoing the key in
    ``system_fingerprint`` (stored in the journal and the responses parquet) makes the reply a paid reject."""
    key = "sk-or-CANARY-fingerprint-77b1"
    recs = _key_echoed(tmp_path, fs, monkeypatch, key, 4, echo_key=True, echo_key_field="system_fingerprint")
    assert len(recs) == 4 and all(
        r["error"] == "api_key_in_reply: the reply's system_fingerprint quotes a configured API key (not stored)"
        for r in recs.values()
    )
    assert fs.app.requests == 4


def test_a_dollar_budget_caps_a_backend_whose_replies_carry_no_cost(tmp_path, fs):
    """An OpenAI-compatible paid backend returns tokens but no ``cost``: with ``price_per_m`` set, every request
    was sent and shown as $0.00. Each reply is now costed at ``price_per_m`` from its usage, and the budget stops."""
    fs.app.config.update({"omit_cost": True})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(40))
    price = {"prompt": 2.0, "completion": 10.0}
    bk = backends_cfg(fs, type="openai", max_concurrency=2, price_per_m=price)
    s = run(tmp_path, fs, prompts, gen=gen_cfg(budget_usd=0.002), bk=bk)
    recs = list(read_journal(tmp_path / "journal", "ds")[0].values())
    want = [(r["prompt_tokens"] * 2.0 + r["completion_tokens"] * 10.0) / 1e6 for r in recs]
    assert [r["cost_usd"] for r in recs] == pytest.approx(want, rel=1e-12) and min(want) > 0
    assert s["stopped_by"] == "budget_usd" and s["not_sent"] > 0 and s["ok"] == len(recs) == fs.app.requests < 40
    assert s["total_cost_usd"] == pytest.approx(sum(want), abs=1e-6)
    # stopped at the budget: the spend plus the 2 in flight (at the mean reply) reached it; overshot by at most those
    assert abs(sum(want) - 0.002) < 3 * max(want) and sum(want) > 0.002 / 2


def test_a_reply_without_usage_is_costed_from_our_count_of_its_tokens(tmp_path, fs, caplog):
    """A reply with no ``usage`` at all: its cost is ``price_per_m`` times our own count of its tokens (here no
    target tokenizer is loaded: UTF-8 bytes / 4, rounded up), and the token budget counts them too (it was blind)."""
    fs.app.config.update({"omit_usage": True})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(6))
    bk = backends_cfg(fs, type="openai", price_per_m={"prompt": 2.0, "completion": 10.0})
    with caplog.at_level("WARNING", logger="eagle3_data.generate"):
        s = run(tmp_path, fs, prompts, gen=gen_cfg(budget_usd=100.0, budget_completion_tokens=10**6), bk=bk)
    recs = list(read_journal(tmp_path / "journal", "ds")[0].values())
    assert len(recs) == 6 and all(r["prompt_tokens"] is None and r["completion_tokens"] is None for r in recs)

    def quarter(text: str) -> int:
        return -(-len(text.encode()) // 4)

    for r in recs:
        prompt = json.loads(r["messages"])[-1]["content"]
        assert prompt.startswith("question number ")
        assert r["cost_usd"] == pytest.approx((quarter(prompt) * 2.0 + quarter(r["content"]) * 10.0) / 1e6, rel=1e-12)
    assert s["completion_tokens"] == sum(quarter(r["content"]) for r in recs) > 0
    assert (
        caplog.text.count(
            "backend fault returned a reply without its token usage: its cost is counted from an estimate "
            "(UTF-8 bytes / 4) of its tokens at backends.fault.price_per_m"
        )
        == 1
    )
    assert caplog.text.count("without usage.completion_tokens: the token budget counts an estimate") == 1


def test_attempts_abandoned_at_the_timeout_are_named_and_counted_as_maybe_billed(tmp_path, fs, caplog):
    """Replies slower than ``timeout_s`` are abandoned and asked again, and each abandoned attempt may be billed:
    the error names the setting, the summary counts them by backend and the job's log warns once per backend."""
    fs.app.config.update({"latency_min_s": 0.05, "latency_max_s": 0.45, "seed": 2})
    prompts = write_prompts(tmp_path / "p.parquet", simple_convs(10))
    with caplog.at_level("WARNING", logger="eagle3_data.generate"):
        s = run(tmp_path, fs, prompts, gen=gen_cfg(max_retries=12), bk=backends_cfg(fs, timeout_s=0.25))
    n = fs.app.requests - 10  # every attempt reached the server: a provider would have billed it
    assert s["ok"] == 10 and n >= 3 and s["timed_out_attempts"] == {"fault": n} and s["retry_reasons"] == {"timeout": n}
    assert (
        caplog.text.count(
            f"[ds/000] {n} attempt(s) abandoned at backends.fault.timeout_s = 0.25 s and asked again: the provider may "
            "have billed them (raise timeout_s if its replies are that slow)"
        )
        == 1
    )
    fs.app.config.update({"latency_min_s": 0.5, "latency_max_s": 0.5})
    with pytest.raises(GenerationStopped) as info:  # none in time: the stop names the setting
        run(
            tmp_path,
            fs,
            write_prompts(tmp_path / "q.parquet", simple_convs(2, start=50)),
            gen=gen_cfg(max_retries=0),
            bk=backends_cfg(fs, timeout_s=0.25),
            out="q.parquet",
        )
    assert (
        "last error: timeout: no complete reply within backends.fault.timeout_s = 0.25 s: the attempt was abandoned "
        "(the provider may bill it); raise timeout_s if its replies are that slow" in str(info.value)
    )


def test_the_default_timeout_fits_the_longest_reply_max_tokens_allows(tmp_path, fs):
    from eagle3_data.backends.definition import BackendConfig

    entry = {"type": "openai", "base_url": "http://x/v1", "model": "m"}
    assert BackendConfig.from_dict("b", entry).timeout_s == 3600.0  # max_tokens left to the server
    assert BackendConfig.from_dict("b", entry, 2048).timeout_s == pytest.approx(324.8)
    assert BackendConfig.from_dict("b", entry, 32768).timeout_s == pytest.approx(3396.8)  # the seed's replies
    assert BackendConfig.from_dict("b", {**entry, "timeout_s": 30}, 32768).timeout_s == 30.0  # set: kept
    bk = backends_cfg(fs)
    bk["fault"].pop("timeout_s")
    settings = gen_settings(tmp_path, gen_cfg(max_tokens=16384), bk)
    assert [c.timeout_s for c in settings.backend_configs()] == [pytest.approx(1758.4)]
