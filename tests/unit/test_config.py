"""Config: slices per rule, and the README's reference matches the schema. That every shipped config validates is
tests/workflow/test_shipped_configs.py's (one case each, with its dry run)."""

from __future__ import annotations

import copy

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from eagle3_data.testing.workflow import ROOT
from eagle3_data import config as cfg
from eagle3_data import settings as stage_settings
from eagle3_data.settings import ExtractSettings, MergeSettings
from eagle3_data.config import docgen
from eagle3_data.backends.limits import jobs_using

SCHEMA = cfg.SCHEMA_PATH


@pytest.mark.parametrize("path", ["resources/configs/openrouter.yaml", "resources/configs/sglang-local.yaml"])
def test_minimal_configs_are_one_dataset_on_the_bundled_samples(path):
    c = yaml.safe_load((ROOT / path).read_text())
    assert len(c["datasets"]) == 1
    (ds,) = c["datasets"].values()
    assert (ROOT / ds["source"]["path"]).exists() and ds["source"]["path"].startswith("resources/samples/")
    assert "CHANGE" in (ROOT / path).read_text()
    assert not {"cache_dir", "validate", "plan", "vocab", "export"} & set(c), "defaults are left out"


def test_defaults_fill_every_section_and_match_the_documented_values():
    schema = cfg.load_schema(SCHEMA)
    c = {
        "target": {"name": "t", "path": "p", "template": "kimi-k25"},
        "datasets": {"d": {"source": {"format": "pretokenized", "path": "x.jsonl"}}},
    }
    cfg.validate_config(c, schema)
    assert c["cache_dir"] == "cache" and c["backends"] == {}
    assert c["datasets"]["d"]["shards"] == 1
    assert c["generation"] == {
        "mode": "last",
        "extra_body": {},
        "max_retries": 5,
        "retry_initial_s": 1.0,
        "retry_max_s": 60.0,
        "max_samples": None,
        "budget_completion_tokens": None,
        "budget_usd": None,
        "stop_grace_s": 10.0,
        "reject_other_models": False,
        "unpaid_failures": "rerun",
        "max_prompt_bytes": 4000000,
    }
    assert c["validate"] == {
        "max_reject_rate": 0.25,
        "keep_truncated": False,
        "max_tokens": None,
        "count_tolerance": {"per_sample_abs": 3, "per_sample_rel": 0.02, "aggregate_rel": None},
    }
    assert c["merge"] == {
        "datasets": None,
        "max_samples": {},
        "max_len": 32768,
        "overflow": "truncate",
        "seed": 0,
        "shards": 1,
        "heldout": 0.0,
        "memory_mb": 4000,
        "threads": 2,
    }
    assert c["normalize"] == {"max_reject_rate": 0.5, "duplicate_prompts": "drop"}
    assert c["extract"]["dtype"] == "bfloat16" and c["extract"]["gpus_per_job"] == 1
    assert c["export"]["layouts"] == [] and c["plan"]["tokens_per_s_per_gpu"] is None
    assert c["vocab"]["draft_vocab_size"] == 32000
    assert "tiny" not in c["target"]
    # a dataset's own generation section gets no defaults: it must not mask the top-level values
    c2 = {
        "target": {"name": "t", "path": "p", "template": "kimi-k25"},
        "backends": {"b": {"type": "openai", "base_url": "http://h/v1", "model": "m", "launch": {"command": "serve"}}},
        "generation": {"backends": ["b"], "max_retries": 9, "mode": "all"},
        "datasets": {"d": {"source": {"format": "sharegpt", "path": "x"}, "generation": {"max_tokens": 5}}},
    }
    cfg.validate_config(c2, schema)
    assert c2["datasets"]["d"]["generation"] == {"max_tokens": 5}
    assert cfg.generation_config(c2, "d")["max_retries"] == 9 and cfg.generation_config(c2, "d")["mode"] == "all"
    assert c2["backends"]["b"]["max_concurrency"] == 8 and c2["backends"]["b"]["launch"]["port"] == "auto"
    # defaults are copies: filling two configs never shares a mutable default
    a = copy.deepcopy(c)
    cfg.validate_config(a, schema)
    a["merge"]["max_samples"]["d"] = 1
    assert c["merge"]["max_samples"] == {}


