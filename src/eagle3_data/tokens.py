"""Stage 3, tokenize: exact target token ids and loss mask for every generated response (rule ``tokenize``; the
module is ``tokens``, so that it does not shadow the standard library's ``tokenize``).

``input_ids = prompt_ids + completion_ids`` and ``loss_mask = [0]*len(prompt_ids) + [1]*len(completion_ids)``:
the loss mask is 1 exactly on the generated completion, including its end-of-turn token (the ``templates`` package gives
the prompt/completion recipe per template family and its sources).

``ids_source`` says where the completion ids came from:

- ``exact``: the backend returned the sampled ``output_ids`` (SGLang ``/generate``); they are used as they are
  (plus the end-of-turn id when the backend left the stop token out) and their decoded text must equal the
  response text in the target's completion format, else the row is rejected ``exact_ids_text_mismatch``;
A row whose server returned its own prompt ids (``prompt_ids``, vLLM's ``return_token_ids``) that differ from this
render is rejected ``server_prompt_mismatch`` (the message names the first differing position and both tokens).

- ``reconstructed``: re-tokenized from the response text (OpenRouter and other text-only APIs); the ids must decode
  back to exactly that text (text -> ids -> text), else the row is rejected ``round_trip`` (a tokenizer whose
  normalizer or unknown-token handling loses text can't give the target's ids).

Speed: prompts are rendered once each (Jinja), then every prompt and completion text piece of the shard is encoded
in ONE batched tokenizer call (parallel in Rust for a fast tokenizer) and the decode check is one batched decode;
no per-token Python loops. Rows that can't be tokenized keep their place with ``reject_stage``/``reject_reason``
set (and empty ids); the validate stage moves them to the rejects file, so every sample is accounted for.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import schemas
from .config.lookup import ORIGINAL_BACKEND
from .prompt_check import mismatch_detail
from .images import image_parts, row_images
from .templates import (
    TargetTokens,
    TemplateError,
    count_tool_calls,
    normalize_finish_reason,
    split_reasoning_from_content,
    target_tokens,
)

if TYPE_CHECKING:
    from .settings import TokenizeSettings

log = logging.getLogger("eagle3_data.tokens")

_RESPONSE_COLUMNS = (
    "sample_id",
    "dataset",
    "turn",
    "messages",
    "tools",
    "status",
    "error",
    "reasoning",
    "content",
    "tool_calls",
    "finish_reason",
    "completion_tokens",
    "prompt_tokens",
    "backend",
    "provider",
    "cost_usd",
    "output_ids",
    "prompt_ids",
)


def _base(r: dict, sid: str) -> dict:
    return {
        "sample_id": sid,
        "dataset": r["dataset"],
        "billed_completion_tokens": r.get("completion_tokens"),
        "billed_prompt_tokens": r.get("prompt_tokens"),
        "finish_reason": r.get("finish_reason"),
        "backend": r.get("backend"),
        "provider": r.get("provider"),
        "cost_usd": r.get("cost_usd"),
    }


def _reject(base: dict, stage: str, reason: str, detail: str) -> dict:
    return {
        **base,
        "ids_source": None,
        "reject_stage": stage,
        "reject_reason": reason,
        "reject_detail": (detail or "")[:500],
    }


def _kept_fields(meta_row: dict) -> dict:
    """A TOKENS row's fields that stay when it is rejected after all (not its verdict, id source or images)."""
    return {k: v for k, v in meta_row.items() if not k.startswith("reject_") and k not in ("ids_source", "images")}


_TARGET_IMAGES: dict[str, object] = {}


def expand_images(
    target: TargetTokens, prompt_ids: list[int], pictures: list[dict]
) -> tuple[list[int], list[tuple[int, int]]]:
    """``prompt_ids`` of a prompt with images (one image token each, as the template renders them) expanded as the
    target's processor expands them (:class:`eagle3_data.images.TargetImages`, loaded once per target folder), and
    each image's ``(start, length)`` in them.
    Raises :class:`eagle3_data.images.ImageProblem` (``image_prompt_text_target``: the target has no image
    processor; ``image_missing``: a file gone or changed) or ValueError (the image tokens and images differ in
    number)."""
    from .images import ImageProblem, TargetImages, open_images

    where = str(getattr(target, "path", None) or getattr(target.tok, "name_or_path", "") or "")
    if where not in _TARGET_IMAGES:
        try:
            _TARGET_IMAGES[where] = TargetImages.load(where)
        except (ValueError, OSError, KeyError) as exc:
            _TARGET_IMAGES[where] = ImageProblem("image_prompt_text_target", f"target {where}: {exc}")
    images = _TARGET_IMAGES[where]
    if isinstance(images, ImageProblem):
        raise images
    pics = open_images(pictures)  # each file read once, and still the bytes its digest names
    counts = images.placeholder_counts(images.inputs(pics)["image_grid_thw"])
    return images.expand_spans(prompt_ids, counts)


