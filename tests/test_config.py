"""Config: the shipped configs validate, slices per rule, and the README's reference matches the schema."""

from __future__ import annotations

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from conftest import ROOT
from eagle3_data import config as cfg

SCHEMA = ROOT / "schemas" / "config.schema.yaml"


@pytest.mark.parametrize("path", ["config.yaml", "resources/configs/seed-kimi-k25.yaml"])
def test_shipped_configs_validate(path):
    validate(yaml.safe_load((ROOT / path).read_text()), str(SCHEMA))


def test_seed_config_has_the_seed_datasets():
    c = yaml.safe_load((ROOT / "resources/configs/seed-kimi-k25.yaml").read_text())
    assert len(cfg.datasets(c)) == 10
    assert cfg.pretokenized_datasets(c) == ["A1_deepswekimi", "A2_kimik25"]
    assert list(cfg.backends_config(c, "B3_magicoder")) == ["sglang_local", "openrouter"]
    assert cfg.generation_config(c, "B8_sweagent")["budget_completion_tokens"] == 10_000_000


def test_generation_slice_merges_defaults_and_dataset_overrides():
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    g = cfg.generation_config(c, "sweagent_demo")
    assert g["max_tokens"] == c["datasets"]["sweagent_demo"]["generation"]["max_tokens"] != c["generation"]["max_tokens"]
    assert g["temperature"] == c["generation"]["temperature"]
    assert c["generation"]["max_tokens"] == 256, "the defaults are not modified by the merge"


def test_unknown_backend_and_merge_dataset_name_the_key():
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    c["datasets"]["ultrachat_demo"]["generation"] = {"backends": ["nope"]}
    with pytest.raises(KeyError, match="datasets.ultrachat_demo.generation.backends: unknown backend 'nope'"):
        cfg.backends_config(c, "ultrachat_demo")
    c["merge"]["datasets"] = ["missing"]
    with pytest.raises(KeyError, match=r"merge.datasets: unknown dataset\(s\) \['missing'\]"):
        cfg.merge_datasets(c)


def test_bad_value_error_names_the_key():
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    c["backends"]["tiny_local"]["max_concurrency"] = 0
    with pytest.raises(WorkflowError, match=r"(?s)0 is less than the minimum of 1.*\['backends'\]\['tiny_local'\]\['max_concurrency'\]"):
        validate(c, str(SCHEMA))


def test_readme_config_reference_matches_the_schema():
    readme = (ROOT / "README.md").read_text()
    schema = yaml.safe_load(SCHEMA.read_text())
    assert cfg.readme_with_reference(readme, schema) == readme, "run: python -m eagle3_data.config README.md"
    for key in ("merge.max_len", "backends.<name>.api_key_env", "datasets.<name>.source.format"):
        assert f"| `{key}` |" in readme


def test_cross_key_checks_name_the_key(tmp_path):
    base = yaml.safe_load((ROOT / "config.yaml").read_text())

    def err(mutate) -> str:
        c = yaml.safe_load(yaml.safe_dump(base))
        mutate(c)
        with pytest.raises(ValueError) as info:
            cfg.check_config(c, check_paths=False)
        return str(info.value)

    assert err(lambda c: c["generation"].__setitem__("backends", ["tiny_locl"])) == (
        "generation.backends: unknown backend 'tiny_locl'; defined: ['tiny_local']")
    assert err(lambda c: c["merge"].__setitem__("max_samples", {"nosuch": 3})).startswith(
        "merge.max_samples: unknown dataset(s) ['nosuch']")
    assert err(lambda c: c["plan"].__setitem__("drop", ["nosuch"])).startswith("plan.drop: unknown dataset(s) ['nosuch']")
    c = yaml.safe_load(yaml.safe_dump(base))
    c["datasets"]["ultrachat_demo"]["source"]["path"] = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"datasets.ultrachat_demo.source.path: .*nope.jsonl does not exist"):
        cfg.check_config(c)
