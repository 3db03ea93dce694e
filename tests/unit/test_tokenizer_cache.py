"""The on-disk cache of loaded target tokenizers (eagle3_data.templates.tokenizer_cache): a second load of the same directory
comes from the cache and encodes and renders exactly like the first; an edited tokenizer file is a miss; the cache
can be turned off, and a directory open to others is never read."""

from __future__ import annotations

import json
import os

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data.templates import tokenizer_cache as tc
from eagle3_data.templates import load_target_tokens

TEXT = "Hello world, 2 + 2 = 4.\n\n  indented line\t東京 café <think>x</think>"
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]


def _entries(d):
    return sorted(p.name for p in d.iterdir() if p.suffix == ".pkl")


def test_second_load_comes_from_the_cache_and_is_identical(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(tc.CACHE_ENV, str(cache))
    path = F.save_fixture("qwen3", tmp_path / "tok")
    first = load_target_tokens(path, "qwen3")
    assert len(_entries(cache)) == 1
    calls = []
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: calls.append(a))
    second = load_target_tokens(path, "qwen3")
    assert calls == []  # not loaded from the directory again
    assert second.tok.encode(TEXT, add_special_tokens=False) == first.tok.encode(TEXT, add_special_tokens=False)
    assert second.render(MSGS, None) == first.render(MSGS, None)
    assert (second.vocab_size, second.eot_id, second.think_open_id) == (
        first.vocab_size,
        first.eot_id,
        first.think_open_id,
    )
    assert oct(cache.stat().st_mode & 0o777) == "0o700"


def test_an_edited_tokenizer_file_is_a_miss(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(tc.CACHE_ENV, str(cache))
    path = F.save_fixture("qwen3", tmp_path / "tok")
    key = tc.cache_key(path, "qwen3", False)
    load_target_tokens(path, "qwen3")
    jinja = tmp_path / "tok" / "chat_template.jinja"  # where transformers saves the template, else the config
    if jinja.is_file():
        jinja.write_text("{{ 'edited' }}")
    else:
        cfg = tmp_path / "tok" / "tokenizer_config.json"
        data = json.loads(cfg.read_text())
        data["chat_template"] = "{{ 'edited' }}"
        cfg.write_text(json.dumps(data))
    (tmp_path / "tok" / "model.safetensors").write_bytes(b"weights are never read")
    new_key = tc.cache_key(path, "qwen3", False)
    assert new_key != key
    assert tc.cache_key(path, "qwen3", True) != new_key  # trust_remote_code is part of the key
    assert load_target_tokens(path, "qwen3").tok.chat_template == "{{ 'edited' }}"
    assert _entries(cache) == sorted([f"{key}.pkl", f"{new_key}.pkl"])


def test_cache_off_and_unsafe_directories(tmp_path, monkeypatch):
    path = F.save_fixture("qwen3", tmp_path / "tok")
    monkeypatch.setenv(tc.CACHE_ENV, "off")
    assert tc.cache_dir() is None
    load_target_tokens(path, "qwen3")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    monkeypatch.setenv(tc.CACHE_ENV, str(open_dir))
    assert tc.cache_dir() is None  # writable by others: never unpickled from
    load_target_tokens(path, "qwen3")
    assert _entries(open_dir) == []


def test_an_unreadable_entry_is_replaced(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(tc.CACHE_ENV, str(cache))
    path = F.save_fixture("qwen3", tmp_path / "tok")
    cache.mkdir(mode=0o700)
    entry = cache / f"{tc.cache_key(path, 'qwen3', False)}.pkl"
    entry.write_bytes(b"truncated")
    tt = load_target_tokens(path, "qwen3")
    assert tt.tok.encode("Hello", add_special_tokens=False)
    assert entry.stat().st_size > 1000


def test_entries_store_bpe_merges_as_strings_and_rebuild_the_same_tokenizer():
    import pickle

    tok = F.qwen3()  # byte-level BPE: no raw space in any merge part
    backend = tok.backend_tokenizer
    text = tc.backend_json(backend)
    merges = json.loads(text)["model"]["merges"]
    assert merges and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)
    assert [m.split(" ") for m in merges] == json.loads(backend.to_str())["model"]["merges"]
    again = pickle.loads(tc.dumps(tok))
    assert again.backend_tokenizer.to_str() == backend.to_str()
    assert again.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT, add_special_tokens=False)
    assert again.chat_template == tok.chat_template and len(again) == len(tok)


def test_merges_with_a_space_keep_the_pair_form():
    from tokenizers import Tokenizer, models

    t = Tokenizer(models.BPE({"a": 0, " ": 1, "a ": 2, "b": 3, "ab": 4}, [("a", " "), ("a", "b")]))
    assert tc.backend_json(t) == t.to_str()  # "a  " would not split back into ("a", " ")


def test_lazy_target_answers_from_the_facts_and_loads_only_to_decode(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(tc.CACHE_ENV, str(cache))
    path = F.save_fixture("qwen3", tmp_path / "tok")
    assert tc.cached_facts(path, "qwen3", False) is None
    first = load_target_tokens(path, "qwen3", lazy=True)  # nothing cached yet: a full load, which stores the facts
    assert not isinstance(first.tok, tc.LazyTokenizer)
    assert tc.cached_facts(path, "qwen3", False)["len"] == len(first.tok)
    loads = []
    real_load = tc.pickle.load
    monkeypatch.setattr(tc.pickle, "load", lambda fh: loads.append(1) or real_load(fh))
    lazy = load_target_tokens(path, "qwen3", lazy=True)
    assert isinstance(lazy.tok, tc.LazyTokenizer) and not lazy.tok.loaded
    for attr in (
        "vocab_size",
        "eot_id",
        "tool_eot_id",
        "end_ids",
        "think_open_id",
        "think_close_id",
        "role_marker_ids",
        "boundary_names",
    ):
        assert getattr(lazy, attr) == getattr(first, attr), attr
    assert lazy.tok.all_special_ids == first.tok.all_special_ids
    assert lazy.special_id("<|im_start|>") == first.special_id("<|im_start|>")
    assert loads == [] and not lazy.tok.loaded
    ids = first.encode_texts(["Hello world <think>"])[0]
    assert lazy.decode_batch([ids]) == first.decode_batch([ids])  # a decode loads the tokenizer, from the cache
    assert lazy.tok.loaded and loads == [1]
    assert lazy.tok.convert_ids_to_tokens(ids) == first.tok.convert_ids_to_tokens(ids)
