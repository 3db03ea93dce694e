"""Rule original_answers: a dataset's own assistant answers as its RESPONSES shard (``answers: original``).

No request is sent and nothing is journaled: each row holds the prompt exactly as rule generate would have sent
it and the source's own answer to it, so tokenize (the target's chat template), validate, merge, extract and
export treat the shard as a generated one. The off-policy baseline: the drafter learns another model's answers
rendered in the target's format.

Rows (``schemas.RESPONSES``), for the samples generate would take (sorted by ``sample_id``, the shard's share of
``generation.max_samples``):

- ``generation.mode: last``: one row per sample, the last assistant turn (index > 0); ``mode: all``: one row per
  assistant turn, each prompt holding the source's earlier turns, their original answers included;
- ``messages``: the prompt (the conversation before the turn; a Kimi target's history tool-call ids rewritten as
  generate sends them), ``tools`` as in the source;
- ``content`` and ``tool_calls`` (JSON) from the source's assistant message; ``reasoning`` from its
  ``reasoning_content`` (or ``reasoning``) field, else the thought of an OpenThoughts-114k
  ``<|begin_of_thought|>`` block (``content`` then the solution), else ``""``: an empty think block, what the
  target's template renders for an answer without reasoning. A ``<think>`` block left in the content (source
  option ``strip_think: false``) is split out by tokenize for a thinking target;
- ``finish_reason`` ``tool_calls`` when the answer calls tools, else ``stop``; ``status`` ``ok``; ``backend``
  :data:`ORIGINAL_BACKEND`; ``request_key`` a content hash of the row; ``prompt_tokens``,
  ``completion_tokens``, ``reasoning_tokens``, ``cost_usd``, ``provider``, ``model``, ``latency_s``,
  ``output_ids``, ``completed_at``, ``prompt_ids``: null (nothing billed: validate's count audit skips them).

A sample with no answer to take is a ``failed`` row with ``backend`` :data:`ORIGINAL_BACKEND` (tokenize turns
it into a reject of stage ``original_answers``): ``no_original_answer`` (no assistant message after the first
message), ``bad_prompt`` (unusable ``messages`` or ``tools``, as in generate), and, for an answer that is there but
is not one (:func:`answer_problem`): ``unclosed_think`` (its content opens ``<think>`` and never closes it: a
reasoning cut off, source option ``strip_think: false``), ``reasoning_only`` (reasoning but no final answer and
no tool call), ``empty_original_answer`` (no reasoning, content or tool call at all).
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import TYPE_CHECKING

from . import schemas
from .config.lookup import ORIGINAL_BACKEND
from .files import content_hash, write_json

if TYPE_CHECKING:
    from .settings import OriginalAnswersSettings

log = logging.getLogger("eagle3_data.original_answers")

#: the reject reason of a sample without an assistant answer to take
NO_ANSWER = "no_original_answer"
#: the reject reasons of an answer that is not one (:func:`answer_problem`)
UNCLOSED_THINK = "unclosed_think"
REASONING_ONLY = "reasoning_only"
EMPTY_ANSWER = "empty_original_answer"

_THOUGHT = re.compile(r"^\s*<\|begin_of_thought\|>(.*?)(?:<\|end_of_thought\|>|$)(.*)$", re.DOTALL)
_SOLUTION = re.compile(r"<\|begin_of_solution\|>(.*?)(?:<\|end_of_solution\|>|$)", re.DOTALL)


def answer_turns(messages: list[dict], mode: str) -> list[int]:
    """Indices of the assistant turns whose answers become rows: the last one (``mode`` ``last``) or every one
    (``all``), index 0 excepted (no prompt before it); ``[]`` when there is none. Raises ValueError for another
    mode."""
    idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    if mode == "last":
        return idx[-1:]
    if mode == "all":
        return idx
    raise ValueError(f"generation.mode must be 'last' or 'all', got {mode!r}")


def answer_fields(message: dict) -> dict:
    """``{"reasoning", "content", "tool_calls"}`` of a RESPONSES row from a source assistant ``message`` (see the
    module docstring; ``tool_calls`` as JSON text or None)."""
    content = message.get("content")
    content = content if isinstance(content, str) else ""
    reasoning = next((message[k] for k in ("reasoning_content", "reasoning") if isinstance(message.get(k), str)), None)
    if reasoning is None:
        m = _THOUGHT.match(content)
        if m:
            rest = m.group(2)
            sol = _SOLUTION.search(rest)
            reasoning, content = m.group(1).strip(), (sol.group(1) if sol else rest).strip()
    calls = message.get("tool_calls") or None
    return {
        "reasoning": reasoning if reasoning is not None else "",
        "content": content,
        "tool_calls": json.dumps(calls, ensure_ascii=False) if calls else None,
    }


def answer_problem(fields: dict) -> tuple[str, str] | None:
    """``(reason, detail)`` when the answer ``fields`` (:func:`answer_fields`) can't be trained on as an answer,
    else None: an unclosed ``<think>`` in the content (:data:`UNCLOSED_THINK`), reasoning without a final answer
    or tool call (:data:`REASONING_ONLY`; a ``<think>...</think>`` block left in the content counts as
    reasoning), nothing at all (:data:`EMPTY_ANSWER`)."""
    content, reasoning, calls = fields["content"] or "", fields["reasoning"] or "", fields["tool_calls"]
    if content.count("<think>") > content.count("</think>"):
        return UNCLOSED_THINK, (
            "the answer opens <think> and never closes it (a reasoning cut off?): no final answer to train on"
        )
    thought, sep, final = content.rpartition("</think>")
    if not sep:
        thought, final = "", content
    if final.strip() or calls:
        return None
    if reasoning.strip() or thought.replace("<think>", "").strip():
        return REASONING_ONLY, "the answer has reasoning but no final answer or tool call: nothing it concludes"
    return EMPTY_ANSWER, "the source's answer is empty (no reasoning, content or tool call)"


def prompt_messages(history: list[dict], tool_call_ids: str) -> list[dict]:
    """The prompt messages generate sends for ``history`` (``tool_call_ids`` ``kimi``: history tool-call ids in
    Kimi's ``functions.<name>:<index>`` form, :func:`templates.rewrite_kimi_tool_call_ids`; ``source``: as they
    are)."""
    if tool_call_ids == "kimi":
        from .templates import rewrite_kimi_tool_call_ids

        return rewrite_kimi_tool_call_ids(history)
    return list(history)


def answer_rows(sample, dataset: str, mode: str, tool_call_ids: str) -> list[dict]:
    """The RESPONSES rows of one prompts sample (:class:`eagle3_data.generate.Sample`): its ok rows, or one
    ``no_original_answer`` failed row."""
    from .generate.runner import failed_row

    messages = sample.messages
    turns = answer_turns(messages, mode)
    tools_json = json.dumps(sample.tools, ensure_ascii=False) if sample.tools else None
    if not turns:
        prompt = prompt_messages(messages, tool_call_ids)
        key = content_hash(dataset, sample.sample_id, NO_ANSWER, length=16)
        row = failed_row(
            sample,
            dataset,
            len(messages),
            key,
            prompt,
            NO_ANSWER,
            "no assistant answer after the first message (the conversation ends with "
            f"{messages[-1].get('role') if messages else 'nothing'!r}): nothing to train on",
        )
        return [{**row, "backend": ORIGINAL_BACKEND}]
    rows = []
    for turn in turns:
        prompt = prompt_messages(messages[:turn], tool_call_ids)
        fields = answer_fields(messages[turn])
        problem = answer_problem(fields)
        if problem:  # one unusable answer fails the sample (mode all: its other turns' prompts hold this one)
            key = content_hash(dataset, sample.sample_id, problem[0], int(turn), length=16)
            row = failed_row(sample, dataset, turn, key, prompt, *problem)
            return [{**row, "backend": ORIGINAL_BACKEND}]
        rows.append(
            {
                "sample_id": sample.sample_id,
                "dataset": dataset,
                "turn": int(turn),
                "request_key": content_hash(
                    dataset, sample.sample_id, int(turn), ORIGINAL_BACKEND, prompt, sample.tools, fields, length=16
                ),
                "messages": json.dumps(prompt, ensure_ascii=False),
                "tools": tools_json,
                "status": "ok",
                "error": None,
                **fields,
                "finish_reason": "tool_calls" if fields["tool_calls"] else "stop",
                "backend": ORIGINAL_BACKEND,
            }
        )
    return rows


def original_answers(
    prompts_path, out_path, *, shard: str, settings: "OriginalAnswersSettings", summary_path=None
) -> dict:
    """Write the RESPONSES shard ``out_path`` (atomically) of the source's own answers to the prompts of
    ``prompts_path`` (PROMPTS parquet); return its summary (also written to ``summary_path`` as JSON).

    ``settings``: :class:`eagle3_data.settings.OriginalAnswersSettings` (dataset, mode, max_samples, num_shards,
    tool_call_ids). Returns a dict with the keys of generate's summary that the reports and the run's last
    screen read: dataset, shard, samples (prompts considered, unusable ones included), ok (samples with every
    row ok), failed (reason -> samples), failed_total, not_sent (0), over_max_samples, stopped_by
    (``all samples done`` or ``max_samples``), rows, by_backend (``{"original": ok rows}``), sent, from_journal,
    retries (0), prompt_tokens, completion_tokens (0), cost_usd, total_cost_usd (0.0), wall_s, cpu_s
    (seconds), and ``answers: "original"``.

    Raises ValueError naming the file and row when ``prompts_path`` is not a PROMPTS parquet or a row has a
    null ``sample_id``.
    """
    from .generate.prompts import read_prompts, shard_share

    t0 = time.monotonic()
    ds = settings.dataset
    tag = f"[{ds}/{shard}]"
    samples, bad = read_prompts(prompts_path, settings.mode)
    samples.sort(key=lambda s: s.sample_id)
    capped = 0
    if settings.max_samples is not None:
        keep = shard_share(int(settings.max_samples), settings.num_shards, shard)
        capped = max(0, len(samples) - keep)
        samples = samples[:keep]
    failed: dict[str, int] = {}
    failed_rows = _bad_prompt_rows(bad, ds, tag, failed)
    ok_rows, ok = _answered(samples, settings, failed_rows, failed)
    with schemas.CheckedParquetWriter("responses", out_path) as writer:
        writer.write_rows(ok_rows)
        writer.write_rows(failed_rows)
        n_rows = writer.rows
    summary = _summary(ds, shard, len(samples), ok, failed, capped, len(ok_rows), n_rows, t0)
    log.info(
        "%s %d sample(s): %d answered from the source (%d row(s), mode %s), %d failed %s, %d over "
        "max_samples; no request sent",
        tag,
        summary["samples"],
        ok,
        len(ok_rows),
        settings.mode,
        summary["failed_total"],
        failed,
        capped,
    )
    if summary_path is not None:
        write_json(summary, summary_path)
    return summary


def _bad_prompt_rows(bad: list[dict], ds: str, tag: str, failed: dict[str, int]) -> list[dict]:
    """The ``failed`` rows (reason ``bad_prompt``) of the unusable prompts ``bad`` (of ``read_prompts``), counted
    in ``failed``; a duplicate ``sample_id`` is logged and skipped."""
    from .generate.prompts import Sample
    from .generate.runner import failed_row

    rows = []
    for b in bad:
        if b.get("dup"):
            log.warning("%s row %d: duplicate sample_id %s skipped", tag, b["row"], b["sample_id"])
            continue
        r = failed_row(
            Sample(b["sample_id"], "[]", None, []),
            ds,
            0,
            content_hash(ds, b["sample_id"], "bad_prompt"),
            b.get("raw") or "[]",
            "bad_prompt",
            b["detail"],
        )
        r["tools"] = b.get("tools")
        r["backend"] = ORIGINAL_BACKEND
        rows.append(r)
        failed["bad_prompt"] = failed.get("bad_prompt", 0) + 1
    return rows


def _answered(
    samples: list, settings: "OriginalAnswersSettings", failed_rows: list[dict], failed: dict[str, int]
) -> tuple[list[dict], int]:
    """The ``ok`` rows of ``samples`` and how many samples they answer; a sample without a usable answer adds
    its failed row to ``failed_rows`` and counts in ``failed`` under its reason."""
    ok_rows: list[dict] = []
    ok = 0
    for s in samples:
        rows = answer_rows(s, settings.dataset, settings.mode, settings.tool_call_ids)
        if rows[0]["status"] == "ok":
            ok_rows.extend(rows)
            ok += 1
        else:
            failed_rows.extend(rows)
            reason = rows[0]["error"].split(":", 1)[0]
            failed[reason] = failed.get(reason, 0) + 1
    return ok_rows, ok


def _summary(
    ds: str, shard: str, n_samples: int, ok: int, failed: dict, capped: int, ok_rows: int, n_rows: int, t0: float
) -> dict:
    """The summary of :func:`original_answers` (generate's keys; no request sent, nothing billed)."""
    from .generate.job import cpu_s

    return {
        "dataset": ds,
        "shard": shard,
        "answers": "original",
        "samples": n_samples + failed.get("bad_prompt", 0),
        "ok": ok,
        "failed": failed,
        "failed_total": sum(failed.values()),
        "from_journal": 0,
        "sent": 0,
        "retries": 0,
        "retry_reasons": {},
        "not_sent": 0,
        "over_max_samples": capped,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cost_usd": 0.0,
        "total_completion_tokens": 0,
        "total_cost_usd": 0.0,
        "by_backend": {ORIGINAL_BACKEND: ok_rows} if ok_rows else {},
        "stopped_by": "max_samples" if capped else "all samples done",
        "servers_started": [],
        "servers_attached": [],
        "journal_bad_lines": 0,
        "rows": n_rows,
        "other_model_replies": 0,
        "wall_s": round(time.monotonic() - t0, 3),
        "startup_s": None,
        "wrapup_s": None,
        "cpu_s": cpu_s(),
    }