def _error(mutate, files=None) -> str:
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    mutate(c)
    with pytest.raises(cfg.ConfigError) as info:
        cfg.validate_config(c, cfg.load_schema(SCHEMA), files=files if files is not None else [("config.yaml", c)])
    return str(info.value)


def test_config_errors_are_short_and_say_did_you_mean():
    def typo(c):
        c["generation"]["max_token"] = c["generation"].pop("max_tokens")

    assert _error(typo) == (
        "Config error in config.yaml: generation.max_token: unknown key; did you mean generation.max_tokens?"
    )
    assert _error(lambda c: c["merge"].__setitem__("max_len", "long")) == (
        "Config error in config.yaml: merge.max_len: 'long' is not of type 'integer'"
    )

    def source_typo(c):
        c["datasets"]["sharegpt_demo"]["sources"] = c["datasets"]["sharegpt_demo"].pop("source")

    # the misspelt key is one problem, not also "missing key source"
    assert _error(source_typo) == (
        "Config error in config.yaml: datasets.sharegpt_demo.sources: unknown key; "
        "did you mean datasets.sharegpt_demo.source?"
    )
    assert _error(lambda c: c["target"].__setitem__("template", "kimi-k2.5")).endswith(
        "target.template: 'kimi-k2.5' is not one of auto, kimi-k2, kimi-k2-thinking, kimi-k25, qwen3, qwen3-coder, "
        "glm45, deepseek-r1, deepseek-v3.1, gpt-oss, llama3, generic; did you mean kimi-k25?"
    )
    assert _error(lambda c: c["generation"].__setitem__("shards", 2)).endswith(
        "generation.shards: unknown key here; shards is a key of datasets.<name>, merge"
    )
    assert _error(lambda c: c.pop("target")) == (
        "Config error in config.yaml: missing top-level key target (it has no default)"
    )
    # a file of extra keys given alone (the shipped decontamination overlay): said once, with how to layer it
    assert _error(lambda c: (c.pop("target"), c.pop("datasets"))) == (
        "Config error in config.yaml: missing top-level keys target, datasets (they have no default); a file "
        "that only adds keys is layered over a whole config, named first: --configfile config.yaml <this file>"
    )
    several = _error(lambda c: (typo(c), c["merge"].__setitem__("max_len", "x")))
    assert several.splitlines() == [
        "Config error in config.yaml:",
        "  generation.max_token: unknown key; did you mean generation.max_tokens?",
        "  merge.max_len: 'x' is not of type 'integer'",
    ]


def test_config_error_names_the_file_that_set_the_key_and_never_a_key_value():
    over = {"merge": {"max_len": "long"}}
    base = yaml.safe_load((ROOT / "config.yaml").read_text())
    msg = _error(lambda c: c["merge"].__setitem__("max_len", "long"), files=[("config.yaml", base), ("my.yaml", over)])
    assert msg.startswith("Config error in my.yaml: merge.max_len")
    secret = "sk-or-v1-0123456789abcdef"
    msg = _error(lambda c: c["backends"]["tiny_local"].__setitem__("api_key_env", secret))
    assert secret not in msg and "backends.tiny_local.api_key_env" in msg and "NAME of an environment variable" in msg


def test_seed_config_has_the_seed_datasets():
    c = yaml.safe_load((ROOT / "resources/configs/seed-kimi-k25.yaml").read_text())
    assert len(cfg.datasets(c)) == 10
    assert cfg.pretokenized_datasets(c) == ["A1_deepswekimi", "A2_kimik25"]
    assert list(cfg.backends_config(c, "B3_magicoder")) == ["sglang_local", "openrouter"]
    assert cfg.generation_config(c, "B8_sweagent")["budget_completion_tokens"] == 10_000_000


def test_generation_slice_merges_defaults_and_dataset_overrides():
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    g = cfg.generation_config(c, "sweagent_demo")
    assert (
        g["max_tokens"] == c["datasets"]["sweagent_demo"]["generation"]["max_tokens"] != c["generation"]["max_tokens"]
    )
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
    with pytest.raises(
        WorkflowError, match=r"(?s)0 is less than the minimum of 1.*\['backends'\]\['tiny_local'\]\['max_concurrency'\]"
    ):
        validate(c, str(SCHEMA))


