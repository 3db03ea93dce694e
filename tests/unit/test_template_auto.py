"""``target.template: auto``: the family found from the target's own chat template, refusals naming the property,
named families as overrides, and the on-disk cache that keeps ``snakemake -n`` from loading transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_data.testing import tokenizer_fixtures as F
from eagle3_data import config as cfg
from eagle3_data.templates import TemplateError
from eagle3_data.templates.auto import cache_key, detect_family, resolve_template

REAL = {  # fixture: (tokenizer, chat_template_kwargs, the family auto must pick)
    "qwen3": (lambda: F.qwen3_real("qwen3"), {}, "qwen3"),
    "qwen3 thinking off": (lambda: F.qwen3_real("qwen3"), {"enable_thinking": False}, "qwen3"),
    "qwen3-2507": (lambda: F.qwen3_real("qwen3-thinking-2507"), {}, "qwen3"),
    "qwen3-coder": (lambda: F.qwen3_real("qwen3-coder"), {}, "qwen3-coder"),
    "deepseek-r1": (F.deepseek_real, {}, "deepseek-r1"),
    "deepseek-v3.1": (F.deepseek_v31, {}, "deepseek-v3.1"),
    "deepseek-v3.1 thinking": (F.deepseek_v31, {"thinking": True}, "deepseek-v3.1"),
    "gpt-oss": (F.gpt_oss_real, {}, "gpt-oss"),
    "llama-3.1": (F.llama3_standin, {}, "llama3"),
    "kimi-k2-thinking": (lambda: F.kimi_real_template("kimi-k2-thinking"), {}, "kimi-k2-thinking"),
    "kimi-k2-instruct": (lambda: F.kimi_real_template("kimi-k2-instruct"), {}, "kimi-k2"),
    "kimi-k25": (F.kimi_k25, {}, "kimi-k25"),
    "kimi-k26 thinking off": (F.kimi_k26, {"thinking": False}, "kimi-k25"),
    "glm-4.5 (official layout)": (F.glm45, {}, "glm45"),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_auto_picks_the_family_of_each_real_template(name):
    tok, kwargs, family = REAL[name]
    info = detect_family(tok(), kwargs)
    assert info["family"] == family
    want_field = {"gpt-oss": "thinking"}.get(family, "reasoning_content")
    assert info["reasoning_field"] in (None, want_field)
    if family == "gpt-oss":
        assert info["reasoning_field"] == "thinking" and info["generation_prompt"] == "<|start|>assistant"


def test_auto_refuses_naming_the_property_that_failed():
    # llama.cpp's copy of GLM-4.5's template writes argument pairs without GLM's own newlines
    with pytest.raises(TemplateError, match="property 'tool-call layout' failed"):
        detect_family(F.glm45_real_template())
    # a generation prompt the finished conversation does not start with
    bad = F.build_fixture_tokenizer(
        F.QWEN3_SPECIALS,
        F.QWEN3_NON_SPECIAL,
        F.chat_template("qwen3").replace(
            "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\nSure: ' }}"
        ),
        eos="<|im_end|>",
    )
    with pytest.raises(TemplateError, match="property 'prefix' failed"):
        detect_family(bad)
    # a Qwen-layout template that writes another think spacing than Qwen3's
    odd = F.build_fixture_tokenizer(
        F.QWEN3_SPECIALS,
        F.QWEN3_NON_SPECIAL,
        F.chat_template("qwen3").replace("'\\n</think>\\n\\n'", "'</think>'"),
        eos="<|im_end|>",
    )
    with pytest.raises(TemplateError, match="property 'think markers' failed"):
        detect_family(odd)


def test_a_named_family_is_an_override(tmp_path):
    d = F.save_deepseek_dir(tmp_path / "v31", template="deepseek-v3.1")
    assert resolve_template({"path": d, "template": "deepseek-r1"}) == (
        "deepseek-r1",
        {"family": "deepseek-r1", "source": "named"},
    )
    assert resolve_template({"path": d, "template": "auto"})[0] == "deepseek-v3.1"


def test_the_resolution_is_cached_and_a_cache_hit_imports_no_transformers(tmp_path):
    d = F.save_deepseek_dir(tmp_path / "v31", template="deepseek-v3.1")
    target = {"path": d, "template": "auto", "chat_template_kwargs": {"thinking": True}}
    fam, info = resolve_template(target, tmp_path / "cache")
    assert (fam, info["source"]) == ("deepseek-v3.1", "probed")
    assert info["generation_prompt"] == "<｜Assistant｜><think>"
    stored = json.loads((tmp_path / "cache" / "template_family" / f"{cache_key(target)}.json").read_text())
    assert stored["family"] == "deepseek-v3.1"
    code = (
        "import sys, time; t = time.process_time(); from eagle3_data.templates.auto import resolve_template; "
        f"f, i = resolve_template({target!r}, {str(tmp_path / 'cache')!r}); "
        "print(f, i['source'], 'transformers' in sys.modules, time.process_time() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == ["deepseek-v3.1", "cache", "False"], out
    assert float(out[3]) < 1.0  # CPU seconds, imports included (a probe: transformers + tokenizer, ~2.5 s)
    # another template file or other kwargs: another key, probed again
    assert cache_key({**target, "chat_template_kwargs": {}}) != cache_key(target)
    cfg_file = tmp_path / "v31" / "tokenizer_config.json"
    conf = json.loads(cfg_file.read_text())
    conf["chat_template"] = F.chat_template("deepseek-r1")
    key = cache_key(target)
    cfg_file.write_text(json.dumps(conf, ensure_ascii=False))
    assert cache_key(target) != key
    assert resolve_template(target, tmp_path / "cache")[0] == "deepseek-r1"


def test_config_check_replaces_auto_and_says_which_was_chosen(tmp_path):
    d = F.save_deepseek_dir(tmp_path / "v31", template="deepseek-v3.1")
    config = {"cache_dir": str(tmp_path / "cache"), "target": {"name": "t", "path": d, "template": "auto"}}
    line = cfg.resolve_target_template(config)
    assert config["target"]["template"] == "deepseek-v3.1"
    assert line.startswith(
        "target.template: auto -> deepseek-v3.1 (probed; generation prompt '<｜Assistant｜></think>'"
    )
    config["target"]["template"] = "deepseek-r1"
    assert cfg.resolve_target_template(config) is None and config["target"]["template"] == "deepseek-r1"
    tiny = {"target": {"name": "t", "path": str(tmp_path / "absent"), "template": "auto", "build_tiny": True}}
    assert "kimi-k25" in cfg.resolve_target_template(tiny) and tiny["target"]["template"] == "kimi-k25"
    with pytest.raises(cfg.ConfigError, match="does not exist"):
        cfg.resolve_target_template({"target": {"name": "t", "path": str(tmp_path / "absent")}})
    glm = tmp_path / "glm"
    F.glm45_real_template().save_pretrained(str(glm))
    with pytest.raises(cfg.ConfigError, match="property 'tool-call layout' failed"):
        cfg.resolve_target_template({"target": {"name": "t", "path": str(glm), "template": "auto"}})
