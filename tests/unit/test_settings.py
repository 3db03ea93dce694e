"""One typed settings object per stage: defaults only from the schema, the config's values where set, rule params
the content keys, and no stage signature restating a config default."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from eagle3_data import config as cfg
from eagle3_data import settings as st

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = cfg.load_schema(cfg.SCHEMA_PATH)
MINIMAL = {
    "target": {"name": "t", "path": "p", "template": "qwen3"},
    "datasets": {"d": {"source": {"format": "sharegpt", "path": "x.json"}}},
}


def schema_section(path: str) -> dict:
    """``{key: schema node}`` of the schema section at dotted ``path`` (read here from the YAML, not through
    eagle3_data.settings)."""
    node = SCHEMA
    for part in path.split("."):
        node = node["properties"][part]
    return node["properties"]


def own_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def schema_default(node: dict):
    if "properties" in node and isinstance(node.get("default"), dict):  # validate.count_tolerance
        return {k: v.get("default") for k, v in node["properties"].items()}
    return node.get("default")


@pytest.mark.parametrize("cls,path", list(st.SECTIONS.items()), ids=lambda x: getattr(x, "__name__", x))
def test_every_settings_field_of_a_section_has_the_schema_default(cls, path):
    """A config that sets nothing of the section: each field is the schema's default (None where it has none),
    from the raw config (never validated) and from the validated one alike, and from ``defaults()``."""
    config = copy.deepcopy(MINIMAL)
    if path == "target.tiny":  # the schema fills target.tiny's keys when the section is there
        config["target"]["tiny"] = {}
    validated = cfg.validate_config(copy.deepcopy(config), SCHEMA)
    props = {k: v for k, v in schema_section(path).items() if f"{path}.{k}" not in st.SECTIONS.values()}
    assert set(props) <= own_fields(cls), f"{cls.__name__} lacks {set(props) - own_fields(cls)}"
    required = MINIMAL["target"] if path == "target" else {}
    for got in (cls.from_config(config), cls.from_config(validated), cls.defaults(**required)):
        for key, node in props.items():
            want = required[key] if key in required else schema_default(node)
            assert getattr(got, key) == want, f"{path}.{key}"


def test_settings_take_the_configs_values():
    c = yaml.safe_load((ROOT / "config.yaml").read_text())
    m = st.MergeSettings.from_config(c)
    assert (m.max_len, m.shards, m.seed, m.overflow, m.datasets) == (2048, 2, 0, "truncate", None)
    assert (m.memory_mb, m.threads) == (4000, 2)  # not in config.yaml: the schema's
    e = st.ExtractSettings.from_config(c)
    assert (e.dtype, e.final_norm, e.batch_tokens, e.model_path, e.cache_dir) == (
        "float32",
        "both",
        8192,
        "results/target/tiny-kimi",
        "cache",
    )
    assert e.reuse_path("sharegpt_demo", "001") == "cache/hidden_states/sharegpt_demo/001.safetensors"
    v = st.ValidateSettings.from_config(c)
    assert v.count_tolerance == {"per_sample_abs": 3, "per_sample_rel": 0.02, "aggregate_rel": 0.0004}
    assert v.target.template == "kimi-k25" and v.target.chat_template_kwargs == {"thinking": True}
    p = st.PlanSettings.from_config(c)
    assert (p.caps, p.measure_tokens, p.gpus_total, p.overflow, p.extract.dtype) == (
        [1024],
        20000,
        8,
        "truncate",
        "float32",
    )
    assert st.VocabSettings.from_config(c).draft_vocab_size == 256
    assert st.ExportSettings.from_config(c).layouts == ["specforge"]
    t = st.TokenizeSettings.from_config(c, "sweagent_demo")
    assert t.max_tokens == 192 and st.TokenizeSettings.from_config(c, "sharegpt_demo").max_tokens == 256
    n = st.NormalizeSettings.from_config(c, "sharegpt_demo")
    assert (n.format, n.shards, n.max_reject_rate) == ("sharegpt", 2, 0.5)
    c["datasets"]["sharegpt_demo"]["source"]["max_reject_rate"] = 0.9  # a dataset's own ceiling wins
    assert st.NormalizeSettings.from_config(c, "sharegpt_demo").max_reject_rate == 0.9
    assert st.TinyTargetSettings.from_config(c).hidden_size == 64


def test_params_are_the_content_keys_as_plain_values():
    """Rule params: the keys the output depends on, JSON-like (Snakemake compares params by repr; a dataclass
    would not be compared at all)."""
    c = cfg.validate_config(yaml.safe_load((ROOT / "config.yaml").read_text()), SCHEMA)
    assert st.MergeSettings.from_config(c).params() == {k: c["merge"][k] for k in cfg.MERGE_DATA_KEYS}
    # final_format, drafters and dflash_layers only where they change what is stored (here: at their defaults)
    assert st.ExtractSettings.from_config(c).params() == {k: c["extract"][k] for k in cfg.EXTRACT_STATE_KEYS[:6]}
    e = st.ExtractSettings.from_config(
        {**c, "extract": {**c["extract"], "drafters": ["eagle3", "dflash"], "final_format": "fp8_e4m3"}}
    ).params()
    assert (e["drafters"], e["dflash_layers"], e["final_format"]) == (["eagle3", "dflash"], None, "fp8_e4m3")
    assert st.ValidateSettings.from_config(c).params() == {
        "keep_truncated": False,
        "max_tokens": None,
        "count_tolerance": {"per_sample_abs": 3, "per_sample_rel": 0.02},
    }
    assert st.TargetSettings.from_config(c).params() == {k: c["target"].get(k) for k in cfg.TARGET_DATA_KEYS}
    # the plan's keys (write_gb_per_s only when set) and the exports whose bytes its disk check adds
    assert st.PlanSettings.from_config(c).params() == {
        **{k: v for k, v in c["plan"].items() if k != "write_gb_per_s"},
        "export_layouts": ["specforge"],
    }
    # the plan depends on the measuring settings only when it measures
    assert "batch_tokens" in st.PlanSettings.from_config(c).extract_params()
    c["plan"]["tokens_per_s_per_gpu"] = 100.0
    assert "batch_tokens" not in st.PlanSettings.from_config(c).extract_params()
    for obj in (
        st.MergeSettings.from_config(c),
        st.TokenizeSettings.from_config(c, "sharegpt_demo"),
        st.ExportSettings.from_config(c),
        st.VocabSettings.from_config(c),
    ):
        assert all(isinstance(v, (str, int, float, bool, list, dict, type(None))) for v in obj.params().values())


def test_generate_settings_params_are_what_the_responses_depend_on():
    c = cfg.validate_config(yaml.safe_load((ROOT / "config.yaml").read_text()), SCHEMA)
    g = st.GenerateSettings.from_config(c, "sweagent_demo")
    p = g.params()
    assert p["generation"] == {k: cfg.generation_config(c, "sweagent_demo").get(k) for k in cfg.GENERATION_DATA_KEYS}
    assert p["generation"] == st.generation_data_settings(c, "sweagent_demo") == g.generation.params()
    assert p["generation"]["max_tokens"] == 192 and p["num_shards"] == 1 and p["target_name"] == "tiny-kimi"
    assert p["backends"]["tiny_local"]["launched"] is True and "max_concurrency" not in p["backends"]["tiny_local"]
    assert p["target"] is None  # no native /generate backend: the target is no dependency of generation
    assert p["target_format"] == {"template": "kimi-k25", "chat_template_kwargs": {"thinking": True}}
    assert g.journal_dir == "cache/journal" and g.backends["tiny_local"]["max_concurrency"] == 4
    assert g.backend_jobs == {"tiny_local": 4}  # 2 + 1 + 1 shards of the generated datasets use it
    # typed: the generation settings and the backends, the schema's defaults where the config sets nothing
    assert (g.generation.max_tokens, g.generation.max_retries, g.generation.stop_grace_s) == (192, 5, 10.0)
    (b,) = g.backend_configs()
    assert (b.name, b.max_concurrency, b.timeout_s, b.down_after_s) == ("tiny_local", 4, 300.0, 30.0)
    other = copy.deepcopy(c)
    other["backends"]["tiny_local"].update(max_concurrency=99, timeout_s=1)  # transport: no rerun
    assert st.GenerateSettings.from_config(other, "sweagent_demo").params() == p
    other["backends"]["tiny_local"]["native_generate"] = True
    assert st.GenerateSettings.from_config(other, "sweagent_demo").params()["target"]["path"] == c["target"]["path"]


def test_generation_and_backend_settings_take_the_schema_defaults_from_a_raw_config():
    """A config never validated (a test's, the Python API's): what it leaves out is the schema's default, for the
    generation settings, each backend's entry and the typed backend the job uses."""
    c = copy.deepcopy(MINIMAL)
    c["backends"] = {"b": {"type": "openai", "base_url": "http://x/v1", "model": "m"}}
    c["generation"] = {"backends": ["b"]}
    g = st.GenerateSettings.from_config(c, "d")
    gen_schema = {**SCHEMA["$defs"]["generation"]["properties"], **schema_section("generation")}
    for key in gen_schema:
        want = SCHEMA["properties"]["generation"]["properties"].get(key, {}).get("default")
        assert getattr(g.generation, key) == (["b"] if key == "backends" else want), key
    backend = SCHEMA["properties"]["backends"]["additionalProperties"]["properties"]
    (b,) = g.backend_configs()
    for key, node in backend.items():
        if "default" in node and key not in ("launch", "price_per_m", "max_jobs", "timeout_s"):
            assert g.backends["b"][key] == node["default"] and getattr(b, key) == node["default"], key
    # timeout_s null: the typed backend's fits the longest reply max_tokens allows (here left to the server)
    assert g.backends["b"]["timeout_s"] is None and b.timeout_s == 3600.0
    assert g.journal_dir == f"{SCHEMA['properties']['cache_dir']['default']}/journal"
    assert g.num_shards == SCHEMA["properties"]["datasets"]["additionalProperties"]["properties"]["shards"]["default"]


