"""Extraction: the target's auxiliary and final hidden states for the samples the merge kept.

Parts, each depending only on those listed before it:

- :mod:`.model` — what the target's ``config.json`` says (layer count, hidden size, vocabulary), the EAGLE-3
  and DFlash default layers (:func:`resolve_drafter_layers`: the union one extraction captures) and the layer
  convention, the checkpoint fingerprint;
- :mod:`.norm` — the final RMSNorm's formulas, to derive post-norm states from pre-norm ones and to find which
  one a target uses;
- :mod:`.layout` — the hidden-states file: layout, writer (:class:`HiddenStateWriter`), readers
  (:class:`StatesFile`, :func:`load_states`), storage savers;
- :mod:`.batching` — padded and packed batch plans;
- :mod:`.transformers_backend`, :mod:`.sglang_backend` — the backends, one interface
  (``batches(lengths, batch_tokens)``, ``capture(id_lists) -> [(aux, final)]``, ``close()``);
- :mod:`.stage` — the stage entry point :func:`extract_states` (one merge selection -> one file, reusing the
  rows already computed);
- :mod:`.forward` — a job's forward side: device assignment (:func:`device_context`), the backend, its batches.

Importing this package imports neither torch nor a backend.
"""

from .layout import (
    AUX_FORMATS,
    DTYPES,
    FINAL_FORMATS,
    FINAL_NORMS,
    FINAL_STATES,
    FORMAT,
    HiddenStateWriter,
    StatesFile,
    TokenShard,
    dequantize_fp8,
    load_states,
    quantize_fp8,
    read_hidden_states,
    supervised_final_mask,
)
from .model import (
    DRAFTERS,
    LAYER_CONVENTION,
    default_layers,
    dflash_layer_ids,
    model_dims,
    model_fingerprint,
    resolve_drafter_layers,
    resolve_layers,
)
from .forward import device_context
from .stage import extract_states, settings_digest

__all__ = [
    "AUX_FORMATS",
    "DRAFTERS",
    "DTYPES",
    "FINAL_FORMATS",
    "FINAL_NORMS",
    "FINAL_STATES",
    "FORMAT",
    "HiddenStateWriter",
    "LAYER_CONVENTION",
    "StatesFile",
    "TokenShard",
    "default_layers",
    "dequantize_fp8",
    "device_context",
    "dflash_layer_ids",
    "extract_states",
    "load_states",
    "model_dims",
    "model_fingerprint",
    "quantize_fp8",
    "read_hidden_states",
    "resolve_drafter_layers",
    "resolve_layers",
    "settings_digest",
    "supervised_final_mask",
]
