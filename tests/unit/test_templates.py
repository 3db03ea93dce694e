"""Per template family: prompt + completion ids and loss masks equal hand-written expectations (multi-turn, tool
calling, reasoning), on locally built fixture tokenizers that mimic the real templates' quirks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data.testing.rows import row  # noqa: F401  (test_tokenize, test_validate, ... import it from here)
from eagle3_data.testing.tokenizer_fixtures import target_tokens as target
from eagle3_data.templates import TargetTokens, TemplateError, completion_format, normalize_ids
from eagle3_data.tokens import tokenize_rows

KIMI_SYS = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "call_7f3", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MULTI = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "Weather?"},
]


def run(tt, r):
    (out,) = tokenize_rows([r], tt)
    assert out["reject_reason"] is None, out["reject_detail"]
    return out


def expect(tt, out, prompt_text: str, completion_text: str):
    """input_ids == encode(prompt) + encode(completion) piecewise; mask exactly on the completion."""
    tok = tt.tok
    p = tok(prompt_text, add_special_tokens=False)["input_ids"]
    ids, mask = out["input_ids"], out["loss_mask"]
    assert ids[: len(p)] == p
    assert mask == [0] * len(p) + [1] * (len(ids) - len(p))
    comp = ids[len(p) :]
    assert tok.decode(comp, skip_special_tokens=False) == completion_text
    assert out["num_prompt_tokens"] == len(p) and out["num_completion_tokens"] == len(comp)
    return np.array(comp)


def sid(tt, name):
    return tt.tok.convert_tokens_to_ids(name)


# ------------------------------------------------------------------------------------------------ Kimi K2-Thinking
def test_kimi_thinking_default_system_history_dropped_and_completion():
    tt = target("kimi-k2-thinking")
    out = run(tt, row(MULTI, reasoning="Let me think.", content="Sunny."))
    prompt = (
        KIMI_SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello<|im_end|>"  # history reasoning dropped
        "<|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    comp = expect(tt, out, prompt, "<think>Let me think.</think>Sunny.<|im_end|>")
    # the special tokens are single ids at the hand-checked positions
    assert comp[0] == sid(tt, "<think>") and comp[-1] == sid(tt, "<|im_end|>") == tt.eot_id
    assert comp[1 + len(tt.tok.encode("Let me think.", add_special_tokens=False))] == sid(tt, "</think>")
    # anchors §6 item 5: re-rendering the finished conversation would have dropped this answer's reasoning
    full = tt.render(
        json.loads(row(MULTI)["messages"])
        + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "Let me think."}],
        None,
        False,
    )
    assert "Let me think." not in full and full.endswith("<think></think>Sunny.<|im_end|>")


def test_kimi_thinking_explicit_system_has_no_default():
    tt = target("kimi-k2-thinking")
    out = run(
        tt,
        row([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Q"}], reasoning="r", content="A"),
    )
    expect(
        tt,
        out,
        "<|im_system|>system<|im_middle|>Be terse.<|im_end|><|im_user|>user<|im_middle|>Q<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>",
        "<think>r</think>A<|im_end|>",
    )


def test_kimi_thinking_tool_calls_interleaved_reasoning_and_call_ids():
    tt = target("kimi-k2-thinking")
    msgs = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need a tool.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    rome = {"id": "call_x9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    out = run(tt, row(msgs, reasoning="Now Rome.", content="Checking.", tool_calls=[rome], tools=[WEATHER]))
    declare = "<|im_system|>tool_declare<|im_middle|>" + json.dumps([WEATHER], separators=(",", ":")) + "<|im_end|>"
    prompt = (
        declare + KIMI_SYS + "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>"
        # a tool-call turn after the last plain answer keeps its reasoning (interleaved thinking)
        "<|im_assistant|>assistant<|im_middle|><think>Need a tool.</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    # the provider's id "call_x9" is not what Kimi emitted: functions.{name}:{global index}
    comp = expect(
        tt,
        out,
        prompt,
        "<think>Now Rome.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
    )
    for name in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"):
        assert (comp == sid(tt, name)).sum() == 1
    # and it equals what the template itself renders for that turn (the final turn is a tool call: suffix turn)
    rome_ok = dict(rome, id="functions.get_weather:1")
    full = tt.render(
        msgs
        + [{"role": "assistant", "content": "Checking.", "reasoning_content": "Now Rome.", "tool_calls": [rome_ok]}],
        [WEATHER],
        False,
    )
    assert tt.tok.decode(out["input_ids"], skip_special_tokens=False) == full


# ------------------------------------------------------------------------------------------------ Kimi K2.5 / K2
def test_kimi_k25_prompt_holds_think_open():
    tt = target("kimi-k25")
    out = run(tt, row(MULTI, reasoning="Let me think.", content="Sunny."))
    prompt = (
        KIMI_SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    comp = expect(tt, out, prompt, "Let me think.</think>Sunny.<|im_end|>")
    assert sid(tt, "<think>") not in comp.tolist()  # the open marker is a prompt token, never supervised


def test_kimi_k25_thinking_off():
    tt = target("kimi-k25", thinking=False)
    out = run(tt, row(MULTI, content="Sunny."))
    prompt_tail = "<|im_assistant|>assistant<|im_middle|><think></think>"
    p = tt.render(MULTI, None)
    assert p.endswith(prompt_tail)
    expect(tt, out, p, "Sunny.<|im_end|>")
    (bad,) = tokenize_rows([row(MULTI, reasoning="thoughts", content="Sunny.")], tt)
    assert bad["reject_reason"] == "unexpected_reasoning" and bad["input_ids"] == []


def test_kimi_k2_instruct_no_think_and_rejects_reasoning():
    tt = target("kimi-k2")
    out = run(tt, row(MULTI, content="Sunny."))
    p = (
        KIMI_SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>Hello<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    expect(tt, out, p, "Sunny.<|im_end|>")
    (bad,) = tokenize_rows([row(MULTI, reasoning="x", content="y")], tt)
    assert bad["reject_reason"] == "unexpected_reasoning"


# ------------------------------------------------------------------------------------------------ Qwen3
QWEN_PROMPT = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"  # history: no think block
    "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
)


def test_qwen3_thinking_completion_layout():
    tt = target("qwen3")
    out = run(tt, row(MULTI, reasoning="\nLet me think.\n", content="\n\nSunny."))
    comp = expect(tt, out, QWEN_PROMPT, "<think>\nLet me think.\n</think>\n\nSunny.<|im_end|>")
    assert comp[0] == sid(tt, "<think>") and comp[-1] == sid(tt, "<|im_end|>")


def test_qwen3_enable_thinking_false_prompt_holds_empty_think():
    tt = target("qwen3", enable_thinking=False)
    out = run(tt, row(MULTI, content="Sunny."))
    expect(tt, out, QWEN_PROMPT + "<think>\n\n</think>\n\n", "Sunny.<|im_end|>")


def test_qwen3_reasoning_only_after_last_real_query_and_tool_call_newlines():
    tt = target("qwen3")
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need a tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
    ]
    out = run(tt, row(msgs, reasoning="Done.", content="It is sunny.", tools=[WEATHER]))
    p = tt.render(msgs, [WEATHER])
    # the tool response is not a real query: the earlier tool-call turn keeps its think block; no newline before
    # the first <tool_call> because that turn's content is empty
    assert (
        '<|im_start|>assistant\n<think>\nNeed a tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        "sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in p
    expect(tt, out, p, "<think>\nDone.\n</think>\n\nIt is sunny.<|im_end|>")
    # a completion with content and two calls: newline before the first call (content non-empty) and between
    two = [CALL, {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    out = run(tt, row(MULTI, reasoning="r", content="Checking.", tool_calls=two, tools=[WEATHER]))
    comp_text = (
        '<think>\nr\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Rome"}}\n</tool_call><|im_end|>'
    )
    expect(tt, out, tt.render(MULTI, [WEATHER]), comp_text)
    out = run(tt, row(MULTI, reasoning="r", content="", tool_calls=[CALL], tools=[WEATHER]))
    expect(
        tt,
        out,
        tt.render(MULTI, [WEATHER]),
        '<think>\nr\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    )


def test_qwen3_matches_template_render_of_final_turn():
    """anchors §6 items 4/6: the final turn rendered by the template equals prompt + our completion."""
    tt = target("qwen3")
    for reasoning, content in [("A\nB", "C"), ("\nr\n", "\n\nC"), ("x", "")]:
        out = run(tt, row(MULTI, reasoning=reasoning, content=content))
        full = tt.render(
            MULTI + [{"role": "assistant", "content": content, "reasoning_content": reasoning}], None, False
        )
        assert tt.tok.decode(out["input_ids"], skip_special_tokens=False) + "\n" == full


# ------------------------------------------------------------------------------------------------ GLM-4.5
GLM_PROMPT = "[gMASK]<sop><|user|>Hi<|assistant|>\n<think></think>\nHello<|user|>Weather?<|assistant|>"


def test_glm45_layout_no_per_turn_end_token():
    tt = target("glm45")
    out = run(tt, row(MULTI, reasoning=" Let me think. ", content="\nSunny.\n"))
    comp = expect(tt, out, GLM_PROMPT, "\n<think>Let me think.</think>\nSunny.<|user|>")
    assert comp[-1] == sid(tt, "<|user|>") and tt.eot_id == sid(tt, "<|user|>")


def test_glm45_tool_call_ends_with_observation():
    tt = target("glm45")
    out = run(tt, row(MULTI, reasoning="r", content="", tool_calls=[CALL], tools=[WEATHER]))
    p = tt.render(MULTI, [WEATHER])
    comp = expect(
        tt,
        out,
        p,
        "\n<think>r</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n</tool_call><|observation|>",
    )
    assert comp[-1] == sid(tt, "<|observation|>")
    full = tt.render(
        MULTI + [{"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [CALL]}], [WEATHER], False
    )
    assert tt.tok.decode(out["input_ids"][:-1], skip_special_tokens=False) == full


def test_glm45_enable_thinking_false():
    tt = target("glm45", enable_thinking=False)
    out = run(tt, row(MULTI, content="Sunny."))
    p = (
        "[gMASK]<sop><|user|>Hi/nothink<|assistant|>\n<think></think>\nHello<|user|>Weather?/nothink<|assistant|>"
        "\n<think></think>"
    )
    expect(tt, out, p, "\nSunny.<|user|>")


# ------------------------------------------------------------------------------------------------ generic
def test_generic_equals_family_where_template_keeps_final_reasoning():
    for family in ("qwen3",):
        fam, gen = target(family), TargetTokens(F.FIXTURES[family](), completion_format("generic"))
        r = row(MULTI, reasoning="Let me think.", content="Sunny.")
        assert run(gen, r)["input_ids"] == run(fam, r)["input_ids"]


def test_generic_rejects_dropped_reasoning_missing_end_and_non_prefix():
    kimi = TargetTokens(F.kimi_k2_thinking(), completion_format("generic"))
    (out,) = tokenize_rows([row(MULTI, reasoning="Let me think.", content="Sunny.")], kimi)
    assert out["reject_reason"] == "reasoning_dropped_by_template"
    glm = TargetTokens(F.glm45(), completion_format("generic"))  # eos <|endoftext|> never rendered
    (out,) = tokenize_rows([row(MULTI, content="Sunny.")], glm)
    assert out["reject_reason"] == "template_no_end_of_turn"
    tok = F.build_fixture_tokenizer(
        F.QWEN3_SPECIALS,
        (),
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}",
        eos="<|im_end|>",
    )
    (out,) = tokenize_rows([row(MULTI, content="Sunny.")], TargetTokens(tok, completion_format("generic")))
    assert out["reject_reason"] == "template_not_prefix"
    assert "not a prefix" in out["reject_detail"]


# ------------------------------------------------------------------------------------------------ misc
def test_bad_role_order_template_error_rejects_row_not_stage():
    """anchors §6 item 14: a template's raise_exception rejects that row only."""
    tok = F.build_fixture_tokenizer(
        F.QWEN3_SPECIALS,
        F.QWEN3_NON_SPECIAL,
        "{% if messages[0].role == 'assistant' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
        + F.QWEN3_TEMPLATE,
        eos="<|im_end|>",
    )
    tt = TargetTokens(tok, completion_format("qwen3"))
    good = row(MULTI, reasoning="r", content="c")
    bad = dict(
        row([{"role": "assistant", "content": "Sure"}, {"role": "user", "content": "Hello"}], content="c"),
        sample_id="s2",
    )
    out = tokenize_rows([bad, good], tt)
    assert out[0]["reject_reason"] == "prompt_render_failed" and "must start with user" in out[0]["reject_detail"]
    assert out[1]["reject_reason"] is None and out[1]["num_completion_tokens"] > 0


