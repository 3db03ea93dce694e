"""eagle3_data.acceptance.measure_groups against a fake vLLM: the fault server, each reply carrying its own
speculative-decoding counters (``metrics.speculative_decoding``, as vLLM 0.32 with
``--per-request-spec-decode-metrics summary``) and ``GET /metrics`` exposing their running sums in vLLM's format.
The real engine is exercised by benchmarks/draft_quality.py's toy run (tests/workflow/test_benchmarks.py)."""

from __future__ import annotations

import random
import threading

import pytest

from eagle3_data.acceptance import measure_groups
from eagle3_data.testing.fault_server import FaultServer

K = 3  # speculative tokens


def fake_vllm(fs: FaultServer, foreign_drafts: int = 0) -> dict:
    """Make ``fs`` answer as vLLM with a drafter: per reply a histogram drawn from its body, /metrics the sums (plus
    ``foreign_drafts`` steps no reply owns: another client's). Returns the running totals."""
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    totals = {"drafts": foreign_drafts, "draft_tokens": K * foreign_drafts, "accepted": 0, "pos": [0] * K}
    lock = threading.Lock()
    orig = fs.app.completion

    def completion(body, bh):
        resp = orig(body, bh)
        rng = random.Random(bh)
        hist = [rng.randint(0, 20) for _ in range(K + 1)]
        steps, acc = sum(hist), sum(j * n for j, n in enumerate(hist))
        with lock:
            totals["drafts"] += steps
            totals["draft_tokens"] += K * steps
            totals["accepted"] += acc
            for k in range(K):
                totals["pos"][k] += sum(hist[k + 1 :])
        resp["metrics"] = {
            "speculative_decoding": {
                "mean_acceptance_length": 1 + acc / steps if steps else 1.0,
                "draft_acceptance_rate": acc / (K * steps) if steps else 0.0,
                "acceptance_histogram": hist,
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": acc,
                "num_draft_tokens": K * steps,
                "num_spec_tokens": K,
            }
        }
        return resp

    async def metrics(request):
        label = 'engine="0",model_name="m"'
        lines = []
        for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted")):
            lines += [f"# TYPE vllm:spec_decode_num_{name}_total counter"]
            lines += [f"vllm:spec_decode_num_{name}_total{{{label}}} {float(totals[key])}"]
        lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{k}"}} {float(n)}'
            for k, n in enumerate(totals["pos"])
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    fs.app.completion = completion
    routes = fs.app.routes
    fs.app.routes = lambda: [Route("/metrics", metrics, methods=["GET"])] + routes()
    return totals


def prompts(n: int, tag: str) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{tag} question number {i}"}] for i in range(n)]


def test_groups_are_their_replies_counters_and_overall_is_metrics_over_the_window():
    fs = FaultServer({"min_tokens": 5, "max_tokens": 30})
    totals = fake_vllm(fs)
    with fs:
        # an earlier request: /metrics counts it, the window does not
        measure_groups(fs.url, "m", {"warm": prompts(2, "warm")}, max_tokens=20)
        before = dict(totals, pos=list(totals["pos"]))
        out = measure_groups(fs.url, "m", {"chat": prompts(5, "chat"), "code": prompts(3, "code")}, max_tokens=20)
    groups = [out["chat"], out["code"]]
    assert [g["requests"] for g in groups] == [5, 3] and out["overall"]["requests"] == 8
    o = out["overall"]
    assert o["drafts"] == totals["drafts"] - before["drafts"] == sum(g["drafts"] for g in groups)
    assert o["accepted"] == totals["accepted"] - before["accepted"] == sum(g["accepted"] for g in groups)
    assert o["completion_tokens"] == sum(g["completion_tokens"] for g in groups) > 0
    assert o["replies_add_up"] is True and o["completion_tokens_per_s"] > 0
    assert o["acceptance_length"] == pytest.approx(1 + o["accepted"] / o["drafts"], abs=1e-6)
    pos = [a - b for a, b in zip(totals["pos"], before["pos"])]
    assert o["acceptance_rate_per_position"] == pytest.approx([p / o["drafts"] for p in pos], abs=1e-6)
    for g in groups:
        rates = g["acceptance_rate_per_position"]
        assert len(rates) == K and rates == sorted(rates, reverse=True)
        assert sum(rates) * g["drafts"] == pytest.approx(g["accepted"], abs=1e-3)


def test_counters_nobody_sent_are_told():
    """Another client's drafts in the window: /metrics counts them, no reply owns them (measure_groups waits up to
    2 s for /metrics to catch up with the replies, then says they do not add up)."""
    fs = FaultServer({"min_tokens": 5, "max_tokens": 30})
    totals = fake_vllm(fs)
    ours = fs.app.completion

    def with_foreign(body, bh):
        totals["drafts"] += 7  # seven drafts of a request that is not ours
        return ours(body, bh)

    fs.app.completion = with_foreign
    with fs:
        before = totals["drafts"]
        out = measure_groups(fs.url, "m", {"chat": prompts(2, "chat")}, max_tokens=20)
    assert out["overall"]["drafts"] == totals["drafts"] - before == out["chat"]["drafts"] + 14
    assert out["overall"]["replies_add_up"] is False