def tokenize_batch(
    rows: list[dict], target: TargetTokens, max_tokens: int | None = None
) -> tuple[list[dict], list[list[int] | None], list[int]]:
    """Tokenize RESPONSES rows; the columnar core of :func:`tokenize_rows`.

    ``max_tokens``: the requests' ``generation.max_tokens`` (a billed completion count at it means the reply was
    cut, :func:`templates.normalize_finish_reason`). Returns ``(meta, ids, prompt_lens)``, one entry per input row
    in order: ``meta`` is the TOKENS row without the id columns (``ids_source``, ``reject_*`` and the normalised
    ``finish_reason`` set; ``reasoning_split`` true when the think block came back inside the content and was
    split out), ``ids[i]`` the full ``input_ids`` (``None`` for a rejected row) and ``prompt_lens[i]`` the prompt
    length (the loss mask is ``0`` before it, ``1`` from it on). Never raises for a bad row.
    """
    turns = Counter(r["sample_id"] for r in rows)
    meta: list[dict] = []
    work: list[tuple] = []  # (row index, segments, exact ids, completion text)
    texts: list[str] = []
    generic = target.fmt.generic
    for r in rows:
        sid = r["sample_id"] if turns[r["sample_id"]] == 1 else f"{r['sample_id']}@{r['turn']}"
        base = _base(r, sid)
        if r.get("status") != "ok":
            err = r.get("error") or "generation_failed"
            code = err.split(":", 1)[0].strip() or "generation_failed"
            # the stage that failed it: rule original_answers for a dataset's own answers, else generate
            meta.append(
                _reject(base, "original_answers" if r.get("backend") == ORIGINAL_BACKEND else "generate", code, err)
            )
            continue
        try:
            try:
                messages = json.loads(r["messages"])
                tools = json.loads(r["tools"]) if r.get("tools") else None
                tool_calls = json.loads(r["tool_calls"]) if r.get("tool_calls") else None
            except (json.JSONDecodeError, TypeError, KeyError) as exc:
                raise TemplateError(f"bad JSON in the response row: {exc}", "bad_response_json") from exc
            exact = r.get("output_ids")
            exact = exact if exact is not None and len(exact) > 0 else None
            finish = normalize_finish_reason(
                r.get("finish_reason"),
                r.get("completion_tokens"),
                max_tokens,
                emitted_end_of_turn=exact is not None and exact[-1] in target.end_ids,
            )
            base["finish_reason"] = finish
            if finish == "content_filter":
                raise TemplateError(
                    f"the provider filtered the reply (finish_reason {r.get('finish_reason')!r}): "
                    "its text may be cut or replaced",
                    "content_filter",
                )
            truncated = finish == "length"
            prompt = target.render(messages, tools, True)
            reasoning, content = r.get("reasoning"), r.get("content")
            split = None
            if not (reasoning or "").strip() and target.think_state(prompt)[0] != "closed":
                split = split_reasoning_from_content(target.fmt, content)
                if split is not None:
                    reasoning, content = split
            if generic:
                comp = target.generic_completion(messages, tools, prompt, reasoning, content, tool_calls, truncated)
                segs = [(comp, False)]
            else:
                segs = target.completion_segments(
                    reasoning,
                    content,
                    tool_calls,
                    prompt,
                    prior_tool_calls=count_tool_calls(messages),
                    truncated=truncated,
                )
        except TemplateError as exc:
            meta.append(_reject(base, "tokenize", exc.reason, str(exc)))
            continue
        meta.append(
            {
                **base,
                "ids_source": "reconstructed",
                "reject_stage": None,
                "reject_reason": None,
                "reject_detail": None,
                "reasoning_split": split is not None,
            }
        )
        texts.append(prompt)
        texts.extend(t for t, special in segs if not special)
        pictures = image_parts(messages)
        work.append((len(meta) - 1, segs, exact, truncated, r.get("prompt_ids") or None, pictures))

    encoded = target.encode_texts(texts)  # the one batched encode of the shard
    ids_out: list[list[int] | None] = [None] * len(meta)
    plens = [0] * len(meta)
    comps: list[list[int]] = []
    want: list[str] = []
    k = 0
    special_ids: dict[str, int] = {}  # name -> id, looked up once per shard (not once per segment)

    def sid(name: str) -> int:
        if name not in special_ids:
            special_ids[name] = target.special_id(name)
        return special_ids[name]

    mismatched: set[int] = set()
    for i, segs, exact, truncated, server_ids, pictures in work:
        prompt_ids = encoded[k]
        k += 1
        if pictures:  # each image token repeated for the image's patches, as the target's processor does
            try:
                prompt_ids, spans = expand_images(target, prompt_ids, pictures)
                meta[i]["images"] = row_images(pictures, spans)
            except (ValueError, OSError) as exc:
                mismatched.add(i)
                meta[i] = _reject(
                    _kept_fields(meta[i]),
                    "tokenize",
                    getattr(exc, "reason", "image_tokens"),
                    str(exc),
                )
        if (
            server_ids is not None and i not in mismatched
        ):  # the server rendered the prompt itself (vLLM return_token_ids)
            detail = mismatch_detail(target, prompt_ids, [int(x) for x in server_ids])
            if detail is not None:
                mismatched.add(i)
                meta[i] = _reject(
                    _kept_fields(meta[i]),
                    "tokenize",
                    "server_prompt_mismatch",
                    detail,
                )
        comp: list[int] = []
        for t, special in segs:
            if special:
                comp.append(sid(t))
            else:
                comp += encoded[k]
                k += 1
        if i in mismatched:
            continue
        if exact is not None:
            exact = [int(x) for x in exact]
            if not truncated and (not exact or exact[-1] not in target.end_ids):
                exact.append(comp[-1] if comp and comp[-1] in target.end_ids else target.eot_id)
            meta[i]["ids_source"] = "exact"
            comp = exact
        ids_out[i] = prompt_ids + comp
        plens[i] = len(prompt_ids)
        comps.append(comp)
        want.append("".join(t for t, _ in segs))

    # text -> ids -> text: one batched decode of every completion
    got = target.decode_batch(comps)
    for (i, *_), g, w in zip([w for w in work if w[0] not in mismatched], got, want):
        if g != w:
            exact = meta[i]["ids_source"] == "exact"
            j = next((n for n, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            meta[i] = _reject(
                _kept_fields(meta[i]),
                "tokenize",
                "exact_ids_text_mismatch" if exact else "round_trip",
                f"{'backend output_ids' if exact else 'completion ids'} decode to text that differs from the "
                f"response at char {j}: {g[j : j + 30]!r} vs {w[j : j + 30]!r}",
            )
            ids_out[i] = None
    return meta, ids_out, plens


def tokenize_rows(rows: list[dict], target: TargetTokens, max_tokens: int | None = None) -> list[dict]:
    """Turn RESPONSES rows (dicts) into TOKENS rows (dicts) for ``target``.

    Each output row has ``input_ids`` (list[int], target vocabulary), ``loss_mask`` (list[int] 0/1, same length,
    1 exactly on the completion including its end-of-turn token), ``num_tokens``/``num_prompt_tokens``/
    ``num_completion_tokens``, ``ids_source`` (exact | reconstructed) and ``billed_completion_tokens`` /
    ``billed_prompt_tokens`` (the backend's ``usage`` counts). A sample regenerated at several turns (generation mode ``all``) yields one row per
    turn with sample id ``<sample_id>@<turn>``. ``max_tokens``: see :func:`tokenize_batch`. Never raises for a bad
    row: it is returned with empty ids and ``reject_stage``/``reject_reason``/``reject_detail`` set.
    """
    meta, ids, plens = tokenize_batch(rows, target, max_tokens)
    out = []
    for m, x, p in zip(meta, ids, plens):
        x = x or []
        out.append(
            {
                **m,
                "input_ids": x,
                "loss_mask": [0] * p + [1] * (len(x) - p),
                "num_tokens": len(x),
                "num_prompt_tokens": p if x else 0,
                "num_completion_tokens": len(x) - p if x else 0,
            }
        )
    return out


def tokens_table(meta: list[dict], ids: list[list[int] | None], plens: list[int]) -> pa.Table:
    """Build the TOKENS ``pyarrow.Table`` from :func:`tokenize_batch` output without per-token Python loops."""
    lens = np.fromiter((len(x) if x else 0 for x in ids), dtype=np.int64, count=len(ids))
    p = np.asarray(plens, dtype=np.int64)
    p = np.where(lens > 0, p, 0)
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    flat = pa.array(np.fromiter(itertools.chain.from_iterable(x for x in ids if x), dtype=np.int32, count=total))
    # loss mask: 1 from each row's prompt end to its end
    mark = np.zeros(total + 1, dtype=np.int8)
    np.add.at(mark, offsets[:-1][lens > 0] + p[lens > 0], 1)
    np.add.at(mark, offsets[1:][lens > 0], -1)
    mask = np.cumsum(mark[:-1], dtype=np.int8)
    cols = {
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets), flat),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask, pa.int8())),
        "num_tokens": pa.array(lens),
        "num_prompt_tokens": pa.array(p),
        "num_completion_tokens": pa.array(lens - p),
    }
    arrays = []
    for f in schemas.TOKENS:
        if f.name in cols:
            arrays.append(cols[f.name].cast(f.type))
        else:
            arrays.append(pa.array([m.get(f.name) for m in meta], type=f.type))
    return pa.Table.from_arrays(arrays, schema=schemas.TOKENS)


