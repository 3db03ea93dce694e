"""Stage 4, validate: named structural checks on every tokenized sample, then the pandera schema.

Each check is a function ``(row, ctx) -> (reason_code, detail) | None``; the first failing check rejects the
row. Reason codes (also the ``reason`` column of ``results/<ds>/rejected/<shard>.parquet``):

======================== ==========================================================================================
code                     meaning
======================== ==========================================================================================
(generate/tokenize code) the sample already failed an earlier stage (``reject_stage`` says which)
empty_sequence           no token ids
length_mismatch          ``loss_mask`` and ``input_ids`` lengths differ
id_out_of_vocab          an id is negative or >= the target vocabulary size
no_supervised_tokens     ``loss_mask`` has no 1
missing_end_of_turn      the sequence does not end with the target's end-of-turn token, supervised
early_end_of_turn        an end-of-turn token inside the completion before its end
truncated                ``finish_reason == "length"`` and ``validate.keep_truncated`` is false
reasoning_marker_count   reasoning target: not exactly one end-of-reasoning marker in the completion;
                         non-reasoning target: any think marker in the completion
reasoning_marker_leak    a think marker after the end of reasoning (inside the answer)
role_marker_leak         a role marker (e.g. ``<|im_user|>``) inside the completion
round_trip               decode -> encode of the completion's text runs does not give back the same ids
count_mismatch           reconstructed completion tokens differ from the backend's billed
                         ``completion_tokens`` by more than ``max(per_sample_abs, per_sample_rel * billed)``
too_long                 more than ``validate.max_tokens`` tokens
======================== ==========================================================================================

Checks follow the seed run's audit (every response ends with ``<|im_end|>``, exactly one end-of-reasoning
marker, no markers leaking into the answer, a tokenizer round trip, counts within tolerance of the billing).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from . import schemas
from .templates import TargetTokens, load_target_tokens

log = logging.getLogger("eagle3_data.validate")


class RejectRateExceeded(RuntimeError):
    """A shard rejected more than ``validate.max_reject_rate`` of its samples."""


@dataclass
class Context:
    """What the checks need to know: the target's special ids and the ``validate`` config slice."""

    target: TargetTokens
    keep_truncated: bool = False
    per_sample_abs: int = 3
    per_sample_rel: float = 0.02
    max_tokens: int | None = None


def completion_ids(row: dict) -> list[int]:
    """The supervised ids of ``row`` (all positions with ``loss_mask == 1``), in order."""
    return [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]


def check_nonempty(row, ctx):
    if not row["input_ids"]:
        return "empty_sequence", "no token ids"


def check_lengths(row, ctx):
    if len(row["input_ids"]) != len(row["loss_mask"]):
        return "length_mismatch", f"{len(row['input_ids'])} ids vs {len(row['loss_mask'])} mask values"


def check_vocab(row, ctx):
    lo, hi = min(row["input_ids"]), max(row["input_ids"])
    if lo < 0 or hi >= ctx.target.vocab_size:
        return "id_out_of_vocab", f"ids span [{lo}, {hi}], vocabulary size {ctx.target.vocab_size}"


def check_supervised(row, ctx):
    if not any(row["loss_mask"]):
        return "no_supervised_tokens", "loss_mask is all zero"


def check_end_of_turn(row, ctx):
    if row["input_ids"][-1] != ctx.target.eot_id or not row["loss_mask"][-1]:
        return "missing_end_of_turn", (
            f"last id {row['input_ids'][-1]} (mask {row['loss_mask'][-1]}), expected supervised "
            f"{ctx.target.fmt.end_of_turn} ({ctx.target.eot_id})"
        )
    comp = completion_ids(row)
    if ctx.target.eot_id in comp[:-1]:
        return "early_end_of_turn", f"end-of-turn at completion position {comp.index(ctx.target.eot_id)}"


def check_truncated(row, ctx):
    if row.get("finish_reason") == "length" and not ctx.keep_truncated:
        return "truncated", "finish_reason=length"


def check_reasoning_markers(row, ctx):
    t = ctx.target
    comp = completion_ids(row)
    opens = [i for i, x in enumerate(comp) if x == t.think_open_id]
    closes = [i for i, x in enumerate(comp) if x == t.think_close_id]
    if not t.fmt.reasoning:
        if opens or closes:
            return "reasoning_marker_count", f"{len(opens)} open / {len(closes)} close think markers, target does not reason"
        return None
    if len(closes) != 1:
        return "reasoning_marker_count", f"{len(closes)} end-of-reasoning markers, expected exactly 1"
    if any(i > closes[0] for i in opens) or len(opens) > 1:
        return "reasoning_marker_leak", "think marker inside the answer"


def check_role_markers(row, ctx):
    comp = completion_ids(row)
    leaked = [x for x in comp if x in ctx.target.role_marker_ids]
    if leaked:
        names = sorted({ctx.target.tok.convert_ids_to_tokens(x) for x in leaked})
        return "role_marker_leak", f"role markers in completion: {names}"


