"""Rehearsal of the seed run, the production run ``resources/configs/seed-kimi-k25.yaml`` describes: ten
datasets, 40,114 samples, on this machine.

What it does, in a scratch directory (``--workdir``, default a temp dir):

1. writes synthetic source files in each seed dataset's real public format with the seed's sample counts
   (``eagle3_data.testing.rehearsal_data``; B1 glaive JSON array ... B8 nebius SWE-agent parquet, A1/A2 pre-tokenized JSONL with
   ~44.9M / ~2.6M tokens), plus a few unusable rows per B source that normalize must reject;
2. writes a config that mirrors ``resources/configs/seed-kimi-k25.yaml`` (same datasets, shards, backends
   ``sglang_local`` / ``openrouter`` and their priority per dataset, generation / validate / merge settings), with
   ``target`` = the tiny Kimi-style target built by rule ``tiny_target`` and both backends pointing at one local
   fault-injecting server (``eagle3_data.testing.rehearsal_server``): ``openrouter`` at the seed's 2,000 concurrency, ``sglang_local``
   at the seed's 256 (``--local-concurrency``), so B3 overflows from local to OpenRouter ("Mixed") as in the seed;
3. starts that server (own process, loopback): per-dataset lognormal reply lengths whose means reproduce the
   seed's completion tokens (~90.9M in all, B1 17.0M), latency 0.5-1.5 s + the reply streamed at the backend's
   speed (``--openrouter-tok-s`` 100 and ``--local-tok-s`` 500 tokens/s per request: a request lasts seconds to
   minutes, long against a job's startup as in a real run, and the longest, 30K-token, replies take 5 min, so each
   backend's work at its limit and its tail take ~5 min each at full scale: the seed's 33 min compressed about
   threefold; ``--toy`` streams at 8,333 tokens/s), 2 % 429 (answered at once, as a rate limit refuses before
   generating) + 1 % 5xx + 0.3 % errors inside a 200 body (both at a uniformly drawn point of the request's
   latency: a provider failing mid-generation); reply text is ASCII of exactly
   ``completion_tokens - 1`` characters (the end-of-turn token is billed), so the byte-level tiny tokenizer
   reconstructs the billed count exactly and validation passes honestly;
4. first, when the workflow has a ``forecast`` rule, runs ``snakemake forecast`` (a journaled pilot of
   ``forecast.pilot_samples`` per dataset, then the forecast of requests, tokens, dollars and hours); then
   runs ``snakemake --cores 2`` through normalize -> generate -> tokenize -> validate -> merge (-> plan, when
   the workflow has a ``plan`` rule; -> report with ``--with-report``), never extraction, sampling the RSS of
   the whole process tree (snakemake, its jobs, the server) every 0.5 s;
5. prints the per-dataset table (DuckDB over the validated parquet files, + responses for backend / cost), the
   requests in flight per backend (the server's request log: max, and the mean from the first request to the last
   new one against ``max_concurrency``; targets: mean >= 90 % of the limit, generation span <= 1.1 x (the longest
   generate job + the backend's work at its limit)), the wall time of each stage (sum of its jobs' times and its
   first-start..last-end span, read from snakemake's
   log), the total, the peak memory, the merge manifest and the extraction plan if one was produced, the forecast
   against the actual cost, completion tokens and generation time (the span of the generate jobs) with their ratios
   (target: within 15 %), and ends
   with ONE JSON line (figures + targets: peak < 8 GB, and the time target of the size run, see Run below).

6. then the incremental scenario (issue 11; ``--no-incremental`` skips it): 10 validated samples' journal lines
   are removed, as if their requests had failed, and a small new dataset is added (a ShareGPT file, one shard);
   ``snakemake --forcerun generate`` (how a user retries failed requests) sends exactly those 10 requests and
   the new dataset's; it reports the jobs rerun per stage, the selection files and rows rewritten, and the tokens
   that extraction would forward (rows of a new or changed selection that the earlier states file cannot give
   byte for byte, by sample id, token ids and loss mask, as ``eagle3_data.extract.stage`` reuses them) against
   the tokens a full build forwards.

Run: ``python benchmarks/rehearsal.py`` (the default size: a 5 % rehearsal, ``--scale 0.05``, with both backends
streaming 4x faster, 400 and 2,000 tokens/s, so that it finishes in under 10 minutes on 2 cores; target: the
whole rehearsal, forecast + build + incremental scenario, ``run_s`` < 10 min) or ``python benchmarks/rehearsal.py
--full`` (the seed's full scale, ~40k samples at 100 / 500 tokens/s; target: the build, ``total_s`` < 30 min). At a scale below 1 the backends' ``max_concurrency`` scale with it (``--limit-scale``), so each
shard holds the same share of its backend's limit and the generation keeps the full run's shape while the CPU
stages shrink. ``--toy`` is the CI size (three datasets, 0.2 % of their samples, one shard each, a few minutes).
``--keep`` keeps the scratch directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

TARGET_TOTAL_S = 30 * 60  # the full-scale rehearsal (--full)
TARGET_DEFAULT_S = 10 * 60  # every benchmark's default size on 2 cores (issue 25)
DEFAULT_SCALE, DEFAULT_SPEEDUP = 0.05, 4.0  # the default size: 5 % of the seed, replies streamed 4x faster
TARGET_PEAK_GB = 8.0

# The seed run's figures: samples and completion tokens per B dataset; A datasets: samples, tokens.
# shards / backends / max_samples mirror resources/configs/seed-kimi-k25.yaml.
SEED_B = {
    #  name                  format                 samples  tokens   max   shards backends
    "B1_glaive": ("glaive", 9_998, 17.0e6, 10_000, 8, ["sglang_local"]),
    "B2_opencodeinstruct": ("instruction_response", 2_932, 11.4e6, 3_000, 4, ["sglang_local"]),
    "B3_magicoder": ("instruction_response", 3_383, 10.5e6, 3_400, 4, ["sglang_local", "openrouter"]),
    "B4_mixturethoughts": ("mixture_of_thoughts", 1_891, 10.2e6, 2_000, 2, None),
    "B5_openthoughts": ("openthoughts", 2_112, 11.0e6, 2_200, 2, None),
    "B6_ultrachat": ("ultrachat", 5_957, 11.1e6, 6_000, 4, None),
    "B7_sharegpt": ("sharegpt", 5_476, 10.9e6, 5_500, 4, None),
    "B8_sweagent": ("nebius_swe_agent", 3_565, 8.8e6, 3_572, 4, None),
}
SEED_A = {"A1_deepswekimi": (2_800, 44.9e6, 8), "A2_kimik25": (2_000, 2.6e6, 2)}
SEED_TOTAL_SAMPLES = 40_114

FILES = {
    "B1_glaive": ("glaive-function-calling-v2.json", "write_glaive", {}),
    "B2_opencodeinstruct": (
        "OpenCodeInstruct/train-00000-of-00014.parquet",
        "write_opencodeinstruct",
        {"prompt_field": "input", "response_field": "output", "id_field": "id"},
    ),
    "B3_magicoder": (
        "data-oss_instruct-decontaminated.jsonl",
        "write_magicoder",
        {"prompt_field": "problem", "response_field": "solution", "id_field": "index"},
    ),
    "B4_mixturethoughts": ("Mixture-of-Thoughts/code/train-00000-of-00008.parquet", "write_mixture_of_thoughts", {}),
    "B5_openthoughts": ("OpenThoughts-114k/train-00000-of-00006.parquet", "write_openthoughts", {}),
    "B6_ultrachat": ("ultrachat_200k/train_sft-00000-of-00003.parquet", "write_ultrachat", {}),
    "B7_sharegpt": ("ShareGPT_V3_unfiltered_cleaned_split.json", "write_sharegpt", {}),
    "B8_sweagent": ("SWE-agent-trajectories/train-00000-of-00012.parquet", "write_nebius_swe_agent", {}),
}

# reply-length spread (lognormal log-sd) per dataset: SWE-agent replies are short tool calls or long patches
LENGTH_SIGMA = {"B8_sweagent": 1.0}
MAX_REPLY = 30_000  # < generation.max_tokens (32,768): no reply is cut
FAKE_KEY_ENV = "REHEARSAL_OPENROUTER_KEY"


# ---------------------------------------------------------------------------------------------------------------
# inputs


def scaled(n: float, scale: float, lo: int = 1) -> int:
    return max(lo, int(round(n * scale)))


#: --toy: one dataset on the local backend overflowing to OpenRouter, one on OpenRouter, one pre-tokenized
TOY_DATASETS = ("B3_magicoder", "B7_sharegpt", "A2_kimik25")
#: the dataset the incremental scenario adds: (format, samples at scale 1, shards), replies drawn like B7's
NEW_DATASET = ("C1_sharegpt_extra", "sharegpt", 400, 1)
RETRIED_REQUESTS = 10


def write_sources(data_dir: Path, scale: float, special_ids: dict) -> dict:
    """Write every source file; return {dataset: {path, rows, good, ...}}."""
    from eagle3_data.testing import rehearsal_data as rd

    out = {}
    for i, (ds, (fmt, n, _tok, mx, _sh, _be)) in enumerate(SEED_B.items()):
        rel, fn, _ = FILES[ds]
        path = data_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        good = scaled(n, scale)
        bad = max(1, math.ceil(0.001 * good))
        t0 = time.perf_counter()
        rows = getattr(rd, fn)(path, good, bad, seed=100 + i)
        out[ds] = {
            "path": str(path),
            "rows": rows,
            "good": good,
            "bad": bad,
            "bytes": path.stat().st_size,
            "write_s": round(time.perf_counter() - t0, 2),
        }
    for i, (ds, (n, tok, _sh)) in enumerate(SEED_A.items()):
        path = data_dir / f"{ds}.jsonl"
        t0 = time.perf_counter()
        rows, tokens = rd.write_pretokenized(path, scaled(n, scale), tok / n, seed=200 + i, special_ids=special_ids)
        out[ds] = {
            "path": str(path),
            "rows": rows,
            "good": rows,
            "bad": 0,
            "tokens": tokens,
            "bytes": path.stat().st_size,
            "write_s": round(time.perf_counter() - t0, 2),
        }
    return out


def build_config(
    sources: dict,
    port: int,
    scale: float,
    local_concurrency: int = 256,
    max_shards: int | None = None,
    limit_scale: float = 1.0,
) -> dict:
    """The seed config (resources/configs/seed-kimi-k25.yaml) pointed at the tiny target and the local server."""
    seed = yaml.safe_load((ROOT / "resources/configs/seed-kimi-k25.yaml").read_text())
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg = dict(seed)
    cfg["cache_dir"] = "cache"
    # the tiny Kimi-style target (build_tiny: true), thinking off: the replies and the A-type rows carry no
    # reasoning (the demo's own target thinks, in the Kimi K2.5 format)
    cfg["target"] = {**demo["target"], "template": "kimi-k2", "chat_template_kwargs": {"thinking": False}}
    url = f"http://127.0.0.1:{port}/v1"
    cfg["backends"] = {
        "openrouter": {
            **seed["backends"]["openrouter"],
            "base_url": url,
            "api_key_env": FAKE_KEY_ENV,
            "timeout_s": 900,
            "max_concurrency": max(4, round(seed["backends"]["openrouter"]["max_concurrency"] * limit_scale)),
        },
        "sglang_local": {k: v for k, v in seed["backends"]["sglang_local"].items() if k != "launch"}
        | {
            "base_url": url,
            "max_concurrency": max(2, round(local_concurrency * limit_scale)),
            "timeout_s": 900,
            # the seed launches it on its own GPUs (nothing bought); here it is the fault server, not launched, so
            # the dollar budget needs its price said: none
            "price_per_m": {"prompt": 0.0, "completion": 0.0},
            # as the target renders its prompts (thinking off): the config check refuses a server told otherwise
            "extra_body": {
                **(seed["backends"]["sglang_local"].get("extra_body") or {}),
                "chat_template_kwargs": {"thinking": False},
            },
        },
    }
    gen = dict(seed["generation"])
    # budgets (split per shard by generate): the seed's 10M per dataset would end B1-B7 early here because the
    # replies are drawn to reproduce the seed's *final* counts; keep them as a safety net, 1.5x above those counts
    gen["budget_completion_tokens"] = int(15e6 * scale)
    gen["budget_usd"] = round(20 * scale, 4)
    cfg["generation"] = gen
    cfg["datasets"] = {}
    for ds, (fmt, _n, _tok, mx, shards, backends) in SEED_B.items():
        src = {"format": fmt, "path": sources[ds]["path"], "max_samples": scaled(mx, scale)}
        if FILES[ds][2]:
            src["options"] = dict(FILES[ds][2])
        g = {"extra_body": {"user": ds}}  # the server picks this dataset's reply profile from the `user` field
        if backends:
            g["backends"] = backends
        if ds == "B1_glaive":
            g["budget_completion_tokens"] = int(25e6 * scale)
        cfg["datasets"][ds] = {"source": src, "shards": min(shards, max_shards or shards), "generation": g}
    for ds, (_n, _tok, shards) in SEED_A.items():
        cfg["datasets"][ds] = {
            "source": {"format": "pretokenized", "path": sources[ds]["path"]},
            "shards": min(shards, max_shards or shards),
        }
    # the draft vocabulary must fit the tiny target's (checked before any job runs): the demo's size
    cfg["vocab"] = {**(seed.get("vocab") or {}), **(demo.get("vocab") or {})}
    cfg["extract"] = {**seed["extract"], "dtype": "float32", "gpus_per_job": 1}  # never run here
    # the plan's throughput: the seed's own (138.4M tokens in its 91 h estimate on 8 GPUs = 52.8 tokens/s per
    # GPU for Kimi-K2.5), not a measurement of the tiny CPU target, which would say nothing about the real run
    cfg["plan"] = {**seed["plan"], "tokens_per_s_per_gpu": round(138.4e6 / (91 * 3600) / 8, 1)}
    cfg["plan"]["drop"] = [d for d in cfg["plan"].get("drop") or [] if d in cfg["datasets"]]
    return cfg


def server_config(models: dict[str, str], tok_s: dict[str, float]) -> dict:
    """The rehearsal server's settings: per-dataset reply lengths and prices (``profiles``, by the ``user`` field) and
    per-backend stream speeds (``model_profiles``: ``models`` backend -> its model, ``tok_s`` backend -> tokens/s
    per request)."""
    profiles = {}
    for ds, (_f, n, tok, _mx, _sh, backends) in SEED_B.items():
        local_only = backends == ["sglang_local"]
        profiles[ds] = {
            "length_mean": tok / n - 1,
            "length_sigma": LENGTH_SIGMA.get(ds, 0.8),
            **({"price_in": 0.0, "price_out": 0.0} if local_only else {}),
        }
    return {
        "profile_field": "user",
        "profiles": profiles,
        "length_dist": "lognormal",
        "min_tokens": 16,
        "max_tokens": MAX_REPLY,
        "eot_tokens": 1,
        "latency_min_s": 0.5,
        "latency_max_s": 1.5,
        "model_profiles": {models[b]: {"latency_per_token_s": 1.0 / tok_s[b]} for b in models},
        "p429": 0.02,
        "p5xx": 0.01,
        "perror200": 0.003,
        "retry_after_s": 0.5,
        # a rate limit refuses before generating; a provider error comes at a drawn point of the generation
        "fault_at": {"p429": "start", "p5xx": "uniform", "perror200": "uniform"},
        "price_in": 0.4e-6,
        "price_out": 0.8e-6,
        "provider": "Moonshot AI",
        "seed": 0,
    }


# ---------------------------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path, config: dict) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3_data.testing.rehearsal_server",
            "--port",
            str(port),
            "--config",
            json.dumps(config),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    import httpx

    for _ in range(100):
        if proc.poll() is not None:
            raise RuntimeError(f"rehearsal server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("rehearsal server did not become ready")


class MemSampler(threading.Thread):
    """Peak summed RSS of a set of root processes and all their descendants, sampled every ``interval`` s."""

    def __init__(self, pids: list[int], interval: float = 0.5):
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.peak = 0
        self.peak_at = 0.0
        self.peak_procs: list[tuple[str, int]] = []
        self.stop_ev = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        import psutil

        procs = {}
        for pid in self.pids:
            try:
                p = psutil.Process(pid)
                procs[p.pid] = p
                for c in p.children(recursive=True):
                    procs[c.pid] = c
            except psutil.Error:
                pass
        total, items = 0, []
        for p in procs.values():
            try:
                rss = p.memory_info().rss
                total += rss
                items.append((" ".join(p.cmdline()[:4])[-90:], rss))
            except psutil.Error:
                pass
        if total > self.peak:
            self.peak, self.peak_at = total, time.monotonic() - self.t0
            self.peak_procs = sorted(items, key=lambda x: -x[1])[:4]

    def run(self) -> None:
        while not self.stop_ev.is_set():
            self.sample()
            self.stop_ev.wait(self.interval)


def rule_names() -> set[str]:
    names = set()
    for f in (ROOT / "rules").glob("*.smk"):
        names |= set(re.findall(r"^\s*rule\s+(\w+)\s*:", f.read_text(), re.M))
    return names


# ---------------------------------------------------------------------------------------------------------------
# measurements


_TS = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]")


def job_times(log_text: str) -> dict[str, list[tuple[float, float]]]:
    """{rule: [(start, end), ...]} in epoch seconds from snakemake's console log (1 s resolution)."""
    starts: dict[str, tuple[str, float]] = {}
    out: dict[str, list[tuple[float, float]]] = {}
    ts = None
    pending_rule = None
    for line in log_text.splitlines():
        m = _TS.match(line)
        if m:
            ts = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y").timestamp()
            continue
        s = line.strip()
        m = re.match(r"^(?:local)?(?:rule|checkpoint) (\w+):$", s)
        if m:
            pending_rule = (m.group(1), ts)
            continue
        m = re.match(r"^jobid: (\d+)$", s)
        if m and pending_rule:
            starts[m.group(1)] = pending_rule
            pending_rule = None
            continue
        m = re.match(r"^Finished job(?:id:)? (\d+)", s)
        if m and m.group(1) in starts and ts is not None:
            rule, t0 = starts.pop(m.group(1))
            out.setdefault(rule, []).append((t0, ts))
    return out


