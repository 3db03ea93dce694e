"""Stage 3, tokenize: exact target token ids and loss mask for every generated response.

``input_ids = prompt_ids + completion_ids`` and ``loss_mask = [0]*len(prompt_ids) + [1]*len(completion_ids)``:
the loss mask is 1 exactly on the generated completion, including its end-of-turn token
(``templates.py`` gives the prompt/completion recipe and its sources).

``ids_source`` says where the completion ids came from:
- ``exact``: the backend returned the sampled ``output_ids`` (SGLang ``/generate``); they are used as they are
  and the response text is checked against them (a mismatch is rejected as ``exact_ids_text_mismatch``);
- ``reconstructed``: re-tokenized from the response text (OpenRouter and other text-only APIs).

Rows that can't be tokenized keep their place with ``reject_stage``/``reject_reason`` set (and empty ids);
the validate stage moves them to the rejects file, so every sample of the shard is accounted for.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

import pyarrow.parquet as pq

from . import schemas
from .templates import TargetTokens, TemplateError, load_target_tokens

log = logging.getLogger("eagle3_data.tokenize")


def _reject_row(base: dict, stage: str, reason: str, detail: str) -> dict:
    return {
        **base,
        "input_ids": [],
        "loss_mask": [],
        "num_tokens": 0,
        "num_prompt_tokens": 0,
        "num_completion_tokens": 0,
        "ids_source": None,
        "reject_stage": stage,
        "reject_reason": reason,
        "reject_detail": detail[:500],
    }


def tokenize_rows(rows: list[dict], target: TargetTokens) -> list[dict]:
    """Turn RESPONSES rows (dicts) into TOKENS rows (dicts) for ``target``.

    Each output row has ``input_ids`` (list[int], target vocabulary), ``loss_mask`` (list[int] 0/1, same length),
    token counts, ``ids_source`` and ``billed_completion_tokens`` (the backend's ``usage.completion_tokens``).
    A sample regenerated at several turns (generation mode ``all``) yields one row per turn with sample id
    ``<sample_id>@<turn>``. Never raises for a bad row: it is returned with ``reject_*`` fields set.
    """
    turns = Counter(r["sample_id"] for r in rows)
    out: list[dict] = []
    pending: list[tuple] = []  # (base row, messages, (reasoning, content, tool_calls), exact output_ids)
    prompt_texts: list[str] = []
    for r in rows:
        sid = r["sample_id"] if turns[r["sample_id"]] == 1 else f"{r['sample_id']}@{r['turn']}"
        base = {
            "sample_id": sid,
            "dataset": r["dataset"],
            "billed_completion_tokens": r.get("completion_tokens"),
            "finish_reason": r.get("finish_reason"),
            "backend": r.get("backend"),
            "provider": r.get("provider"),
            "cost_usd": r.get("cost_usd"),
        }
        if r.get("status") != "ok":
            err = r.get("error") or "generation_failed"
            code = err.split(":", 1)[0].strip() or "generation_failed"
            out.append(_reject_row(base, "generate", code, err))
            continue
        try:
            messages = json.loads(r["messages"])
            tools = json.loads(r["tools"]) if r.get("tools") else None
            tool_calls = json.loads(r["tool_calls"]) if r.get("tool_calls") else None
            prompt_text = target.render_prompt_text(messages, tools)
        except (TemplateError, json.JSONDecodeError, KeyError, TypeError) as exc:
            out.append(_reject_row(base, "tokenize", "prompt_render_failed", str(exc)))
            continue
        prompt_texts.append(prompt_text)
        pending.append((base, messages, (r.get("reasoning"), r.get("content"), tool_calls), r.get("output_ids")))

    prompt_ids_all = target.encode_texts(prompt_texts)
    # completion segments need to know whether the prompt opened the think block
    seg_lists: list[list[tuple[str, bool]] | Exception] = []
    texts: list[str] = []
    for (base, _messages, (reasoning, content, tool_calls), _exact), prompt_ids in zip(pending, prompt_ids_all):
        try:
            segs = target.completion_segments(reasoning, content, tool_calls, target.prompt_ends_open(prompt_ids))
        except TemplateError as exc:
            seg_lists.append(exc)
            continue
        seg_lists.append(segs)
        texts.extend(t for t, special in segs if not special)
    encoded = iter(target.encode_texts(texts))

    for (base, _m, _c, exact), prompt_ids, segs in zip(pending, prompt_ids_all, seg_lists):
        if isinstance(segs, Exception):
            out.append(_reject_row(base, "tokenize", "completion_format", str(segs)))
            continue
        completion: list[int] = []
        for text, special in segs:
            completion.extend([target.special_id(text)] if special else next(encoded))
        ids_source = "reconstructed"
        if exact is not None and len(exact) > 0:
            exact = [int(x) for x in exact]
            if exact[-1] != target.eot_id:
                exact = exact + [target.eot_id]
            if exact != completion:
                out.append(
                    _reject_row(
                        base,
                        "tokenize",
                        "exact_ids_text_mismatch",
                        f"backend output_ids ({len(exact)}) differ from the response text's ids ({len(completion)})",
                    )
                )
                continue
            completion, ids_source = exact, "exact"
        ids = prompt_ids + completion
        out.append(
            {
                **base,
                "input_ids": ids,
                "loss_mask": [0] * len(prompt_ids) + [1] * len(completion),
                "num_tokens": len(ids),
                "num_prompt_tokens": len(prompt_ids),
                "num_completion_tokens": len(completion),
                "ids_source": ids_source,
                "reject_stage": None,
                "reject_reason": None,
                "reject_detail": None,
            }
        )
    return out


def tokenize(responses_path: str, out_path: str, *, target: dict, log_path: str | None = None) -> dict:
    """Stage entry point: RESPONSES parquet -> TOKENS parquet (schema-checked, written atomically).

    ``target`` is the config ``target`` slice: ``path`` (local tokenizer dir), ``template`` (family name),
    ``trust_remote_code``, ``chat_template_kwargs``. Returns counts ``{rows, tokenized, rejected: {reason: n},
    tokens}``. Raises :class:`templates.TemplateError` if the tokenizer can't be loaded.
    """
    t0 = time.time()
    tt = load_target_tokens(
        target["path"],
        target.get("template", "generic"),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template_kwargs=target.get("chat_template_kwargs") or {},
    )
    rows = pq.read_table(responses_path).to_pylist()
    out = tokenize_rows(rows, tt)
    table = schemas.from_rows(out, schemas.TOKENS)
    schemas.write_checked(table, "tokens", out_path)
    rejected = Counter(r["reject_reason"] for r in out if r["reject_reason"])
    summary = {
        "rows": len(rows),
        "tokenized": len(out) - sum(rejected.values()),
        "rejected": dict(rejected),
        "tokens": sum(r["num_tokens"] for r in out),
        "seconds": round(time.time() - t0, 3),
    }
    log.info("tokenize %s: %s", responses_path, summary)
    return summary
