"""The config slices the report rules pass as params, built from the stage settings, and the schema section of
every settings class."""

from __future__ import annotations


from .. import config as cfg
from .generation import GenerateSettings, GenerationSettings
from .stages import (
    DecontaminateSettings,
    ExportSettings,
    ExtractSettings,
    GGUFTargetSettings,
    MergeSettings,
    NormalizeSettings,
    PlanSettings,
    TargetSettings,
    TinyTargetSettings,
    ValidateSettings,
    VocabSettings,
)


# The config slices the report rules pass as params, built from the stage settings above (the rules' params are
# each settings object's params(); these group them per dataset).


def datasets_data_settings(config: dict) -> dict:
    """Every dataset's source keys (``eagle3_data.config.SOURCE_DATA_KEYS``) and shard count: what the reports
    depend on; and ``answers: original`` where set (only then, so the other datasets' slices stay as they were)."""
    out = {}
    for ds in cfg.datasets(config):
        out[ds] = {
            "source": NormalizeSettings.from_config(config, ds).params(),
            "shards": cfg.dataset_shards(config, ds),
        }
        if cfg.is_original(config, ds):
            out[ds]["answers"] = "original"
    return out


def generation_data_settings(config: dict, ds: str) -> dict:
    """The generation settings of ``ds`` its responses depend on (``eagle3_data.config.GENERATION_DATA_KEYS``, and
    ``reject_other_models`` when it is set: left at its default it changes nothing, and reruns nothing)."""
    return GenerationSettings.from_config(config, ds).params()


def backends_data_settings(config: dict, ds: str) -> dict:
    """Per backend ``ds`` uses (priority order): the keys that say which endpoint answers and how requests
    are shaped (``eagle3_data.config.BACKEND_DATA_KEYS``); ``launch`` counts only as present or not."""
    return GenerateSettings.from_config(config, ds).params()["backends"]


#: every settings class and the schema section its own fields come from (tests/unit/test_settings.py)
SECTIONS: dict[type, str] = {
    TargetSettings: "target",
    TinyTargetSettings: "target.tiny",
    GGUFTargetSettings: "target.gguf",
    DecontaminateSettings: "decontaminate",
    ValidateSettings: "validate",
    MergeSettings: "merge",
    GenerationSettings: "generation",
    ExtractSettings: "extract",
    PlanSettings: "plan",
    VocabSettings: "vocab",
    ExportSettings: "export",
}