def test_docs_config_reference_matches_the_schema():
    doc = (ROOT / "docs" / "config.md").read_text()
    schema = yaml.safe_load(SCHEMA.read_text())
    assert docgen.with_generated_tables(doc, schema) == doc, "run: python -m eagle3_data.config.docgen"
    for key in ("merge.max_len", "backends.<name>.api_key_env", "datasets.<name>.source.format"):
        assert f"| `{key}` |" in doc


def test_cross_key_checks_name_the_key(tmp_path):
    base = yaml.safe_load((ROOT / "config.yaml").read_text())

    def err(mutate) -> str:
        c = yaml.safe_load(yaml.safe_dump(base))
        mutate(c)
        with pytest.raises(ValueError) as info:
            cfg.check_config(c, check_paths=False)
        return str(info.value)

    assert err(lambda c: c["generation"].__setitem__("backends", ["tiny_locl"])) == (
        "generation.backends: unknown backend 'tiny_locl'; defined: ['tiny_local']"
    )
    assert err(lambda c: c["merge"].__setitem__("max_samples", {"nosuch": 3})).startswith(
        "merge.max_samples: unknown dataset(s) ['nosuch']"
    )
    assert err(lambda c: c["plan"].__setitem__("drop", ["nosuch"])).startswith(
        "plan.drop: unknown dataset(s) ['nosuch']"
    )
    c = yaml.safe_load(yaml.safe_dump(base))
    c["datasets"]["ultrachat_demo"]["source"]["path"] = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"datasets.ultrachat_demo.source.path: .*nope.jsonl does not exist"):
        cfg.check_config(c)


def test_generated_dataset_without_a_backend_and_build_tiny_over_a_real_model(tmp_path):
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    del c["generation"]["backends"]
    with pytest.raises(cfg.ConfigError, match=r"datasets.sharegpt_demo: no backend to generate its responses with"):
        cfg.check_config(c, check_paths=False)
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    for ds in c["datasets"].values():
        ds["source"]["path"] = str(ROOT / ds["source"]["path"])
    real = tmp_path / "Kimi-K2.5"
    real.mkdir()
    (real / "config.json").write_text("{}")
    c["target"]["path"] = str(real)
    with pytest.raises(cfg.ConfigError, match=r"target.path: .*Kimi-K2.5 exists and is not a tiny target"):
        cfg.check_config(c)
    (real / "tiny_target.json").write_text("{}")  # one this build made earlier: rebuilt as usual
    cfg.check_config(c)


def test_layering_a_config_with_its_own_datasets_on_another_is_refused():
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    mine = yaml.safe_load((ROOT / "resources/configs/openrouter.yaml").read_text())
    with pytest.raises(cfg.ConfigError) as info:
        cfg.check_layering([("config.yaml", demo), ("my.yaml", mine)])
    msg = str(info.value)
    assert msg.startswith(
        "Config error: my.yaml is a config of its own (target or backends, and datasets), so the "
        "datasets of config.yaml (sharegpt_demo, ultrachat_demo, sweagent_demo, pretokenized_demo) "
        "would be built too, with its target and backends"
    )
    assert "Use my.yaml alone" in msg and "`sharegpt_demo: {}`" in msg
    # an override file changing keys (also of a dataset defined earlier) or adding a dataset layers fine, and so
    # does a config of one's own naming the earlier datasets to keep them
    cfg.check_layering(
        [("config.yaml", demo), ("o.yaml", {"merge": {"max_len": 512}, "datasets": {"sharegpt_demo": {"shards": 4}}})]
    )
    more = {"datasets": {"more": {"source": {"format": "ultrachat", "path": "x.jsonl"}}}}
    cfg.check_layering([("config.yaml", demo), ("more.yaml", more)])
    with pytest.raises(cfg.ConfigError, match="b.yaml is a config of its own"):
        cfg.check_layering([("config.yaml", demo), ("b.yaml", {**more, "backends": mine["backends"]})])
    keep = copy.deepcopy(mine)
    keep["datasets"].update({ds: {} for ds in demo["datasets"]})
    cfg.check_layering([("config.yaml", demo), ("my.yaml", keep)])
    cfg.check_layering([("my.yaml", mine)])


