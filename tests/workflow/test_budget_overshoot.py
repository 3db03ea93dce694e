"""A budget stop's overshoot: bounded by the requests in flight when the budget was reached, and said on the
run's last screen, counted at the fault server (the completion tokens it billed).

The scratch workflow of ``test_stop.py`` (200 prompts in 2 shards, the qwen3 fixture as the target) with
``budget_completion_tokens: 300`` (150 per shard). The server's replies are 2 tokens long until 20 have been sent,
then 8: the running mean the budget counts the requests in flight at is too low, so the budget is overshot (by at
most the replies in flight, 8 tokens each)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from eagle3_data.testing.workflow import snakemake_env

from eagle3_data.testing.fault_server import FaultServer
from test_stop import TARGETS, _workflow, target_dir  # noqa: F401

pytestmark = pytest.mark.slow

BUDGET = 300
LONG = 8  # completion tokens of each reply after the switch: the most any reply is billed


def _journal_tokens(wd: Path) -> int:
    import json

    return sum(
        json.loads(ln).get("completion_tokens") or 0
        for p in (wd / "cache" / "journal" / "chat").glob("*.jsonl")
        for ln in p.read_text().splitlines()
    )


def test_a_budget_overshoot_is_bounded_by_what_was_in_flight_and_reported(tmp_path, target_dir):  # noqa: F811
    with FaultServer({"latency_min_s": 0.2, "latency_max_s": 0.4, "min_tokens": 2, "max_tokens": 2}) as fs:
        wd = _workflow(tmp_path, target_dir, fs)
        cfg = yaml.safe_load((wd / "mine.yaml").read_text())
        cfg["datasets"]["chat"]["generation"] = {"budget_completion_tokens": BUDGET}
        (wd / "mine.yaml").write_text(yaml.safe_dump(cfg))
        done = threading.Event()

        def lengthen():  # replies grow once 20 were sent: the mean in-flight estimate lags behind
            while not done.is_set() and fs.app.completed < 20:
                time.sleep(0.02)
            fs.app.config.update({"min_tokens": LONG, "max_tokens": LONG})

        t = threading.Thread(target=lengthen, daemon=True)
        t.start()
        p = subprocess.run(
            [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", "--configfile", "mine.yaml"],
            cwd=wd,
            env=snakemake_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        done.set()
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-3000:]
        billed = fs.app.billed_completion_tokens
        assert billed == _journal_tokens(wd)  # every billed token is journaled and counted
        screen = out[out.rindex("Run summary") :]
        row = next(ln.split() for ln in screen.splitlines() if ln.startswith("chat "))
        assert row[-1] == "budget_completion_tokens" and int(row[5]) > 0, row  # not sent: the budget stopped it
        # the overshoot, as the last screen says it, is the server's count
        m = re.search(
            r"^Budget overshoot \(the replies in flight when it was reached; each at most max_tokens\): "
            r"chat budget_completion_tokens ([\d,]+) of ([\d,]+) completion tokens \(\+([\d.]+)%, "
            r"([\d,]+) in flight\)\.$",
            screen,
            re.M,
        )
        assert m, screen
        spent, budget, pct, in_flight = (
            int(m[1].replace(",", "")),
            int(m[2].replace(",", "")),
            float(m[3]),
            int(m[4].replace(",", "")),
        )
        assert (spent, budget) == (billed, BUDGET) and pct == round(100 * (billed / BUDGET - 1), 1)
        # bounded: at most the replies that could still arrive when each shard's spend reached its share (the
        # requests then in flight and the reply that reached it, each at most LONG tokens): per shard at most the
        # backend's max_concurrency + 1
        assert 1 <= in_flight <= 2 * (cfg["backends"]["fake"]["max_concurrency"] + 1)
        assert 0 < billed - BUDGET <= in_flight * LONG, (billed, in_flight)
