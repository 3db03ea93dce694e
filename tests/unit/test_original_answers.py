"""Rule original_answers (``datasets.<name>.answers: original``): the source's own answers as RESPONSES rows, what
tokenize and validate make of them on a thinking target, the config's dataset lists and checks, the reports."""

from __future__ import annotations

import copy
import json

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data import config as cfg
from eagle3_data import settings as stage_settings
from eagle3_data import schemas
from eagle3_data.original_answers import answer_fields, original_answers
from eagle3_data.report import run_summary_rows, tally
from eagle3_data.settings import OriginalAnswersSettings, TokenizeSettings, ValidateSettings
from eagle3_data.templates import rewrite_kimi_tool_call_ids
from eagle3_data.tokens import tokenize
from eagle3_data.validate import validate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]
CALL = [{"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello world"},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Then the end."},
]
AGENT = [
    {"role": "user", "content": "List files"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": CALL},
    {"role": "tool", "tool_call_id": "call_0", "content": "a.txt"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "cat a.txt"}'}}
        ],
    },
]
THINK = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>Two and two.</think>\n\nFour."}]
NO_ANSWER = [{"role": "user", "content": "Anyone there?"}]


def write_prompts(path, samples: dict[str, list], tools: dict | None = None) -> str:
    rows = [
        {
            "sample_id": sid,
            "dataset": "ds",
            "messages": json.dumps(m),
            "source_format": "sharegpt",
            "tools": json.dumps((tools or {})[sid]) if (tools or {}).get(sid) else None,
            "source_row": i,
        }
        for i, (sid, m) in enumerate(samples.items())
    ]
    pq.write_table(schemas.from_rows(rows, schemas.PROMPTS), path)
    return str(path)


def run(tmp_path, samples, tools=None, **settings):
    prompts = write_prompts(tmp_path / "prompts.parquet", samples, tools)
    out, summary = tmp_path / "responses.parquet", tmp_path / "responses.json"
    s = original_answers(
        prompts, out, shard="000", settings=OriginalAnswersSettings.defaults("ds", **settings), summary_path=summary
    )
    assert json.loads(summary.read_text()) == s
    table = pq.read_table(out)
    schemas.check(table, "responses", str(out))
    return table.to_pylist(), s


NULL_COLUMNS = (
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_usd",
    "provider",
    "model",
    "latency_s",
    "output_ids",
    "completed_at",
    "prompt_ids",
    "error",
)


def test_mode_last_takes_the_last_answer_with_the_prompt_generate_sends(tmp_path):
    rows, s = run(tmp_path, {"chat": CHAT})
    (r,) = rows
    assert (r["sample_id"], r["dataset"], r["turn"], r["status"]) == ("chat", "ds", 4, "ok")
    assert json.loads(r["messages"]) == CHAT[:4]
    assert (r["content"], r["reasoning"], r["tool_calls"], r["finish_reason"]) == ("Then the end.", "", None, "stop")
    assert r["backend"] == "original" and len(r["request_key"]) == 32
    assert all(r[c] is None for c in NULL_COLUMNS)
    assert {
        k: s[k]
        for k in (
            "samples",
            "ok",
            "failed_total",
            "sent",
            "not_sent",
            "cost_usd",
            "total_cost_usd",
            "stopped_by",
            "rows",
            "by_backend",
            "answers",
        )
    } == {
        "samples": 1,
        "ok": 1,
        "failed_total": 0,
        "sent": 0,
        "not_sent": 0,
        "cost_usd": 0.0,
        "total_cost_usd": 0.0,
        "stopped_by": "all samples done",
        "rows": 1,
        "by_backend": {"original": 1},
        "answers": "original",
    }


def test_mode_all_gives_one_row_per_turn_with_the_original_history(tmp_path):
    rows, s = run(tmp_path, {"chat": CHAT}, mode="all")
    assert [r["turn"] for r in rows] == [2, 4]
    assert [json.loads(r["messages"]) for r in rows] == [CHAT[:2], CHAT[:4]]
    assert json.loads(rows[1]["messages"])[2]["content"] == "Hello world"  # the source's answer, not a new one
    assert [r["content"] for r in rows] == ["Hello world", "Then the end."]
    assert len({r["request_key"] for r in rows}) == 2 and (s["ok"], s["rows"]) == (1, 2)


