"""Each named validation check: a row that fails it (with its reason code) and rows that pass; the stage entry
point, the reject-rate ceiling and the aggregate billed-count audit (a provider that trims whitespace)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data import schemas
from eagle3_data.settings import ValidateSettings
from eagle3_data.tokens import tokenize_rows
from eagle3_data.validate import CHECKS, REASONS, Context, CountAuditFailed, RejectRateExceeded, validate, validate_rows
from test_templates import MULTI, row, target

KT = target("kimi-k2-thinking")


def tok_row(tt=KT, **kw) -> dict:
    kw.setdefault("reasoning", "Let me think.")
    kw.setdefault("content", "Sunny today.")
    (r,) = tokenize_rows([row(MULTI, **kw)], tt)
    assert r["reject_reason"] is None, r["reject_detail"]
    return r


def fix(r: dict) -> dict:
    """Recompute the count fields after editing ids/mask."""
    r = dict(r)
    r["num_tokens"] = len(r["input_ids"])
    r["num_completion_tokens"] = sum(1 for m in r["loss_mask"] if m)
    r["num_prompt_tokens"] = r["num_tokens"] - r["num_completion_tokens"]
    return r


def reason(r, tt=KT, **ctx):
    (v,) = validate_rows([r], Context(tt, **ctx))
    return None if v is None else v[0]


def test_every_registered_check_is_listed():
    assert [r for r, _ in CHECKS] == REASONS[2:]
    assert len(set(REASONS)) == len(REASONS)


def test_good_rows_pass_for_every_family():
    for fam, kw in [
        ("kimi-k2-thinking", {}),
        ("kimi-k25", {}),
        ("qwen3", {}),
        ("glm45", {}),
        ("kimi-k2", {"reasoning": None}),
        ("qwen3", {"enable_thinking": False, "reasoning": None}),
        ("kimi-k25", {"thinking": False, "reasoning": None}),
    ]:
        tkw = {k: v for k, v in kw.items() if k in ("enable_thinking", "thinking")}
        tt = target(fam, **tkw)
        r = tok_row(tt, **{k: v for k, v in kw.items() if k == "reasoning"}, completion_tokens=None)
        assert reason(r, tt) is None, fam
        # and a tool-call turn
        call = {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        r = tok_row(
            tt,
            **{k: v for k, v in kw.items() if k == "reasoning"},
            tool_calls=[call],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
        assert reason(r, tt) is None, fam


def test_earlier_stage_reject_is_carried():
    (r,) = tokenize_rows([dict(row(MULTI, content="x"), status="failed", error="http_500: boom")], KT)
    (v,) = validate_rows([r], Context(KT))
    assert v == ("http_500", "http_500: boom")


def test_empty_sequence_and_length_mismatch():
    good = tok_row()
    assert (
        reason(dict(good, input_ids=[], loss_mask=[], num_tokens=0, num_prompt_tokens=0, num_completion_tokens=0))
        == "empty_sequence"
    )
    assert reason(dict(good, loss_mask=good["loss_mask"][:-1])) == "length_mismatch"
    assert reason(dict(good, num_completion_tokens=good["num_completion_tokens"] + 1)) == "length_mismatch"
    assert reason(good) is None


def test_id_out_of_vocab():
    good = tok_row()
    for bad_id in (KT.vocab_size, -1):
        ids = list(good["input_ids"])
        ids[3] = bad_id
        assert reason(dict(good, input_ids=ids)) == "id_out_of_vocab"
    ids = list(good["input_ids"])
    ids[3] = KT.vocab_size - 1
    assert reason(dict(good, input_ids=ids)) is None


def test_bad_loss_mask_and_no_supervised_tokens():
    good = tok_row()
    m = list(good["loss_mask"])
    m[-1] = 2
    assert reason(dict(good, loss_mask=m)) == "bad_loss_mask"
    assert reason(fix(dict(good, loss_mask=[0] * len(good["loss_mask"])))) == "no_supervised_tokens"


def test_mask_not_completion():
    good = tok_row()
    m = list(good["loss_mask"])
    m[-3] = 0  # a hole in the completion
    assert reason(fix(dict(good, loss_mask=m))) == "mask_not_completion"
    m = list(good["loss_mask"])
    m[2] = 1  # a supervised prompt token
    assert reason(fix(dict(good, loss_mask=m))) == "mask_not_completion"
    # pre-tokenized multi-turn masks may have several supervised spans, counted as normalize counts them
    assert reason(fix(dict(good, loss_mask=m, ids_source="pretokenized"))) is None
    from eagle3_data.normalize import _tokens_row

    pre = dict(good, **_tokens_row(good["sample_id"], good["dataset"], good["input_ids"], m))
    assert pre["num_prompt_tokens"] + pre["num_completion_tokens"] == pre["num_tokens"]
    assert reason(pre) is None


def test_truncated_rejected_or_kept_by_config():
    r = tok_row(content=None, finish_reason="length")
    assert reason(r) == "truncated"
    assert reason(r, keep_truncated=True) is None  # no end-of-turn needed: the target never emitted one
    # a kept truncated row still may not contain an end-of-turn
    assert reason(tok_row(content="a<|im_end|>b", finish_reason="length"), keep_truncated=True) == "early_end_of_turn"


def test_missing_and_early_end_of_turn():
    good = tok_row()
    assert (
        reason(fix(dict(good, input_ids=good["input_ids"][:-1], loss_mask=good["loss_mask"][:-1])))
        == "missing_end_of_turn"
    )
    unsup = dict(good, loss_mask=good["loss_mask"][:-1] + [0])
    assert reason(unsup) == "mask_not_completion"  # 1s no longer number num_completion_tokens
    assert reason(fix(unsup)) == "mask_not_completion"  # the last position is not supervised
    assert reason(fix(dict(unsup, ids_source="pretokenized"))) == "missing_end_of_turn"
    # a provider text holding the end-of-turn marker: tokenized as the marker -> early end of turn
    assert reason(tok_row(content="Sure.<|im_end|>More")) == "early_end_of_turn"


def test_empty_completion():
    k2 = target("kimi-k2")
    assert reason(tok_row(k2, reasoning=None, content=""), k2) == "empty_completion"
    (r,) = tokenize_rows([row(MULTI, reasoning="", content="")], KT)  # a thinking target with no reasoning
    assert r["reject_reason"] == "missing_reasoning"
    assert reason(tok_row(k2, reasoning=None, content="ok"), k2) is None


def test_reasoning_marker_count():
    k2 = target("kimi-k2")
    r = tok_row(k2, reasoning=None, content="no think block")
    assert reason(r, KT) == "reasoning_marker_count"  # same vocabulary, but a reasoning target needs </think>
    assert reason(r, k2) is None


def test_reasoning_marker_leak():
    assert reason(tok_row(content="Answer </think> more")) == "reasoning_marker_leak"
    assert reason(tok_row(content="Answer <think>again")) == "reasoning_marker_leak"
    k2 = target("kimi-k2")
    assert reason(tok_row(k2, reasoning=None, content="x <think> y"), k2) == "reasoning_marker_leak"
    # K2.5: the <think> in the prompt + </think> in the completion is one block
    k25 = target("kimi-k25")
    assert reason(tok_row(k25), k25) is None
    assert reason(tok_row(k25, content="a</think>b"), k25) == "reasoning_marker_leak"
    # Qwen3 enable_thinking=False: the empty block is in the prompt; a marker in the answer leaks
    q = target("qwen3", enable_thinking=False)
    assert reason(tok_row(q, reasoning=None, content="ok"), q) is None
    assert reason(tok_row(q, reasoning=None, content="ok</think>"), q) == "reasoning_marker_leak"


def test_role_marker_leak():
    assert reason(tok_row(content="Hi <|im_user|>user")) == "role_marker_leak"
    q = target("qwen3")
    assert reason(tok_row(q, content="<|im_start|>user"), q) == "role_marker_leak"
    g = target("glm45")
    assert reason(tok_row(g, content="x<|assistant|>"), g) == "role_marker_leak"
    assert reason(tok_row(g, content="x<|user|>y"), g) == "early_end_of_turn"


def test_round_trip_for_ids_we_did_not_encode():
    good = tok_row(content="Hello today.")
    pre = dict(good, ids_source="pretokenized")
    assert reason(pre) is None
    # "Hello" split into single bytes is not the tokenizer's encoding of its own decode
    p = good["num_prompt_tokens"]
    comp = good["input_ids"][p:]
    s = comp.index(KT.think_close_id) + 1
    split = (
        comp[:s]
        + KT.tok.convert_tokens_to_ids(list("Hello"))
        + KT.tok.encode(" today.", add_special_tokens=False)
        + [KT.eot_id]
    )
    assert KT.tok.decode(split[s:], skip_special_tokens=False) == "Hello today.<|im_end|>"
    bad = fix(dict(pre, input_ids=good["input_ids"][:p] + split, loss_mask=[0] * p + [1] * len(split)))
    assert bad["input_ids"] != good["input_ids"]
    assert reason(bad) == "round_trip"
    exact = dict(bad, ids_source="exact")
    assert reason(exact) is None  # the sampled ids of the target are kept by default...
    assert reason(exact, round_trip_sources=("exact", "pretokenized")) == "round_trip"  # ...unless configured


def test_count_mismatch_per_sample():
    good = tok_row()
    n = good["num_completion_tokens"]
    assert reason(dict(good, billed_completion_tokens=n)) is None
    assert reason(dict(good, billed_completion_tokens=n + 3)) is None  # within per_sample_abs 3
    assert reason(dict(good, billed_completion_tokens=n + 4)) == "count_mismatch"
    assert reason(dict(good, billed_completion_tokens=n + 4), per_sample_abs=4) is None
    assert reason(dict(good, billed_completion_tokens=n + 4, ids_source="pretokenized")) is None


def test_too_long():
    good = tok_row()
    assert reason(good, max_tokens=good["num_tokens"]) is None
    assert reason(good, max_tokens=good["num_tokens"] - 1) == "too_long"


def trimmed_rows(n: int, trim: bool):
    """Responses whose model output began with blank lines that the provider stripped from the returned text."""
    body = ("The weather in Paris is sunny and the temperature is mild. " * 8).strip()
    full = [
        dict(row(MULTI, reasoning="Let me check the forecast.", content="\n\n" + body), sample_id=f"s{i}")
        for i in range(n)
    ]
    billed = [r["num_completion_tokens"] for r in tokenize_rows(full, KT)]  # what the backend counted
    sent = [
        dict(r, content=r["content"].lstrip("\n") if trim else r["content"], completion_tokens=b)
        for r, b in zip(full, billed)
    ]
    return tokenize_rows(sent, KT)


def test_trimmed_whitespace_is_caught_by_the_count_audit(tmp_path):
    rows = trimmed_rows(20, trim=True)
    assert all(r["billed_completion_tokens"] - r["num_completion_tokens"] == 2 for r in rows)  # "\n", "\n"
    assert {reason(r, per_sample_abs=0, per_sample_rel=0.0) for r in rows} == {
        "count_mismatch"
    }  # exact-billing per sample
    assert {reason(r) for r in rows} == {None}  # the default per-sample tolerance lets each row through...
    path = F.save_fixture("kimi-k2-thinking", tmp_path / "tok")
    tokens = tmp_path / "tokens.parquet"
    pq.write_table(schemas.from_rows(rows, schemas.TOKENS), tokens)
    tgt = {"path": path, "template": "kimi-k2-thinking"}
    settings = {
        "max_reject_rate": 0.5,
        "count_tolerance": {"per_sample_abs": 3, "per_sample_rel": 0.02, "aggregate_rel": 0.0004},
    }
    with pytest.raises(CountAuditFailed, match="aggregate_rel"):  # ...but the shard's aggregate does not
        validate(
            str(tokens),
            str(tmp_path / "v.parquet"),
            str(tmp_path / "r.parquet"),
            settings=ValidateSettings.defaults(tgt, **settings),
        )
    ok = tmp_path / "ok.parquet"
    good = trimmed_rows(20, trim=False)
    for i, r in enumerate(good):  # the prompt audit: billed prompt counts, 5 of them off by one (reported only)
        r["billed_prompt_tokens"] = r["num_prompt_tokens"] + (1 if i % 4 == 0 else 0)
    good[1]["billed_prompt_tokens"] = None
    pq.write_table(schemas.from_rows(good, schemas.TOKENS), ok)
    s = validate(
        str(ok),
        str(tmp_path / "v.parquet"),
        str(tmp_path / "r.parquet"),
        settings=ValidateSettings.defaults(tgt, **settings),
    )
    assert s["validated"] == 20 and s["count_rel"] == 0.0
    assert s["billed_completion_tokens"] == s["reconstructed_completion_tokens"] > 20 * 100
    rendered = sum(r["num_prompt_tokens"] for i, r in enumerate(good) if i != 1)
    assert (s["prompt_samples_billed"], s["prompt_samples_differ"]) == (19, 5)
    assert (s["rendered_prompt_tokens"], s["billed_prompt_tokens"]) == (rendered, rendered + 5)
    assert pq.read_table(tmp_path / "v.parquet").column("billed_prompt_tokens").null_count == 1
    # a tokens file from before the billed_prompt_tokens column still validates (the column comes out null)
    old = tmp_path / "old.parquet"
    pq.write_table(schemas.from_rows(good, schemas.TOKENS).drop_columns(["billed_prompt_tokens"]), old)
    s = validate(
        str(old),
        str(tmp_path / "v2.parquet"),
        str(tmp_path / "r2.parquet"),
        settings=ValidateSettings.defaults(tgt, **settings),
    )
    assert s["validated"] == 20 and s["prompt_samples_billed"] == 0


def test_stage_writes_validated_and_rejects_and_enforces_ceiling(tmp_path):
    path = F.save_fixture("kimi-k2-thinking", tmp_path / "tok")
    rows = [dict(tok_row(), sample_id=f"g{i}", billed_completion_tokens=None) for i in range(6)]
    rows.append(dict(tok_row(content="Answer </think> more"), sample_id="leak"))
    rows.append(dict(tok_row(content=None, finish_reason="length"), sample_id="cut"))
    tokens = tmp_path / "tokens.parquet"
    pq.write_table(schemas.from_rows(rows, schemas.TOKENS), tokens)
    tgt = {"path": path, "template": "kimi-k2-thinking"}
    v, rj = tmp_path / "v.parquet", tmp_path / "r.parquet"
    s = validate(
        str(tokens), str(v), str(rj), settings=ValidateSettings.defaults(tgt, max_reject_rate=0.3), shard="000"
    )
    assert s["rows"] == 8 and s["validated"] == 6
    assert s["rejected"] == {"reasoning_marker_leak": 1, "truncated": 1}
    got = pq.read_table(v)
    assert got.schema.equals(schemas.VALIDATED) and got.column("sample_id").to_pylist() == [f"g{i}" for i in range(6)]
    assert got.column("input_ids").to_pylist() == [r["input_ids"] for r in rows[:6]]
    rej = pq.read_table(rj).to_pylist()
    assert {(r["sample_id"], r["stage"], r["reason"]) for r in rej} == {
        ("leak", "validate", "reasoning_marker_leak"),
        ("cut", "validate", "truncated"),
    }
    with pytest.raises(RejectRateExceeded, match="2/8"):
        validate(str(tokens), str(v), str(rj), settings=ValidateSettings.defaults(tgt, max_reject_rate=0.2))
    assert pq.read_table(rj).num_rows == 2  # both files are written before the shard fails


def test_turn_counts_match_the_dense_prefix_sums():
    """The reasoning checks' sparse per-row counts equal the prefix-sum formulas over every position."""
    import numpy as np
    import pyarrow as pa

    from eagle3_data.validate import Batch, _turn_counts

    tt = target("qwen3")
    ctx = Context(tt)
    rng = np.random.default_rng(0)
    pool = np.array([tt.think_open_id, tt.think_close_id, *sorted(ctx.boundary_ids), 5, 6, 7, 8], dtype=np.int64)
    ids, masks = [], []
    for _ in range(300):
        n = int(rng.integers(1, 40))
        ids.append(rng.choice(pool, n).tolist())
        p = int(rng.integers(0, n + 1))
        masks.append([0] * p + [1] * (n - p) if rng.random() < 0.8 else rng.integers(0, 2, n).tolist())
    table = pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
            "num_completion_tokens": [sum(m) for m in masks],
            "num_prompt_tokens": [0] * len(ids),
            "num_tokens": [len(x) for x in ids],
        }
    )
    b = Batch(table, np.arange(len(ids)))
    got = _turn_counts(b, ctx)
    bound = np.isin(b.ids, ctx.boundary_ids) & (b.mask == 0)
    turn_start = np.maximum(b.per_row(np.where(bound, b.pos, -1), np.maximum) + 1, b.starts)
    is_open, is_close = b.ids == tt.think_open_id, b.ids == tt.think_close_id
    co, cc = b.cum(is_open), b.cum(is_close)
    want = (
        co[b.ends] - co[turn_start],
        cc[b.ends] - cc[turn_start],
        b.per_row(np.where(is_open, b.pos, -1), np.maximum),
        b.per_row(np.where(is_close, b.pos, -1), np.maximum),
        b.per_row(((is_open | is_close) & (b.mask == 1)).astype(np.int64)),
    )
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()
    assert _turn_counts(b, ctx) is got  # once per batch
    assert sum(want[0]) > 50 and sum(want[4]) > 50  # the random rows do exercise the markers