def test_api_key_check_names_the_variable_and_close_names_never_values():
    c = yaml.safe_load((ROOT / "resources/configs/openrouter.yaml").read_text())
    env = {
        "OPENROUTER_KEY": "sk-secret-1",
        "OPENROUTER_API_KEY_OLD": "sk-secret-2",
        "HOME": "/root",
        "PATH": "/bin",
        "OPENROUTER_API_KEy": "",
    }
    with pytest.raises(cfg.ConfigError) as info:
        cfg.check_api_keys(c, ["sharegpt"], env)
    msg = str(info.value)
    assert msg == (
        "Config error: OPENROUTER_API_KEY is not set (backends.openrouter.api_key_env, used by sharegpt); "
        "set, with a close name: OPENROUTER_API_KEY_OLD, OPENROUTER_KEY. Export the key under the name "
        "the config gives (or correct api_key_env), then run again."
    )
    assert "sk-secret" not in msg
    cfg.check_api_keys(c, ["sharegpt"], {"OPENROUTER_API_KEY": "sk-or-v1-0123456789abcdef"})
    cfg.check_api_keys(c, [], {})  # nothing to generate: no key needed
    # backends without a key variable (a local server) need nothing
    demo = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg.check_api_keys(demo, cfg.generated_datasets(demo), {})


def test_pending_generation_lists_datasets_with_responses_to_generate(tmp_path):
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert cfg.pending_generation(c, tmp_path) == ["sharegpt_demo", "ultrachat_demo", "sweagent_demo"]
    for s in ("000", "001"):
        (tmp_path / "results/sharegpt_demo/responses").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"results/sharegpt_demo/responses/{s}.parquet").touch()
    assert cfg.pending_generation(c, tmp_path) == ["ultrachat_demo", "sweagent_demo"]


def _schema_keys() -> list[str]:
    rows = docgen.schema_reference(yaml.safe_load(SCHEMA.read_text())).splitlines()[2:]
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
    assert cfg.reruns_of("backends.<name>.launch.command").startswith(cfg.NOTHING)
    assert cfg.reruns_of("datasets.<name>.generation.max_retries") == cfg.NOTHING
    assert cfg.reruns_of("datasets.<name>.generation.temperature") == "as generation.<key>, for that dataset only"
    assert "extract" in cfg.reruns_of("merge.max_len")
    doc = (ROOT / "docs" / "config.md").read_text()
    assert docgen.reruns_table() in doc, "run: python -m eagle3_data.config.docgen"


def test_rule_params_leave_out_transport_settings():
    """The slices the rules pass as params don't move when a transport setting does."""
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    before = {
        ds: (stage_settings.generation_data_settings(c, ds), stage_settings.backends_data_settings(c, ds))
        for ds in cfg.generated_datasets(c)
    }
    other = yaml.safe_load(yaml.safe_dump(c))
    b = other["backends"]["tiny_local"]
    b.update(
        max_concurrency=99,
        timeout_s=1,
        requests_per_minute=5,
        tokens_per_minute=9,
        api_key_env="X",
        headers={"X-Title": "t"},
    )
    b["launch"]["command"] += " --verbose"
    other["generation"].update(max_retries=0, retry_initial_s=9.0)
    after = {
        ds: (stage_settings.generation_data_settings(other, ds), stage_settings.backends_data_settings(other, ds))
        for ds in cfg.generated_datasets(other)
    }
    assert after == before
    other["backends"]["tiny_local"]["extra_body"] = {"top_k": 3}  # shapes requests: a data setting
    assert stage_settings.backends_data_settings(other, "sharegpt_demo") != before["sharegpt_demo"][1]
    e = yaml.safe_load(yaml.safe_dump(c))
    e["extract"].update(device="cpu", batch_tokens=7, gpu_lock_dir="/x")
    assert ExtractSettings.from_config(e).params() == ExtractSettings.from_config(c).params()
    assert ExtractSettings.from_config(e) != ExtractSettings.from_config(c)  # ... which the job still gets
    e["merge"].update(memory_mb=999, threads=7)
    assert MergeSettings.from_config(e).params() == MergeSettings.from_config(c).params()