def test_tool_call_answers_and_kimi_history_ids(tmp_path):
    rows, _ = run(tmp_path, {"agent": AGENT}, {"agent": TOOLS}, mode="all", tool_call_ids="kimi")
    first, last = rows
    assert json.loads(first["tool_calls"]) == CALL and first["finish_reason"] == "tool_calls"
    assert first["content"] == "Let me look." and json.loads(first["tools"]) == TOOLS
    prompt = json.loads(last["messages"])
    assert prompt == rewrite_kimi_tool_call_ids(AGENT[:3])  # as generate sends it to a Kimi target
    assert prompt[1]["tool_calls"][0]["id"] == "functions.bash:0" and prompt[2]["tool_call_id"] == "functions.bash:0"
    assert json.loads(last["tool_calls"])[0]["function"]["arguments"] == '{"cmd": "cat a.txt"}'
    # other families: the ids as in the source
    (tmp_path / "other").mkdir()
    rows, _ = run(tmp_path / "other", {"agent": AGENT}, {"agent": TOOLS}, mode="all")
    assert json.loads(rows[1]["messages"]) == AGENT[:3]


def test_reasoning_fields_of_an_answer():
    assert answer_fields({"role": "assistant", "content": "A", "reasoning_content": "R"}) == {
        "reasoning": "R",
        "content": "A",
        "tool_calls": None,
    }
    # OpenThoughts-114k markers (source option strip_reasoning: false): thought -> reasoning, solution -> content
    ot = (
        "<|begin_of_thought|>\n\nLet me add.\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\n4\n\n<|end_of_solution|>"
    )
    assert answer_fields({"role": "assistant", "content": ot}) == {
        "reasoning": "Let me add.",
        "content": "4",
        "tool_calls": None,
    }
    # a <think> block stays in the content: tokenize splits it as the target family does
    assert answer_fields(THINK[1])["content"] == THINK[1]["content"] and answer_fields(THINK[1])["reasoning"] == ""


def test_no_answer_is_a_named_reject_and_the_cap_takes_generates_samples(tmp_path):
    samples = {f"s{i}": CHAT for i in range(5)}
    samples["lonely"] = NO_ANSWER
    rows, s = run(tmp_path, samples, max_samples=7, num_shards=2)  # shard 000 of 2: 4 of the 7
    assert sorted(r["sample_id"] for r in rows) == ["lonely", "s0", "s1", "s2"]  # sorted by id, as generate
    bad = next(r for r in rows if r["sample_id"] == "lonely")
    assert bad["status"] == "failed" and bad["error"].startswith("no_original_answer: ")
    assert bad["backend"] == "original" and json.loads(bad["messages"]) == NO_ANSWER and bad["turn"] == 1
    assert (s["samples"], s["ok"], s["failed"], s["over_max_samples"], s["stopped_by"]) == (
        4,
        3,
        {"no_original_answer": 1},
        2,
        "max_samples",
    )