def stage_of(rule: str) -> str:
    return "normalize" if rule.startswith("normalize_") else rule


def stage_table(times: dict) -> dict[str, dict]:
    st: dict[str, dict] = {}
    for rule, spans in times.items():
        s = st.setdefault(stage_of(rule), {"jobs": 0, "job_s": 0.0, "first": math.inf, "last": -math.inf})
        for a, b in spans:
            s["jobs"] += 1
            s["job_s"] += b - a
            s["first"] = min(s["first"], a)
            s["last"] = max(s["last"], b)
    return st


def seed_table(work: Path, datasets: list[str]) -> list[dict]:
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads = 2")
    rows = []
    for ds in datasets:
        files = sorted(str(p) for p in (work / "results" / ds / "validated").glob("*.parquet"))
        if not files:
            rows.append({"dataset": ds, "samples": 0})
            continue
        r = con.execute(
            "SELECT count(*), sum(num_prompt_tokens), sum(num_completion_tokens), sum(num_tokens), "
            "sum(coalesce(cost_usd, 0)), string_agg(DISTINCT backend, '+' ORDER BY backend), "
            "sum(billed_completion_tokens) FROM read_parquet(?)",
            [files],
        ).fetchone()
        rows.append(
            {
                "dataset": ds,
                "samples": r[0],
                "prompt_tokens": int(r[1] or 0),
                "completion_tokens": int(r[2] or 0),
                "tokens": int(r[3] or 0),
                "cost_usd": float(r[4] or 0),
                "backends": r[5] or "",
                "billed_completion_tokens": int(r[6] or 0),
            }
        )
    return rows