def test_section_fills_what_the_schema_fills():
    """cfg.section() of an unvalidated config gives the schema's defaults: the ones validate_config fills in."""
    c = {
        "target": {"name": "t", "path": "p", "template": "kimi-k25"},
        "datasets": {"d": {"source": {"format": "pretokenized", "path": "x.jsonl"}}},
    }
    raw = copy.deepcopy(c)
    cfg.validate_config(c, cfg.load_schema(SCHEMA))
    for name in ("normalize", "validate", "merge", "extract", "export", "plan", "forecast", "vocab"):
        assert cfg.section(raw, name) == c[name], name


def test_generation_source_names_where_a_budget_is_set():
    from eagle3_data.config import generation_source

    config = {
        "generation": {"budget_usd": 5.0, "budget_completion_tokens": None},
        "datasets": {"a": {"generation": {"budget_usd": 1.0}}, "b": {}, "c": {"generation": None}},
    }
    assert generation_source(config, "a", "budget_usd") == "datasets.a.generation.budget_usd"
    assert generation_source(config, "b", "budget_usd") == "generation.budget_usd"
    assert generation_source(config, "c", "budget_usd") == "generation.budget_usd"
    assert generation_source(config, "a", "budget_completion_tokens") is None


def _two_backend_config() -> dict:
    """The embedded default with a second backend: sharegpt_demo on ``remote`` only, ultrachat_demo on
    ``tiny_local`` then ``remote``, sweagent_demo on ``tiny_local`` (the default)."""
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    c["backends"]["remote.api"] = {
        "type": "openai",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "max_concurrency": 2000,
    }
    c["datasets"]["sharegpt_demo"]["generation"] = {"backends": ["remote.api"]}
    c["datasets"]["ultrachat_demo"]["generation"] = {"backends": ["tiny_local", "remote.api"]}
    return c


def test_generate_job_seats_leave_each_backend_its_share_and_lend_the_rest_unless_set():
    c = _two_backend_config()
    # G=5, even share 3: sharegpt_demo's 2 shards use remote.api only, sweagent_demo's 1 tiny_local only, so
    # remote.api may take 5 - min(1, 3) = 4 seats and tiny_local 5 - min(2, 3) = 3
    assert cfg.backend_job_seats(c, 5) == {"remote.api": 4, "tiny_local": 3}
    assert cfg.backend_job_seats(c, 3) == {"remote.api": 2, "tiny_local": 2}  # the even share, never less
    assert cfg.backend_job_seats(c, 1) == {"remote.api": 1, "tiny_local": 1}
    c["backends"]["tiny_local"]["max_jobs"] = 1
    assert cfg.backend_job_seats(c, 8) == {"remote.api": 7, "tiny_local": 1}  # tiny_local reserves its 1
    # a backend no generated dataset uses gets no seats; one backend in use takes them all
    one = yaml.safe_load((ROOT / "config.yaml").read_text())
    one["backends"]["unused"] = dict(c["backends"]["remote.api"])
    assert cfg.backend_job_seats(one, 5) == {"tiny_local": 5}
    assert cfg.seat_resource("remote.api") == "generate_jobs_remote_api"


def test_generate_job_seats_let_every_shard_of_the_seed_config_run_at_once():
    """The seed config: 32 shards, 20 on openrouter (B3's 4 also on sglang_local), 16 on sglang_local. An even split
    (16 + 16) held B3's shards back until an openrouter shard ended; with 32 generate jobs all of them fit."""
    seed = yaml.safe_load((ROOT / "resources/configs/seed-kimi-k25.yaml").read_text())
    jobs = {b: jobs_using(seed, b) for b in ("openrouter", "sglang_local")}
    assert jobs == {"openrouter": 20, "sglang_local": 16}
    assert cfg.backend_job_seats(seed, 32) == {"openrouter": 20, "sglang_local": 16}
    # fewer seats than shards: sglang_local's 12 own shards keep their even share (8 of 16), and so do openrouter's
    assert cfg.backend_job_seats(seed, 16) == {"openrouter": 8, "sglang_local": 8}
    assert cfg.backend_job_seats(seed, 24) == {"openrouter": 12, "sglang_local": 12}
    # three backends: a third with 2 shards of its own reserves 2 seats from each of the others
    three = copy.deepcopy(seed)
    three["backends"]["third"] = dict(seed["backends"]["openrouter"])
    three["datasets"]["B7_sharegpt"]["generation"] = {"backends": ["third"]}
    three["datasets"]["B7_sharegpt"]["shards"] = 2
    assert cfg.backend_job_seats(three, 30) == {
        "openrouter": 30 - 10 - 2,
        "sglang_local": 30 - 10 - 2,
        "third": 30 - 10 - 10,
    }