def test_thinking_target_tokenizes_and_validates_original_answers(tmp_path):
    """Kimi K2.5 with thinking on: an answer without reasoning gets the empty think block its template renders, a
    think block in the content is split out; the no-answer sample is rejected under stage original_answers; the
    billed-count audit skips rows without a billed count; the tally labels the dataset."""
    path = F.save_fixture("kimi-k25", tmp_path / "tok")
    target = {"path": path, "template": "kimi-k25", "chat_template_kwargs": {"thinking": True}}
    rows, _ = run(
        tmp_path,
        {"chat": CHAT, "think": THINK, "lonely": NO_ANSWER, "agent": AGENT},
        {"agent": TOOLS},
        tool_call_ids="kimi",
    )
    tokens = tmp_path / "tokens.parquet"
    tokenize(str(tmp_path / "responses.parquet"), str(tokens), settings=TokenizeSettings.defaults(target))
    vpath, rpath = tmp_path / "ds" / "validated" / "000.parquet", tmp_path / "ds" / "rejected" / "000.parquet"
    vpath.parent.mkdir(parents=True)
    rpath.parent.mkdir(parents=True)
    # a ceiling above the one reject of 4 (the bundled demo's is 0.25)
    summary = validate(
        str(tokens), str(vpath), str(rpath), settings=ValidateSettings.defaults(target=target, max_reject_rate=0.5)
    )
    assert summary["validated"] == 3 and summary["rejected"] == {"no_original_answer": 1}
    assert summary["billed_completion_tokens"] == 0  # nothing billed: the audit had nothing to compare
    tok = F.FIXTURES["kimi-k25"]()
    got = {r["sample_id"]: r for r in pq.read_table(vpath).to_pylist()}
    comp = {
        sid: tok.decode(r["input_ids"][r["num_prompt_tokens"] :], skip_special_tokens=False) for sid, r in got.items()
    }
    assert comp["chat"] == "</think>Then the end.<|im_end|>"
    assert comp["think"] == "Two and two.</think>\n\nFour.<|im_end|>"
    assert comp["agent"].startswith("</think><|tool_calls_section_begin|><|tool_call_begin|>functions.bash:1")
    assert all(
        r["backend"] == "original" and r["cost_usd"] is None and r["billed_completion_tokens"] is None
        for r in got.values()
    )
    assert all(r["loss_mask"] == [0] * r["num_prompt_tokens"] + [1] * r["num_completion_tokens"] for r in got.values())
    (rej,) = pq.read_table(rpath).to_pylist()
    assert (rej["sample_id"], rej["stage"], rej["reason"]) == ("lonely", "original_answers", "no_original_answer")

    resp = tmp_path / "ds" / "responses" / "000.parquet"
    resp.parent.mkdir(parents=True)
    (tmp_path / "responses.parquet").rename(resp)
    (tmp_path / "responses.json").rename(resp.with_suffix(".json"))
    datasets = {"ds": {"source": {"format": "sharegpt"}, "shards": 1, "answers": "original"}}
    by = {r["dataset"]: r for r in tally([vpath], [rpath], [resp], tmp_path / "reports", datasets_config=datasets)}
    assert (by["ds"]["kind"], by["ds"]["source"], by["ds"]["samples"], by["ds"]["rejected"]) == (
        "original",
        "Original answers",
        3,
        1,
    )
    assert by["Total original answers"]["samples"] == 3 and "Total generated" not in by
    md = (tmp_path / "reports" / "tally.md").read_text()
    assert "| Original answers " in md and "(original)" not in md
    assert "| ds        | original_answers | no_original_answer |" in md
    (row, total) = run_summary_rows(datasets, tmp_path)
    assert (row["kind"], row["ended_by"], row["cost_usd"], row["samples"], row["ok"], row["failed"], row["kept"]) == (
        "original",
        "original answers",
        None,
        4,
        3,
        1,
        3,
    )


def config(**ds_extra) -> dict:
    return {
        "target": {"name": "t", "path": "p", "template": "kimi-k25"},
        "generation": {"mode": "last", "max_tokens": 99},
        "datasets": {
            "orig": {
                "source": {"format": "sharegpt", "path": "x.json"},
                "shards": 2,
                "answers": "original",
                **ds_extra,
            },
            "pre": {"source": {"format": "pretokenized", "path": "y.jsonl"}},
        },
    }


