"""Checks before any job runs (eagle3_data.runtime.prerun): a target without a loadable tokenizer or chat template, a draft
vocabulary larger than the target's, a launch.python that does not exist, a SLURM account variable left unset.
Each is one line naming the key, at parse time (a dry run too: tests/workflow/test_prerun_dry_run.py), before
anything is paid for."""

from __future__ import annotations

import json
import sys

import pytest


from eagle3_data.runtime import prerun
from eagle3_data.config import ConfigError


def _config(target_path, **extra) -> dict:
    cfg = {
        "target": {"name": "t", "path": str(target_path), "template": "qwen3"},
        "vocab": {"draft_vocab_size": 256},
        "backends": {},
        "datasets": {},
    }
    cfg.update(extra)
    return cfg


def test_missing_target_path_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        prerun.check_target(_config(tmp_path / "no-such-model"), tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Config error: target.path: ") and "does not exist" in msg
    assert str(tmp_path / "no-such-model") in msg
    assert "`hf download <repo> --local-dir <dir>`" in msg  # the CLI the README uses


def test_target_without_tokenizer_or_chat_template(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 300}))
    with pytest.raises(ConfigError, match="has no tokenizer"):
        prerun.check_target(_config(d), tmp_path / "cache")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ConfigError, match="has no chat template"):
        prerun.check_target(_config(d), tmp_path / "cache")


def test_target_that_loads_is_checked_once(tmp_path):
    from eagle3_data.testing.tokenizer_fixtures import save_fixture

    d = tmp_path / "qwen"
    save_fixture("qwen3", d)
    cache = tmp_path / "cache"
    prerun.check_target(_config(d), cache)
    stamps = list((cache / "checks").glob("target-*.ok"))
    assert len(stamps) == 1
    # a damaged tokenizer.json: its size/mtime changed, so it is loaded again and the load's error is one line
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        prerun.check_target(_config(d), cache)
    assert "\n" not in str(e.value) and "cannot load the target tokenizer" in str(e.value)
    assert len(list((cache / "checks").glob("target-*.ok"))) == 1


def test_tiny_target_not_built_yet_is_not_checked(tmp_path):
    cfg = _config(tmp_path / "results/target/tiny")
    cfg["target"]["build_tiny"] = True
    prerun.check_target(cfg, tmp_path / "cache")  # the build makes it


def test_draft_vocab_larger_than_the_target_vocabulary(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 272}}))
    prerun.check_draft_vocab(_config(d))  # 256 <= 272
    with pytest.raises(ConfigError) as e:
        prerun.check_draft_vocab(_config(d, vocab={"draft_vocab_size": 32000}))
    assert str(e.value) == (
        f"Config error: vocab.draft_vocab_size is 32,000, larger than the target's vocabulary "
        f"(272 tokens, vocab_size of {d}/config.json); set it to at most 272."
    )


def test_launch_python_that_does_not_exist(tmp_path):
    cfg = _config(
        tmp_path,
        backends={
            "local": {
                "type": "sglang",
                "base_url": "http://127.0.0.1:{port}/v1",
                "model": "m",
                "launch": {"command": "python -m x", "python": str(tmp_path / "venv-gone")},
            }
        },
        generation={"backends": ["local"]},
        datasets={"d": {"source": {"format": "sharegpt", "path": "x"}}},
    )
    with pytest.raises(ConfigError) as e:
        prerun.check_launch_python(cfg)
    assert str(e.value).startswith(
        f"Config error: backends.local.launch.python: {tmp_path / 'venv-gone'} does not exist"
    ) and "\n" not in str(e.value)
    cfg["backends"]["local"]["launch"]["python"] = sys.executable
    prerun.check_launch_python(cfg)


def test_unset_variable_in_a_cluster_resource():
    res = {"slurm_account": "$EAGLE3_SLURM_ACCOUNT", "slurm_partition": "cpu"}
    prerun.check_resources(res, environ={"EAGLE3_SLURM_ACCOUNT": "proj"})
    with pytest.raises(ConfigError) as e:
        prerun.check_resources(res, environ={})
    assert "slurm_account" in str(e.value) and "export EAGLE3_SLURM_ACCOUNT=" in str(e.value)
    assert "\n" not in str(e.value)


def test_export_layouts_the_configured_states_cannot_serve(tmp_path):
    """A layout whose final-state form or drafter layers the configured extraction would not store is refused
    before any job, naming the setting (the issue: speculators found it only after extraction)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 64, "vocab_size": 300}))

    def cfg(extract=None, layouts=()):
        return _config(d, extract=extract or {}, export={"layouts": list(layouts)})

    prerun.check_export_layouts(cfg(layouts=["specforge", "speculators", "speculators_fp8", "modelopt"]))  # both
    with pytest.raises(ConfigError) as e:
        prerun.check_export_layouts(cfg({"final_norm": "post"}, ["specforge", "speculators"]))
    assert str(e.value) == (
        "Config error: export.layouts: speculators reads pre-norm final states, but "
        "extract.final_norm: post stores post-norm ones only; set extract.final_norm: both (the "
        "default: every layout from one extraction) or pre"
    )
    with pytest.raises(ConfigError, match="modelopt reads post-norm final states.*extract.final_norm: both"):
        prerun.check_export_layouts(cfg({"final_norm": "pre"}, ["modelopt"]))
    with pytest.raises(
        ConfigError,
        match=r"specforge_dflash reads DFlash's target layers, which extract.drafters "
        r"\['eagle3'\] does not capture; add dflash to extract.drafters",
    ):
        prerun.check_export_layouts(cfg(layouts=["specforge", "specforge_dflash"]))
    prerun.check_export_layouts(cfg({"drafters": ["eagle3", "dspark"]}, ["specforge_dflash", "specforge_dspark"]))
    with pytest.raises(ConfigError, match="reads EAGLE-3's auxiliary layers.*add eagle3"):
        prerun.check_export_layouts(cfg({"drafters": ["dflash"]}, ["speculators"]))
    with pytest.raises(ConfigError, match="sglang stores post-norm final states only.*extract.final_norm: post"):
        prerun.check_export_layouts(cfg({"backend": "sglang"}))
    with pytest.raises(ConfigError, match="speculators reads pre-norm.*extract.backend: transformers"):
        prerun.check_export_layouts(cfg({"backend": "sglang", "final_norm": "post"}, ["speculators"]))
    # the drafters' layers against the target's config.json: five DFlash layers do not fit a 2-layer target
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    with pytest.raises(ConfigError) as e:
        prerun.check_export_layouts(cfg({"drafters": ["dflash"]}))
    assert str(e.value).startswith(
        "Config error: extract.dflash_layers: 5 DFlash layers of a 2-layer target give ids "
        "[1, 0, 0, 0, -1] outside [0, 1]"
    ) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="extract layer 9 is outside the target's decoder layers"):
        prerun.check_export_layouts(cfg({"drafters": ["dspark"], "dflash_layers": [1, 9]}))