def test_each_generate_job_takes_a_seat_of_exactly_its_datasets_backends(tmp_path):
    """Dry run of a two-backend config: every generate job's resources name one seat of each backend its dataset
    uses and none of the other's (Snakemake caps the jobs holding a backend's seats at its share)."""
    import re

    from eagle3_data.testing.workflow import copy_workflow, run_snakemake

    wd = copy_workflow(tmp_path / "wf")
    (wd / "two.yaml").write_text(yaml.safe_dump(_two_backend_config()))
    proc = run_snakemake(
        wd,
        "-n",
        "results/sharegpt_demo/responses/000.parquet",
        "results/sharegpt_demo/responses/001.parquet",
        "results/ultrachat_demo/responses/000.parquet",
        "results/sweagent_demo/responses/000.parquet",
        "--configfile",
        "two.yaml",
    )
    seen = {}
    for block in (proc.stdout + proc.stderr).split("rule generate:")[1:]:
        ds = re.search(r"wildcards: ds=(\w+), shard=(\d+)", block)
        res = dict(kv.split("=") for kv in re.search(r"resources: (.*)", block).group(1).split(", "))
        seen[ds.groups()] = (int(res["generate_jobs_tiny_local"]), int(res["generate_jobs_remote_api"]))
    assert seen == {
        ("sharegpt_demo", "000"): (0, 1),
        ("sharegpt_demo", "001"): (0, 1),
        ("ultrachat_demo", "000"): (1, 1),
        ("sweagent_demo", "000"): (1, 0),
    }


def test_a_server_told_other_chat_template_variables_than_tokenize_renders_with_is_refused():
    c = yaml.safe_load((ROOT / "config.yaml").read_text())  # target thinking: true
    c["backends"]["tiny_local"]["extra_body"] = {"chat_template_kwargs": {"thinking": False}}
    with pytest.raises(
        cfg.ConfigError,
        match=r"backends\.tiny_local\.extra_body\.chat_template_kwargs\.thinking "
        r"is False, but tokenize renders the prompts of \w+ with thinking True",
    ):
        cfg.check_config(c, check_paths=False)
    # the same value on both sides, or none sent (the server's default), passes
    c["backends"]["tiny_local"]["extra_body"] = {"chat_template_kwargs": {"thinking": True}}
    cfg.check_config(c, check_paths=False)
    c["backends"]["tiny_local"]["extra_body"] = {}
    cfg.check_config(c, check_paths=False)
    # a variable the target does not render with is refused too (tokenize would use the template's default)
    c["backends"]["tiny_local"]["extra_body"] = {"chat_template_kwargs": {"preserve_thinking": True}}
    with pytest.raises(cfg.ConfigError, match="preserve_thinking is True.*not set"):
        cfg.check_config(c, check_paths=False)
    # a dataset's own chat_template_kwargs go to both the server (replacing the backend's) and tokenize
    c["backends"]["tiny_local"]["extra_body"] = {"chat_template_kwargs": {"thinking": False}}
    for ds in cfg.generated_datasets(c):
        c["datasets"][ds].setdefault("generation", {})["extra_body"] = {"chat_template_kwargs": {"thinking": False}}
    cfg.check_config(c, check_paths=False)
    # a native_generate backend is sent the prompt's ids, rendered here
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    c["backends"]["tiny_local"].update(extra_body={"chat_template_kwargs": {"thinking": False}}, native_generate=True)
    cfg.check_config(c, check_paths=False)