def test_settings_are_frozen():
    m = st.MergeSettings.defaults(max_len=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.max_len = 20
    assert m.replace(max_len=20).max_len == 20 and m.max_len == 10


#: the stage entry points the scripts call, and the settings class whose values they must not restate
def _entry_points():
    from eagle3_data import export, forecast, generate, merge, normalize, plan, tiny_target, tokens, validate, vocab
    from eagle3_data.extract import stage

    return [
        (generate.generate, st.GenerateSettings),
        (forecast.pilot, st.GenerateSettings),
        (normalize.normalize, st.NormalizeSettings),
        (tokens.tokenize, st.TokenizeSettings),
        (validate.validate, st.ValidateSettings),
        (merge.merge, st.MergeSettings),
        (stage.extract_states, st.ExtractSettings),
        (plan.plan, st.PlanSettings),
        (plan.build_plan, st.PlanSettings),
        (plan.measure_throughput, st.PlanSettings),
        (vocab.build_vocab, st.VocabSettings),
        (export.export, st.ExportSettings),
        (export.prune_stale, st.ExportSettings),
        (export.specforge_path, st.ExportSettings),
        (tiny_target.build_tiny_target, st.TinyTargetSettings),
    ]


def _config_keys(cls) -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        keys.add(f.name)
        if f.name == "extract":
            keys |= _config_keys(st.ExtractSettings)
        if f.name == "generation" and cls is st.GenerateSettings:
            keys |= _config_keys(st.GenerationSettings)
    return keys | {"gpus", "lock_dir", "max_tokens", "measure", "source_format", "num_shards"}


@pytest.mark.parametrize("fn,cls", _entry_points(), ids=lambda x: getattr(x, "__qualname__", ""))
def test_no_stage_signature_restates_a_config_default(fn, cls):
    """Each entry point takes the stage's settings object; none of its parameters named like a config key of the
    stage has a default (the value comes from the settings, whose defaults are the schema's)."""
    sig = inspect.signature(fn)
    if fn.__name__ not in ("prune_stale", "specforge_path"):
        assert "settings" in sig.parameters, fn.__qualname__
        assert sig.parameters["settings"].default is inspect.Parameter.empty, fn.__qualname__
    keys = _config_keys(cls) - {"settings"}
    restated = {
        n: p.default for n, p in sig.parameters.items() if n in keys and p.default is not inspect.Parameter.empty
    }
    assert not restated, f"{fn.__qualname__} restates {restated}"


def test_the_schema_is_the_only_place_with_stage_defaults():
    """The config package has no table of defaults of its own (cfg.section is the schema's)."""
    assert not hasattr(cfg, "DEFAULTS")
    assert cfg.section({}, "merge") == st.filled("merge", {})
    assert cfg.section({}, "merge")["memory_mb"] == schema_section("merge")["memory_mb"]["default"]


def _schema_enum(path: str) -> list:
    """The ``enum`` of dotted key ``path`` (``<name>`` for a free-form name; ``[]`` for a list's items), read
    here from the YAML."""
    node = SCHEMA
    for part in path.split("."):
        if part == "<name>":
            node = node["additionalProperties"]
        elif part == "[]":
            node = node["items"]
        else:
            node = (SCHEMA["$defs"]["generation"] if node is SCHEMA["properties"]["generation"] else node)[
                "properties"
            ][part]
    return node["enum"]


def _python_enums():
    """Every Python tuple / mapping of a config key's allowed values, and the key whose schema ``enum`` it must be."""
    from eagle3_data import export, merge, sources
    from eagle3_data.backends.definition import BACKEND_TYPES
    from eagle3_data.decontaminate import benchmarks
    from eagle3_data.extract import fused, layout, model, transformers_backend
    from eagle3_data.templates.formats import FORMATS

    return [
        (layout.DTYPES, "extract.dtype"),
        (layout.FINAL_STATES, "extract.final_states"),
        (layout.FINAL_NORMS, "extract.final_norm"),
        (layout.AUX_FORMATS, "extract.aux_format"),
        (layout.FINAL_FORMATS, "extract.final_format"),
        (transformers_backend.ATTENTION_MODES, "extract.attention"),
        (fused.FUSED_MODES, "extract.fused"),
        (model.DRAFTERS, "extract.drafters.[]"),
        (BACKEND_TYPES, "backends.<name>.type"),
        (merge.OVERFLOW_MODES, "merge.overflow"),
        (export.LAYOUTS, "export.layouts.[]"),
        (sources.ADAPTERS, "datasets.<name>.source.format"),
        (benchmarks.FORMATS, "decontaminate.benchmarks.[].format"),
        ({**FORMATS, "auto": None}, "target.template"),
    ]


@pytest.mark.parametrize("values,path", _python_enums(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_python_enum_is_the_schemas(values, path):
    """A value the schema allows but Python doesn't know (or the reverse) fails here, not in a paid run: each
    Python list of allowed values holds exactly the schema's ``enum`` of its key."""
    assert sorted(values) == sorted(_schema_enum(path)), path


def test_extract_checks_its_enums_against_the_schema():
    """extract_states refuses a value outside the schema's enum (the Python API; the config is validated first),
    naming the schema's values."""
    from eagle3_data.extract import stage

    for key in ("dtype", "final_norm", "final_states", "aux_format", "final_format", "backend", "attention"):
        with pytest.raises(ValueError, match=f"extract {key} must be one of"):
            stage.check_settings(st.ExtractSettings.defaults(**{key: "nonsense"}))
    stage.check_settings(st.ExtractSettings.defaults())
