"""Stage 4, validate: named structural checks on every tokenized sample, then the pandera schema.

A row is rejected with the reason code of the *first* check it fails, in this order (also the ``reason`` column of
``results/<ds>/rejected/<shard>.parquet``):

======================== ==========================================================================================
code                     meaning
======================== ==========================================================================================
(generate/tokenize code) the sample already failed an earlier stage (``stage`` says which), e.g.
                         ``prompt_render_failed``, ``template_not_prefix``, ``unexpected_reasoning``,
                         ``missing_reasoning``, ``unknown_finish_reason``, ``content_filter``,
                         ``truncated_tool_call``, ``tool_calls_unsupported``, ``exact_ids_text_mismatch``,
                         ``server_prompt_mismatch`` (the server's prompt ids, vLLM ``return_token_ids``, differ
                         from the target's render), ``round_trip`` (text -> ids -> text, reconstructed ids); see
                         the table in ``templates/core.py``
empty_sequence           no token ids
length_mismatch          ``loss_mask``/``input_ids`` lengths or the ``num_*`` counts disagree
id_out_of_vocab          an id is negative or >= the target vocabulary size (``len(tokenizer)``)
bad_loss_mask            a ``loss_mask`` value other than 0/1
no_supervised_tokens     ``loss_mask`` has no 1
mask_not_completion      generated row: the 1s are not exactly the completion (one trailing run of
                         ``num_completion_tokens`` positions)
image_span               row with images: an image's placeholder positions (``images``: start, length) are not one
                         id inside the row with loss mask 0 before the first supervised position
truncated                normalised ``finish_reason == "length"`` (a billed count at ``max_tokens`` included) and
                         ``validate.keep_truncated`` is false
missing_end_of_turn      the sequence does not end with a supervised end-of-turn token of the target
                         (kept truncated rows are exempt: the target never emitted one)
early_end_of_turn        generated row: an end-of-turn token inside the completion before its end
empty_completion         generated row: the completion has no text token (only markers / end-of-turn)
reasoning_marker_count   reasoning target: the assistant turn (generation-prompt tail + completion) has no
                         end-of-reasoning marker or no opening marker
reasoning_marker_leak    reasoning target: more than one open/close think marker in the turn, or close before open
                         (a marker inside the answer); non-reasoning target: any think marker in the completion
empty_answer             generated row: nothing but whitespace after the last end-of-reasoning marker (no content,
                         no tool call): reasoning followed by the end of the turn (kept cut rows are exempt)
role_marker_leak         a role marker (``<|im_user|>``, ``<|im_start|>``, ``<|assistant|>``...) at a supervised
                         position
round_trip               ids -> text -> ids changes the ids (pre-tokenized rows: whole sequence; rows whose
                         ``ids_source`` is in ``Context.round_trip_sources``: the completion)
count_mismatch           reconstructed completion tokens differ from the backend's billed ``completion_tokens``
                         by more than ``max(count_tolerance.per_sample_abs, per_sample_rel * billed)``
too_long                 more than ``validate.max_tokens`` tokens
======================== ==========================================================================================

The shard then fails (after both files are written) when its reject rate exceeds ``validate.max_reject_rate``
(:class:`RejectRateExceeded`) or when the sum of reconstructed completion tokens of its validated rows differs
from the sum billed by more than ``count_tolerance.aggregate_rel`` (:class:`CountAuditFailed`). ``validate()``
returns both sums so reports can give the audit per dataset.

Checks (every response ends with ``<|im_end|>``, exactly one end-of-reasoning marker,
no markers leaking into the answer, a tokenizer round trip, counts within tolerance of the billing). Reconstructed
ids are the tokenizer's own encoding of the response text and are checked text -> ids -> text at tokenize time, so
the ids -> text -> ids round trip here is only needed for ids that did not come from our encoding (pre-tokenized,
optionally exact). Every check is vectorised over the shard (numpy over the flattened id/mask arrays).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import schemas
from .backends.errors import unpaid_reason
from .validate_audit import (  # noqa: F401 (the stage's exceptions, raised by validate())
    CountAuditFailed,
    RejectRateExceeded,
    count_audits,
    raise_over_ceilings,
    warn_prompt_audit,
)
from .templates import KIMI_TOOL_TOKENS, TargetTokens, target_tokens

if TYPE_CHECKING:
    from .settings import ValidateSettings

log = logging.getLogger("eagle3_data.validate")


@dataclass
class Context:
    """What the checks need: the target's special ids and the ``validate`` config slice."""

    target: TargetTokens
    keep_truncated: bool = False
    per_sample_abs: int = 3
    per_sample_rel: float = 0.02
    aggregate_rel: float | None = None
    max_tokens: int | None = None
    round_trip_sources: tuple[str, ...] = ("pretokenized",)

    def __post_init__(self):
        t = self.target
        self.end_ids = np.array(sorted(t.end_ids), dtype=np.int64)
        self.role_ids = np.array(sorted(t.role_marker_ids), dtype=np.int64)
        bound = set(t.role_marker_ids) | set(t.end_ids)
        self.boundary_ids = np.array(sorted(bound), dtype=np.int64)
        markers = set(bound)
        markers |= {i for i in (t.think_open_id, t.think_close_id) if i is not None}
        markers |= {i for i in (t.special_id(n, required=False) for n in KIMI_TOOL_TOKENS) if i is not None}
        markers |= set(getattr(t.tok, "all_special_ids", []) or [])
        self.marker_ids = np.array(sorted(markers), dtype=np.int64)

    @classmethod
    def from_settings(cls, target: TargetTokens, settings: "ValidateSettings") -> "Context":
        """Context from the validate settings (``keep_truncated``, ``count_tolerance``, ``max_tokens``)."""
        tol = settings.count_tolerance
        agg = tol["aggregate_rel"]
        return cls(
            target,
            keep_truncated=bool(settings.keep_truncated),
            per_sample_abs=int(tol["per_sample_abs"]),
            per_sample_rel=float(tol["per_sample_rel"]),
            aggregate_rel=None if agg is None else float(agg),
            max_tokens=settings.max_tokens,
        )