def test_a_key_set_twice_in_a_config_file_is_an_error_naming_both_lines(tmp_path):
    """A second `generation:` block appended later would silently replace the first (and its budget)."""
    mine = tmp_path / "my.yaml"
    mine.write_text(
        "generation:\n  budget_usd: 0.0001\n  max_retries: 3\ndatasets: {}\n"
        "# appended later\ngeneration:\n  max_tokens: 64\n"
    )
    with pytest.raises(cfg.ConfigError) as ei:
        cfg.config_sources([str(mine)])
    assert str(ei.value) == (
        f"Config error in {mine}: generation is set twice, at lines 1 and 6; YAML keeps only the one at line 6 and "
        "silently drops the other (e.g. a budget): merge them into one"
    )
    mine.write_text("datasets:\n  a:\n    shards: 2\n    shards: 4\n")
    with pytest.raises(cfg.ConfigError, match=r"datasets\.a\.shards is set twice, at lines 3 and 4;"):
        cfg.config_sources([str(mine)])
    mine.write_text("generation:\n  budget_usd: 0.0001\ndatasets:\n  a: {shards: 2}\n")
    assert cfg.config_sources([str(mine)]) == [
        (str(mine), {"generation": {"budget_usd": 0.0001}, "datasets": {"a": {"shards": 2}}})
    ]