def rejects(work: Path) -> list[tuple]:
    import duckdb

    files = [str(p) for p in work.glob("results/*/rejected/*.parquet")]
    if not files:
        return []
    con = duckdb.connect()
    try:
        return con.execute(
            "SELECT dataset, stage, reason, count(*) FROM read_parquet(?, union_by_name=true) "
            "GROUP BY ALL ORDER BY 1, 2, 3",
            [files],
        ).fetchall()
    except duckdb.Error as exc:
        return [("?", "?", f"could not read rejects: {exc}"[:120], 0)]


def in_flight(intervals: list, models: dict[str, str], limits: dict[str, int]) -> dict[str, dict]:
    """Requests in flight per backend from the server's ``[model, arrival, reply, first]`` intervals.

    For each backend (``models``: request ``model`` -> backend name): ``max`` in flight over the run, the time-
    weighted ``mean`` from its first request to its last *new* request (first attempt of a body: after it, no new
    work arrives and the backend drains its tail), ``mean_ratio`` = mean / ``limits[backend]``, ``work_s`` (sum of
    request durations, request-seconds) and ``ideal_s`` = work_s / limit (the time the work takes at the limit)."""
    out: dict[str, dict] = {}
    for model, backend in models.items():
        iv = [(a, b, f) for m, a, b, f in intervals if m == model]
        if not iv:
            out[backend] = {"requests": 0}
            continue
        t_start = min(a for a, _, _ in iv)
        t_tail = max((a for a, _, f in iv if f), default=t_start)
        events = sorted([(a, 1) for a, _, _ in iv] + [(b, -1) for _, b, _ in iv], key=lambda e: (e[0], e[1]))
        n = peak = 0
        area, last = 0.0, t_start
        for t, d in events:
            lo, hi = max(last, t_start), min(t, t_tail)
            if hi > lo:
                area += n * (hi - lo)
            last = t
            n += d
            peak = max(peak, n)
        mean = area / (t_tail - t_start) if t_tail > t_start else float(n)
        work = sum(b - a for a, b, _ in iv)
        lim = limits[backend]
        out[backend] = {
            "requests": len(iv),
            "limit": lim,
            "max": peak,
            "mean": round(mean, 1),
            "mean_ratio": round(mean / lim, 3),
            "until_tail_s": round(t_tail - t_start, 1),
            "span_s": round(max(b for _, b, _ in iv) - t_start, 1),
            "work_s": round(work, 1),
            "ideal_s": round(work / lim, 1),
        }
    return out


