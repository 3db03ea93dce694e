"""Source-format adapters and streaming readers (src/eagle3_data/sources/)."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.sources import REJECT_REASONS, RowReject, SourceFormatError, get_adapter, iter_records
from eagle3_data.sources.base import strip_think
from eagle3_data.sources.glaive import parse_glaive_system


def convert(fmt, record, **options):
    adapter = get_adapter(fmt, options or None)
    assert adapter.shape_problem(record) is None
    return adapter.convert(record)


def reason_of(fmt, record, **options):
    with pytest.raises(RowReject) as exc:
        convert(fmt, record, **options)
    assert exc.value.reason in REJECT_REASONS
    return exc.value.reason


# ------------------------------------------------------------------------------------------ registry


def test_get_adapter_unknown_format_and_option():
    with pytest.raises(ValueError, match="unknown source format 'nope'.*sharegpt"):
        get_adapter("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['idfield'\]"):
        get_adapter("sharegpt", {"idfield": "x"})


def test_reason_codes_are_snake_case():
    for code in REJECT_REASONS:
        assert code == code.lower() and " " not in code and code.replace("_", "").isalnum()


# ------------------------------------------------------------------------------------------ sharegpt


def test_sharegpt_roles_and_merge():
    s = convert(
        "sharegpt",
        {
            "id": "abc_0",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Hi"},
                {"from": "human", "value": "there"},
                {"from": "bing", "value": "Hello"},
                {"from": "user", "value": "Q2"},
                {"from": "chatgpt", "value": "A2"},
                {"from": "bard", "value": "A2b"},
            ],
        },
    )
    assert s.sample_id == "abc_0"
    assert s.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\n\nthere"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2\n\nA2b"},
    ]
    assert s.notes == ["merged_consecutive_turns"]
    unmerged = convert(
        "sharegpt",
        {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]},
        merge_consecutive=False,
    )
    assert [m["content"] for m in unmerged.messages] == ["a", "b"] and unmerged.sample_id is None


@pytest.mark.parametrize(
    "conv, reason",
    [
        ([], "empty_conversation"),
        ([{"from": "gpt", "value": "continuing"}, {"from": "human", "value": "ok"}], "starts_with_assistant"),
        ([{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"}], "unknown_role"),
        ([{"from": "human", "value": "  "}, {"from": "gpt", "value": "?"}], "empty_user_message"),
        ([{"from": "system", "value": "s"}], "no_user_turn"),
        ([{"from": "human", "value": "a"}, {"from": "system", "value": "late"}], "misplaced_system"),
        ([{"from": "human"}], "malformed_message"),
        (["just a string"], "malformed_message"),
    ],
)
def test_sharegpt_rejects(conv, reason):
    assert reason_of("sharegpt", {"id": "x", "conversations": conv}) == reason


def test_sharegpt_role_map_option_and_top_level_system():
    s = convert(
        "sharegpt",
        {"system": "sys", "conversations": [{"from": "Narrator", "value": "n"}, {"from": "human", "value": "q"}]},
        role_map={"narrator": "system"},
    )
    assert s.messages == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "n"},
        {"role": "user", "content": "q"},
    ]


def test_openthoughts_drops_system_and_reasoning():
    s = convert(
        "openthoughts",
        {
            "system": "Your role as an assistant involves thoroughly exploring questions...",
            "conversations": [
                {"from": "user", "value": "Return your final response within \\boxed{}. 1+1?"},
                {
                    "from": "assistant",
                    "value": "<|begin_of_thought|>\n\nhmm\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\n\\boxed{2}\n\n<|end_of_solution|>",
                },
                {"from": "user", "value": "and 2+2?"},
                {"from": "assistant", "value": "<think>\nadd\n</think>\n\n4"},
            ],
        },
    )
    assert s.messages == [
        {"role": "user", "content": "Return your final response within \\boxed{}. 1+1?"},
        {"role": "assistant", "content": "\\boxed{2}"},
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4"},
    ]


# ------------------------------------------------------------------------------------------ openai-style


def test_ultrachat_id_and_prompt_fallback():
    pid = "a" * 64
    s = convert(
        "ultrachat",
        {
            "prompt": "Q",
            "prompt_id": pid,
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": "Q2"},
            ],
        },
    )
    assert s.sample_id == pid and [m["role"] for m in s.messages] == ["user", "assistant", "user"]
    s = convert("ultrachat", {"prompt": "only prompt", "prompt_id": pid, "messages": []})
    assert s.messages == [{"role": "user", "content": "only prompt"}]
    assert reason_of("ultrachat", {"prompt": "", "prompt_id": pid, "messages": []}) == "empty_conversation"
    assert (
        reason_of(
            "ultrachat",
            {"prompt_id": pid, "messages": [{"role": "user", "content": "Q"}, {"role": "critic", "content": "x"}]},
        )
        == "unknown_role"
    )


def test_mixture_of_thoughts_strips_think():
    s = convert(
        "mixture_of_thoughts",
        {
            "messages": [
                {"role": "user", "content": "Solve x+1=2"},
                {"role": "assistant", "content": "<think>\nsubtract 1\n</think>\n\nx = 1"},
            ],
            "num_tokens": 10,
            "source": "open-r1/OpenR1-Math-220k",
        },
    )
    assert s.messages[1] == {"role": "assistant", "content": "x = 1"} and s.sample_id is None
    assert strip_think("<think>never closed") == ""
    assert strip_think("no think here") == "no think here"


def test_openai_messages_tool_calls_and_tools():
    record = {
        "id": 7,
        "messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Paris?"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "dropped",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"t": 20}'},
            {"role": "assistant", "content": "20 C"},
        ],
        "tools": json.dumps([{"name": "get_weather", "parameters": {"type": "object"}}]),
    }
    s = convert("openai_messages", record)
    assert s.sample_id == "7"
    assert s.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "content": '{"t": 20}', "tool_call_id": "c1", "name": "get_weather"},
        {"role": "assistant", "content": "20 C"},
    ]
    assert s.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    bad = dict(record, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert reason_of("openai_messages", bad) == "malformed_message"
    assert reason_of("openai_messages", dict(record, tools="{not json")) == "malformed_tools"


def test_swe_smith_messages_as_json_text():
    msgs = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Fix the bug."},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
    ]
    s = convert(
        "swe_smith",
        {"traj_id": "repo.abc.1", "instance_id": "repo.abc", "messages": json.dumps(msgs), "resolved": True},
    )
    assert s.sample_id == "repo.abc.1"
    assert s.messages[2]["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
    assert s.messages[3] == {"role": "tool", "content": "a.py", "tool_call_id": "t1"}
    assert reason_of("swe_smith", {"traj_id": "x", "messages": "[{oops"}) == "malformed_message"


# ------------------------------------------------------------------------------------------ nebius SWE-agent


def el(role, text, sp=""):
    return {"cutoff_date": "01.01.2023", "mask": role == "ai", "role": role, "system_prompt": sp, "text": text}


def test_nebius_swe_agent_mapping_and_id():
    rec = {
        "instance_id": "django__django-11099",
        "model_name": "swe-agent-llama-70b",
        "target": True,
        "trajectory": [
            el("system", "", sp="SYS PROMPT"),
            el("user", "ISSUE\nbash-$"),
            el("ai", "DISCUSSION\n```\nls\n```"),
        ],
        "exit_status": "submitted",
        "generated_patch": "",
    }
    s = convert("nebius_swe_agent", rec)
    assert s.messages == [
        {"role": "system", "content": "SYS PROMPT"},
        {"role": "user", "content": "ISSUE\nbash-$"},
        {"role": "assistant", "content": "DISCUSSION\n```\nls\n```"},
    ]
    assert s.sample_id.startswith("django__django-11099:swe-agent-llama-70b:") and len(s.sample_id.split(":")[-1]) == 8
    other = convert("nebius_swe_agent", dict(rec, trajectory=rec["trajectory"] + [el("user", "more")]))
    assert other.sample_id != s.sample_id  # another trajectory of the same instance + model
    assert reason_of("nebius_swe_agent", dict(rec, trajectory=[el("system", "S")])) == "no_user_turn"
    assert (
        reason_of("nebius_swe_agent", dict(rec, trajectory=[el("system", "S"), el("ai", "x")]))
        == "starts_with_assistant"
    )
    assert reason_of("nebius_swe_agent", dict(rec, trajectory=[el("user", "u"), el("robot", "x")])) == "unknown_role"


# ------------------------------------------------------------------------------------------ glaive + instruction


def test_glaive_system_tools_and_chat():
    system = (
        "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
        '{\n    "name": "calculate_bmi",\n    "description": "BMI",\n    "parameters": {"type": "object"}\n}\n\n'
        '{\n    "name": "noop",\n    "parameters": {}\n}\n'
    )
    chat = (
        "USER: My weight is 70 kg and height 1.75 m.\n\n\n"
        'ASSISTANT: <functioncall> {"name": "calculate_bmi", "arguments": \'{"weight": 70, "height": 1.75}\'} <|endoftext|>\n\n\n'
        'FUNCTION RESPONSE: {"bmi": 22.86}\n\n\n'
        "ASSISTANT: Your BMI is 22.86. <|endoftext|>\n\n\n"
    )
    s = convert("glaive", {"system": system, "chat": chat})
    assert s.tools == [
        {
            "type": "function",
            "function": {"name": "calculate_bmi", "description": "BMI", "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "noop", "parameters": {}}},
    ]
    assert s.messages == [
        {
            "role": "system",
            "content": "You are a helpful assistant with access to the following functions. Use them if required -",
        },
        {"role": "user", "content": "My weight is 70 kg and height 1.75 m."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "calculate_bmi", "arguments": '{"weight": 70, "height": 1.75}'},
                }
            ],
        },
        {"role": "tool", "content": '{"bmi": 22.86}', "tool_call_id": "call_0", "name": "calculate_bmi"},
        {"role": "assistant", "content": "Your BMI is 22.86."},
    ]
    text, tools = parse_glaive_system("SYSTEM: You are a helpful assistant, with no access to external functions.\n\n")
    assert (text, tools) == ("You are a helpful assistant, with no access to external functions.", [])
    assert (
        reason_of("glaive", {"system": "", "chat": "USER: \n\n\nASSISTANT: hi <|endoftext|>"}) == "empty_user_message"
    )
    assert reason_of("glaive", {"system": "", "chat": "FUNCTION RESPONSE: {}"}) == "malformed_message"


def test_instruction_response_fields():
    s = convert("instruction_response", {"problem": "Write fizzbuzz", "solution": "code", "lang": "python", "index": 3})
    assert s.messages == [{"role": "user", "content": "Write fizzbuzz"}, {"role": "assistant", "content": "code"}]
    s = convert("instruction_response", {"id": "oci-1", "input": "Q", "output": "A", "domain": "generic"})
    assert s.sample_id == "oci-1" and s.messages[0] == {"role": "user", "content": "Q"}
    s = convert("instruction_response", {"q": "Q", "a": ""}, prompt_field="q", response_field="a")
    assert s.messages == [{"role": "user", "content": "Q"}]
    assert get_adapter("instruction_response").shape_problem({"text": "x"}).startswith("no prompt field")


# ------------------------------------------------------------------------------------------ pretokenized


def test_pretokenized_ok():
    s = convert("pretokenized", {"sample_id": "p1", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, True, 1]})
    assert (s.sample_id, s.input_ids, s.loss_mask) == ("p1", [5, 6, 7, 8], [0, 0, 1, 1])
    assert convert("pretokenized", {"id": 3, "input_ids": [1], "loss_mask": [0]}).sample_id == "3"


@pytest.mark.parametrize(
    "ids, mask, reason",
    [
        ([], [], "empty_input_ids"),
        ([1, 2, 3], [0, 1], "length_mismatch"),
        ([1, 2.0], [0, 1], "non_integer_id"),
        ([1, "2"], [0, 1], "non_integer_id"),
        ([1, None], [0, 1], "non_integer_id"),
        ([1, True], [0, 1], "non_integer_id"),
        ([1, -1], [0, 1], "id_out_of_range"),
        ([1, 2**31], [0, 1], "id_out_of_range"),
        ([1, 2], [0, 2], "invalid_mask_value"),
        ([1, 2], [0, 0.5], "invalid_mask_value"),
        ("1 2", [0, 1], "non_integer_id"),
    ],
)
def test_pretokenized_rejects(ids, mask, reason):
    assert reason_of("pretokenized", {"input_ids": ids, "loss_mask": mask}) == reason


# ------------------------------------------------------------------------------------------ readers

RECS = [{"id": f"r{i}", "text": "x\ny" * i, "n": i, "f": 1.5} for i in range(5)]


def test_json_array_reader_streams_records(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps(RECS, indent=2))
    got = list(iter_records(p))
    assert [r for _, r, _ in got] == RECS
    assert [(i, w) for i, _, w in got] == [(i, f"record {i}") for i in range(5)]
    # across tiny chunks (records straddle chunk boundaries)
    from eagle3_data.sources.readers import _iter_json_array

    assert [r for _, r, _ in _iter_json_array(p, chunk_chars=7)] == RECS


def test_json_array_reader_errors(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[\n{"a": 1},\n{"a": 2}\n{"a": 3}\n]')
    with pytest.raises(SourceFormatError, match=r"bad\.json.*record 2\b.*invalid JSON") as exc:
        list(iter_records(p))
    assert "bad.json line 4 (record 2)" in str(exc.value)
    p.write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(SourceFormatError, match=r"bad\.json: expected a JSON array.*\.jsonl"):
        list(iter_records(p))


def test_jsonl_reader_lines_blank_lines_gzip_and_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3,}\n')
    with pytest.raises(SourceFormatError, match=r"x\.jsonl:4: invalid JSON \(Expecting property name"):
        list(iter_records(p))
    p.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert [(i, r, w) for i, r, w in iter_records(p)] == [(0, {"a": 1}, "line 1"), (1, {"a": 2}, "line 3")]
    gz = tmp_path / "x.jsonl.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert [r for _, r, _ in iter_records(gz)] == [{"a": 1}, {"a": 2}]


def test_parquet_reader_and_bad_files(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"}], "k": i} for i in range(5)]), p
    )
    got = list(iter_records(p, batch_rows=2))
    assert [i for i, _, _ in got] == [0, 1, 2, 3, 4] and got[3][1] == {
        "messages": [{"role": "user", "content": "q"}],
        "k": 3,
    }
    bad = tmp_path / "fake.parquet"
    bad.write_text("not parquet")
    with pytest.raises(SourceFormatError, match=r"fake\.parquet: not a readable parquet file"):
        list(iter_records(bad))
    with pytest.raises(SourceFormatError, match=r"unknown source file extension '\.csv'"):
        list(iter_records(tmp_path / "x.csv"))


def test_glaive_arguments_written_as_a_python_literal_become_json_or_a_named_reject():
    def call(args: str) -> str:
        chat = (
            "USER: convert 5 inches\n\n\n"
            f'ASSISTANT: <functioncall> {{"name": "convert", "arguments": \'{args}\'}} <|endoftext|>\n\n\n'
        )
        s = convert("glaive", {"system": "", "chat": chat})
        return s.messages[1]["tool_calls"][0]["function"]["arguments"]

    assert call('{"value": 5, "unit": "in"}') == '{"value": 5, "unit": "in"}'  # JSON: as it is
    assert (
        call("{'value': 5, 'unit': 'in', 'exact': True, 'note': None}")
        == '{"value": 5, "unit": "in", "exact": true, "note": null}'
    )
    for bad in ("{'value': 5", "convert(5)", "5 inches"):
        chat = (
            "USER: convert 5 inches\n\n\n"
            f'ASSISTANT: <functioncall> {{"name": "convert", "arguments": \'{bad}\'}} <|endoftext|>\n\n\n'
        )
        assert reason_of("glaive", {"system": "", "chat": chat}) == "malformed_tool_arguments", bad