def test_concurrency_and_shards_past_their_bounds_name_the_file_line_and_the_bound(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    schema = cfg.load_schema(cfg.SCHEMA_PATH)
    base = yaml.safe_load((ROOT / "config.yaml").read_text())
    text = "backends:\n  tiny_local:\n    max_concurrency: 5000\ndatasets:\n  sharegpt_demo:\n    shards: 100000\n"
    (tmp_path / "my.yaml").write_text(text)
    over = yaml.safe_load(text)
    files = [("config.yaml", base), ("my.yaml", over)]

    def merged(**bounds):
        c = copy.deepcopy(base)
        c["backends"]["tiny_local"]["max_concurrency"] = 5000
        c["datasets"]["sharegpt_demo"]["shards"] = 100000
        if bounds:
            c["bounds"] = bounds
        return c

    with pytest.raises(cfg.ConfigError) as ei:
        cfg.validate_config(merged(), schema, files=files)
    assert str(ei.value) == (
        "Config error: my.yaml line 3: backends.tiny_local.max_concurrency: 5,000 is above bounds.max_concurrency "
        "(4,096; requests in flight to the backend (a budget stop lets them finish: they bound its overshoot)): "
        "lower it, or set bounds.max_concurrency: 5000 to allow it"
    )
    with pytest.raises(
        cfg.ConfigError,
        match=r"^Config error: my.yaml line 6: datasets.sharegpt_demo.shards: "
        r"100,000 is above bounds.max_shards \(1,024;",
    ):
        cfg.validate_config(merged(max_concurrency=5000), schema, files=files)
    cfg.validate_config(merged(max_concurrency=5000, max_shards=100000), schema, files=files)  # raised: accepted
    c = merged(max_concurrency=40000)
    c["backends"]["tiny_local"]["max_concurrency"] = 40000
    with pytest.raises(cfg.ConfigError, match="max_concurrency"):  # past what the shared request slots can hold
        cfg.validate_config(c, schema, files=files)


@pytest.mark.parametrize("key", ["test", "beta", "k3y9zq", "0123456789abcde"])
def test_a_key_shorter_than_a_safe_length_is_refused_before_any_request(key):
    """A local server's `--api-key test`: such a key is an ordinary word of replies, which could then not be
    checked for it; refused when the config is checked (and at job start), naming the variable, never the value."""
    c = yaml.safe_load((ROOT / "resources/configs/openrouter.yaml").read_text())
    with pytest.raises(cfg.ConfigError) as info:
        cfg.check_api_keys(c, ["sharegpt"], {"OPENROUTER_API_KEY": key})
    msg = str(info.value)
    assert msg.startswith(
        f"Config error: backends.openrouter.api_key_env: the key in OPENROUTER_API_KEY is {len(key)} "
        "characters; a key shorter than 16 could be an ordinary word of a reply"
    )
    with pytest.raises(cfg.ConfigError) as other:  # the message does not depend on the value
        cfg.check_api_keys(c, ["sharegpt"], {"OPENROUTER_API_KEY": "x" * len(key)})
    assert str(other.value) == msg


def test_a_budget_that_caps_nothing_or_can_count_no_dollar_is_a_config_error():
    """A NaN or infinite budget was accepted and meant no cap; a dollar budget over a backend that reports no
    cost and has no price counted nothing. Both are refused before anything is sent, naming the setting."""
    base = yaml.safe_load((ROOT / "config.yaml").read_text())
    ds = cfg.generated_datasets(base)[0]
    for value, why in ((float("nan"), "is NaN"), (float("inf"), "is infinite"), (-0.5, r"is negative \(-0.5\)")):
        for key in ("budget_usd", "budget_completion_tokens"):
            c = copy.deepcopy(base)
            c["datasets"][ds]["generation"] = {key: value}
            with pytest.raises(cfg.ConfigError, match=rf"^datasets\.{ds}\.generation\.{key} {why}"):
                cfg.check_config(c, check_paths=False)
        c = copy.deepcopy(base)
        c["generation"]["budget_usd"] = value
        with pytest.raises(cfg.ConfigError, match=rf"^generation\.budget_usd {why}"):
            cfg.check_config(c, check_paths=False)
    c = copy.deepcopy(base)
    c["generation"]["budget_usd"] = 1.0
    cfg.check_config(c, check_paths=False)  # the demo's backend is a server the build launches: nothing bought
    c["backends"]["hosted"] = {"type": "openai", "base_url": "https://api.example.com/v1", "model": "m"}
    c["datasets"][ds]["generation"] = {"backends": ["hosted"]}
    with pytest.raises(cfg.ConfigError) as ei:
        cfg.check_config(c, check_paths=False)
    assert str(ei.value) == (
        f"generation.budget_usd is set, but backend hosted (type openai, used by {ds}) reports no cost and has no "
        "price, so the budget could not count what it spends: set backends.hosted.price_per_m: {prompt: USD, "
        "completion: USD} (per million tokens; 0 for a free local server), or remove budget_usd"
    )
    c["backends"]["hosted"]["price_per_m"] = {"prompt": 0.5, "completion": 1.5}
    cfg.check_config(c, check_paths=False)
    c["backends"]["hosted"].update(type="openrouter", price_per_m=None)  # OpenRouter's replies carry usage.cost
    cfg.check_config(c, check_paths=False)
    c["generation"]["budget_usd"] = None
    c["backends"]["hosted"].update(type="openai")
    cfg.check_config(c, check_paths=False)  # no dollar budget: nothing to count
    schema = cfg.load_schema(cfg.SCHEMA_PATH)
    c["generation"]["budget_usd"] = -1
    with pytest.raises(WorkflowError):
        validate(c, schema)


def test_two_modes_of_one_source_are_not_near_duplicates_of_each_other():
    """With near-duplicates on, an answers: original dataset made from the same source as a regenerated one lost
    every prompt (the docs pair them): a dataset's earlier datasets leave out another mode of its own source."""
    x = {"format": "sharegpt", "path": "resources/samples/sharegpt.json"}
    c = {
        "datasets": {
            "a": {"source": dict(x)},
            "b": {"source": dict(x), "answers": "original"},
            "c": {"source": {"format": "ultrachat", "path": "u.jsonl"}},
            "t": {"source": {"format": "pretokenized", "path": "t.parquet"}},
            "d": {"source": dict(x)},  # the same source regenerated twice: duplicates indeed
            "e": {"source": {**x, "options": {"strip_think": False}}, "answers": "original"},  # other options
        }
    }
    assert cfg.two_modes_of_one_source(c, "a", "b") and not cfg.two_modes_of_one_source(c, "a", "d")
    assert not cfg.two_modes_of_one_source(c, "a", "e")
    assert {ds: cfg.earlier_prompt_datasets(c, ds) for ds in ("a", "b", "c", "d", "e")} == {
        "a": [],
        "b": [],
        "c": ["a", "b"],
        "d": ["a", "c"],
        "e": ["a", "b", "c", "d"],
    }
