"""What the generate stage sends as history: Kimi tool-call ids, reasoning sent back in the backend's field
(mode ``all``) against a fake server enforcing Moonshot's thinking-mode rule, and the "every request failed" stop
rule counting requests."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle3_data.backends.chat import history_reasoning
from eagle3_data.generate import GenerationStopped
from eagle3_data.tokens import tokenize_rows
from test_generate import backends_cfg, gen_cfg, run, write_prompts
from eagle3_data.testing.tokenizer_fixtures import target_tokens as target

CALL0 = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL0]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Probably sunny."},
]
KIMI = {"template": "kimi-k2-thinking", "chat_template_kwargs": {}}


def sent(fs) -> list[list[dict]]:
    return [b["messages"] for b in fs.app.bodies]


def test_history_reasoning_goes_in_the_backend_field():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
        {"role": "assistant", "content": "", "tool_calls": [CALL0]},
    ]
    assert history_reasoning("openrouter", msgs, False)[1] == {"role": "assistant", "content": "a", "reasoning": "r"}
    assert history_reasoning("sglang", msgs, False) is msgs  # already in reasoning_content, nothing to add
    # thinking: a tool-call turn without reasoning gets an empty one (renders as the template's <think></think>)
    assert history_reasoning("sglang", msgs, True)[2]["reasoning_content"] == ""
    assert history_reasoning("openrouter", msgs, True)[2]["reasoning"] == ""
    assert "reasoning_content" not in history_reasoning("openrouter", msgs, True)[1]
    assert msgs[2] == {"role": "assistant", "content": "", "tool_calls": [CALL0]}  # the input is untouched


def test_mode_all_on_a_thinking_target_satisfies_moonshots_rule(tmp_path, fs):
    """Moonshot-style providers answer 400 to a thinking request whose assistant tool-call message has no
    reasoning_content: the dataset's tool-call turn gets an empty one, regenerated turns send their reasoning back
    (reasoning_content for SGLang/Moonshot, reasoning for OpenRouter), Kimi ids name the function."""
    fs.app.config.update(
        {"require_tool_reasoning": True, "reasoning_tokens": 3, "reasoning_field": "reasoning_content"}
    )
    prompts = write_prompts(tmp_path / "p.parquet", [TOOL_CONV])
    s = run(tmp_path, fs, prompts, gen=gen_cfg(mode="all"), bk=backends_cfg(fs, type="sglang"), target_format=KIMI)
    rows = sorted(pq.read_table(tmp_path / "out.parquet").to_pylist(), key=lambda r: r["turn"])
    assert s["ok"] == 1 and s["failed"] == {} and [r["turn"] for r in rows] == [1, 3, 5]
    assert fs.app.outcomes.get("400", 0) == 0
    bodies = sent(fs)
    turn3, turn5 = bodies[1], bodies[2]
    assert turn3[1]["tool_calls"][0]["id"] == "functions.get_weather:0" and turn3[1]["reasoning_content"] == ""
    assert turn3[2]["tool_call_id"] == "functions.get_weather:0"
    # the regenerated turn 3 goes back with its reasoning
    assert turn5[3] == {"role": "assistant", "content": rows[1]["content"], "reasoning_content": rows[1]["reasoning"]}
    assert rows[1]["reasoning"] and rows[1]["content"] != "It is sunny."
    # what is stored (and keyed, and tokenized) is the prompt form: reasoning under reasoning_content, Kimi ids
    stored = json.loads(rows[2]["messages"])
    assert (
        stored[3]["reasoning_content"] == rows[1]["reasoning"]
        and stored[1]["tool_calls"][0]["id"] == "functions.get_weather:0"
    )
    # OpenRouter gets the same history with the reasoning under "reasoning"
    fs.app.config.update({"require_tool_reasoning": False})
    fs.app.reset()
    run(tmp_path, fs, prompts, gen=gen_cfg(mode="all", max_tokens=29), target_format=KIMI, out="or.parquet")
    assert (
        sent(fs)[2][3]
        == {"role": "assistant", "content": sent(fs)[2][3]["content"], "reasoning": sent(fs)[2][3]["reasoning"]}
        and sent(fs)[1][1]["reasoning"] == ""
    )


def test_without_the_empty_reasoning_the_rule_fails_the_turn_but_keeps_paid_ones(tmp_path, fs):
    """The fake server enforces the rule (a request without the placeholder is refused), and the turn answered
    before the refused one still reaches the output: the stop rule counts requests, not samples."""
    fs.app.config.update({"require_tool_reasoning": True})
    prompts = write_prompts(tmp_path / "p.parquet", [TOOL_CONV])
    s = run(tmp_path, fs, prompts, gen=gen_cfg(mode="all"), bk=backends_cfg(fs, type="sglang"))
    rows = sorted(pq.read_table(tmp_path / "out.parquet").to_pylist(), key=lambda r: r["turn"])
    assert fs.app.outcomes["400"] == 1 and s["failed"] == {"http_400": 1}
    assert [(r["turn"], r["status"]) for r in rows] == [(1, "ok"), (3, "failed")]
    assert "reasoning_content is missing" in rows[1]["error"]


def test_stop_rule_counts_requests(tmp_path, fs):
    """A one-sample shard whose 4th request fails after 3 answered is not "every request failed": the 3 paid
    responses reach the output with the failed row."""
    conv = []
    for i in range(4):
        conv += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    fs.app.config.update({"fail_after": 3, "fail_status": 500})
    prompts = write_prompts(tmp_path / "p.parquet", [conv])
    s = run(tmp_path, fs, prompts, gen=gen_cfg(mode="all", max_retries=0, unpaid_failures="keep"))
    rows = sorted(pq.read_table(tmp_path / "out.parquet").to_pylist(), key=lambda r: r["turn"])
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "failed"] and s["failed"] == {"http_500": 1}
    assert fs.stats()["completed"] == 3


def test_mode_all_a_turn_failed_without_a_paid_reply_is_the_only_request_of_the_rerun(tmp_path, fs):
    """The 4th turn of a conversation fails with a 500 after the first 3 were answered: the job fails (no output),
    the 3 paid turns are journaled, and the rerun sends the 4th turn only, with the regenerated history."""
    conv = []
    for i in range(4):
        conv += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    fs.app.config.update({"fail_after": 3, "fail_status": 500})
    prompts = write_prompts(tmp_path / "p.parquet", [conv])
    with pytest.raises(GenerationStopped, match=r"1 of 1 sample failed without a paid reply \(http_500 1\)"):
        run(tmp_path, fs, prompts, gen=gen_cfg(mode="all", max_retries=0))
    assert not (tmp_path / "out.parquet").exists() and fs.app.completed == 3
    fs.app.config.update({"fail_after": None})
    fs.app.reset()
    s = run(tmp_path, fs, prompts, gen=gen_cfg(mode="all", max_retries=0))
    assert s["ok"] == 1 and s["from_journal"] == 3 and s["sent"] == 1 == fs.app.requests
    (body,) = sent(fs)
    assert [m["content"] for m in body if m["role"] == "user"] == ["q0", "q1", "q2", "q3"]
    assert all(m["content"] != f"a{i}" for i, m in enumerate(m for m in body if m["role"] == "assistant"))


def test_kimi_ids_rewritten_on_the_request_path_equal_the_tokenized_prompt(tmp_path, fs):
    prompts = write_prompts(tmp_path / "p.parquet", [TOOL_CONV[:4]])
    run(tmp_path, fs, prompts, bk=backends_cfg(fs, type="sglang"), target_format=KIMI)
    (body,) = sent(fs)
    assert body[1]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert body[2]["tool_call_id"] == "functions.get_weather:0"
    (resp,) = pq.read_table(tmp_path / "out.parquet").to_pylist()
    stored = json.loads(resp["messages"])
    assert [m.get("tool_call_id") for m in stored] == [m.get("tool_call_id") for m in body]
    # the tokenize stage renders exactly what the server was sent (the rewrite is idempotent)
    tt = target("kimi-k2-thinking")
    assert tt.render(stored, None) == tt.render(
        [{k: v for k, v in m.items() if k != "reasoning_content"} for m in body], None
    )
    (tok,) = tokenize_rows([dict(resp, reasoning="r", content="Sunny.")], tt)
    text = tt.tok.decode(tok["input_ids"][: tok["num_prompt_tokens"]], skip_special_tokens=False)
    assert "functions.get_weather:0" in text and "call_0" not in text


def test_mode_all_keeps_the_original_turn_when_the_regenerated_one_calls_tools():
    """A regenerated turn that calls tools where the dataset's turn did not has no tool results after it (a server
    answers such a history with 400): the later turns are asked with the original turn in their history."""
    from eagle3_data.generate import JobState, Runner, Sample

    conv = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a3"},
    ]
    from eagle3_data.settings import GenerateSettings

    runner = Runner(
        GenerateSettings.defaults(target_name="t", generation=gen_cfg(mode="all")),
        records={},
        journal=None,
        pool=None,
        state=JobState(total=1, budget_tokens=None, budget_usd=None),
    )
    sample = Sample("s", json.dumps(conv), None, [1, 3, 5])
    steps = runner.steps(sample)
    turn, prompt, *_ = next(steps)
    assert turn == 1
    turn, prompt, *_ = steps.send({"content": "", "tool_calls": json.dumps([CALL0])})  # regenerated with a call
    assert turn == 3 and prompt[1] == conv[1]  # the original answer stays in the history
    turn, prompt, *_ = steps.send({"content": "new a2", "reasoning": None, "tool_calls": None})
    assert turn == 5 and prompt[1] == conv[1] and prompt[3]["content"] == "new a2"  # a plain answer replaces it
