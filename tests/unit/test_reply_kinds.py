"""Every kind of reply a backend returns, per template family: what is supervised, what is rejected and why
(the table in ``templates/core.py``): finish reasons, cut prefixes, empty answers, reasoning outside its markers and
think blocks returned inside the content."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data import schemas
from eagle3_data.templates import FINISH_REASONS, TemplateError, normalize_finish_reason
from eagle3_data.settings import TokenizeSettings
from eagle3_data.tokens import tokenize, tokenize_rows
from eagle3_data.validate import Context, validate_rows
from test_templates import MULTI, row, target

KT = target("kimi-k2-thinking")
QT = target("qwen3")


def tok1(tt, max_tokens=None, **kw):
    (out,) = tokenize_rows([row(MULTI, **kw)], tt, max_tokens)
    return out


def verdict(r, tt, **ctx):
    (v,) = validate_rows([r], Context(tt, **ctx))
    return None if v is None else v[0]


def completion_text(tt, r):
    return tt.tok.decode(r["input_ids"][r["num_prompt_tokens"] :], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------------ finish reasons
def test_finish_reasons_normalise_to_a_closed_set():
    assert FINISH_REASONS == ("stop", "length", "tool_calls", "content_filter")
    cases = {
        "stop": "stop",
        "STOP": "stop",
        "end_turn": "stop",
        "eos": "stop",
        "length": "length",
        "MAX_TOKENS": "length",
        "max_tokens": "length",
        "tool_calls": "tool_calls",
        "tool_use": "tool_calls",
        "function_call": "tool_calls",
        "content_filter": "content_filter",
        "SAFETY": "content_filter",
    }
    for raw, want in cases.items():
        assert normalize_finish_reason(raw, 10, 100) == want, raw
    # a billed count at max_tokens is a cut, whatever the string says (a null one included)...
    assert normalize_finish_reason("stop", 100, 100) == "length"
    assert normalize_finish_reason(None, 120, 100) == "length"
    assert normalize_finish_reason("tool_calls", 100, 100) == "length"
    # ...unless the exact ids end in the end-of-turn token (the target stopped on its last allowed token)
    assert normalize_finish_reason("stop", 100, 100, emitted_end_of_turn=True) == "stop"
    assert normalize_finish_reason(None, 5, 100, emitted_end_of_turn=True) == "stop"
    assert normalize_finish_reason("content_filter", 100, 100) == "content_filter"
    for raw in ("abort", "error", "weird"):
        with pytest.raises(TemplateError, match=repr(raw)) as ei:
            normalize_finish_reason(raw, 5, 100)
        assert ei.value.reason == "unknown_finish_reason"
    with pytest.raises(TemplateError, match="null") as ei:
        normalize_finish_reason(None, 5, 100)
    assert ei.value.reason == "unknown_finish_reason"


def test_content_filter_reply_is_rejected_not_trained_as_a_full_turn():
    out = tok1(QT, reasoning="r", content="Sure, step one is to", finish_reason="content_filter")
    assert (out["reject_stage"], out["reject_reason"]) == ("tokenize", "content_filter")
    assert out["input_ids"] == []


@pytest.mark.parametrize("finish, billed", [("MAX_TOKENS", 7), ("max_tokens", 7), (None, 64), ("stop", 64)])
def test_cut_replies_are_cut_whatever_the_string_says(finish, billed):
    out = tok1(
        KT, max_tokens=64, reasoning="r", content="Sure, step one is to", finish_reason=finish, completion_tokens=billed
    )
    assert out["reject_reason"] is None and out["finish_reason"] == "length"
    assert completion_text(KT, out) == "<think>r</think>Sure, step one is to"  # no <|im_end|> appended
    assert verdict(out, KT) == "truncated"
    assert verdict(out, KT, keep_truncated=True, per_sample_abs=64) is None  # (billed counts made up here)


def test_unknown_finish_reason_is_rejected_by_name():
    out = tok1(KT, reasoning="r", content="c", finish_reason="abort")
    assert out["reject_reason"] == "unknown_finish_reason" and "'abort'" in out["reject_detail"]


# ------------------------------------------------------------------------------------------------ cut prefixes
@pytest.mark.parametrize(
    "tt, cut_reasoning, cut_content",
    [
        (KT, "<think>Let me count: one, two", "<think>Let me count: one, two, three.</think>The answer is"),
        (QT, "<think>\nLet me count: one, two", "<think>\nLet me count: one, two, three.\n</think>\n\nThe answer is"),
        (
            target("glm45"),
            "\n<think>Let me count: one, two",
            "\n<think>Let me count: one, two, three.</think>\nThe answer is",
        ),
        (target("kimi-k25"), "Let me count: one, two", "Let me count: one, two, three.</think>The answer is"),
    ],
)
def test_kept_cut_prefix_ends_where_the_target_stopped(tt, cut_reasoning, cut_content):
    """No end-of-reasoning marker after reasoning cut mid-sentence, no end-of-turn token, the loss mask ending
    at the last emitted token."""
    cut = tok1(tt, reasoning="Let me count: one, two", content=None, finish_reason="length")
    assert completion_text(tt, cut) == cut_reasoning
    assert tt.think_close_id not in cut["input_ids"][cut["num_prompt_tokens"] :]
    last = tt.tok.encode("Let me count: one, two", add_special_tokens=False)[-1]
    assert cut["input_ids"][-1] == last and cut["loss_mask"][-1] == 1
    assert verdict(cut, tt, keep_truncated=True) is None and verdict(cut, tt) == "truncated"
    mid = tok1(tt, reasoning="Let me count: one, two, three.", content="The answer is", finish_reason="length")
    assert completion_text(tt, mid) == cut_content
    assert mid["input_ids"][-1] not in tt.end_ids
    assert verdict(mid, tt, keep_truncated=True) is None


def test_cut_reply_with_tool_calls_is_rejected():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    out = tok1(KT, reasoning="r", content="", tool_calls=[call], finish_reason="length")
    assert out["reject_reason"] == "truncated_tool_call"


# ------------------------------------------------------------------------------------------------ empty answers
@pytest.mark.parametrize("family", ["kimi-k2-thinking", "kimi-k25", "qwen3", "glm45"])
def test_reasoning_then_end_of_turn_is_an_empty_answer(family):
    tt = target(family)
    out = tok1(tt, reasoning="Let me list the cases.", content="", finish_reason="stop")
    assert out["reject_reason"] is None
    assert verdict(out, tt) == "empty_answer"
    assert verdict(tok1(tt, reasoning="Let me list the cases.", content="  \n"), tt) == "empty_answer"
    assert verdict(tok1(tt, reasoning="Let me list the cases.", content="Two."), tt) is None
    # a tool call is an answer
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    r = tok1(
        tt,
        reasoning="I need f.",
        content="",
        tool_calls=[call],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    )
    assert verdict(r, tt) is None


# ------------------------------------------------------------------------------------------------ reasoning outside
PROSE = "Okay, the user asks for 2+2. Let me think. Two plus two is four. So the answer is 4."


@pytest.mark.parametrize(
    "family, kwargs",
    [
        ("kimi-k2-thinking", {}),
        ("kimi-k25", {}),
        ("kimi-k25", {"thinking": True}),
        ("qwen3", {}),
        ("qwen3", {"enable_thinking": True}),
        ("glm45", {}),
    ],
)
def test_reasoning_prose_in_content_on_a_thinking_target_is_rejected(family, kwargs):
    tt = target(family, **kwargs)
    out = tok1(tt, reasoning=None, content=PROSE)
    assert out["reject_reason"] == "missing_reasoning", out["reject_detail"]


@pytest.mark.parametrize(
    "family, kwargs",
    [
        ("kimi-k25", {"thinking": False}),
        ("qwen3", {"enable_thinking": False}),
        ("glm45", {"enable_thinking": False}),
        ("kimi-k2", {}),
    ],
)
def test_no_reasoning_is_right_when_thinking_is_off(family, kwargs):
    tt = target(family, **kwargs)
    out = tok1(tt, reasoning=None, content="4")
    assert out["reject_reason"] is None and verdict(out, tt) is None


# ------------------------------------------------------------------------------------------------ think in content
@pytest.mark.parametrize(
    "family, content",
    [
        ("qwen3", "<think>\nTwo plus two is four.\n</think>\n\n4"),
        ("kimi-k2-thinking", "<think>Two plus two is four.</think>4"),
        ("kimi-k25", "Two plus two is four.</think>4"),  # the prompt already holds <think>
        ("glm45", "<think>Two plus two is four.</think>\n4"),
    ],
)
def test_think_block_inside_content_is_split_and_kept(family, content):
    tt = target(family)
    split = tok1(tt, reasoning=None, content=content)
    fields = tok1(tt, reasoning="Two plus two is four.", content="4")
    assert split["reject_reason"] is None and split["reasoning_split"] is True
    assert split["input_ids"] == fields["input_ids"] and split["loss_mask"] == fields["loss_mask"]
    assert verdict(split, tt) is None


def test_a_second_think_block_in_content_still_leaks():
    out = tok1(QT, reasoning=None, content="<think>\na\n</think>\n\nb<think>c</think>d")
    assert out["reject_reason"] is None and verdict(out, QT) == "reasoning_marker_leak"


def test_stage_counts_split_rows_and_passes_max_tokens(tmp_path):
    path = F.save_fixture("qwen3", tmp_path / "tok")
    rows = [
        dict(row(MULTI, content="<think>\nr\n</think>\n\nA", completion_tokens=9), sample_id="a"),
        dict(row(MULTI, reasoning="r", content="B", completion_tokens=64), sample_id="b"),
        dict(row(MULTI, reasoning="r", content="C", completion_tokens=9), sample_id="c"),
    ]
    resp = tmp_path / "responses.parquet"
    pq.write_table(schemas.from_rows(rows, schemas.RESPONSES), resp)
    s = tokenize(
        str(resp),
        str(tmp_path / "t.parquet"),
        settings=TokenizeSettings.defaults({"path": path, "template": "qwen3"}, max_tokens=64),
    )
    assert s["reasoning_split_from_content"] == 1 and s["tokenized"] == 3
    got = {r["sample_id"]: r for r in pq.read_table(tmp_path / "t.parquet").to_pylist()}
    assert [got[k]["finish_reason"] for k in "abc"] == ["stop", "length", "stop"]