class Batch:
    """The rows under check as flat numpy arrays (rows that passed the per-row structure checks).

    ``ids``/``mask``: all rows' ``input_ids``/``loss_mask`` concatenated (int64 / int8); ``starts``/``ends``: each
    row's slice; ``rows``: index of each row in the input table.
    """

    def __init__(self, table: pa.Table, rows: np.ndarray):
        t = table.take(pa.array(rows, pa.int64())) if len(rows) != table.num_rows else table
        ids = t.column("input_ids").combine_chunks()
        mask = t.column("loss_mask").combine_chunks()
        self.rows = rows
        self.n = t.num_rows
        self.ids = pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        self.mask = pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype(np.int8, copy=False)
        self.lens = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
        self.ends = np.cumsum(self.lens)
        self.starts = self.ends - self.lens
        self.pos = np.arange(len(self.ids), dtype=np.int64)

        def col(name, default=None):
            if name in t.column_names:
                return np.array(t.column(name).to_pylist(), dtype=object)
            return np.full(self.n, default, dtype=object)

        self.source = col("ids_source")
        self.images = col("images")
        self.finish = col("finish_reason")
        billed = col("billed_completion_tokens")
        self.billed = np.array([np.nan if b is None else float(b) for b in billed])
        self.num_completion = t.column("num_completion_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        self.num_prompt = t.column("num_prompt_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        self.num_tokens = t.column("num_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        self.generated = self.source != "pretokenized"
        self.supervised = np.add.reduceat(self.mask.astype(np.int64), self.starts) if self.n else np.zeros(0, np.int64)

    def per_row(self, values: np.ndarray, how=np.add) -> np.ndarray:
        """Reduce a flat per-position array to one value per row (``np.add``, ``np.maximum``, ...)."""
        if not self.n:
            return np.zeros(0, dtype=values.dtype)
        return how.reduceat(values, self.starts)

    def cum(self, flags: np.ndarray) -> np.ndarray:
        """Prefix sums with a leading 0: ``c[b] - c[a]`` counts flags in ``[a, b)``."""
        c = np.zeros(len(flags) + 1, dtype=np.int64)
        np.cumsum(flags, out=c[1:])
        return c

    def count_in(self, where: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Per row, how many of the sorted flat positions ``where`` lie in ``[lo, hi)`` (the same counts as
        ``cum(flags)[hi] - cum(flags)[lo]`` for ``where = flatnonzero(flags)``, without a pass over every
        position: for sparse flags such as think markers)."""
        return np.searchsorted(where, hi) - np.searchsorted(where, lo)

    def last_in_row(self, where: np.ndarray) -> np.ndarray:
        """Per row, the largest of the sorted flat positions ``where`` inside the row, else -1 (the same as
        ``per_row(np.where(flags, pos, -1), np.maximum)`` for ``where = flatnonzero(flags)``)."""
        if not self.n:
            return np.zeros(0, dtype=np.int64)
        k = np.searchsorted(where, self.ends) - 1
        cand = where[np.maximum(k, 0)] if len(where) else np.full(self.n, -1, dtype=np.int64)
        return np.where((k >= 0) & (cand >= self.starts), cand, -1).astype(np.int64)

    def row_ids(self, i: int) -> np.ndarray:
        return self.ids[self.starts[i] : self.ends[i]]

    def row_mask(self, i: int) -> np.ndarray:
        return self.mask[self.starts[i] : self.ends[i]]

    def completion(self, i: int) -> np.ndarray:
        s, e = self.starts[i], self.ends[i]
        return self.ids[s:e][self.mask[s:e] == 1]


# ---------------------------------------------------------------------------------------------------------------
# the checks: each returns a boolean "fails" array over the batch rows and a detail function for one row

CheckFn = Callable[[Batch, Context], tuple[np.ndarray, Callable[[int], str]]]
CHECKS: list[tuple[str, CheckFn]] = []


def check(reason: str):
    """Register a check under its reason code (order of registration = order of evaluation)."""

    def deco(fn: CheckFn) -> CheckFn:
        CHECKS.append((reason, fn))
        fn.reason = reason
        return fn

    return deco


@check("id_out_of_vocab")
def check_vocab(b: Batch, ctx: Context):
    lo, hi = b.per_row(b.ids, np.minimum), b.per_row(b.ids, np.maximum)
    v = ctx.target.vocab_size
    return (lo < 0) | (hi >= v), lambda i: f"ids span [{lo[i]}, {hi[i]}], vocabulary size {v}"


@check("bad_loss_mask")
def check_mask_values(b: Batch, ctx: Context):
    bad = b.per_row(((b.mask != 0) & (b.mask != 1)).astype(np.int64))
    return bad > 0, lambda i: f"{bad[i]} loss_mask values are not 0/1"


@check("no_supervised_tokens")
def check_supervised(b: Batch, ctx: Context):
    return b.supervised == 0, lambda i: "loss_mask is all zero"


@check("mask_not_completion")
def check_mask_is_completion(b: Batch, ctx: Context):
    # a 1 -> 0 step inside a row, or the 1s not numbering num_completion_tokens, or not at the end
    drop = np.zeros(len(b.mask), dtype=np.int64)
    if len(b.mask) > 1:
        drop[:-1] = (b.mask[:-1] == 1) & (b.mask[1:] == 0)
        drop[b.ends - 1] = 0
    drops = b.per_row(drop)
    last = b.mask[b.ends - 1] if b.n else np.zeros(0, np.int8)
    bad = b.generated & ((drops > 0) | (b.supervised != b.num_completion) | (last != 1))
    return (
        bad,
        lambda i: (
            f"{b.supervised[i]} supervised positions, {drops[i]} gaps, last mask {last[i]}; "
            f"expected the last {b.num_completion[i]} positions"
        ),
    )


@check("image_span")
def check_image_spans(b: Batch, ctx: Context):
    """Rows with images: each image's placeholder positions (``images``: start, length) lie in the row, hold one
    id, have loss mask 0 and come before the first supervised position (so a cut at ``merge.max_len`` that keeps
    a supervised token keeps every image whole)."""
    from .images import span_problem

    why = {
        i: w
        for i in np.flatnonzero(b.images != None).tolist()  # noqa: E711 (an object array of str / None)
        if (w := span_problem(b.row_ids(i), b.row_mask(i), b.images[i])) is not None
    }
    return np.array([i in why for i in range(b.n)], dtype=bool), lambda i: why.get(i, "")


@check("truncated")
def check_truncated(b: Batch, ctx: Context):
    bad = (b.finish == "length") & (not ctx.keep_truncated)
    return bad.astype(bool), lambda i: "finish_reason=length (validate.keep_truncated is false)"


@check("missing_end_of_turn")
def check_end_of_turn(b: Batch, ctx: Context):
    last_id = b.ids[b.ends - 1] if b.n else np.zeros(0, np.int64)
    last_m = b.mask[b.ends - 1] if b.n else np.zeros(0, np.int8)
    kept_cut = (b.finish == "length") & ctx.keep_truncated
    bad = (~np.isin(last_id, ctx.end_ids) | (last_m != 1)) & ~kept_cut.astype(bool)
    t = ctx.target
    names = sorted({t.eot_name, t.tool_eot_name})
    return bad, lambda i: f"last id {last_id[i]} (mask {last_m[i]}); expected a supervised {names}"


@check("early_end_of_turn")
def check_early_end(b: Batch, ctx: Context):
    n = b.per_row((np.isin(b.ids, ctx.end_ids) & (b.mask == 1)).astype(np.int64))
    kept_cut = ((b.finish == "length") & ctx.keep_truncated).astype(bool)
    allowed = np.where(kept_cut, 0, 1)
    return b.generated & (n > allowed), lambda i: f"{n[i]} end-of-turn tokens in the completion, expected {allowed[i]}"


@check("empty_completion")
def check_empty_completion(b: Batch, ctx: Context):
    text = b.per_row((~np.isin(b.ids, ctx.marker_ids) & (b.mask == 1)).astype(np.int64))
    return b.generated & (text == 0), lambda i: "the completion has no text token (only markers / end-of-turn)"


def _turn_counts(b: Batch, ctx: Context):
    """Per row: think open/close counts in the assistant turn (after the last role/end marker of the prompt),
    the last open/close positions (-1: none) and the think markers in the completion. Computed once per batch
    (both reasoning checks use it) on the sorted positions of the (sparse) markers."""
    memo = b.__dict__.setdefault("_memo", {})
    if "turn_counts" in memo:
        return memo["turn_counts"]
    t = ctx.target
    bound = np.flatnonzero(np.isin(b.ids, ctx.boundary_ids) & (b.mask == 0))
    last_bound = b.last_in_row(bound)
    turn_start = np.maximum(last_bound + 1, b.starts)
    is_open = np.flatnonzero(b.ids == (t.think_open_id if t.think_open_id is not None else -1))
    is_close = np.flatnonzero(b.ids == (t.think_close_id if t.think_close_id is not None else -1))
    opens = b.count_in(is_open, turn_start, b.ends)
    closes = b.count_in(is_close, turn_start, b.ends)
    last_open = b.last_in_row(is_open)
    last_close = b.last_in_row(is_close)
    marks = np.union1d(is_open, is_close)
    in_comp = b.count_in(marks[b.mask[marks] == 1], b.starts, b.ends)
    memo["turn_counts"] = opens, closes, last_open, last_close, in_comp
    return memo["turn_counts"]


@check("reasoning_marker_count")
def check_reasoning_count(b: Batch, ctx: Context):
    if not ctx.target.fmt.reasoning or not b.n or ctx.target.think_open_id is None:
        return np.zeros(b.n, bool), lambda i: ""  # (gpt-oss: channels, no think markers)
    opens, closes, *_ = _turn_counts(b, ctx)
    kept_cut = ((b.finish == "length") & ctx.keep_truncated).astype(bool)
    if ctx.target.fmt.think_in_prompt:  # DeepSeek-V3.1: "</think>" alone (thinking off) or no block (after tools)
        bad = b.generated & ~kept_cut & (opens != closes) & ~((opens == 0) & (closes == 1))
    else:
        bad = b.generated & ~kept_cut & ((closes == 0) | (opens == 0))
    return bad, lambda i: f"{opens[i]} open / {closes[i]} end-of-reasoning markers in the turn, expected 1 / 1"


@check("reasoning_marker_leak")
def check_reasoning_leak(b: Batch, ctx: Context):
    fmt = ctx.target.fmt
    if fmt.reasoning is None or not b.n or ctx.target.think_open_id is None:
        return np.zeros(b.n, bool), lambda i: ""
    opens, closes, last_open, last_close, in_comp = _turn_counts(b, ctx)
    if fmt.reasoning:
        bad = b.generated & ((opens > 1) | (closes > 1) | ((closes == 1) & (opens == 1) & (last_close < last_open)))
        return bad, lambda i: f"{opens[i]} open / {closes[i]} close think markers in the turn: a marker in the answer"
    bad = b.generated & (in_comp > 0)
    return bad, lambda i: f"{in_comp[i]} think markers in the completion of a non-reasoning target"


#: answers of at most this many tokens are decoded to see whether they hold more than whitespace
_SHORT_ANSWER = 8


@check("empty_answer")
def check_empty_answer(b: Batch, ctx: Context):
    """The answer (the completion after its last end-of-reasoning marker, or all of it when the prompt closed the
    think block or the target does not reason; end-of-turn ids left out) is empty or whitespace: the reasoning is
    not an answer, and training on it teaches the draft to end the turn right after thinking. Tool-call tokens
    count as an answer. Kept cut rows are exempt (the target was stopped before it could answer)."""
    if not b.n:
        return np.zeros(0, bool), lambda i: ""
    t = ctx.target
    close = t.think_close_id if t.think_close_id is not None else -1
    last_close = b.per_row(np.where((b.ids == close) & (b.mask == 1), b.pos, -1), np.maximum)
    start = np.where(last_close >= 0, last_close + 1, b.ends - b.num_completion)
    answer = (~np.isin(b.ids, ctx.end_ids) & (b.mask == 1)).astype(np.int64)
    c = b.cum(answer)
    n = c[b.ends] - c[start]
    kept_cut = ((b.finish == "length") & ctx.keep_truncated).astype(bool)
    bad = np.zeros(b.n, bool)
    rows = np.flatnonzero(b.generated & ~kept_cut & (n <= _SHORT_ANSWER))
    if len(rows):
        ends = set(int(x) for x in ctx.end_ids)
        texts = t.decode_batch([[x for x in b.ids[start[i] : b.ends[i]].tolist() if x not in ends] for i in rows])
        for i, text in zip(rows, texts):
            bad[i] = not text.strip()
    return (
        bad,
        lambda i: (
            f"no answer after the reasoning ({n[i]} answer token(s), whitespace at most): the target "
            "ended its turn right after thinking"
        ),
    )


@check("role_marker_leak")
def check_role_markers(b: Batch, ctx: Context):
    hit = np.isin(b.ids, ctx.role_ids) & (b.mask == 1)
    n = b.per_row(hit.astype(np.int64))

    def detail(i):
        got = sorted({ctx.target.tok.convert_ids_to_tokens(int(x)) for x in b.completion(i) if x in ctx.role_ids})
        return f"role markers in the completion: {got}"

    return n > 0, detail


@check("round_trip")
def check_round_trip(b: Batch, ctx: Context):
    whole = b.source == "pretokenized"
    sel = np.flatnonzero(np.isin(b.source, list(ctx.round_trip_sources)))
    bad = np.zeros(b.n, bool)
    info: dict[int, str] = {}
    if len(sel):
        seqs = [(b.ids[b.starts[i] : b.ends[i]] if whole[i] else b.completion(i)).tolist() for i in sel]
        texts = ctx.target.decode_batch(seqs)
        again = ctx.target.encode_texts(texts)
        for i, s, a in zip(sel, seqs, again):
            if list(a) != s:
                bad[i] = True
                j = next((k for k, (x, y) in enumerate(zip(s, a)) if x != y), min(len(s), len(a)))
                info[i] = f"{len(s)} ids -> text -> {len(a)} ids, first difference at {j}"
    return bad, lambda i: info.get(i, "")


@check("count_mismatch")
def check_billed_count(b: Batch, ctx: Context):
    has = ~np.isnan(b.billed) & b.generated
    tol = np.maximum(ctx.per_sample_abs, ctx.per_sample_rel * np.nan_to_num(b.billed))
    diff = np.abs(b.num_completion - np.nan_to_num(b.billed))
    return (
        has & (diff > tol),
        lambda i: (
            f"reconstructed {b.num_completion[i]} vs billed {int(b.billed[i])} completion tokens (tolerance {tol[i]:g})"
        ),
    )


@check("too_long")
def check_length_limit(b: Batch, ctx: Context):
    if ctx.max_tokens is None:
        return np.zeros(b.n, bool), lambda i: ""
    return b.num_tokens > ctx.max_tokens, lambda i: f"{b.num_tokens[i]} tokens > validate.max_tokens {ctx.max_tokens}"


REASONS = ["empty_sequence", "length_mismatch"] + [r for r, _ in CHECKS]


def check_table(table: pa.Table, ctx: Context) -> list[tuple[str, str, str] | None]:
    """Run every check on a TOKENS table; per row ``None`` (valid) or ``(stage, reason, detail)`` of the first
    failure. Rows that already failed an earlier stage keep that stage's reason."""
    n = table.num_rows
    verdict: list[tuple[str, str, str] | None] = [None] * n
    cols = table.column_names
    rs = table.column("reject_reason").to_pylist() if "reject_reason" in cols else [None] * n
    st = table.column("reject_stage").to_pylist() if "reject_stage" in cols else [None] * n
    dt = table.column("reject_detail").to_pylist() if "reject_detail" in cols else [None] * n
    nid = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    nmask = pc.list_value_length(table.column("loss_mask")).to_numpy(zero_copy_only=False)
    ntok = table.column("num_tokens").to_numpy(zero_copy_only=False)
    npr = table.column("num_prompt_tokens").to_numpy(zero_copy_only=False)
    nco = table.column("num_completion_tokens").to_numpy(zero_copy_only=False)
    keep = []
    for i in range(n):
        if rs[i]:
            verdict[i] = (st[i] or "validate", rs[i], dt[i] or "")
        elif not nid[i]:
            verdict[i] = ("validate", "empty_sequence", "no token ids")
        elif nid[i] != nmask[i] or ntok[i] != nid[i] or npr[i] + nco[i] != ntok[i]:
            verdict[i] = (
                "validate",
                "length_mismatch",
                f"{nid[i]} ids, {nmask[i]} mask values, num_tokens {ntok[i]} = prompt {npr[i]} + completion {nco[i]}?",
            )
        else:
            keep.append(i)
    if not keep:
        return verdict
    b = Batch(table, np.array(keep, dtype=np.int64))
    open_rows = np.ones(b.n, bool)
    for reason, fn in CHECKS:
        bad, detail = fn(b, ctx)
        hit = np.flatnonzero(bad & open_rows)
        for j in hit:
            verdict[int(b.rows[j])] = ("validate", reason, detail(int(j)))
        open_rows[hit] = False
    return verdict


def validate_rows(rows: list[dict], ctx: Context) -> list[tuple[str, str] | None]:
    """Check TOKENS rows given as dicts; per row ``None`` or ``(reason, detail)`` of the first failing check."""
    out = check_table(_rows_table(rows), ctx)
    return [None if v is None else (v[1], v[2]) for v in out]


def validate_row(row: dict, ctx: Context) -> tuple[str, str] | None:
    """:func:`validate_rows` for one row."""
    return validate_rows([row], ctx)[0]


def _rows_table(rows: list[dict]) -> pa.Table:
    full = []
    for r in rows:
        ids = list(r.get("input_ids") or [])
        mask = list(r.get("loss_mask") or [])
        d = {"num_tokens": len(ids), "num_completion_tokens": int(sum(1 for m in mask if m)), **r}
        d.setdefault("num_prompt_tokens", d["num_tokens"] - d["num_completion_tokens"])
        full.append(d)
    return schemas.from_rows(full, schemas.TOKENS)


def validate(
    tokens_path: str,
    validated_path: str,
    rejected_path: str,
    *,
    settings: "ValidateSettings",
    shard: str = "",
) -> dict:
    """Stage entry point: TOKENS parquet -> VALIDATED + REJECTS parquet (both schema-checked, atomic).

    ``settings``: :class:`~eagle3_data.settings.ValidateSettings`: the ``validate`` section (``max_reject_rate``,
    ``keep_truncated``, ``count_tolerance: {per_sample_abs, per_sample_rel, aggregate_rel}``, ``max_tokens``) and
    the ``target`` (tokenizer path, template family, ...). Returns ``{rows, validated, rejected: {reason: n}, reject_rate,
    billed_completion_tokens, reconstructed_completion_tokens, count_rel, billed_prompt_tokens,
    rendered_prompt_tokens, prompt_samples_billed, prompt_samples_differ, failed_unpaid, seconds}``
    (``failed_unpaid``: rejects of samples that failed at generate without a paid reply); the completion sums cover the
    validated rows that carry a billed count (the aggregate count audit; ``count_rel = |recon - billed| / billed``),
    the prompt ones the rows with a billed prompt count (the prompt audit: logged as a warning, never a reject).
    Raises, after writing both files, :class:`RejectRateExceeded` when the reject rate is above ``max_reject_rate``
    and :class:`CountAuditFailed` when ``count_rel`` is above ``count_tolerance.aggregate_rel`` (when set).
    """
    t0 = time.time()
    # lazy: the checks need the target's special ids and vocabulary size (cached facts); the tokenizer itself is
    # loaded only when a check decodes (short answers, round trips) or names a token in a reject detail
    tt = target_tokens(settings.target.params(), lazy=True)
    ctx = Context.from_settings(tt, settings)
    table = pq.read_table(tokens_path)
    for name in ("billed_prompt_tokens", "images"):  # a tokens file written before the column existed
        if name not in table.column_names:
            typ = schemas.TOKENS.field(name).type
            table = table.append_column(pa.field(name, typ), pa.nulls(table.num_rows, typ))
    verdict = check_table(table, ctx)
    good = np.array([v is None for v in verdict], dtype=bool)
    validated = table.filter(pa.array(good)).select(schemas.VALIDATED.names).cast(schemas.VALIDATED)
    bad = _reject_rows(table, verdict)
    schemas.write_checked(validated, "validated", validated_path)
    schemas.write_checked(schemas.from_rows(bad, schemas.REJECTS), "rejects", rejected_path)
    n = table.num_rows
    rate = len(bad) / n if n else 0.0
    summary = {
        "shard": shard,
        "rows": n,
        "validated": n - len(bad),
        "rejected": dict(Counter(b["reason"] for b in bad)),
        "reject_rate": round(rate, 4),
        **count_audits(validated),
        # generate failures that got no paid reply (nothing journaled): a rerun of generate sends them again
        "failed_unpaid": sum(1 for b in bad if b["stage"] == "generate" and unpaid_reason(b["reason"])),
        "seconds": round(time.time() - t0, 3),
    }
    log.info("validate %s: %s", tokens_path, summary)
    warn_prompt_audit(tokens_path, summary)
    raise_over_ceilings(tokens_path, summary, bad, float(settings.max_reject_rate), ctx.aggregate_rel)
    return summary


def _reject_rows(table: pa.Table, verdict: list) -> list[dict]:
    """The REJECTS rows of the rows of ``table`` with a verdict (``(stage, reason, detail)``)."""
    sids = table.column("sample_id").to_pylist()
    dss = table.column("dataset").to_pylist()
    return [
        {
            "sample_id": sids[i],
            "dataset": dss[i],
            "stage": v[0],
            "reason": v[1],
            "detail": (v[2] or "")[:500],
            "source_row": None,
        }
        for i, v in enumerate(verdict)
        if v is not None
    ]