def test_missing_special_token_raises():
    with pytest.raises(TemplateError, match="<\\|im_end\\|>"):
        TargetTokens(F.glm45(), completion_format("qwen3"))
    with pytest.raises(TemplateError, match="unknown target.template"):
        completion_format("llama9")


def test_normalize_ids_every_return_type():
    import torch
    from transformers import BatchEncoding

    want = [5, 6, 7]
    cases = [
        want,
        [want],
        (5, 6, 7),
        np.array(want),
        np.array([want]),
        torch.tensor(want),
        torch.tensor([want]),
        {"input_ids": want, "attention_mask": [1, 1, 1]},
        BatchEncoding({"input_ids": [want]}),
        BatchEncoding({"input_ids": torch.tensor([want])}),
        [np.int64(5), np.int64(6), np.int64(7)],
    ]
    for c in cases:
        assert normalize_ids(c) == want, type(c)
    with pytest.raises(TemplateError, match="batch of 2"):
        normalize_ids([[1], [2]])
    with pytest.raises(TemplateError, match="no input_ids"):
        normalize_ids({"attention_mask": [1]})
    # what transformers 5 really returns from apply_chat_template(tokenize=True) normalises to the text's ids
    tt = target("qwen3")
    raw = tt.tok.apply_chat_template(MULTI, add_generation_prompt=True, tokenize=True)
    assert normalize_ids(raw) == tt.prompt_ids(MULTI, None) == tt.encode_texts([tt.render(MULTI, None)])[0]
    assert len(normalize_ids(raw)) > 10  # not the 2 keys of a BatchEncoding (anchors §6 item 9)


# ------------------------------------------------------------------------------------------------ DeepSeek-R1
R1_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.role == 'assistant' %}"
    "<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def test_deepseek_r1_prompt_opens_think_with_newline():
    tok = F.build_fixture_tokenizer(
        ("<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        (),
        R1_TEMPLATE,
        eos="<｜end▁of▁sentence｜>",
    )
    tt = TargetTokens(tok, completion_format("deepseek-r1"))
    msgs = [{"role": "user", "content": "2+2?"}]
    out = run(tt, row(msgs, reasoning="\nAdd them.\n", content="4"))
    # the "\n" after <think> is a prompt token: the completion starts with the reasoning text itself, and the
    # separators are R1's own ("\n</think>\n\n"), whatever whitespace the server's parser left
    expect(tt, out, "<｜User｜>2+2?<｜Assistant｜><think>\n", "Add them.\n</think>\n\n4<｜end▁of▁sentence｜>")
    assert tt.think_state(tt.render(msgs, None)) == ("open", "\n")
