"""The workflow config: validation with defaults and short errors, cross-key checks, and the slices rules get.

``rules/common.smk`` calls :func:`validate_config` (JSON schema ``eagle3_data/config/config.schema.yaml``, shipped with the package; every key with a
``default`` may be left out), :func:`check_layering`, :func:`check_config` and :func:`check_api_keys` before any
job runs; each raises :class:`ConfigError`, whose message is a few lines naming the config file and the key path
(with a "did you mean" for a misspelt key), never a schema dump or a key's value.

Rules pass exactly these slices as ``params:`` — the settings a stage's OUTPUT depends on — so a change
reruns only the rules whose output it changes (e.g. ``merge.max_len`` reruns merge and below, never
generation). Settings that change how a stage runs but not what it writes (concurrency, timeouts, rate
limits, headers, key variable names, launch commands, retries, devices, batch sizes, memory, reject
ceilings) are never params: the stage's script reads them from ``snakemake.config`` at run time, so
changing them reruns nothing. :data:`RERUNS` lists, for every config key, what its change reruns; the
table in docs/config.md is generated from it (``eagle3_data.docgen``) and tests check both against the schema
and dry runs.

The config's jobs live in modules named for what they do; this package re-exports every name the single
``config`` module used to define, so ``from eagle3_data.config import X`` and ``cfg.X`` still work:

- :mod:`.validation` - :func:`validate_config`, :func:`load_schema`, :class:`ConfigError`;
- :mod:`.schema` - the shipped schema (:data:`SCHEMA_PATH`, :func:`schema`) and its defaults (:func:`default`, :func:`filled`);
- :mod:`.checks` - :func:`check_config`, :func:`check_layering`, :func:`check_api_keys`,
  :func:`config_sources`, :func:`pending_generation`, :func:`resolve_target_template`;
- :mod:`.lookup` - datasets, shards, generation settings and backends of the config (:func:`datasets`,
  :func:`generated_datasets`, :func:`original_datasets`, :func:`response_datasets`, :func:`shard_names`,
  :func:`generation_config`, :func:`backends_config`, ...);
- :mod:`.params` - the content keys rules' params are made of (``*_DATA_KEYS``), :func:`section`, :func:`selection_digest`;
- :mod:`.reruns` - :data:`RERUNS`, :func:`reruns_of`;
- :mod:`.resources` - :func:`backend_job_seats`, :func:`seat_resource`, :func:`launch_gpus`.
"""

from __future__ import annotations

from .validation import (  # noqa: F401
    ConfigError,
    MAX_LISTED_PROBLEMS,
    key_paths,
    resolve_ref,
    load_schema,
    validate_config,
)
from .schema import SCHEMA_PATH, default, filled, schema, schema_node  # noqa: F401
from .lookup import (  # noqa: F401
    ORIGINAL_BACKEND,
    PRETOKENIZED_FORMATS,
    answers_of,
    backends_config,
    dataset_shards,
    datasets,
    deep_merge,
    earlier_prompt_datasets,
    two_modes_of_one_source,
    generated_datasets,
    generation_config,
    generation_source,
    is_original,
    is_pretokenized,
    merge_datasets,
    merged_shard_names,
    original_datasets,
    pretokenized_datasets,
    response_datasets,
    shard_names,
)
from .params import (  # noqa: F401
    BACKEND_DATA_KEYS,
    EXTRACT_STATE_KEYS,
    GENERATION_DATA_KEYS,
    MERGE_DATA_KEYS,
    SOURCE_DATA_KEYS,
    TARGET_DATA_KEYS,
    VALIDATE_DATA_KEYS,
    section,
    selection_digest,
)
from .reruns import (  # noqa: F401
    NOTHING,
    RERUNS,
    reruns_of,
)
from .resources import (  # noqa: F401
    backend_job_seats,
    launch_gpus,
    seat_resource,
)
from .checks import (  # noqa: F401
    TINY_TARGET_FAMILY,
    check_api_keys,
    check_config,
    check_layering,
    config_sources,
    pending_generation,
    resolve_target_template,
)
