"""Tests of the tiny Kimi-style target (``eagle3_data.tiny_target``) and the bundled pre-tokenized sample."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_data.settings import TinyTargetSettings
from eagle3_data.tiny_target import (
    ALLOWED_COMPLETION_BYTES,
    CONTENT_BYTES,
    DEFAULT_SYSTEM_PROMPT,
    REASONING_BYTES,
    SPECIAL_TOKENS,
    build_tiny_target,
)

THINK, END_THINK, IM_END = 268, 269, 258

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("target") / "tiny-kimi"
    facts = build_tiny_target(out, settings=TinyTargetSettings.defaults(seed=0))
    return out, facts


@pytest.fixture(scope="module")
def tok(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built[0])


@pytest.fixture(scope="module")
def model(built):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(built[0]).eval()


def test_build_is_deterministic_and_seeded(built, tmp_path):
    out, facts = built
    again = build_tiny_target(tmp_path / "again", settings=TinyTargetSettings.defaults(seed=0))
    assert again == facts
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "again" / "tokenizer.json").read_bytes()
    assert (out / "chat_template.jinja").read_text() == (tmp_path / "again" / "chat_template.jinja").read_text()
    other = build_tiny_target(tmp_path / "other", settings=TinyTargetSettings.defaults(seed=1))
    c = load_file(tmp_path / "other" / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert other["special_token_ids"] == facts["special_token_ids"]


def test_build_replaces_existing_dir_atomically(tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    build_tiny_target(out, settings=TinyTargetSettings.defaults(seed=3, num_layers=2))
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no temp dirs left behind


def test_build_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_target(tmp_path / "x", settings=TinyTargetSettings.defaults(hidden_size=64, num_heads=5))
    with pytest.raises(ValueError, match="mean_completion_tokens must be > 2"):
        build_tiny_target(tmp_path / "x", settings=TinyTargetSettings.defaults(mean_completion_tokens=2))
    with pytest.raises(ValueError, match="mean_reasoning_tokens must be > 2"):
        build_tiny_target(tmp_path / "x", settings=TinyTargetSettings.defaults(mean_reasoning_tokens=1))
    with pytest.raises(ValueError, match="hidden_size must be at least 12"):
        build_tiny_target(
            tmp_path / "x", settings=TinyTargetSettings.defaults(hidden_size=8, num_heads=2, num_kv_heads=1)
        )
    assert not (tmp_path / "x").exists()


def test_facts_and_configs(built):
    out, facts = built
    ids = facts["special_token_ids"]
    assert list(ids) == list(SPECIAL_TOKENS)
    assert list(ids.values()) == list(range(256, 256 + len(SPECIAL_TOKENS)))
    assert facts["vocab_size"] == 272 and facts["vocab_size"] % 8 == 0
    assert facts["eos_token_id"] == ids["<|im_end|>"] and facts["pad_token_id"] == ids["[PAD]"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (272, 64, 8)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]) == (4, 2, 128)
    assert cfg["max_position_embeddings"] == 8192 and cfg["tie_word_embeddings"] is False
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["temperature"] == 1.0 and gen["top_k"] == 0 and gen["top_p"] == 1.0
    assert gen["eos_token_id"] == ids["<|im_end|>"]
    allowed = set(range(272)) - set(gen["suppress_tokens"])
    assert allowed == set(REASONING_BYTES) | set(CONTENT_BYTES) | {ids["<|im_end|>"], ids["</think>"]}
    assert not set(REASONING_BYTES) & set(CONTENT_BYTES) and set(ALLOWED_COMPLETION_BYTES) <= set(range(10, 127))
    assert (ids["<think>"], ids["</think>"]) == (THINK, END_THINK)
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["response_template"]["fields"]["reasoning_content"] == {
        "open": "<think>",
        "close": "</think>",
        "content": "text",
    }
    assert json.loads((out / "tiny_target.json").read_text()) == json.loads(json.dumps(facts))


def test_special_tokens_atomic_with_real_names(tok):
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(name) == 256 + i
        assert tok.encode(f"ab{name}cd", add_special_tokens=False) == [97, 98, 256 + i, 99, 100]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "[PAD]"
    assert tok.encode("hi", add_special_tokens=False) == tok.encode("hi") == [104, 105]  # no BOS/EOS added
    # like Kimi: tool-call section tokens are not "special" (kept by skip_special_tokens), role tokens are
    assert tok.decode([259, 97, 263, 258], skip_special_tokens=True) == "a<|tool_calls_section_begin|>"


def test_chat_template_default_system_and_generation_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    no_gen = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert no_gen == text[: -len("<|im_assistant|>assistant<|im_middle|><think>")]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False) and ids[-1] == THINK and ids[0] == 261
    # Kimi K2.5: thinking=False closes the think block in the prompt; thinking=True is the default
    off = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False, thinking=False
    )
    assert off == text + "</think>"
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False, thinking=True
        )
        == text
    )


def test_chat_template_drops_history_reasoning_up_to_the_last_plain_answer(tok):
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "r1"},
        {"role": "user", "content": "b"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r2",
            "tool_calls": [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "R"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>A<|im_end|>" in text  # reasoning dropped
    assert "<|im_assistant|>assistant<|im_middle|><think>r2</think><|tool_calls_section_begin|>" in text  # kept
    assert "r1" not in text and text.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_chat_template_tools_names_and_tool_turns(tok):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q", "name": "bob"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                {"id": "functions.f:1", "type": "function", "function": {"name": "f", "arguments": {"b": 2}}},
            ],
        },
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "R0"},
        {"role": "tool", "tool_call_id": "functions.f:1", "content": "R1"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"f","parameters":'
        '{"type":"object"}}}]<|im_end|>'
        "<|im_system|>system<|im_middle|>S<|im_end|>"
        "<|im_user|>bob<|im_middle|>q<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>ok<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a":1}<|tool_call_end|>'
        '<|tool_call_begin|>functions.f:1<|tool_call_argument_begin|>{"b": 2}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.f:0\nR0<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.f:1\nR1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert DEFAULT_SYSTEM_PROMPT not in text  # a system message is present


def test_decode_encode_round_trip_on_random_ascii(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice(ALLOWED_COMPLETION_BYTES) for _ in range(rng.randint(1, 60))]
        text = tok.decode(ids, skip_special_tokens=False)
        assert len(text) == len(ids)
        assert tok.encode(text, add_special_tokens=False) == ids
        with_end = ids + [258]
        assert tok.encode(tok.decode(with_end), add_special_tokens=False) == with_end
    # every byte id is its byte value
    assert tok.encode(" \n~A", add_special_tokens=False) == [32, 10, 126, 65]


def _check_grammar(seq: list[int]) -> tuple[int, int]:
    """Assert ``seq`` (sampled after a prompt ending in <think>) is reasoning, </think>, answer, <|im_end|>, with no
    whitespace at the ends of either part; return (reasoning, answer) lengths, end markers included."""
    assert seq.count(END_THINK) == 1 and seq[-1] == IM_END and seq.count(IM_END) == 1, seq
    k = seq.index(END_THINK)
    reasoning, answer = seq[:k], seq[k + 1 : -1]
    assert reasoning and answer
    assert set(reasoning) <= set(REASONING_BYTES) and set(answer) <= set(CONTENT_BYTES)
    for part in (reasoning, answer):
        assert part[0] not in (10, 32) and part[-1] not in (10, 32)
        assert all(not (a in (10, 32) and b in (10, 32)) for a, b in zip(part, part[1:]))
    return k + 1, len(seq) - k - 1


def test_forward_and_sampling_follow_the_thinking_format(built, tok, model):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me something."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model(**prompt, output_hidden_states=True)
    n = prompt["input_ids"].shape[1]
    assert out.logits.shape == (1, n, 272) and len(out.hidden_states) == 9
    torch.manual_seed(0)
    seqs = model.generate(**prompt, max_new_tokens=256, num_return_sequences=60)[:, n:].tolist()
    lengths = [_check_grammar(s[: s.index(IM_END) + 1] if IM_END in s else s) for s in seqs]
    mean_r = sum(r for r, _ in lengths) / len(lengths)
    mean_a = sum(a for _, a in lengths) / len(lengths)
    assert 10 <= mean_r <= 24 and 10 <= mean_a <= 24, lengths  # built with means 16 and 16
    assert len({r + a for r, a in lengths}) > 15  # varied lengths, not a fixed cut
    # thinking off: the prompt closed the think block, the target answers at once
    off = tok.apply_chat_template(
        [{"role": "user", "content": "Hi."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        thinking=False,
    )
    m = off["input_ids"].shape[1]
    for s in model.generate(**off, max_new_tokens=256, num_return_sequences=10)[:, m:].tolist():
        s = s[: s.index(IM_END) + 1]
        assert END_THINK not in s and set(s[:-1]) <= set(CONTENT_BYTES) and s[0] != 32 and s[-2] != 32


def test_mean_lengths_change_with_the_settings(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    build_tiny_target(
        tmp_path / "short",
        settings=TinyTargetSettings.defaults(mean_reasoning_tokens=40, mean_completion_tokens=6, num_layers=2),
    )
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "short").eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    torch.manual_seed(1)
    out = m.generate(**prompt, max_new_tokens=400, num_return_sequences=40)[:, prompt["input_ids"].shape[1] :]
    lengths = [_check_grammar(s[: s.index(IM_END) + 1]) for s in out.tolist() if IM_END in s]
    assert len(lengths) >= 38
    assert 25 <= sum(r for r, _ in lengths) / len(lengths) <= 60, lengths
    assert 3 <= sum(a for _, a in lengths) / len(lengths) <= 10, lengths


# ---------------------------------------------------------------- the bundled pre-tokenized (A-type) sample


def _load_sample_script():
    spec = importlib.util.spec_from_file_location("make_pretok", REPO / "resources" / "make_pretokenized_sample.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pretokenized_sample_is_current_and_as_documented(tok):
    rows = [json.loads(line) for line in (REPO / "resources/samples/pretokenized.jsonl").read_text().splitlines()]
    assert rows == _load_sample_script().make_rows(0)  # the file is what the script makes
    assert len(rows) == 30
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen_prompt = tok.encode("<|im_assistant|>assistant<|im_middle|><think>", add_special_tokens=False)
    for r in rows[:23]:
        ids, mask = r["input_ids"], r["loss_mask"]
        assert len(ids) == len(mask) and ids[-1] == im_end and max(ids) < 272
        start = mask.index(1)
        assert all(mask[start:]) and not any(mask[:start])  # 1 exactly on the completion
        assert ids[start - len(gen_prompt) : start] == gen_prompt
        assert ids[start:].count(END_THINK) == 1 and ids[start] != END_THINK  # reasoning, </think>, answer
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    messy = rows[23:]
    assert len(messy[0]["loss_mask"]) == len(messy[0]["input_ids"]) + 1
    assert len(messy[1]["loss_mask"]) == len(messy[1]["input_ids"]) - 3
    assert messy[2]["input_ids"] == [] and messy[2]["loss_mask"] == []
    assert max(messy[3]["input_ids"]) == 300
    assert sum(messy[4]["loss_mask"]) == 0 and len(messy[4]["input_ids"]) > 0
    assert messy[5]["input_ids"][-1] != im_end and messy[5]["loss_mask"][-1] == 1
    assert "id" not in messy[6] and "id" in messy[5]


# ---------------------------------------------------------------- served over HTTP by `transformers serve`


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    shutil.which("transformers", path=os.path.dirname(sys.executable)) is None, reason="transformers CLI not installed"
)
def test_transformers_serve_returns_reasoning_and_content_exactly(built, tok):
    import httpx

    out, facts = built
    port = _free_port()
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.Popen(
        [cli, "serve", str(out), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, "transformers serve exited"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "transformers serve not healthy after 120 s"
            time.sleep(0.2)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        convs = [
            ([{"role": "user", "content": "Hello there"}], None),
            (
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "and 3+3?"},
                ],
                None,
            ),
            (
                [
                    {"role": "user", "content": "Weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "functions.get_weather:0",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
                ],
                tools,
            ),
        ]
        stops = 0
        for i in range(12):
            msgs, tl = convs[i % 3]
            body = {"model": str(out), "messages": msgs, "max_tokens": 256, "temperature": 1.0}
            if tl:
                body["tools"] = tl
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            j = r.json()
            choice, usage = j["choices"][0], j["usage"]
            content, reasoning = choice["message"]["content"], choice["message"]["reasoning_content"]
            stop = choice["finish_reason"] == "stop"
            stops += stop
            # split by the tokenizer's response template: reasoning</think>content<|im_end|>, counted exactly
            completion = reasoning + "</think>" + content + "<|im_end|>" * stop
            assert len(tok.encode(completion, add_special_tokens=False)) == usage["completion_tokens"]
            assert set(reasoning.encode()) <= set(REASONING_BYTES) and set(content.encode()) <= set(CONTENT_BYTES)
            prompt_ids = tok.apply_chat_template(msgs, tools=tl, add_generation_prompt=True)["input_ids"]
            assert usage["prompt_tokens"] == len(prompt_ids)
        assert stops >= 11
        r = httpx.post(base + "/v1/chat/completions", json={"model": "other", "messages": convs[0][0]}, timeout=60)
        assert r.status_code == 400 and "pinned" in r.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
