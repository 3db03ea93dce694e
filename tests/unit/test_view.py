"""Loss-mask view (src/eagle3_data/view.py): exactly the supervised tokens of a known sample are marked, in HTML,
in the terminal (colour and plain) and in the table, for validated, tokens and merged files."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pyarrow.parquet as pq
import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data import schemas, view

MESSAGES = [{"role": "user", "content": "Say hello to the world in Japanese.\nThanks!"}]
#: the completion: multi-byte characters (3-byte 日本, 2-byte ö) split over byte tokens, a newline, end of turn
COMPLETION = "Hello wörld: 日本\tok<|im_end|>"


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """A validated file with one known sample (prompt from the Kimi-like chat template, completion with
    multi-byte characters) and a second one; the tokenizer directory; the sample's ids and mask."""
    d = tmp_path_factory.mktemp("view")
    tok_dir = F.save_fixture("kimi-k2-thinking", d / "tok")
    tok = F.kimi_k2_thinking()
    prompt_text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    comp_ids = tok(COMPLETION, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + comp_ids
    mask = [0] * len(prompt_ids) + [1] * len(comp_ids)
    rows = [
        {
            "sample_id": "other",
            "dataset": "ds",
            "input_ids": prompt_ids + comp_ids[:3],
            "loss_mask": [0] * len(prompt_ids) + [1] * 3,
            "num_tokens": len(prompt_ids) + 3,
            "num_prompt_tokens": len(prompt_ids),
            "num_completion_tokens": 3,
            "ids_source": "reconstructed",
            "finish_reason": "stop",
        },
        {
            "sample_id": "known",
            "dataset": "ds",
            "input_ids": ids,
            "loss_mask": mask,
            "num_tokens": len(ids),
            "num_prompt_tokens": len(prompt_ids),
            "num_completion_tokens": len(comp_ids),
            "ids_source": "exact",
            "finish_reason": "stop",
        },
    ]
    path = d / "validated.parquet"
    schemas.write_checked(schemas.from_rows(rows, schemas.VALIDATED), "validated", path)
    return {
        "path": path,
        "tok_dir": tok_dir,
        "tok": tok,
        "ids": ids,
        "mask": mask,
        "prompt_len": len(prompt_ids),
        "comp_ids": comp_ids,
    }


class _Spans(HTMLParser):
    """Token spans (``class="t ..."``) and markers of a view page, in document order."""

    def __init__(self):
        super().__init__()
        self.tokens, self.marks, self._cur = [], [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "span" and "t" in cls and "data-id" in a:
            self._cur = {
                "i": int(a["data-i"]),
                "id": int(a["data-id"]),
                "mask": int(a["data-mask"]),
                "cls": cls,
                "text": "",
            }
            self.tokens.append(self._cur)
        elif tag == "span" and "mark" in cls and "data-at" in a:  # not the legend's
            self.marks.append((int(a["data-at"]), cls))

    def handle_endtag(self, tag):
        self._cur = None

    def handle_data(self, data):
        if self._cur is not None:
            self._cur["text"] += data


def _spans(html_text: str) -> _Spans:
    p = _Spans()
    p.feed(html_text)
    return p


def test_html_marks_exactly_the_supervised_tokens(known, tmp_path, capsys):
    out = tmp_path / "v.html"
    assert (
        view.main([str(known["path"]), "--sample", "known", "--tokenizer", known["tok_dir"], "--html", str(out)]) == 0
    )
    assert f"{len(known['ids']):,} tokens, {len(known['comp_ids']):,} supervised" in capsys.readouterr().out
    page = out.read_text()
    p = _spans(page)
    # every token once, in order, with its id and mask
    assert [t["i"] for t in p.tokens] == list(range(len(known["ids"])))
    assert [t["id"] for t in p.tokens] == known["ids"]
    assert [t["mask"] for t in p.tokens] == known["mask"]
    # supervised = exactly the completion's ids, by class as drawn
    assert [t["id"] for t in p.tokens if "m1" in t["cls"]] == known["comp_ids"]
    assert not [t for t in p.tokens if ("m1" in t["cls"]) != (t["mask"] == 1)]
    # the prompt/completion split: one marker where the completion starts
    assert p.marks == [(known["prompt_len"], ["mark", "c1"])]
    # special tokens: the template's role markers and the end of turn
    tok = known["tok"]
    specials = [t["id"] for t in p.tokens if "sp" in t["cls"]]
    assert tok.convert_tokens_to_ids("<|im_end|>") == known["ids"][-1] and specials[-1] == known["ids"][-1]
    assert tok.convert_tokens_to_ids("<|im_assistant|>") in specials
    assert set(specials) == {i for i in known["ids"] if i in tok.added_tokens_decoder}
    # token boundaries: the texts as drawn (newlines and tabs made visible) add up to the decoded sample
    drawn = "".join("" if "pend" in t["cls"] else t["text"] for t in p.tokens)
    decoded = tok.decode(known["ids"], skip_special_tokens=False)
    assert drawn == view.shown(decoded)
    # a character of k UTF-8 bytes is k byte tokens here: k - 1 drawn as pending, the character on the last
    sup = ["" if "pend" in t["cls"] else t["text"] for t in p.tokens if t["mask"] == 1]
    for ch in "ö日本":
        k = len(ch.encode())
        assert sup[sup.index(ch) - k + 1 : sup.index(ch)] == [""] * (k - 1), ch
    assert sup.count("") == 1 + 2 + 2
    assert "<script" not in page and "http" not in page.split("<body>")[1]  # self-contained


def test_token_texts_concatenate_to_the_decode_with_both_tokenizer_kinds(known):
    fast = view.load_tokenizer(known["tok_dir"])  # tokenizers.Tokenizer (tokenizer.json)
    texts = view.token_texts(fast, known["ids"])
    assert "".join(texts) == known["tok"].decode(known["ids"], skip_special_tokens=False)
    assert view.token_texts(known["tok"], known["ids"]) == texts  # a transformers tokenizer decodes the same
    assert view.special_ids(fast) == view.special_ids(known["tok"])
    assert texts[-1] == "<|im_end|>" and texts.count("") == 4 + 1  # 日, 本: 2 pending each; ö: 1


def test_terminal_plain_colour_and_table(known, capsys, monkeypatch):
    args = [str(known["path"]), "--index", "1", "--tokenizer", known["tok_dir"]]
    texts = view.token_texts(view.load_tokenizer(known["tok_dir"]), known["ids"])
    n, p = len(known["ids"]), known["prompt_len"]
    comp = "│".join(view.shown(t) for t in texts[p:])

    # plain (not a terminal): the supervised run inside ⟦ ⟧, tokens split by │
    assert view.main(args) == 0
    out = capsys.readouterr().out
    assert f"{n:,} tokens: {p:,} context (loss mask 0), {n - p:,} supervised (loss mask 1) in 1 span(s)" in out
    body = out.splitlines()[3:]
    assert re.findall(r"⟦(.*?)⟧", "\n".join(body), re.S) == [comp]
    assert "\x1b[" not in out
    # NO_COLOR wins over a terminal in auto mode
    monkeypatch.setenv("NO_COLOR", "1")
    assert not view._use_color("auto", type("T", (), {"isatty": lambda self: True})())
    monkeypatch.delenv("NO_COLOR")
    assert view._use_color("auto", type("T", (), {"isatty": lambda self: True})())

    # colour: the supervised tokens, and only they, on the green backgrounds
    assert view.main(args + ["--color", "always"]) == 0
    out = capsys.readouterr().out
    green = re.compile(r"\x1b\[[0-9;]*48;2;(?:183;228;199|143;211;168)m([^\x1b]*)\x1b\[0m")
    body = out.split("\n", 3)[3]  # after the two summary lines and the legend
    assert "".join(green.findall(body)) == "".join(view.shown(t) for t in texts[p:])
    assert " ▶ completion " in re.sub(r"\x1b\[[0-9;]*m", "", body)

    # table: one line per token, the mask column exact
    assert view.main(args + ["--table"]) == 0
    lines = capsys.readouterr().out.splitlines()[3:]
    assert len(lines) == n
    assert [int(line.split()[2]) for line in lines] == known["mask"]
    assert [int(line.split()[1]) for line in lines] == known["ids"]


def test_tokens_and_merged_files_and_errors(known, tmp_path, capsys):
    t = pq.read_table(known["path"]).to_pylist()
    # a merged file
    merged = [
        {k: r[k] for k in ("sample_id", "dataset", "input_ids", "loss_mask", "num_tokens")}
        | {"num_supervised": sum(r["loss_mask"]), "truncated": False}
        for r in reversed(t)
    ]
    mp = tmp_path / "merged.parquet"
    schemas.write_checked(schemas.from_rows(merged, schemas.MERGED), "merged", mp)
    row, idx, kind = view.load_row(mp, sample_id="known")
    assert (kind, idx, row["input_ids"], row["loss_mask"]) == ("merged", 0, known["ids"], known["mask"])
    dup = tmp_path / "dup.parquet"
    pq.write_table(pq.read_table(mp).take([0, 1, 0]), dup)  # breaks the unique-id contract
    with pytest.raises(
        ValueError, match=r"dup\.parquet: sample 'known' is in 2 rows \(\[0, 2\]\); choose one with --index"
    ):
        view.load_row(dup, sample_id="known")
    # a tokens file (with the reject columns) and a negative index
    tp = tmp_path / "tokens.parquet"
    schemas.write_checked(schemas.from_rows(t, schemas.TOKENS), "tokens", tp)
    row, idx, kind = view.load_row(tp, index=-1)
    assert (kind, idx, row["sample_id"]) == ("tokens", 1, "known")
    # errors name the file; the command exits 2 with the message
    assert view.main([str(tp), "--index", "5", "--tokenizer", known["tok_dir"]]) == 2
    assert "tokens.parquet: row index 5 out of range (the file has 2 rows)" in capsys.readouterr().err
    assert view.main([str(tp), "--sample", "nope", "--tokenizer", known["tok_dir"]]) == 2
    assert "no sample 'nope'" in capsys.readouterr().err
    bad = tmp_path / "prompts.parquet"
    schemas.write_checked(schemas.from_rows([], schemas.PROMPTS), "prompts", bad)
    with pytest.raises(ValueError, match=r"prompts\.parquet: no input_ids/loss_mask columns"):
        view.load_row(bad)


def test_tokenizer_from_the_config(known, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="pass --tokenizer DIR"):
        view.resolve_tokenizer()
    (tmp_path / "config.yaml").write_text(json.dumps({"target": {"path": known["tok_dir"], "trust_remote_code": True}}))
    assert view.resolve_tokenizer() == (known["tok_dir"], True)
    (tmp_path / "other.yaml").write_text(json.dumps({"target": {"path": "results/target/x"}}))
    with pytest.raises(FileNotFoundError, match="target.path results/target/x of other.yaml does not exist"):
        view.resolve_tokenizer(config="other.yaml")
    assert view.resolve_tokenizer("some/dir") == ("some/dir", True)


def test_long_context_is_shortened_and_examples_spread_over_lengths(known, tmp_path):
    tok = view.load_tokenizer(known["tok_dir"])
    row, _, _ = view.load_row(known["path"], sample_id="known")
    v = view.sample_view(row, tok)
    p = known["prompt_len"]
    pieces = view._elided(v, 5)
    assert pieces == [("tokens", 0, 5), ("gap", 5, p - 5), ("tokens", p - 5, p), ("tokens", p, len(v.ids))]
    spans = _spans(view.html_page([v], title="x", context=5))
    assert [t["i"] for t in spans.tokens] == list(range(5)) + list(range(p - 5, len(v.ids)))
    assert f"… {p - 10:,} context tokens not shown …" in view.render_plain(v, context=5)

    out = tmp_path / "ex.html"
    shown_ids = view.write_examples([known["path"]], out, dataset="ds", tokenizer=tok, n=3)
    assert shown_ids == ["other", "known"]  # 2 rows: both, shortest first
    page = out.read_text()
    assert page.count('<div class="tokens">') == 2 and "2 validated samples of ds" in page
    assert view.pick_examples([known["path"]], 1) == [(str(known["path"]), "known")]  # the median of 2
