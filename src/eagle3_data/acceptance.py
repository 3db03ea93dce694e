"""A drafter's acceptance as its inference engine measures it: the target served by vLLM with an EAGLE-3 drafter
(speculative decoding), prompts sent, and vLLM's own counters read from ``GET /metrics``.

vLLM counts, over every speculative step of every request (``vllm/v1/spec_decode/metrics.py``):
``vllm:spec_decode_num_drafts_total`` (steps that proposed tokens), ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total`` and ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position=k}``.
The acceptance length is ``1 + accepted / drafts`` (tokens the target emits per verify step: the accepted drafts
and its own next token), as vLLM's ``tests/v1/spec_decode/test_acceptance_length.py`` and speculators'
``scripts/evaluate`` read it; the acceptance rate at position ``k`` is ``accepted_k / drafts``.

The server is a launched one (:func:`eagle3_data.backends.server.launch_server`): a backend's ``launch`` (e.g. the
vLLM command of ``resources/configs/real-small.yaml``) with ``--speculative-config`` added by
:func:`speculative_launch`. The drafter is a directory saved in speculators' format
(``Eagle3DraftModel.save_pretrained``: ``config.json`` with ``speculators_model_type: eagle3``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "SpecDecodeCounters",
    "parse_metrics",
    "request_counters",
    "speculative_launch",
    "measure_groups",
    "measure_drafter",
]

#: the counters this module reads, without their ``_total`` suffix (prometheus_client's family names)
_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters at one moment (sums over engines). ``accepted_per_position[k]``: drafts
    whose token ``k`` (0-based) was accepted. Subtract two readings for what happened between them; add the
    counters of several replies for theirs."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)

    def _combine(self, other: SpecDecodeCounters, sign: float) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0.0] * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + [0.0] * (n - len(other.accepted_per_position))
        return SpecDecodeCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            [x + sign * y for x, y in zip(a, b)],
        )

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, 1.0)

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, -1.0)

    @property
    def acceptance_length(self) -> float:
        """``1 + accepted / drafts``: tokens emitted per verify step (1.0 when nothing was drafted)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """``accepted_per_position[k] / drafts`` for each position ``k``."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    def summary(self) -> dict:
        """The counters, the acceptance length and the per-position rates (rounded to 6 decimals)."""
        return {
            "drafts": int(self.drafts),
            "draft_tokens": int(self.draft_tokens),
            "accepted": int(self.accepted),
            "acceptance_length": round(self.acceptance_length, 6),
            "acceptance_rate_per_position": [round(r, 6) for r in self.acceptance_rate_per_position],
        }


def parse_metrics(text: str) -> SpecDecodeCounters:
    """The speculative-decoding counters of a Prometheus text exposition (vLLM's ``GET /metrics``), parsed with
    ``prometheus_client``. Counters a server without a drafter does not export read 0. Raises ValueError on a
    ``position`` label that is not an integer."""
    from prometheus_client.parser import text_string_to_metric_families

    out = SpecDecodeCounters()
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the *_created gauges prometheus_client pairs with each counter
            name = sample.name[: -len("_total")]
            if name in _METRICS:
                setattr(out, _METRICS[name], getattr(out, _METRICS[name]) + sample.value)
            elif name == _PER_POSITION:
                k = int(sample.labels["position"])
                per_position[k] = per_position.get(k, 0.0) + sample.value
    out.accepted_per_position = [per_position.get(k, 0.0) for k in range(max(per_position, default=-1) + 1)]
    return out


def speculative_launch(launch: dict, drafter: str | Path, num_speculative_tokens: int = 3) -> dict:
    """A copy of the vLLM ``launch`` with the EAGLE-3 ``drafter`` (a speculators-format directory) added as
    ``--speculative-config``, and each reply's own counters asked for (``--per-request-spec-decode-metrics
    summary``, vLLM >= 0.32). Raises ValueError when the command already has one or is not a string."""
    out = copy.deepcopy(launch)
    command = out.get("command")
    if not isinstance(command, str):
        raise ValueError("launch.command: a string command is needed to add --speculative-config")
    if "--speculative-config" in command or "--speculative_config" in command:
        raise ValueError("launch.command already has a --speculative-config")
    spec = {"method": "eagle3", "model": str(Path(drafter).resolve()), "num_speculative_tokens": num_speculative_tokens}
    out["command"] = f"{command} --speculative-config '{json.dumps(spec)}' --per-request-spec-decode-metrics summary"
    return out


async def _send_all(client, model: str, prompts: list[list[dict]], max_tokens: int) -> list[dict]:
    async def one(messages: list[dict]) -> dict:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        resp = await client.post("/v1/chat/completions", json=body)
        resp.raise_for_status()
        return resp.json()

    return list(await asyncio.gather(*(one(m) for m in prompts)))


def request_counters(reply: dict) -> SpecDecodeCounters:
    """One chat reply's own counters, from the ``metrics.speculative_decoding`` vLLM adds to it when started with
    ``--per-request-spec-decode-metrics summary`` (:func:`speculative_launch` adds it): ``acceptance_histogram[j]``
    verify steps accepted exactly ``j`` drafted tokens, so position ``k`` was accepted in ``sum_{j > k}`` of them.
    A reply without them (a server without a drafter) counts nothing."""
    spec = (reply.get("metrics") or {}).get("speculative_decoding")
    if not spec:
        return SpecDecodeCounters()
    hist = [int(n) for n in spec["acceptance_histogram"]]
    return SpecDecodeCounters(
        drafts=float(spec["num_spec_steps"]),
        draft_tokens=float(spec["num_draft_tokens"]),
        accepted=float(spec["num_accepted_draft_tokens"]),
        accepted_per_position=[float(sum(hist[k + 1 :])) for k in range(len(hist) - 1)],
    )


def measure_groups(base_url: str, model: str, groups: dict[str, list[list[dict]]], *, max_tokens: int) -> dict:
    """Send every group's prompts (chat messages) to the server at ``base_url`` (``http://127.0.0.1:P``) at once,
    greedy (temperature 0), reading ``/metrics`` before and after.

    Returns per group the :meth:`SpecDecodeCounters.summary` of its replies' own counters (:func:`request_counters`),
    ``requests`` and ``completion_tokens``; and ``overall``: the counters of ``/metrics`` over the window, the same
    figures, ``seconds`` (wall) and ``completion_tokens_per_s``, and ``replies_add_up``: whether the replies'
    counters sum to ``/metrics``' (they must, when nothing else uses the server). Raises
    ``httpx.HTTPStatusError`` on a reply that is not 2xx."""
    import httpx

    names = [name for name, prompts in groups.items() for _ in prompts]
    flat = [m for prompts in groups.values() for m in prompts]
    limits = httpx.Limits(max_connections=max(1, len(flat)))

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits, trust_env=False) as client:
            return await _send_all(client, model, flat, max_tokens)

    with httpx.Client(base_url=base_url, timeout=None, trust_env=False) as sync:
        before = parse_metrics(sync.get("/metrics").text)
        t0 = time.perf_counter()
        replies = asyncio.run(run())
        seconds = time.perf_counter() - t0
        out: dict = {}
        summed = SpecDecodeCounters()
        for name in groups:
            mine = [r for r, n in zip(replies, names) if n == name]
            counters = sum((request_counters(r) for r in mine), SpecDecodeCounters())
            summed = summed + counters
            tokens = sum(int(r["usage"]["completion_tokens"]) for r in mine)
            out[name] = {**counters.summary(), "requests": len(mine), "completion_tokens": tokens}
        for _ in range(10):  # the engine's last step may reach /metrics just after its reply: wait up to 2 s for it
            window = parse_metrics(sync.get("/metrics").text) - before
            if window.summary() == summed.summary():
                break
            time.sleep(0.2)
    tokens = sum(int(r["usage"]["completion_tokens"]) for r in replies)
    out["overall"] = {
        **window.summary(),
        "requests": len(replies),
        "completion_tokens": tokens,
        "seconds": round(seconds, 2),
        "completion_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "replies_add_up": summed.summary() == window.summary(),
    }
    return out


def measure_drafter(
    launch: dict,
    model: str,
    groups: dict[str, list[list[dict]]],
    log_path: str | Path,
    *,
    drafter: str | Path | None = None,
    num_speculative_tokens: int = 3,
    max_tokens: int = 160,
) -> dict:
    """Launch the vLLM ``launch`` for ``model`` (with ``drafter`` as EAGLE-3 speculator; None: the target alone,
    the baseline), run :func:`measure_groups`, stop the server. Returns ``{"startup_s": seconds to ready,
    "groups": its result}``. Raises
    :class:`eagle3_data.backends.server.ServerLaunchError` (with the log's last lines, ``log_path``) when the server
    does not start."""
    from .backends.server import launch_server

    if drafter is not None:
        launch = speculative_launch(launch, drafter, num_speculative_tokens)
    t0 = time.perf_counter()
    with launch_server(launch, model, log_path, name="acceptance") as server:
        startup = time.perf_counter() - t0
        res = measure_groups(f"http://127.0.0.1:{server.port}", model, groups, max_tokens=max_tokens)
    return {"startup_s": round(startup, 1), "groups": res}