def human(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def source_label(ds: str, backends: str) -> str:
    if ds in SEED_A:
        return "pre-tokenized"
    b = set(filter(None, backends.split("+")))
    if b == {"sglang_local"}:
        return "Local SGLang"
    if b == {"openrouter"}:
        return "OpenRouter"
    return "Mixed (local + OR)" if b else "-"


def print_table(rows: list[dict], scale: float) -> dict:
    print(f"\n## Per-dataset table (validated parquet; rehearsal at scale {scale:g}; seed figures scaled alongside)\n")
    print(
        "| Dataset | Samples | Prompt tok | Completion tok | Total tok | Source | Cost $ | seed samples | seed tokens |"
    )
    print("|---|--:|--:|--:|--:|---|--:|--:|--:|")
    tot = {"B": [0, 0, 0, 0, 0.0], "A": [0, 0, 0, 0, 0.0]}
    for r in rows:
        ds = r["dataset"]
        kind = "A" if ds in SEED_A else "B"
        seed_n, seed_tok = (SEED_A[ds][0], SEED_A[ds][1]) if kind == "A" else (SEED_B[ds][1], SEED_B[ds][2])
        t = tot[kind]
        for j, k in enumerate(("samples", "prompt_tokens", "completion_tokens", "tokens")):
            t[j] += r.get(k, 0)
        t[4] += r.get("cost_usd", 0.0)
        print(
            f"| {ds} | {r.get('samples', 0):,} | {human(r.get('prompt_tokens', 0))} | "
            f"{human(r.get('completion_tokens', 0))} | {human(r.get('tokens', 0))} | "
            f"{source_label(ds, r.get('backends', ''))} | {r.get('cost_usd', 0):.2f} | "
            f"{scaled(seed_n, scale):,} | {human(seed_tok * scale)} |"
        )
        if ds == "B8_sweagent":
            b = tot["B"]
            print(
                f"| **Total B** | **{b[0]:,}** | {human(b[1])} | **{human(b[2])}** | {human(b[3])} | | "
                f"{b[4]:.2f} | {scaled(35_314, scale):,} | {human(90.9e6 * scale)} |"
            )
    a = tot["A"]
    print(
        f"| **Total A** | **{a[0]:,}** | {human(a[1])} | {human(a[2])} | **{human(a[3])}** | | | "
        f"{scaled(4_800, scale):,} | {human(47.5e6 * scale)} |"
    )
    g = [tot["A"][i] + tot["B"][i] for i in range(5)]
    print(
        f"| **Grand total** | **{g[0]:,}** | | | **{human(g[3])}** | | {g[4]:.2f} | "
        f"{scaled(SEED_TOTAL_SAMPLES, scale):,} | {human(138.4e6 * scale)} |"
    )
    return {
        "B_samples": tot["B"][0],
        "B_completion_tokens": tot["B"][2],
        "B_tokens": tot["B"][3],
        "A_samples": tot["A"][0],
        "A_tokens": tot["A"][3],
        "samples": g[0],
        "tokens": g[3],
        "cost_usd": round(g[4], 2),
    }


# ---------------------------------------------------------------------------------------------------------------


def run_workflow(cmd: list[str], env: dict, log_path: Path, server_pid: int) -> tuple[int, float, MemSampler]:
    """Run snakemake to completion, its console output in ``log_path``: (exit code, wall s, memory sampler)."""
    t0 = time.monotonic()
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        mem = MemSampler([proc.pid, server_pid])
        mem.start()
        rc = proc.wait()
    elapsed = time.monotonic() - t0
    mem.stop_ev.set()
    mem.join()
    return rc, elapsed, mem


FORECAST_TOLERANCE = 0.15


def actual_generation(work: Path, datasets: list[str]) -> dict[str, dict]:
    """Per dataset: answered requests, billed completion tokens and cost of the build's responses (the pilot's
    included: the build answers them from the journal)."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads = 2")
    out = {}
    for ds in datasets:
        files = sorted(str(p) for p in (work / "results" / ds / "responses").glob("*.parquet"))
        if not files:
            continue
        r = con.execute(
            "SELECT count(*), sum(completion_tokens), sum(coalesce(cost_usd, 0)) FROM read_parquet(?) "
            "WHERE status = 'ok'",
            [files],
        ).fetchone()
        out[ds] = {"requests": int(r[0]), "completion_tokens": int(r[1] or 0), "usd": float(r[2] or 0)}
    return out


def compare_forecast(fc: dict, actual: dict[str, dict], gen_span_s: float, work_s: float) -> dict:
    """Print the forecast against the build (per dataset and in total) and return the ratios forecast / actual.

    ``gen_span_s``: the build's generate span (first job start to last end); ``work_s``: the request-seconds the
    server measured during the build (every attempt), against the forecast's request-seconds of what the pilot left
    (its latency model)."""
    print("\n## Forecast (before the build, from the pilot) vs actual\n")
    print("| Dataset | Requests fc / actual | Completion tok fc / actual | ratio | Cost $ fc / actual | ratio |")
    print("|---|--:|--:|--:|--:|--:|")
    for ds, d in fc["datasets"].items():
        a = actual.get(ds, {"requests": 0, "completion_tokens": 0, "usd": 0.0})
        rc = d["expected_completion_tokens"] / max(1, a["completion_tokens"])
        ru = (d["usd"] or 0.0) / a["usd"] if a["usd"] else float("nan")
        print(
            f"| {ds} | {d['requests_sent']:,} / {a['requests']:,} | {human(d['expected_completion_tokens'])} / "
            f"{human(a['completion_tokens'])} | {rc:.2f} | {d['usd'] or 0:.4f} / {a['usd']:.4f} | {ru:.2f} |"
        )
    t = fc["total"]
    act_comp = sum(a["completion_tokens"] for a in actual.values())
    act_usd = sum(a["usd"] for a in actual.values())
    fc_s = t["hours_remaining"] * 3600  # the build sends what the pilot did not: its generate span is that part
    fc_lo, fc_hi = t.get("hours_remaining_p10", 0.0) * 3600, t.get("hours_remaining_p90", 0.0) * 3600
    out = {
        "forecast_usd": round(t["usd"] or 0.0, 4),
        "actual_usd": round(act_usd, 4),
        "forecast_cost_ratio": round((t["usd"] or 0.0) / act_usd, 3) if act_usd else None,
        "forecast_completion_tokens": t["expected_completion_tokens"],
        "actual_completion_tokens": act_comp,
        "forecast_completion_ratio": round(t["expected_completion_tokens"] / max(1, act_comp), 3),
        "forecast_generate_s": round(fc_s, 1),
        "actual_generate_span_s": round(gen_span_s, 1),
        "forecast_time_ratio": round(fc_s / gen_span_s, 3) if gen_span_s else None,
        "forecast_generate_p10_s": round(fc_lo, 1),
        "forecast_generate_p90_s": round(fc_hi, 1),
        "actual_in_forecast_range": fc_lo <= gen_span_s <= fc_hi,
        "forecast_work_s": round(sum(d["remaining_work_s"] for d in fc["datasets"].values()), 1),
        "actual_work_s": round(work_s, 1),
    }
    out["forecast_work_ratio"] = round(out["forecast_work_s"] / work_s, 3) if work_s else None
    print(
        f"| **Total** | {t['requests_sent']:,} / {sum(a['requests'] for a in actual.values()):,} | "
        f"{human(t['expected_completion_tokens'])} / {human(act_comp)} | {out['forecast_completion_ratio']:.2f} | "
        f"{out['forecast_usd']:.4f} / {act_usd:.4f} | {out['forecast_cost_ratio']} |"
    )
    ok = [
        r is not None and abs(r - 1) <= FORECAST_TOLERANCE
        for r in (out["forecast_cost_ratio"], out["forecast_time_ratio"])
    ]
    out["forecast_within_tolerance"] = all(ok)
    print(
        f"\ngeneration time (the requests the pilot left): forecast {fc_s:.0f} s (simulated runs: 10th-90th "
        f"percentile {fc_lo:.0f}-{fc_hi:.0f} s) vs actual {gen_span_s:.0f} s (first "
        f"generate job start to last end), ratio {out['forecast_time_ratio']}; cost ratio {out['forecast_cost_ratio']} "
        f"(target: both within {FORECAST_TOLERANCE:.0%}); request-seconds: forecast {out['forecast_work_s']:,.0f} vs "
        f"{work_s:,.0f} measured by the server, ratio {out['forecast_work_ratio']}"
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# incremental scenario (issue 11)


def drop_journal_lines(work: Path, n: int, seed: int = 7) -> list[str]:
    """Remove ``n`` validated samples' lines from the generation journals (spread over the shards, seeded), as if
    their requests had failed; return their sample ids."""
    import random

    import pyarrow.parquet as pq

    rng = random.Random(seed)
    candidates = []
    for sel in sorted((work / "results/merged/selection").glob("*/*.parquet")):
        journal = work / "cache/journal" / sel.parent.name / f"{sel.stem}.jsonl"
        if journal.exists():
            ids = pq.read_table(sel, columns=["sample_id"]).column("sample_id").to_pylist()
            candidates += [(journal, sid) for sid in ids]
    picked = rng.sample(candidates, min(n, len(candidates)))
    by_journal: dict[Path, set[str]] = {}
    for journal, sid in picked:
        by_journal.setdefault(journal, set()).add(sid)
    for journal, sids in by_journal.items():
        lines = journal.read_text().splitlines()
        kept = [ln for ln in lines if json.loads(ln).get("sample_id") not in sids]
        journal.write_text("".join(ln + "\n" for ln in kept))
    return sorted(sid for _j, sid in picked)


def selection_rows(sel_dir: Path) -> dict[str, dict[str, tuple[int, str]]]:
    """``{"<ds>/<shard>": {sample_id: (num_tokens, digest of token ids + loss mask)}}`` of every selection file."""
    import duckdb

    out: dict[str, dict[str, tuple[int, str]]] = {}
    con = duckdb.connect()
    con.execute("SET threads = 2")
    for p in sorted(sel_dir.glob("*/*.parquet")):
        rows = con.execute(
            "SELECT sample_id, num_tokens, md5(input_ids::VARCHAR || '|' || loss_mask::VARCHAR) FROM read_parquet(?)",
            [str(p)],
        ).fetchall()
        out[f"{p.parent.name}/{p.stem}"] = {sid: (int(n), h) for sid, n, h in rows}
    return out


def forwarded_tokens(before: dict, after: dict) -> dict:
    """What extraction would forward after the change, given the states of ``before``: rows of a selection whose
    (sample id, token ids, loss mask) its earlier states file does not hold. Prefix reuse of a truncated row
    (``extract_states`` reuses those too) is not counted, so this is an upper bound."""
    changed, fwd_rows, fwd_tokens = [], 0, 0
    for key, rows in after.items():
        old = before.get(key, {})
        new = {sid: v for sid, v in rows.items() if old.get(sid) != v}
        if rows != old:
            changed.append(key)
        fwd_rows += len(new)
        fwd_tokens += sum(n for n, _h in new.values())
    return {
        "selections": len(after),
        "selections_changed": sorted(changed),
        "rows_forwarded": fwd_rows,
        "tokens_forwarded": fwd_tokens,
        "rows_total": sum(len(r) for r in after.values()),
        "tokens_total": sum(n for r in after.values() for n, _h in r.values()),
    }


def incremental(
    work: Path, cfg: dict, scale: float, cmd: list[str], env: dict, server_pid: int, retried: int = RETRIED_REQUESTS
) -> dict:
    """Retry ``retried`` failed requests and add one small dataset after the full build; measure what reruns.

    A failed request is simulated by removing a validated sample's journal line; the states the build would hold
    then are its selection without that sample, so the retried samples count as forwarded even when the server
    answers them as before."""
    from eagle3_data.testing import rehearsal_data as rd

    sel_dir = work / "results/merged/selection"
    merged_before = {p.name: p.stat().st_mtime_ns for p in (work / "results/merged").glob("*.parquet")}
    dropped = set(drop_journal_lines(work, retried))
    # the states a build with those requests failed would hold: their selections without the dropped samples
    before = {
        k: {sid: v for sid, v in rows.items() if sid not in dropped} for k, rows in selection_rows(sel_dir).items()
    }
    name, fmt, n, shards = NEW_DATASET
    path = work / "data" / f"{name}.json"
    good = scaled(n, scale)
    rd.write_sharegpt(path, good, 1, seed=300)
    cfg = {
        **cfg,
        "datasets": {
            **cfg["datasets"],
            name: {
                "source": {"format": fmt, "path": str(path)},
                "shards": shards,
                "generation": {"extra_body": {"user": "B7_sharegpt"}},
            },
        },
    }
    cfg_path = work / "rehearsal-incremental.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False, width=120))
    i = cmd.index("--configfile")
    cmd = cmd[: i + 1] + [str(cfg_path)] + cmd[i + 2 :] + ["--forcerun", "generate"]
    log = work / "snakemake.incremental.log"
    rc, wall, _mem = run_workflow(cmd, env, log, server_pid)
    if rc != 0:
        print(
            f"\nincremental snakemake FAILED (exit {rc}); last lines of {log}:\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )
    after = selection_rows(sel_dir)
    fwd = forwarded_tokens(before, after)
    jobs = {k: v["jobs"] for k, v in stage_table(job_times(log.read_text(errors="replace"))).items()}
    sent = sum(
        json.loads(p.read_text()).get("sent", 0)
        for p in work.glob("results/*/responses/*.json")
        if p.stat().st_mtime > time.time() - wall - 5
    )
    merged_rewritten = sum(
        1 for p in (work / "results/merged").glob("*.parquet") if merged_before.get(p.name) != p.stat().st_mtime_ns
    )
    out = {
        "snakemake_rc": rc,
        "wall_s": round(wall, 1),
        "retried_requests": len(dropped),
        "new_dataset": name,
        "new_dataset_samples": good,
        "requests_sent": sent,
        "jobs_rerun": jobs,
        "merged_shards_rewritten": merged_rewritten,
        **fwd,
        "tokens_forwarded_ratio": round(fwd["tokens_forwarded"] / max(1, fwd["tokens_total"]), 5),
    }
    print(f"\n## Incremental: retry {len(dropped)} failed requests + add a small dataset (--forcerun generate)\n")
    print("| Stage | Jobs rerun |\n|---|--:|")
    for k in sorted(jobs):
        print(f"| {k} | {jobs[k]} |")
    print(
        f"\nrequests sent {sent}; selections changed {len(fwd['selections_changed'])} of {fwd['selections']} "
        f"({', '.join(fwd['selections_changed'])}); rows forwarded {fwd['rows_forwarded']:,} of "
        f"{fwd['rows_total']:,}; tokens forwarded {fwd['tokens_forwarded']:,} of {fwd['tokens_total']:,} "
        f"({100 * out['tokens_forwarded_ratio']:.3f} % of a full build's); merged shards rewritten "
        f"{merged_rewritten} (an index over the states: no extraction)"
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--full",
        action="store_true",
        help="the seed's full scale (--scale 1 at the seed-like stream speeds; target total 30 min)",
    )
    ap.add_argument(
        "--scale",
        type=float,
        default=None,
        help=f"fraction of the seed's samples (default {DEFAULT_SCALE:g}; --full: 1)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument(
        "--local-concurrency",
        type=int,
        default=256,
        help="sglang_local's max_concurrency (seed: 256; openrouter stays at the seed's 2,000)",
    )
    ap.add_argument(
        "--openrouter-tok-s",
        type=float,
        default=None,
        help="openrouter's stream speed, tokens/s per request (default 400; --full: 100; --toy: 8,333)",
    )
    ap.add_argument(
        "--local-tok-s",
        type=float,
        default=None,
        help="sglang_local's stream speed, tokens/s per request (default 2,000; --full: 500; --toy: 8,333)",
    )
    ap.add_argument(
        "--limit-scale",
        type=float,
        default=None,
        help="factor on both backends' max_concurrency (default: --scale; --toy: 1)",
    )
    ap.add_argument("--with-report", action="store_true", help="also run the report rule (tables, plots)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (always kept with --workdir)")
    ap.add_argument("--max-shards", type=int, default=None, help="cap every dataset's shard count")
    ap.add_argument("--no-incremental", action="store_true", help="skip the incremental scenario")
    ap.add_argument(
        "--retried",
        type=int,
        default=RETRIED_REQUESTS,
        help=f"failed requests the incremental scenario retries (default {RETRIED_REQUESTS})",
    )
    ap.add_argument("--datasets", default=None, help="comma-separated subset of the seed's datasets (default: all)")
    ap.add_argument(
        "--toy",
        action="store_true",
        help=f"CI size: --scale 0.002 --max-shards 1 --retried 2 --datasets {','.join(TOY_DATASETS)}",
    )
    args = ap.parse_args(argv)
    if args.full and args.toy:
        ap.error("--full and --toy are two sizes: give one")
    speedup = 1.0 if args.full else DEFAULT_SPEEDUP
    args.openrouter_tok_s = args.openrouter_tok_s or 100.0 * speedup
    args.local_tok_s = args.local_tok_s or 500.0 * speedup
    if args.scale is None:
        args.scale = 1.0 if args.full else DEFAULT_SCALE
    target_total_s = TARGET_TOTAL_S if args.full else TARGET_DEFAULT_S
    if args.toy:
        args.scale, args.max_shards, args.datasets = 0.002, 1, args.datasets or ",".join(TOY_DATASETS)
        args.retried = 2  # of ~20 samples
        args.openrouter_tok_s = args.local_tok_s = 1 / 1.2e-4  # seconds of requests: the toy is about the stages
        args.limit_scale = 1.0 if args.limit_scale is None else args.limit_scale
    if args.limit_scale is None:
        args.limit_scale = args.scale
    if args.datasets:
        keep = set(args.datasets.split(","))
        unknown = keep - set(SEED_B) - set(SEED_A)
        if unknown:
            ap.error(f"--datasets: unknown {sorted(unknown)}; known: {sorted(SEED_B) + sorted(SEED_A)}")
        for table in (SEED_B, SEED_A):
            for name in [n for n in table if n not in keep]:
                del table[name]

    from eagle3_data.tiny_target import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()  # the tiny target's tokenizer: ids of its special tokens, looked up by name
    special_ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="eagle3-rehearsal-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"rehearsal: scale {args.scale:g}, cores {args.cores}, workdir {work}", flush=True)

    t_all = time.monotonic()
    t0 = time.monotonic()
    sources = write_sources(work / "data", args.scale, special_ids)
    t_sources = time.monotonic() - t0
    print(f"source files written in {t_sources:.1f} s:", flush=True)
    for ds, s in sources.items():
        extra = f", {human(s['tokens'])} tokens" if "tokens" in s else f" ({s['bad']} unusable)"
        print(f"  {ds:22s} {s['rows']:>6,} rows{extra}, {s['bytes'] / 2**20:7.1f} MiB, {s['write_s']:.1f} s")

    port = free_port()
    cfg = build_config(sources, port, args.scale, args.local_concurrency, args.max_shards, args.limit_scale)
    cfg_path = work / "rehearsal.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False, width=120))

    names = rule_names()
    # file targets, not --until: Snakemake 9 left the plan job unscheduled ("Out of jobs ready") with --until
    targets = (
        ["results/merged/manifest.json"]
        + (["results/reports/plan.md"] if "plan" in names else [])
        + (["results/reports/tally.md"] if args.with_report else [])
    )
    cmd = [
        "snakemake",
        "-s",
        str(ROOT / "Snakefile"),
        "-d",
        str(work),
        "--configfile",
        str(cfg_path),
        "--cores",
        str(args.cores),
        "--nolock",
        *targets,
    ]
    env = {
        **os.environ,
        FAKE_KEY_ENV: "rehearsal-not-a-secret",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    be = cfg["backends"]
    server = start_server(
        port,
        work / "server.log",
        server_config(
            {b: be[b]["model"] for b in be}, {"openrouter": args.openrouter_tok_s, "sglang_local": args.local_tok_s}
        ),
    )
    fc, t_forecast = None, 0.0
    if "forecast" in names:  # before paying: the forecast target (its pilot is journaled, never paid twice)
        fc_cmd = cmd[: -len(targets)] + ["results/reports/forecast.json"]
        print(f"\nrehearsal server on 127.0.0.1:{port}; forecast first: {' '.join(fc_cmd)}", flush=True)
        rc_fc, t_forecast, _m = run_workflow(fc_cmd, env, work / "snakemake.forecast.log", server.pid)
        if rc_fc != 0:
            print(
                f"\nforecast FAILED (exit {rc_fc}); last lines:\n"
                + "\n".join((work / "snakemake.forecast.log").read_text(errors="replace").splitlines()[-40:])
            )
        else:
            fc = json.loads((work / "results/reports/forecast.json").read_text())
            t = fc["total"]
            print(
                f"forecast in {t_forecast:.0f} s: {t['requests_sent']:,} requests, "
                f"{human(t['expected_completion_tokens'])} completion tokens, ${t['usd'] or 0:.2f}, "
                f"{t['hours'] * 3600:.0f} s of generation",
                flush=True,
            )
    import httpx

    # the build's requests only: the forecast's pilot requests were answered before it started
    n_pilot = len(httpx.get(f"http://127.0.0.1:{port}/admin/intervals", timeout=60).json()["intervals"])
    print(f"\nrehearsal server on 127.0.0.1:{port}; running: {' '.join(cmd)}", flush=True)
    smk_log = work / "snakemake.console.log"
    rc, t_workflow, mem = run_workflow(cmd, env, smk_log, server.pid)
    try:
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()
        stats.pop("completed_by_body", None)
        intervals = httpx.get(f"http://127.0.0.1:{port}/admin/intervals", timeout=60).json()["intervals"][n_pilot:]
        (work / "intervals.json").write_text(json.dumps(intervals))  # [model, arrival, reply, first] per request
    except Exception as exc:  # noqa: BLE001 - report, don't fail the benchmark on stats
        stats = {"error": str(exc)}
        intervals = []
    log_text = smk_log.read_text(errors="replace")
    if rc != 0:
        print(f"\nsnakemake FAILED (exit {rc}); last lines of {smk_log}:\n" + "\n".join(log_text.splitlines()[-60:]))

    stages = stage_table(job_times(log_text))
    print("\n## Stages (job wall times from snakemake's log, 1 s resolution)\n")
    print("| Stage | Jobs | Sum of job times (s) | Span first start..last end (s) |")
    print("|---|--:|--:|--:|")
    order = ["tiny_target", "normalize", "generate", "tokenize", "validate", "merge", "plan", "report"]
    for name in sorted(stages, key=lambda n: order.index(n) if n in order else 99):
        s = stages[name]
        print(f"| {name} | {s['jobs']} | {s['job_s']:.0f} | {s['last'] - s['first']:.0f} |")
    print(f"| **workflow (snakemake wall)** | {sum(s['jobs'] for s in stages.values())} | | **{t_workflow:.0f}** |")

    flight = in_flight(intervals, {be[b]["model"]: b for b in be}, {b: be[b]["max_concurrency"] for b in be})
    gen_jobs = job_times(log_text).get("generate", [])
    longest_shard = max((b - a for a, b in gen_jobs), default=0.0)
    gen_span = stages["generate"]["last"] - stages["generate"]["first"] if "generate" in stages else 0.0
    ideal = max((f.get("ideal_s", 0.0) for f in flight.values()), default=0.0)
    print("\n## Requests in flight per backend (server side; mean from the first request to the last new one)\n")
    print("| Backend | Limit | Requests | Max | Mean | Mean / limit | Work (req-s) | Work / limit (s) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for b, f in flight.items():
        if f.get("requests"):
            print(
                f"| {b} | {f['limit']:,} | {f['requests']:,} | {f['max']:,} | {f['mean']:,} | {f['mean_ratio']:.2f} | "
                f"{f['work_s']:,.0f} | {f['ideal_s']:,.1f} |"
            )
    print(
        f"\ngeneration span {gen_span:.0f} s; longest generate job {longest_shard:.0f} s; the work at the limit "
        f"{ideal:.0f} s; span / (longest job + work at the limit) = "
        f"{gen_span / max(1e-9, longest_shard + ideal):.2f} (target <= 1.1)"
    )

    datasets = list(SEED_B) + list(SEED_A)
    rows = seed_table(work, datasets)
    totals = print_table(rows, args.scale)
    billed = sum(r.get("billed_completion_tokens", 0) for r in rows)
    comp_b = totals["B_completion_tokens"]
    print(f"\nreconstructed vs billed completion tokens (B): {comp_b:,} vs {billed:,}")

    rj = rejects(work)
    if rj:
        print("\n## Rejects by dataset, stage, reason\n")
        for d, st, reason, n in rj:
            print(f"  {d:22s} {str(st):10s} {str(reason):28s} {n:>6,}")

    summaries = [json.loads(p.read_text()) for p in work.glob("results/*/responses/*.json")]
    gen = {
        "sent": sum(s.get("sent", 0) for s in summaries),
        "retries": sum(s.get("retries", 0) for s in summaries),
        "failed": sum(s.get("failed_total", 0) for s in summaries),
        "not_sent": sum(s.get("not_sent", 0) for s in summaries),
        "stopped_by": sorted({s.get("stopped_by") for s in summaries if s.get("stopped_by")}),
    }
    print(f"\ngeneration: {json.dumps(gen)}\nserver: {json.dumps(stats)}")

    manifest_p = work / "results/merged/manifest.json"
    manifest = json.loads(manifest_p.read_text()) if manifest_p.exists() else None
    if manifest:
        print("\n## Merge manifest (totals)\n")
        print(
            json.dumps({k: v for k, v in manifest.items() if k not in ("shards", "inputs", "selections")}, indent=1)[
                :3000
            ]
        )
    plan_files = sorted(p for p in work.glob("results/**/*plan*") if p.is_file())
    if plan_files:
        print("\n## Extraction plan\n")
        for p in plan_files:
            print(f"--- {p.relative_to(work)}")
            print(p.read_text(errors="replace")[:4000])
    else:
        print("\n## Extraction plan: not produced (no plan rule / report output in this workflow yet)")
    fc_cmp = (
        compare_forecast(
            fc, actual_generation(work, list(SEED_B)), gen_span, sum(f.get("work_s", 0.0) for f in flight.values())
        )
        if fc is not None
        else None
    )
    tally = work / "results/reports/tally.md"
    if tally.exists():
        print("\n## results/reports/tally.md\n\n" + tally.read_text())

    # the full build's figures (the forecast before it and the incremental run after it are timed on their own)
    total_s = time.monotonic() - t_all - t_forecast
    inc = None
    if rc == 0 and not args.no_incremental:
        inc = incremental(work, cfg, args.scale, cmd, env, server.pid, args.retried)
    server.terminate()
    server.wait(10)
    run_s = time.monotonic() - t_all  # the whole rehearsal: forecast, build and incremental scenario
    # the full scale's target is the build's (the seed run's); the default size's is the whole benchmark's
    judged_s = total_s if args.full else run_s
    peak_gb = mem.peak / 2**30
    print(
        f"\ntotal wall {total_s:.0f} s (sources {t_sources:.0f} s + workflow {t_workflow:.0f} s); "
        f"peak RSS of the process tree {peak_gb:.2f} GB at t={mem.peak_at:.0f} s: "
        + "; ".join(f"{c} {r / 2**20:.0f} MiB" for c, r in mem.peak_procs)
    )
    result = {
        "benchmark": "rehearsal",
        "scale": args.scale,
        "cores": args.cores,
        "snakemake_rc": rc,
        "samples": totals["samples"],
        "seed_samples_scaled": scaled(SEED_TOTAL_SAMPLES, args.scale),
        "B_completion_tokens": comp_b,
        "billed_completion_tokens": billed,
        "A_tokens": totals["A_tokens"],
        "tokens": totals["tokens"],
        "cost_usd": totals["cost_usd"],
        "stage_job_s": {k: round(v["job_s"]) for k, v in stages.items()},
        "stage_span_s": {k: round(v["last"] - v["first"]) for k, v in stages.items()},
        "sources_s": round(t_sources, 1),
        "workflow_s": round(t_workflow, 1),
        "total_s": round(total_s, 1),
        "peak_rss_gb": round(peak_gb, 2),
        "merged_samples": (manifest or {}).get("totals", {}).get("samples"),
        "in_flight": flight,
        "generate_span_s": round(gen_span),
        "longest_generate_job_s": round(longest_shard),
        "generate_jobs": len(gen_jobs),
        "work_at_limit_s": round(ideal, 1),
        "generate_span_ratio": round(gen_span / max(1e-9, longest_shard + ideal), 3),
        "target_generate_span_ratio": 1.1,
        "target_in_flight_ratio": 0.9,
        "plan_produced": bool(plan_files),
        "forecast_s": round(t_forecast, 1),
        **(fc_cmp or {"forecast_cost_ratio": None, "forecast_time_ratio": None}),
        "forecast_pilot_samples": (fc or {}).get("pilot_samples"),
        "target_forecast_tolerance": FORECAST_TOLERANCE,
        "full_scale": args.full,
        "openrouter_tok_s": args.openrouter_tok_s,
        "local_tok_s": args.local_tok_s,
        "run_s": round(run_s, 1),
        "target_total_s": target_total_s,
        "target_applies_to": "total_s (the build)" if args.full else "run_s (forecast + build + incremental)",
        "target_peak_gb": TARGET_PEAK_GB,
        "total_ratio_to_target": round(judged_s / target_total_s, 3),
        "peak_ratio_to_target": round(peak_gb / TARGET_PEAK_GB, 3),
        "meets_targets": rc == 0 and judged_s < target_total_s and peak_gb < TARGET_PEAK_GB,
        "workdir": str(work),
    }
    if inc is not None:
        result["incremental"] = {k: v for k, v in inc.items() if k != "selections_changed"} | {
            "selections_changed": len(inc["selections_changed"])
        }
        rc = rc or inc["snakemake_rc"]
    if not (args.keep or args.workdir) and rc == 0:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
