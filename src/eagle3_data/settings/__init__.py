"""One typed settings object per stage, built once from the validated config; defaults only from the schema.

Every stage's script builds its settings with ``<Stage>Settings.from_config(snakemake.config, ...)`` and passes
that one object to the stage's entry point; no stage function restates a config default in its signature
(``tests/unit/test_settings.py`` checks both). A field missing from the config (a config that was never validated, a
test's partial config) takes the schema's ``default``, read from the schema the package ships (:mod:`eagle3_data.config.schema`) (a key without
a default: ``None``); :meth:`defaults` builds a stage's settings from the schema alone, with overrides, for
library use and tests.

Rule ``params`` are each settings object's :meth:`params`: the content keys a stage's OUTPUT depends on
(:data:`eagle3_data.config.MERGE_DATA_KEYS` and the other ``*_DATA_KEYS``), the same values as before these
objects existed, so a change reruns exactly the rules whose output it changes. The other fields (memory,
threads, devices, reject ceilings) are read at run time and rerun nothing.

The objects are frozen dataclasses; their mapping-valued fields hold the config's plain values (lists, dicts),
so ``params()`` stays JSON-like and equal to the config's slices.
"""

from ..config.schema import SCHEMA_PATH, default, filled, schema, schema_node  # noqa: F401
from .base import SettingsBase, build_settings, stage_value  # noqa: F401
from .generation import (  # noqa: F401
    GenerateSettings,
    GenerationSettings,
    OriginalAnswersSettings,
    backend_settings,
)
from .slices import SECTIONS, backends_data_settings, datasets_data_settings, generation_data_settings  # noqa: F401
from .stages import (  # noqa: F401
    DecontaminateSettings,
    ExportSettings,
    ExtractSettings,
    GGUFTargetSettings,
    MergeSettings,
    NormalizeSettings,
    PlanSettings,
    TargetSettings,
    TinyTargetSettings,
    TokenizeSettings,
    ValidateSettings,
    VocabSettings,
)