def read_responses(path: str) -> list[dict]:
    """RESPONSES parquet rows as dicts (only the columns this stage reads). Raises ``ValueError`` naming the file
    and the missing columns when it is not a responses file."""
    pf = pq.ParquetFile(path)
    missing = [c for c in ("sample_id", "dataset", "messages", "status") if c not in pf.schema_arrow.names]
    if missing:
        raise ValueError(f"{path}: not a responses file (missing columns {missing})")
    cols = [c for c in _RESPONSE_COLUMNS if c in pf.schema_arrow.names]
    return pf.read(columns=cols).to_pylist()


def tokenize(responses_path: str, out_path: str, *, settings: "TokenizeSettings", log_path: str | None = None) -> dict:
    """Stage entry point: RESPONSES parquet -> TOKENS parquet (schema-checked, written atomically).

    ``settings`` (:class:`~eagle3_data.settings.TokenizeSettings`): ``target`` (``path``: local tokenizer dir,
    ``template``: family name, ``trust_remote_code``, ``chat_template_kwargs``); ``chat_template_kwargs`` (the
    dataset's ``generation.extra_body.chat_template_kwargs``) update the target's, as they did for the request;
    ``max_tokens`` is the dataset's ``generation.max_tokens`` (a billed count at it means cut; None: no limit). Returns counts
    ``{rows, tokenized, rejected: {reason: n}, reasoning_split_from_content, tokens, completion_tokens, seconds,
    tokens_per_s}`` (``reasoning_split_from_content``: kept rows whose think block came back inside the content).
    Raises :class:`templates.TemplateError` if the tokenizer
    can't be loaded, ``ValueError`` if ``responses_path`` is not a responses file.
    """
    t0 = time.time()
    tt = target_tokens(settings.target.params(), settings.chat_template_kwargs)
    rows = read_responses(responses_path)
    meta, ids, plens = tokenize_batch(rows, tt, settings.max_tokens)
    table = tokens_table(meta, ids, plens)
    schemas.write_checked(table, "tokens", out_path)
    rejected = Counter(m["reject_reason"] for m in meta if m["reject_reason"])
    ntok = int(pc.sum(table["num_tokens"]).as_py() or 0)
    secs = time.time() - t0
    summary = {
        "rows": len(rows),
        "tokenized": len(meta) - sum(rejected.values()),
        "rejected": dict(rejected),
        "reasoning_split_from_content": sum(1 for m in meta if m.get("reasoning_split") and not m["reject_reason"]),
        "tokens": ntok,
        "completion_tokens": int(pc.sum(table["num_completion_tokens"]).as_py() or 0),
        "seconds": round(secs, 3),
        "tokens_per_s": round(ntok / secs) if secs > 0 else None,
    }
    log.info("tokenize %s: %s", responses_path, summary)
    return summary
