"""Stage export: the merged set's samples and their hidden states in the layouts the trainers read (the stage's
entry :func:`.stage.export`; formats and contracts in :mod:`.stage`'s docstring)."""

from .layouts import (  # noqa: F401
    CONTRACTS,
    configured_layer_ids,
    FP8_MAX,
    INPLACE_LAYOUTS,
    LAYOUTS,
    SPECULATORS_DATASET_FILES,
    SPECULATORS_LAYOUTS,
    drafter_of,
    has_consecutive_supervised,
    modelopt_path,
    quantize_per_token_fp8,
    REFS_LAYOUTS,
    sample_path,
    specforge_path,
    speculators_path,
)
from .stage import export, prune_stale, start_indices, write_speculators_dataset  # noqa: F401
from .writer import MergedShard, StatesIndex  # noqa: F401
