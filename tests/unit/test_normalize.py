"""normalize stage: shard files, rejects, ids, sharding stability, bundled samples, error reporting."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_data import schemas
from eagle3_data.files import content_hash, shard_of
from eagle3_data.normalize import normalize
from eagle3_data.settings import NormalizeSettings
from eagle3_data.sources import SourceFormatError

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "resources" / "samples"


def run(tmp_path, src, fmt, shards=2, **kw):
    out = tmp_path / "out"
    paths = [out / "prompts" / f"{i:03d}.parquet" for i in range(shards)]
    rej = out / "rejected" / "normalize.parquet"
    kw.setdefault("max_reject_rate", 1.0)  # no ceiling unless a test sets one
    counts = normalize(NormalizeSettings.defaults("ds", format=fmt, path=src, shards=shards, **kw), paths, rej)
    kind = "tokens" if fmt == "pretokenized" else "prompts"
    tables = [schemas.check(pq.read_table(p), kind, str(p)) for p in paths]  # every file passes its contract
    rejects = schemas.check(pq.read_table(rej), "rejects", str(rej))
    return counts, tables, rejects.to_pylist()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sg(i, conv):
    return {"id": f"id{i}_0", "conversations": conv}


H = lambda v: {"from": "human", "value": v}  # noqa: E731
G = lambda v: {"from": "gpt", "value": v}  # noqa: E731


def messy_sharegpt():
    return [
        sg(0, [H("q0"), G("a0")]),
        sg(1, [G("continued"), H("q"), G("a")]),  # starts_with_assistant
        sg(2, []),  # empty_conversation
        sg(3, [H("q3"), {"from": "critic", "value": "x"}]),  # unknown_role
        sg(4, [H("q4"), H("more"), G("a4")]),  # merged
        sg(0, [H("other"), G("dup")]),  # duplicate_id
        {"conversations": [H("no id"), G("hash id")]},  # content-hash id
        sg(7, [H("prompt only")]),
    ]


def test_normalize_sharegpt_rows_rejects_and_shards(tmp_path):
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(messy_sharegpt()))
    counts, tables, rejects = run(tmp_path, src, "sharegpt", shards=3)
    assert counts["rows_read"] == 8 and counts["kept"] == 4
    assert counts["rejected"] == {
        "duplicate_id": 1,
        "empty_conversation": 1,
        "starts_with_assistant": 1,
        "unknown_role": 1,
    }
    assert counts["repaired"] == {"merged_consecutive_turns": 1}
    rows = {r["sample_id"]: r for t in tables for r in t.to_pylist()}
    hashed = content_hash([{"role": "user", "content": "no id"}, {"role": "assistant", "content": "hash id"}], None)
    assert set(rows) == {"id0_0", "id4_0", "id7_0", hashed}
    assert json.loads(rows["id4_0"]["messages"]) == [
        {"role": "user", "content": "q4\n\nmore"},
        {"role": "assistant", "content": "a4"},
    ]
    assert json.loads(rows["id0_0"]["messages"])[1]["content"] == "a0"  # first occurrence wins
    assert rows["id7_0"]["source_row"] == 7 and rows["id7_0"]["tools"] is None
    assert all(r["dataset"] == "ds" and r["source_format"] == "sharegpt" for r in rows.values())
    for i, t in enumerate(tables):  # each row sits in the shard its id hashes to
        assert all(shard_of(s, 3) == i for s in t.column("sample_id").to_pylist())
    assert counts["per_shard"] == [t.num_rows for t in tables]
    by_reason = {r["reason"]: r for r in rejects}
    assert by_reason["duplicate_id"]["sample_id"] == "id0_0" and by_reason["duplicate_id"]["source_row"] == 5
    assert by_reason["starts_with_assistant"]["detail"].startswith("record 1:")
    assert all(r["stage"] == "normalize" and r["dataset"] == "ds" for r in rejects)


def test_shards_stable_when_rows_are_appended(tmp_path):
    base = [sg(i, [H(f"q{i}"), G(f"a{i}")]) for i in range(30)]
    a = tmp_path / "a.jsonl"
    write_jsonl(a, base)
    _, small, _ = run(tmp_path / "1", a, "sharegpt", shards=4)
    write_jsonl(a, base + [sg(i, [H(f"q{i}"), G(f"a{i}")]) for i in range(30, 60)])
    _, big, _ = run(tmp_path / "2", a, "sharegpt", shards=4)
    for s, b in zip(small, big):
        old = set(s.column("sample_id").to_pylist())
        assert old <= set(b.column("sample_id").to_pylist())
    assert sum(t.num_rows for t in big) == 60


def test_max_samples_keeps_first_usable_rows(tmp_path):
    src = tmp_path / "sg.json"
    src.write_text(json.dumps(messy_sharegpt()))
    counts, tables, rejects = run(tmp_path, src, "sharegpt", shards=1, max_samples=2)
    assert counts["kept"] == 2 and counts["rows_read"] == 5  # id0, 3 rejects, id4; stops before row 5
    assert sorted(tables[0].column("sample_id").to_pylist()) == ["id0_0", "id4_0"]
    assert len(rejects) == 3


def test_empty_shards_still_written(tmp_path):
    src = write_jsonl(tmp_path / "one.jsonl", [sg(0, [H("q"), G("a")])])
    counts, tables, rejects = run(tmp_path, src, "sharegpt", shards=4)
    assert sorted(counts["per_shard"]) == [0, 0, 0, 1] and rejects == []
    assert all(t.schema.equals(schemas.PROMPTS) for t in tables)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.parquet"])
def test_empty_source_is_an_error_naming_the_file(tmp_path, name):
    src = tmp_path / name
    if name.endswith(".parquet"):
        import pyarrow as pa

        pq.write_table(pa.table({"id": pa.array([], pa.string()), "conversations": pa.array([], pa.string())}), src)
    else:
        src.write_text("")
    with pytest.raises(SourceFormatError, match=f"{name}: the source holds no records"):
        run(tmp_path, src, "sharegpt")


def test_openai_tools_roundtrip_through_json(tmp_path):
    rec = {
        "id": "t1",
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
    }
    counts, tables, _ = run(tmp_path, write_jsonl(tmp_path / "t.jsonl", [rec]), "openai_messages", shards=1)
    row = tables[0].to_pylist()[0]
    assert json.loads(row["tools"]) == rec["tools"]
    assert json.loads(row["messages"])[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c"}


def test_unpaired_surrogates_are_replaced_and_counted_not_written_as_question_marks(tmp_path):
    # JSONL escapes: a broken emoji (lone high surrogate) in a prompt and in a tool description, a valid pair
    src = tmp_path / "s.jsonl"
    src.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi \\ud83d there"}, {"role": "assistant", '
        '"content": "ok \\ud83d\\ude00"}], "tools": [{"type": "function", "function": {"name": "w", '
        '"description": "x\\udc00"}}]}\n'
        '{"messages": [{"role": "user", "content": "no id \\udfff"}, {"role": "assistant", "content": "a"}]}\n'
        '{"id": "c", "messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "b"}]}\n'
    )
    counts, tables, _ = run(tmp_path, src, "openai_messages", shards=1)
    assert counts["kept"] == 3 and counts["repaired"] == {"replaced_unpaired_surrogates": 2}
    rows = {r["sample_id"]: r for r in tables[0].to_pylist()}
    a = json.loads(rows["a"]["messages"])
    assert a[0]["content"] == "hi \ufffd there" and a[1]["content"] == "ok \U0001f600"
    assert json.loads(rows["a"]["tools"])[0]["function"]["description"] == "x\ufffd"
    no_id = [r for sid, r in rows.items() if sid not in ("a", "c")][0]
    fixed = [{"role": "user", "content": "no id \ufffd"}, {"role": "assistant", "content": "a"}]
    assert json.loads(no_id["messages"]) == fixed and no_id["sample_id"] == content_hash(fixed, None)


def test_json_array_and_jsonl_sources_agree_on_broken_unicode(tmp_path):
    # the same records as a JSON array and as JSONL: lone high/low surrogates, a reversed pair, one in the id
    recs = [
        '{"id": "a", "messages": [{"role": "user", "content": "hi \\ud83d"}, {"role": "assistant", "content": "x"}]}',
        '{"id": "b", "messages": [{"role": "user", "content": "lo \\ude00 rev \\ude00\\ud83d"}, '
        '{"role": "assistant", "content": "y"}]}',
        '{"id": "c\\ud800", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "z"}]}',
        '{"id": "d", "messages": [{"role": "user", "content": "ok \\ud83d\\ude00"}, {"role": "assistant", "content": "w"}]}',
    ]
    arr = tmp_path / "s.json"
    arr.write_text("[" + ",\n".join(recs) + "]")
    lines = tmp_path / "s.jsonl"
    lines.write_text("\n".join(recs) + "\n")
    got = {}
    for src in (arr, lines):
        counts, tables, rejects = run(tmp_path / src.suffix[1:], src, "openai_messages", shards=1)
        got[src.suffix] = (
            counts,
            sorted(tables[0].to_pylist(), key=lambda r: r["sample_id"]),
            [(r["reason"], r["sample_id"]) for r in rejects],
        )
    counts, rows, rejects = got[".json"]
    assert (counts, [dict(r, source_format=None) for r in rows], rejects) == (
        got[".jsonl"][0],
        [dict(r, source_format=None) for r in got[".jsonl"][1]],
        got[".jsonl"][2],
    )
    assert counts["kept"] == 3 and counts["repaired"] == {"replaced_unpaired_surrogates": 2}
    assert rejects == [("invalid_id", None)]
    msgs = {r["sample_id"]: json.loads(r["messages"])[0]["content"] for r in rows}
    assert msgs == {"a": "hi \ufffd", "b": "lo \ufffd rev \ufffd\ufffd", "d": "ok \U0001f600"}


# ------------------------------------------------------------------------------------------ errors


def test_invalid_json_line_raises_naming_file_and_line(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text('{"id": "a", "conversations": []}\n{"id": "b" "conversations": []}\n')
    with pytest.raises(SourceFormatError, match=r"x\.jsonl:2: invalid JSON \(Expecting ',' delimiter"):
        run(tmp_path, src, "sharegpt")
    assert not (tmp_path / "out" / "prompts").exists() or not list((tmp_path / "out" / "prompts").glob("*.parquet"))


def test_on_error_skip_rejects_and_counts_invalid_lines_with_their_numbers(tmp_path):
    good = [json.dumps(sg(i, [H(f"q{i}"), G("a")])) for i in range(6)]
    lines = good[:2] + ['{"id": "b" "conversations": []}'] + good[2:5] + ["{truncated"] + good[5:]
    src = tmp_path / "x.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts, tables, rejects = run(tmp_path, src, "sharegpt", on_error="skip")
    assert counts["rows_read"] == 8 and counts["kept"] == 6 and counts["skipped_lines"] == [3, 7]
    assert counts["rejected"] == {"invalid_json": 2}
    assert sorted(sum((t.column("sample_id").to_pylist() for t in tables), [])) == [f"id{i}_0" for i in range(6)]
    assert [(r["reason"], r["detail"].split(": ")[0]) for r in rejects] == [
        ("invalid_json", f"{src}:3"),
        ("invalid_json", f"{src}:7"),
    ]
    with pytest.raises(SourceFormatError, match=r"x\.jsonl:3: invalid JSON .*source\.on_error: skip"):
        run(tmp_path, src, "sharegpt")  # the default: fail, naming file:line


def test_wrong_format_fails_fast_and_late_breakage_is_rejected(tmp_path):
    uc = write_jsonl(
        tmp_path / "uc.jsonl", [{"prompt_id": "p", "prompt": "q", "messages": [{"role": "user", "content": "q"}]}]
    )
    with pytest.raises(
        SourceFormatError,
        match=r"uc\.jsonl line 1: expected a ShareGPT record with a `conversations` list of \{from, value\}, got keys \['messages', 'prompt', 'prompt_id'\]",
    ):
        run(tmp_path, uc, "sharegpt")
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([[1, 2]]))
    with pytest.raises(SourceFormatError, match=r"arr\.json record 0: expected a ShareGPT record.*got a list"):
        run(tmp_path, arr, "sharegpt")
    good = [sg(i, [H(f"q{i}"), G("a")]) for i in range(12)]
    late = write_jsonl(tmp_path / "late.jsonl", good + [{"messages": []}, sg(99, [H("q99")])])
    counts, tables, rejects = run(tmp_path, late, "sharegpt")
    assert counts["rejected"] == {"malformed_record": 1} and counts["kept"] == 13
    assert rejects[0]["source_row"] == 12 and rejects[0]["detail"].startswith("line 13: got keys ['messages']")
    with pytest.raises(ValueError, match="2 output paths for 3 shards"):
        normalize(
            NormalizeSettings.defaults("ds", format="sharegpt", path=late, shards=3),
            [tmp_path / "a", tmp_path / "b"],
            tmp_path / "r.parquet",
        )


# ------------------------------------------------------------------------------------------ pretokenized


def test_pretokenized_writes_tokens_rows(tmp_path):
    recs = [
        {"sample_id": "p0", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
        {"sample_id": "p1", "input_ids": [1, 2], "loss_mask": [0, 0]},  # no supervised token: validate's job
        {"sample_id": "p2", "input_ids": [1, 2, 3], "loss_mask": [0, 1]},
        {"sample_id": "p3", "input_ids": [], "loss_mask": []},
        {"sample_id": "p4", "input_ids": [1, 2.5], "loss_mask": [0, 1]},
        {"sample_id": "p5", "input_ids": [1, 2], "loss_mask": [0, 3]},
        {"sample_id": "p0", "input_ids": [9], "loss_mask": [1]},
        {"input_ids": [7, 8], "loss_mask": [0, 1]},
    ]
    counts, tables, rejects = run(tmp_path, write_jsonl(tmp_path / "p.jsonl", recs), "pretokenized", shards=2)
    assert counts["output"] == "tokens" and counts["kept"] == 3
    assert counts["rejected"] == {
        "duplicate_id": 1,
        "empty_input_ids": 1,
        "invalid_mask_value": 1,
        "length_mismatch": 1,
        "non_integer_id": 1,
    }
    rows = {r["sample_id"]: r for t in tables for r in t.to_pylist()}
    p0 = rows["p0"]
    assert p0["input_ids"] == [1, 2, 3, 4, 5] and p0["loss_mask"] == [0, 0, 1, 1, 1]
    assert (p0["num_tokens"], p0["num_prompt_tokens"], p0["num_completion_tokens"]) == (5, 2, 3)
    assert p0["ids_source"] == "pretokenized" and p0["backend"] is None and p0["finish_reason"] is None
    assert (rows["p1"]["num_prompt_tokens"], rows["p1"]["num_completion_tokens"]) == (2, 0)
    assert content_hash([7, 8], [0, 1]) in rows
    assert all(t.schema.equals(schemas.TOKENS) for t in tables)


def test_pretokenized_multi_turn_masks_count_every_supervised_span(tmp_path):
    """A multi-turn pre-tokenized sample (two supervised spans, the newline after an end-of-turn masked):
    completion = the supervised tokens, prompt = the rest, so prompt + completion = num_tokens as validate checks
    (the prompt was once the tokens before the first supervised one: every such sample was a length_mismatch;
    tests/unit/test_validate.py runs one through validate)."""
    mask = [0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0]
    recs = [{"sample_id": "mt", "input_ids": list(range(10, 21)), "loss_mask": mask}]
    _counts, tables, _rejects = run(tmp_path, write_jsonl(tmp_path / "p.jsonl", recs), "pretokenized")
    row = next(r for t in tables for r in t.to_pylist())
    assert (row["num_tokens"], row["num_prompt_tokens"], row["num_completion_tokens"]) == (11, 6, 5)


# ------------------------------------------------------------------------------------------ bundled samples

BUNDLED = [
    # file, format, shards, kept, rejected, repaired
    (
        "sharegpt.json",
        "sharegpt",
        2,
        35,
        {
            "duplicate_id": 1,
            "empty_conversation": 1,
            "empty_user_message": 1,
            "starts_with_assistant": 1,
            "unknown_role": 1,
        },
        {"merged_consecutive_turns": 2},
    ),
    ("ultrachat.jsonl", "ultrachat", 1, 28, {"duplicate_id": 1, "empty_user_message": 1}, {}),
    ("swe_agent_trajectories.jsonl", "nebius_swe_agent", 1, 21, {"no_user_turn": 2, "starts_with_assistant": 2}, {}),
]


@pytest.mark.parametrize("name, fmt, shards, kept, rejected, repaired", BUNDLED)
def test_bundled_samples(tmp_path, name, fmt, shards, kept, rejected, repaired):
    src = SAMPLES / name
    raw = src.read_bytes()
    assert raw.isascii()
    counts, tables, rejects = run(tmp_path, src, fmt, shards=shards)
    assert counts["kept"] == kept and counts["rejected"] == rejected and counts["repaired"] == repaired
    assert counts["rows_read"] == kept + sum(rejected.values())
    assert len(rejects) == sum(rejected.values())
    for t in tables:
        for row in t.to_pylist():
            msgs = json.loads(row["messages"])
            assert msgs[next(i for i, m in enumerate(msgs) if m["role"] != "system")]["role"] == "user"
            assert sum(len(m["content"]) for m in msgs) < 1500


def test_bundled_sharegpt_specifics(tmp_path):
    counts, tables, rejects = run(tmp_path, SAMPLES / "sharegpt.json", "sharegpt", shards=2)
    rows = {r["sample_id"]: json.loads(r["messages"]) for t in tables for r in t.to_pylist()}
    assert "QWJ2cIt_0" in rows and len(rows["QWJ2cIt_0"]) == 4
    assert {r["sample_id"]: r["reason"] for r in rejects}["QWJ2cIt_1"] == "starts_with_assistant"
    assert any(m[0]["role"] == "system" for m in rows.values())
    assert any(m[-1]["role"] == "user" for m in rows.values())  # a prompt-only row
    assert len(json.loads((SAMPLES / "sharegpt.json").read_text())) == 40


def test_a_prompt_repeated_under_another_id_is_a_named_reject_unless_kept(tmp_path):
    """duplicate_prompts: drop (the default) rejects a later row whose system, user and tool messages and tools
    equal an earlier row's (its answers may differ), naming the first; keep keeps it. The prompt_key column is
    the normalized user text's key: equal for the copies, and for a copy with other case and punctuation."""
    S = lambda v: {"from": "system", "value": v}  # noqa: E731
    recs = [
        sg(0, [H("What is 2+2?"), G("4")]),
        sg(1, [H("Name a prime."), G("7")]),
        sg(2, [H("What is 2+2?"), G("four")]),  # the same prompt, another answer: duplicate_prompt
        sg(3, [H("what is 2 + 2"), G("4")]),  # other case and punctuation: not exact, kept, same prompt_key
        sg(4, [S("Be brief."), H("What is 2+2?"), G("4")]),  # another system prompt: not the same prompt
    ]
    src = write_jsonl(tmp_path / "dups.jsonl", recs)
    counts, tables, rejects = run(tmp_path, src, "sharegpt", shards=1)
    assert counts["rejected"] == {"duplicate_prompt": 1} and counts["kept"] == 4
    assert rejects == [
        {
            "sample_id": "id2_0",
            "dataset": "ds",
            "stage": "normalize",
            "reason": "duplicate_prompt",
            "detail": "line 3: the same prompt as 'id0_0' (source row 0), an earlier row",
            "source_row": 2,
        }
    ]
    keys = {r["sample_id"]: r["prompt_key"] for r in tables[0].to_pylist()}
    assert keys["id0_0"] == keys["id3_0"] == keys["id4_0"] != keys["id1_0"] and len(keys["id0_0"]) == 16
    counts, tables, rejects = run(tmp_path, src, "sharegpt", shards=1, duplicate_prompts="keep")
    assert counts["rejected"] == {} and counts["kept"] == 5 and rejects == []