def test_dataset_lists_checks_and_params_leave_original_answers_out_of_generation(monkeypatch):
    c = config()
    cfg.validate_config(c, cfg.load_schema(cfg_schema()))
    # no backends anywhere: nothing to generate
    cfg.check_config(copy.deepcopy(c), check_paths=False)
    assert (cfg.generated_datasets(c), cfg.original_datasets(c), cfg.response_datasets(c)) == ([], ["orig"], ["orig"])
    assert cfg.pending_generation(c) == [] and cfg.backend_job_seats(c, 32) == {}
    assert OriginalAnswersSettings.from_config(c, "orig").params() == {
        "answers": "original",
        "mode": "last",
        "max_samples": None,
        "num_shards": 2,
        "tool_call_ids": "kimi",
    }
    assert TokenizeSettings.from_config(c, "orig").max_tokens is None  # nothing was cut at a max_tokens
    assert (
        stage_settings.datasets_data_settings(c)["orig"]["answers"] == "original"
        and "answers" not in stage_settings.datasets_data_settings(c)["pre"]
    )
    assert "original_answers" in cfg.reruns_of("datasets.<name>.answers")

    # a regenerated dataset beside it needs a backend and its key; the original one never
    c2 = copy.deepcopy(c)
    c2["backends"] = {"or": {"type": "openrouter", "base_url": "https://x/v1", "model": "m", "api_key_env": "K_X"}}
    c2["datasets"]["regen"] = {"source": {"format": "sharegpt", "path": "x.json"}, "generation": {"backends": ["or"]}}
    assert cfg.generated_datasets(c2) == ["regen"] and cfg.response_datasets(c2) == ["orig", "regen"]
    with pytest.raises(cfg.ConfigError, match=r"K_X is not set \(backends.or.api_key_env, used by regen\)"):
        cfg.check_api_keys(c2, cfg.generated_datasets(c2), {})

    bad = copy.deepcopy(c)
    bad["datasets"]["pre"]["answers"] = "original"
    with pytest.raises(cfg.ConfigError, match=r"datasets.pre.answers: original needs a conversation source"):
        cfg.check_config(bad, check_paths=False)
    bad = copy.deepcopy(c)
    bad["backends"] = {"original": {"type": "openai", "base_url": "http://h/v1", "model": "m"}}
    with pytest.raises(cfg.ConfigError, match=r"backends.original: the name is reserved"):
        cfg.check_config(bad, check_paths=False)
    regen = copy.deepcopy(c)
    regen["datasets"]["orig"]["answers"] = "regenerate"
    with pytest.raises(cfg.ConfigError, match=r"datasets.orig: no backend to generate its responses with"):
        cfg.check_config(regen, check_paths=False)
    with pytest.raises(cfg.ConfigError, match=r"datasets.orig.answers"):
        cfg.validate_config(config(answers="both"), cfg.load_schema(cfg_schema()))


def cfg_schema():
    from eagle3_data.settings import SCHEMA_PATH

    return SCHEMA_PATH


def test_answers_that_are_not_answers_are_each_a_named_reject(tmp_path):
    """With strip_think: false an answer whose <think> never closes was kept as a broken turn, one with only
    reasoning was kept with an empty final answer, an empty one was rejected under a reason pointing at
    OpenRouter settings: each is its own named reject of stage original_answers."""
    q = {"role": "user", "content": "2+2?"}
    samples = {
        "ok_think": THINK,
        "ok_tools": AGENT,  # a tool call with empty content is an answer
        "unclosed": [q, {"role": "assistant", "content": "<think>Two and two make"}],
        "thought_only": [q, {"role": "assistant", "content": "<think>Two and two.</think>\n\n"}],
        "field_only": [q, {"role": "assistant", "content": " ", "reasoning_content": "Two and two."}],
        "ot_only": [q, {"role": "assistant", "content": "<|begin_of_thought|>Two.<|end_of_thought|>"}],
        "empty": [q, {"role": "assistant", "content": ""}],
        "none": [q, {"role": "assistant", "content": None}],
    }
    rows, s = run(tmp_path, samples, mode="all")
    assert s["ok"] == 2 and s["failed"] == {"unclosed_think": 1, "reasoning_only": 3, "empty_original_answer": 2}
    errors = {r["sample_id"]: r["error"] for r in rows if r["status"] == "failed"}
    assert errors["unclosed"] == (
        "unclosed_think: the answer opens <think> and never closes it (a reasoning cut off?): no final answer to "
        "train on"
    )
    assert {errors[k].split(":")[0] for k in ("thought_only", "field_only", "ot_only")} == {"reasoning_only"}
    assert errors["empty"] == "empty_original_answer: the source's answer is empty (no reasoning, content or tool call)"
    assert all(r["backend"] == "original" for r in rows) and len(rows) == 2 + 1 + 6  # AGENT: 2 turns in mode all