def test_reject_ceiling_counts_the_samples_that_failed_without_a_paid_reply(tmp_path):
    """Samples recorded as failed at generate without a paid reply (a 500, a timeout; not a 422) are counted in the
    summary and named in the ceiling's message with what sends them again."""
    path = F.save_fixture("kimi-k2-thinking", tmp_path / "tok")
    good = [dict(tok_row(), sample_id=f"g{i}", billed_completion_tokens=None) for i in range(5)]
    failed = tokenize_rows(
        [
            dict(row(MULTI, content="x"), sample_id=f"f{i}", status="failed", error=err)
            for i, err in enumerate(["http_500: boom", "timeout: ReadTimeout", "http_422: bad"])
        ],
        KT,
    )
    tokens = tmp_path / "tokens.parquet"
    pq.write_table(schemas.from_rows(good + failed, schemas.TOKENS), tokens)
    tgt = {"path": path, "template": "kimi-k2-thinking"}
    v, rj = tmp_path / "v.parquet", tmp_path / "r.parquet"
    with pytest.raises(RejectRateExceeded) as ei:
        validate(str(tokens), str(v), str(rj), settings=ValidateSettings.defaults(tgt, max_reject_rate=0.25))
    msg = str(ei.value)
    assert "3/8 samples rejected" in msg and msg.endswith(
        "; 2 failed, not paid: rerun to retry them (`snakemake --forcerun generate` sends only those samples: they "
        "were recorded as failed with generation.unpaid_failures: keep)"
    )
    s = validate(str(tokens), str(v), str(rj), settings=ValidateSettings.defaults(tgt, max_reject_rate=0.5))
    assert s["failed_unpaid"] == 2 and s["rejected"] == {"http_500": 1, "timeout": 1, "http_422": 1}
