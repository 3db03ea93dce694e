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


def _schema_keys() -> list[str]:
    rows = cfg.schema_reference(yaml.safe_load(SCHEMA.read_text())).splitlines()[2:]
    return [r.split("|")[1].strip().strip("`") for r in rows]


def test_every_config_key_says_what_its_change_reruns():
    """RERUNS covers every leaf key of the schema (objects are covered through their keys), and names no key
    the schema doesn't have; the README's table is rendered from it."""
    keys = _schema_keys()
    parents = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    leaves = [k for k in keys if k not in parents]
    missing = [k for k in leaves if cfg.reruns_of(k) is None]
    assert missing == [], f"add these to config.RERUNS: {missing}"
    for entry, _ in cfg.RERUNS:
        prefix = entry[:-2] if entry.endswith(".*") else entry
        assert prefix in keys, f"config.RERUNS names {entry!r}, which the schema doesn't have"
    # transport settings rerun nothing; data settings name the stages
    assert cfg.reruns_of("backends.<name>.max_concurrency") == cfg.NOTHING
    assert cfg.reruns_of("backends.<name>.launch.command") .startswith(cfg.NOTHING)
    assert cfg.reruns_of("datasets.<name>.generation.max_retries") == cfg.NOTHING
    assert cfg.reruns_of("datasets.<name>.generation.temperature") == "as generation.<key>, for that dataset only"
    assert "extract" in cfg.reruns_of("merge.max_len")
    readme = (ROOT / "README.md").read_text()
    assert cfg.reruns_table() in readme, "run: python -m eagle3_data.config README.md"


def test_rule_params_leave_out_transport_settings():
    """The slices the rules pass as params don't move when a transport setting does."""
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    before = {ds: (cfg.generation_data_settings(c, ds), cfg.backends_data_settings(c, ds))
              for ds in cfg.generated_datasets(c)}
    other = yaml.safe_load(yaml.safe_dump(c))
    b = other["backends"]["tiny_local"]
    b.update(max_concurrency=99, timeout_s=1, requests_per_minute=5, tokens_per_minute=9, api_key_env="X",
             headers={"X-Title": "t"})
    b["launch"]["command"] += " --verbose"
    other["generation"].update(max_retries=0, retry_initial_s=9.0)
    after = {ds: (cfg.generation_data_settings(other, ds), cfg.backends_data_settings(other, ds))
             for ds in cfg.generated_datasets(other)}
    assert after == before
    other["backends"]["tiny_local"]["extra_body"] = {"top_k": 3}  # shapes requests: a data setting
    assert cfg.backends_data_settings(other, "sharegpt_demo") != before["sharegpt_demo"][1]
    e = yaml.safe_load(yaml.safe_dump(c))
    e["extract"].update(device="cpu", batch_tokens=7, gpu_lock_dir="/x")
    assert cfg.extract_state_settings(e) == cfg.extract_state_settings(c)
    e["merge"].update(memory_mb=999, threads=7)
    assert cfg.merge_data_settings(e) == cfg.merge_data_settings(c)
