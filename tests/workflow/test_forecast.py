"""The generation forecast: a journaled pilot (through generate itself) and the figures it implies, against the
fault-injecting server (eagle3_data.testing.fault_server)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data.testing.workflow import copy_workflow, md_rows, run_snakemake
from eagle3_data.testing.fault_server import FaultServer
from test_generate import backends_cfg, gen_cfg, simple_convs, write_prompts

from eagle3_data import forecast as fc
from eagle3_data.generate import generate, request_key
from eagle3_data.generate.journal import read_journal
from eagle3_data.settings import GenerateSettings, GenerationSettings, TokenizeSettings
from eagle3_data.tokens import tokenize

SHARDS = ("000", "001")
N_PER_SHARD = 12
PILOT = 8


@pytest.fixture
def target(tmp_path):
    return {
        "name": "tiny-target",
        "path": F.save_fixture("qwen3", tmp_path / "tok"),
        "template": "qwen3",
        "trust_remote_code": False,
        "chat_template_kwargs": {},
    }


def _prompts(tmp_path) -> list[Path]:
    """Two shards of prompts of different lengths (so the prompt tokens are not one number times the count)."""
    out = []
    for k, shard in enumerate(SHARDS):
        convs = simple_convs(N_PER_SHARD, start=100 * k)
        for i, c in enumerate(convs):
            c[0]["content"] += " and more" * (i % 5)
        out.append(
            write_prompts(
                tmp_path / "prompts" / f"{shard}.parquet", convs, ids=[f"s{k}{i:03d}" for i in range(N_PER_SHARD)]
            )
        )
    return out


def _settings(tmp_path, gen, bk, target) -> GenerateSettings:
    """Dataset ds's generate settings: ``gen`` and ``bk`` (the schema's defaults where unset), the target's name and
    format, the journal under ``tmp_path``."""
    return GenerateSettings.defaults(
        generation=gen,
        backends=bk,
        target_name=target["name"],
        journal_dir=tmp_path / "journal",
        num_shards=len(SHARDS),
        target_format={"template": target["template"]},
    )


def _pilot(tmp_path, fs, prompts, gen, bk, target, n=PILOT):
    for path, shard in zip(prompts, SHARDS):
        fc.pilot(path, tmp_path / "pilot" / f"{shard}.parquet", _settings(tmp_path, gen, bk, target), n=n, shard=shard)
    return [tmp_path / "pilot" / f"{s}.parquet" for s in SHARDS]


def _forecast(tmp_path, prompts, pilots, gen, bk, target, pilot_samples=PILOT) -> dict:
    s = _settings(tmp_path, gen, bk, target)
    spec = {
        "ds": {
            "prompts": prompts,
            "pilot": pilots,
            "generation": s.generation,
            "backends": s.backends,
            "num_shards": len(SHARDS),
        }
    }
    return fc.forecast(
        spec,
        tmp_path / "forecast.md",
        tmp_path / "forecast.json",
        target=target,
        pilot_samples=pilot_samples,
        cache_dir=tmp_path / "cache",
        backends=bk,
    )


def test_pilot_is_journaled_and_never_sent_again_and_the_forecast_is_what_it_implies(tmp_path, fs, target):
    fs.configure(latency_min_s=0.02, latency_max_s=0.08, min_tokens=5, max_tokens=40, reasoning_tokens=3)
    fs.app.reset()
    gen = gen_cfg()
    bk = backends_cfg(fs)
    prompts = _prompts(tmp_path)
    pilots = _pilot(tmp_path, fs, prompts, gen, bk, target)

    # the pilot: PILOT samples, split over the shards, each journaled in its shard's journal under its request key
    assert fs.stats()["completed"] == PILOT
    records, _ = read_journal(tmp_path / "journal", "ds")
    assert len(records) == PILOT
    for shard in SHARDS:
        lines = (tmp_path / "journal" / "ds" / f"{shard}.jsonl").read_text().splitlines()
        assert len(lines) == PILOT // len(SHARDS)
    for rec in records.values():
        msgs = json.loads(rec["messages"])
        sampling = {
            k: gen[k] if k != "extra_body" else {} for k in ("max_tokens", "temperature", "top_p", "extra_body")
        }
        assert rec["request_key"] == request_key("ds", rec["sample_id"], 1, "tiny-target", msgs, None, sampling)

    f = _forecast(tmp_path, prompts, pilots, gen, bk, target)
    d = f["datasets"]["ds"]
    ok = list(records.values())
    n = len(SHARDS) * N_PER_SHARD
    mean_comp = sum(r["completion_tokens"] for r in ok) / len(ok)
    mean_cost = sum(r["cost_usd"] for r in ok) / len(ok)
    assert d["requests"] == d["requests_sent"] == n and d["samples"] == n
    assert d["expected_completion_tokens"] == round(n * mean_comp)
    assert d["usd"] == pytest.approx(n * mean_cost, rel=1e-9)
    assert d["cost_source"] == "usage.cost"
    a, b = fc.latency_fit([(r["completion_tokens"], r["latency_s"]) for r in ok])
    # the longest of n replies drawn like the pilot's (lognormal fit, capped at max_tokens)
    longest = fc.expected_longest([r["completion_tokens"] for r in ok], n, gen["max_tokens"])
    pilot_longest = max(r["completion_tokens"] for r in ok)
    assert pilot_longest <= longest <= max(pilot_longest, gen["max_tokens"])
    assert d["longest_tokens"] == round(longest) and d["tail_s"] == pytest.approx(a + b * longest)
    # time: the simulated runs, on the one backend (its fit is the dataset's: it answered every pilot request),
    # with no failures (the server injects none); never faster than the work at the limit, never slower than
    # that plus the longest reply the pilot's lengths allow
    m = f["backends"]["fault"]
    assert (m["concurrency"], m["pilot_responses"], m["p_rate_limit"], m["p_fault"]) == (8, PILOT, 0.0, 0.0)
    assert (m["a"], m["b"]) == pytest.approx((a, b))
    h = f["total"]["hours"] * 3600
    # hours x 3600 comes back within float rounding of the seconds: a schedule exactly at the work's bound (every
    # slot busy to the end) can land one ulp below it
    eps = 1e-9
    assert d["work_s"] / 8 * (1 - eps) <= h <= (d["work_s"] / 8 + a + b * gen["max_tokens"]) * (1 + eps)
    assert f["total"]["hours_p10"] <= f["total"]["hours"] <= f["total"]["hours_p90"]
    assert d["hours"] == pytest.approx(f["total"]["hours"])  # one dataset: its last request ends the run
    assert f["total"]["usd"] == d["usd"]
    # what the build still sends and pays: everything but the pilot (each shard sent its share)
    assert f["total"]["requests_remaining"] == n - PILOT
    assert [sh["remaining"] for sh in d["shards"]] == [N_PER_SHARD - PILOT // 2] * 2
    assert f["total"]["usd_remaining"] == pytest.approx(n * mean_cost - sum(r["cost_usd"] for r in ok), rel=1e-9)
    assert 0 < f["total"]["hours_remaining"] < f["total"]["hours"]
    assert d["remaining_work_s"] < d["work_s"]
    md = (tmp_path / "forecast.md").read_text()
    assert "| **Total**" in md and f"**{n}**" in md
    assert f"\nFrom a pilot of {PILOT} samples. The pilot is journaled" in md  # sent as planned: the size alone
    assert d["pilot"]["samples"] == PILOT
    usd_left = f["total"]["usd_remaining"]  # in cents, or under a cent
    usd_shown = f"${usd_left:,.2f}" if usd_left >= 0.005 else "under $0.01"
    assert f"\nAlready paid by the pilot: the build sends {n - PILOT} more request(s), for {usd_shown} in " in md

    # the build: every shard's generate job answers the pilot from the journal and sends only the rest
    before = fs.stats()["completed"]
    summaries = [
        generate(p, tmp_path / "responses" / f"{s}.parquet", _settings(tmp_path, gen, bk, target), shard=s)
        for p, s in zip(prompts, SHARDS)
    ]
    assert sum(s["from_journal"] for s in summaries) == PILOT
    assert fs.stats()["completed"] - before == n - PILOT
    assert max(fs.stats()["completed_by_body"].values()) == 1, "a pilot request was sent again"

    # prompt tokens: exactly the prompt lengths the tokenize stage finds in the build's responses
    tok_prompt = 0
    for s in SHARDS:
        tokenize(
            str(tmp_path / "responses" / f"{s}.parquet"),
            str(tmp_path / "tokens" / f"{s}.parquet"),
            settings=TokenizeSettings.defaults(target),
        )
        tok_prompt += sum(pq.read_table(tmp_path / "tokens" / f"{s}.parquet").column("num_prompt_tokens").to_pylist())
    assert d["prompt_tokens"] == tok_prompt > 0


def test_prices_from_the_model_list_cached_then_config_then_unknown(tmp_path, fs, target):
    fs.configure(omit_cost=True, price_in=3e-7, price_out=5e-6)  # no usage.cost: prices per token are needed
    fs.app.reset()
    gen = gen_cfg()
    prompts = _prompts(tmp_path)
    bk = backends_cfg(fs, model="fault-model")  # the fault server lists its model as "fault-model"
    pilots = _pilot(tmp_path, fs, prompts, gen, bk, target)
    rows = [r for p in pilots for r in pq.read_table(p).to_pylist()]
    assert rows and all(r["cost_usd"] is None for r in rows)
    per_request = sum(r["prompt_tokens"] * 3e-7 + r["completion_tokens"] * 5e-6 for r in rows) / len(rows)
    n = len(SHARDS) * N_PER_SHARD
    fc.prices._PRICE_CACHE.clear()
    d = _forecast(tmp_path, prompts, pilots, gen, bk, target)["datasets"]["ds"]
    assert d["usd"] == pytest.approx(n * per_request, rel=1e-9)
    assert d["cost_source"].startswith("OpenRouter model list")
    cached = list((tmp_path / "cache" / "forecast").glob("prices-*.json"))
    assert len(cached) == 1
    # fetched once: new prices on the server change nothing while the cached list is there
    fs.configure(price_in=1.0, price_out=1.0)
    fc.prices._PRICE_CACHE.clear()
    assert _forecast(tmp_path, prompts, pilots, gen, bk, target)["datasets"]["ds"]["usd"] == pytest.approx(d["usd"])

    # not OpenRouter: the config's price table (USD per million tokens), else unknown, naming the key to set
    other = {"fault": {**bk["fault"], "type": "openai", "price_per_m": {"prompt": 2.0, "completion": 10.0}}}
    per_request = sum(r["prompt_tokens"] * 2e-6 + r["completion_tokens"] * 1e-5 for r in rows) / len(rows)
    d = _forecast(tmp_path, prompts, pilots, gen, other, target)["datasets"]["ds"]
    assert d["usd"] == pytest.approx(n * per_request, rel=1e-9)
    assert d["cost_source"] == "config backends.fault.price_per_m"
    other["fault"].pop("price_per_m")
    f = _forecast(tmp_path, prompts, pilots, gen, other, target)
    assert f["datasets"]["ds"]["usd"] is None and f["datasets"]["ds"]["missing_prices"] == ["fault"]
    assert f["total"]["usd"] is None and f["total"]["usd_unknown"] == ["ds"]
    assert "backends.fault.price_per_m" in (tmp_path / "forecast.md").read_text()


def test_a_pilot_larger_than_the_dataset_says_what_it_sent_and_leaves_exactly_nothing_to_pay(tmp_path, fs, target):
    """forecast.pilot_samples above the dataset's size: the pilot sends every sample, the forecast says so (the
    size planned, then what was sent) and what the build still pays is exactly $0.00 (no float noise)."""
    fs.configure(min_tokens=5, max_tokens=40)
    fs.app.reset()
    gen, bk = gen_cfg(), backends_cfg(fs)
    prompts = _prompts(tmp_path)
    n = len(SHARDS) * N_PER_SHARD
    planned = 2 * n
    pilots = _pilot(tmp_path, fs, prompts, gen, bk, target, n=planned)
    assert fs.stats()["completed"] == n  # every sample, once
    f = _forecast(tmp_path, prompts, pilots, gen, bk, target, pilot_samples=planned)
    d = f["datasets"]["ds"]
    assert d["pilot"]["samples"] == d["samples"] == n and d["pilot"]["cost_usd"] > 0
    assert f["total"]["requests_remaining"] == 0 and f["total"]["usd_remaining"] == 0.0
    md = (tmp_path / "forecast.md").read_text()
    assert f"\nFrom a pilot of {planned} samples planned; sent: ds {n} (all it sends). The pilot is journaled" in md
    assert "\nThe pilot sent every request: the build sends none, and pays nothing more for generation.\n" in md
    # the dollars in cents: the forecast table's Cost $ (the total the same), the pilot's Cost $ (what it paid)
    cents = lambda v: f"{v:,.2f}" if v >= 0.005 else "< 0.01"  # noqa: E731
    pilot_cost = sum(r["cost_usd"] for p in pilots for r in pq.read_table(p).to_pylist())
    (row, total) = md_rows(md.split("## Pilot")[0])
    assert row[:3] == ["ds", str(n), str(n)] and row[5] == cents(d["usd"]) and total[5] == f"**{cents(d['usd'])}**"
    (pilot_row,) = md_rows(md.split("## Pilot")[1].split("## Time")[0])
    assert pilot_row[:4] == ["ds", str(n), str(n), "0"] and pilot_row[6] == cents(pilot_cost)
    assert d["pilot"]["cost_usd"] == pytest.approx(pilot_cost)


def test_a_budget_scales_what_is_sent(tmp_path, fs, target):
    fs.configure(min_tokens=20, max_tokens=20)  # every reply 20 completion tokens
    fs.app.reset()
    prompts = _prompts(tmp_path)
    bk = backends_cfg(fs)
    gen = gen_cfg(budget_completion_tokens=120)
    pilots = _pilot(tmp_path, fs, prompts, gen, bk, target)
    d = _forecast(tmp_path, prompts, pilots, gen, bk, target)["datasets"]["ds"]
    assert d["requests"] == 24 and d["requests_sent"] == 6  # 120 tokens / 20 per request
    assert d["expected_completion_tokens"] == 120 and d["stopped_by"] == "budget_completion_tokens"


def test_pilot_samples_are_among_those_the_build_sends(tmp_path):
    """The pilot's share of each shard comes from the samples generate will send (max_samples: the first by id),
    picked by a hash of the id (not the first ones), the same on every call."""
    prompts = _prompts(tmp_path)
    gen = GenerationSettings.defaults(**gen_cfg(max_samples=10))  # 5 per shard of 12: ids s?000..s?004 are sent
    for k, (path, shard) in enumerate(zip(prompts, SHARDS)):
        ids = fc.pilot_sample_ids(path, gen, n=6, num_shards=2, shard=shard)
        assert len(ids) == 3 and set(ids) <= {f"s{k}{i:03d}" for i in range(5)}
        assert ids == fc.pilot_sample_ids(path, gen, n=6, num_shards=2, shard=shard)
    everything = fc.pilot_sample_ids(
        prompts[0], GenerationSettings.defaults(**gen_cfg()), n=24, num_shards=2, shard="000"
    )
    assert len(everything) == 12
    first = fc.pilot_sample_ids(prompts[0], GenerationSettings.defaults(**gen_cfg()), n=8, num_shards=2, shard="000")
    assert first != everything[:4], "the pilot is not the first samples by id"


def test_latency_fit():
    a, b = fc.latency_fit([(0, 1.0), (100, 2.0), (200, 3.0)])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.01)
    assert fc.latency_fit([(50, 2.0), (50, 4.0)]) == (3.0, 0.0)
    assert fc.latency_fit([(0, 3.0), (100, 1.0)]) == (2.0, 0.0)  # a negative slope: the mean


def _backend(conc, a, b=0.0, p_rate_limit=0.0, p_fault=0.0):
    return {"concurrency": conc, "a": a, "b": b, "p_rate_limit": p_rate_limit, "p_fault": p_fault}


def _fixed(tokens):
    """Every reply ``tokens`` long (a lognormal of spread 0)."""
    import math

    return {"mu": math.log(tokens), "sigma": 0.0, "cap": None}


def test_simulation_of_waves_on_the_slots():
    # 10 requests of 1 + 0.01 x 100 = 2 s on 4 slots: three waves, 6 s, in every run; 20 request-seconds
    sim = fc.simulate_generation(
        [{"dataset": "d", "requests": 10, "backends": ["x"]}], {"x": _backend(4, 1.0, 0.01)}, {"d": _fixed(100)}, runs=3
    )
    assert sim["span_s"] == pytest.approx([6.0] * 3)
    assert sim["work_s"] == {"d": pytest.approx(20.0)} and sim["busy_s"] == {"x": pytest.approx(20.0)}


def test_simulation_shares_a_backend_fairly_and_overflows_to_the_next():
    """Job A (10 requests) uses only `local` (2 slots, 1 s each); job B (10) prefers `local`, then `or` (10 slots,
    5 s each). At t=0 the fair share gives each job one local slot, and B's other 9 requests overflow to `or`;
    from t=1 A has both local slots: its 9 other requests take 1 + 9/2 -> t=6 (the last wave holds one). B's
    overflow ends at t=5."""
    jobs = [
        {"dataset": "A", "requests": 10, "backends": ["local"]},
        {"dataset": "B", "requests": 10, "backends": ["local", "or"]},
    ]
    sim = fc.simulate_generation(
        jobs, {"local": _backend(2, 1.0), "or": _backend(10, 5.0)}, {"A": _fixed(10), "B": _fixed(10)}, runs=1
    )
    assert sim["dataset_s"] == {"A": [pytest.approx(6.0)], "B": [pytest.approx(5.0)]}
    assert sim["span_s"] == [pytest.approx(6.0)]
    assert sim["busy_s"] == {"local": pytest.approx(11.0), "or": pytest.approx(45.0)}
    # a dataset's own latency on a backend (fitted on its own pilot answers) overrides the backend's
    models = {"local": _backend(2, 1.0) | {"latency": {"A": (0.5, 0.0)}}, "or": _backend(10, 5.0)}
    sim = fc.simulate_generation(jobs, models, {"A": _fixed(10), "B": _fixed(10)}, runs=1)
    assert sim["work_s"]["A"] == pytest.approx(5.0)


def test_simulation_retries_failures_and_rate_limits():
    one = [{"dataset": "d", "requests": 20, "backends": ["x"]}]
    # every attempt fails mid-request: each request is tried 1 + max_retries times, each attempt a uniform part of
    # its 10 s, with backoff waits between (0.25 .. 1 s here); nothing is left waiting
    sim = fc.simulate_generation(
        one,
        {"x": _backend(100, 10.0, p_fault=1.0)},
        {"d": _fixed(5)},
        runs=20,
        max_retries=2,
        retry_initial_s=1.0,
        retry_max_s=1.0,
    )
    per_request = sim["work_s"]["d"] / 20
    assert 3 * 10.0 * 0.3 < per_request < 3 * 10.0 * 0.7  # 3 attempts of 5 s on average
    assert max(sim["span_s"]) < 3 * 10.0 + 2 * 1.0
    # every attempt rate-limited: refused at once, so no request-seconds, only the backoff waits
    sim = fc.simulate_generation(
        one,
        {"x": _backend(100, 10.0, p_rate_limit=1.0)},
        {"d": _fixed(5)},
        runs=5,
        max_retries=3,
        retry_initial_s=0.4,
        retry_max_s=0.4,
    )
    assert sim["work_s"]["d"] == 0.0
    assert all(3 * 0.1 <= s <= 3 * 0.4 for s in sim["span_s"])
    # a job's own retry settings win over the defaults
    sim = fc.simulate_generation(
        [{**one[0], "max_retries": 0}],
        {"x": _backend(100, 10.0, p_fault=1.0)},
        {"d": _fixed(5)},
        runs=20,
        max_retries=5,
    )
    assert sim["work_s"]["d"] / 20 < 10.0


def test_simulation_draws_lengths_from_the_lognormal_capped():
    import math
    from statistics import NormalDist

    mu, sigma, cap = math.log(1000), 0.8, 4000
    n = 20_000
    sim = fc.simulate_generation(
        [{"dataset": "d", "requests": n, "backends": ["x"]}],
        {"x": _backend(1000, 0.5, 0.001)},
        {"d": {"mu": mu, "sigma": sigma, "cap": cap}},
        runs=1,
    )
    # E[min(L, cap)] of a lognormal: e^(mu + s^2/2) Phi((ln cap - mu - s^2) / s) + cap (1 - Phi((ln cap - mu) / s))
    z = (math.log(cap) - mu) / sigma
    mean = math.exp(mu + sigma**2 / 2) * NormalDist().cdf(z - sigma) + cap * (1 - NormalDist().cdf(z))
    assert sim["work_s"]["d"] / n == pytest.approx(0.5 + 0.001 * mean, rel=0.02)
    assert fc.length_model([100, 400], 300) == {
        "mu": pytest.approx(math.log(200)),
        "sigma": pytest.approx(math.log(4) / math.sqrt(2)),
        "cap": 300,
    }
    assert fc.length_model([250], None)["sigma"] == 0.0


def test_pilot_faults_split_over_the_backends_by_their_answers():
    summaries = [
        {"attempts": {"sent": 110, "retry_reasons": {"http_429": 6, "http_502": 4}, "by_backend": {"a": 75, "b": 25}}},
        {"sent": 50, "retry_reasons": {"timeout": 5}, "by_backend": {"b": 45}},  # no `attempts`: its own
        {"sent": 0, "retry_reasons": {}, "by_backend": {}},
    ]  # answered from the journal: nothing seen
    f = fc.pilot_faults(summaries)
    assert f["a"] == pytest.approx({"attempts": 82.5, "rate_limited": 4.5, "faults": 3.0})
    assert f["b"] == pytest.approx({"attempts": 27.5 + 50, "rate_limited": 1.5, "faults": 1.0 + 5})


def test_job_overhead_is_the_pilot_jobs_mean_and_every_simulated_time_includes_it():
    summaries = [
        {"attempts": {"startup_s": 4.0, "wrapup_s": 1.0}},
        {"startup_s": 6.0, "wrapup_s": 3.0},
        {"startup_s": None, "wrapup_s": None},
    ]  # sent nothing: measured nothing
    assert fc.job_overhead(summaries) == {"startup_s": 5.0, "wrapup_s": 2.0, "job_s": 7.0}
    assert fc.job_overhead([]) == {"startup_s": 0.0, "wrapup_s": 0.0, "job_s": 0.0}
    per = [
        {
            "dataset": "d",
            "backends": ["x"],
            "shards": [{"requests": 10, "remaining": 4}],
            "retry": {"max_retries": 0},
            "length_model": _fixed(100),
            "_pilot_lengths": [100],
        }
    ]
    models = {
        "x": _backend(4, 1.0, 0.01)
        | {"latency": {}, "pilot_attempts": 0.0, "pilot_rate_limited": 0.0, "pilot_faults": 0.0}
    }
    full = fc.simulated_hours(per, models, "requests", 7.0)
    assert full["hours"] * 3600 == pytest.approx(6.0 + 7.0)  # 3 waves of 2 s, plus the job's own 7 s
    assert full["dataset_hours"]["d"] * 3600 == pytest.approx(13.0)
    assert fc.simulated_hours(per, models, "remaining")["hours"] * 3600 == pytest.approx(2.0)  # 4 on 4 slots


def test_a_rerun_pilot_answered_from_the_journal_keeps_the_failures_it_saw(tmp_path, fs, target):
    fs.configure(p429=0.3, p5xx=0.2, latency_min_s=0.0, latency_max_s=0.0)
    fs.app.reset()
    gen, bk = gen_cfg(), backends_cfg(fs)
    prompts = _prompts(tmp_path)
    kw = dict(
        n=PILOT,
        shard="000",
        attempts_path=tmp_path / "cache/forecast/pilot/ds/000.jsonl",
        summary_path=tmp_path / "s.json",
    )
    settings = _settings(tmp_path, gen, bk, target)
    first = fc.pilot(prompts[0], tmp_path / "p.parquet", settings, **kw)
    st = fs.stats()
    assert first["attempts"]["sent"] == st["requests"] > PILOT // 2  # the faults made retries
    retried = sum(first["attempts"]["retry_reasons"].values())
    assert retried == st["requests"] - PILOT // 2
    assert json.loads((tmp_path / "s.json").read_text())["attempts"] == first["attempts"]
    again = fc.pilot(prompts[0], tmp_path / "p.parquet", settings, **kw)
    assert fs.stats()["requests"] == st["requests"], "the rerun sent requests"
    assert again["sent"] == 0 and again["attempts"] == first["attempts"]
    # the job's own time besides its requests, kept for the forecast through the rerun
    assert first["startup_s"] > 0 and first["wrapup_s"] >= 0 and again["startup_s"] is None
    assert again["attempts"]["startup_s"] == first["startup_s"]
    assert fc.job_overhead([again])["job_s"] == pytest.approx(first["startup_s"] + first["wrapup_s"], abs=1e-3)
    f = fc.pilot_faults([again])["fault"]
    assert f["attempts"] == st["requests"]
    assert f["rate_limited"] + f["faults"] == retried


@pytest.mark.slow
def test_forecast_target_then_build_pays_nothing_twice(tmp_path):
    """`snakemake forecast` on a small config, then the build: the pilot is in generate's journal and the build's
    generate jobs send none of its requests again."""
    server = FaultServer({"min_tokens": 5, "max_tokens": 30, "latency_min_s": 0.01, "latency_max_s": 0.03}).start()
    try:
        wd = copy_workflow(tmp_path / "wf")
        cfg = yaml.safe_load((wd / "config.yaml").read_text())
        cfg["backends"] = {
            "remote": {
                "type": "openrouter",
                "base_url": f"{server.url}/v1",
                "model": "fault-model",
                "max_concurrency": 4,
                "timeout_s": 10,
            }
        }
        cfg["generation"].update({"backends": ["remote"], "max_retries": 1})
        cfg["datasets"] = {k: v for k, v in cfg["datasets"].items() if k in ("ultrachat_demo", "sharegpt_demo")}
        cfg["forecast"] = {"pilot_samples": 3}
        (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        run_snakemake(wd, "--cores", "2", "forecast")
        f = json.loads((wd / "results/reports/forecast.json").read_text())
        assert set(f["datasets"]) == {"ultrachat_demo", "sharegpt_demo"}
        pilot_sent = server.stats()["completed"]
        assert pilot_sent == 6
        for ds in f["datasets"]:
            records, _ = read_journal(wd / "cache/journal", ds)
            assert len(records) == 3
        assert (wd / "results/reports/forecast.md").read_text().startswith("# Generation forecast")
        targets = [
            f"results/{ds}/responses/{s}.parquet"
            for ds in f["datasets"]
            for s in ([f"{i:03d}" for i in range(cfg["datasets"][ds].get("shards", 1))])
        ]
        run_snakemake(wd, "--cores", "2", *targets)
        st = server.stats()
        assert max(st["completed_by_body"].values()) == 1, "a pilot request was paid twice"
        rows = [r for t in targets for r in pq.read_table(wd / t).to_pylist() if r["status"] == "ok"]
        assert st["completed"] == len(rows) == f["total"]["requests"]
    finally:
        server.stop()


def test_expected_longest_is_the_lognormal_quantile_n_over_n_plus_1_capped():
    import math
    from statistics import NormalDist

    # logs ln 100, ln 400: mean ln 200, sample sd ln 4 / sqrt 2
    q = 200 * math.exp(math.log(4) / math.sqrt(2) * NormalDist().inv_cdf(99 / 100))
    assert q == pytest.approx(1956.2, abs=0.5)
    assert fc.expected_longest([100, 400], 99) == pytest.approx(q)
    assert fc.expected_longest([100, 400], 99, cap=1000) == 1000.0
    assert fc.expected_longest([100, 400], 1) == 400.0  # one request: no extrapolation
    assert fc.expected_longest([100, 400], 2, cap=300) == 400.0  # never below the pilot's own longest
    assert fc.expected_longest([250], 10_000) == 250.0  # one length: no spread to fit
    assert fc.expected_longest([], 10) == 0.0


def test_simulation_overflows_in_each_datasets_priority_order():
    """Job B prefers `local` then `or`; `or` comes first in the backends' order (another dataset's only backend):
    B still fills local's free slots first and overflows to `or` only for the rest."""
    jobs = [
        {"dataset": "C", "requests": 1, "backends": ["or"]},
        {"dataset": "B", "requests": 5, "backends": ["local", "or"]},
    ]
    sim = fc.simulate_generation(
        jobs, {"or": _backend(10, 5.0), "local": _backend(3, 1.0)}, {"B": _fixed(10), "C": _fixed(10)}, runs=1
    )
    # B: 3 requests on local (1 s each), 2 on or (5 s each); C: 1 on or
    assert sim["busy_s"] == {"local": pytest.approx(3.0), "or": pytest.approx(15.0)}