def check_round_trip(row, ctx):
    t = ctx.target
    comp = completion_ids(row)
    run: list[int] = []
    for x in comp + [None]:
        if x is None or x in t.special_ids:
            if run:
                text = t.tok.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                again = t.tok.encode(text, add_special_tokens=False)
                if list(again) != run:
                    return "round_trip", f"{len(run)} ids -> text -> {len(again)} ids"
            run = []
        else:
            run.append(x)


def check_billed_count(row, ctx):
    billed = row.get("billed_completion_tokens")
    if billed is None or row.get("ids_source") == "pretokenized":
        return None
    got = row["num_completion_tokens"]
    tol = max(ctx.per_sample_abs, ctx.per_sample_rel * billed)
    if abs(got - billed) > tol:
        return "count_mismatch", f"reconstructed {got} vs billed {billed} completion tokens (tolerance {tol:g})"


def check_length_limit(row, ctx):
    if ctx.max_tokens is not None and row["num_tokens"] > ctx.max_tokens:
        return "too_long", f"{row['num_tokens']} tokens > validate.max_tokens {ctx.max_tokens}"


CHECKS: list[Callable] = [
    check_nonempty,
    check_lengths,
    check_vocab,
    check_supervised,
    check_end_of_turn,
    check_truncated,
    check_reasoning_markers,
    check_role_markers,
    check_round_trip,
    check_billed_count,
    check_length_limit,
]


def validate_row(row: dict, ctx: Context) -> tuple[str, str] | None:
    """Run :data:`CHECKS` in order on one TOKENS row; return ``(reason, detail)`` of the first failure or None."""
    if row.get("reject_reason"):
        return row["reject_reason"], row.get("reject_detail") or ""
    for check in CHECKS:
        bad = check(row, ctx)
        if bad:
            return bad
    return None


def validate(
    tokens_path: str,
    validated_path: str,
    rejected_path: str,
    *,
    target: dict,
    settings: dict,
    shard: str = "",
) -> dict:
    """Stage entry point: TOKENS parquet -> VALIDATED + REJECTS parquet (both schema-checked, atomic).

    ``target``: the config ``target`` slice (tokenizer path, template family, ...). ``settings``: the config
    ``validate`` slice (``max_reject_rate``, ``keep_truncated``, ``count_tolerance``, ``max_tokens``).
    Returns ``{rows, validated, rejected: {reason: n}, reject_rate, billed, reconstructed}``; ``billed`` and
    ``reconstructed`` sum the completion tokens of validated rows that carry a billed count (the aggregate
    count audit). Raises :class:`RejectRateExceeded` after writing both files when the reject rate is above
    ``max_reject_rate``.
    """
    t0 = time.time()
    tt = load_target_tokens(
        target["path"],
        target.get("template", "generic"),
        trust_remote_code=bool(target.get("trust_remote_code", False)),
        chat_template_kwargs=target.get("chat_template_kwargs") or {},
    )
    tol = settings.get("count_tolerance") or {}
    ctx = Context(
        tt,
        keep_truncated=bool(settings.get("keep_truncated", False)),
        per_sample_abs=int(tol.get("per_sample_abs", 3)),
        per_sample_rel=float(tol.get("per_sample_rel", 0.02)),
        max_tokens=settings.get("max_tokens"),
    )
    table = pq.read_table(tokens_path)
    rows = table.to_pylist()
    good, bad = [], []
    for row in rows:
        verdict = validate_row(row, ctx)
        if verdict is None:
            good.append({k: row[k] for k in schemas.VALIDATED.names})
        else:
            reason, detail = verdict
            bad.append(
                {
                    "sample_id": row["sample_id"],
                    "dataset": row["dataset"],
                    "stage": row.get("reject_stage") or "validate",
                    "reason": reason,
                    "detail": (detail or "")[:500],
                    "source_row": None,
                }
            )
    schemas.write_checked(schemas.from_rows(good, schemas.VALIDATED), "validated", validated_path)
    schemas.write_checked(schemas.from_rows(bad, schemas.REJECTS), "rejects", rejected_path)
    reasons = Counter(b["reason"] for b in bad)
    billed = sum(r["billed_completion_tokens"] for r in good if r["billed_completion_tokens"] is not None)
    recon = sum(r["num_completion_tokens"] for r in good if r["billed_completion_tokens"] is not None)
    rate = len(bad) / len(rows) if rows else 0.0
    summary = {
        "rows": len(rows),
        "validated": len(good),
        "rejected": dict(reasons),
        "reject_rate": round(rate, 4),
        "billed_completion_tokens": billed,
        "reconstructed_completion_tokens": recon,
        "seconds": round(time.time() - t0, 3),
    }
    log.info("validate %s: %s", tokens_path, summary)
    ceiling = float(settings.get("max_reject_rate", 1.0))
    if rate > ceiling:
        examples = "; ".join(f"{b['sample_id']}: {b['reason']} ({b['detail'][:80]})" for b in bad[:5])
        raise RejectRateExceeded(
            f"{tokens_path}: {len(bad)}/{len(rows)} samples rejected ({rate:.1%}) > validate.max_reject_rate "
            f"{ceiling:.1%}; reasons {dict(reasons)}; e.g. {examples}"
        )
    return summary
