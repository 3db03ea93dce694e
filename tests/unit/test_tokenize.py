"""The tokenize stage: exact output_ids, truncated responses, failed generations, the parquet stage entry point and
loading tokenizers that need trust_remote_code."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data import schemas
from eagle3_data.templates import TargetTokens, TemplateError, completion_format, load_target_tokens
from eagle3_data.settings import TokenizeSettings
from eagle3_data.tokens import tokenize, tokenize_batch, tokenize_rows, tokens_table
from test_templates import MULTI, row, target


def test_exact_output_ids_used_and_checked_against_text():
    tt = target("kimi-k2-thinking")
    rec = tokenize_rows([row(MULTI, reasoning="think", content="Hello world")], tt)[0]
    p = rec["num_prompt_tokens"]
    comp = rec["input_ids"][p:]
    # a non-canonical split of the same text (the sampler may pick it): kept as exact, with the backend's ids
    hw = tt.tok.encode(" world", add_special_tokens=False)
    assert len(hw) == 1  # merged in the fixture
    text_ids = tt.tok.encode("Hello", add_special_tokens=False)
    noncanon = (
        comp[: comp.index(tt.think_close_id) + 1]
        + text_ids
        + tt.tok.convert_tokens_to_ids(["Ġ", "w", "o", "r", "l", "d"])
    )  # no <|im_end|>: appended
    (out,) = tokenize_rows([row(MULTI, reasoning="think", content="Hello world", output_ids=noncanon)], tt)
    assert out["ids_source"] == "exact" and out["reject_reason"] is None
    assert out["input_ids"] == rec["input_ids"][:p] + noncanon + [tt.eot_id]
    assert out["num_completion_tokens"] == len(noncanon) + 1 and len(noncanon) + 1 > len(comp)
    # ids whose text is not the response text are rejected
    wrong = comp[:-3] + tt.tok.encode("Xorld", add_special_tokens=False) + [tt.eot_id]
    (bad,) = tokenize_rows([row(MULTI, reasoning="think", content="Hello world", output_ids=wrong)], tt)
    assert bad["reject_reason"] == "exact_ids_text_mismatch" and bad["input_ids"] == []


def test_truncated_response_gets_no_end_of_turn():
    tt = target("kimi-k2-thinking")
    (out,) = tokenize_rows([row(MULTI, reasoning="long thoughts", content=None, finish_reason="length")], tt)
    assert out["reject_reason"] is None
    assert out["input_ids"][-1] != tt.eot_id
    # cut inside the reasoning: the prefix ends where the target stopped, no end-of-reasoning marker
    assert (
        tt.tok.decode(out["input_ids"][out["num_prompt_tokens"] :], skip_special_tokens=False) == "<think>long thoughts"
    )


def test_failed_generation_and_bad_json_rows_keep_their_place():
    tt = target("qwen3")
    rows = [
        dict(row(MULTI, content="a"), sample_id="a", status="failed", error="http_429: rate limited"),
        dict(row(MULTI, reasoning="r", content="b"), sample_id="b", messages="[not json"),
        dict(row(MULTI, reasoning="r", content="c"), sample_id="c"),
        dict(row(MULTI, reasoning="r", content="d1"), sample_id="d", turn=1),
        dict(row(MULTI, reasoning="r", content="d3"), sample_id="d", turn=3),
    ]
    out = tokenize_rows(rows, tt)
    assert [o["sample_id"] for o in out] == ["a", "b", "c", "d@1", "d@3"]
    assert (out[0]["reject_stage"], out[0]["reject_reason"]) == ("generate", "http_429")
    assert (out[1]["reject_stage"], out[1]["reject_reason"]) == ("tokenize", "bad_response_json")
    assert all(o["reject_reason"] is None for o in out[2:])


def test_tokens_table_equals_row_dicts_and_passes_schema():
    tt = target("glm45")
    rows = [
        dict(row(MULTI, reasoning=f"r{i}", content="x" * i), sample_id=f"s{i}", completion_tokens=5) for i in range(6)
    ]
    rows[2]["status"] = "failed"
    meta, ids, plens = tokenize_batch(rows, tt)
    table = tokens_table(meta, ids, plens)
    schemas.check(table, "tokens")
    expect = schemas.from_rows(tokenize_rows(rows, tt), schemas.TOKENS)
    assert table.to_pylist() == expect.to_pylist()


def test_stage_writes_tokens_parquet(tmp_path):
    path = F.save_fixture("kimi-k2-thinking", tmp_path / "tok")
    rows = [
        dict(
            row(MULTI, reasoning="r", content=f"answer {i}"),
            sample_id=f"s{i}",
            completion_tokens=9,
            prompt_tokens=None if i == 3 else 40 + i,
        )
        for i in range(4)
    ]
    resp = tmp_path / "responses.parquet"
    pq.write_table(schemas.from_rows(rows, schemas.RESPONSES), resp)
    out = tmp_path / "tokens.parquet"
    summary = tokenize(
        str(resp), str(out), settings=TokenizeSettings.defaults({"path": path, "template": "kimi-k2-thinking"})
    )
    assert summary["rows"] == summary["tokenized"] == 4 and summary["rejected"] == {}
    got = pq.read_table(out)
    assert got.schema.equals(schemas.TOKENS) and got.num_rows == 4
    assert got.column("loss_mask").to_pylist()[0][-1] == 1
    assert got.column("billed_prompt_tokens").to_pylist() == [40, 41, 42, None]  # usage.prompt_tokens, for the audit
    assert got.column("billed_completion_tokens").to_pylist() == [9] * 4
    with pytest.raises(ValueError, match="not a responses file"):
        tokenize(
            str(out),
            str(tmp_path / "x.parquet"),
            settings=TokenizeSettings.defaults({"path": path, "template": "kimi-k2-thinking"}),
        )


def test_dataset_chat_template_kwargs_change_the_rendered_prompt(tmp_path):
    """Kimi K2.5: thinking on -> the prompt ends in <think>; a dataset that turns thinking off (its
    generation.extra_body.chat_template_kwargs, sent with the request) gets <think></think> in the prompt."""
    path = F.save_fixture("kimi-k25", tmp_path / "tok")
    resp, resp_on = tmp_path / "responses.parquet", tmp_path / "responses_on.parquet"
    pq.write_table(
        schemas.from_rows([row(MULTI, content="plain answer", completion_tokens=3)], schemas.RESPONSES), resp
    )
    pq.write_table(
        schemas.from_rows([row(MULTI, reasoning="r", content="plain answer", completion_tokens=3)], schemas.RESPONSES),
        resp_on,
    )
    target = {"path": path, "template": "kimi-k25", "chat_template_kwargs": {"thinking": True}}
    tokenize(str(resp_on), str(tmp_path / "on.parquet"), settings=TokenizeSettings.defaults(target))
    tokenize(
        str(resp),
        str(tmp_path / "off.parquet"),
        settings=TokenizeSettings.defaults(target, chat_template_kwargs={"thinking": False}),
    )
    tok = F.FIXTURES["kimi-k25"]()
    on, off = (pq.read_table(tmp_path / f).to_pylist()[0] for f in ("on.parquet", "off.parquet"))
    prompt_on = tok.decode(on["input_ids"][: on["num_prompt_tokens"]], skip_special_tokens=False)
    prompt_off = tok.decode(off["input_ids"][: off["num_prompt_tokens"]], skip_special_tokens=False)
    assert prompt_on.endswith("<|im_middle|><think>") and prompt_off.endswith("<|im_middle|><think></think>")
    comp_off = tok.decode(off["input_ids"][off["num_prompt_tokens"] :], skip_special_tokens=False)
    assert comp_off == "plain answer<|im_end|>" and off["reject_reason"] is None


REMOTE_CODE = '''
from transformers import PreTrainedTokenizerFast


class FixtureRemoteTokenizer(PreTrainedTokenizerFast):
    """Stands in for a tokenizer that ships its own code (Kimi's tiktoken-based tokenization_kimi.py)."""
'''


def test_trust_remote_code_tokenizer_loads_only_when_allowed(tmp_path):
    d = tmp_path / "remote"
    F.save_fixture("kimi-k2-thinking", d)
    (d / "tokenization_fixture.py").write_text(REMOTE_CODE)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "FixtureRemoteTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_fixture.FixtureRemoteTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TemplateError, match="trust_remote_code"):
        load_target_tokens(str(d), "kimi-k2-thinking", trust_remote_code=False)
    tt = load_target_tokens(str(d), "kimi-k2-thinking", trust_remote_code=True)
    assert type(tt.tok).__name__ == "FixtureRemoteTokenizer"
    (out,) = tokenize_rows([row(MULTI, reasoning="r", content="c")], tt)
    assert (
        out["input_ids"]
        == tokenize_rows([row(MULTI, reasoning="r", content="c")], target("kimi-k2-thinking"))[0]["input_ids"]
    )


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path):
    tok = F.build_fixture_tokenizer(F.QWEN3_SPECIALS, (), None, eos="<|im_end|>")
    tok.save_pretrained(str(tmp_path))
    with pytest.raises(TemplateError, match="no chat template"):
        load_target_tokens(str(tmp_path), "qwen3")
    assert isinstance(TargetTokens(F.qwen3(), completion_format("qwen3")).vocab_size, int)
